#!/usr/bin/env bash
# Session 37, job 5 (H200, the final bundle): every test of test-ops; initcheck with every kernel
# instrumented over each masked_bmm test, one per process (job 4's initcheck instrumented only the
# masked_bmm kernels, so it saw candle's writes as uninitialized).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
timeout 200 "$work/test-ops" --test-threads=4 > "$OUT/tests-all.log" 2>&1
echo "tests all rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-all.log" | head -5 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for t in $("$work/test-ops" matmul::masked_bmm_ --list 2>/dev/null | grep ': test' | sed 's/: test//'); do
  timeout 280 "$san" --tool initcheck --error-exitcode 9 "$work/test-ops" "$t" --exact --test-threads=1 > "$OUT/san-initcheck-${t##*::}.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
