#!/usr/bin/env bash
# Session 39, job 6 (H200): the portable one-pass backward (attention_bwd_generated_d128_bf16,
# causal bf16 b4 h16 n4096 d128) beside FlashAttention-2's backward kernel under ncu: duration,
# pipes, issue, occupancy, shared-memory wavefronts and the warp stall reasons per issued
# instruction.
# target/s39/fa2_bwd.py is copied as benches/results/h200-2026-11-28-s39-job6-fa2_bwd.py.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d); xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
m=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic
for r in wait short_scoreboard long_scoreboard barrier mio_throttle math_pipe_throttle not_selected selected lg_throttle dispatch_stall no_instruction branch_resolving membar; do
  m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_CASES="causal b=4 h=16 n=4096 d=128" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
  timeout 150 "$ncu" --clock-control none --kernel-name "regex:attention_bwd_generated" --launch-count 1 --metrics $m --csv "$work/bench" masked_attention > "$OUT/ours.csv" 2> "$OUT/ours.err"
echo "ncu ours rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
timeout 150 "$ncu" --clock-control none --kernel-name "regex:flash_bwd_dq_dk_dv" --launch-skip 2 --launch-count 1 --metrics $m --csv python3 target/s39/fa2_bwd.py > "$OUT/fa2.csv" 2> "$OUT/fa2.err"
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
