#!/usr/bin/env bash
# Session 38, job 6 (H200): small_fc_lopt's lopt_stats with two elements a thread a turn (the
# second's streams loaded before the first is updated): la at three blocks an SM (80 registers,
# 100 bytes of spills), lb at two (126 registers, none), against main (base). ncu durations and
# DRAM throughput of lopt_stats per variant, then the bench's small_fc_lopt section alternately.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d)
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in base la lb; do
  xz -dc target/s38/$v/bench-ops.xz > "$work/$v"; chmod +x "$work/$v"
  FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 120 "$ncu" --clock-control none --kernel-name "regex:lopt_stats" --launch-count 3 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active --csv "$work/$v" small_fc_lopt > "$OUT/ncu-$v.csv" 2>/dev/null
  echo "ncu $v rc=$? $SECONDS s: $(grep -o '"[a-z_]*__[a-z_.]*","[^"]*","[0-9.,]*"' "$OUT/ncu-$v.csv" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
done
timeout 420 bash scripts/ab-bench.sh "$OUT/ab" 2 small_fc_lopt base=target/s38/base/bench-ops.xz la=target/s38/la/bench-ops.xz lb=target/s38/lb/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cut -c1-220 "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
