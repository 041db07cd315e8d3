// Sparse feature transformer (the NNUE input layer), forward and backward.
//
//   out[b, half(b, p), :] = bias + sum_k value_p[b, k] * weight[index_p[b, k], :]
//
// for each position b and perspective p (one, or two sharing the weights; `half` puts the side
// to move first). A warp owns one (position, perspective) task at a time and a stripe of
// columns: each lane keeps LOADS groups of E adjacent columns in registers, so any output size
// works (a prime size just leaves lanes idle in the last stripe) and nothing lives in shared
// memory. The grid is persistent and walks the stripes of its launch in order, and the host
// launches groups of stripes whose weight rows (num_inputs x stripe columns) fit in half the L2,
// so the rows in use stay resident while every position gathers from them (a kernel boundary
// keeps two groups from competing for the cache). Each step of the feature loop issues UNROLL
// row loads before using any, since the gather is bound by L2 latency, not arithmetic.
//
// Activation: with `clamped` set the forward stores clamp(x, 0, ceiling) (a NaN stays NaN) and
// the backward passes the output gradient only where the stored output lies strictly inside
// (0, ceiling), reading the forward's output beside the gradient (the NNUE clipped ReLU, fused).
//
// Indices: a row's features end at its first -1; anything after it is ignored. An index < -1
// or >= num_inputs is never dereferenced: it contributes nothing and raises the call's error
// flag (a device word the host reads after the forward kernels; null in unchecked calls).
#include "common.cuh"

using namespace fastops;

