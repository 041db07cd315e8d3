#!/usr/bin/env bash
# Session 48, job 7 (H200): the final code after the launch-code fold (one launch block for both
# span kernels): the matmul tests through the default and the portable kernels, masked_bmm past
# 2^31 elements through the default.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work/test-ops"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_MATMUL_KERNELS=$k timeout 60 "$work/test-ops" matmul --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests matmul $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
timeout 40 "$work/test-ops" scale::masked_bmm --ignored --test-threads=1 > "$OUT/tests-scale.log" 2>&1
echo "tests scale::masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-scale.log" | head -5 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
