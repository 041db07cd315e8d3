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
//   *_cached: groups that fit in registers (CACHED_UNITS per thread): one read, one write.
//             Persistent blocks walk columns of groups and load the next column before reducing
//             the current one, so every block always has a group's loads in flight.
//   *_fused:  one block covers whole groups: pass 1 reads, pass 2 re-reads and writes.
//   softmax_partial + *_finish: groups too large for the grid are split into chunks along j
//             (gridDim.y); partial writes one (max, sum) pair per (group, chunk), finish folds
//             the pairs of its group and writes its chunk, walking the blocks in reverse so its
//             first reads hit what partial left in L2. No grid-wide barrier anywhere.
#include "common.cuh"
#include <math_constants.h>

using namespace fastops;

namespace {

using fastops_constants::softmax::MAX_BLOCKS;
using fastops_constants::softmax::ROW_BLOCK_MAX_THREADS;

// n / d and n % d for n < 2^31 with one multiply-high (Granlund & Montgomery).
struct FastDiv {
    uint32_t divisor, multiplier, shift;
    __device__ __forceinline__ uint32_t div(uint32_t n) const {
        return (__umulhi(n, multiplier) + n) >> shift;
    }
};
static_assert(sizeof(FastDiv) == 12, "FastDiv is mirrored by a Rust #[repr(C)] struct of 12 bytes");

struct ReduceLayout {
    uint32_t n_kept, n_reduced;
    FastDiv kept_div[MAX_BLOCKS];
    uint64_t kept_stride[MAX_BLOCKS];
    FastDiv reduced_div[MAX_BLOCKS];
    uint64_t reduced_stride[MAX_BLOCKS];
    FastDiv lanes;
    uint32_t num_groups, group_size;
};
static_assert(sizeof(ReduceLayout) == 272, "ReduceLayout is mirrored by a Rust #[repr(C)] struct of 272 bytes");

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

// Walks the elements j, j + step, j + 2 * step, ... of a group. The innermost reduced block
// (size inner, stride inner_stride) is advanced by addition; the outer reduced blocks are
// decomposed again only when the walk leaves a run of the innermost block, so the common case
// costs an add and a compare per element instead of a mixed-radix decomposition.
struct Cursor {
    uint32_t j, i;
    uint64_t offset;
    __device__ __forceinline__ void seek(const ReduceLayout& L, uint32_t to) {
        const uint32_t last = L.n_reduced - 1;
        const FastDiv& inner = L.reduced_div[last];
        const uint32_t run = inner.div(to);
        j = to;
        i = to - run * inner.divisor;
        offset = mixed_radix(run, last, L.reduced_div, L.reduced_stride) + i * L.reduced_stride[last];
    }
    __device__ __forceinline__ void advance(const ReduceLayout& L, uint32_t step) {
        const uint32_t last = L.n_reduced - 1;
        i += step;
        if (i < L.reduced_div[last].divisor) {
            j += step;
            offset += static_cast<uint64_t>(step) * L.reduced_stride[last];
        } else {
            seek(L, j + step);
        }
    }
};

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

// Folds the LY pairs of each x column and returns the column's result to every thread: first
// across the y values that share a warp (shuffles), then across warps (shared memory).
__device__ __forceinline__ Online reduce_over_y(Online acc) {
    extern __shared__ float2 pairs[];  // at most LX * LY = blockDim entries
    const uint32_t lx = blockDim.x, ly = blockDim.y;
    if (ly == 1) return acc;
    __syncthreads();  // a previous call's readers are done with `pairs`
    const uint32_t tid = threadIdx.y * lx + threadIdx.x, warp = tid / 32, lane = tid % 32;
    for (uint32_t off = 16; off >= lx; off /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, acc.m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, acc.s, off);
        acc.merge(m2, s2);
    }
    // After the shuffles, lane x (< lx) of each warp holds that warp's pair for column x.
    const bool by_warp = lx < 32;
    const uint32_t entries = by_warp ? blockDim.x * blockDim.y / 32 : ly;
    if (!by_warp || lane < lx) pairs[(by_warp ? warp : threadIdx.y) * lx + threadIdx.x] = make_float2(acc.m, acc.s);
    __syncthreads();
    Online total;
    for (uint32_t e = 0; e < entries; ++e) {
        const float2 p = pairs[e * lx + threadIdx.x];
        total.merge(p.x, p.y);
    }
    return total;
}

