#!/usr/bin/env bash
# Session 37, job 2 (H200): the span products longest first (span_tile) and lse_log2 through
# row_lse2. Matmul and attention tests (portable, default), the masked_bmm > 2^31 test; A/B of the
# bench's masked_bmm section, main's binary (base) and this change's (new) alternately, three
# rounds; ncu durations of one call; memcheck / racecheck over the masked_bmm backward tests.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; xz -dc target/gpu-bundle/bin/bench-ops.xz > "$work/bench-new"
xz -dc target/s37/base/bench-ops.xz > "$work/bench-base"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 120 "$work/test-ops" matmul --test-threads=4 > "$OUT/tests-matmul.log" 2>&1
echo "tests matmul rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-matmul.log" | head -5 | tee -a "$OUT/summary.txt"
timeout 60 "$work/test-ops" scale::masked_bmm_past_2_31 --ignored --test-threads=1 > "$OUT/scale-mbmm.log" 2>&1
echo "scale masked_bmm rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-mbmm.log" | tee -a "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
export FASTOPS_BENCH_NO_BASELINE=1
for round in 1 2 3; do
  for v in base new; do
    timeout 100 "$work/bench-$v" masked_bmm > "$OUT/ab-$v-$round.log" 2>&1
    echo "ab $v round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "^| masked_bmm" "$OUT/ab-$v-$round.log" | grep "plan  \|fwd+bwd" | cut -c14-100 | tee -a "$OUT/summary.txt"
  done
done
cp "$work/bench-new" "$work/bench-ops"
FASTOPS_BENCH_CALLS=0,1 timeout 100 bash target/gpu-bundle/profile.sh "$OUT/ncu" 'span_matmul' 0 16 masked_bmm > "$OUT/ncu.log" 2>&1
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
        print(r["ID"], r["Kernel Name"][:40], r["Grid Size"], r["Metric Value"])
PY
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for tool in memcheck racecheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 200 "$san" --tool $tool "${extra[@]}" --kernel-name kns=span_matmul --error-exitcode 9 "$work/test-ops" matmul::masked_bmm_ --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
