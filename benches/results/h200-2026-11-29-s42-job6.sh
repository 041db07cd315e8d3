#!/usr/bin/env bash
# Session 42, job 6 (H200; the final code): the bench's attention rows through the portable
# (forced) and the default kernels with the composite baselines, then PyTorch's anchors in the
# same job (issue 17 / 18's rows after this session's stride change to every kernel).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_OUT=$OUT/bench-$k.jsonl timeout 250 "$work/bench-ops" masked_attention > "$OUT/bench-$k.log" 2>&1
  echo "bench $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "b=4" "$OUT/bench-$k.log" | cut -c20-220 | tee -a "$OUT/summary.txt"
done
timeout 250 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
