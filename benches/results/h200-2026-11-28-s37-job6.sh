#!/usr/bin/env bash
# Session 37, job 6 (H200, the final bundle): the bench's masked_bmm section with its candle
# baselines, then PyTorch's masked_bmm anchors in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
FASTOPS_BENCH_OUT=$OUT/bench.jsonl timeout 200 "$work/bench" masked_bmm > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "^| masked_bmm" "$OUT/bench.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
timeout 100 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_bmm > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/torch.jsonl" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
