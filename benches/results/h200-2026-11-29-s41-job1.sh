#!/usr/bin/env bash
# Session 41, job 1 (H200): where masked_bmm's f32 span products (the backward) go, main's code
# (session 40's final bundle). ncu's full section set of the two span products of one f32 fwd+bwd
# call (b=64 2048 k=64), and the SASS-level source counters of the first (grad_a); then the bench's
# masked_bmm section once.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1
NCU_ARGS="--set full --csv --page details" \
  timeout 200 bash target/gpu-bundle/profile.sh "$OUT/full" 'span_matmul_tf32x3' 0 2 masked_bmm > "$OUT/full.log" 2>&1
echo "ncu full rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i "\"Duration\|Achieved Occupancy\|Registers Per\|DRAM Throughput\|L2 Hit\|L1/TEX Hit\|Issue Slots Busy\|Executed Ipc A\|Theoretical Occ\|Block Limit\|Compute (SM) Th\|Memory Throughput\|Waves Per SM\|Dynamic Shared\|Stall\|Warp Cycles\|Max Bandwidth\|L2 Compression\|Mem Busy\|Mem Pipes\|Eligible\|No Eligible\|Active Warps" "$OUT/full/profile.csv" | cut -c1-240 | tee -a "$OUT/summary.txt"
SASS=1 timeout 200 bash target/gpu-bundle/profile.sh "$OUT/sass" 'span_matmul_tf32x3' 0 1 masked_bmm > "$OUT/sass.log" 2>&1
echo "ncu sass rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
unset FASTOPS_BENCH_CALLS
work=$(mktemp -d); xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
timeout 120 "$work/bench" masked_bmm > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "^| masked_bmm" "$OUT/bench.log" | cut -c1-110 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
