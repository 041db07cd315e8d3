#!/usr/bin/env bash
# Session 56 job 1: small_fc_lopt's update MLP a 16-row tile at a time (study kernels of a tuning
# build: FASTOPS_LOPT_WGMMA=1 the default wgmma kernel, 2 by tile at three blocks an SM, 3 by tile
# at two, 4 at four), their tests, an A/B of the step (two rounds alternately) and ncu of one update launch
# each. Build, with the study kernels applied (`git apply
# benches/results/h100-2026-12-07-s56-job1-by-tile.diff`):
# GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh test-ops bench-ops
# Run: OUT=DIR bash benches/results/h100-2026-12-07-s56-job1.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench" && chmod +x "$work/bench"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
names=(portable wgmma by_tile3 by_tile2 by_tile4)
for v in 1 2 4; do
    FASTOPS_LOPT_WGMMA=$v timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-${names[$v]}.log" 2>&1
    log "tests (${names[$v]}) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-${names[$v]}.log" | tail -1)"
done
CANDLE_FASTOPS_LOPT_KERNELS=portable timeout 120 "$work/test-ops" small_fc_lopt --test-threads=4 > "$out/tests-portable.log" 2>&1
log "tests (portable) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-portable.log" | tail -1)"
for v in 2 4; do
    FASTOPS_LOPT_WGMMA=$v timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale-${names[$v]}.log" 2>&1
    log "scale::small_fc_lopt (${names[$v]}) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale-${names[$v]}.log" | tail -1)"
done
for round in 1 2; do
    for v in 1 2 3 4; do
        FASTOPS_LOPT_WGMMA=$v FASTOPS_BENCH_NO_BASELINE=1 \
            FASTOPS_BENCH_CASES="354M/289 step (fused),152M/97 step (fused)" \
            FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" timeout 100 "$work/bench" small_fc_lopt \
            > "$out/ab-$v-$round.log" 2>&1
        log "bench ${names[$v]} round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
names = ["portable", "wgmma", "by_tile3", "by_tile2", "by_tile4"]
table = {}
for v in range(5):
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:40s} " + "  ".join(f"{names[v]}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in range(1, 5)))
PY
for v in 1 4; do
    FASTOPS_LOPT_WGMMA=$v FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" \
        NCU_ARGS="--metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread,launch__occupancy_limit_registers --csv" \
        timeout 120 bash target/gpu-bundle/profile.sh "$out/ncu-${names[$v]}" lopt_update 0 1 small_fc_lopt > /dev/null 2>&1
    log "ncu ${names[$v]} rc=$? $((SECONDS - S))s"
    grep -v "^==" "$out/ncu-${names[$v]}/profile.csv" | tail -8 | tee -a "$out/summary.txt"
done
# memcheck and synccheck over the small_fc_lopt tests through the study kernels (this crate's
# kernels instrumented).
for v in 2 4; do
    FASTOPS_LOPT_WGMMA=$v SAN_TIMEOUT=200 SAN_SPLIT="small_fc_lopt::" bash target/gpu-bundle/sanitize.sh "$out/san-${names[$v]}" memcheck synccheck > "$out/san-${names[$v]}.txt" 2>&1 &
done
wait
for v in 2 4; do
    log "sanitizers (${names[$v]}) $((SECONDS - S))s"
    cat "$out/san-${names[$v]}/sanitize.txt" | tee -a "$out/summary.txt"
    rm -f "$out/san-${names[$v]}"/*.log.big
done
# On an H200 only: issue 18's rows and the lopt step rows of this build (default kernels), then
# PyTorch's attention anchors, in the same job (session 55 job 4's form).
if grep -q H200 "$out/gpu.txt"; then
    export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64,354M/289 step (fused),152M/97 step (fused)"
    FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_OUT="$out/h200-ops.jsonl" timeout 200 "$work/bench" masked_attention small_fc_lopt > "$out/h200-bench.log" 2>&1
    log "h200 bench rc=$? $((SECONDS - S))s"
    grep -E "masked_attention|small_fc_lopt" "$out/h200-bench.log" | grep -v "packed\|projection\|token-major" | cut -c1-150 | tee -a "$out/summary.txt"
    timeout 170 python3 scripts/torch_anchors.py "$out/h200-torch.jsonl" masked_attention > "$out/h200-torch.log" 2>&1
    log "torch rc=$? $((SECONDS - S))s"
    grep -v "bool mask" "$out/h200-torch.jsonl" | cut -c1-200 | tee -a "$out/summary.txt" 2>/dev/null
fi
rm -rf "$work"
