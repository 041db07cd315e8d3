#!/usr/bin/env bash
# Session 40, job 1 (H200): the portable backward's blocks head by head. base: main's bench;
# v1: the one-pass backward (head tile 128) takes key blocks head by head (key block fastest,
# as FlashAttention-2 and the Hopper backward do); v2: v1 and the dk / dv kernel of the two-pass
# backward (D = 64, 256, deterministic mode) head by head too. The masked_attention section
# through the portable kernels, alternately, three rounds.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
timeout 570 bash scripts/ab-bench.sh "$OUT/ab" 3 masked_attention base=target/s40/base/bench-ops.xz v1=target/s40/v1/bench-ops.xz v2=target/s40/v2/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cut -c1-230 "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
