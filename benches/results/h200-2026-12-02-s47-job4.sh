#!/usr/bin/env bash
# Session 47, job 4 (H200): the attention rows in the board's steady state (FASTOPS_BENCH_WARM_MS
# = 600: calls go on until 600 ms of load before the timed ones, ours and PyTorch's alike). Three
# rounds of: our bench (portable kernels, causal 4096 / 8192 d128) then SDPA flash (fa2_steady.py,
# fresh operands); then our bench through the default kernels (every attention case) and
# scripts/torch_anchors.py masked_attention, both steady.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work/bench-ops"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_WARM_MS=600
for round in 1 2 3; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128" \
    timeout 120 "$work/bench-ops" masked_attention > "$OUT/bench-portable-$round.log" 2>&1
  echo "bench portable round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E "n=(4096|8192) d=128 (forward|fwd\+bwd) " "$OUT/bench-portable-$round.log" | cut -c1-80 | tee -a "$OUT/summary.txt"
  timeout 120 python3 target/s47c/fa2_steady.py > "$OUT/fa2-$round.log" 2>&1
  echo "fa2 round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/fa2-$round.log" | tee -a "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=default FASTOPS_BENCH_OUT=$OUT/bench-default.jsonl FASTOPS_BENCH_NO_BASELINE=1 \
  FASTOPS_BENCH_CASES="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^documents,^causal b=4 h=16 n=4096 d=64" \
  timeout 150 "$work/bench-ops" masked_attention > "$OUT/bench-default.log" 2>&1
echo "bench default rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/bench-default.log" | grep -v "packed\|projection\|token-major" | cut -c1-80 | tee -a "$OUT/summary.txt"
timeout $((585 - SECONDS)) python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | grep -v "bool mask" | sed 's/"op": "masked_attention", //' | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
