#!/usr/bin/env bash
# Session 39, job 5 (final code: the portable forward in 64-key chunks at D <= 128, dq in 64-key
# chunks at D = 64): the bench's attention rows through the portable kernels against c64 (the
# forward change alone), alternately, two rounds; the attention tests through the portable and the
# default kernels; the > 2^31 test (portable); memcheck / racecheck / synccheck over the attention
# tests (portable forced).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 200 bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention c64=target/s39/c64/bench-ops.xz final=target/gpu-bundle/bin/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v round "$OUT/ab/ab-summary.txt" | cut -c1-230 | tee -a "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-portable.log" 2>&1
echo "scale portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-portable.log" | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 240 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
timeout 240 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::gradients_repeat_bit_for_bit --exact --test-threads=1 > "$OUT/san-initcheck-gradients_repeat_bit_for_bit.log" 2>&1 &
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
