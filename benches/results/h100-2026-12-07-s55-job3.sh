#!/usr/bin/env bash
# Session 55 job 3: the final code's GPU suite (run.sh: every test, the attention tests through
# both forwards, the matmul and small_fc_lopt tests through the portable kernels; no 2^31 tests)
# and the small_fc_lopt step rows. OUT=DIR bash benches/results/h100-2026-12-07-s55-job3.sh
set -u
out=${OUT:?}
TORCH=0 SCALE=0 FASTOPS_BENCH_CASES="354M/289 step (fused),152M/97 step (fused)" \
    timeout 560 bash target/gpu-bundle/run.sh "$out" small_fc_lopt > "$out/run.txt" 2>&1
echo "run.sh rc=$?"
grep -E "^===|^test result|FAILED|panicked" "$out/tests.log" | head -40
grep -E "small_fc_lopt" "$out/bench.log" | head -20
