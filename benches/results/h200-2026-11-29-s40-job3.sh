#!/usr/bin/env bash
# Session 40, job 3 (H200): load_tile with each quarter-warp copying one 128-byte segment of a row
# (v4) against v3 (job 2's delta pass, main's load_tile: 16 lanes a 256-byte row). The attention
# tests through the portable and default kernels (v4), the > 2^31 test (portable); ncu of the
# one-pass backward's shared-memory wavefronts in both; then the masked_attention section of both
# alternately through the portable kernels, three rounds.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"
xz -dc target/s40/v3/bench-ops.xz > "$work/v3"; xz -dc target/s40/v4/bench-ops.xz > "$work/v4"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-portable.log" 2>&1
echo "scale portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-portable.log" | tee -a "$OUT/summary.txt"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
m=gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
for b in v3 v4; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_CASES="causal b=4 h=16 n=4096 d=128" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
    timeout 100 "$ncu" --clock-control none --kernel-name "regex:attention_(bwd|fwd)_generated" --launch-count 2 --metrics $m --csv "$work/$b" masked_attention > "$OUT/ncu-$b.csv" 2> "$OUT/ncu-$b.err"
  echo "ncu $b rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  python3 - "$OUT/ncu-$b.csv" "$b" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[2], "no rows"); sys.exit()
head = rows[0]; ix = {h: i for i, h in enumerate(head)}
for r in rows[1:]:
    print(sys.argv[2], r[ix["Kernel Name"]][:32], r[ix["Metric Name"]], r[ix["Metric Value"]])
PY
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 280 bash scripts/ab-bench.sh "$OUT/ab" 3 masked_attention v3="$work/v3" v4="$work/v4" > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v "round" "$OUT/ab/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
