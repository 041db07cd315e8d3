#!/usr/bin/env bash
# Session 51, job 1 (H200; written, NOT RUN: no GPU came this session): two units a block in the Hopper attention kernels, against main:
#   the backward's block takes key blocks p and key_blocks - 1 - p of a (batch, kv head) (session
#   47's diff), with dk / dv staged in two Q / dO stages instead of the K / V tiles, so that the
#   second unit's K / V and first Q / dO copies start before the first unit's dk / dv stores; the
#   forward of documents in runs takes row blocks r and row_blocks - 1 - r of a head, the second's
#   Q copied during the first, its K / V streamed on by the producer. The host pairs units on
#   grids of at least 4 waves (CANDLE_FASTOPS_ATTENTION_PAIRS=1 / =0 forces it on / off); the
#   kernels read the choice from their grid.
# The attention tests with pairing forced and by default (small tests: unpaired), the matmul
# backward tests (their new narrowed-a case), the attention tests past 2^31 elements (paired);
# main's bench (`base`) against this one (`f1`), alternately, two rounds, on issue 18's attention
# rows (documents, causal 4096 and 8192 at d128); memcheck / racecheck over the attention tests
# with pairing forced; ncu kernel
# times. Binaries: target/s51/{bench-base,bench-f1,test-f1}.xz, each xz -6 of the release
# `cargo build --release --features cuda --bench ops --test ops` outputs (target/release/deps/ops-*):
# bench-base from main, bench-f1 / test-f1 with benches/results/h200-2026-12-07-s51-two-unit.diff
# applied; target/s51/libs.sh is the libs.sh that scripts/gpu-bundle.sh writes. Carry target/s51
# and run from the repo root (about 6 minutes):
#   OUT=DIR bash benches/results/h200-2026-12-07-s51-job1.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s51/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-base bench-f1 test-f1; do xz -dc target/s51/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
t() { # name, timeout, binary, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$name.log" | head -5 | tee -a "$OUT/summary.txt"
}
t paired-attention 150 env CANDLE_FASTOPS_ATTENTION_PAIRS=1 "$work/test-f1" attention:: --test-threads=4
t default-attention 100 "$work/test-f1" attention:: --test-threads=4
t default-mbmm 80 "$work/test-f1" masked_bmm_backward --test-threads=4
t paired-scale 60 env CANDLE_FASTOPS_ATTENTION_PAIRS=1 "$work/test-f1" scale::masked_attention --ignored --test-threads=1
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base="$work/bench-base" f1="$work/bench-f1" > /dev/null 2>&1
grep -v "packed\|projection\|token-major" "$OUT/ab/ab-summary.txt" | cut -c1-160 | tee -a "$OUT/summary.txt"
echo "ab $SECONDS s" | tee -a "$OUT/summary.txt"
unset FASTOPS_BENCH_CASES
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
left=$((320 - SECONDS)); [ $left -gt 75 ] && left=75
if [ $left -gt 60 ]; then
  export FASTOPS_TEST_LIGHT=1
  for tool in memcheck racecheck; do
    extra=(--kernel-name kns=attention_bwd_sm90 --kernel-name kns=attention_fwd_sm90); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
    CANDLE_FASTOPS_ATTENTION_PAIRS=1 timeout $left "$san" --tool $tool "${extra[@]}" --error-exitcode 9 "$work/test-f1" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
  done
  wait
  for tool in memcheck racecheck; do
    echo "$tool: $(grep -E 'SUMMARY' "$OUT/san-$tool.log" | tail -1) | $(grep '^test result' "$OUT/san-$tool.log" | tail -1)" | tee -a "$OUT/summary.txt"
  done
fi
export FASTOPS_BENCH_CASES
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
[ $SECONDS -lt 300 ] && for v in base f1; do
  bin="$work/bench-$v"
  FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128" FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 \
    timeout 25 "$ncu" --clock-control none --kernel-name regex:"attention_(bwd|fwd)_sm90" --metrics gpu__time_duration.sum --csv "$bin" masked_attention > "$OUT/ncu-$v.csv" 2>&1
  echo "ncu $v rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '"attention' "$OUT/ncu-$v.csv" | awk -F'","' '{print $5, $(NF)}' | sed 's/"//g' | cut -c1-120 | head -12 | tee -a "$OUT/summary.txt"
done
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
