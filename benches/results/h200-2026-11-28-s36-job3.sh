#!/usr/bin/env bash
# Session 36, job 3 (final code): the > 2^31 test (portable and default); memcheck / racecheck /
# synccheck over the attention tests (portable forced; only the crate's attention kernels
# instrumented) and initcheck one gradient test per process with every kernel instrumented.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-$k.log" 2>&1
  echo "scale $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k.log" | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 330 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
for t in gradients_match_composed_attention gradients_repeat_bit_for_bit rows_that_see_no_key_are_zero; do
  timeout 330 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::$t --exact --test-threads=1 > "$OUT/san-initcheck-$t.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
