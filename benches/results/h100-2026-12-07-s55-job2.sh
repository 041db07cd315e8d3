#!/usr/bin/env bash
# Session 55 job 2: the wgmma update's variants (A/B), its checks (tests of the folded variant,
# the test past 2^31 elements, compute-sanitizer). OUT=DIR bash benches/results/h100-2026-12-07-s55-job2.sh
set -u
out=${OUT:?}
mkdir -p "$out"
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops" && chmod +x "$work/test-ops"
xz -dc target/s55/bench-tuning.xz > "$work/bench-tuning" && chmod +x "$work/bench-tuning"
xz -dc target/s55/test-tuning.xz > "$work/test-tuning" && chmod +x "$work/test-tuning"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
S=$SECONDS
log() { echo "$*" | tee -a "$out/summary.txt"; }
names=(portable wgmma pipelined folded pipelined_folded)
for round in 1 2; do
    for v in 0 1 2 3 4; do
        FASTOPS_LOPT_WGMMA=$v FASTOPS_BENCH_NO_BASELINE=1 \
            FASTOPS_BENCH_CASES="354M/289 step (fused),152M/97 step (fused)" \
            FASTOPS_BENCH_OUT="$out/ab-$v-$round.jsonl" timeout 100 "$work/bench-tuning" small_fc_lopt \
            > "$out/ab-$v-$round.log" 2>&1
        log "bench ${names[$v]} round $round rc=$? $((SECONDS - S))s"
    done
done
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
names = ["portable", "wgmma", "pipelined", "folded", "pipelined_folded"]
table = {}
for v in range(5):
    for r in (1, 2):
        p = os.path.join(out, f"ab-{v}-{r}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                row = json.loads(line)
                table.setdefault(row["case"], {}).setdefault(v, []).append(row["median_us"])
for case in sorted(table):
    print(f"{case:40s} " + "  ".join(f"{names[v]}: " + "/".join(f"{x:.0f}" for x in table[case].get(v, [])) for v in range(5)))
PY
for v in 3 4; do
    FASTOPS_LOPT_WGMMA=$v timeout 120 "$work/test-tuning" small_fc_lopt --test-threads=4 > "$out/tests-${names[$v]}.log" 2>&1
    log "tests (${names[$v]}) rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/tests-${names[$v]}.log" | tail -1)"
done
timeout 150 "$work/test-ops" --ignored scale::small_fc_lopt --test-threads=1 > "$out/scale.log" 2>&1
log "scale::small_fc_lopt rc=$? $((SECONDS - S))s: $(grep '^test result' "$out/scale.log" | tail -1)"
tests="golden_vectors_every_case_both_configs saved_state_resumes_exactly mlp_weights_errors_name_the_tensor
bad_variables_and_gradients any_rank_and_float_dtype non_finite_gradients_policies fused_passes_match
many_tensors_of_every_rank deterministic_steps_repeat named_state_resumes mismatched_state_files
cuda_step_refuses"
split=""
for t in $tests; do split="$split small_fc_lopt::$t"; done
SAN_TIMEOUT=300 SAN_SPLIT="small_fc_lopt::" bash target/gpu-bundle/sanitize.sh "$out/san" memcheck racecheck synccheck > "$out/san.txt" 2>&1 &
SAN_TIMEOUT=300 SAN_SPLIT="$split" bash target/gpu-bundle/sanitize.sh "$out/init" initcheck > "$out/init.txt" 2>&1 &
wait
log "sanitizers done $((SECONDS - S))s"
cat "$out/san/sanitize.txt" "$out/init/sanitize.txt" | tee -a "$out/summary.txt"
rm -f "$out"/san/*.log.big
rm -rf "$work"
