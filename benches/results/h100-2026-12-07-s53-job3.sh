#!/usr/bin/env bash
# Session 53, job 3 (kind nvidia-h200; the card it ran on is in gpu.txt): issue 18's rows on the
# final code (bench-fp32 of job 2: the forward prefetch), the bench's masked_attention section
# with the candle baselines where they fit, then PyTorch's anchors, as "At a glance" takes them.
# Binary: target/s53/bench-fp32.xz; libs.sh as scripts/gpu-bundle.sh writes it. Carry target/s53:
#   OUT=DIR bash benches/results/h100-2026-12-07-s53-job3.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s53/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s53/bench-fp32.xz > "$work/bench" && chmod +x "$work/bench"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64"
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_OUT="$OUT/ops.jsonl" timeout 200 "$work/bench" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "masked_attention" "$OUT/bench.log" | grep -v "packed\|projection\|token-major" | cut -c1-150 | tee -a "$OUT/summary.txt"
timeout 150 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -v "bool mask" "$OUT/torch.jsonl" | cut -c1-200 >> "$OUT/summary.txt" 2>/dev/null
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
