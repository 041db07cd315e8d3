#!/usr/bin/env bash
# Session 57 job 1: small_fc_lopt's statistics pass reads only (the update pass computes this
# step's accumulators again and stores them with the parameter). The new binaries' small_fc_lopt
# tests (default and portable kernels, the test past 2^31 elements, memcheck / racecheck /
# synccheck), an A/B of the step against main's bench binary (`base`, two rounds alternately),
# ncu kernel times of one 354M / 289 step in each binary, and the stall reasons of one update
# launch (new binary). Build: main's bench binary as target/gpu-bundle-base/bench-ops.xz, then
# this change's `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/h100-2026-12-07-s57-job1.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/new" && chmod +x "$work/new"
xz -dc target/gpu-bundle-base/bench-ops.xz > "$work/base" && chmod +x "$work/base"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(tail -1 "$out/gpu.txt")"
timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in base new; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 100 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
        log "bench $v round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
table = {}
for v in ("base", "new"):
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:45s} " + "  ".join(f"{v}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in ("base", "new")))
PY
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in base new; do
    FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 150 "$ncu" --clock-control none \
        --kernel-name regex:lopt_ --launch-skip 0 --launch-count 15 \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum \
        --csv "$work/$v" small_fc_lopt > "$out/ncu-$v.csv" 2> "$out/ncu-$v.err"
    log "ncu $v rc=$? $((SECONDS - S))s"
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, os, sys
out = sys.argv[1]
for v in ("base", "new"):
    p = os.path.join(out, f"ncu-{v}.csv")
    if not os.path.exists(p):
        continue
    rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')]))
    launches = {}
    for r in rows:
        launches.setdefault((r["ID"], r["Kernel Name"].split("(")[0]), {})[r["Metric Name"]] = r["Metric Value"]
    print(f"ncu {v}: kernel | us | DRAM % | read MB | write MB")
    for (i, k), m in launches.items():
        t = float(m.get("gpu__time_duration.sum", "0").replace(",", "")) / 1e3
        rd = float(m.get("dram__bytes_read.sum", "0").replace(",", "")) / 1e6
        wr = float(m.get("dram__bytes_write.sum", "0").replace(",", "")) / 1e6
        print(f"  {i:>3} {k:28s} {t:9.1f} {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '')} {rd:9.1f} {wr:9.1f}")
PY
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
grep -h -E "FAILED|panicked|failed" "$out"/tests*.log "$out/scale.log" | head -20 | tee -a "$out/summary.txt"
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" timeout 150 "$ncu" --clock-control none \
    --kernel-name regex:lopt_update --launch-skip 0 --launch-count 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio$,smsp__average_warp_latency_per_inst_issued.ratio,gpu__time_duration.sum" \
    --csv "$work/new" small_fc_lopt > "$out/ncu-stalls.csv" 2> "$out/ncu-stalls.err"
log "ncu stalls rc=$? $((SECONDS - S))s"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, os, sys
p = os.path.join(sys.argv[1], "ncu-stalls.csv")
rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
vals = []
for r in rows:
    try:
        vals.append((float(r["Metric Value"].replace(",", "")), r["Metric Name"]))
    except ValueError:
        pass
print("update kernel (new), stalls per issued instruction:")
for v, n in sorted(vals, reverse=True):
    if v > 0.005:
        print(f"  {v:10.3f} {n}")
PY
SAN_TIMEOUT=150 SAN_SPLIT="small_fc_lopt::" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck synccheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cat "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
