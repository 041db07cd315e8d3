#!/usr/bin/env bash
# Session 47, job 2 (H200): the causal 8192 forward's two speeds against operand placement. The
# probe (examples/probe_s47.rs, carried compressed) times the forward on every pair of COPIES
# fresh q and k / v allocations in one process; three processes through the portable kernels,
# one through the default (Hopper) kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s47b/probe.xz > "$work/probe"; chmod +x "$work/probe"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for run in 1 2 3; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable COPIES=5 timeout 120 "$work/probe" > "$OUT/probe-portable-$run.log" 2>&1
  echo "probe portable $run rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/probe-portable-$run.log" >> "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=default COPIES=4 timeout 120 "$work/probe" > "$OUT/probe-default.log" 2>&1
echo "probe default rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/probe-default.log" >> "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
