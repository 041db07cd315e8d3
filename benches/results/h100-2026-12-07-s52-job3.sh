#!/usr/bin/env bash
# Session 52, job 3 (kind nvidia-h200; the card is in gpu.txt): what job 2 left unchecked, on the
# same binaries (target/s52b, carried): the attention test past 2^31 elements alone; initcheck
# (every kernel instrumented, one test thread, as target/gpu-bundle/sanitize.sh runs it) over the
# attention gradient tests that take the forward-zeroed dq accumulator, a process each; ncu times
# of the documents case's attention kernels (the forward with and without the zeroing).
#   OUT=DIR bash benches/results/h100-2026-12-07-s52-job3.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s52b/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-final test-final; do xz -dc target/s52b/$b.xz > "$work/$b" & done; wait; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 150 "$work/test-final" scale::masked_attention_past_2_31 --exact --ignored > "$OUT/tests-scale.log" 2>&1
echo "tests scale rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked" "$OUT/tests-scale.log" | head -3 | tee -a "$OUT/summary.txt"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
FASTOPS_BENCH_CASES="^documents" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
  timeout 60 "$ncu" --clock-control none --kernel-name regex:"attention" --metrics gpu__time_duration.sum --csv "$work/bench-final" masked_attention > "$OUT/ncu-final.csv" 2>&1
echo "ncu rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep -E '^"[0-9]' "$OUT/ncu-final.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 | head -16 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
for f in attention::second_backward_of_one_graph_matches_the_first attention::gradients_match_composed_attention attention::long_sequences_gradients_every_mask; do
  FASTOPS_TEST_LIGHT=1 timeout 230 "$san" --tool initcheck --error-exitcode 9 "$work/test-final" "$f" --exact --test-threads=1 > "$OUT/san-initcheck-${f#attention::}.log" 2>&1 &
done
wait
for f in "$OUT"/san-initcheck-*.log; do
  echo "$(basename "$f"): $(grep -E 'SUMMARY' "$f" | tail -1) | $(grep '^test result' "$f" | tail -1)" | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
