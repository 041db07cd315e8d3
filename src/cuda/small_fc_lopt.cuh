// small_fc_lopt's device code shared by the portable kernels (small_fc_lopt.cu) and the Hopper
// update kernel (sm90/small_fc_lopt.cu): the argument structs that src/optim/small_fc_lopt/cuda.rs
// mirrors, the chunk walk, the features, the tensor-core MLP's operand splits and output layer, and
// the update pass written against an MLP evaluator.
#pragma once
#include "common.cuh"

namespace {


using fastops_constants::small_fc_lopt::FEATURES;
using fastops_constants::small_fc_lopt::GROUP;
using fastops_constants::small_fc_lopt::HIDDEN;
using fastops_constants::small_fc_lopt::THREADS;
constexpr int WARPS = THREADS / 32;
constexpr uint64_t CHUNK = fastops_constants::small_fc_lopt::CHUNK;
constexpr unsigned FULL_MASK = 0xffffffffu;

// Division by a per-tensor constant: a multiply-high and a shift for 32-bit dividends (round-up
// method, exact for every n < 2^32), a plain 64-bit division for tensors of 2^32 elements or more.
struct Divisor {
    uint64_t d;
    uint32_t magic, shift;
};
static_assert(sizeof(Divisor) == 16, "Divisor is mirrored by a Rust #[repr(C)] struct of 16 bytes");

__device__ __forceinline__ uint64_t quotient(uint64_t n, const Divisor& v, bool wide) {
    if (wide) return n / v.d;
    const uint32_t n32 = static_cast<uint32_t>(n);
    return (static_cast<uint64_t>(__umulhi(n32, v.magic)) + n32) >> v.shift;
}

// The index of element e in the tensor with one axis removed (outer = the axis' stride x size).
__device__ __forceinline__ uint64_t drop_axis(uint64_t e, const Divisor& inner, const Divisor& outer, bool wide) {
    return quotient(e, outer, wide) * inner.d + (e - quotient(e, inner, wide) * inner.d);
}

// Mirrors `LoptMeta` in src/optim/small_fc_lopt/cuda.rs (repr(C)); one per tensor, built once.
struct LoptMeta {
    uint64_t n;
    uint64_t elem;              // [4, n] (momentum 0..2, rms) in the element-state buffer
    uint64_t full;              // vectors: [3, n] in the vector-accumulator buffer
    uint64_t row, col;          // matrices: [3, rows] / [3, cols] in the row / column buffers
    uint64_t row_sum, col_sum;  // [rows] / [cols] in the square-sum scratch
    uint64_t batch;             // [3, batches] in the batch-sum scratch
    uint64_t rows, cols, batches;
    Divisor inner0, outer0;          // element -> row index (axis d0 removed)
    Divisor inner1, outer1;          // element -> column index (axis d1 removed)
    Divisor row_inner1, row_outer1;  // row index -> batch (axis d1 removed from the row shape)
    float inv_size0, inv_size1;
    uint32_t factored, wide;
    uint32_t tiled, pad;  // tiled: a 2-D matrix whose square sums lopt_square_sums_tiled takes
};
static_assert(sizeof(LoptMeta) == 208, "LoptMeta is mirrored by a Rust #[repr(C)] struct of 208 bytes");

struct Chunk {
    uint32_t tensor, pad;
    uint64_t start;
};
static_assert(sizeof(Chunk) == 16, "Chunk is mirrored by a Rust #[repr(C)] struct of 16 bytes");

// This step's gradient and parameter of each tensor of the group (null gradient: skipped).
struct StepTensors {
    const float* grad[GROUP];
    float* param[GROUP];
};
static_assert(sizeof(StepTensors) == 2048, "StepTensors is mirrored by a Rust #[repr(C)] struct of 2048 bytes");

struct Buffers {
    float* elem;
    float* full;
    float* row;
    float* col;
    float* row_factor;
    float* col_factor;
    float* row_sum;
    float* col_sum;
    float* batch_sum;
    float* feat_sum;
};
static_assert(sizeof(Buffers) == 80, "Buffers is mirrored by a Rust #[repr(C)] struct of 80 bytes");

// Decays of the three momenta, the rms and the three Adafactor accumulators.
// Each decay's complement (1 - decay, rounded to f32 on the host as the device would round it)
// travels beside it, so that the element loops read both straight from the parameter bank instead
// of holding seven computed complements in registers for the whole kernel.
struct Decays {
    float momentum[3], rms, adafactor[3], pad;
    float momentum_rest[3], rms_rest, adafactor_rest[3], pad_rest;
};
static_assert(sizeof(Decays) == 64, "Decays is mirrored by a Rust #[repr(C)] struct of 64 bytes");

struct Hyper {
    float step_mult, exp_mult, lr, weight_decay;
};
static_assert(sizeof(Hyper) == 16, "Hyper is mirrored by a Rust #[repr(C)] struct of 16 bytes");

__device__ __forceinline__ float srsqrt(float x) { return 1.0f / sqrtf(fmaxf(x, 1e-9f)); }


// One element's inputs, as loaded: gradient, parameter, the stored accumulators and, for
// matrices, its row / column accumulators and factors. (The statistics pass loads two elements
// before it uses either; in the update pass, loading an iteration ahead was measured slower on the
// H200: its registers cost resident warps.)
struct Inputs {
    float g, p, m[3], v, full[3];
    float row[3], col[3], row_factor[3], col_factor[3];
};

// One chunk of one tensor as the element loops read it: every stream's base at the chunk's first
// element (or at the tensor's first row / column), so that an element's address is a base plus a
// 32-bit offset. The block builds it in shared memory when it takes the chunk (open_chunk); the
// loops then read no tensor metadata from global memory and do no 64-bit index arithmetic.
struct ChunkStreams {
    const float* grad;
    float* param;
    float* state[4];           // momenta 0..2, then rms
    float* full[3];            // vectors: the Adafactor accumulators
    const float* row[3];       // matrices: [k] the k-th row accumulators (indexed by row) ...
    const float* col[3];       // ... column accumulators,
    const float* row_factor[3];
    const float* col_factor[3];  // ... and factors
    uint64_t first;            // the chunk's first element, as an index into the tensor
    uint32_t count;            // elements in the chunk (<= CHUNK)
    uint32_t factored, wide;   // wide: the tensor has 2^32 elements or more (64-bit quotients)
    uint32_t pad;
    Divisor inner0, outer0, inner1, outer1;  // element -> row / column index, as in LoptMeta
};

// Thread 0 fills `c` for chunk `ch`; the caller syncs the block before and after.
__device__ __forceinline__ void open_chunk(ChunkStreams& c, const LoptMeta& t, const Chunk& ch, const float* grad,
                                           float* param, const Buffers& buf) {
    const uint64_t start = ch.start;
    c.grad = grad + start;
    c.param = param + start;
#pragma unroll
    for (int k = 0; k < 4; ++k) c.state[k] = buf.elem + t.elem + k * t.n + start;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        if (t.factored) {
            c.row[k] = buf.row + t.row + k * t.rows;
            c.col[k] = buf.col + t.col + k * t.cols;
            c.row_factor[k] = buf.row_factor + t.row + k * t.rows;
            c.col_factor[k] = buf.col_factor + t.col + k * t.cols;
        } else {
            c.full[k] = buf.full + t.full + k * t.n + start;
        }
    }
    c.first = start;
    c.count = static_cast<uint32_t>(min(start + CHUNK, t.n) - start);
    c.factored = t.factored;
    c.wide = t.wide;
    c.inner0 = t.inner0;
    c.outer0 = t.outer0;
    c.inner1 = t.inner1;
    c.outer1 = t.outer1;
}

