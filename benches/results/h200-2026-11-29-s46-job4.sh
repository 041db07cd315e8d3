#!/usr/bin/env bash
# Session 46, job 4 (H200; the final code, job 3's bundle): the attention tests through the
# default and the portable kernels (job 3 ran them beside the sanitizers, which starved them past
# their limit); then the causal 8192 rows alone, the portable kernels (six bench processes) and
# SDPA flash (target/s46/fa2_8192.py, copied as h200-2026-11-29-s46-job4-fa2_8192.py; one process
# a round, two rounds on fresh operands each) alternately.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
for round in 1 2 3; do
  for half in a b; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" timeout 60 "$work/bench-ops" masked_attention > "$OUT/bench-$round$half.log" 2>&1
    echo "bench portable $round$half rc=$? $SECONDS s: $(grep 'n=8192 d=128 forward \|n=8192 d=128 fwd+bwd ' "$OUT/bench-$round$half.log" | awk -F'|' '{printf "%s%s ", $3, $6}')" | tee -a "$OUT/summary.txt"
  done
  timeout 60 python3 target/s46/fa2_8192.py 2 > "$OUT/fa2-$round.jsonl" 2> "$OUT/fa2-$round.err"
  echo "fa2 round $round rc=$? $SECONDS s: $(tr '\n' ' ' < "$OUT/fa2-$round.jsonl")" | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
