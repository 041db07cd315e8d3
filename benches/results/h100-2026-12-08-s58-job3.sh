#!/usr/bin/env bash
# Session 58 job 3: lopt_factors with four rows a thread loaded before any is used (one block
# walks each matrix, so an embedding's 50257 rows were a chain of dependent loads). The new
# binaries' small_fc_lopt tests (default, portable kernels, the test past 2^31 elements; memcheck,
# synccheck and initcheck, one process per test), an A/B of the step in three tuning bench binaries (two rounds
# alternately): `deferred` session 57's (b62d5d5), `s2` job 1's landed code, `factors` this
# change; ncu kernel times of one 354M / 289 step (s2, factors). Build: the two earlier bench
# binaries as target/gpu-bundle-base/bench-ops-{deferred,s2}.xz, then this change's
# `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/h100-2026-12-08-s58-job3.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/factors" && chmod +x "$work/factors"
for v in deferred s2; do
    xz -dc target/gpu-bundle-base/bench-ops-$v.xz > "$work/$v" && chmod +x "$work/$v"
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(tail -1 "$out/gpu.txt")"
timeout 150 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 150 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
grep -h -E "FAILED|panicked" "$out"/tests*.log "$out/scale.log" | head -20 | tee -a "$out/summary.txt"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in deferred s2 factors; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 100 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
        log "bench $v round $round rc=$? $((SECONDS - S))s"
    done
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in s2 factors; do
    FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 150 "$ncu" --clock-control none \
        --kernel-name regex:lopt_ --launch-skip 0 --launch-count 12 \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        --csv "$work/$v" small_fc_lopt > "$out/ncu-$v.csv" 2> "$out/ncu-$v.err"
    log "ncu $v rc=$? $((SECONDS - S))s"
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, json, os, sys
out = sys.argv[1]
names = ("deferred", "s2", "factors")
table = {}
for v in names:
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:40s} " + "  ".join(f"{v}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in names))
for v in ("s2", "factors"):
    p = os.path.join(out, f"ncu-{v}.csv")
    rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
    launches = {}
    for r in rows:
        launches.setdefault((r["ID"], r["Kernel Name"].split("(")[0]), {})[r["Metric Name"]] = r["Metric Value"]
    print(f"ncu {v}: kernel | us | DRAM %")
    for (i, k), m in launches.items():
        t = float(m.get("gpu__time_duration.sum", "0").replace(",", "")) / 1e3
        print(f"  {i:>3} {k:28s} {t:9.1f} {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '')}")
PY
split=""
for t in golden saved mlp_weights bad_variables any_rank non_finite fused_passes many_tensors deterministic named_state mismatched cuda_step; do
    split="$split small_fc_lopt::$t"
done
SAN_TIMEOUT=240 SAN_SPLIT="$split" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck synccheck initcheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cat "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
