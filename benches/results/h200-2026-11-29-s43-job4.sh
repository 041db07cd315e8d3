#!/usr/bin/env bash
# Session 43, job 4 (H200; the final code): the attention tests through the default and the
# portable kernels (masked_attention_backward, masked_attention_combine and the split-key test
# included); the attention test past 2^31 elements (now with the backward as a function too)
# both ways; memcheck over the new tests both ways, initcheck on the combine test. (The bench's
# attention rows of this code's kernels are job 1's.)
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 120 "$work/test-ops" scale::masked_attention_past_2_31 --exact --ignored --test-threads=1 > "$OUT/scale-$k.log" 2>&1
  echo "scale::masked_attention_past_2_31 $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k.log" | head -3 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention::explicit attention::split attention::parts --test-threads=2 > "$OUT/san-memcheck-$k.log" 2>&1 &
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::parts_combine_to_the_whole_forward --exact --test-threads=1 > "$OUT/san-initcheck-combine-$k.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