// A unit of UNIT_WARPS consecutive warps that walks chunks together: the whole block
// (UNIT_WARPS == WARPS, synced by __syncthreads) or half the block (named barrier 1 + its index
// in the block, so that the two units of a block never wait for each other).
template <uint32_t UNIT_WARPS>
struct Unit {
    static_assert(WARPS % UNIT_WARPS == 0, "whole units per block");
    static constexpr uint32_t PER_BLOCK = WARPS / UNIT_WARPS;
    static constexpr uint32_t THREADS_PER_UNIT = UNIT_WARPS * 32;
    __device__ __forceinline__ static uint32_t index() { return threadIdx.x / THREADS_PER_UNIT; }
    __device__ __forceinline__ static uint32_t rank() { return threadIdx.x % THREADS_PER_UNIT; }
    __device__ __forceinline__ static void sync() {
        if constexpr (UNIT_WARPS == WARPS) {
            __syncthreads();
        } else {
            // Barrier ids as immediates (a register id makes ptxas reserve all 16).
            static_assert(PER_BLOCK == 2, "named barriers 1 and 2, one per unit");
            if (index() == 0) {
                asm volatile("bar.sync 1, %0;" ::"n"(THREADS_PER_UNIT) : "memory");
            } else {
                asm volatile("bar.sync 2, %0;" ::"n"(THREADS_PER_UNIT) : "memory");
            }
        }
    }
};

