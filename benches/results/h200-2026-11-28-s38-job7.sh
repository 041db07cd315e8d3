#!/usr/bin/env bash
# Session 38, job 7 (H200): the portable forward (causal, bf16 b4 h16 n8192 d128) beside
# SDPA flash's (FlashAttention-2) under ncu: duration, tensor pipe, issue, occupancy, DRAM, L2.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d); xz -dc target/s38/base/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
m=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__grid_size,launch__block_size
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_CASES="causal b=4 h=16 n=8192 d=128" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
  timeout 200 "$ncu" --clock-control none --kernel-name "regex:attention_fwd" --launch-count 1 --metrics $m --csv "$work/bench" masked_attention > "$OUT/ours.csv" 2> "$OUT/ours.err"
echo "ncu ours rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
timeout 200 "$ncu" --clock-control none --kernel-name "regex:flash_fwd" --launch-skip 2 --launch-count 1 --metrics $m --csv python3 target/s38/fa2_fwd.py > "$OUT/fa2.csv" 2> "$OUT/fa2.err"
echo "ncu fa2 rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
for f in ours fa2; do
python3 - "$OUT/$f.csv" "$f" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[2], "no rows"); sys.exit()
head = rows[0]; ix = {h: i for i, h in enumerate(head)}
for r in rows[1:]:
    print(sys.argv[2], r[ix["Kernel Name"]][:40], r[ix["Metric Name"]], r[ix["Metric Value"]])
PY
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
