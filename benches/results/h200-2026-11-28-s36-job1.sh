#!/usr/bin/env bash
# Session 36, job 1: row statistics by cp.async, per-warp tile spans, and an instance per mask
# family (generated / runs / stored) for the portable kernels. Attention tests (portable, default),
# then an A/B of the bench's d=128 rows, portable forced: main's bench (base) and this change's,
# alternately, two rounds; stored documents (CANDLE_FASTOPS_ATTENTION_RUNS=0) once each; ncu
# kernel durations of one causal 4096 fwd+bwd call.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-new"
xz -dc target/s36/base/bench-ops.xz > "$work/bench-base"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1
for round in 1 2; do
  for v in base new; do
    FASTOPS_BENCH_CASES="d=128" timeout 150 "$work/bench-$v" masked_attention > "$OUT/ab-$v-$round.log" 2>&1
    echo "ab $v round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "d=128" "$OUT/ab-$v-$round.log" | cut -c20-130 | tee -a "$OUT/summary.txt"
  done
done
for v in base new; do
  CANDLE_FASTOPS_ATTENTION_RUNS=0 FASTOPS_BENCH_CASES="documents" timeout 100 "$work/bench-$v" masked_attention > "$OUT/ab-stored-$v.log" 2>&1
  echo "stored documents $v rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "d=128" "$OUT/ab-stored-$v.log" | cut -c20-130 | tee -a "$OUT/summary.txt"
done
cp "$work/bench-new" "$work/bench-ops"
FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_CASES="causal b=4 h=16 n=4096 d=128" \
  timeout 100 bash target/gpu-bundle/profile.sh "$OUT/ncu" '.' 0 40 masked_attention > "$OUT/ncu.log" 2>&1
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
        if "curand" in r["Kernel Name"] or "gen_seq" in r["Kernel Name"] or "cast_f32" in r["Kernel Name"]: continue
        print(r["ID"], r["Kernel Name"][:60], r["Metric Value"])
PY
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
