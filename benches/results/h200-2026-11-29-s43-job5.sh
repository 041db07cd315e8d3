#!/usr/bin/env bash
# Session 43, job 5 (H200; a `tuning` build): the portable one-pass backward's block order.
# FASTOPS_ATTENTION_PAIR_GROUP=G makes its blocks go G (batch, kv head) pairs at a time, key block
# by key block within a group (unset: all 64 pairs, key block by key block, as before). The
# attention tests through the portable kernels at G = 3 (a partial last group) and G = 1; then
# the bench's d128 cases through the portable kernels (no baselines) at each G, two rounds
# alternately.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for g in 3 1; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_ATTENTION_PAIR_GROUP=$g timeout 100 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-g$g.log" 2>&1
  echo "tests attention portable G=$g rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-g$g.log" | head -5 | tee -a "$OUT/summary.txt"
done
cases="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^documents"
for round in 1 2; do
  for g in all 1 4 8 16; do
    if [ $g = all ]; then unset FASTOPS_ATTENTION_PAIR_GROUP; else export FASTOPS_ATTENTION_PAIR_GROUP=$g; fi
    CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" timeout 100 "$work/bench-ops" masked_attention > "$OUT/bench-g$g-$round.log" 2>&1
    echo "bench G=$g round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "fwd+bwd" "$OUT/bench-g$g-$round.log" | cut -c20-110 | tee -a "$OUT/summary.txt"
  done
done
unset FASTOPS_ATTENTION_PAIR_GROUP
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
