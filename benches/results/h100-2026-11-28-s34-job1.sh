#!/usr/bin/env bash
# Session 34, job 1: the 8-warp portable backward with two Q / dO stages (WIP) against the
# two-pass one (its "vs deterministic" row), portable kernels forced; ncu of both backwards.
set -u
OUT=${OUT:?}
V=${V:-v1}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s34/$V/test-ops.xz > "$work/test-ops"; xz -dc target/s34/$V/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
cp "$work/bench-ops.xz" /dev/null 2>/dev/null
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
nvidia-smi -L > "$OUT/gpu.txt"
timeout 200 "$work/test-ops" attention:: --test-threads=2 > "$OUT/tests.log" 2>&1
echo "tests rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests.log" | head -5 | tee -a "$OUT/summary.txt"
for r in 1 2; do
  FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench-$r.jsonl "$work/bench-ops" masked_attention > "$OUT/bench-$r.log" 2>&1
  echo "bench $r rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "fwd+bwd" "$OUT/bench-$r.log" | tee -a "$OUT/summary.txt"
done
M="gpu__time_duration.sum,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_not_selected_per_warp_active.pct,smsp__warp_issue_stalled_selected_per_warp_active.pct,lts__t_bytes.sum"
for mode in bwd8 twopass; do
  b8=1; [ $mode = twopass ] && b8=0
  FASTOPS_ATTENTION_BWD8=$b8 FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_NO_BASELINE=1 \
    FASTOPS_BENCH_CASES="${CASE:-causal b=4 h=16 n=4096 d=128}" NCU_ARGS="--metrics $M --csv" \
    bash target/gpu-bundle/profile.sh "$OUT/$mode" 'attention_' 0 8 masked_attention
  echo "$mode ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
done
python3 - "$OUT" >> "$OUT/summary.txt" <<'PY'
import csv, sys, os, io
out = sys.argv[1]
for who in ("bwd8", "twopass"):
    path = os.path.join(out, who, "profile.csv")
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        print(who, "no rows"); continue
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    by = {}
    for r in rows:
        key = (r["ID"], r["Kernel Name"][:40])
        by.setdefault(key, {})[r["Metric Name"]] = r["Metric Value"]
    print("==", who)
    for (i, name), m in by.items():
        print(i, name, " | ".join(f"{k.replace('smsp__warp_issue_stalled_','st_').split('.')[0].split('__')[-1]}={v}" for k, v in sorted(m.items())))
PY
cat "$OUT/summary.txt"
