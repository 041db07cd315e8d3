#!/usr/bin/env bash
# Session 43, job 6 (H200; the final code: the one-pass backward four pairs at a time by default).
# The attention tests through the default and the portable kernels, memcheck over the portable
# gradient tests beside them; then the bench's attention section both ways (with each case's
# explicit fwd+bwd) and PyTorch's anchors in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_TEST_LIGHT=1 timeout 170 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention::long_sequences_gradients_every_mask attention::explicit --test-threads=2 > "$OUT/san-memcheck-portable.log" 2>&1 &
sanpid=$!
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
wait $sanpid
f="$OUT/san-memcheck-portable.log"; echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1) $SECONDS s" | tee -a "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_OUT=$OUT/bench-$k.jsonl timeout 170 "$work/bench-ops" masked_attention > "$OUT/bench-$k.log" 2>&1
  echo "bench $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "b=4" "$OUT/bench-$k.log" | cut -c20-220 | tee -a "$OUT/summary.txt"
done
timeout 120 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
