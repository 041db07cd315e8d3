#!/usr/bin/env bash
# Session 43, job 3 (H200): is the explicit backward's missing saving at causal 8192 the board's
# power limit? The causal 8192 d128 case alone (forward, autograd fwd+bwd, explicit fwd+bwd; no
# baselines), both kernel paths, with the GPU idle 0 or 20 ms after each timed call
# (FASTOPS_BENCH_COOL_MS), two rounds; SM clock, power and throttle reasons sampled every 20 ms.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,clocks_throttle_reasons.active --format=csv,nounits -lms 20 > "$OUT/smi.csv" 2>&1 &
smi=$!
for round in 1 2; do
  for k in default portable; do
    for cool in 0 20; do
      echo "start $k cool $cool round $round $(date +%H:%M:%S.%N)" >> "$OUT/phases.txt"
      CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_COOL_MS=$cool FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" timeout 120 "$work/bench-ops" masked_attention > "$OUT/bench-$k-$cool-$round.log" 2>&1
      echo "bench $k cool $cool round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
      grep "n=8192" "$OUT/bench-$k-$cool-$round.log" | cut -c20-120 | tee -a "$OUT/summary.txt"
      echo "end $k cool $cool round $round $(date +%H:%M:%S.%N)" >> "$OUT/phases.txt"
    done
  done
done
kill $smi
head -3 "$OUT/smi.csv" >> "$OUT/summary.txt"
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import sys, os
out = sys.argv[1]
rows = []
for l in open(os.path.join(out, "smi.csv")):
    p = [x.strip() for x in l.split(",")]
    if len(p) < 4 or not p[0][:4].isdigit(): continue
    try: rows.append((p[0].split()[1], int(p[1]), float(p[2]), p[3]))
    except ValueError: pass
ph = [l.split() for l in open(os.path.join(out, "phases.txt"))]
for i in range(0, len(ph), 2):
    s, e = ph[i][-1][:12], ph[i+1][-1][:12]
    sel = [r for r in rows if s <= r[0][:12] <= e and r[2] > 300]
    if not sel: continue
    clk = sorted(r[1] for r in sel); pw = sorted(r[2] for r in sel)
    capped = sum(1 for r in sel if r[3].endswith("4"))
    print(" ".join(ph[i][1:5]), "busy samples", len(sel), "sm clock min/median", clk[0], clk[len(clk)//2], "power median/max", pw[len(pw)//2], pw[-1], "power-capped", capped)
PY
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