template <bool LOG>
__device__ __forceinline__ float normalise(float v, const Online& acc, float inv_s, float log_s) {
    if (acc.m == -CUDART_INF_F) return LOG ? -CUDART_INF_F : 0.f;  // all entries -inf
    return LOG ? v - acc.m - log_s : __expf(v - acc.m) * inv_s;
}

enum class Mode { Fused, Partial, Finish };

// W adjacent elements moved as one access: a 16-byte vector when the group's innermost reduced
// block is contiguous and aligned (the host then describes the layout in units of W elements),
// a single element otherwise.
template <typename T, int W> struct alignas(sizeof(T) * W) Unit {
    T v[W];
};

// Loads up to BATCH units along the cursor before any is used, so that many loads are in flight
// per thread (a load consumed right away stalls the warp for the full memory latency). Returns
// how many were loaded.
// Writes units 0 .. n - 1 (n <= N) along the cursor from yg, unit k's element w being
// value(k, w) rounded to T.
template <int N, int W, typename T, class Value>
__device__ __forceinline__ void store_units(T* yg, const ReduceLayout& L, Cursor cur, uint32_t step, int n,
                                            Value&& value) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        if (k < n) {
            Unit<T, W> out;
#pragma unroll
            for (int w = 0; w < W; ++w) out.v[w] = from_float<T>(value(k, w));
            *reinterpret_cast<Unit<T, W>*>(yg + cur.offset) = out;
            cur.advance(L, step);
        }
    }
}

template <int BATCH, typename T, int W>
__device__ __forceinline__ int load_batch(const T* xg, const ReduceLayout& L, Cursor& cur, uint32_t j_end,
                                          uint32_t step, Unit<T, W> (&raw)[BATCH]) {
    int n = 0;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        if (cur.j < j_end) {
            raw[k] = *reinterpret_cast<const Unit<T, W>*>(xg + cur.offset);
            n = k + 1;
            cur.advance(L, step);
        }
    }
    return n;
}

// A thread moves units of W adjacent elements. With LANES false the W elements are W
// consecutive elements of one group (its innermost reduced run is contiguous); with LANES true
// they are element j of W adjacent groups (column-like groups, whose lanes are contiguous), and
// the thread keeps one accumulator per group. Group index g and element index j count units;
// cur.offset is in elements.
template <typename T, int W, bool LANES, bool LOG, Mode MODE>
__device__ void softmax_dims(const T* __restrict__ x, T* __restrict__ y, float2* __restrict__ partials,
                             const ReduceLayout& L, uint32_t chunk_len) {
    using U = Unit<T, W>;
    constexpr int NA = LANES ? W : 1;  // accumulators per thread
    constexpr int BATCH = W == 1 ? 8 : 4;
    // Finish walks the grid backwards: the last chunks partial read are still in L2.
    const uint32_t bx = MODE == Mode::Finish ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const uint32_t by = MODE == Mode::Finish ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
    const uint32_t g = bx * blockDim.x + threadIdx.x;
    const bool valid = g < L.num_groups;
    const uint32_t j_begin = by * chunk_len;
    const uint32_t j_end = min(L.group_size, j_begin + chunk_len);
    const uint32_t step = blockDim.y;
    const uint32_t first = j_begin + threadIdx.y;
    const bool active = valid && first < j_end;
    const uint64_t base = valid ? group_base(L, LANES ? g * W : g) : 0;
    const T* xg = x + base;
    T* yg = y + base;
    Online acc[NA];
    if constexpr (MODE != Mode::Finish) {
        if (active) {
            Cursor cur;
            cur.seek(L, first);
            while (cur.j < j_end) {
                U batch[BATCH];
                const int n = load_batch<BATCH>(xg, L, cur, j_end, step, batch);
#pragma unroll
                for (int k = 0; k < BATCH; ++k)
                    if (k < n) {
#pragma unroll
                        for (int w = 0; w < W; ++w) acc[LANES ? w : 0].push(to_float(batch[k].v[w]));
                    }
            }
        }
#pragma unroll
        for (int a = 0; a < NA; ++a) acc[a] = reduce_over_y(acc[a]);
        if constexpr (MODE == Mode::Partial) {
            if (valid && threadIdx.y == 0) {
#pragma unroll
                for (int a = 0; a < NA; ++a) {
                    const uint64_t group = LANES ? static_cast<uint64_t>(g) * W + a : g;
                    partials[group * gridDim.y + by] = make_float2(acc[a].m, acc[a].s);
                }
            }
            return;
        }
    } else if (valid) {
#pragma unroll
        for (int a = 0; a < NA; ++a) {
            const uint64_t group = LANES ? static_cast<uint64_t>(g) * W + a : g;
            for (uint32_t c = 0; c < gridDim.y; ++c) {
                const float2 p = partials[group * gridDim.y + c];
                acc[a].merge(p.x, p.y);
            }
        }
    }
    if (!active) return;

    float inv_s[NA], log_s[NA];
#pragma unroll
    for (int a = 0; a < NA; ++a) {
        inv_s[a] = 1.f / acc[a].s;
        log_s[a] = __logf(acc[a].s);
    }
    Cursor cur;
    cur.seek(L, first);
    while (cur.j < j_end) {
        const Cursor store = cur;
        U batch[BATCH];
        const int n = load_batch<BATCH>(xg, L, cur, j_end, step, batch);
        store_units<BATCH, W>(yg, L, store, step, n, [&](int k, int w) {
            const int a = LANES ? w : 0;
            return normalise<LOG>(to_float(batch[k].v[w]), acc[a], inv_s[a], log_s[a]);
        });
    }
}

