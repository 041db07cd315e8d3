#!/usr/bin/env bash
# Session 42, job 4 (H200): masked_attention_tokens (token-major q [b, m, h, d], k / v [b, n, hk,
# d], output [b, m, h, dv]; gradients written token-major in place). Attention tests both ways,
# the > 2^31 tests (tokens, packed, plain) both ways; the bench's n=4096 d=128 rows both ways, two
# rounds; ncu of the token-major call; memcheck over the attention tests, initcheck and racecheck
# on the token tests, both ways.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-ops test-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  for t in scale::masked_attention_tokens_past_2_31 scale::masked_attention_packed_past_2_31 scale::masked_attention_past_2_31; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" $t --ignored --test-threads=1 > "$OUT/scale-$k-$(basename $t).log" 2>&1
    echo "$t $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$k-$(basename $t).log" | tee -a "$OUT/summary.txt"
  done
done
for round in 1 2; do
  for k in portable default; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_CASES="n=4096 d=128" timeout 250 "$work/bench-ops" masked_attention > "$OUT/bench-$k-$round.log" 2>&1
    echo "bench $k round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "n=4096 d=128" "$OUT/bench-$k-$round.log" | cut -c1-270 | tee -a "$OUT/summary.txt"
  done
done
mkdir -p "$OUT/ncu"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
CANDLE_FASTOPS_ATTENTION_KERNELS=default FASTOPS_BENCH_CASES="token-major" FASTOPS_BENCH_CALLS=0,1 timeout 200 "$ncu" --clock-control none \
  --metrics gpu__time_duration.sum --csv "$work/bench-ops" masked_attention > "$OUT/ncu/profile.csv" 2> "$OUT/ncu/profile.err"
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys, os, io
text = open(os.path.join(sys.argv[1], "ncu", "profile.csv")).read()
start = text.find('"ID"')
rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
for r in rows:
    n = r["Kernel Name"]
    if "curand" in n or "gen_seq" in n: continue
    print(r["ID"], n[:50], r["Grid Size"], r["Metric Value"])
PY
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention:: --test-threads=2 > "$OUT/san-memcheck-$k.log" 2>&1 &
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::token_major_operands_match_the_views --exact --test-threads=1 > "$OUT/san-initcheck-$k.log" 2>&1 &
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool racecheck --error-exitcode 9 "$work/test-ops" attention::token --test-threads=1 > "$OUT/san-racecheck-$k.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
