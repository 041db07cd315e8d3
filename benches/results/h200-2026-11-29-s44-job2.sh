#!/usr/bin/env bash
# Session 44, job 2 (H200): where the explicit fwd+bwd's time goes (the Hopper kernels, causal
# bf16 b4 h16 d128): examples/attn_explicit_probe.rs (kept as
# benches/results/h200-2026-11-29-s44-job2-probe.rs) at n = 8192 and 4096, then at 8192 through
# the portable kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s44/probe.xz > "$work/probe"; chmod +x "$work/probe"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for n in 8192 4096; do
  N=$n timeout 200 "$work/probe" > "$OUT/probe-$n.log" 2>&1
  echo "probe default n=$n rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/probe-$n.log" | tee -a "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable N=8192 timeout 200 "$work/probe" > "$OUT/probe-portable.log" 2>&1
echo "probe portable n=8192 rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/probe-portable.log" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
