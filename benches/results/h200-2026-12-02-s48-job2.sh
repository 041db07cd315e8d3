#!/usr/bin/env bash
# Session 48, job 2 (H200): main's bench (base) against the Hopper grad_a span kernel (new),
# alternately, three rounds of the masked_bmm section (ours only), then ncu times of the span
# kernels of one call of each case through each.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_bmm base=target/s48/bench-base.xz new=target/gpu-bundle/bin/bench-ops.xz > /dev/null 2>&1
grep -v "round" "$OUT/ab/ab-summary.txt" >> "$OUT/summary.txt"
echo "ab done $SECONDS s" >> "$OUT/summary.txt"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/new"; xz -dc target/s48/bench-base.xz > "$work/base"; chmod +x "$work"/*
for v in base new; do
  FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 150 "$ncu" --kernel-name regex:"span" --metrics gpu__time_duration.sum --csv "$work/$v" masked_bmm > "$OUT/ncu-$v.csv" 2>&1
  echo "ncu $v rc=$? $SECONDS s" >> "$OUT/summary.txt"
  grep -E '"span' "$OUT/ncu-$v.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 >> "$OUT/summary.txt"
done
echo "done $SECONDS s" >> "$OUT/summary.txt"
