#!/usr/bin/env bash
# Session 46, job 3 (H200; the final code: v4 of job 2 — the generated-mask instances' two-stage
# pipeline with one barrier an item, the generated-mask forward's tiles swizzled at head dim 128,
# each fragment row's maximum by a tree). memcheck, racecheck and synccheck over the attention
# tests through the portable kernels (light sizes, the attention kernels instrumented) beside the
# attention tests through the default and the portable kernels and the attention tests past 2^31
# elements (both kernel sets); then the bench's attention section through the portable and the
# default kernels (composite baselines, explicit fwd+bwd) and PyTorch's anchors in the same job.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
san=$(command -v compute-sanitizer || find /opt /usr/local -name compute-sanitizer -type f 2>/dev/null | head -n1)
for tool in memcheck racecheck synccheck; do
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  FASTOPS_TEST_LIGHT=1 CANDLE_FASTOPS_ATTENTION_KERNELS=portable timeout 300 "$san" --tool $tool "${extra[@]}" --kernel-name kns=attention_ --error-exitcode 9 "$work/test-ops" attention:: --test-threads=4 > "$OUT/san-$tool.log" 2>&1 &
done
for k in default portable; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 200 "$work/test-ops" attention:: --test-threads=4 > "$OUT/tests-$k.log" 2>&1
  echo "tests attention $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-$k.log" | head -5 | tee -a "$OUT/summary.txt"
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k timeout 120 "$work/test-ops" scale::masked_attention --ignored --test-threads=1 > "$OUT/tests-scale-$k.log" 2>&1
  echo "tests scale::masked_attention (past 2^31) $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"; grep "test result\|panicked\|FAILED" "$OUT/tests-scale-$k.log" | head -5 | tee -a "$OUT/summary.txt"
done
wait
for f in "$OUT"/san-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) | $(grep 'test result' $f | tail -1) $SECONDS s" | tee -a "$OUT/summary.txt"; done
for k in portable default; do
  CANDLE_FASTOPS_ATTENTION_KERNELS=$k FASTOPS_BENCH_OUT=$OUT/bench-$k.jsonl timeout 170 "$work/bench-ops" masked_attention > "$OUT/bench-$k.log" 2>&1
  echo "bench $k rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep "b=4" "$OUT/bench-$k.log" | cut -c20-150 | tee -a "$OUT/summary.txt"
done
timeout 120 python3 scripts/torch_anchors.py "$OUT/torch.jsonl" masked_attention > "$OUT/torch.log" 2>&1
echo "torch rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
grep "b=4" "$OUT/torch.jsonl" | sed 's/"op": "masked_attention", //' | cut -c1-200 | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
cp "$OUT"/bench-*.jsonl "$OUT"/torch.jsonl /tmp/ 2>/dev/null
tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv /tmp/logs.tgz "$OUT/"
mv /tmp/bench-*.jsonl /tmp/torch.jsonl "$OUT/" 2>/dev/null
