#!/usr/bin/env bash
# Session 48, job 5 (H200): what the split's proxy fence costs the Hopper grad_a span kernel
# (v4: cp.async copies of each thread's own chunks into raw stages, split into separate
# buffers): the same kernel with and without fence.proxy.async (FASTOPS_SPAN_FENCE=0, a timing
# study: not a correct kernel), ncu times and issue / warp / DRAM figures of one call a case.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for fence in 1 0; do
  FASTOPS_SPAN_FENCE=$fence FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 150 "$ncu" --kernel-name regex:"span_grad" --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio --csv "$work/bench" masked_bmm > "$OUT/ncu-fence$fence.csv" 2>&1
  echo "ncu fence=$fence rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '"span' "$OUT/ncu-fence$fence.csv" | awk -F'","' '{print $5, $(NF-2), $(NF)}' | sed 's/"//g' | cut -c1-140 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
