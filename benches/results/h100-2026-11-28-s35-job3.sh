#!/usr/bin/env bash
# Session 35, job 3 (final code): attention tests (portable, default), the > 2^31 test (portable and
# default), memcheck / racecheck / synccheck over the attention tests and initcheck over the
# gradient tests (portable forced), then the bench's d=128 rows through the default kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L > "$OUT/gpu.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 120 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-$k.log" 2>&1
  echo "scale $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k.log" | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck synccheck initcheck; do
  extra=(); filter=attention::; [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  [ $tool = initcheck ] && filter=attention::gradients
  timeout 300 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" $filter --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck synccheck initcheck; do echo "$tool: $(grep -E 'SUMMARY' $OUT/san-$tool.log | tail -1) | $(grep 'test result' $OUT/san-$tool.log | tail -1)" | tee -a "$OUT/summary.txt"; done
unset FASTOPS_TEST_LIGHT CANDLE_FASTOPS_ATTENTION_KERNELS
FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench-default.jsonl "$work/bench-ops" masked_attention > "$OUT/bench-default.log" 2>&1
echo "bench default rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "d=128" "$OUT/bench-default.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
