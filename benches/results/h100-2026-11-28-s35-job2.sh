#!/usr/bin/env bash
# Session 35, job 2: documents in runs through the one-pass backward too. Attention tests (portable),
# the bench's d=128 rows (portable; fwd+bwd: one pass, "vs deterministic": two passes), PyTorch's
# anchors in the same job, and every kernel of one causal 4096 fwd+bwd call under ncu (durations).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-ops"; chmod +x "$work"/*
nvidia-smi -L > "$OUT/gpu.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
timeout 120 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-portable.log" 2>&1
echo "tests portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-portable.log" | head -5 | tee -a "$OUT/summary.txt"
FASTOPS_BENCH_CASES="d=128" FASTOPS_BENCH_OUT=$OUT/bench.jsonl "$work/bench-ops" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "d=128" "$OUT/bench.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
timeout 300 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "d=128\|n=4096\|n=8192" "$OUT/torch.jsonl" | tee -a "$OUT/summary.txt"
FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="causal b=4 h=16 n=4096 d=128" \
  timeout 120 bash target/gpu-bundle/profile.sh "$OUT/ncu" '.' 0 60 masked_attention > "$OUT/ncu.log" 2>&1
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
        print(r["ID"], r["Kernel Name"][:60], r["Grid Size"] if "Grid Size" in r else "", r["Metric Value"])
PY
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
