#!/usr/bin/env bash
# Session 38, job 8 (H200): the portable query-tile kernels' block order (forward, dq): groups of
# heads sized to QUERY_GROUP_WAVES waves of resident blocks, longest first within a group. main
# (base: every head at once, longest first), w0 (a head at a time), w1, w3; the bench's
# masked_attention section through the portable kernels, alternately, three rounds.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
timeout 560 bash scripts/ab-bench.sh "$OUT/ab" 3 masked_attention base=target/s38/base/bench-ops.xz w0=target/s38/w0/bench-ops.xz w1=target/s38/w1/bench-ops.xz w3=target/s38/w3/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cut -c1-230 "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
