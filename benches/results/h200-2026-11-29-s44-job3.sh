#!/usr/bin/env bash
# Session 44, job 3 (H200): job 2's probe at causal 8192 (Hopper kernels) twice, with the SM clock,
# power and throttle reasons sampled every 100 ms beside it; per form, the samples taken while it
# ran (the probe prints a timestamp before each form).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s44/probe.xz > "$work/probe"; chmod +x "$work/probe"
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
smi=$!
sleep 1
for round in 1 2; do
  N=8192 PROBE_STAMPS=1 timeout 200 "$work/probe" > "$OUT/probe-$round.log" 2>&1
  echo "probe round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; cat "$OUT/probe-$round.log" | tee -a "$OUT/summary.txt"
done
sleep 1
kill $smi
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import sys, os, datetime, collections
out = sys.argv[1]
def ts(s):
    return datetime.datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
samples = []
for l in open(os.path.join(out, "smi.csv")):
    p = [x.strip() for x in l.split(",")]
    if len(p) < 5 or not p[1][0].isdigit(): continue
    samples.append((ts(p[0]), int(p[1].split()[0]), float(p[2].split()[0]) if p[2][0].isdigit() else 0.0, p[4]))
for r in (1, 2):
    stamps = []
    for l in open(os.path.join(out, f"probe-{r}.log")):
        if l.startswith("stamp "):
            _, t, name = l.rstrip("\n").split(" ", 2)
            stamps.append((float(t), name))
    for (t0, name), (t1, _) in zip(stamps, stamps[1:]):
        sel = [s for s in samples if t0 <= s[0] < t1]
        if not sel: continue
        clk = sorted(s[1] for s in sel); pw = sorted(s[2] for s in sel)
        th = collections.Counter(s[3] for s in sel)
        print(f"round {r} {name:40} n={len(sel):3} sm clock median {clk[len(clk)//2]} min {clk[0]}  power median {pw[len(pw)//2]:.0f} max {pw[-1]:.0f}  throttle {dict(th)}")
clk = sorted(s[1] for s in samples)
print("all samples", len(samples), "first", samples[0][0] if samples else None, "clock median", clk[len(clk)//2] if clk else None, "min", clk[0] if clk else None)
PY
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
