#!/usr/bin/env bash
# Session 44, job 1 (H200): this session's code (CPU loops at the CPU's vector width; pulp's
# x86-v3 feature now on, which gemm shares). Every GPU test of test-ops (default kernels), the
# attention tests through the portable kernels; then ncu's full section set of one launch of
# the portable one-pass backward at causal 8192 d128 (pair groups of 4) and of the Hopper
# backward on documents of 1024 at 8192 (runs), for the record of what bounds each.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 300 "$work/test-ops" --test-threads=4 > "$OUT/tests-all.log" 2>&1
echo "tests all (default kernels) rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-all.log" | head -8 | tee -a "$OUT/summary.txt"
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-portable.log" 2>&1
echo "tests attention portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-portable.log" | head -5 | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1
keys="\"Duration\|Achieved Occupancy\|Registers Per\|DRAM Throughput\|L2 Hit\|L1/TEX Hit\|Issue Slots Busy\|Executed Ipc A\|Theoretical Occ\|Compute (SM) Th\|Memory Throughput\|Dynamic Shared\|Stall\|Warp Cycles\|Eligible\|No Eligible\|Active Warps\|Tensor\|dram__bytes"
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" NCU_ARGS="--set full --csv --page details" \
  timeout 200 bash target/gpu-bundle/profile.sh "$OUT/portable" 'attention_bwd_generated_d128_bf16' 0 1 masked_attention > "$OUT/portable.log" 2>&1
echo "ncu portable one-pass backward rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i "$keys" "$OUT/portable/profile.csv" | cut -c1-240 | tee -a "$OUT/summary.txt"
FASTOPS_BENCH_CASES="^documents 1024 causal b=4 h=16 n=8192 d=128" NCU_ARGS="--set full --csv --page details" \
  timeout 200 bash target/gpu-bundle/profile.sh "$OUT/hopper-docs" 'attention_bwd_sm90_runs_d128_bf16' 0 1 masked_attention > "$OUT/hopper-docs.log" 2>&1
echo "ncu Hopper documents backward rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i "$keys" "$OUT/hopper-docs/profile.csv" | cut -c1-240 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
