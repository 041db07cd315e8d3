#!/usr/bin/env bash
# Session 58 job 1: the small_fc_lopt step with (a) session 57's per-warpgroup chunk walk for the
# wgmma update kernel (`unit`: named barriers instead of a block-wide barrier at every chunk
# boundary) and (b) on top of it a statistics pass with more loads in flight: each thread loads
# STATS_ELEMS elements before it uses any (`s2`: 2, `s4`: 4; two resident blocks of 256 threads)
# and skips the 12 always-zero row / column feature sums of a matrix. Tests of s2 and s4 (default
# and portable kernels; s2 also the test past 2^31 elements, memcheck / racecheck / synccheck /
# initcheck), an A/B of the step in four binaries (two rounds alternately): `deferred` session
# 57's final (b62d5d5 = main), `unit`, `s2`, `s4`; ncu kernel times of one 354M / 289 step, the
# update kernel's and the statistics pass's stall reasons (s2). Build: the earlier bench binaries
# as target/gpu-bundle-base/bench-ops-{deferred,unit,s4}.xz and test-ops-s4.xz, then s2's
# `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/<this file>
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/s2" && chmod +x "$work/s2"
for v in deferred unit s4; do
    xz -dc target/gpu-bundle-base/bench-ops-$v.xz > "$work/$v" && chmod +x "$work/$v"
done
xz -dc target/gpu-bundle-base/test-ops-s4.xz > "$work/test-ops-s4" && chmod +x "$work/test-ops-s4"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(tail -1 "$out/gpu.txt")"
timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
timeout 120 "$work/test-ops-s4" small_fc_lopt --test-threads=4 > "$out/tests-s4.log" 2>&1
log "tests s4 (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-s4.log" | tail -1)"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in deferred unit s2 s4; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 100 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
        log "bench $v round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
names = ("deferred", "unit", "s2", "s4")
table = {}
for v in names:
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:48s} " + "  ".join(f"{v}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in names))
PY
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in deferred unit s2 s4; do
    FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 150 "$ncu" --clock-control none \
        --kernel-name regex:lopt_ --launch-skip 0 --launch-count 12 \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        --csv "$work/$v" small_fc_lopt > "$out/ncu-$v.csv" 2> "$out/ncu-$v.err"
    log "ncu $v rc=$? $((SECONDS - S))s"
done
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" timeout 150 "$ncu" --clock-control none \
    --kernel-name regex:lopt_update --launch-skip 0 --launch-count 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio$,smsp__average_warp_latency_per_inst_issued.ratio,gpu__time_duration.sum,sm__inst_issued.avg.pct_of_peak_sustained_active" \
    --csv "$work/s2" small_fc_lopt > "$out/ncu-stalls.csv" 2> "$out/ncu-stalls.err"
log "ncu stalls rc=$? $((SECONDS - S))s"
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" timeout 150 "$ncu" --clock-control none \
    --kernel-name regex:lopt_stats --launch-skip 0 --launch-count 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio$,smsp__average_warp_latency_per_inst_issued.ratio,gpu__time_duration.sum,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread" \
    --csv "$work/s2" small_fc_lopt > "$out/ncu-stats-stalls.csv" 2> "$out/ncu-stats-stalls.err"
log "ncu stats stalls rc=$? $((SECONDS - S))s"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, os, sys
out = sys.argv[1]
for v in ("deferred", "unit", "s2", "s4"):
    p = os.path.join(out, f"ncu-{v}.csv")
    rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
    launches = {}
    for r in rows:
        launches.setdefault((r["ID"], r["Kernel Name"].split("(")[0]), {})[r["Metric Name"]] = r["Metric Value"]
    print(f"ncu {v}: kernel | us | DRAM %")
    for (i, k), m in launches.items():
        t = float(m.get("gpu__time_duration.sum", "0").replace(",", "")) / 1e3
        print(f"  {i:>3} {k:28s} {t:9.1f} {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '')}")
for name, title in (("ncu-stalls.csv", "update kernel"), ("ncu-stats-stalls.csv", "statistics pass")):
    p = os.path.join(out, name)
    rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
    vals = []
    for r in rows:
        try:
            vals.append((float(r["Metric Value"].replace(",", "")), r["Metric Name"]))
        except ValueError:
            pass
    print(f"{title} (s2; first launch of 152M/97), stalls per issued instruction and the rest:")
    for v, n in sorted(vals, reverse=True):
        if v > 0.005:
            print(f"  {v:14.3f} {n}")
PY
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 120 "$work/test-ops-s4" small_fc_lopt --test-threads=4 > "$out/tests-s4-portable.log" 2>&1
log "tests s4 (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-s4-portable.log" | tail -1)"
timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
grep -h -E "FAILED|panicked" "$out"/tests*.log "$out/scale.log" | head -20 | tee -a "$out/summary.txt"
SAN_TIMEOUT=150 SAN_SPLIT="small_fc_lopt::" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck racecheck synccheck initcheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cat "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