namespace {

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int THREADS = fastops_constants::sparse_linear::THREADS;
constexpr int WARPS = THREADS / 32;

// Mirrors `SparseShape` in src/sparse_linear/cuda.rs (repr(C)).
struct SparseShape {
    uint32_t* error_flag;   // the call's bad-index word; null: bad indices are not reported
    uint64_t batch;
    uint64_t num_inputs;
    uint64_t out_dim;
    uint64_t index_stride;  // elements between consecutive rows of indices / values
    uint64_t weight_stride; // elements between consecutive weight rows
    uint64_t stripe_begin;  // the launch covers column stripes [stripe_begin, stripe_end)
    uint64_t stripe_end;
    uint32_t max_active;
    uint32_t perspectives;  // 1 or 2
    float ceiling;          // the clipped ReLU's upper bound (used when clamped != 0)
    uint32_t clamped;       // nonzero: the output is clamp(x, 0, ceiling)
};
static_assert(sizeof(SparseShape) == 80, "SparseShape is mirrored by a Rust #[repr(C)] struct of 80 bytes");

// The shape plus the feature tensors, as the kernels receive them.
struct SparseBatch {
    const int32_t* indices[2];
    const float* values[2];     // null: every value is 1
    const uint8_t* side_first;  // [batch]; null: perspective p goes to half p
    uint32_t* error_flag;
    uint64_t batch, num_inputs, out_dim, index_stride, weight_stride, stripe_begin, stripe_end;
    uint32_t max_active, perspectives;
    float ceiling;
    bool clamped;
    __device__ __forceinline__ SparseBatch(const SparseShape& sh, const int32_t* idx0, const int32_t* idx1,
                                           const float* val0, const float* val1, const uint8_t* side)
        : indices{idx0, idx1}, values{val0, val1}, side_first(side), error_flag(sh.error_flag), batch(sh.batch),
          num_inputs(sh.num_inputs), out_dim(sh.out_dim), index_stride(sh.index_stride),
          weight_stride(sh.weight_stride), stripe_begin(sh.stripe_begin), stripe_end(sh.stripe_end),
          max_active(sh.max_active), perspectives(sh.perspectives), ceiling(sh.ceiling),
          clamped(sh.clamped != 0) {}
};

// The (position, perspective) of task t and the half of the output row it fills.
struct Task {
    uint64_t position;
    int perspective;
    int half;
    __device__ __forceinline__ Task(const SparseBatch& s, uint64_t t) {
        if (s.perspectives == 2) {
            position = t >> 1;
            perspective = static_cast<int>(t & 1);
            half = (s.side_first == nullptr || s.side_first[position] != 0) ? perspective : 1 - perspective;
        } else {
            position = t;
            perspective = 0;
            half = 0;
        }
    }
};

// Up to 32 features of a row, one per lane: lane j holds feature base + j. `count` (warp-uniform)
// is how many are active before the row's first -1; `last` is set when the row ends in this chunk.
// A bad index gets index -2 (skipped) and raises the error flag.
struct FeatureChunk {
    int32_t index;
    float value;
    int count;
    bool last;
};

__device__ __forceinline__ FeatureChunk load_features(const SparseBatch& s, const Task& task, uint32_t base,
                                                      int lane) {
    const uint32_t k = base + lane;
    const uint64_t at = task.position * s.index_stride + k;
    int32_t index = -1;
    float value = 1.0f;
    if (k < s.max_active) {
        // Selected, not indexed: a dynamic index into the kernel parameter would copy it to the stack.
        index = (task.perspective ? s.indices[1] : s.indices[0])[at];
        const float* values = task.perspective ? s.values[1] : s.values[0];
        if (values != nullptr) value = values[at];
    }
    const unsigned ends = __ballot_sync(FULL_MASK, index == -1);
    FeatureChunk chunk;
    chunk.count = ends ? __ffs(ends) - 1 : 32;
    chunk.last = ends != 0 || base + 32 >= s.max_active;
    const bool bad = lane < chunk.count && (index < -1 || static_cast<uint64_t>(static_cast<int64_t>(index)) >= s.num_inputs);
    if (bad) {
        if (s.error_flag != nullptr) *s.error_flag = 1u;  // every writer stores 1: no ordering needed
        index = -2;
    }
    chunk.index = index;
    chunk.value = value;
    return chunk;
}

// A warp's walk of the forward and backward kernels: stripes of STRIPE output columns in
// [stripe_begin, stripe_end), and in each the tasks (batch position x perspective) t = warp,
// warp + warps, ... Lane `lane` owns LOADS groups of E adjacent columns of a stripe.
template <int LOADS, int E> struct StripeWalk {
    static constexpr uint64_t STRIPE = 32 * LOADS * E;
    int lane;
    uint64_t warp, warps, n_out, row_stride, tasks, stripes;

    __device__ __forceinline__ explicit StripeWalk(const SparseBatch& s)
        : lane(threadIdx.x & 31),
          warp((static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5),
          warps((static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5),
          n_out(s.out_dim),
          row_stride(s.out_dim * s.perspectives),
          tasks(s.batch * s.perspectives),
          stripes(min((s.out_dim + STRIPE - 1) / STRIPE, s.stripe_end)) {}

    // The first column of each of the lane's groups in `stripe`, and whether it is inside the output.
    __device__ __forceinline__ void columns(uint64_t stripe, uint64_t (&col)[LOADS], bool (&in_range)[LOADS]) const {
#pragma unroll
        for (int l = 0; l < LOADS; ++l) {
            col[l] = stripe * STRIPE + static_cast<uint64_t>(l * 32 + lane) * E;
            in_range[l] = col[l] < n_out;
        }
    }

    // The offset of a task's half row of the output (or output gradient).
    __device__ __forceinline__ uint64_t row(const Task& task) const {
        return task.position * row_stride + static_cast<uint64_t>(task.half) * n_out;
    }
};

// E adjacent columns moved as one unit: a 16-byte vector, or one element for the scalar form
// (output sizes that are not a multiple of the vector width, or misaligned buffers).
template <typename T, bool VEC> struct Group;

template <typename T> struct Group<T, true> {
    static constexpr int E = vec_width<T>();
    using Raw = uint4;
    static __device__ __forceinline__ Raw zero() { return make_uint4(0, 0, 0, 0); }
    static __device__ __forceinline__ Raw load(const T* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
    static __device__ __forceinline__ void unpack(Raw raw, float (&f)[E]) {
        Vec16<T> v;
        v.raw = raw;
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const float2 pair = to_float2(&v.lanes[e]);
            f[e] = pair.x;
            f[e + 1] = pair.y;
        }
    }
    static __device__ __forceinline__ void store(T* p, const float (&f)[E]) {
        Vec16<T> v;
#pragma unroll
        for (int e = 0; e < E; e += 2) from_float2(&v.lanes[e], f[e], f[e + 1]);
        store16<CacheHint::Streaming>(reinterpret_cast<uint4*>(p), v.raw);
    }
};

template <typename T> struct Group<T, false> {
    static constexpr int E = 1;
    using Raw = T;
    static __device__ __forceinline__ Raw zero() { return from_float<T>(0.0f); }
    static __device__ __forceinline__ Raw load(const T* p) { return __ldg(p); }
    static __device__ __forceinline__ void unpack(Raw raw, float (&f)[1]) { f[0] = to_float(raw); }
    static __device__ __forceinline__ void store(T* p, const float (&f)[1]) { __stcs(p, from_float<T>(f[0])); }
};


template <typename T, bool VEC, int LOADS, int UNROLL>
__device__ __forceinline__ void sparse_forward(const SparseBatch& s, const T* __restrict__ weight,
                                               const T* __restrict__ bias, T* __restrict__ out) {
    using G = Group<T, VEC>;
    constexpr int E = G::E;
    const StripeWalk<LOADS, E> walk(s);
    for (uint64_t stripe = s.stripe_begin; stripe < walk.stripes; ++stripe) {
        uint64_t col[LOADS];
        bool in_range[LOADS];
        walk.columns(stripe, col, in_range);
        float bias_part[LOADS][E];
#pragma unroll
        for (int l = 0; l < LOADS; ++l) G::unpack(in_range[l] ? G::load(bias + col[l]) : G::zero(), bias_part[l]);
        for (uint64_t t = walk.warp; t < walk.tasks; t += walk.warps) {
            const Task task(s, t);
            float acc[LOADS][E];
#pragma unroll
            for (int l = 0; l < LOADS; ++l)
#pragma unroll
                for (int e = 0; e < E; ++e) acc[l][e] = bias_part[l][e];

            for (uint32_t base = 0; base < s.max_active; base += 32) {
                const FeatureChunk chunk = load_features(s, task, base, walk.lane);
                for (int k = 0; k < chunk.count; k += UNROLL) {
                    typename G::Raw raw[UNROLL][LOADS];
                    float value[UNROLL];
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) {
                        const int32_t row = __shfl_sync(FULL_MASK, chunk.index, k + u);
                        value[u] = __shfl_sync(FULL_MASK, chunk.value, k + u);
                        const bool use = k + u < chunk.count && row >= 0;
                        if (!use) value[u] = 0.0f;
                        const T* weight_row = weight + static_cast<uint64_t>(use ? row : 0) * s.weight_stride;
#pragma unroll
                        for (int l = 0; l < LOADS; ++l)
                            raw[u][l] = (use && in_range[l]) ? G::load(weight_row + col[l]) : G::zero();
                    }
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                        for (int l = 0; l < LOADS; ++l) {
                            float w[E];
                            G::unpack(raw[u][l], w);
#pragma unroll
                            for (int e = 0; e < E; ++e) acc[l][e] = fmaf(value[u], w[e], acc[l][e]);
                        }
                }
                if (chunk.last) break;
            }

            if (s.clamped) {
#pragma unroll
                for (int l = 0; l < LOADS; ++l)
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[l][e] = clipped_relu(acc[l][e], s.ceiling);
            }
            T* dst = out + walk.row(task);
#pragma unroll
            for (int l = 0; l < LOADS; ++l)
                if (in_range[l]) G::store(dst + col[l], acc[l]);
        }
    }
}

// Four output-gradient columns of dtype T as floats, and the matching weight-gradient update.
template <typename T, bool VEC> struct GradGroup;

template <typename T> struct GradGroup<T, true> {
    static constexpr int E = 4;
    static __device__ __forceinline__ void load(const T* p, float (&g)[4]) {
        if constexpr (sizeof(T) == 4) {
            const float4 v = __ldcs(reinterpret_cast<const float4*>(p));
            g[0] = v.x, g[1] = v.y, g[2] = v.z, g[3] = v.w;
        } else {
            const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
            const T* halves = reinterpret_cast<const T*>(&raw);
            const float2 a = to_float2(halves), b = to_float2(halves + 2);
            g[0] = a.x, g[1] = a.y, g[2] = b.x, g[3] = b.y;
        }
    }
    // The same, cached normally: the by-feature gather reads each row once per active feature.
    static __device__ __forceinline__ void load_reused(const T* p, float (&g)[4]) {
        if constexpr (sizeof(T) == 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(p));
            g[0] = v.x, g[1] = v.y, g[2] = v.z, g[3] = v.w;
        } else {
            const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
            const T* halves = reinterpret_cast<const T*>(&raw);
            const float2 a = to_float2(halves), b = to_float2(halves + 2);
            g[0] = a.x, g[1] = a.y, g[2] = b.x, g[3] = b.y;
        }
    }
    static __device__ __forceinline__ void add(float* p, float v, const float (&g)[4]) {
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(p), make_float4(v * g[0], v * g[1], v * g[2], v * g[3]));
#else
#pragma unroll
        for (int e = 0; e < 4; ++e) atomicAdd(p + e, v * g[e]);
#endif
    }
};

