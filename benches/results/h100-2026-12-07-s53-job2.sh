#!/usr/bin/env bash
# Session 53, job 2 (kind nvidia-h200; the card it ran on is in gpu.txt): the Hopper forward's
# prefetch alone (job 1's backward prefetch dropped), at three distances, against main (base):
#   fpN: each Hopper forward block's idle producer warps ask the L2 for the Q rows and first two
#        K / V tiles of the block N later (N = 12, 32, 96).
# Checks on fp32 (the candidate): the attention tests, the attention tests past 2^31 elements,
# memcheck / racecheck / synccheck over the attention tests (attention kernels instrumented),
# initcheck (every kernel, a process per test) over the three gradient tests; the A/B
# (scripts/ab-bench.sh, two rounds, issue 18's rows); PyTorch's anchors; ncu times of every
# kernel (candle's included) of one documents fwd+bwd call through candle's autograd.
# Binaries: target/s53/{bench-base,bench-fp12,bench-fp32,bench-fp96,test-fp32}.xz (xz -6 of the
# release `cargo build --release --features cuda --bench ops --test ops` outputs), libs.sh as
# scripts/gpu-bundle.sh writes it. Carry target/s53; from the repo root:
#   OUT=DIR bash benches/results/h100-2026-12-07-s53-job2.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s53/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-base bench-fp12 bench-fp32 bench-fp96 test-fp32; do xz -dc target/s53/$b.xz > "$work/$b" & done; wait; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
t() { # name, timeout, binary, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$name.log" | head -5 | tee -a "$OUT/summary.txt"
}
t attention 100 "$work/test-fp32" attention:: --test-threads=4
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
(t scale 200 "$work/test-fp32" scale::masked_attention --ignored --test-threads=1) &
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
  FASTOPS_TEST_LIGHT=1 timeout 170 "$san" --tool $tool --kernel-name kns=attention "${extra[@]}" --error-exitcode 9 "$work/test-fp32" attention:: --test-threads=2 > "$OUT/san-$tool.log" 2>&1 &
done
for f in attention::second_backward_of_one_graph_matches_the_first attention::gradients_match_composed_attention attention::long_sequences_gradients_every_mask; do
  FASTOPS_TEST_LIGHT=1 timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-fp32" "$f" --exact --test-threads=1 > "$OUT/san-initcheck-${f#attention::}.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do
  echo "$(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -1) | $(grep '^test result' "$f" | tail -1)" | cut -c1-200 | tee -a "$OUT/summary.txt"
done
echo "checks $SECONDS s" | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base="$work/bench-base" fp12="$work/bench-fp12" fp32="$work/bench-fp32" fp96="$work/bench-fp96" > /dev/null 2>&1
grep -v "packed\|projection\|token-major\|vs deterministic\|vs dq zeroed" "$OUT/ab/ab-summary.txt" | cut -c1-220 | tee -a "$OUT/summary.txt"
echo "ab $SECONDS s" | tee -a "$OUT/summary.txt"
left=$((500 - SECONDS)); [ $left -gt 110 ] && left=110
[ $left -gt 30 ] && timeout $left python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep Flex "$OUT/torch.jsonl" | cut -c1-200 >> "$OUT/summary.txt" 2>/dev/null
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
left=$((585 - SECONDS))
if [ $left -gt 30 ]; then
  # Every kernel of the documents rows (forward, fwd+bwd through autograd, ...), one call each.
  FASTOPS_BENCH_CASES="^documents" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
    timeout $left "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv "$work/bench-fp32" masked_attention > "$OUT/ncu-all.csv" 2>&1
  echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '^"[0-9]' "$OUT/ncu-all.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 | head -40 | tee -a "$OUT/summary.txt"
fi
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
