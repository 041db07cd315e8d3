#!/usr/bin/env bash
# Session 35, job 4: initcheck with every kernel instrumented (candle's too: with only the crate's
# kernels instrumented, memory written by candle's kernels reads as uninitialized), portable forced,
# over attention tests that reach the one-pass backward, each test on its own.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for t in gradients_repeat_bit_for_bit queries_before_the_keys_have_zero_gradients rows_that_see_no_key_are_zero gradients_match_composed_attention; do
  timeout 330 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::$t --exact --test-threads=1 > "$OUT/initcheck-$t.log" 2>&1 &
done
wait
for t in gradients_repeat_bit_for_bit queries_before_the_keys_have_zero_gradients rows_that_see_no_key_are_zero gradients_match_composed_attention; do
  echo "$t: $(grep -E 'SUMMARY' $OUT/initcheck-$t.log | tail -1) | $(grep 'test result' $OUT/initcheck-$t.log | tail -1)" | tee -a "$OUT/summary.txt"
  grep -E "Device Frame|Host API" "$OUT/initcheck-$t.log" | sort | uniq -c | sort -rn | head -5 | tee -a "$OUT/summary.txt"
done
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