template <typename T> struct GradGroup<T, false> {
    static constexpr int E = 1;
    static __device__ __forceinline__ void load(const T* p, float (&g)[1]) { g[0] = to_float(*p); }
    static __device__ __forceinline__ void load_reused(const T* p, float (&g)[1]) { g[0] = to_float(__ldg(p)); }
    static __device__ __forceinline__ void add(float* p, float v, const float (&g)[1]) { atomicAdd(p, v * g[0]); }
};

// grad has num_inputs + 1 rows of out_dim f32, zeroed by the host: rows [0, num_inputs) receive the
// weight gradient, the last row the bias gradient. Weight rows are updated with vector atomics,
// skipping groups whose output gradient is all zero (common behind a clamp). The bias gradient
// is summed in registers per warp, then across the block, and added with one atomic per column
// per block, not per position.
// `act_out` (the forward's output, same layout as grad_out) is read only when s.clamped.
template <typename T, bool VEC, int LOADS>
__device__ __forceinline__ void sparse_backward(const SparseBatch& s, const T* __restrict__ grad_out,
                                                const T* __restrict__ act_out, float* __restrict__ grad) {
    using G = GradGroup<T, VEC>;
    constexpr int E = G::E;
    using Walk = StripeWalk<LOADS, E>;
    constexpr int STRIPE = static_cast<int>(Walk::STRIPE);
    __shared__ float bias_partial[WARPS][STRIPE];
    const Walk walk(s);
    const int lane = walk.lane;
    const int warp_in_block = threadIdx.x >> 5;
    const uint64_t n_out = walk.n_out;
    float* bias_grad = grad + s.num_inputs * n_out;
    const float ceiling = to_float(from_float<T>(s.ceiling));

    for (uint64_t stripe = s.stripe_begin; stripe < walk.stripes; ++stripe) {
        uint64_t col[LOADS];
        bool in_range[LOADS];
        walk.columns(stripe, col, in_range);
        float bias_sum[LOADS][E] = {};
        for (uint64_t t = walk.warp; t < walk.tasks; t += walk.warps) {
            const Task task(s, t);
            const uint64_t row_at = walk.row(task);
            float g[LOADS][E];
            bool nonzero[LOADS];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) {
                if (in_range[l]) {
                    G::load(grad_out + row_at + col[l], g[l]);
                    if (s.clamped) {
                        float y[E];
                        G::load(act_out + row_at + col[l], y);
#pragma unroll
                        for (int e = 0; e < E; ++e) g[l][e] = through_clipped_relu(g[l][e], y[e], ceiling);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < E; ++e) g[l][e] = 0.0f;
                }
                nonzero[l] = false;
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    bias_sum[l][e] += g[l][e];
                    nonzero[l] |= g[l][e] != 0.0f;
                }
            }
            for (uint32_t base = 0; base < s.max_active; base += 32) {
                const FeatureChunk chunk = load_features(s, task, base, walk.lane);
                for (int k = 0; k < chunk.count; ++k) {
                    const int32_t row = __shfl_sync(FULL_MASK, chunk.index, k);
                    const float value = __shfl_sync(FULL_MASK, chunk.value, k);
                    if (row < 0) continue;
                    float* dst = grad + static_cast<uint64_t>(row) * n_out;
#pragma unroll
                    for (int l = 0; l < LOADS; ++l)
                        if (nonzero[l]) G::add(dst + col[l], value, g[l]);
                }
                if (chunk.last) break;
            }
        }
