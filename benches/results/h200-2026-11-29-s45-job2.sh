#!/usr/bin/env bash
# Session 45, job 2 (H200): v2 = v1 (the one-pass backward with one barrier per query tile,
# Swizzled128 tiles) + the portable forward's tiles swizzled (Swizzled<D>, padding unused). The
# attention tests through the portable and the default kernels (v2); A/B/C, the benches of main
# (base), v1 and v2 alternately, portable forced, no baselines, two rounds; ncu sections of the
# portable forward and one-pass backward at causal 8192, base and v2; then memcheck, racecheck
# and synccheck over the attention tests, portable, light sizes, the attention kernels
# instrumented (v2).
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done
xz -dc target/s45/bench-base.xz > "$work/bench-base"; xz -dc target/s45/bench-v1.xz > "$work/bench-v1"
mv "$work/bench-ops" "$work/bench-v2"; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 150 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -6 | tee -a "$OUT/summary.txt"
done
cases="^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^documents,^causal b=4 h=16 n=4096 d=64"
for round in 1 2; do
  for bin in bench-base bench-v1 bench-v2; do
    CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CASES="$cases" timeout 150 "$work/$bin" masked_attention > "$OUT/$bin-$round.log" 2>&1
    echo "$bin round $round rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
    grep "forward\|fwd+bwd" "$OUT/$bin-$round.log" | grep -v "vs deterministic\|packed\|projection\|token-major" | cut -c20-100 | tee -a "$OUT/summary.txt"
  done
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
for bin in bench-base bench-v2; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=portable FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 FASTOPS_BENCH_CASES="^causal b=4 h=16 n=8192 d=128" \
    timeout 200 "$ncu" --clock-control none --kernel-name "regex:attention_(fwd|bwd)_generated_d128_bf16" --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section LaunchStats --section Occupancy \
    --csv --page details "$work/$bin" masked_attention > "$OUT/ncu-$bin.csv" 2> "$OUT/ncu-$bin.err"
  echo "ncu $bin rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -i "\"Duration\"\|Shared Load\|Shared Store\|Stall Barrier\|Warp Cycles Per Issued\|Registers Per\|L1/TEX Cache Throughput\|Bank" "$OUT/ncu-$bin.csv" | awk -F'","' '{print $5" | "$(NF-2)" | "$(NF-1)" | "$NF}' | cut -c1-160 | tee -a "$OUT/summary.txt"
done
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
export FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  timeout 330 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1)" | tee -a "$OUT/summary.txt"; done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
