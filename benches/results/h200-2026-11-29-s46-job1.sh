#!/usr/bin/env bash
# Session 46, job 1 (H200): v1 = the two-stage pipeline with one barrier an item (the portable
# forward, dq and dk / dv kernels); v2 = v1 + the portable forward's tiles swizzled at D = 128 for
# generated and runs masks. Attention tests through the portable and the default kernels (v2);
# the benches of main, v1 and v2 alternately, portable forced, no baselines, five rounds; ncu of
# the portable forward at causal 8192 (main, v2).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s46/test-v2.xz > "$work/test-ops"
for b in main v1 v2; do xz -dc target/s46/bench-$b.xz > "$work/bench-$b"; done
chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -6 | tee -a "$OUT/summary.txt"
done
cases="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^documents,^causal b=4 h=16 n=4096 d=64,^causal b=4 h=16 n=4096 d=256,^dense"
for round in 1 2 3 4 5; do
  for bin in bench-main bench-v1 bench-v2; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" timeout 150 "$work/$bin" masked_attention > "$OUT/$bin-$round.log" 2>&1
    echo "$bin round $round rc=$? $SECONDS s" >> "$OUT/summary.txt"
  done
done
python3 - "$OUT" >> "$OUT/summary.txt" <<'PY'
import re, sys, glob, statistics, collections
out = sys.argv[1]
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(f"{out}/bench-*-*.log")):
    binname = f.split("/")[-1].rsplit("-", 1)[0]
    for line in open(f):
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and ("forward" in cells[2] or "fwd+bwd" in cells[2]) and not any(x in cells[2] for x in ("packed", "projection", "token-major", "deterministic", "transposed", "reshape")):
            try: rows[cells[2]][binname].append(float(cells[5]))
            except ValueError: pass
for case, by in rows.items():
    base = statistics.mean(by["bench-main"]) if by["bench-main"] else None
    parts = []
    for b in ("bench-main", "bench-v1", "bench-v2"):
        v = by[b]
        if not v: continue
        m = statistics.mean(v)
        parts.append(f"{b[6:]} {'/'.join(f'{x:.0f}' for x in v)} (mean {m:.1f}{'' if base is None or b=='bench-main' else f', {100*(m/base-1):+.1f}%'})")
    print(f"{case[:60]:60s} | " + " | ".join(parts))
PY
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for bin in bench-main bench-v2; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" \
    timeout 150 "$ncu" --clock-control none --kernel-name "regex:attention_fwd_generated_d128_bf16" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats --section MemoryWorkloadAnalysis_Tables \
    --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio \
    --csv --page details "$work/$bin" masked_attention > "$OUT/ncu-$bin.csv" 2> "$OUT/ncu-$bin.err"
  echo "ncu $bin rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -i "\"Duration\"\|stalled\|Stall\|Warp Cycles Per Issued\|Registers Per\|L1/TEX Cache Throughput\|Executed Instructions\"\|Issue Slots Busy\|Local" "$OUT/ncu-$bin.csv" | awk -F'","' '{print $13" | "$14" | "$15}' | cut -c1-120 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