// A unit's walk into chunk `ch`: sync (the previous chunk's streams, and whatever `between`
// writes, are no longer read), the unit's first thread opens the chunk, every thread runs
// `between` (other per-chunk shared state, e.g. the tensor's feature norms), sync, then
// `span(std::bool_constant<WIDE>{})` with the chunk's width.
template <class U, class Between, class Span>
__device__ __forceinline__ void enter_chunk(ChunkStreams& streams, const LoptMeta& t, const Chunk& ch,
                                            const float* grad, float* param, const Buffers& buf,
                                            Between&& between, Span&& span) {
    U::sync();
    if (U::rank() == 0) open_chunk(streams, t, ch, grad, param, buf);
    between();
    U::sync();
    if (streams.wide) {
        span(std::true_type{});
    } else {
        span(std::false_type{});
    }
}

// drop_axis for tensors of fewer than 2^32 elements: every index fits 32 bits.
__device__ __forceinline__ uint32_t drop_axis32(uint32_t e, const Divisor& inner, const Divisor& outer) {
    const uint32_t q_outer = static_cast<uint32_t>(quotient(e, outer, false));
    const uint32_t q_inner = static_cast<uint32_t>(quotient(e, inner, false));
    const uint32_t d = static_cast<uint32_t>(inner.d);
    return q_outer * d + (e - q_inner * d);
}

// ROW_FEATURES = false leaves out what only the row / column features (13..24) of a matrix read:
// the statistics pass has their sums from lopt_factors. `o` is the element's offset in the chunk.
template <bool ROW_FEATURES, bool WIDE>
__device__ __forceinline__ Inputs load_inputs(const ChunkStreams& c, bool factored, uint32_t o) {
    Inputs s;
    s.g = c.grad[o];
    s.p = c.param[o];
#pragma unroll
    for (int k = 0; k < 3; ++k) s.m[k] = c.state[k][o];
    s.v = c.state[3][o];
    if (factored) {
        uint64_t r, col;
        if (WIDE) {
            const uint64_t e = c.first + o;
            r = drop_axis(e, c.inner0, c.outer0, true);
            col = drop_axis(e, c.inner1, c.outer1, true);
        } else {
            const uint32_t e = static_cast<uint32_t>(c.first) + o;
            r = drop_axis32(e, c.inner0, c.outer0);
            col = drop_axis32(e, c.inner1, c.outer1);
        }
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            if (ROW_FEATURES) {
                s.row[k] = c.row[k][r];
                s.col[k] = c.col[k][col];
            }
            s.row_factor[k] = c.row_factor[k][r];
            s.col_factor[k] = c.col_factor[k][col];
        }
    } else {
#pragma unroll
        for (int k = 0; k < 3; ++k) s.full[k] = c.full[k][o];
    }
    return s;
}

// This step's momenta and rms from the previous step's, in `s` (which holds the previous step's
// on entry). lopt_stats takes its feature statistics of these values without storing them; the
// update pass computes them again (the same code, so the same bits) and stores them with the
// parameter. So the memory-bound statistics pass stores only the small vectors' Adafactor
// accumulators (advance_vector_accumulators), and the rest of the stores ride on the
// compute-bound update pass.
__device__ __forceinline__ void advance_moments(const Decays& d, Inputs& s) {
#pragma unroll
    for (int k = 0; k < 3; ++k) s.m[k] = d.momentum[k] * s.m[k] + d.momentum_rest[k] * s.g;
    s.v = d.rms * s.v + d.rms_rest * (s.g * s.g);
}

