#!/usr/bin/env bash
# Session 44, job 4 (H200; the final code): the attention tests (the new
# windows_wider_than_the_sequence_are_causal among them) through the default and the portable
# kernels, then memcheck over the new test.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED\|windows_wider" "$OUT/tests-$k.log" | head -6 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$san" --tool memcheck --error-exitcode 3 "$work/test-ops" attention::windows_wider --test-threads=1 > "$OUT/memcheck-$k.log" 2>&1
  echo "memcheck windows_wider $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "ERROR SUMMARY\|test result" "$OUT/memcheck-$k.log" | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
