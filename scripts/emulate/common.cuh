// A host (C++20) stand-in for src/cuda/common.cuh, so that kernels can run on a CPU without a
// GPU: each CUDA thread of a block is a cooperative context (ucontext) on one OS thread, switched
// round-robin at barriers; __syncthreads is a block barrier; warp shuffles, ldmatrix and mma.sync
// are warp-collective exchanges through per-warp slots, with the fragment layouts of the PTX ISA
// (written from the ISA's tables, independently of the kernels). cp.async copies at once. Blocks
// of a launch run one after another.
// Used by scripts/emulate/run.sh; never compiled into the crate.
#pragma once
#include <ucontext.h>
#include <vector>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include "fastops_constants.cuh"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
// A block-wide static array: blocks run one after another, so a static serves every thread of
// the block that is running.
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint4 { uint32_t x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) int2 { int x, y; };
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
struct Dim3 { uint32_t x = 0, y = 0, z = 0; };
inline Dim3 threadIdx, blockIdx;
inline Dim3 gridDim, blockDim;
using std::min;
using std::max;

struct __half { _Float16 v; };
struct __nv_bfloat16 { uint16_t bits; };

namespace emu {
// The block's shared memory and its warps' exchange slots (one block runs at a time).
inline unsigned char* smem = nullptr;
// The contexts of the block's threads and the scheduler's.
inline std::vector<ucontext_t> contexts;
inline ucontext_t scheduler;
inline void yield() { swapcontext(&contexts[threadIdx.x], &scheduler); }
// A barrier of `size` threads: the last to arrive releases the others (who wait by yielding).
struct Barrier {
    int size = 0, count = 0;
    unsigned generation = 0;
    void arrive_and_wait() {
        const unsigned g = generation;
        if (++count == size) {
            count = 0;
            ++generation;
            return;
        }
        while (generation == g) yield();
    }
};
struct Warp {
    Barrier bar{32};
    uint32_t slots[32][8];
    float fslots[32];
};
inline Warp* warps = nullptr;
inline Warp& warp() { return warps[threadIdx.x / 32]; }
inline int lane() { return threadIdx.x % 32; }
inline Barrier* block_barrier = nullptr;

inline float bf16_to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
    return static_cast<uint16_t>(u >> 16);
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
// Threads switch only at barriers and warp exchanges, so a plain read-modify-write is atomic.
inline float atomicAdd(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}

inline float __shfl_xor_sync(unsigned, float v, int x) {
    auto& w = emu::warp();
    const int l = emu::lane();
    w.fslots[l] = v;
    w.bar.arrive_and_wait();
    const float r = w.fslots[l ^ x];
    w.bar.arrive_and_wait();
    return r;
}

inline unsigned __ballot_sync(unsigned, bool pred) {
    auto& w = emu::warp();
    const int l = emu::lane();
    w.fslots[l] = pred ? 1.f : 0.f;
    w.bar.arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (w.fslots[i] != 0.f) r |= 1u << i;
    w.bar.arrive_and_wait();
    return r;
}

inline int __any_sync(unsigned mask, bool pred) { return __ballot_sync(mask, pred) != 0; }

inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }

inline uint64_t __cvta_generic_to_shared(const void* p) {
    return static_cast<uint64_t>(static_cast<const unsigned char*>(p) - emu::smem);
}

namespace fastops {

template <typename T> inline float to_float(T v);
template <> inline float to_float<float>(float v) { return v; }
template <> inline float to_float<__half>(__half v) { return static_cast<float>(v.v); }
template <> inline float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return emu::bf16_to_float(v.bits); }

template <typename T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline __half from_float<__half>(float v) { return __half{static_cast<_Float16>(v)}; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __nv_bfloat16{emu::float_to_bf16(v)}; }

template <typename T> inline void from_float2(T* p, float a, float b) {
    p[0] = from_float<T>(a);
    p[1] = from_float<T>(b);
}

inline uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

inline void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    std::memset(emu::smem + dst, 0, 16);
    std::memcpy(emu::smem + dst, src, src_bytes);
}
inline void cp_async4(uint32_t dst, const void* src, int src_bytes) {
    std::memset(emu::smem + dst, 0, 4);
    std::memcpy(emu::smem + dst, src, src_bytes);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}

inline uint16_t smem16(uint32_t addr) {
    uint16_t v;
    std::memcpy(&v, emu::smem + addr, 2);
    return v;
}

// ldmatrix .x4: matrix i's row r comes from the address of lane 8 i + r. Without .trans, lane l
// gets row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each matrix; with .trans, rows
// 2 (l % 4) and 2 (l % 4) + 1 of column l / 4 (the matrix transposed).
template <bool TRANS> inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    auto& w = emu::warp();
    const int l = emu::lane();
    w.slots[l][0] = addr;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!TRANS) {
            const uint32_t row = w.slots[8 * i + l / 4][0];
            lo = smem16(row + 2 * (2 * (l % 4)));
            hi = smem16(row + 2 * (2 * (l % 4) + 1));
        } else {
            lo = smem16(w.slots[8 * i + 2 * (l % 4)][0] + 2 * (l / 4));
            hi = smem16(w.slots[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4));
        }
        r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    w.bar.arrive_and_wait();
}

template <typename T> inline float half_of(uint32_t reg, int which) {
    const uint16_t bits = static_cast<uint16_t>(which ? reg >> 16 : reg & 0xffff);
    if constexpr (std::is_same_v<T, __half>) {
        _Float16 h;
        std::memcpy(&h, &bits, 2);
        return static_cast<float>(h);
    } else {
        return emu::bf16_to_float(bits);
    }
}

// mma.sync m16n8k16 row.col, f32 accumulation. PTX ISA fragments (g = lane / 4, t = lane % 4):
// A: reg 0 (row g, k 2t..2t+1), reg 1 (row g + 8, k 2t..), reg 2 (row g, k 2t + 8..), reg 3
// (row g + 8, k 2t + 8..); B: reg 0 (k 2t..2t+1, column g), reg 1 (k 2t + 8.., column g);
// C: c0, c1 (row g, columns 2t, 2t + 1), c2, c3 (row g + 8, same columns).
template <typename T>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    auto& w = emu::warp();
    const int l = emu::lane();
    for (int i = 0; i < 4; ++i) w.slots[l][i] = a[i];
    w.slots[l][4] = b0;
    w.slots[l][5] = b1;
    w.bar.arrive_and_wait();
    auto A = [&](int row, int k) {
        const int lane = (row % 8) * 4 + (k % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return half_of<T>(w.slots[lane][reg], k % 2);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        return half_of<T>(w.slots[lane][k >= 8 ? 5 : 4], k % 2);
    };
    const int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; ++r) {
        const int row = g + (r / 2) * 8, col = 2 * t + (r % 2);
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        c[r] += s;
    }
    w.bar.arrive_and_wait();
}

}  // namespace fastops
