#!/usr/bin/env bash
# Session 43, job 8 (H200; the final code): a second same-run measurement of issue 17's causal
# rows through the portable kernels (autograd and explicit fwd+bwd), then PyTorch's anchors.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_OUT=$OUT/bench-portable.jsonl FASTOPS_BENCH_CASES="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128" timeout 120 "$work/bench-ops" masked_attention > "$OUT/bench-portable.log" 2>&1
echo "bench portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/bench-portable.log" | grep -v -E "packed|qkv|token" | cut -c20-200 | tee -a "$OUT/summary.txt"
timeout 130 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "causal b=4 h=16 n=[48]..2 d=128" "$OUT/torch.jsonl" | grep "SDPA flash" | sed 's/"op": "masked_attention", //' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
