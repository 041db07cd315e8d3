#!/usr/bin/env bash
# Session 39, job 4 (H200): the portable two-pass backward at D = 64 in whole 64-wide chunks (dq:
# keys, dk / dv: queries). c64: session 39's main (the forward change only); dq64: dq's chunk 64;
# bwd64: dq's and dk / dv's (this bundle's code). The bench's d=64 attention rows through the
# portable kernels, alternately, three rounds; then this bundle's attention tests (portable and
# default kernels), memcheck / racecheck / synccheck over them (portable), initcheck one test per
# process with every kernel instrumented.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
FASTOPS_BENCH_CASES="d=64" timeout 200 bash scripts/ab-bench.sh "$OUT/ab" 3 masked_attention c64=target/s39/c64/bench-ops.xz dq64=target/s39/dq64/bench-ops.xz bwd64=target/gpu-bundle/bin/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v round "$OUT/ab/ab-summary.txt" | cut -c1-230 | tee -a "$OUT/summary.txt"
unset CANDLE_FASTOPS_ATTENTION_KERNELS
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 300 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
for t in every_mask_kind_matches_the_reference gradients_repeat_bit_for_bit gradients_match_composed_attention; do
  timeout 300 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::$t --exact --test-threads=1 > "$OUT/san-initcheck-$t.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