#pragma unroll
        for (int l = 0; l < LOADS; ++l)
#pragma unroll
            for (int e = 0; e < E; ++e) bias_partial[warp_in_block][(l * 32 + lane) * E + e] = bias_sum[l][e];
        __syncthreads();
        for (int c = threadIdx.x; c < STRIPE; c += THREADS) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) sum += bias_partial[w][c];
            const uint64_t column = stripe * STRIPE + c;
            if (column < n_out && sum != 0.0f) atomicAdd(bias_grad + column, sum);
        }
        __syncthreads();
    }
}


// Deterministic backward: the host sorts every active (feature, slot) pair by feature, keeping
// batch order, and cuts each feature's run into pieces of at most a few dozen entries. A warp sums
// one piece in order (rows: output-gradient row, values: feature value) and stores it: straight
// into the gradient row when the feature has one piece, into a scratch row otherwise. A second
// kernel adds each multi-piece feature's scratch rows in order. No atomics, so the result is the
// same on every run. The bias gradient is one more "feature" whose entries are every row, value 1.
// pieces: [key, begin, end, scratch row or NO_SCRATCH] per piece.
constexpr uint32_t NO_SCRATCH = 0xffffffffu;
// A piece of a feature with several pieces that adds itself into the gradient row with atomics
// (the GPU-sorted backward; its gradient is zeroed first).
constexpr uint32_t ATOMIC_SLOT = 0xfffffffeu;