// lopt_stats on a vector's element: its three Adafactor accumulators advanced in `s` and stored
// (the update pass reads them back).
__device__ __forceinline__ void advance_vector_accumulators(const ChunkStreams& c, uint32_t o, const Decays& d,
                                                            Inputs& s) {
    const float g2 = s.g * s.g + 1e-30f;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        s.full[k] = d.adafactor[k] * s.full[k] + d.adafactor_rest[k] * g2;
        c.full[k][o] = s.full[k];
    }
}

// The update pass: the momenta and rms advance_moments computed, stored for the element at `o`.
__device__ __forceinline__ void store_moments(const ChunkStreams& c, uint32_t o, const Inputs& s) {
#pragma unroll
    for (int k = 0; k < 3; ++k) c.state[k][o] = s.m[k];
    c.state[3][o] = s.v;
}

// The 28 normalised-feature inputs (spec order) from an element whose accumulators hold this
// step's values, before the per-tensor scaling.
template <bool ROW_FEATURES>
__device__ __forceinline__ void features(bool factored, const Inputs& s, float (&x)[FEATURES]) {
    const float g = s.g;
    const float rsqrt_v = 1.0f / sqrtf(s.v + 1e-6f);
    x[0] = g;
    x[1] = s.p;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        x[2 + k] = s.m[k];
        x[6 + k] = s.m[k] * rsqrt_v;
    }
    x[5] = s.v;
    x[9] = rsqrt_v;
    if (factored) {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const float rf = s.row_factor[k], cf = s.col_factor[k];
            x[10 + k] = g * rf * cf;
            x[25 + k] = s.m[k] * rf * cf;
            if (ROW_FEATURES) {
                const float rk = s.row[k], ck = s.col[k];
                x[13 + k] = rk;
                x[16 + k] = ck;
                x[19 + k] = 1.0f / sqrtf(rk + 1e-8f);
                x[22 + k] = 1.0f / sqrtf(ck + 1e-8f);
            } else {
                x[13 + k] = x[16 + k] = x[19 + k] = x[22 + k] = 0.0f;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const float f = s.full[k];
            x[10 + k] = g * srsqrt(f + 1e-9f);
            x[13 + k] = f;
            x[16 + k] = f;
            x[19 + k] = 1.0f / sqrtf(f + 1e-8f);
            x[22 + k] = x[19 + k];
            x[25 + k] = s.m[k] / sqrtf(f + 1e-6f);
        }
    }
}

// mlp: w_in [32, 28] (the normalised-feature columns), b_eff [32] (bias plus time features),
// w_1 [32, 32], b_1 [32], w_out [2, 32], b_out [2], packed in that order.
constexpr int MLP_FLOATS = HIDDEN * FEATURES + HIDDEN + HIDDEN * HIDDEN + HIDDEN + 2 * HIDDEN + 2;
constexpr int W_IN = 0, B_EFF = W_IN + HIDDEN * FEATURES, W_1 = B_EFF + HIDDEN, B_1 = W_1 + HIDDEN * HIDDEN,
              W_OUT = B_1 + HIDDEN, B_OUT = W_OUT + 2 * HIDDEN;

__device__ __forceinline__ float relu_keep_nan(float s) { return s > 0.0f || s != s ? s : 0.0f; }

// The per-tensor normalisation 1 / sqrt(mean of squares + 1e-5) of feature f < FEATURES.
__device__ __forceinline__ float feature_norm(const float* sums, uint64_t n, uint32_t f) {
    return 1.0f / sqrtf(sums[f] / static_cast<float>(n) + 1e-5f);
}

__device__ __forceinline__ float new_param(float p, float direction, float magnitude, const Hyper& h) {
    const float step = direction * expf(h.exp_mult * magnitude) * h.step_mult;
    p -= h.lr * step;
    if (h.weight_decay > 0.0f) p -= h.lr * h.weight_decay * p;
    return p;
}

