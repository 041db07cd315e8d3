#!/usr/bin/env bash
# Runs src/cuda/attention.cu's kernels on the CPU against an f64 reference (no GPU needed):
#   bash scripts/emulate/run.sh [quick | one_pass | tokens]   # tokens: out, dq, dk, dv token-major
#   EMU_FLAGS="-DNAME=VALUE" bash scripts/emulate/run.sh   # extra compiler flags (kernel variants)
# A check of the kernels' logic (fragment layouts, pipeline, masks, indexing) with the PTX
# instructions emulated from the ISA's tables; it says nothing of speed, of real-hardware limits
# (shared memory size, alignment faults) or of races, which only the GPU tests and
# compute-sanitizer see.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# fastops_constants.cuh from src/kernel_constants.rs, as build.rs writes it.
python3 - "$root/src/kernel_constants.rs" > "$work/fastops_constants.cuh" <<'PY'
import re, sys
out = ["#pragma once"]
module = None
for line in open(sys.argv[1]):
    m = re.match(r"\s*pub mod (\w+) \{", line)
    if m:
        module = m.group(1)
        out.append(f"namespace fastops_constants::{module} {{")
        continue
    m = re.match(r"\s*pub const (\w+): \w+ = (-?\d+);", line)
    if m and module:
        out.append(f"constexpr int {m.group(1)} = {m.group(2)};")
        continue
    if module and re.match(r"^\}", line):
        out.append("}")
        module = None
print("\n".join(out))
PY
# The kernel file's own headers (attention_common.cuh), beside it; their "common.cuh" then comes
# from this directory (-I"$here"), the emulated one.
cp "$root/src/cuda/attention_common.cuh" "$work/"
sed 's/extern __shared__ uint4 shared_raw\[\];/uint4* shared_raw = reinterpret_cast<uint4*>(emu::smem);/' \
    "${KERNEL:-$root/src/cuda/attention.cu}" > "$work/attention_kernels.inc"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -w ${EMU_FLAGS:-} -I"$here" -I"$work" "$here/attention_emu.cpp" -o "$work/attention_emu"
"$work/attention_emu" "$@"