// Units a thread of the cached kernel holds: 16 single elements, or 4 16-byte vectors.
template <int W> __host__ __device__ constexpr int cached_units() {
    return W == 1 ? fastops_constants::softmax::CACHED_ELEMENTS : fastops_constants::softmax::CACHED_VECTORS;
}

// Groups of at most cached_units<W>() * blockDim.y units (row-like groups in 16-byte vectors,
// W > 1, or any group one element at a time), one read and one write per element. Block b
// handles the columns of blockDim.x groups b, b + gridDim.x, ...
// PREFETCH (rows, launched as one resident wave): the loads of the next column are issued
// before the current one is reduced, so the block's loads stay in flight across the reduction's
// barriers. Without it (column-like groups, launched with a block per column) the kernel needs
// fewer registers and more blocks fit per SM, which measured faster there.
template <typename T, int W, bool LOG, bool PREFETCH>
__device__ void softmax_cached(const T* __restrict__ x, T* __restrict__ y, const ReduceLayout& L,
                               uint32_t columns) {
    using U = Unit<T, W>;
    constexpr int UNITS = cached_units<W>();
    // exp(x - thread max) is kept for the write when that costs no extra resident blocks
    // (f32 rows); otherwise it is recomputed.
    constexpr bool KEEP_EXP = PREFETCH && !LOG && sizeof(T) == 4;
    const uint32_t step = blockDim.y;
    const bool has_elements = threadIdx.y < L.group_size;
    auto base_of = [&](uint32_t column) -> uint64_t {
        const uint32_t g = column * blockDim.x + threadIdx.x;
        return column < columns && g < L.num_groups ? group_base(L, g) : UINT64_MAX;
    };
    auto load = [&](uint64_t base, U (&dst)[UNITS]) -> int {
        if (base == UINT64_MAX || !has_elements) return 0;
        Cursor cur;
        cur.seek(L, threadIdx.y);
        return load_batch<UNITS>(x + base, L, cur, L.group_size, step, dst);
    };
    U raw[UNITS], next[PREFETCH ? UNITS : 1];
    uint64_t base = base_of(blockIdx.x);
    int n = load(base, raw);
    for (uint32_t column = blockIdx.x; column < columns; column += gridDim.x) {
        const uint64_t next_base = base_of(column + gridDim.x);
        int next_n = 0;
        if constexpr (PREFETCH) next_n = load(next_base, next);

        float local_m = -CUDART_INF_F;
        bool nan = false;
#pragma unroll
        for (int k = 0; k < UNITS; ++k)
            if (k < n)
#pragma unroll
                for (int w = 0; w < W; ++w) {
                    const float v = to_float(raw[k].v[w]);
                    local_m = fmaxf(local_m, v);
                    nan |= isnan(v);
                }
        float e[KEEP_EXP ? UNITS * W : 1];
        float s = 0.f;
        if (local_m != -CUDART_INF_F) {
#pragma unroll
            for (int k = 0; k < UNITS; ++k)
                if (k < n)
#pragma unroll
                    for (int w = 0; w < W; ++w) {
                        const float ev = __expf(to_float(raw[k].v[w]) - local_m);
                        if constexpr (KEEP_EXP) e[k * W + w] = ev;
                        s += ev;
                    }
        }
        Online acc;
        acc.m = nan ? CUDART_NAN_F : local_m;
        acc.s = nan ? CUDART_NAN_F : s;
        acc = reduce_over_y(acc);

        if (n > 0) {
            // exp(x - thread max) rescaled to the group's max; zero where the thread or the
            // whole group saw only -inf.
            const bool masked = local_m == -CUDART_INF_F || acc.m == -CUDART_INF_F;
            const float scale = masked ? 0.f : __expf(local_m - acc.m) / acc.s;
            const float log_s = __logf(acc.s);
            Cursor cur;
            cur.seek(L, threadIdx.y);
            store_units<UNITS, W>(y + base, L, cur, step, n, [&](int k, int w) {
                const float v = to_float(raw[k].v[w]);
                if (isnan(acc.m)) return CUDART_NAN_F;
                if constexpr (LOG) {
                    // (x - m) first: exact for nearby values, so large x lose nothing.
                    return acc.m == -CUDART_INF_F ? -CUDART_INF_F : (v - acc.m) - log_s;
                } else {
                    if (masked) return 0.f;  // (e was not computed)
                    if constexpr (KEEP_EXP) return e[k * W + w] * scale;
                    return __expf(v - local_m) * scale;
                }
            });
        }
        if constexpr (PREFETCH) {
#pragma unroll
            for (int k = 0; k < UNITS; ++k) raw[k] = next[k];
            n = next_n;
        } else {
            break;  // launched with a block per column
        }
        base = next_base;
    }
}