// ---- f16 tensor cores: a warp evaluates its 32 elements as two 16-row tiles (mma.m16n8k16, or
// its rows of a warpgroup's wgmma m64n32k16, whose accumulators and register A fragments have the
// same layout per warp) with f32 accumulation. Rows are elements, so the first layer's
// accumulator fragment is, element for element, the second layer's A fragment (no data movement
// between layers). The output layer (32 -> 2) runs in f32 FMAs on the second layer's f32
// accumulators, so the direction sees no f16 rounding of its own. A layer marked SPLIT splits
// each operand v into hi = f16(v) and lo = f16(v - hi) and sums hi.hi + hi.lo + lo.hi (22
// significant bits per operand, at three times the mma count).

// hi and lo halves of (a, b), packed as the mma's f16 pairs.
struct Split2 {
    uint32_t hi, lo;
};

__device__ __forceinline__ Split2 split_half2(float a, float b) {
    const __half2 hi = __floats2half2_rn(a, b);
    const float2 back = __half22float2(hi);
    const __half2 lo = __floats2half2_rn(a - back.x, b - back.y);
    return {*reinterpret_cast<const uint32_t*>(&hi), *reinterpret_cast<const uint32_t*>(&lo)};
}

// Feature rows of the warp's 32 elements: 32 hi k-slots (features 0..27, a constant 1 that
// carries the first layer's bias, zeros), then the 32 lo slots; padded to 72 halves so that
// neither the row stores nor ldmatrix's 8-row reads conflict on banks.
constexpr int BIAS_SLOT = FEATURES;
constexpr int TILE_STRIDE = 72;

// A 16-row tile's A fragments ([k tile][register]), hi and lo.
struct SplitA {
    uint32_t hi[2][4], lo[2][4];
};

// The second layer's bias and the output layer (32 -> 2), f32, as the tensor-core MLPs read them
// from shared memory.
struct OutputWeights {
    float b_1[HIDDEN];
    float w_out[2][HIDDEN];  // [direction / magnitude][column]
    float b_out[2];

    // Every thread of the block calls it; the caller syncs before the first read.
    __device__ __forceinline__ void fill(const float* __restrict__ mlp) {
        for (int i = threadIdx.x; i < HIDDEN; i += blockDim.x) {
            b_1[i] = mlp[B_1 + i];
            w_out[0][i] = mlp[W_OUT + i];
            w_out[1][i] = mlp[W_OUT + HIDDEN + i];
        }
        if (threadIdx.x < 2) b_out[threadIdx.x] = mlp[B_OUT + threadIdx.x];
    }
};

// Layer `layer`'s weight at (k, n) of its 32 x 32 operand: the first layer's 28 feature columns,
// its bias in the constant slot, zeros; the second layer's weights.
__device__ __forceinline__ float weight_at(const float* __restrict__ mlp, int layer, int k, int n) {
    if (layer == 1) return mlp[W_1 + n * HIDDEN + k];
    return k < FEATURES ? mlp[W_IN + n * FEATURES + k] : k == BIAS_SLOT ? mlp[B_EFF + n] : 0.0f;
}

// The warp's 32 elements (lane = element, x already normalised) as the first layer's A fragments
// of two 16-row tiles: each lane writes its element's split row to the warp's `tile`, then
// ldmatrix reads the fragments back. With SPLIT_IN false only the hi parts are written and read.
template <bool SPLIT_IN>
__device__ __forceinline__ void features_to_a(__half (*tile)[TILE_STRIDE], const float (&x)[FEATURES], SplitA (&a)[2]) {
    const int lane = threadIdx.x & 31;
    __syncwarp();  // the previous iteration's ldmatrix reads are done
    uint4* row = reinterpret_cast<uint4*>(tile[lane]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int f = q * 8 + 2 * j;
            const float first = f < FEATURES ? x[f] : f == BIAS_SLOT ? 1.0f : 0.0f;
            const float second = f + 1 < FEATURES ? x[f + 1] : 0.0f;
            const Split2 v = split_half2(first, second);
            hi[j] = v.hi;
            lo[j] = v.lo;
        }
        row[q] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if (SPLIT_IN) row[4 + q] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    __syncwarp();
    const int m = lane >> 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const __half* src = tile[mt * 16 + (m & 1) * 8 + (lane & 7)] + (m >> 1) * 8;
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            fastops::ldmatrix_x4<false>(a[mt].hi[kt], fastops::shared_address(src + kt * 16));
            if (SPLIT_IN) fastops::ldmatrix_x4<false>(a[mt].lo[kt], fastops::shared_address(src + 32 + kt * 16));
        }
    }
}

