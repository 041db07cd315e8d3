#!/usr/bin/env bash
# Session 42, job 5 (H200): the final code (a value head dim that is not a multiple of 8 takes the
# view form in masked_attention_tokens; a dv = 20 case in its test). Attention tests both ways;
# memcheck and initcheck on the token-major test, both ways.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention::token --test-threads=2 > "$OUT/san-memcheck-$k.log" 2>&1 &
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" attention::token_major_operands_match_the_views --exact --test-threads=1 > "$OUT/san-initcheck-$k.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