// Block-wide max / sum for the one-row-per-block kernel: warp shuffles, then one value per warp
// through shared memory. Every thread gets the result.
template <bool MAX> __device__ __forceinline__ float block_fold(float v, float* scratch) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        const float w = __shfl_xor_sync(0xffffffffu, v, off);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    const uint32_t warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // a previous fold's readers are done with `scratch`
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : (MAX ? -CUDART_INF_F : 0.f);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        const float w = __shfl_xor_sync(0xffffffffu, v, off);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    return v;
}

// Contiguous rows of at most VPT * blockDim.x 16-byte vectors (W elements each), a block per
// row, no persistent loop: each thread loads its VPT vectors once, the block folds the max and
// then the sum of exp(x - max), and the thread writes from registers. One read, one write.
// blockDim.x is a multiple of 32. Same special values as the other kernels: NaN anywhere makes
// the row NaN; a row of -inf gives zeros (log: -inf).
template <typename T, int W, bool LOG, int VPT>
__device__ void softmax_row_block(const T* __restrict__ x, T* __restrict__ y, const ReduceLayout& L) {
    using U = Unit<T, W>;
    static_assert(sizeof(U) == 16, "the row kernel moves 16-byte vectors");
    __shared__ float scratch[32];
    const uint32_t g = blockIdx.x;
    const uint64_t base = group_base(L, g);
    const U* xr = reinterpret_cast<const U*>(x + base);
    U* yr = reinterpret_cast<U*>(y + base);
    U raw[VPT];
    float v[VPT][W];
    bool nan = false;
    float m = -CUDART_INF_F;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const uint32_t j = threadIdx.x + k * blockDim.x;
        if (j < L.group_size) {
            const uint4 bits = __ldcs(reinterpret_cast<const uint4*>(xr + j));
            raw[k] = *reinterpret_cast<const U*>(&bits);
#pragma unroll
            for (int w = 0; w < W; ++w) {
                v[k][w] = to_float(raw[k].v[w]);
                m = fmaxf(m, v[k][w]);
                nan |= isnan(v[k][w]);
            }
        }
    }
    nan = __syncthreads_or(nan);
    m = block_fold<true>(m, scratch);
    float s = 0.f;
    if (!nan && m != -CUDART_INF_F) {
#pragma unroll
        for (int k = 0; k < VPT; ++k)
            if (threadIdx.x + k * blockDim.x < L.group_size)
#pragma unroll
                for (int w = 0; w < W; ++w) {
                    const float e = __expf(v[k][w] - m);
                    if constexpr (!LOG) v[k][w] = e;
                    s += e;
                }
    }
    s = block_fold<false>(s, scratch);
    const float inv_s = 1.f / s, log_s = __logf(s);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const uint32_t j = threadIdx.x + k * blockDim.x;
        if (j < L.group_size) {
            U out;
#pragma unroll
            for (int w = 0; w < W; ++w) {
                float r;
                if (nan) r = CUDART_NAN_F;
                else if (m == -CUDART_INF_F) r = LOG ? -CUDART_INF_F : 0.f;
                else r = LOG ? (v[k][w] - m) - log_s : v[k][w] * inv_s;
                out.v[w] = from_float<T>(r);
            }
            __stcs(reinterpret_cast<uint4*>(yr + j), *reinterpret_cast<const uint4*>(&out));
        }
    }
}

