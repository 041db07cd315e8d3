#!/usr/bin/env bash
# Session 36, job 5 (final code: bwd_tc's row loops through per_row, whitespace in sm90): attention
# tests (portable, default), memcheck over them (portable), and an A/B of the bench's d=128 rows
# (portable forced) against job 1's binary (prev), one round each, alternately.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-new"
xz -dc target/s36/prev/bench-ops.xz > "$work/bench-prev"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 200 "$san" --tool memcheck --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-memcheck.log" 2>&1
echo "memcheck rc=$? $(grep 'ERROR SUMMARY' $OUT/san-memcheck.log | tail -1) | $(grep 'test result' $OUT/san-memcheck.log | tail -1)" | tee -a "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1
for v in prev new; do
  FASTOPS_BENCH_CASES="d=128" timeout 150 "$work/bench-$v" masked_attention > "$OUT/ab-$v.log" 2>&1
  echo "ab $v rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "d=128" "$OUT/ab-$v.log" | grep -v determin | cut -c20-110 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
