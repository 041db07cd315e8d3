#!/usr/bin/env bash
# Session 38, job 3 (H200): sparse_linear's forward with the next stripe's weight slices
# prefetched by cp.async.bulk.prefetch.L2 (one per row slice, sm_90). A/B of the bench's
# sparse_linear section (main = base, the prefetch = C), alternately, three rounds; the stride
# program of job 2 built from each; ncu of C's f32 forward.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 300 bash scripts/ab-bench.sh "$OUT/ab" 3 sparse_linear base=target/s38/base/bench-ops.xz C=target/s38/C/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cut -c1-220 "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
work=$(mktemp -d)
for v in base C; do xz -dc target/s38/$v/scratch.xz > "$work/scratch-$v"; chmod +x "$work/scratch-$v"; done
for round in 1 2; do for v in base C; do
  timeout 60 "$work/scratch-$v" > "$OUT/stride-$v-$round.txt" 2>&1; echo "stride $v round $round rc=$?" | tee -a "$OUT/summary.txt"
  sed 's/ weight [0-9]* MB//; s/ a 128-column stripe,//' "$OUT/stride-$v-$round.txt" | grep "used 1024\|of 128\|cols 128 used\|cols 1024 used 128" | head -4 | tee -a "$OUT/summary.txt"
done; done
xz -dc target/s38/C/bench-ops.xz > target/gpu-bundle/bin/bench-ops && rm target/gpu-bundle/bin/bench-ops.xz && xz -T0 target/gpu-bundle/bin/bench-ops
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 NCU_ARGS="--set full --csv --page details" timeout 100 bash target/gpu-bundle/profile.sh "$OUT/ncu" 'sparse_linear_fwd_vec1_f32' 0 2 sparse_linear > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i '"Duration"\|"DRAM Throughput"\|"L2 Cache Throughput"\|"L2 Hit Rate"' "$OUT/ncu/profile.csv" | awk -F'","' '{print $5, $13, $15}' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