// Asynchronous global -> shared copy of one unit (8 or 16 bytes).
template <int BYTES> __device__ __forceinline__ void cp_async_unit(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
    } else {
        static_assert(BYTES == 8 || BYTES == 4, "cp.async copies 4, 8 or 16 bytes");
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(BYTES) : "memory");
    }
}

// A store marked evict-first (st.cs) of one 8- or 16-byte unit.
template <typename U> __device__ __forceinline__ void store_streaming(U* p, const U& v) {
    if constexpr (sizeof(U) == 16) {
        __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
    } else if constexpr (sizeof(U) == 8) {
        __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&v));
    } else {
        *p = v;
    }
}

// Column-like groups (lanes form: a unit is element j of LANE_WIDTH adjacent groups) staged in
// shared memory: a block takes blockDim.x adjacent units of groups ("x") and all their
// elements, copies them in once (cp.async, nothing held in registers, so every copy of the block
// is in flight at once), reduces each group over the staged copy and writes from it. One read,
// one write. The offsets of the group_size elements are decomposed once per block into a table
// (thread y of a column walks elements y, y + blockDim.y, ...: adjacent y are adjacent in shared
// memory, so the copies do not conflict on banks). Shared memory: the table (group_size u32,
// padded to 16 bytes),
// then group_size * blockDim.x units, then blockDim.x * blockDim.y pairs.
template <typename T, bool LOG>
__device__ void softmax_staged(const T* __restrict__ x, T* __restrict__ y, const ReduceLayout& L) {
    constexpr int W = fastops_constants::softmax::LANE_WIDTH;
    using U = Unit<T, W>;
    extern __shared__ __align__(16) unsigned char staged_raw[];
    const uint32_t lx = blockDim.x, ly = blockDim.y, size = L.group_size;
    const uint32_t tid = threadIdx.y * lx + threadIdx.x, threads = lx * ly;
    uint32_t* offsets = reinterpret_cast<uint32_t*>(staged_raw);
    U* stage = reinterpret_cast<U*>(staged_raw + ((static_cast<size_t>(size) * sizeof(uint32_t) + 15) & ~size_t{15}));
    float2* pairs = reinterpret_cast<float2*>(reinterpret_cast<unsigned char*>(stage) +
                                              static_cast<size_t>(size) * lx * sizeof(U));
    for (uint32_t j = tid; j < size; j += threads) {
        Cursor cur;
        cur.seek(L, j);
        offsets[j] = static_cast<uint32_t>(cur.offset);  // < 2^32: checked by the host
    }
    __syncthreads();
    const uint32_t g = blockIdx.x * lx + threadIdx.x;  // this thread's unit of groups
    const bool valid = g < L.num_groups;
    const T* xg = x + (valid ? group_base(L, g * W) : 0);
    if (valid)
#pragma unroll 4
        for (uint32_t j = threadIdx.y; j < size; j += ly)
            cp_async_unit<sizeof(U)>(stage + j * lx + threadIdx.x, xg + offsets[j]);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();

    // Reduce: thread t folds lane t % (lx * W) (one group) over elements t / (lx * W), + parts, ...
    const uint32_t lanes = lx * W, parts = threads / lanes, lane = tid % lanes, part = tid / lanes;
    const T* first = reinterpret_cast<const T*>(stage) + part * lanes + lane;
    const T* end = reinterpret_cast<const T*>(stage) + size * lanes;
    const uint32_t stride = parts * lanes;
    float m = -CUDART_INF_F;
    bool nan = false;
    for (const T* p = first; p < end; p += stride) {
        const float v = to_float(*p);
        m = fmaxf(m, v);
        nan |= isnan(v);
    }
    float s = 0.f;
    if (m != -CUDART_INF_F)
        for (const T* p = first; p < end; p += stride) s += __expf(to_float(*p) - m);
    pairs[tid] = nan ? make_float2(CUDART_NAN_F, CUDART_NAN_F) : make_float2(m, s);
    __syncthreads();
    if (tid < lanes) {
        Online acc;
        for (uint32_t p = 0; p < parts; ++p) {
            const float2 q = pairs[p * lanes + tid];
            acc.merge(q.x, q.y);
        }
        // (shift, factor) such that softmax = exp(x - shift) * factor and log_softmax =
        // x - shift - factor with no branch per element: a group of -inf gets shift 0 and
        // factor 0 (log: +inf), a NaN group a NaN shift.
        const bool empty = acc.m == -CUDART_INF_F;
        const float shift = empty ? 0.f : acc.m;
        const float factor = LOG ? (empty ? CUDART_INF_F : __logf(acc.s)) : (empty ? 0.f : 1.f / acc.s);
        pairs[tid] = make_float2(shift, factor);
    }
    __syncthreads();

    if (!valid) return;
    float shift[W], factor[W];
#pragma unroll
    for (int w = 0; w < W; ++w) {
        const float2 q = pairs[threadIdx.x * W + w];
        shift[w] = q.x;
        factor[w] = q.y;
    }
    T* yg = y + (xg - x);
#pragma unroll 4
    for (uint32_t j = threadIdx.y; j < size; j += ly) {
        const U in = stage[j * lx + threadIdx.x];
        U out;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float d = to_float(in.v[w]) - shift[w];
            out.v[w] = from_float<T>(LOG ? d - factor[w] : __expf(d) * factor[w]);
        }
        store_streaming(reinterpret_cast<U*>(yg + offsets[j]), out);
    }
}

}  // namespace

