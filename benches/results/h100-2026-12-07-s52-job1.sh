#!/usr/bin/env bash
# Session 52, job 1 (H200): issue 18's documents row, three kernel variants against main (base):
#   f1: session 51's two units a block (benches/results/h200-2026-12-07-s51-two-unit.diff);
#   f2: main + the Hopper forward's idle producer warps zeroing the backward's dq accumulator when
#       gradients are tracked (the backward's memset then skipped);
#   f3: both.
# Tests (f3 with pairing forced, f2 by default, the attention tests past 2^31 on f3, the masked_bmm
# backward tests on f2), the A/B (scripts/ab-bench.sh, two rounds, documents and causal 4096 d128),
# memcheck / racecheck on f3 (pairing forced) and initcheck on f2 over the attention tests (the
# crate's attention kernels only), ncu kernel times of base and f3.
# Binaries: target/s52/{bench-base,bench-f1,bench-f2,bench-f3,test-f2,test-f3}.xz (xz -6 of the
# release `cargo build --release --features cuda --bench ops --test ops` outputs); libs.sh as
# scripts/gpu-bundle.sh writes it. Carry target/s52; run from the repo root:
#   OUT=DIR bash benches/results/h100-2026-12-07-s52-job1.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s52/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-base bench-f1 bench-f2 bench-f3 test-f2 test-f3; do xz -dc target/s52/$b.xz > "$work/$b" & done; wait; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
t() { # name, timeout, binary, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$name.log" | head -5 | tee -a "$OUT/summary.txt"
}
t f3-paired 150 env CANDLE_FASTOPS_ATTENTION_PAIRS=1 "$work/test-f3" attention:: --test-threads=4
t f2-default 100 "$work/test-f2" attention:: --test-threads=4
t f3-scale 60 env CANDLE_FASTOPS_ATTENTION_PAIRS=1 "$work/test-f3" scale::masked_attention --ignored --test-threads=1
t f2-mbmm 60 "$work/test-f2" masked_bmm_backward --test-threads=4
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base="$work/bench-base" f1="$work/bench-f1" f2="$work/bench-f2" f3="$work/bench-f3" > /dev/null 2>&1
grep -v "packed\|projection\|token-major" "$OUT/ab/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "ab $SECONDS s" | tee -a "$OUT/summary.txt"
unset FASTOPS_BENCH_CASES
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
left=$((500 - SECONDS)); [ $left -gt 100 ] && left=100
if [ $left -gt 45 ]; then
  export FASTOPS_TEST_LIGHT=1
  for tool in memcheck racecheck; do
    extra=(--kernel-name kns=attention_bwd_sm90 --kernel-name kns=attention_fwd_sm90); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
    CANDLE_FASTOPS_ATTENTION_PAIRS=1 timeout $left "$san" --tool $tool "${extra[@]}" --error-exitcode 9 "$work/test-f3" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
  done
  timeout $left "$san" --tool initcheck --kernel-name regex:attention --error-exitcode 9 "$work/test-f2" attention:: --test-threads=2 > "$OUT/san-initcheck.log" 2>&1 &
  wait
  for tool in memcheck racecheck initcheck; do
    echo "$tool: $(grep -E 'SUMMARY' "$OUT/san-$tool.log" | tail -1) | $(grep '^test result' "$OUT/san-$tool.log" | tail -1)" | tee -a "$OUT/summary.txt"
  done
fi
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in base f3; do
  [ $SECONDS -lt 540 ] || break
  FASTOPS_BENCH_CASES="^documents" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
    timeout 25 "$ncu" --clock-control none --kernel-name regex:"attention|memset|fill" --metrics gpu__time_duration.sum --csv "$work/bench-$v" masked_attention > "$OUT/ncu-$v.csv" 2>&1
  echo "ncu $v rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '^"[0-9]' "$OUT/ncu-$v.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 | head -16 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
