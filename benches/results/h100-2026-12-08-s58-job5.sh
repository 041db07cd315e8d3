#!/usr/bin/env bash
# Session 58 job 5 (written, NOT RUN: the session's device time ran out); it replaces job 4. Two
# small_fc_lopt changes on top of session 58's main:
#  - `factors`: benches/results/h100-2026-12-08-s58-job4-columns.diff, lopt_factors' column loop
#    loading four columns a thread before it uses any (the embedding's 50257 columns: ~250 us of
#    group 1's lopt_factors, against ~30 for the other groups);
#  - `rz`: that, plus benches/results/h100-2026-12-08-s58-job5-rz-relu-split.diff: the second
#    layer's input split with the ReLU folded into the conversions (cvt.rz.relu for hi,
#    cvt.rn.relu for lo; session 32's "rz", measured then on the mma.sync kernel, whose time did
#    not follow its instruction count; the wgmma kernel's did in session 55). SASS: the wgmma
#    update loop 751 -> 719 instructions per 32 elements (narrow matrices), 103 registers as before.
#    If kept, small_fc_lopt.cuh's note on the split (hi = f16(v)) must say rz for that layer.
# The rz binary's small_fc_lopt tests (default and portable kernels, the test past 2^31 elements;
# memcheck, synccheck, initcheck, one process per test), an A/B of the step (`s2` = main before
# these, `factors`, `rz`; two rounds alternately), ncu times of one 354M / 289 step (factors, rz).
# Build (from main): `scripts/gpu-bundle.sh bench-ops` with GPU_BUNDLE_FEATURES=cuda,tuning at
# main -> target/gpu-bundle-base/bench-ops-s2.xz; `git apply` the columns diff, the same ->
# bench-ops-factors.xz; `git apply` the rz diff, then
# `GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops`.
# Run: OUT=DIR bash benches/results/h100-2026-12-08-s58-job5.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/rz" && chmod +x "$work/rz"
for v in s2 factors; do
    xz -dc target/gpu-bundle-base/bench-ops-$v.xz > "$work/$v" && chmod +x "$work/$v"
done
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "$(nvidia-smi --query-gpu=name --format=csv,noheader)"
timeout 100 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests.log" 2>&1
log "tests (default) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests.log" | tail -1)"
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 60 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
timeout 100 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
grep -h -E "FAILED|panicked" "$out"/tests*.log "$out/scale.log" | head -10 | tee -a "$out/summary.txt"
cases="354M/289 step (fused),152M/97 step (fused)"
for round in 1 2; do
    for v in s2 factors rz; do
        FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" \
            timeout 60 "$work/$v" small_fc_lopt > "$out/ab-$v-$round.log" 2>&1
    done
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for v in factors rz; do
    FASTOPS_BENCH_CALLS=1,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="354M/289 step (fused)" timeout 60 "$ncu" --clock-control none \
        --kernel-name regex:lopt_ --launch-skip 0 --launch-count 12 --metrics gpu__time_duration.sum \
        --csv "$work/$v" small_fc_lopt > "$out/ncu-$v.csv" 2> "$out/ncu-$v.err"
done
log "bench + ncu $((SECONDS - S))s"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import csv, json, os, sys
out = sys.argv[1]
table = {}
for v in ("s2", "factors", "rz"):
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:40s} " + "  ".join(f"{v}: " + "/".join(f"{x:.0f}" for x in xs) for v, xs in table[case].items()))
for v in ("factors", "rz"):
    p = os.path.join(out, f"ncu-{v}.csv")
    rows = list(csv.DictReader([l for l in open(p) if l.startswith('"')])) if os.path.exists(p) else []
    print(f"ncu {v}, us: " + "  ".join(f"{r['Kernel Name'].split('(')[0]} {float(r['Metric Value'].replace(',', '')) / 1e3:.1f}" for r in rows))
PY
split=""
for t in golden saved mlp_weights bad_variables any_rank non_finite fused_passes many_tensors deterministic named_state mismatched cuda_step; do
    split="$split small_fc_lopt::$t"
done
SAN_TIMEOUT=240 SAN_SPLIT="$split" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck synccheck initcheck > "$out/san.txt" 2>&1
log "sanitizers $((SECONDS - S))s"
cut -c1-110 "$out/san/sanitize.txt" | tee -a "$out/summary.txt"
rm -rf "$out/san"/*.log "$work"
