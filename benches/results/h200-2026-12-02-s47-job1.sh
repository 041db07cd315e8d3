#!/usr/bin/env bash
# Session 47, job 1 (H200): v1 = the Hopper forward / backward skip the products of a warpgroup's
# empty mask tile (FORMULA and RUNS instances). The attention tests through the default (Hopper)
# kernels (v1); main's bench and v1's alternately, default kernels, no baselines, four rounds;
# then PyTorch's attention anchors in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/s47/test-v1.xz > "$work/test-ops"
for b in main v1; do xz -dc target/s47/bench-$b.xz > "$work/bench-$b"; done
chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
CANDLE_FASTOPS_ATTENTION_KERNELS=default timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-default.log" 2>&1
echo "tests attention default rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-default.log" | head -8 | tee -a "$OUT/summary.txt"
cases="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^documents,^causal b=4 h=16 n=4096 d=64,^dense"
for round in 1 2 3 4; do
  for bin in bench-main bench-v1; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=default FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" timeout 100 "$work/$bin" masked_attention > "$OUT/$bin-$round.log" 2>&1
    echo "$bin round $round rc=$? $SECONDS s" >> "$OUT/summary.txt"
  done
  [ $SECONDS -gt 380 ] && break
done
python3 - "$OUT" >> "$OUT/summary.txt" <<'PY'
import sys, glob, statistics, collections
out = sys.argv[1]
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(f"{out}/bench-*-*.log")):
    binname = f.split("/")[-1].rsplit("-", 1)[0]
    for line in open(f):
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and ("forward" in cells[2] or "fwd+bwd" in cells[2]) and not any(x in cells[2] for x in ("packed", "projection", "token-major", "deterministic", "transposed", "reshape")):
            try: rows[cells[2]][binname].append(float(cells[5]))
            except ValueError: pass
for case, by in rows.items():
    base = statistics.mean(by["bench-main"]) if by["bench-main"] else None
    parts = []
    for b in ("bench-main", "bench-v1"):
        v = by[b]
        if not v: continue
        m = statistics.mean(v)
        parts.append(f"{b[6:]} {'/'.join(f'{x:.0f}' for x in v)} (mean {m:.1f}{'' if base is None or b=='bench-main' else f', {100*(m/base-1):+.1f}%'})")
    print(f"{case[:62]:62s} | " + " | ".join(parts))
PY
timeout $((580 - SECONDS)) python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | cut -c1-220 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
cp "$OUT"/torch.jsonl /tmp/ 2>/dev/null
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
mv /tmp/torch.jsonl "$OUT/" 2>/dev/null
