#!/usr/bin/env bash
# Session 58 job 4 (written, NOT RUN: the session's device time ran out). Apply
# benches/results/h100-2026-12-08-s58-job4-columns.diff first: lopt_factors with four columns a
# thread loaded before any is used, as job 3 did for the rows (an embedding's 50257 entries are
# its columns: rows = the product of the shape with d0 set to 1). Short: the small_fc_lopt tests
# (default and portable kernels), an A/B of the step (`s2` job 1's code, `factors` this change,
# two rounds alternately), ncu times of one 354M / 289 step's lopt_ kernels (factors), memcheck
# and initcheck over three of the tests.
# Build: job 1's bench binary as target/gpu-bundle-base/bench-ops-s2.xz, then this change's
# `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/h100-2026-12-08-s58-job4.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/factors" && chmod +x "$work/factors"
xz -dc target/gpu-bundle-base/bench-ops-s2.xz > "$work/s2" && chmod +x "$work/s2"
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(nvidia-smi --query-gpu=name --format=csv,noheader)"
timeout 100 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 60 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
grep -h -E "FAILED|panicked" "$out"/tests*.log | head -10 | tee -a "$out/summary.txt"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in s2 factors; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 60 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
    done
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 60 "$ncu" --clock-control none \
    --kernel-name regex:lopt_ --launch-skip 0 --launch-count 12 --metrics gpu__time_duration.sum \
    --csv "$work/factors" small_fc_lopt > "$out/ncu-factors.csv" 2> "$out/ncu-factors.err"
log "bench + ncu $((SECONDS - S))s"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, json, os, sys
out = sys.argv[1]
table = {}
for v in ("s2", "factors"):
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:40s} " + "  ".join(f"{v}: " + "/".join(f"{x:.0f}" for x in xs) for v, xs in table[case].items()))
p = os.path.join(out, "ncu-factors.csv")
rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
print("ncu factors, us: " + "  ".join(f"{r['Kernel Name'].split('(')[0]} {float(r['Metric Value'].replace(',', '')) / 1e3:.1f}" for r in rows))
PY
SAN_TIMEOUT=60 SAN_SPLIT="small_fc_lopt::fused_passes small_fc_lopt::deterministic small_fc_lopt::golden" \
    bash target/gpu-bundle/sanitize.sh "$out/san" memcheck initcheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cut -c1-120 "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
