#!/usr/bin/env bash
# Session 37, job 1 (H200): where masked_bmm's f32 fwd+bwd goes on the H200 (main's code, fd55b66).
# ncu kernel durations of one call of each masked_bmm case; a full ncu section set of the two
# f32 span products; the bench's masked_bmm section twice.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
  timeout 150 bash target/gpu-bundle/profile.sh "$OUT/ncu" '.' 0 120 masked_bmm > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys, os, io
path = os.path.join(sys.argv[1], "ncu", "profile.csv")
text = open(path).read() if os.path.exists(path) else ""
start = text.find('"ID"')
if start < 0:
    print("ncu: no rows")
else:
    for r in csv.DictReader(io.StringIO(text[start:])):
        n = r["Kernel Name"]
        if "curand" in n or "gen_seq" in n: continue
        print(r["ID"], n[:60], r["Grid Size"] if "Grid Size" in r else "", r["Metric Value"])
PY
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 NCU_ARGS="--set full --csv --page details" \
  timeout 200 bash target/gpu-bundle/profile.sh "$OUT/full" 'span_matmul_tf32x3' 0 2 masked_bmm > "$OUT/full.log" 2>&1
echo "ncu full rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -i "Duration\|Achieved Occupancy\|Registers Per\|DRAM Throughput\|L2 Hit\|Issue Slots Busy\|Executed Ipc A\|Theoretical Occ\|Block Limit\|Compute (SM) Th\|Memory Throughput\|Waves Per SM\|Dynamic Shared" "$OUT/full/profile.csv" | cut -c1-220 | tee -a "$OUT/summary.txt"
work=$(mktemp -d); xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench"; chmod +x "$work/bench"
for round in 1 2; do
  FASTOPS_BENCH_NO_BASELINE=1 timeout 120 "$work/bench" masked_bmm > "$OUT/bench-$round.log" 2>&1
  echo "bench round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "^| masked_bmm" "$OUT/bench-$round.log" | cut -c1-110 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
