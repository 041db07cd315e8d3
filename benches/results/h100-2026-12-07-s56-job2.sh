#!/usr/bin/env bash
# Session 56 job 2: where the wgmma update kernel's issue slots go: ncu's pipe utilisation, warp
# states and scheduler statistics of one update launch (the first of "152M/97 step (fused)"), the
# kept kernel (FASTOPS_LOPT_WGMMA=1) and job 1's four-block study kernel (4). Job 1's bundle (built
# with job 1's diff applied).
# Run: OUT=DIR bash benches/results/h100-2026-12-07-s56-job2.sh
set -u
out=${OUT:?}
mkdir -p "$out"
nvidia-smi -L > "$out/gpu.txt"
for v in 1 4; do
    FASTOPS_LOPT_WGMMA=$v FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="152M/97 step (fused)" \
        NCU_ARGS="--section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats --metrics regex:sm__inst_executed_pipe_[a-z0-9_]+[.]avg[.]pct_of_peak_sustained_active$ --csv --page details" \
        timeout 150 bash target/gpu-bundle/profile.sh "$out/ncu-$v" lopt_update 0 1 small_fc_lopt > /dev/null 2>&1
    echo "ncu v$v rc=$?"
done
python3 - "$out" <<'PY' > "$out/summary.txt"
import csv, os, sys
out = sys.argv[1]
rows = {}
for v in (1, 4):
    p = os.path.join(out, f"ncu-{v}", "profile.csv")
    if not os.path.exists(p):
        continue
    lines = [l for l in open(p) if l.startswith('"')]
    for r in csv.DictReader(lines):
        key = (r.get("Section Name", ""), r.get("Metric Name", ""), r.get("Metric Unit", ""))
        rows.setdefault(key, {})[v] = r.get("Metric Value", "")
print(open(os.path.join(out, "gpu.txt")).read().strip())
print("section | metric | unit | wgmma (kept) | by tile, 4 blocks")
for key in rows:
    print(" | ".join(key) + " | " + " | ".join(rows[key].get(v, "") for v in (1, 4)))
PY
cat "$out/summary.txt"
