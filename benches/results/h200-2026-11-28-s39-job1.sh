#!/usr/bin/env bash
# Session 39, job 1 (H200): the portable forward with 64-key chunks (each Q fragment read from
# shared memory serves 64 keys, not 32). base: main's bench; c64: chunk 64 at D <= 128; c64d64:
# chunk 64 at D = 64 only. The bench's masked_attention section through the portable kernels,
# alternately, three rounds.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
timeout 570 bash scripts/ab-bench.sh "$OUT/ab" 3 masked_attention base=target/s38/base/bench-ops.xz c64=target/s39/c64/bench-ops.xz c64d64=target/s39/c64d64/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cut -c1-230 "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
