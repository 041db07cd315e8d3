#!/usr/bin/env bash
# Session 53, job 1 (kind nvidia-h200; the card it ran on is in gpu.txt): main (base) against two
# candidates for issue 18's documents row, and the checks of the second:
#   pf: each Hopper attention block asks the L2 for the first tiles of the block PREFETCH_AHEAD (32)
#       later (forward: its Q rows and first two K / V tiles; backward: its K / V tiles);
#   zw: pf, and the forward's zeroing warps start once both consumers hold their Q tiles.
# The attention tests (zw), the attention tests past 2^31 elements, memcheck / racecheck / synccheck
# over the attention tests (attention kernels instrumented), initcheck (every kernel, a process
# per test) over the three gradient tests that take the forward-zeroed dq accumulator; the A/B
# (scripts/ab-bench.sh, two rounds, issue 18's rows); PyTorch's anchors; ncu kernel times of the
# documents case for base and zw.
# Binaries: target/s53/{bench-base,bench-pf,bench-zw,test-zw}.xz (xz -6 of the release
# `cargo build --release --features cuda --bench ops --test ops` outputs), libs.sh as
# scripts/gpu-bundle.sh writes it. Carry target/s53; from the repo root:
#   OUT=DIR bash benches/results/h100-2026-12-07-s53-job1.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s53/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-base bench-zw test-zw; do xz -dc target/s53/$b.xz > "$work/$b" & done; wait; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
t() { # name, timeout, binary, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$name.log" | head -5 | tee -a "$OUT/summary.txt"
}
t attention 100 "$work/test-zw" attention:: --test-threads=4
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
(t scale 240 "$work/test-zw" scale::masked_attention --ignored --test-threads=1) &
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
  FASTOPS_TEST_LIGHT=1 timeout 170 "$san" --tool $tool --kernel-name kns=attention "${extra[@]}" --error-exitcode 9 "$work/test-zw" attention:: --test-threads=2 > "$OUT/san-$tool.log" 2>&1 &
done
for f in attention::second_backward_of_one_graph_matches_the_first attention::gradients_match_composed_attention attention::long_sequences_gradients_every_mask; do
  FASTOPS_TEST_LIGHT=1 timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-zw" "$f" --exact --test-threads=1 > "$OUT/san-initcheck-${f#attention::}.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do
  echo "$(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -1) | $(grep '^test result' "$f" | tail -1)" | cut -c1-200 | tee -a "$OUT/summary.txt"
done
echo "checks $SECONDS s" | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base="$work/bench-base" pf=target/s53/bench-pf.xz zw="$work/bench-zw" > /dev/null 2>&1
grep -v "packed\|projection\|token-major" "$OUT/ab/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "ab $SECONDS s" | tee -a "$OUT/summary.txt"
left=$((500 - SECONDS)); [ $left -gt 110 ] && left=110
[ $left -gt 30 ] && timeout $left python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
cut -c1-200 "$OUT/torch.jsonl" >> "$OUT/summary.txt" 2>/dev/null
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for b in base zw; do
  left=$((580 - SECONDS)); [ $left -gt 40 ] || break
  FASTOPS_BENCH_CASES="^documents" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
    timeout $left "$ncu" --clock-control none --kernel-name regex:"attention" --metrics gpu__time_duration.sum --csv "$work/bench-$b" masked_attention > "$OUT/ncu-$b.csv" 2>&1
  echo "ncu $b rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '^"[0-9]' "$OUT/ncu-$b.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 | head -16 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