// A block per contiguous row (`_row_block`), 16-byte vectors, 2 per thread.
#define SOFTMAX_ROW_BLOCK(T, SUFFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(ROW_BLOCK_MAX_THREADS) softmax_row_block_vec_##SUFFIX(const T* x, T* y,   \
                                                                                    ReduceLayout layout) { \
        softmax_row_block<T, 16 / sizeof(T), false, fastops_constants::softmax::ROW_BLOCK_VECTORS>(x, y, layout); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(ROW_BLOCK_MAX_THREADS) log_softmax_row_block_vec_##SUFFIX(const T* x, T* y, \
                                                                                        ReduceLayout layout) { \
        softmax_row_block<T, 16 / sizeof(T), true, fastops_constants::softmax::ROW_BLOCK_VECTORS>(x, y, layout); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS)                     \
        softmax_staged_lanes_##SUFFIX(const T* x, T* y, ReduceLayout layout) {                            \
        softmax_staged<T, false>(x, y, layout);                                                           \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS)                     \
        log_softmax_staged_lanes_##SUFFIX(const T* x, T* y, ReduceLayout layout) {                       \
        softmax_staged<T, true>(x, y, layout);                                                            \
    }
FASTOPS_FLOAT_KERNELS(SOFTMAX_ROW_BLOCK)

