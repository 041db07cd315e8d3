#!/usr/bin/env bash
# Session 57 job 2 (written, NOT RUN: the session's device time ran out): the wgmma update
# kernel's warpgroups walk their own chunks (named barriers instead of a block-wide barrier at
# every chunk boundary); the change is `benches/results/h100-2026-12-07-s57-job2-unit-walk.diff`
# (`git apply` it before building the `unit` bundle). The new binaries' small_fc_lopt tests
# (default and portable kernels, the test past 2^31 elements, memcheck / racecheck / synccheck),
# an A/B of the step in three binaries (two rounds alternately): `base` main before this session
# (c50d639), `deferred` job 1's (b62d5d5), `unit` this change; ncu kernel times of one 354M / 289
# step and the update kernel's stall reasons (unit). Build: the two earlier tuning bench binaries
# as target/gpu-bundle-base/bench-ops.xz and bench-ops-deferred.xz, then this change's
# `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/h100-2026-12-07-s57-job2.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/unit" && chmod +x "$work/unit"
xz -dc target/gpu-bundle-base/bench-ops-deferred.xz > "$work/deferred" && chmod +x "$work/deferred"
xz -dc target/gpu-bundle-base/bench-ops.xz > "$work/base" && chmod +x "$work/base"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(tail -1 "$out/gpu.txt")"
timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in base deferred unit; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 100 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
        log "bench $v round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
names = ("base", "deferred", "unit")
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
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 150 "$ncu" --clock-control none \
    --kernel-name regex:lopt_ --launch-skip 0 --launch-count 12 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv "$work/unit" small_fc_lopt > "$out/ncu-unit.csv" 2> "$out/ncu-unit.err"
log "ncu unit rc=$? $((SECONDS - S))s"
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" timeout 150 "$ncu" --clock-control none \
    --kernel-name regex:lopt_update --launch-skip 0 --launch-count 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio$,smsp__average_warp_latency_per_inst_issued.ratio,gpu__time_duration.sum,sm__inst_issued.avg.pct_of_peak_sustained_active" \
    --csv "$work/unit" small_fc_lopt > "$out/ncu-stalls.csv" 2> "$out/ncu-stalls.err"
log "ncu stalls rc=$? $((SECONDS - S))s"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, os, sys
out = sys.argv[1]
p = os.path.join(out, "ncu-unit.csv")
rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
launches = {}
for r in rows:
    launches.setdefault((r["ID"], r["Kernel Name"].split("(")[0]), {})[r["Metric Name"]] = r["Metric Value"]
print("ncu unit: kernel | us | DRAM %")
for (i, k), m in launches.items():
    t = float(m.get("gpu__time_duration.sum", "0").replace(",", "")) / 1e3
    print(f"  {i:>3} {k:28s} {t:9.1f} {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '')}")
p = os.path.join(out, "ncu-stalls.csv")
rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
vals = []
for r in rows:
    try:
        vals.append((float(r["Metric Value"].replace(",", "")), r["Metric Name"]))
    except ValueError:
        pass
print("update kernel (unit; first launch of 152M/97), stalls per issued instruction:")
for v, n in sorted(vals, reverse=True):
    if v > 0.005:
        print(f"  {v:10.3f} {n}")
PY
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
grep -h -E "FAILED|panicked" "$out"/tests*.log "$out/scale.log" | head -20 | tee -a "$out/summary.txt"
SAN_TIMEOUT=150 SAN_SPLIT="small_fc_lopt::" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck racecheck synccheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cat "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
