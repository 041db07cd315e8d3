#!/usr/bin/env bash
# Session 47, job 5 (H200, a fresh machine): job 4's steady-state comparison again, four rounds
# of our bench (portable kernels, causal 4096 / 8192 d128) then SDPA flash (fa2_steady.py).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work/bench-ops"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_WARM_MS=600
for round in 1 2 3 4; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128" \
    timeout 120 "$work/bench-ops" masked_attention > "$OUT/bench-portable-$round.log" 2>&1
  echo "bench portable round $round rc=$? $SECONDS s" >> "$OUT/summary.txt"
  grep -E "n=(4096|8192) d=128 (forward|fwd\+bwd) " "$OUT/bench-portable-$round.log" | awk -F'|' '{printf "ours %-45s %s\n", $3, $6}' >> "$OUT/summary.txt"
  timeout 120 python3 target/s47c/fa2_steady.py > "$OUT/fa2-$round.log" 2>&1
  echo "fa2 round $round rc=$? $SECONDS s" >> "$OUT/summary.txt"; cat "$OUT/fa2-$round.log" >> "$OUT/summary.txt"
done
echo "done $SECONDS s" >> "$OUT/summary.txt"
rm -f "$OUT"/*.log