// relu of the first layer's accumulators as the second layer's A fragments: n tiles 2 kt and
// 2 kt + 1 are k tile kt's columns 0..7 and 8..15.
__device__ __forceinline__ void relu_to_a(const float (&acc)[4][4], SplitA& a) {
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float(&c)[4] = acc[2 * kt + h];
            const Split2 top = split_half2(relu_keep_nan(c[0]), relu_keep_nan(c[1]));
            const Split2 bottom = split_half2(relu_keep_nan(c[2]), relu_keep_nan(c[3]));
            a.hi[kt][2 * h] = top.hi;
            a.lo[kt][2 * h] = top.lo;
            a.hi[kt][2 * h + 1] = bottom.hi;
            a.lo[kt][2 * h + 1] = bottom.lo;
        }
    }
}

// acc[n tile] of one 16-row tile = the second layer's bias, in the accumulator layout (lane's
// columns 2 t and 2 t + 1 of each 8-column n tile, rows g and g + 8).
__device__ __forceinline__ void bias_to_acc(const OutputWeights& w, float (&acc)[4][4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const float2 bias = *reinterpret_cast<const float2*>(&w.b_1[nt * 8 + 2 * t]);
        acc[nt][0] = acc[nt][2] = bias.x;
        acc[nt][1] = acc[nt][3] = bias.y;
    }
}

// The output layer in f32 on the second layer's accumulators (two 16-row tiles, the m16n8
// accumulator layout of each warp), each lane receiving the direction and magnitude of its own
// element (row lane % 16 of tile lane / 16).
__device__ __forceinline__ void output_layer(const OutputWeights& w, const float (&acc)[2][4][4], float& direction,
                                             float& magnitude) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    float out[2][4];  // [tile][direction, magnitude of row g; of row g + 8]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        // This lane's 8 columns of rows g and g + 8, then the quad's sum.
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const float2 wd = *reinterpret_cast<const float2*>(&w.w_out[0][nt * 8 + 2 * t]);
            const float2 wm = *reinterpret_cast<const float2*>(&w.w_out[1][nt * 8 + 2 * t]);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float top = relu_keep_nan(acc[mt][nt][j]), bottom = relu_keep_nan(acc[mt][nt][2 + j]);
                const float d = j ? wd.y : wd.x, m = j ? wm.y : wm.x;
                o[0] = fmaf(d, top, o[0]);
                o[1] = fmaf(m, top, o[1]);
                o[2] = fmaf(d, bottom, o[2]);
                o[3] = fmaf(m, bottom, o[3]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[i] += __shfl_xor_sync(FULL_MASK, o[i], 1);
            o[i] += __shfl_xor_sync(FULL_MASK, o[i], 2);
            out[mt][i] = o[i] + w.b_out[i & 1];
        }
    }
    // Row r of tile mt sits in the quad of lane 4 (r % 8), entries 2 (r / 8) and 2 (r / 8) + 1.
    const int src_lane = (lane & 7) * 4, upper = (lane >> 3) & 1, tile_of_lane = lane >> 4;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const float d0 = __shfl_sync(FULL_MASK, out[mt][0], src_lane);
        const float m0 = __shfl_sync(FULL_MASK, out[mt][1], src_lane);
        const float d1 = __shfl_sync(FULL_MASK, out[mt][2], src_lane);
        const float m1 = __shfl_sync(FULL_MASK, out[mt][3], src_lane);
        if (mt == tile_of_lane) {
            direction = upper ? d1 : d0;
            magnitude = upper ? m1 : m0;
        }
    }
}

