#!/usr/bin/env bash
# Session 48, job 6 (H200): the final code (the Hopper grad_a span kernel as landed: cp.async of
# each thread's own chunks into padded raw stages, split into separate buffers). Every test of
# test-ops (default kernels), the matmul tests through the portable kernels, masked_bmm past 2^31
# through both, memcheck / racecheck / synccheck / initcheck over the masked_bmm tests; then
# main's bench (base) against this one alternately, two rounds of the masked_bmm section.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
[ -d /work/main/src ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
timeout 240 "$work/test-ops" --test-threads=4 > "$OUT/tests-all.log" 2>&1
echo "tests all default rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-all.log" | head -8 | tee -a "$OUT/summary.txt"
CANDLE_FASTOPS_MATMUL_KERNELS=portable timeout 120 "$work/test-ops" matmul --test-threads=4 > "$OUT/tests-portable.log" 2>&1
echo "tests matmul portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-portable.log" | head -5 | tee -a "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_MATMUL_KERNELS=$k timeout 100 "$work/test-ops" scale::masked_bmm --ignored --test-threads=1 > "$OUT/tests-scale-$k.log" 2>&1
  echo "tests scale::masked_bmm (past 2^31) $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-scale-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
filt=(--kernel-name kns=span_grad --kernel-name kns=span_matmul --kernel-name kns=masked_bmm --kernel-name kns=mask_grad --kernel-name kns=tile_summary)
for tool in memcheck racecheck synccheck; do
  extra=("${filt[@]}"); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
  timeout 150 "$san" --tool $tool "${extra[@]}" --error-exitcode 9 "$work/test-ops" masked_bmm --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" masked_bmm_backward --test-threads=1 > "$OUT/san-initcheck.log" 2>&1 &
wait
for tool in memcheck racecheck synccheck initcheck; do
  echo "$tool: $(grep -E 'SUMMARY' "$OUT/san-$tool.log" | tail -1) | $(grep '^test result' "$OUT/san-$tool.log" | tail -1)" | tee -a "$OUT/summary.txt"
done
unset FASTOPS_TEST_LIGHT
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_bmm base=target/s48/bench-base.xz new=target/gpu-bundle/bin/bench-ops.xz > /dev/null 2>&1
grep -v "round" "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