template <typename T, bool VEC>
__device__ __forceinline__ void gather_pieces(const uint32_t* __restrict__ pieces, uint64_t num_pieces,
                                              const uint32_t* __restrict__ rows, const float* __restrict__ values,
                                              const T* __restrict__ grad_out, const T* __restrict__ act_out,
                                              float ceiling_in, uint64_t out_dim, float* __restrict__ grad,
                                              float* __restrict__ scratch, const uint32_t* __restrict__ piece_count) {
    using G = GradGroup<T, VEC>;
    constexpr int E = G::E;
    constexpr int UNROLL = 8;
    // Stripes of 32 x E columns are the outer loop, as in the forward: while the grid walks the
    // pieces of one stripe, only that stripe of the output gradient is being gathered, so it
    // stays in L2 (the whole output gradient may not fit there).
    constexpr uint64_t STRIPE = 32 * E;
    const int lane = threadIdx.x & 31;
    const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const uint64_t warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
    const float ceiling = to_float(from_float<T>(ceiling_in));
    // A device-side count (the GPU-built list) bounds the host's upper bound.
    if (piece_count != nullptr) num_pieces = min(num_pieces, static_cast<uint64_t>(*piece_count));
    const uint64_t stripes = (out_dim + STRIPE - 1) / STRIPE;
    for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
        const uint64_t col = stripe * STRIPE + static_cast<uint64_t>(lane) * E;
        const bool in_range = col < out_dim;
        for (uint64_t piece = warp; piece < num_pieces; piece += warps) {
            const uint4 p = __ldg(reinterpret_cast<const uint4*>(pieces) + piece);
            const uint32_t key = p.x, begin = p.y, count = p.z - p.y, slot = p.w;
            // Lane j holds entry begin + j (a piece has at most 32 entries).
            const uint32_t my_row = lane < count ? rows[begin + lane] : 0;
            const float my_value = lane < count ? values[begin + lane] : 0.0f;
            float acc[E];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] = 0.0f;
            for (uint32_t k = 0; k < count; k += UNROLL) {
                float g[UNROLL][E], v[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const uint32_t i = k + u;
                    const uint32_t row = __shfl_sync(FULL_MASK, my_row, i & 31);
                    v[u] = __shfl_sync(FULL_MASK, my_value, i & 31);
                    if (i < count && in_range) {
                        const uint64_t at = static_cast<uint64_t>(row) * out_dim + col;
                        G::load_reused(grad_out + at, g[u]);
                        if (act_out != nullptr) {
                            float y[E];
                            G::load_reused(act_out + at, y);
#pragma unroll
                            for (int e = 0; e < E; ++e) g[u][e] = through_clipped_relu(g[u][e], y[e], ceiling);
                        }
                    } else {
                        v[u] = 0.0f;
#pragma unroll
                        for (int e = 0; e < E; ++e) g[u][e] = 0.0f;
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[e] = fmaf(v[u], g[u][e], acc[e]);
            }
            if (!in_range) continue;
            if (slot == ATOMIC_SLOT) {
                G::add(grad + static_cast<uint64_t>(key) * out_dim + col, 1.0f, acc);
            } else {
                float* dst = slot == NO_SCRATCH ? grad + static_cast<uint64_t>(key) * out_dim
                                                : scratch + static_cast<uint64_t>(slot) * out_dim;
#pragma unroll
                for (int e = 0; e < E; ++e) dst[col + e] = acc[e];
            }
        }
    }
}

