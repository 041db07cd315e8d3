// Softmax / log-softmax over any set of dims, driven by a ReducePlan (src/reduce_plan.rs).
//
// Element j of group g sits at kept_offset(g / lanes) + g % lanes + reduced_offset(j); the
// decompositions use multiply-high division by invariant integers, so no offset table is read.
// A block is LX x LY threads: x picks the group (adjacent x = adjacent lanes, so column-like
// groups are read coalesced), y strides over the group's elements (row-like groups are read
// coalesced along y). Each thread keeps an online (max, sum of exp) pair; pairs are combined
// across y in shared memory.
//
// Kernels:
//   *_fused:  one block covers whole groups: pass 1 reads (keeping up to CACHE values per thread
//             in registers), pass 2 writes (re-reading only what did not fit).
//   softmax_partial + *_finish: groups too large for the grid are split into chunks along j
//             (gridDim.y); partial writes one (max, sum) pair per (group, chunk), finish folds
//             the pairs of its group and writes its chunk. No grid-wide barrier anywhere.
#include "common.cuh"
#include <math_constants.h>

using namespace fastops;

namespace {

constexpr int MAX_BLOCKS = 6;
constexpr int CACHE = 16;

// n / d and n % d for n < 2^31 with one multiply-high (Granlund & Montgomery).
struct FastDiv {
    uint32_t divisor, multiplier, shift;
    __device__ __forceinline__ uint32_t div(uint32_t n) const {
        return (__umulhi(n, multiplier) + n) >> shift;
    }
};

struct ReduceLayout {
    uint32_t n_kept, n_reduced;
    FastDiv kept_div[MAX_BLOCKS];
    uint64_t kept_stride[MAX_BLOCKS];
    FastDiv reduced_div[MAX_BLOCKS];
    uint64_t reduced_stride[MAX_BLOCKS];
    FastDiv lanes;
    uint32_t num_groups, group_size;
};

__device__ __forceinline__ uint64_t mixed_radix(uint32_t index, uint32_t n, const FastDiv* divs,
                                                const uint64_t* strides) {
    uint64_t offset = 0;
    for (int b = static_cast<int>(n) - 1; b >= 0; --b) {
        const uint32_t q = divs[b].div(index);
        offset += static_cast<uint64_t>(index - q * divs[b].divisor) * strides[b];
        index = q;
    }
    return offset;
}

__device__ __forceinline__ uint64_t group_base(const ReduceLayout& L, uint32_t g) {
    const uint32_t outer = L.lanes.div(g);
    return mixed_radix(outer, L.n_kept, L.kept_div, L.kept_stride) + (g - outer * L.lanes.divisor);
}

__device__ __forceinline__ uint64_t element_offset(const ReduceLayout& L, uint32_t j) {
    return mixed_radix(j, L.n_reduced, L.reduced_div, L.reduced_stride);
}

// Running (max, sum of exp(x - max)); NaN anywhere makes the pair NaN, -inf entries add nothing.
struct Online {
    float m = -CUDART_INF_F, s = 0.f;
    __device__ __forceinline__ void push(float v) {
        if (isnan(v)) {
            m = v;
            s = v;
        } else if (v > m) {
            s = s * __expf(m - v) + 1.f;
            m = v;
        } else if (v != -CUDART_INF_F) {
            s += __expf(v - m);
        }
    }
    __device__ __forceinline__ void merge(float m2, float s2) {
        if (isnan(m) || isnan(m2)) {
            m = s = CUDART_NAN_F;
            return;
        }
        const float mx = fmaxf(m, m2);
        if (mx == -CUDART_INF_F) return;
        s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
        m = mx;
    }
};

// Folds the LY pairs of each x column into row 0 and returns the column's result to every thread.
__device__ __forceinline__ Online reduce_over_y(Online acc) {
    extern __shared__ float2 pairs[];  // [LY][LX]
    const uint32_t lx = blockDim.x, idx = threadIdx.y * lx + threadIdx.x;
    pairs[idx] = make_float2(acc.m, acc.s);
    __syncthreads();
    for (uint32_t half = blockDim.y / 2; half > 0; half /= 2) {
        if (threadIdx.y < half) {
            const float2 other = pairs[idx + half * lx];
            Online mine{pairs[idx].x, pairs[idx].y};
            mine.merge(other.x, other.y);
            pairs[idx] = make_float2(mine.m, mine.s);
        }
        __syncthreads();
    }
    const float2 total = pairs[threadIdx.x];
    return Online{total.x, total.y};
}

template <bool LOG>
__device__ __forceinline__ float normalise(float v, const Online& acc, float inv_s, float log_s) {
    if (acc.m == -CUDART_INF_F) return LOG ? -CUDART_INF_F : 0.f;  // all entries -inf
    return LOG ? v - acc.m - log_s : __expf(v - acc.m) * inv_s;
}

enum class Mode { Fused, Partial, Finish };

template <typename T, bool LOG, Mode MODE>
__device__ void softmax_dims(const T* __restrict__ x, T* __restrict__ y, float2* __restrict__ partials,
                             const ReduceLayout& L, uint32_t chunk_len) {
    const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
    const bool valid = g < L.num_groups;
    const uint32_t j_begin = blockIdx.y * chunk_len;
    const uint32_t j_end = min(L.group_size, j_begin + chunk_len);
    const uint32_t step = blockDim.y;
    const uint64_t base = valid ? group_base(L, g) : 0;
    const T* xg = x + base;

    Online acc;
    float cache[CACHE];
    if constexpr (MODE != Mode::Finish) {
        if (valid) {
            uint32_t j = j_begin + threadIdx.y;
#pragma unroll
            for (int k = 0; k < CACHE; ++k, j += step) {
                if (j < j_end) {
                    cache[k] = to_float(xg[element_offset(L, j)]);
                    acc.push(cache[k]);
                }
            }
            for (; j < j_end; j += step) acc.push(to_float(xg[element_offset(L, j)]));
        }
        acc = reduce_over_y(acc);
        if constexpr (MODE == Mode::Partial) {
            if (valid && threadIdx.y == 0) partials[static_cast<uint64_t>(g) * gridDim.y + blockIdx.y] = make_float2(acc.m, acc.s);
            return;
        }
    } else {
        if (valid) {
            for (uint32_t c = 0; c < gridDim.y; ++c) {
                const float2 p = partials[static_cast<uint64_t>(g) * gridDim.y + c];
                acc.merge(p.x, p.y);
            }
        }
    }
    if (!valid) return;

    const float inv_s = 1.f / acc.s, log_s = __logf(acc.s);
    T* yg = y + base;
    uint32_t j = j_begin + threadIdx.y;
    if constexpr (MODE == Mode::Fused) {
#pragma unroll
        for (int k = 0; k < CACHE; ++k, j += step) {
            if (j < j_end) yg[element_offset(L, j)] = from_float<T>(normalise<LOG>(cache[k], acc, inv_s, log_s));
        }
    }
    for (; j < j_end; j += step) {
        const uint64_t off = element_offset(L, j);
        yg[off] = from_float<T>(normalise<LOG>(to_float(xg[off]), acc, inv_s, log_s));
    }
}

}  // namespace

