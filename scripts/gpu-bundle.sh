#!/usr/bin/env bash
# Builds the CUDA test binaries, examples and the bench in release mode and packs them,
# xz-compressed, with the scripts below into target/gpu-bundle/ (carry that folder to a GPU
# machine that has no Rust):
#
#     scripts/gpu-bundle.sh [NAME...]     # NAME: binaries to pack (e.g. test-ops bench-ops);
#                                         # all tests, examples and the bench when none is given
#     GPU_BUNDLE_FEATURES=cuda,tuning scripts/gpu-bundle.sh bench-ops   # for sweep.sh
#     # on the GPU machine, from the repository root:
#     bash target/gpu-bundle/run.sh OUTDIR [bench filters...]
#     bash target/gpu-bundle/sanitize.sh OUTDIR [TOOL...]   # compute-sanitizer over every test binary
#     bash target/gpu-bundle/ddp.sh OUTDIR [GPUS]   # several GPUs (GPU_BUNDLE_FEATURES=nccl)
#
# run.sh unpacks, finds the CUDA libraries on that machine, runs every GPU test (one thread, so
# output stays readable), the examples and the bench, and writes tests.log, bench.log, ops.jsonl and
# nvidia-smi.txt into OUTDIR, then (where torch imports) the PyTorch anchors of
# scripts/torch_anchors.py into torch.jsonl. It exits non-zero when a test fails. sanitize.sh runs every test
# binary under memcheck, racecheck, initcheck and synccheck (the tools in parallel, instrumenting
# only this crate's kernels, heavy tests shrunk by FASTOPS_TEST_LIGHT=1) and prints one summary
# line per tool and binary (OUTDIR/sanitize.txt, full logs beside it).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
eval "$(scripts/cuda-toolkit.sh)"

bundle="$repo/target/gpu-bundle"
rm -rf "$bundle"
mkdir -p "$bundle/bin"

features=${GPU_BUNDLE_FEATURES:-cuda}
echo "gpu-bundle: building tests and bench (release, --features $features)" >&2
cargo build --release --features "$features" --tests --benches --examples --message-format=json-render-diagnostics \
    > "$bundle/cargo.json"
python3 - "$bundle" "$@" <<'PY'
import json, os, shutil, sys
bundle = sys.argv[1]
wanted = set(sys.argv[2:])
seen = set()
for line in open(os.path.join(bundle, "cargo.json")):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    kind = msg["target"]["kind"][0]
    if kind not in ("test", "bench", "lib", "example"):
        continue
    prefix = {"lib": "test", "test": "test", "bench": "bench", "example": "example"}[kind]
    name = prefix + "-" + msg["target"]["name"]
    if name in seen or (wanted and name not in wanted):
        continue
    seen.add(name)
    shutil.copy(msg["executable"], os.path.join(bundle, "bin", name))
    print(name)
