#!/usr/bin/env bash
# Session 38, job 4 (H200): L1 and L2 hit rates of every f32 sparse_linear forward launch in the
# bench's sparse_linear section (main's binary, one call a case), to compare the 22528-row and
# the 1024-row (L2-resident) cases.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
work=$(mktemp -d); xz -dc target/s38/base/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 200 "$ncu" --clock-control none --kernel-name "regex:sparse_linear_fwd_vec1_f32" \
  --metrics gpu__time_duration.sum,l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct,lts__t_sectors.sum,l1tex__t_sectors.sum,launch__grid_size \
  --csv "$work/bench" sparse_linear > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT/ncu.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
ix = {h: i for i, h in enumerate(head)}
byid = {}
for r in rows:
    byid.setdefault(r[ix["ID"]], {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for k in sorted(byid, key=int):
    m = byid[k]
    print(k, " ".join(f"{n.split('__')[1][:22]}={m[n]}" for n in sorted(m)))
PY
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
