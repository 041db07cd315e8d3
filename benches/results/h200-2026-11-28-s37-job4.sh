#!/usr/bin/env bash
# Session 37, job 4 (H200): masked_bmm's forward tile parked in shared memory and written in
# 16-byte row pieces. Matmul tests and the masked_bmm > 2^31 test; A/B of the bench's masked_bmm
# section against main's binary (4558296), alternately, three rounds; ncu full sections of one f32
# forward; memcheck / racecheck / initcheck over the masked_bmm tests (masked_bmm kernels only).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-new"
xz -dc target/s37/main/bench-ops.xz > "$work/bench-base"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 120 "$work/test-ops" matmul --test-threads=4 > "$OUT/tests-matmul.log" 2>&1
echo "tests matmul rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-matmul.log" | head -5 | tee -a "$OUT/summary.txt"
timeout 60 "$work/test-ops" scale::masked_bmm_past_2_31 --ignored --test-threads=1 > "$OUT/scale-mbmm.log" 2>&1
echo "scale masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-mbmm.log" | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_NO_BASELINE=1
for round in 1 2 3; do
  for v in base new; do
    timeout 100 "$work/bench-$v" masked_bmm > "$OUT/ab-$v-$round.log" 2>&1
    echo "ab $v round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "^| masked_bmm" "$OUT/ab-$v-$round.log" | cut -c14-100 | tee -a "$OUT/summary.txt"
  done
done
cp "$work/bench-new" "$work/bench-ops"
FASTOPS_BENCH_CALLS=0,1 NCU_ARGS="--set full --csv --page details" timeout 120 bash target/gpu-bundle/profile.sh "$OUT/mbmm" 'masked_bmm_tf32x3' 0 1 masked_bmm > "$OUT/mbmm.log" 2>&1
echo "ncu masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i '"Duration"\|"DRAM Throughput"\|"L2 Cache Throughput"\|"Achieved Occupancy"\|"Issue Slots Busy"' "$OUT/mbmm/profile.csv" | awk -F'","' '{print $5, $13, $15}' | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for tool in memcheck racecheck initcheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 200 "$san" --tool $tool "${extra[@]}" --kernel-name kns=masked_bmm --error-exitcode 9 "$work/test-ops" matmul::masked_bmm_ --test-threads=1 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