PY
rm "$bundle/cargo.json"
for f in "$bundle"/bin/*; do xz -T0 -6 "$f"; done
# Everything carried to the device machine must stay under 64 MiB.
total=$(du -sm "$bundle" | cut -f1)
if [ "$total" -ge 64 ]; then
    echo "gpu-bundle: WARNING: ${total} MiB is over the 64 MiB carry limit; pass the binaries you need" >&2
fi

# Sourced by the scripts below: the CUDA libraries candle links (driver, cublas, cublasLt, curand,
# nvrtc) wherever that machine keeps them.
cat > "$bundle/libs.sh" <<'LIBS'
libdirs=/usr/local/cuda/lib64
for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13 libnccl.so.2; do
    found=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -n1)
    [ -n "$found" ] && libdirs="$libdirs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LIBS

cat > "$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled GPU tests and bench. Usage: run.sh OUTDIR [bench filters...]
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: run.sh OUTDIR [bench filters...]}
shift
mkdir -p "$out"
work=$(mktemp -d)
for f in "$here"/bin/*.xz; do
    name=$(basename "${f%.xz}")
    xz -dc "$f" > "$work/$name" && chmod +x "$work/$name"
done

source "$here/libs.sh"
# The tests poison outputs themselves; the bench must not (a memset per output).
unset CANDLE_FASTOPS_POISON
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
missing=$(ldd "$work"/bench-* | grep 'not found' | sort -u)
[ -n "$missing" ] && echo "run.sh: unresolved libraries: $missing"

status=0
: > "$out/tests.log"
# TESTS=0 skips the tests (a bench-only run); TEST_FILTER and SCALE_FILTER narrow them (libtest filters).
[ "${TESTS:-1}" = 0 ] && rm -f "$work"/test-* "$work"/example-*
for t in "$work"/test-*; do
    [ -e "$t" ] || continue
    echo "=== $(basename "$t")" | tee -a "$out/tests.log"
    (cd "$here/../.." && "$t" ${TEST_FILTER:-} --test-threads=1) >> "$out/tests.log" 2>&1 || { status=1; echo "FAILED: $(basename "$t")"; }
    grep -E '^test result|SKIPPED|note:' "$out/tests.log" | tail -n 3
done
# The attention tests once through each forward (on compute capability 9.0 the default one is
# the sm_90a or the portable kernel); KERNEL_PASSES=0 skips these passes.
for kernels in sm90 portable; do
    [ -e "$work/test-ops" ] && [ "${KERNEL_PASSES:-1}" != 0 ] || break
    echo "=== test-ops attention:: (CANDLE_FASTOPS_ATTENTION_KERNELS=$kernels)" | tee -a "$out/tests.log"
    (cd "$here/../.." && CANDLE_FASTOPS_ATTENTION_KERNELS=$kernels "$work/test-ops" attention:: --test-threads=1) \
        >> "$out/tests.log" 2>&1 || { status=1; echo "FAILED: attention tests ($kernels)"; }
    grep -E '^test result' "$out/tests.log" | tail -n 1
done
# The matmul tests through the portable kernels too (on compute capability 9.0 the masked_bmm
# backward's grad_a takes src/cuda/sm90/span.cu by default).
if [ -e "$work/test-ops" ] && [ "${KERNEL_PASSES:-1}" != 0 ]; then
    echo "=== test-ops matmul (CANDLE_FASTOPS_MATMUL_KERNELS=portable)" | tee -a "$out/tests.log"
    (cd "$here/../.." && CANDLE_FASTOPS_MATMUL_KERNELS=portable "$work/test-ops" matmul --test-threads=1) \
        >> "$out/tests.log" 2>&1 || { status=1; echo "FAILED: matmul tests (portable)"; }
    grep -E '^test result' "$out/tests.log" | tail -n 1
fi
# The small_fc_lopt tests through the portable update kernel too (on compute capability 9.0 the
# update pass takes src/cuda/sm90/small_fc_lopt.cu by default).
if [ -e "$work/test-ops" ] && [ "${KERNEL_PASSES:-1}" != 0 ]; then
    echo "=== test-ops small_fc_lopt (CANDLE_FASTOPS_LOPT_KERNELS=portable)" | tee -a "$out/tests.log"
    (cd "$here/../.." && CANDLE_FASTOPS_LOPT_KERNELS=portable "$work/test-ops" small_fc_lopt --test-threads=1) \
        >> "$out/tests.log" 2>&1 || { status=1; echo "FAILED: small_fc_lopt tests (portable)"; }
    grep -E '^test result' "$out/tests.log" | tail -n 1
fi
# The > 2^31-element tests (ignored by default: ~60 GB of GPU memory); SCALE=0 skips them.
if [ -e "$work/test-ops" ] && [ "${SCALE:-1}" != 0 ]; then
    echo "=== test-ops --ignored scale::" | tee -a "$out/tests.log"
    (cd "$here/../.." && "$work/test-ops" --ignored "scale::${SCALE_FILTER:-}" --test-threads=1) >> "$out/tests.log" 2>&1 \
        || { status=1; echo "FAILED: scale tests"; }
    grep -E '^test result' "$out/tests.log" | tail -n 1
fi
for e in "$work"/example-*; do
    [ -e "$e" ] || continue
    echo "=== $(basename "$e")"
    (cd "$here/../.." && "$e") 2>&1 | tee -a "$out/tests.log" || { status=1; echo "FAILED: $(basename "$e")"; }
done
echo "=== bench"
(cd "$here/../.." && FASTOPS_BENCH_OUT="$out/ops.jsonl" "$work"/bench-ops "$@") 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# PyTorch anchors in the same job, where torch imports (BENCHMARKS.md's "at a glance" table).
python=""
for p in /opt/torch/.venv/bin/python python3; do
    if "$p" -c "import torch; assert torch.cuda.is_available()" > /dev/null 2>&1; then python=$p; break; fi
done
if [ -n "$python" ] && [ "${TORCH:-1}" != 0 ]; then
    echo "=== torch anchors ($python)"
    (cd "$here/../.." && "$python" scripts/torch_anchors.py "$out/torch.jsonl" "$@") 2>&1 | tee "$out/torch.log"
else
    echo "=== torch anchors: skipped (no torch with CUDA, or TORCH=0)"
fi
rm -rf "$work"
echo "run.sh: exit $status"
exit $status
RUN
chmod +x "$bundle/run.sh"

cat > "$bundle/ddp.sh" <<'DDP'
#!/usr/bin/env bash
# Several GPUs (a bundle built with GPU_BUNDLE_FEATURES=nccl holding test-nccl and
# example-ddp_train): ddp.sh OUTDIR [GPUS]. The NCCL tests, then on 1 and GPUS GPUs: the NNUE's
# throughput at the same per-GPU batch, the sharded small_fc_lopt step at 354M parameters, the
# all-reduce of 256 MiB beside PyTorch's (torch.distributed.run) in the same job. Logs in OUTDIR.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: ddp.sh OUTDIR [GPUS]}
gpus=${2:-2}
mkdir -p "$out"
work=$(mktemp -d)
for f in "$here"/bin/*.xz; do
    name=$(basename "${f%.xz}")
    xz -dc "$f" > "$work/$name" && chmod +x "$work/$name"
done
source "$here/libs.sh"
export NCCL_NVLS_ENABLE=0
cd "$here/../.."
nvidia-smi topo -m > "$out/topo.txt" 2>&1
status=0
{
    echo "=== test-nccl"
    timeout 600 "$work/test-nccl" --test-threads=1 --nocapture || status=1
    echo "=== test-ops dist::"
    timeout 600 "$work/test-ops" dist:: --test-threads=1 || status=1
} > "$out/tests.log" 2>&1
grep -E "^===|test result|SKIPPED" "$out/tests.log"
nnue="--inputs 22528 --hidden 1024 --batch 16384 --steps 200 --log-every 50"
for n in 1 "$gpus"; do
    for opt in adamw fused-adamw zero-adamw lopt; do
        echo "=== ddp_train --gpus $n --optimizer $opt" | tee -a "$out/ddp.log"
        timeout 300 "$work/example-ddp_train" --gpus "$n" $nnue --optimizer "$opt" 2>&1 | tee -a "$out/ddp.log" | tail -n 3
    done
    echo "=== zero bench --gpus $n" | tee -a "$out/ddp.log"
    timeout 300 "$work/example-ddp_train" --gpus "$n" --zero-bench 2>&1 | tee -a "$out/ddp.log"
done
for mib in 16 256 1024; do
    echo "=== all-reduce $mib MiB" | tee -a "$out/ddp.log"
    timeout 120 "$work/example-ddp_train" --gpus "$gpus" --allreduce-bench "$mib" 2>&1 | tee -a "$out/ddp.log"
    timeout 300 python3 -m torch.distributed.run --nproc_per_node "$gpus" scripts/torch_allreduce.py "$mib" "$out/torch.jsonl" 2>&1 | grep '^{' | tee -a "$out/ddp.log"
done
rm -rf "$work"
echo "ddp.sh: exit $status"
exit $status
DDP
chmod +x "$bundle/ddp.sh"

cat > "$bundle/sweep.sh" <<'SWEEP'
#!/usr/bin/env bash
# Tuning runs: sweep.sh OUTDIR "VAR=a" "VAR=b OTHER=c" ... runs the bench once per setting (bench
# filter from $FILTER), appending the rows to OUTDIR/sweep.log and OUTDIR/sweep.jsonl. The FASTOPS_*
# overrides exist only in a bundle built with GPU_BUNDLE_FEATURES=cuda,tuning.
out=${1:?usage: sweep.sh OUTDIR SETTING...}
shift
mkdir -p "$out"
work=$(mktemp -d)
xz -dc "$(dirname "$0")/bin/bench-ops.xz" > "$work/bench" && chmod +x "$work/bench"
source "$(dirname "$0")/libs.sh"
for setting in "$@"; do
    echo "=== $setting" | tee -a "$out/sweep.log"
    (eval "export $setting"; FASTOPS_BENCH_OUT="$out/sweep.jsonl" "$work/bench" ${FILTER:-}) 2>&1 \
        | grep -E '^\| [a-z]|rror' | tee -a "$out/sweep.log"
done
rm -rf "$work"
SWEEP
chmod +x "$bundle/sweep.sh"
cat > "$bundle/sanitize.sh" <<'SAN'
#!/usr/bin/env bash
# compute-sanitizer over every bundled test binary: sanitize.sh OUTDIR [TOOL...] (default: memcheck
# racecheck initcheck synccheck, run side by side). memcheck, racecheck and synccheck instrument
# only this crate's kernels, and FASTOPS_TEST_LIGHT=1 shrinks the heaviest tests.
# Writes OUTDIR/sanitize.txt (one line per tool and binary: exit status, the tool's summary, the
# test result) and OUTDIR/san-TOOL-BINARY.log; exits non-zero when any tool reports or a test fails.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: sanitize.sh OUTDIR [TOOL...]}
shift
tools=${*:-memcheck racecheck initcheck synccheck}
mkdir -p "$out"
work=$(mktemp -d)
for f in "$here"/bin/test-*.xz; do
    name=$(basename "${f%.xz}")
    xz -dc "$f" > "$work/$name" && chmod +x "$work/$name"
done
source "$here/libs.sh"
san=$(command -v compute-sanitizer || find /usr/local /opt -name compute-sanitizer -type f 2>/dev/null | head -n1)
[ -n "$san" ] || { echo "sanitize.sh: no compute-sanitizer"; exit 2; }
# memcheck, racecheck and synccheck instrument only this crate's kernels (one additive filter per
# kernel family; candle's own kernels run uninstrumented). initcheck instruments every kernel: it
# tracks which bytes kernels have written, so an uninstrumented candle kernel's output (a
# `.contiguous()` copy, say) would read as uninitialized to ours.
filter=()
for k in bias_add softmax sparse_linear lopt_ masked_bmm mask_grad argmin_matmul argmin_split span_matmul span_grad tile_summary attention_ adamw_; do
    filter+=(--kernel-name "kns=$k")
done
export FASTOPS_TEST_LIGHT=1
# SAN_SPLIT="f1 f2 ..." runs each tool over test-ops once per test-name filter (side by side), for
# a tool too slow over the whole binary inside one command's time limit.
# Test threads per process: SAN_THREADS, else 4, except initcheck, which runs one test at a time.
# With several test threads initcheck reported, in some runs only, reads by candle's own kernels of
# buffers that candle kernels had just written (affine_f32 reading badd_f32's output in a test's
# composed reference, session 32); one test at a time it reports none. The cause is not proven
# (a guess: buffers recycled between the test threads' streams by the stream-ordered allocator).
run_tool() {
    local tool=$1 t=$2 filter_arg=${3:-} name log extra=() threads=${SAN_THREADS:-4}
    name=$(basename "$t")${filter_arg:+-${filter_arg//:/}}
    log="$out/san-$tool-$name.log"
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    [ "$tool" != initcheck ] && extra+=("${filter[@]}")
    [ "$tool" = initcheck ] && threads=${SAN_THREADS:-1}
    (cd "$here/../.." && timeout "${SAN_TIMEOUT:-1500}" "$san" --tool "$tool" "${extra[@]}" \
        --error-exitcode 9 "$t" $filter_arg --test-threads="$threads") > "$log" 2>&1
    local rc=$?
    local summary result
    summary=$(grep -E '(ERROR|RACECHECK|INITCHECK|SYNCCHECK) SUMMARY' "$log" | tail -n1 | sed 's/^========= //')
    result=$(grep -E '^test result' "$log" | tail -n1)
    # A binary whose tests make no CUDA call (the CPU-only unit tests) gives the tool nothing to
    # instrument: it exits 255 with this message. With its tests passed, that is a clean run.
    if [ "$rc" = 255 ] && grep -q 'terminated before first instrumented API call' "$log" \
        && [[ "$result" == "test result: ok."* ]]; then
        rc=0
        summary="no CUDA call to check"
    fi
    printf '%-9s %-26s exit %-3s | %s | %s\n' "$tool" "$name" "$rc" "${summary:-no summary}" "${result:-no test result}"
}
: > "$out/sanitize.txt"
for tool in $tools; do
    for t in "$work"/test-*; do
        if [ -n "${SAN_SPLIT:-}" ] && [ "$(basename "$t")" = test-ops ]; then
            for f in $SAN_SPLIT; do run_tool "$tool" "$t" "$f" >> "$out/sanitize.txt" & done
        else
            run_tool "$tool" "$t" >> "$out/sanitize.txt" &
        fi
    done
done
wait
sort -o "$out/sanitize.txt" "$out/sanitize.txt"
cat "$out/sanitize.txt"
rm -rf "$work"
if grep -qv ' exit 0 ' "$out/sanitize.txt"; then exit 1; fi
SAN
chmod +x "$bundle/sanitize.sh"
cat > "$bundle/profile.sh" <<'PROFILE'
#!/usr/bin/env bash
# Kernel durations with Nsight Compute: profile.sh OUTDIR KERNEL_REGEX SKIP COUNT [bench filters...]
# profiles COUNT launches of kernels matching KERNEL_REGEX after skipping SKIP of them, in the bench
# run with the given filters, and writes OUTDIR/profile.csv (one row per launch: gpu__time_duration).
# NCU_ARGS replaces the metric list (e.g. NCU_ARGS="--set full -o OUTDIR/k" for a full report, then
# `ncu --import OUTDIR/k.ncu-rep --page details --csv` or `--page source --print-source sass`).
# SASS=1 instead takes the full set and writes two files: OUTDIR/raw.csv.xz (every metric) and
# OUTDIR/source.csv.xz (per SASS instruction: executions, stall samples), which
# scripts/ncu_sass_summary.py reads (instructions per opcode, the hottest straight-line runs).
out=${1:?usage: profile.sh OUTDIR KERNEL_REGEX SKIP COUNT [filters...]}
regex=$2 skip=$3 count=$4
shift 4
mkdir -p "$out"
work=$(mktemp -d)
xz -dc "$(dirname "$0")/bin/bench-ops.xz" > "$work/bench" && chmod +x "$work/bench"
source "$(dirname "$0")/libs.sh"
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
if [ "${SASS:-0}" = 1 ]; then
    "$ncu" --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
        --set full --import-source no -o "$work/k" "$work/bench" "$@" > "$out/profile.err" 2>&1
    echo "profile.sh: ncu exit $?"
    "$ncu" --import "$work/k.ncu-rep" --page source --print-source sass --csv | xz -9 > "$out/source.csv.xz"
    "$ncu" --import "$work/k.ncu-rep" --page raw --csv | xz -9 > "$out/raw.csv.xz"
else
    "$ncu" --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
        ${NCU_ARGS:---metrics gpu__time_duration.sum --csv} "$work/bench" "$@" > "$out/profile.csv" 2> "$out/profile.err"
    echo "profile.sh: ncu exit $?"
fi
rm -rf "$work"
PROFILE
chmod +x "$bundle/profile.sh"
du -sh "$bundle" >&2
ls -la "$bundle/bin" >&2
