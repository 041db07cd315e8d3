#!/usr/bin/env bash
# Session 40, job 2 (H200): the delta pass reading 16 bytes a lane over several rows a warp (v3)
# against main (base). The attention tests through the portable and the default kernels (v3);
# ncu times of the delta kernel in both binaries (causal bf16 b4 h16 n4096 d128); a SASS-level
# profile of main's one-pass backward (where its shared-memory bank conflicts are); then the
# masked_attention section of both binaries alternately, two rounds, portable and default kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"
xz -dc target/s40/base/bench-ops.xz > "$work/base"; xz -dc target/s40/v3/bench-ops.xz > "$work/v3"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
case4096="causal b=4 h=16 n=4096 d=128"
for b in base v3; do
  for k in portable default; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_CASES="$case4096" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,2 \
      timeout 100 "$ncu" --clock-control none --kernel-name "regex:attention_delta|dq_rows" --launch-count 4 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv "$work/$b" masked_attention > "$OUT/ncu-delta-$b-$k.csv" 2> "$OUT/ncu-delta-$b-$k.err"
    echo "ncu delta $b $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    python3 - "$OUT/ncu-delta-$b-$k.csv" "$b $k" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[2], "no rows"); sys.exit()
head = rows[0]; ix = {h: i for i, h in enumerate(head)}
for r in rows[1:]:
    print(sys.argv[2], r[ix["ID"]], r[ix["Kernel Name"]][:32], r[ix["Metric Name"]], r[ix["Metric Value"]])
PY
  done
done
CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_CASES="$case4096" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
  timeout 200 "$ncu" --clock-control none --kernel-name "regex:attention_bwd_generated" --launch-count 1 --set full --import-source no -o "$work/bwd" "$work/base" masked_attention > "$OUT/ncu-bwd-sass.err" 2>&1
echo "ncu bwd sass rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
"$ncu" --import "$work/bwd.ncu-rep" --page source --print-source sass --csv | xz -9 > "$OUT/bwd-source.csv.xz"
"$ncu" --import "$work/bwd.ncu-rep" --page details --csv | xz -9 > "$OUT/bwd-details.csv.xz"
echo "ncu export $SECONDS s" | tee -a "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 300 bash scripts/ab-bench.sh "$OUT/ab-$k" 2 masked_attention base="$work/base" v3="$work/v3" > "$OUT/ab-$k.log" 2>&1
  echo "ab $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v "round" "$OUT/ab-$k/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt ! -name 'bwd-*.xz' -delete && mv /tmp/logs.tgz "$OUT/"
