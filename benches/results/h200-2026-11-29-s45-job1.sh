#!/usr/bin/env bash
# Session 45, job 1 (H200): the portable one-pass backward with one barrier per query tile
# (Swizzled128 tiles, three Q / dO stages, two P / dS buffers). The attention tests through the
# portable kernels (where the one-pass kernel runs on an H200) and the default ones; then A/B:
# the bench built from main before the change (bench-base) and this one, portable forced, no
# baselines, two rounds alternately; then racecheck, synccheck and memcheck over the portable
# gradient tests with the one-pass kernels instrumented.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done
xz -dc target/s45/bench-base.xz > "$work/bench-base"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -6 | tee -a "$OUT/summary.txt"
done
cases="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^documents"
for round in 1 2; do
  for bin in bench-base bench-ops; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" timeout 120 "$work/$bin" masked_attention > "$OUT/$bin-$round.log" 2>&1
    echo "$bin round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "forward\|fwd+bwd" "$OUT/$bin-$round.log" | grep -v "vs deterministic\|packed\|projection\|token-major" | cut -c1-105 | tee -a "$OUT/summary.txt"
  done
done
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
for tool in racecheck synccheck memcheck; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 240 "$san" --tool $tool --kernel-name regex:attention_bwd --error-exitcode 3 \
    "$work/test-ops" attention::gradients_match_composed attention::long_sequences_gradients attention::queries_before_the_keys --test-threads=1 > "$OUT/$tool.log" 2>&1
  echo "$tool portable bwd rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "ERROR SUMMARY\|RACECHECK SUMMARY\|test result" "$OUT/$tool.log" | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
