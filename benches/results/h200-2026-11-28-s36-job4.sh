#!/usr/bin/env bash
# Session 36, job 4 (H200): issue 21's rows that owe an H200 figure. nnue_train at the issue's size,
# two rounds; the bench's small_fc_lopt, sparse_linear, masked_bmm and adamw sections; PyTorch's
# anchors for sparse_linear and masked_bmm in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-ops example-nnue_train; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for round in 1 2; do
  timeout 120 "$work/example-nnue_train" --inputs 22528 --hidden 1024 --batch 16384 --steps 300 > "$OUT/nnue-$round.log" 2>&1
  echo "nnue round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; tail -3 "$OUT/nnue-$round.log" | tee -a "$OUT/summary.txt"
done
FASTOPS_BENCH_OUT=$OUT/bench.jsonl timeout 330 "$work/bench-ops" small_fc_lopt sparse_linear masked_bmm adamw > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "^| \(small_fc\|sparse\|masked_bmm\|adamw\|optim\)" "$OUT/bench.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
timeout 100 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" sparse_linear masked_bmm > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/torch.jsonl" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
