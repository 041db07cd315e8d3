#!/usr/bin/env bash
# Session 52, job 2 (kind nvidia-h200; the card it ran on is in gpu.txt): the final code of the
# change (the Hopper forward zeroes the backward's dq accumulator when gradients are tracked)
# against main (base).
# The attention tests; the attention tests past 2^31 elements beside memcheck / racecheck /
# initcheck / synccheck over the attention tests (the crate's attention kernels); then the A/B
# (scripts/ab-bench.sh, two rounds, issue 18's rows) and PyTorch's anchors for masked_attention.
# Binaries: target/s52b/{bench-base,bench-final,test-final}.xz (xz -6 of the release
# `cargo build --release --features cuda --bench ops --test ops` outputs; base from main 8d0ad7a's
# kernels); libs.sh as scripts/gpu-bundle.sh writes it. Carry target/s52b; from the repo root:
#   OUT=DIR bash benches/results/h100-2026-12-07-s52-job2.sh
set -u
OUT=${OUT:?}
mkdir -p target/gpu-bundle && cp target/s52b/libs.sh target/gpu-bundle/libs.sh
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in bench-base bench-final test-final; do xz -dc target/s52b/$b.xz > "$work/$b" & done; wait; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
t() { # name, timeout, binary, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/tests-$name.log" 2>&1
  echo "tests $name rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$name.log" | head -5 | tee -a "$OUT/summary.txt"
}
t attention 100 "$work/test-final" attention:: --test-threads=4
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
(t scale 200 "$work/test-final" scale::masked_attention --ignored --test-threads=1) &
for tool in memcheck racecheck initcheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra+=(--racecheck-report hazard)
  FASTOPS_TEST_LIGHT=1 timeout 180 "$san" --tool $tool --kernel-name kns=attention "${extra[@]}" --error-exitcode 9 "$work/test-final" attention:: --test-threads=2 > "$OUT/san-$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck initcheck synccheck; do
  echo "$tool: $(grep -E 'SUMMARY' "$OUT/san-$tool.log" | tail -1) | $(grep '^test result' "$OUT/san-$tool.log" | tail -1)" | tee -a "$OUT/summary.txt"
done
echo "checks $SECONDS s" | tee -a "$OUT/summary.txt"
export FASTOPS_BENCH_CASES="^documents,^causal b=4 h=16 n=4096 d=128,^causal b=4 h=16 n=8192 d=128,^window,^causal b=4 h=16 n=4096 d=64"
bash scripts/ab-bench.sh "$OUT/ab" 2 masked_attention base="$work/bench-base" final="$work/bench-final" > /dev/null 2>&1
grep -v "packed\|projection\|token-major" "$OUT/ab/ab-summary.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "ab $SECONDS s" | tee -a "$OUT/summary.txt"
left=$((585 - SECONDS)); [ $left -gt 200 ] && left=200
[ $left -gt 30 ] && timeout $left python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
cut -c1-200 "$OUT/torch.jsonl" >> "$OUT/summary.txt" 2>/dev/null
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
