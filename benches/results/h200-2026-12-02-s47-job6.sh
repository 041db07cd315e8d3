#!/usr/bin/env bash
# Session 47, job 6 (H200): the final code (kernels as main; the bench and the anchors warm up to
# the steady state by default). The attention tests through the default and the portable kernels
# (alone), the attention tests past 2^31 elements through both, gpt_train on CUDA, and the bench's
# causal 4096 case with its default warm-up.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops example-gpt_train; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
# gpt_train reads the crate's sources from where it was built.
[ -d /work/main/src ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 100 "$work/test-ops" scale::masked_attention --ignored --test-threads=1 > "$OUT/tests-scale-$k.log" 2>&1
  echo "tests scale::masked_attention (past 2^31) $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-scale-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
timeout 150 "$work/example-gpt_train" --steps 40 --layers 4 --batch 16 --seq 256 > "$OUT/gpt_train.log" 2>&1
echo "gpt_train rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; (head -5 "$OUT/gpt_train.log"; tail -5 "$OUT/gpt_train.log") | cut -c1-200 | tee -a "$OUT/summary.txt"
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=4096 d=128" timeout 100 "$work/bench-ops" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "b=4" "$OUT/bench.log" | awk -F'|' '{printf "%-50s %s\n", $3, $6}' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
