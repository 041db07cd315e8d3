#!/usr/bin/env bash
# Session 40, job 6 (H200; the final code: the delta pass of job 2 and dq_rows of job 5): the bench's attention
# rows through the portable (forced) and the default kernels with the composite baselines, then
# PyTorch's anchors in the same job; then the > 2^31 test both ways, and memcheck / synccheck over
# the attention tests (attention kernels instrumented) and initcheck on two gradient tests, with
# the portable and the default kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_OUT=$OUT/bench-$k.jsonl timeout 200 "$work/bench-ops" masked_attention > "$OUT/bench-$k.log" 2>&1
  echo "bench $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "b=4" "$OUT/bench-$k.log" | cut -c20-200 | tee -a "$OUT/summary.txt"
done
timeout 200 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | tee -a "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-$k.log" 2>&1
  echo "scale $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k.log" | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  for tool in memcheck synccheck; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool $tool --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool-$k.log" 2>&1 &
  done
  for t in gradients_match_composed_attention queries_before_the_keys_have_zero_gradients; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::$t --exact --test-threads=1 > "$OUT/san-initcheck-$t-$k.log" 2>&1 &
  done
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
