#!/usr/bin/env bash
# Session 40, job 5 (H200): dq_rows through a shared tile, whole 16-byte pieces of dq rows (v5)
# against v3 (job 4's code). The attention tests through the portable and default kernels (v5) and
# the > 2^31 test both ways; ncu times of dq_rows in both binaries; the masked_attention section of
# both alternately, two rounds, default and portable kernels; then memcheck / synccheck / racecheck
# over the attention tests (attention kernels instrumented) and initcheck on two gradient tests,
# with the portable and the default kernels.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"
xz -dc target/s40/v3/bench-ops.xz > "$work/v3"; xz -dc target/s40/v5/bench-ops.xz > "$work/v5"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 60 "$work/test-ops" scale::masked_attention_past_2_31 --ignored --test-threads=1 > "$OUT/scale-$k.log" 2>&1
  echo "scale $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k.log" | tee -a "$OUT/summary.txt"
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for b in v3 v5; do
  for k in portable default; do
    for c in "causal b=4 h=16 n=4096 d=128" "documents 1024 causal b=4 h=16 n=8192 d=128"; do
      CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_CASES="$c" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
        timeout 100 "$ncu" --clock-control none --kernel-name "regex:dq_rows" --launch-count 1 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv "$work/$b" masked_attention > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
      python3 - "$OUT/ncu.csv" "$b $k ${c%% b=*}" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[2], "no rows"); sys.exit()
head = rows[0]; ix = {h: i for i, h in enumerate(head)}
print(sys.argv[2], rows[1][ix["Kernel Name"]][:32], " ".join(f'{r[ix["Metric Name"]]}={r[ix["Metric Value"]]}' for r in rows[1:]))
PY
    done
  done
done
for k in default portable; do
  FASTOPS_BENCH_CASES="d=128,d=64" CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 bash scripts/ab-bench.sh "$OUT/ab-$k" 2 masked_attention v3="$work/v3" v5="$work/v5" > "$OUT/ab-$k.log" 2>&1
  echo "ab $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v "round" "$OUT/ab-$k/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  for tool in memcheck synccheck racecheck; do
    extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_dq_rows --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool-$k.log" 2>&1 &
  done
  for t in gradients_match_composed_attention queries_before_the_keys_have_zero_gradients; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::$t --exact --test-threads=1 > "$OUT/san-initcheck-$t-$k.log" 2>&1 &
  done
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
