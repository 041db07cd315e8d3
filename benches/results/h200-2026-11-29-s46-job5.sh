#!/usr/bin/env bash
# Session 46, job 5 (H200; the final code, job 3's bundle): is the causal 8192 portable forward's
# process-to-process bimodality the board's clock? Six bench processes of that case (portable, 10
# warm-up and 100 timed calls a row) with nvidia-smi sampling SM clock, power and clock-event
# reasons every 50 ms (the first 6 busy samples: the forward row's calls), and SDPA flash (two
# processes, two rounds each; every busy sample) the same way.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
sample() { nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu --format=csv,noheader -lms 50 > "$1" 2>/dev/null & echo $!; }
summarize() { python3 - "$1" "$2" <<'PY'
import sys
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
busy = [r for r in rows if float(r[2].split()[0]) > 300][:int(sys.argv[2])]
if not busy: print("no busy samples"); sys.exit()
clk = sorted(int(r[1].split()[0]) for r in busy); pw = [float(r[2].split()[0]) for r in busy]
cap = sum(1 for r in busy if int(r[3], 16) & 0x4)
print(f"busy samples {len(busy)}: SM clock median {clk[len(clk)//2]} MHz (min {clk[0]}), power mean {sum(pw)/len(pw):.0f} W, power-capped {cap}, temp {busy[-1][4]} C")
PY
}
for i in 1 2 3 4 5 6; do
  pid=$(sample "$OUT/smi-ours-$i.csv")
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=10,100 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" timeout 60 "$work/bench-ops" masked_attention > "$OUT/bench-$i.log" 2>&1
  kill $pid
  echo "ours $i: $(grep 'n=8192 d=128 forward ' "$OUT/bench-$i.log" | awk -F'|' '{printf "%s", $6}') us | $(summarize "$OUT/smi-ours-$i.csv" 6)" | tee -a "$OUT/summary.txt"
  if [ $i = 3 ] || [ $i = 6 ]; then
    pid=$(sample "$OUT/smi-fa2-$i.csv")
    timeout 60 python3 target/s46/fa2_8192.py 2 > "$OUT/fa2-$i.jsonl" 2> "$OUT/fa2-$i.err"
    kill $pid
    echo "fa2 after $i: $(tr '\n' ' ' < "$OUT/fa2-$i.jsonl") | $(summarize "$OUT/smi-fa2-$i.csv" 1000)" | tee -a "$OUT/summary.txt"
  fi
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
