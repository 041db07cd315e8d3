#!/usr/bin/env bash
# Session 48, job 3 (H200): the Hopper grad_a span kernel, v2 (a stage's products under the next
# stage's copies and split, one sum a stage): the matmul tests and masked_bmm past 2^31 through
# it, memcheck / racecheck / initcheck over the masked_bmm tests; main's bench (base) against v1
# (job 2's kernel) and v2 alternately, two rounds of the masked_bmm section; ncu times of the
# span kernels of one call of each case through v2.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/new"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 120 "$work/test-ops" matmul --test-threads=4 > "$OUT/tests.log" 2>&1
echo "tests matmul rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests.log" | head -5 | tee -a "$OUT/summary.txt"
timeout 100 "$work/test-ops" scale::masked_bmm --ignored --test-threads=1 > "$OUT/tests-scale.log" 2>&1
echo "tests scale::masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-scale.log" | head -5 | tee -a "$OUT/summary.txt"
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
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_bmm base=target/s48/bench-base.xz v1=target/s48/bench-v1.xz v2=target/gpu-bundle/bin/bench-ops.xz > /dev/null 2>&1
grep -v "round" "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "ab done $SECONDS s" | tee -a "$OUT/summary.txt"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 150 "$ncu" --kernel-name regex:"span" --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active --csv "$work/new" masked_bmm > "$OUT/ncu-v2.csv" 2>&1
echo "ncu v2 rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -E '"span' "$OUT/ncu-v2.csv" | awk -F'","' '{print $5, $(NF-2), $(NF)}' | sed 's/"//g' | cut -c1-140 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