// The GPU-sorted backward builds the deterministic backward's work list on the device (its
// order within a feature follows atomics, so it is not deterministic): count each feature's
// active slots, scan the counts into offsets and piece numbers, scatter (output-gradient row,
// value) pairs into each feature's run, cut the runs into pieces. Keys are features
// 0 .. num_inputs - 1 and the bias, key num_inputs, fed by every row (value 1).
__device__ __forceinline__ void count_features(const SparseBatch& s, uint32_t* __restrict__ counts) {
    const int lane = threadIdx.x & 31;
    const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const uint64_t warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
    for (uint64_t t = warp; t < s.batch * s.perspectives; t += warps) {
        const Task task(s, t);
        for (uint32_t base = 0;; base += 32) {
            const FeatureChunk chunk = load_features(s, task, base, lane);
            if (lane < chunk.count && chunk.index >= 0) atomicAdd(counts + chunk.index, 1u);
            if (chunk.last) break;
        }
    }
}

__device__ __forceinline__ void scatter_features(const SparseBatch& s, const uint32_t* __restrict__ offsets,
                                                 uint32_t* __restrict__ cursor, uint32_t* __restrict__ rows,
                                                 float* __restrict__ values) {
    const int lane = threadIdx.x & 31;
    const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const uint64_t warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
    for (uint64_t t = warp; t < s.batch * s.perspectives; t += warps) {
        const Task task(s, t);
        const uint32_t grad_row = static_cast<uint32_t>(task.position * s.perspectives + task.half);
        for (uint32_t base = 0;; base += 32) {
            const FeatureChunk chunk = load_features(s, task, base, lane);
            if (lane < chunk.count && chunk.index >= 0) {
                const uint32_t at = atomicAdd(cursor + chunk.index, 1u);
                rows[at] = grad_row;
                values[at] = chunk.value;
            }
            if (chunk.last) break;
        }
        if (lane == 0) {
            const uint32_t at = offsets[s.num_inputs] + static_cast<uint32_t>(t);
            rows[at] = grad_row;
            values[at] = 1.0f;
        }
    }
}

