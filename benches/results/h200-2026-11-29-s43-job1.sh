#!/usr/bin/env bash
# Session 43, job 1 (H200): masked_attention_backward (the backward as a function). The attention
# tests through the default and the portable kernels; the bench's attention section both ways
# (each case's "fwd+bwd, explicit backward" against the autograd fwd+bwd in the same run), then
# PyTorch's anchors in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_OUT=$OUT/bench-$k.jsonl timeout 200 "$work/bench-ops" masked_attention > "$OUT/bench-$k.log" 2>&1
  echo "bench $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "b=4" "$OUT/bench-$k.log" | cut -c20-220 | tee -a "$OUT/summary.txt"
done
timeout 150 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
