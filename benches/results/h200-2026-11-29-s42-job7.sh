#!/usr/bin/env bash
# Session 42, job 7 (H200): the review commit (packed layouts through heads_first, one rank-4
# check, the bench's layout cases sharing their setup). Attention tests both ways, the token-major
# and packed > 2^31 tests (default kernels), memcheck over the attention tests both ways, the
# bench's layout cases (default kernels).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
for t in scale::masked_attention_tokens_past_2_31 scale::masked_attention_packed_past_2_31; do
  timeout 150 "$work/test-ops" $t --ignored --test-threads=1 > "$OUT/scale-$(basename $t).log" 2>&1
  echo "$t rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/scale-$(basename $t).log" | tee -a "$OUT/summary.txt"
done
FASTOPS_BENCH_CASES="packed,qkv,token-major" timeout 200 "$work/bench-ops" masked_attention > "$OUT/bench.log" 2>&1
echo "bench rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "fwd+bwd" "$OUT/bench.log" | cut -c20-240 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 280 "$san" --tool memcheck --error-exitcode 9 "$work/test-ops" attention:: --test-threads=2 > "$OUT/san-memcheck-$k.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
