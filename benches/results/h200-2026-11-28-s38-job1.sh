#!/usr/bin/env bash
# Session 38, job 1 (H200): sparse_linear's forward with the warps' task order turned each stripe
# and the next stripe's weight rows prefetched into L2. Tests (sparse_linear, the > 2^31 test);
# A/B of the bench's sparse_linear section: main (base), the turned order alone (rot), both
# (rotpf), alternately, three rounds; ncu of the f32 forward (rotpf).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 150 "$work/test-ops" sparse_linear --test-threads=4 > "$OUT/tests-sparse.log" 2>&1
echo "tests sparse_linear rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-sparse.log" | head -5 | tee -a "$OUT/summary.txt"
timeout 60 "$work/test-ops" scale::sparse_linear_past_2_31 --ignored --test-threads=1 > "$OUT/scale-sparse.log" 2>&1
echo "scale sparse_linear rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-sparse.log" | tee -a "$OUT/summary.txt"
timeout 330 bash scripts/ab-bench.sh "$OUT/ab" 3 sparse_linear base=target/s38/base/bench-ops.xz rot=target/s38/A/bench-ops.xz rotpf=target/gpu-bundle/bin/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/ab/ab-summary.txt" | cut -c1-220 | tee -a "$OUT/summary.txt"
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 NCU_ARGS="--set full --csv --page details" timeout 100 bash target/gpu-bundle/profile.sh "$OUT/ncu" 'sparse_linear_fwd_vec1_f32' 0 2 sparse_linear > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i '"Duration"\|"DRAM Throughput"\|"L2 Cache Throughput"\|"L2 Hit Rate"\|"Achieved Occupancy"' "$OUT/ncu/profile.csv" | awk -F'","' '{print $5, $13, $15}' | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