// One block of SCAN_THREADS: offsets (keys + 1 entries) = exclusive scan of the counts, with the
// bias key's count `bias_count`; cursor = offsets; piece_first (keys + 1) = exclusive scan of
// ceil(count / piece). Keys go through shared memory a tile of SCAN_THREADS x SCAN_RUN at a
// time (loads and stores coalesced); each thread scans a run of SCAN_RUN keys of the tile.
constexpr int SCAN_THREADS = fastops_constants::sparse_linear::SCAN_THREADS;
constexpr int SCAN_RUN = 4;
constexpr int SCAN_TILE = SCAN_THREADS * SCAN_RUN;
__device__ __forceinline__ void plan_features(const uint32_t* __restrict__ counts, uint32_t keys,
                                              uint32_t bias_count, uint32_t piece, uint32_t* __restrict__ offsets,
                                              uint32_t* __restrict__ cursor, uint32_t* __restrict__ piece_first) {
    __shared__ uint32_t tile_entries[SCAN_TILE], tile_pieces[SCAN_TILE];
    __shared__ uint32_t warp_entries[SCAN_THREADS / 32], warp_pieces[SCAN_THREADS / 32];
    const uint32_t t = threadIdx.x, lane = t & 31, warp = t >> 5;
    uint32_t carry_entries = 0, carry_pieces = 0;
    for (uint32_t tile = 0; tile < keys; tile += SCAN_TILE) {
        for (uint32_t i = t; i < SCAN_TILE; i += SCAN_THREADS) {
            const uint32_t k = tile + i;
            const uint32_t c = k + 1 == keys ? bias_count : (k < keys ? counts[k] : 0u);
            tile_entries[i] = c;
            tile_pieces[i] = (c + piece - 1) / piece;
        }
        __syncthreads();
        uint32_t entries = 0, pieces = 0;
#pragma unroll
        for (int r = 0; r < SCAN_RUN; ++r) {
            entries += tile_entries[t * SCAN_RUN + r];
            pieces += tile_pieces[t * SCAN_RUN + r];
        }
        // Inclusive scan across the warp, then across the warps' totals.
        uint32_t e_inc = entries, p_inc = pieces;
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const uint32_t e = __shfl_up_sync(FULL_MASK, e_inc, off), p = __shfl_up_sync(FULL_MASK, p_inc, off);
            if (lane >= static_cast<uint32_t>(off)) e_inc += e, p_inc += p;
        }
        if (lane == 31) warp_entries[warp] = e_inc, warp_pieces[warp] = p_inc;
        __syncthreads();
        if (warp == 0) {
            uint32_t e = warp_entries[lane], p = warp_pieces[lane];
#pragma unroll
            for (int off = 1; off < 32; off *= 2) {
                const uint32_t e2 = __shfl_up_sync(FULL_MASK, e, off), p2 = __shfl_up_sync(FULL_MASK, p, off);
                if (lane >= static_cast<uint32_t>(off)) e += e2, p += p2;
            }
            warp_entries[lane] = e, warp_pieces[lane] = p;
        }
        __syncthreads();
        uint32_t e_at = carry_entries + e_inc - entries + (warp ? warp_entries[warp - 1] : 0);
        uint32_t p_at = carry_pieces + p_inc - pieces + (warp ? warp_pieces[warp - 1] : 0);
#pragma unroll
        for (int r = 0; r < SCAN_RUN; ++r) {
            const uint32_t i = t * SCAN_RUN + r, c = tile_entries[i], np = tile_pieces[i];
            tile_entries[i] = e_at;
            tile_pieces[i] = p_at;
            e_at += c;
            p_at += np;
        }
        carry_entries += warp_entries[SCAN_THREADS / 32 - 1];
        carry_pieces += warp_pieces[SCAN_THREADS / 32 - 1];
        __syncthreads();
        for (uint32_t i = t; i < SCAN_TILE && tile + i < keys; i += SCAN_THREADS) {
            offsets[tile + i] = cursor[tile + i] = tile_entries[i];
            piece_first[tile + i] = tile_pieces[i];
        }
        __syncthreads();  // the next tile reuses the shared arrays
    }
    if (t == 0) {
        offsets[keys] = carry_entries;
        piece_first[keys] = carry_pieces;
    }
}

// A warp per key writes its pieces: [key, begin, end, NO_SCRATCH (one piece: stored) or
// ATOMIC_SLOT (several: added)].
__device__ __forceinline__ void cut_pieces(const uint32_t* __restrict__ offsets, const uint32_t* __restrict__ piece_first,
                                           uint32_t keys, uint32_t piece, uint32_t* __restrict__ pieces) {
    const int lane = threadIdx.x & 31;
    const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const uint64_t warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
    for (uint64_t k = warp; k < keys; k += warps) {
        const uint32_t begin = offsets[k], end = offsets[k + 1], first = piece_first[k];
        const uint32_t count = piece_first[k + 1] - first;
        for (uint32_t j = lane; j < count; j += 32) {
            const uint32_t b = begin + j * piece;
            reinterpret_cast<uint4*>(pieces)[first + j] =
                make_uint4(static_cast<uint32_t>(k), b, min(end, b + piece), count > 1 ? ATOMIC_SLOT : NO_SCRATCH);
        }
    }
}

// groups: [key, first scratch row, number of scratch rows] per multi-piece feature.
__device__ __forceinline__ void combine_pieces(const uint32_t* __restrict__ groups, uint64_t num_groups,
                                               const float* __restrict__ scratch, uint64_t out_dim,
                                               float* __restrict__ grad) {
    const uint64_t thread = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    const uint64_t total = num_groups * out_dim;
    for (uint64_t i = thread; i < total; i += threads) {
        const uint64_t group = i / out_dim, col = i - group * out_dim;
        const uint32_t key = groups[3 * group], first = groups[3 * group + 1], count = groups[3 * group + 2];
        float sum = 0.0f;
        for (uint32_t r = 0; r < count; ++r) sum += scratch[static_cast<uint64_t>(first + r) * out_dim + col];
        grad[static_cast<uint64_t>(key) * out_dim + col] = sum;
    }
}

}  // namespace

