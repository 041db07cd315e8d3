#!/usr/bin/env bash
# Session 41, job 2 (H200): SASS-level source counters of one f32 span product (grad_a of the
# b=64 2048 k=64 fwd+bwd call), main's code; summarised by scripts/ncu_sass_summary.py.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1
SASS=1 timeout 200 bash target/gpu-bundle/profile.sh "$OUT/sass" 'span_matmul_tf32x3' 0 1 masked_bmm > "$OUT/sass.log" 2>&1
echo "ncu sass rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 scripts/ncu_sass_summary.py "$OUT/sass/source.csv.xz" 16 > "$OUT/sass-summary.txt" 2>&1
SASS=1 timeout 200 bash target/gpu-bundle/profile.sh "$OUT/sass_b" 'span_matmul_tf32x3' 1 1 masked_bmm > "$OUT/sass_b.log" 2>&1
python3 scripts/ncu_sass_summary.py "$OUT/sass_b/source.csv.xz" 16 > "$OUT/sass-b-summary.txt" 2>&1
mv "$OUT/sass/source.csv.xz" "$OUT/span-a-source.csv.xz"; mv "$OUT/sass_b/source.csv.xz" "$OUT/span-b-source.csv.xz"
rm -rf "$OUT/sass" "$OUT/sass_b" "$OUT/sass.log" "$OUT/sass_b.log"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
