#!/usr/bin/env bash
# Session 55, job 4 (kind nvidia-h200; the card it ran on is in gpu.txt): the final code's issue-18
# rows (the bench's masked_attention section, ours only) and small_fc_lopt's step rows, then
# PyTorch's attention anchors in the same job. Carry target/gpu-bundle (scripts/gpu-bundle.sh
# test-ops bench-ops at the session's final code):
#   OUT=DIR bash benches/results/h100-2026-12-07-s55-job4.sh
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench" && chmod +x "$work/bench"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64,354M/289 step (fused),152M/97 step (fused)"
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_OUT="$OUT/ops.jsonl" timeout 200 "$work/bench" masked_attention small_fc_lopt > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -E "masked_attention|small_fc_lopt" "$OUT/bench.log" | grep -v "packed\|projection\|token-major" | cut -c1-150 | tee -a "$OUT/summary.txt"
timeout 170 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -v "bool mask" "$OUT/torch.jsonl" | cut -c1-200 | tee -a "$OUT/summary.txt" 2>/dev/null
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
