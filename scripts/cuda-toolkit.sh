#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 *build* toolkit (nvcc + headers + link libraries) from NVIDIA's
# PyPI wheels into `.cuda-toolkit/` (git-ignored), arranges it the way nvcc and cudarc expect, and
# prints the environment as `export NAME=value` lines:
#
#     eval "$(scripts/cuda-toolkit.sh)"
#     cargo build --features cuda
#
# Why 13.0: the H200 machines run driver 580 (CUDA 13.0); PTX from a newer nvcc may not load there.
# Idempotent: a second run only re-prints the environment. Progress goes to stderr so that
# stdout stays eval-able.
set -euo pipefail

CUDA_VERSION_PIN="13.0.0"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
top="${CUDA_TOOLKIT_DIR:-$repo/.cuda-toolkit}"
venv="$top/venv"
root="$top/root"
log() { echo "cuda-toolkit: $*" >&2; }

if [[ ! -f "$top/.installed-$CUDA_VERSION_PIN" ]]; then
    log "installing cuda-toolkit $CUDA_VERSION_PIN wheels into $venv (about 1.2 GB)"
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "cuda-toolkit[nvcc,crt,nvvm,cudart,cccl,curand,nvrtc,cublas]==$CUDA_VERSION_PIN" >&2
    touch "$top/.installed-$CUDA_VERSION_PIN"
fi

wheel=$(ls -d "$venv"/lib/python3.*/site-packages/nvidia/cu13 | head -n1)
[[ -x "$wheel/bin/nvcc" ]] || { log "nvcc missing under $wheel; delete $top and rerun"; exit 1; }

# nvcc.profile looks for cicc under <top>/nvvm/bin and libdevice under <top>/nvvm/libdevice,
# but the wheels put cicc in bin/: build a root of symlinks with the layout nvcc expects.
if [[ ! -f "$root/.ready" ]]; then
    log "arranging $root"
    rm -rf "$root"
    mkdir -p "$root/bin" "$root/nvvm/bin" "$root/lib/stubs"
    for f in "$wheel"/bin/*; do ln -sf "$f" "$root/bin/"; done
    ln -sf "$wheel/bin/cicc" "$root/nvvm/bin/cicc"
    ln -sf "$wheel/nvvm/libdevice" "$root/nvvm/libdevice"
    ln -sf "$wheel/include" "$root/include"
    # The wheels ship only libX.so.N; the linker wants libX.so.
    for so in "$wheel"/lib/lib*.so.*; do
        base=$(basename "$so")
        ln -sf "$so" "$root/lib/$base"
        ln -sf "$so" "$root/lib/${base%%.so.*}.so"
    done

    # libcuda belongs to the driver, which this machine lacks: build a link-time stub exporting
    # every driver entry point cudarc declares. Each returns CUDA_ERROR_NO_DEVICE (100), so a
    # binary run here sees "no GPU" and the tests skip the GPU; on a GPU machine the real
    # libcuda.so.1 is loaded instead.
    sys_rs=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -n1 || true)
    if [[ -z "$sys_rs" ]]; then
        (cd "$repo" && cargo fetch -q >&2)
        sys_rs=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | tail -n1)
    fi
    stub_c="$top/libcuda_stub.c"
    grep -o 'pub unsafe fn cu[A-Za-z0-9_]*' "$sys_rs" | awk '{print $4}' | sort -u |
        awk '{printf "int %s(void) { return 100; }\n", $1}' > "$stub_c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so.1" "$stub_c"
    ln -sf libcuda.so.1 "$root/lib/stubs/libcuda.so"
    log "libcuda stub: $(wc -l < "$stub_c") entry points"
    touch "$root/.ready"
fi

# libnccl (the `nccl` feature) is not among the toolkit wheels either: a link-time stub with
# soname libnccl.so.2 exporting every NCCL entry point cudarc declares. Each returns
# ncclSystemError (2), so `dist::NcclGroup` reports "NCCL unavailable" here; on a GPU machine the
# system's libnccl.so.2 (2.28 on the H200 hosts) is loaded instead.
if [[ ! -f "$root/lib/stubs/libnccl.so.2" ]]; then
    nccl_rs=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/nccl/sys/mod.rs 2>/dev/null | tail -n1 || true)
    if [[ -z "$nccl_rs" ]]; then
        (cd "$repo" && cargo fetch -q >&2)
        nccl_rs=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/nccl/sys/mod.rs | tail -n1)
    fi
    stub_c="$top/libnccl_stub.c"
    {
        echo 'static const char message[] = "libnccl.so.2 is the build stub: no NCCL on this machine";'
        echo 'const char *ncclGetErrorString(int result) { (void)result; return message; }'
        echo 'const char *ncclGetLastError(void *comm) { (void)comm; return message; }'
        grep -o 'pub unsafe fn nccl[A-Za-z0-9_]*' "$nccl_rs" | awk '{print $4}' | sort -u |
            grep -v -x -e ncclGetErrorString -e ncclGetLastError |
            awk '{printf "int %s(void) { return 2; }\n", $1}'
    } > "$stub_c"
    mkdir -p "$root/lib/stubs"
    gcc -shared -fPIC -Wl,-soname,libnccl.so.2 -o "$root/lib/stubs/libnccl.so.2" "$stub_c"
    ln -sf libnccl.so.2 "$root/lib/stubs/libnccl.so"
    log "libnccl stub: $(grep -c '^int\|^const' "$stub_c") entry points"
fi

echo "export CUDA_ROOT=$root"
echo "export PATH=$root/bin:\$PATH"
echo "export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}"
# Lets cuda-enabled test binaries start here (they find no GPU through the stub and skip it).
echo "export LD_LIBRARY_PATH=$root/lib:$root/lib/stubs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
