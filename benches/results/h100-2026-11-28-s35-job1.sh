#!/usr/bin/env bash
# Session 35, job 1: the one-pass backward with 16-byte dq reductions in fragment order, the scale
# applied by dq_rows, one barrier fewer per item. Attention tests (portable, default), the > 2^31
# test (portable), the bench's d=128 rows (portable: fwd+bwd one pass, "vs deterministic" two
# passes), ncu of the one-pass kernel, then racecheck / synccheck / memcheck over the attention tests.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L > "$OUT/gpu.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done ) > "$OUT/scale-smi.txt" 2>&1 &
smi=$!
CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 90 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale.log" 2>&1
echo "scale portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale.log" | tee -a "$OUT/summary.txt"
kill $smi
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench.jsonl "$work/bench-ops" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "fwd+bwd" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
M="gpu__time_duration.sum,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_not_selected_per_warp_active.pct,smsp__warp_issue_stalled_selected_per_warp_active.pct,lts__t_bytes.sum"
FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="causal b=4 h=16 n=4096 d=128" NCU_ARGS="--metrics $M --csv" \
  timeout 120 bash target/gpu-bundle/profile.sh "$OUT/ncu" 'attention_' 0 8 masked_attention > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" >> "$OUT/summary.txt" <<'PY'
import csv, sys, os, io
path = os.path.join(sys.argv[1], "ncu", "profile.csv")
text = open(path).read() if os.path.exists(path) else ""
start = text.find('"ID"')
if start < 0:
    print("ncu: no rows")
else:
    by = {}
    for r in csv.DictReader(io.StringIO(text[start:])):
        by.setdefault((r["ID"], r["Kernel Name"][:40]), {})[r["Metric Name"]] = r["Metric Value"]
    for (i, name), m in by.items():
        print(i, name, " | ".join(f"{k.replace('smsp__warp_issue_stalled_','st_').split('.')[0].split('__')[-1]}={v}" for k, v in sorted(m.items())))
PY
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
left=$((570 - SECONDS))
for tool in racecheck synccheck memcheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout $left "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for tool in racecheck synccheck memcheck; do echo "$tool: $(grep -E 'SUMMARY' $OUT/san-$tool.log | tail -1) | $(grep 'test result' $OUT/san-$tool.log | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
cd "$OUT" && tar czf logs.tgz --exclude=summary.txt --exclude=logs.tgz . && find . -mindepth 1 ! -name summary.txt ! -name logs.tgz -delete