#define SPARSE_FEATURE_ARGS                                                                                   \
    SparseShape shape, const int32_t *idx0, const int32_t *idx1, const float *val0, const float *val1,       \
        const uint8_t *side_first
#define SPARSE_BATCH SparseBatch(shape, idx0, idx1, val0, val1, side_first)
#define SPARSE_FORWARD(T, SUFFIX, NAME, VEC, LOADS, UNROLL)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 2)                                                  \
        NAME##_##SUFFIX(SPARSE_FEATURE_ARGS, const T* weight, const T* bias, T* out) {                       \
        sparse_forward<T, VEC, LOADS, UNROLL>(SPARSE_BATCH, weight, bias, out);                               \
    }
#define SPARSE_BACKWARD(T, SUFFIX, NAME, VEC, LOADS)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        NAME##_##SUFFIX(SPARSE_FEATURE_ARGS, const T* grad_out, const T* act_out, float* grad) {              \
        sparse_backward<T, VEC, LOADS>(SPARSE_BATCH, grad_out, act_out, grad);                                \
    }
#define SPARSE_GATHER(T, SUFFIX, NAME, VEC)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        NAME##_##SUFFIX(const uint32_t* pieces, uint64_t num_pieces, const uint32_t* rows, const float* values, \
                        const T* grad_out, const T* act_out, float ceiling, uint64_t out_dim, float* grad,     \
                        float* scratch, const uint32_t* piece_count) {                                         \
        gather_pieces<T, VEC>(pieces, num_pieces, rows, values, grad_out, act_out, ceiling, out_dim, grad,    \
                              scratch, piece_count);                                                           \
    }
#define SPARSE_KERNELS(T, SUFFIX)                                        \
    SPARSE_GATHER(T, SUFFIX, sparse_linear_bwd_sorted_vec, true)         \
    SPARSE_GATHER(T, SUFFIX, sparse_linear_bwd_sorted_scalar, false)     \
    SPARSE_FORWARD(T, SUFFIX, sparse_linear_fwd_vec2, true, 2, 4)        \
    SPARSE_FORWARD(T, SUFFIX, sparse_linear_fwd_vec1, true, 1, 8)        \
    SPARSE_FORWARD(T, SUFFIX, sparse_linear_fwd_scalar, false, 4, 8)     \
    SPARSE_BACKWARD(T, SUFFIX, sparse_linear_bwd_vec2, true, 2)          \
    SPARSE_BACKWARD(T, SUFFIX, sparse_linear_bwd_vec1, true, 1)          \
    SPARSE_BACKWARD(T, SUFFIX, sparse_linear_bwd_scalar, false, 4)
FASTOPS_FLOAT_KERNELS(SPARSE_KERNELS)

extern "C" __global__ void __launch_bounds__(THREADS)
    sparse_linear_bwd_combine(const uint32_t* groups, uint64_t num_groups, const float* scratch, uint64_t out_dim,
                              float* grad) {
    combine_pieces(groups, num_groups, scratch, out_dim, grad);
}

// The GPU-sorted backward's list building (dtype-free: indices and values are i32 / f32).
extern "C" __global__ void __launch_bounds__(THREADS)
    sparse_linear_bwd_count(SPARSE_FEATURE_ARGS, uint32_t* counts) {
    count_features(SPARSE_BATCH, counts);
}
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    sparse_linear_bwd_plan(const uint32_t* counts, uint32_t keys, uint32_t bias_count, uint32_t piece,
                           uint32_t* offsets, uint32_t* cursor, uint32_t* piece_first) {
    plan_features(counts, keys, bias_count, piece, offsets, cursor, piece_first);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    sparse_linear_bwd_scatter(SPARSE_FEATURE_ARGS, const uint32_t* offsets, uint32_t* cursor, uint32_t* rows,
                              float* values) {
    scatter_features(SPARSE_BATCH, offsets, cursor, rows, values);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    sparse_linear_bwd_cut(const uint32_t* offsets, const uint32_t* piece_first, uint32_t keys, uint32_t piece,
                          uint32_t* pieces) {
    cut_pieces(offsets, piece_first, keys, piece, pieces);
}
