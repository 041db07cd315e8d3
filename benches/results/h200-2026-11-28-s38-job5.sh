#!/usr/bin/env bash
# Session 38, job 5 (H200): what bounds small_fc_lopt's update kernel: tensor-pipe and issue
# utilisation of lopt_update_mma and lopt_stats launches (main's bench binary, small_fc_lopt
# section, one call a case), plus the full GPU test suite of the final bundle and memcheck over its sparse_linear tests.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d); xz -dc target/s38/base/bench-ops.xz > "$work/bench"; xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
m=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 240 "$ncu" --clock-control none --kernel-name "regex:lopt_update_mma|lopt_stats" --launch-count 12 \
  --metrics $m --csv "$work/bench" small_fc_lopt > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT/ncu.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
ix = {h: i for i, h in enumerate(head)}
byid = {}
for r in rows:
    d = byid.setdefault(r[ix["ID"]], {"name": r[ix["Kernel Name"]][:24]})
    d[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for k in sorted(byid, key=int):
    m = byid.pop(k) if False else byid[k]
    name = m.pop("name")
    print(k, name, " ".join(f"{n.split('__')[1].split('.')[0][:26]}={m[n]}" for n in sorted(m)))
PY
timeout 280 "$work/test-ops" --test-threads=4 > "$OUT/tests.log" 2>&1
echo "tests rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests.log" | head -5 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
FASTOPS_TEST_LIGHT=1 timeout 150 "$san" --tool memcheck --kernel-name kns=sparse_linear --error-exitcode 9 "$work/test-ops" sparse_linear --test-threads=1 > "$OUT/san-memcheck-sparse.log" 2>&1
echo "memcheck sparse_linear rc=$? $SECONDS s: $(grep 'ERROR SUMMARY' "$OUT/san-memcheck-sparse.log" | tail -1) | $(grep 'test result' "$OUT/san-memcheck-sparse.log" | tail -1)" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
