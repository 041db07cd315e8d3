#!/usr/bin/env bash
# Session 34, job 2: the one-pass backward as landed. Attention tests through the portable and the
# default kernels, the > 2^31 test through the portable ones, the four sanitizers over the
# attention tests (portable forced), then the bench's d=128 rows (fwd+bwd: one pass; "vs
# deterministic": the two-pass backward).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L > "$OUT/gpu.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 120 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale.log" 2>&1
echo "scale portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale.log" | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck initcheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 260 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck initcheck synccheck; do echo "$tool: $(grep -E 'SUMMARY' $OUT/san-$tool.log | tail -1) | $(grep 'test result' $OUT/san-$tool.log | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "sanitizers done $SECONDS s" | tee -a "$OUT/summary.txt"
unset FASTOPS_TEST_LIGHT
FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench.jsonl "$work/bench-ops" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "fwd+bwd" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