#define SOFTMAX_KERNELS(T, SUFFIX)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) softmax_fused_##SUFFIX(                             \
        const T* x, T* y, ReduceLayout layout, uint32_t chunk_len) {                                       \
        softmax_dims<T, false, Mode::Fused>(x, y, nullptr, layout, chunk_len);                             \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) log_softmax_fused_##SUFFIX(                         \
        const T* x, T* y, ReduceLayout layout, uint32_t chunk_len) {                                       \
        softmax_dims<T, true, Mode::Fused>(x, y, nullptr, layout, chunk_len);                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) softmax_partial_##SUFFIX(                           \
        const T* x, float2* partials, ReduceLayout layout, uint32_t chunk_len) {                           \
        softmax_dims<T, false, Mode::Partial>(x, nullptr, partials, layout, chunk_len);                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) softmax_finish_##SUFFIX(                            \
        const T* x, T* y, const float2* partials, ReduceLayout layout, uint32_t chunk_len) {               \
        softmax_dims<T, false, Mode::Finish>(x, y, const_cast<float2*>(partials), layout, chunk_len);     \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) log_softmax_finish_##SUFFIX(                        \
        const T* x, T* y, const float2* partials, ReduceLayout layout, uint32_t chunk_len) {               \
        softmax_dims<T, true, Mode::Finish>(x, y, const_cast<float2*>(partials), layout, chunk_len);      \
    }

FASTOPS_FLOAT_KERNELS(SOFTMAX_KERNELS)
