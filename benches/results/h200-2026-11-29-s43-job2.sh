#!/usr/bin/env bash
# Session 43, job 2 (H200): causal 8192 d128, where job 1's explicit backward saved nothing against
# autograd (while documents / window at 8192 saved ~1 ms): three rounds of that case both ways with
# the SM clock, power and throttle reasons sampled beside; ncu kernel times of one call of each;
# then memcheck over the new tests both ways and initcheck on the explicit-backward test.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > "$OUT/smi.csv" 2>&1 &
smi=$!
for round in 1 2 3; do
  for k in default portable; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_CASES="causal b=4 h=16 n=8192 d=128" timeout 120 "$work/bench-ops" masked_attention > "$OUT/bench-$k-$round.log" 2>&1
    echo "bench $k round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "fwd+bwd" "$OUT/bench-$k-$round.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
  done
done
kill $smi
python3 - "$OUT/smi.csv" <<'PY' | tee -a "$OUT/summary.txt"
import sys, collections
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l[0].isdigit()]
clk = [int(r[1].split()[0]) for r in rows if len(r) > 5]
pw = [float(r[3].split()[0]) for r in rows if len(r) > 5 and r[3][0].isdigit()]
th = collections.Counter(r[5] for r in rows if len(r) > 5)
print("sm clock min/median/max", min(clk), sorted(clk)[len(clk)//2], max(clk), "power max", max(pw), "throttle", dict(th))
PY
mkdir -p "$OUT/ncu"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
CANDLE_FASTOPS_ATTENTION_KERNELS=default FASTOPS_BENCH_NO_BASELINE= FASTOPS_BENCH_CASES="causal b=4 h=16 n=8192 d=128" FASTOPS_BENCH_CALLS=0,1 timeout 200 "$ncu" --clock-control none \
  --metrics gpu__time_duration.sum --csv "$work/bench-ops" masked_attention > "$OUT/ncu/profile.csv" 2> "$OUT/ncu/profile.err"
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" <<'PY' > "$OUT/ncu/kernels.txt"
import csv, sys, os, io
text = open(os.path.join(sys.argv[1], "ncu", "profile.csv")).read()
start = text.find('"ID"')
rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
for r in rows:
    n = r["Kernel Name"]
    if "curand" in n or "gen_seq" in n: continue
    print(r["ID"], n[:50], r["Grid Size"], r["Metric Value"])
PY
tail -n 40 "$OUT/ncu/kernels.txt" | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention::explicit attention::split --test-threads=2 > "$OUT/san-memcheck-$k.log" 2>&1 &
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::split_keys_backward_sums_to_the_whole --exact --test-threads=1 > "$OUT/san-initcheck-$k.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
