#!/usr/bin/env bash
# Session 33, job 7 (work in progress, not in main): the 8-warp portable backward (FA2's layout).
# Attention tests through the portable kernels, memcheck and racecheck over them, then the bench
# twice (its fwd+bwd row is the 8-warp backward, its "vs deterministic" row the two-pass one).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s33/wip/test-ops.xz > "$work/test-ops"; xz -dc target/s33/wip/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
nvidia-smi -L > "$OUT/gpu.txt"
"$work/test-ops" attention:: --test-threads=1 > "$OUT/tests.log" 2>&1
echo "tests rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests.log" | head -5 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for tool in memcheck racecheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 250 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck; do echo "$tool: $(grep -E 'SUMMARY' $OUT/san-$tool.log | tail -1) | $(grep 'test result' $OUT/san-$tool.log | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "sanitizers done $SECONDS s" | tee -a "$OUT/summary.txt"
unset FASTOPS_TEST_LIGHT
for r in 1 2; do
  FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench-$r.jsonl "$work/bench-ops" masked_attention > "$OUT/bench-$r.log" 2>&1
  echo "bench $r rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "fwd+bwd" "$OUT/bench-$r.log" | tee -a "$OUT/summary.txt"
done
