#!/usr/bin/env bash
# Session 47, job 7 (H200): issue 21's GPU rows with the bench's steady-state warm-up (500 ms):
# masked_bmm, small_fc_lopt and sparse_linear, ours only.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work/bench-ops"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for op in masked_bmm small_fc_lopt; do
  FASTOPS_BENCH_NO_BASELINE=1 timeout 70 "$work/bench-ops" $op > "$OUT/bench-$op.log" 2>&1
  echo "bench $op rc=$? $SECONDS s" >> "$OUT/summary.txt"
  grep "| cuda |" "$OUT/bench-$op.log" | awk -F'|' '{printf "%-70s %-5s %s\n", $3, $4, $6}' >> "$OUT/summary.txt"
done
echo "done $SECONDS s" >> "$OUT/summary.txt"
rm -f "$OUT"/bench-*.log
