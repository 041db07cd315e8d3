#!/usr/bin/env bash
# Session 39, job 7 (H200): the portable forward in 64-key chunks at D = 256 too (one 64-row tile a
# block there: 242-249 registers, no spills). base256: main's kernels with the bench's new
# causal 4096 d256 case; new: this bundle. The d=256 rows through the portable kernels,
# alternately, two rounds; then this bundle's attention tests (portable), memcheck and synccheck
# over them and racecheck over every_dtype_shape_and_layout (the D = 256 shapes).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
xz -dc target/gpu-bundle/bin/test-ops.xz > "$work/test-ops"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
export CANDLE_FASTOPS_ATTENTION_KERNELS=portable
FASTOPS_BENCH_CASES="d=256" timeout 110 bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base256=target/s39/base256/bench-ops.xz new=target/gpu-bundle/bin/bench-ops.xz > "$OUT/ab.log" 2>&1
echo "ab rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep -v round "$OUT/ab/ab-summary.txt" | cut -c1-230 | tee -a "$OUT/summary.txt"
timeout 80 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-portable.log" 2>&1
echo "tests portable rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-portable.log" | head -5 | tee -a "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1
for tool in memcheck synccheck; do
  timeout 90 "$san" --tool $tool --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
timeout 90 "$san" --tool racecheck --racecheck-report hazard --kernel-name kns=attention_fwd --error-exitcode 9 "$work/test-ops" attention::every_dtype_shape_and_layout --exact > "$OUT/san-racecheck.log" 2>&1 &
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