// The update pass over one chunk (each element's momenta and rms advanced and stored, its
// parameter updated; a vector's Adafactor accumulators are stored by the statistics pass) by one
// unit of `Mlp::UNIT_WARPS` warps, written against an MLP evaluator `mlp(x, direction, magnitude)`
// whose `Mlp::WARPS_TOGETHER` consecutive warps evaluate together (1 for the per-warp mma.sync and
// FMA MLPs, 4 for a warpgroup's wgmma): each turn the unit takes its next run of 32 elements a
// warp, and every warp of an evaluation group runs every turn that the group runs. Every lane runs
// every iteration of its warp (the tensor-core paths need them all in each mma): a lane past the
// chunk's end evaluates a copy of the chunk's last element (the MLP's rows are independent) and
// stores nothing.
template <bool WIDE, class Mlp>
__device__ __forceinline__ void update_span(const ChunkStreams& c, const Decays& d, const Hyper& h, const Mlp& mlp,
                                            const float* norm) {
    using U = Unit<Mlp::UNIT_WARPS>;
    constexpr uint32_t GROUP_THREADS = Mlp::WARPS_TOGETHER * 32;
    static_assert(Mlp::UNIT_WARPS % Mlp::WARPS_TOGETHER == 0, "whole evaluation groups per unit");
    const uint32_t count = c.count;
    const uint32_t in_group = U::rank() % GROUP_THREADS;
    for (uint32_t base = U::rank() - in_group; base < count; base += U::THREADS_PER_UNIT) {
        const uint32_t o = base + in_group;
        const bool active = o < count;
        Inputs s = load_inputs<true, WIDE>(c, c.factored, active ? o : count - 1);
        advance_moments(d, s);
        if (active) store_moments(c, o, s);
        float x[FEATURES];
        features<true>(c.factored, s, x);
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) x[f] *= norm[f];
        float direction = 0.0f, magnitude = 0.0f;
        mlp(x, direction, magnitude);
        if (active) c.param[o] = new_param(s.p, direction, magnitude, h);
    }
}

// The update pass of a launch: each unit of `Mlp::UNIT_WARPS` warps walks its own chunks (unit u
// of block b takes chunk b * units + u, then every gridDim.x * units-th). With units smaller than
// the block (the wgmma MLP's warpgroups), a unit that finishes a chunk does not wait for the
// block's other units, whose warps progress at other rates; a unit of one warp would (a chunk's
// 8192 elements taking one warp eight times as long as a block) leave the launch a long tail.
template <class Mlp>
__device__ __forceinline__ void update(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks,
                                       uint32_t n_chunks, uint32_t first, const StepTensors& ptrs, const Buffers& buf,
                                       const Decays& d, const Hyper& h, const Mlp& mlp) {
    using U = Unit<Mlp::UNIT_WARPS>;
    __shared__ float norms[U::PER_BLOCK][FEATURES];
    __shared__ ChunkStreams unit_streams[U::PER_BLOCK];
    float* norm = norms[U::index()];
    ChunkStreams& streams = unit_streams[U::index()];
    const uint32_t units = gridDim.x * U::PER_BLOCK;
    int64_t current = -1;
    for (uint32_t c = blockIdx.x * U::PER_BLOCK + U::index(); c < n_chunks; c += units) {
        const Chunk ch = chunks[c];
        const float* grad = ptrs.grad[ch.tensor - first];
        if (grad == nullptr) continue;
        const LoptMeta& t = meta[ch.tensor];
        const bool new_tensor = ch.tensor != current;
        current = ch.tensor;
        enter_chunk<U>(
            streams, t, ch, grad, ptrs.param[ch.tensor - first], buf,
            [&] {
                const uint32_t f = U::rank();
                if (new_tensor && f < FEATURES)
                    norm[f] = feature_norm(buf.feat_sum + ch.tensor * FEATURES, t.n, f);
            },
            [&](auto wide) { update_span<decltype(wide)::value>(streams, d, h, mlp, norm); });
    }
}

}  // namespace
