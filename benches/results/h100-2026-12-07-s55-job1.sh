#!/usr/bin/env bash
# Session 55 job 1: small_fc_lopt's update pass on wgmma. OUT=DIR bash benches/results/h100-2026-12-07-s55-job1.sh
# (the carried target/gpu-bundle: test-ops and bench-ops of the change, default features;
# target/s55/bench-tuning.xz: the same with `tuning`, FASTOPS_LOPT_WGMMA choosing the kernel).
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/s55/bench-tuning.xz > "$work/bench-tuning" && chmod +x "$work/bench-tuning"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
timeout 240 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-wgmma.log" 2>&1
log "tests (default: wgmma) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-wgmma.log" | tail -1)"
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 240 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
grep -E "FAILED|panicked|Error" "$out"/tests-*.log | head -20
for round in 1 2; do
    for v in 0 1 2; do
        FASTOPS_LOPT_WGMMA=$v FASTOPS_BENCH_NO_BASELINE=1 \
            FASTOPS_BENCH_CASES="step (fused),step (fused, deterministic)" \
            FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" timeout 150 "$work/bench-tuning" small_fc_lopt \
            > "$out/ab-$v-$round.log" 2>&1
        log "bench FASTOPS_LOPT_WGMMA=$v round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
table = {}
for v in "012":
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if not os.path.exists(p):
            continue
        for line in open(p):
            row = json.loads(line)
            table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
names = {"0": "portable", "1": "wgmma", "2": "pipelined"}
for case in sorted(table):
    print(f"{case:50s} " + "  ".join(f"{names[v]}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in "012"))
PY
rm -rf "$work"
