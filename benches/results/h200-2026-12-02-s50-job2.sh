#!/usr/bin/env bash
# Session 50, job 2 (H200): the Hopper span kernels with the partial tiles' mask bytes copied into
# shared memory with their stages. Every test of test-ops (default kernels), the matmul
# tests through the portable kernels, masked_bmm past 2^31 through both, memcheck / racecheck /
# synccheck / initcheck over the masked_bmm tests; ncu of one call of the span kernels both ways;
# this bench against the same binary with CANDLE_FASTOPS_MATMUL_KERNELS=portable, alternately,
# two rounds of the masked_bmm section.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
printf '#!/usr/bin/env bash\nCANDLE_FASTOPS_MATMUL_KERNELS=portable exec %s "$@"\n' "$work/bench-ops" > "$work/portable"; chmod +x "$work/portable"
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
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for k in default portable; do
  CANDLE_FASTOPS_MATMUL_KERNELS=$k FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 150 "$ncu" --kernel-name regex:"span_" --metrics gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio --csv "$work/bench-ops" masked_bmm > "$OUT/ncu-$k.csv" 2>&1
  echo "ncu $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '"span' "$OUT/ncu-$k.csv" | awk -F'","' '{print $5, $(NF-2), $(NF)}' | sed 's/"//g' | cut -c1-140 | tee -a "$OUT/summary.txt"
done
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_bmm portable="$work/portable" new="$work/bench-ops" > /dev/null 2>&1
grep -v "round" "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