// Every kernel in up to three forms: `name_<dtype>` moves one element per access;
// `name_vec_<dtype>` a 16-byte vector of one group's run; `name_lanes_<dtype>` 4 elements spanning
// 4 adjacent groups (launched only when the host has described the layout in such units).
// `_rows` (prefetching, one resident wave; 3 blocks of 256 per SM) and `_cols` (a block per
// column) forms of the one-read kernel.
// One `_cached` kernel: NAME is softmax_cached_rows or _cols, LOG picks log_softmax, ROWS the
// prefetching rows form, BLOCKS the resident blocks per multiprocessor it is built for.
#define SOFTMAX_CACHED_ONE(T, SUFFIX, VARIANT, W, PREFIX, FORM, LOG, ROWS, BLOCKS)                          \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS, BLOCKS)               \
        PREFIX##softmax_cached_##FORM##VARIANT##SUFFIX(const T* x, T* y, ReduceLayout layout, uint32_t columns) { \
        softmax_cached<T, W, LOG, ROWS>(x, y, layout, columns);                                              \
    }

#define SOFTMAX_CACHED(T, SUFFIX, VARIANT, W)                                  \
    SOFTMAX_CACHED_ONE(T, SUFFIX, VARIANT, W, , rows, false, true, 3)          \
    SOFTMAX_CACHED_ONE(T, SUFFIX, VARIANT, W, log_, rows, true, true, 3)       \
    SOFTMAX_CACHED_ONE(T, SUFFIX, VARIANT, W, , cols, false, false, 5)         \
    SOFTMAX_CACHED_ONE(T, SUFFIX, VARIANT, W, log_, cols, true, false, 5)

#define SOFTMAX_FORM(T, SUFFIX, VARIANT, W, LANES)                                                        \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS) softmax_fused##VARIANT##SUFFIX(                     \
        const T* x, T* y, ReduceLayout layout, uint32_t chunk_len) {                                       \
        softmax_dims<T, W, LANES, false, Mode::Fused>(x, y, nullptr, layout, chunk_len);                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS) log_softmax_fused##VARIANT##SUFFIX(                 \
        const T* x, T* y, ReduceLayout layout, uint32_t chunk_len) {                                       \
        softmax_dims<T, W, LANES, true, Mode::Fused>(x, y, nullptr, layout, chunk_len);                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS) softmax_partial##VARIANT##SUFFIX(                   \
        const T* x, float2* partials, ReduceLayout layout, uint32_t chunk_len) {                           \
        softmax_dims<T, W, LANES, false, Mode::Partial>(x, nullptr, partials, layout, chunk_len);          \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS) softmax_finish##VARIANT##SUFFIX(                    \
        const T* x, T* y, const float2* partials, ReduceLayout layout, uint32_t chunk_len) {               \
        softmax_dims<T, W, LANES, false, Mode::Finish>(x, y, const_cast<float2*>(partials), layout,        \
                                                       chunk_len);                                         \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(fastops_constants::softmax::THREADS) log_softmax_finish##VARIANT##SUFFIX(                \
        const T* x, T* y, const float2* partials, ReduceLayout layout, uint32_t chunk_len) {               \
        softmax_dims<T, W, LANES, true, Mode::Finish>(x, y, const_cast<float2*>(partials), layout,         \
                                                      chunk_len);                                          \
    }

#define SOFTMAX_KERNELS(T, SUFFIX)                          \
    SOFTMAX_CACHED(T, SUFFIX, _, 1)                         \
    SOFTMAX_CACHED(T, SUFFIX, _vec_, (16 / sizeof(T)))      \
    SOFTMAX_FORM(T, SUFFIX, _, 1, false)                    \
    SOFTMAX_FORM(T, SUFFIX, _vec_, (16 / sizeof(T)), false) \
    SOFTMAX_FORM(T, SUFFIX, _lanes_, fastops_constants::softmax::LANE_WIDTH, true)

FASTOPS_FLOAT_KERNELS(SOFTMAX_KERNELS)
