// Shared helpers for candle-fastops kernels: dtype conversion to the f32 accumulator type,
// 16-byte vector IO with cache hints, and instantiation macros so every kernel is exported once
// per dtype under candle's naming scheme (`name_f32`, `name_f16`, `name_bf16`).
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "fastops_constants.cuh"

namespace fastops {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Pairs of adjacent values converted with one packed instruction (F2FP / HADD2.F32 on sm_90)
// instead of two scalar conversions; same rounding as the scalar forms.
template <typename T> __device__ __forceinline__ float2 to_float2(const T* p) {
    return make_float2(to_float(p[0]), to_float(p[1]));
}
template <> __device__ __forceinline__ float2 to_float2<__half>(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}
template <> __device__ __forceinline__ float2 to_float2<__nv_bfloat16>(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

template <typename T> __device__ __forceinline__ void from_float2(T* p, float a, float b) {
    p[0] = from_float<T>(a);
    p[1] = from_float<T>(b);
}
template <> __device__ __forceinline__ void from_float2<__half>(__half* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ void from_float2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// How a kernel streams a tensor it touches exactly once. `Streaming` (ld.cs / st.cs) marks the
// lines evict-first so the stream does not push reused data (a bias, a weight stripe) out of L2;
// `Volatile` (ld.cv / st.wt) is what the TF study used; `Default` is a plain ld/st.
enum class CacheHint { Default, Streaming, Volatile };

template <CacheHint H> __device__ __forceinline__ uint4 load16(const uint4* p) {
    if constexpr (H == CacheHint::Streaming) return __ldcs(p);
    else if constexpr (H == CacheHint::Volatile) return __ldcv(p);
    else return *p;
}

template <CacheHint H> __device__ __forceinline__ void store16(uint4* p, uint4 v) {
    if constexpr (H == CacheHint::Streaming) __stcs(p, v);
    else if constexpr (H == CacheHint::Volatile) __stwt(p, v);
    else *p = v;
}

// Number of T in one 16-byte vector.
template <typename T> __host__ __device__ constexpr int vec_width() { return 16 / sizeof(T); }

template <typename T> union Vec16 {
    uint4 raw;
    T lanes[16 / sizeof(T)];
};

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// clamp(x, 0, ceiling), a NaN passing through (both comparisons fail).
__device__ __forceinline__ float clipped_relu(float x, float ceiling) {
    return x < 0.0f ? 0.0f : (x > ceiling ? ceiling : x);
}

// The output gradient behind the clipped ReLU: g where 0 < y < ceiling (y the stored output,
// `ceiling` rounded to its dtype), else 0.
__device__ __forceinline__ float through_clipped_relu(float g, float y, float ceiling) {
    return (y > 0.0f && y < ceiling) ? g : 0.0f;
}

// ---- Warp-level tensor-core pieces (sm_80+), shared by the matmul core and the optimizer's MLP.

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 b16 matrices from shared memory (`.trans`: each transposed on the way), one row
// address per lane.
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    }
}

// 16-byte asynchronous copy global -> shared; the bytes past `src_bytes` (0 to 16) are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte asynchronous copy global -> shared (through L1); zero-filled when `src_bytes` is 0.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// cp_async16 that also has L2 fetch the whole 128-byte (PREFETCH 128) or 256-byte segment around
// the source, for copies whose next stages read the bytes after it.
template <int PREFETCH>
__device__ __forceinline__ void cp_async16_prefetch(uint32_t dst, const void* src, int src_bytes) {
    static_assert(PREFETCH == 0 || PREFETCH == 128 || PREFETCH == 256, "an L2 prefetch size of PTX");
    if constexpr (PREFETCH == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    } else if constexpr (PREFETCH == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    } else {
        cp_async16(dst, src, src_bytes);
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// c += a . b for one m16n8k16 tile of f16 or bf16 operands (T) with f32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    static_assert(sizeof(T) == 2, "f16 or bf16 operands");
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

}  // namespace fastops

// Exports `kernel<T>` as extern "C" `name_f32`, `name_f16`, `name_bf16`
// (the suffixes `candle_core::cuda_backend::kernel_name` produces).
#define FASTOPS_FLOAT_KERNELS(MACRO) \
    MACRO(float, f32)                \
    MACRO(__half, f16)               \
    MACRO(__nv_bfloat16, bf16)
