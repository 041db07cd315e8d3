#!/usr/bin/env bash
# Session 37, job 3 (H200): every test of test-ops on the final bundle; then profiles for issue 21's
# open rows ("profile first"): ncu kernel times of one small_fc_lopt step (354M / 289 and 152M / 97
# sets), a SASS profile of its update kernel, the full section set of the sparse_linear f32 forward
# (its two launches) and of the masked_bmm f32 forward.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 240 "$work/test-ops" --test-threads=4 > "$OUT/tests-all.log" 2>&1
echo "tests all rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-all.log" | head -5 | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1
timeout 120 bash target/gpu-bundle/profile.sh "$OUT/lopt" 'lopt_' 0 200 small_fc_lopt > "$OUT/lopt.log" 2>&1
echo "ncu lopt rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT/lopt/profile.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys, io, collections
text = open(sys.argv[1]).read()
start = text.find('"ID"')
rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
print("lopt launches:", len(rows))
for r in rows[:80]:
    print(r["ID"], r["Kernel Name"][:32], r["Grid Size"], r["Metric Value"])
PY
SASS=1 timeout 150 bash target/gpu-bundle/profile.sh "$OUT/lopt-sass" 'lopt_update_mma' 2 1 small_fc_lopt > "$OUT/lopt-sass.log" 2>&1
echo "ncu lopt sass rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
NCU_ARGS="--set full --csv --page details" timeout 120 bash target/gpu-bundle/profile.sh "$OUT/sparse" 'sparse_linear_fwd' 0 2 sparse_linear > "$OUT/sparse.log" 2>&1
echo "ncu sparse rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
NCU_ARGS="--set full --csv --page details" timeout 120 bash target/gpu-bundle/profile.sh "$OUT/mbmm" 'masked_bmm_tf32x3' 0 1 masked_bmm > "$OUT/mbmm.log" 2>&1
echo "ncu masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
for f in sparse mbmm; do
  grep -i '"Duration"\|"DRAM Throughput"\|"L2 Hit Rate"\|"Achieved Occupancy"\|"Registers Per Thread"\|"Memory Throughput","%"\|"Issue Slots Busy"\|"L1/TEX Hit Rate"\|"Grid Size"' "$OUT/$f/profile.csv" | awk -F'","' '{print $5, $(NF-2), $(NF-1), $NF}' | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
