#!/usr/bin/env bash
# Session 47, job 3 (H200): the causal 8192 forward call by call (150 back to back after a 3 s
# pause, four runs: (q0, k0, v0), (q2, k0, v0), (q0, k0, v0), (q0, k1, v1)), portable then default
# kernels, with nvidia-smi sampling the SM clock, power and clock-event reasons every 20 ms.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s47b/probe.xz > "$work/probe"; chmod +x "$work/probe"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 20 > "$OUT/smi.csv" 2>&1 &
smi=$!
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k TIMELINE=1 COPIES=3 timeout 120 "$work/probe" > "$OUT/timeline-$k.log" 2>&1
  echo "timeline $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/timeline-$k.log" >> "$OUT/summary.txt"
done
kill $smi
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
