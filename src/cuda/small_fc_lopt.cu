// small_fc_lopt: one optimizer step over many tensors at once (src/optim/multi_tensor.rs). A launch
// covers a group of up to GROUP tensors; its blocks walk a static list of fixed-size chunks of those
// tensors, so a model with hundreds of tensors costs a handful of launches, not thousands. In order:
//   lopt_square_sums: per matrix, the sums of g^2 over axis d0 and over axis d1 (the Adafactor
//                     reductions), straight from the gradient.
//   lopt_factors:     a block per matrix: the row / column accumulators (in place) and the factors.
//   lopt_stats:       the momenta, rms (and vector Adafactor) accumulators, in place; the sums of
//                     the squares of the 28 normalised-feature inputs per tensor.
//   lopt_update_mma / lopt_update_fma: the features rebuilt and normalised, the 39-32-32-2 MLP (f16
//                     tensor cores with f32 accumulation, or f32 FMAs), the parameter written in place.
// Every buffer is f32. The 11 time features are folded into the first layer's bias by the host.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int FEATURES = 28;
constexpr int HIDDEN = 32;
constexpr int GROUP = 128;
constexpr uint64_t CHUNK = 8192;
constexpr unsigned FULL_MASK = 0xffffffffu;

// Division by a per-tensor constant: a multiply-high and a shift for 32-bit dividends (round-up
// method, exact for every n < 2^32), a plain 64-bit division for tensors of 2^32 elements or more.
struct Divisor {
    uint64_t d;
    uint32_t magic, shift;
};

__device__ __forceinline__ uint64_t quotient(uint64_t n, const Divisor& v, bool wide) {
    if (wide) return n / v.d;
    const uint32_t n32 = static_cast<uint32_t>(n);
    return (static_cast<uint64_t>(__umulhi(n32, v.magic)) + n32) >> v.shift;
}

// The index of element e in the tensor with one axis removed (outer = the axis' stride x size).
__device__ __forceinline__ uint64_t drop_axis(uint64_t e, const Divisor& inner, const Divisor& outer, bool wide) {
    return quotient(e, outer, wide) * inner.d + (e - quotient(e, inner, wide) * inner.d);
}

// Mirrors `LoptMeta` in src/optim/multi_tensor.rs (repr(C)); one per tensor, built once.
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
};

struct Chunk {
    uint32_t tensor, pad;
    uint64_t start;
};

// This step's gradient and parameter of each tensor of the group (null gradient: skipped).
struct StepTensors {
    const float* grad[GROUP];
    float* param[GROUP];
};

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

// Decays of the three momenta, the rms and the three Adafactor accumulators.
struct Decays {
    float momentum[3], rms, adafactor[3], pad;
};

struct Hyper {
    float step_mult, exp_mult, lr, weight_decay;
};

__device__ __forceinline__ float srsqrt(float x) { return 1.0f / sqrtf(fmaxf(x, 1e-9f)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Adds v (active lanes only) to base[idx], with one atomic per warp when every active lane has the
// same idx (a run along the reduced axis). Lane 0 must be active.
__device__ __forceinline__ void add_at(float* base, uint64_t idx, float v, bool active) {
    const uint64_t idx0 = __shfl_sync(FULL_MASK, idx, 0);
    if (__all_sync(FULL_MASK, !active || idx == idx0)) {
        v = warp_sum(active ? v : 0.0f);
        if ((threadIdx.x & 31) == 0) atomicAdd(base + idx0, v);
    } else if (active) {
        atomicAdd(base + idx, v);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_square_sums(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                     uint32_t first, StepTensors ptrs, Buffers buf) {
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const Chunk ch = chunks[c];
        const LoptMeta& m = meta[ch.tensor];
        const float* __restrict__ g = ptrs.grad[ch.tensor - first];
        if (!m.factored || g == nullptr) continue;
        const uint64_t end = min(ch.start + CHUNK, m.n);
        for (uint64_t base = ch.start + (threadIdx.x & ~31u); base < end; base += THREADS) {
            const uint64_t e = base + lane;
            const bool active = e < end;
            const float v = active ? g[e] * g[e] : 0.0f;
            add_at(buf.row_sum + m.row_sum, drop_axis(e, m.inner0, m.outer0, m.wide), v, active);
            add_at(buf.col_sum + m.col_sum, drop_axis(e, m.inner1, m.outer1, m.wide), v, active);
        }
    }
}

// A block per matrix: row and column accumulators from the means of g^2 (+1e-30, as the
// reference adds it to every square), the per-batch means of the rows over axis d1, then the
// factors: row_factor = srsqrt(row / (mean over d1 + 1e-9)), col_factor = srsqrt(col).
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_factors(const LoptMeta* __restrict__ meta, uint32_t first, uint32_t count, StepTensors ptrs,
                 Buffers buf, Decays d) {
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
        const LoptMeta& m = meta[first + i];
        if (!m.factored || m.n == 0 || ptrs.grad[i] == nullptr) continue;
        float* row = buf.row + m.row;
        float* col = buf.col + m.col;
        for (uint64_t base = threadIdx.x & ~31u; base < m.rows; base += THREADS) {
            const uint64_t r = base + lane;
            const bool active = r < m.rows;
            const float mean = active ? buf.row_sum[m.row_sum + r] * m.inv_size0 + 1e-30f : 0.0f;
            const uint64_t b = drop_axis(r, m.row_inner1, m.row_outer1, m.wide);
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                float v = 0.0f;
                if (active) {
                    v = d.adafactor[k] * row[k * m.rows + r] + (1.0f - d.adafactor[k]) * mean;
                    row[k * m.rows + r] = v;
                }
                add_at(buf.batch_sum + m.batch + k * m.batches, b, v, active);
            }
        }
        for (uint64_t c = threadIdx.x; c < m.cols; c += THREADS) {
            const float mean = buf.col_sum[m.col_sum + c] * m.inv_size1 + 1e-30f;
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                const float v = d.adafactor[k] * col[k * m.cols + c] + (1.0f - d.adafactor[k]) * mean;
                col[k * m.cols + c] = v;
                buf.col_factor[m.col + k * m.cols + c] = srsqrt(v);
            }
        }
        __syncthreads();  // the batch sums are complete (only this block adds to them)
        for (uint64_t r = threadIdx.x; r < m.rows; r += THREADS) {
            const uint64_t b = drop_axis(r, m.row_inner1, m.row_outer1, m.wide);
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                const float mean = __ldcg(buf.batch_sum + m.batch + k * m.batches + b) * m.inv_size1;
                buf.row_factor[m.row + k * m.rows + r] = srsqrt(row[k * m.rows + r] / (mean + 1e-9f));
            }
        }
    }
}

namespace {

// One element after this step's accumulator updates.
struct Element {
    float g, p, m[3], v, full[3];
};

// The 28 normalised-feature inputs of element e (spec order), before the per-tensor scaling.
__device__ __forceinline__ void features(const LoptMeta& t, const Buffers& buf, uint64_t e, const Element& s,
                                         float (&x)[FEATURES]) {
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
    if (t.factored) {
        const uint64_t r = drop_axis(e, t.inner0, t.outer0, t.wide);
        const uint64_t c = drop_axis(e, t.inner1, t.outer1, t.wide);
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const uint64_t ri = t.row + k * t.rows + r, ci = t.col + k * t.cols + c;
            const float rf = buf.row_factor[ri], cf = buf.col_factor[ci];
            const float rk = buf.row[ri], ck = buf.col[ci];
            x[10 + k] = g * rf * cf;
            x[13 + k] = rk;
            x[16 + k] = ck;
            x[19 + k] = 1.0f / sqrtf(rk + 1e-8f);
            x[22 + k] = 1.0f / sqrtf(ck + 1e-8f);
            x[25 + k] = s.m[k] * rf * cf;
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

// Element e of tensor t with its accumulators as stored.
__device__ __forceinline__ Element load_element(const LoptMeta& t, const Buffers& buf, const float* grad,
                                                const float* param, uint64_t e) {
    Element s;
    s.g = grad[e];
    s.p = param[e];
    const float* state = buf.elem + t.elem;
#pragma unroll
    for (int k = 0; k < 3; ++k) s.m[k] = state[k * t.n + e];
    s.v = state[3 * t.n + e];
    if (!t.factored) {
#pragma unroll
        for (int k = 0; k < 3; ++k) s.full[k] = buf.full[t.full + k * t.n + e];
    }
    return s;
}

// Adds the block's sums of squared features into out[0..28] and clears acc.
__device__ __forceinline__ void flush_sums(float (&acc)[FEATURES], float (*partial)[FEATURES], float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) {
        const float v = warp_sum(acc[f]);
        if (lane == 0) partial[warp][f] = v;
        acc[f] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x < FEATURES) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += partial[w][threadIdx.x];
        atomicAdd(out + threadIdx.x, v);
    }
    __syncthreads();
}

}  // namespace

// Updates every element's accumulators in place (they hold the previous step's on entry) and adds
// the squares of its features into feat_sum[tensor * 28 + f] (zeroed by the host).
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_stats(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks, uint32_t first,
               StepTensors ptrs, Buffers buf, Decays d) {
    __shared__ float partial[WARPS][FEATURES];
    float acc[FEATURES];
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) acc[f] = 0.0f;
    int64_t current = -1;  // the tensor acc belongs to (block-uniform)
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const Chunk ch = chunks[c];
        const float* grad = ptrs.grad[ch.tensor - first];
        if (grad == nullptr) continue;
        if (ch.tensor != current) {
            if (current >= 0) flush_sums(acc, partial, buf.feat_sum + current * FEATURES);
            current = ch.tensor;
        }
        const LoptMeta& t = meta[ch.tensor];
        float* param = ptrs.param[ch.tensor - first];
        float* state = buf.elem + t.elem;
        const uint64_t end = min(ch.start + CHUNK, t.n);
        for (uint64_t e = ch.start + threadIdx.x; e < end; e += THREADS) {
            Element s = load_element(t, buf, grad, param, e);
            const float g2 = s.g * s.g;
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                s.m[k] = d.momentum[k] * s.m[k] + (1.0f - d.momentum[k]) * s.g;
                state[k * t.n + e] = s.m[k];
            }
            s.v = d.rms * s.v + (1.0f - d.rms) * g2;
            state[3 * t.n + e] = s.v;
            if (!t.factored) {
#pragma unroll
                for (int k = 0; k < 3; ++k) {
                    s.full[k] = d.adafactor[k] * s.full[k] + (1.0f - d.adafactor[k]) * (g2 + 1e-30f);
                    buf.full[t.full + k * t.n + e] = s.full[k];
                }
            }
            float x[FEATURES];
            features(t, buf, e, s, x);
#pragma unroll
            for (int f = 0; f < FEATURES; ++f) acc[f] = fmaf(x[f], x[f], acc[f]);
        }
    }
    if (current >= 0) flush_sums(acc, partial, buf.feat_sum + current * FEATURES);
}

namespace {

// mlp: w_in [32, 28] (the normalised-feature columns), b_eff [32] (bias plus time features),
// w_1 [32, 32], b_1 [32], w_out [2, 32], b_out [2], packed in that order.
constexpr int MLP_FLOATS = HIDDEN * FEATURES + HIDDEN + HIDDEN * HIDDEN + HIDDEN + 2 * HIDDEN + 2;
constexpr int W_IN = 0, B_EFF = W_IN + HIDDEN * FEATURES, W_1 = B_EFF + HIDDEN, B_1 = W_1 + HIDDEN * HIDDEN,
              W_OUT = B_1 + HIDDEN, B_OUT = W_OUT + 2 * HIDDEN;

__device__ __forceinline__ float relu_keep_nan(float s) { return s > 0.0f || s != s ? s : 0.0f; }

// The per-tensor normalisation 1 / sqrt(mean of squares + 1e-5), into norm[0..28].
__device__ __forceinline__ void load_norms(const float* sums, uint64_t n, float* norm) {
    __syncthreads();  // the previous tensor's norms are no longer read
    if (threadIdx.x < FEATURES) norm[threadIdx.x] = 1.0f / sqrtf(sums[threadIdx.x] / static_cast<float>(n) + 1e-5f);
    __syncthreads();
}

__device__ __forceinline__ float new_param(float p, float direction, float magnitude, const Hyper& h) {
    const float step = direction * expf(h.exp_mult * magnitude) * h.step_mult;
    p -= h.lr * step;
    if (h.weight_decay > 0.0f) p -= h.lr * h.weight_decay * p;
    return p;
}

// ---- f32 FMAs: each thread evaluates its element's MLP with the weights in shared memory.

__device__ __forceinline__ void mlp_fma(const float* w, float (&x)[FEATURES], float& direction, float& magnitude) {
    float h1[HIDDEN];
#pragma unroll
    for (int j = 0; j < HIDDEN; ++j) {
        float s = w[B_EFF + j];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) s = fmaf(w[W_IN + j * FEATURES + f], x[f], s);
        h1[j] = relu_keep_nan(s);
    }
    direction = w[B_OUT];
    magnitude = w[B_OUT + 1];
#pragma unroll 4
    for (int j = 0; j < HIDDEN; ++j) {
        float s = w[B_1 + j];
#pragma unroll
        for (int i = 0; i < HIDDEN; ++i) s = fmaf(w[W_1 + j * HIDDEN + i], h1[i], s);
        s = relu_keep_nan(s);
        direction = fmaf(w[W_OUT + j], s, direction);
        magnitude = fmaf(w[W_OUT + HIDDEN + j], s, magnitude);
    }
}

// ---- f16 tensor cores: a warp evaluates 32 elements as two 16-row tiles of mma.m16n8k16 with
// f32 accumulation. Rows are elements, so each layer's accumulator fragment is, element for
// element, the next layer's A fragment (no data movement between layers); the weights are the
// B fragments, held in registers for the whole launch.

__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Feature rows of the warp's 32 elements in f16: 32 k-slots (features 0..27, then zeros), padded
// to 40 so that neither the row stores nor ldmatrix's 8-row reads conflict on banks.
constexpr int TILE_STRIDE = 40;

// Two resident blocks per SM (at most 128 registers): the loads of one hide behind the other's MLP.
constexpr int UPDATE_BLOCKS_PER_SM = 2;

struct MmaWeights {
    uint32_t w_in[2][4][2];  // [k tile][n tile][register]
    uint32_t w_1[2][4][2];
    uint32_t w_out[2][2];
    float b_in[4][2], b_1[4][2], b_out[2];

    // B fragment (k = 2 t + {0, 1} and 2 t + 8 + {0, 1}, n = g) and the accumulator's column bias
    // (columns 2 t + {0, 1}), with g = lane / 4 and t = lane % 4.
    __device__ __forceinline__ explicit MmaWeights(const float* __restrict__ mlp) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        auto w_in_at = [&](int k, int n) { return k < FEATURES ? mlp[W_IN + n * FEATURES + k] : 0.0f; };
        auto w_1_at = [&](int k, int n) { return mlp[W_1 + n * HIDDEN + k]; };
        auto w_out_at = [&](int k, int n) { return n < 2 ? mlp[W_OUT + n * HIDDEN + k] : 0.0f; };
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            const int k = kt * 16 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int n = nt * 8 + g;
                w_in[kt][nt][0] = pack_half2(w_in_at(k, n), w_in_at(k + 1, n));
                w_in[kt][nt][1] = pack_half2(w_in_at(k + 8, n), w_in_at(k + 9, n));
                w_1[kt][nt][0] = pack_half2(w_1_at(k, n), w_1_at(k + 1, n));
                w_1[kt][nt][1] = pack_half2(w_1_at(k + 8, n), w_1_at(k + 9, n));
            }
            w_out[kt][0] = pack_half2(w_out_at(k, g), w_out_at(k + 1, g));
            w_out[kt][1] = pack_half2(w_out_at(k + 8, g), w_out_at(k + 9, g));
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                b_in[nt][j] = mlp[B_EFF + nt * 8 + 2 * t + j];
                b_1[nt][j] = mlp[B_1 + nt * 8 + 2 * t + j];
            }
        }
        b_out[0] = t == 0 ? mlp[B_OUT] : 0.0f;
        b_out[1] = t == 0 ? mlp[B_OUT + 1] : 0.0f;
    }
};

// One dense layer on a 16-row tile: acc[n tile] = bias + a . W.
__device__ __forceinline__ void dense(const uint32_t (&a)[2][4], const uint32_t (&w)[2][4][2], const float (&bias)[4][2],
                                      float (&acc)[4][4]) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        acc[nt][0] = acc[nt][2] = bias[nt][0];
        acc[nt][1] = acc[nt][3] = bias[nt][1];
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) mma_f16(acc[nt], a[kt], w[kt][nt]);
    }
}

// relu of an accumulator tile as the next layer's A fragments: n tiles 2 kt and 2 kt + 1 are k
// tile kt's columns 0..7 and 8..15.
__device__ __forceinline__ void relu_to_a(const float (&acc)[4][4], uint32_t (&a)[2][4]) {
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float(&c)[4] = acc[2 * kt + h];
            a[kt][2 * h] = pack_half2(relu_keep_nan(c[0]), relu_keep_nan(c[1]));
            a[kt][2 * h + 1] = pack_half2(relu_keep_nan(c[2]), relu_keep_nan(c[3]));
        }
    }
}

// The warp's 32 elements (lane = element, x already normalised; zeros for idle lanes) through the
// MLP; each lane gets its element's direction and magnitude.
__device__ __forceinline__ void mlp_mma(const MmaWeights& w, __half (*tile)[TILE_STRIDE], const float (&x)[FEATURES],
                                        float& direction, float& magnitude) {
    const int lane = threadIdx.x & 31;
    __syncwarp();  // the previous iteration's ldmatrix reads are done
    uint4* row = reinterpret_cast<uint4*>(tile[lane]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint32_t v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int f = q * 8 + 2 * j;
            v[j] = f < FEATURES ? pack_half2(x[f], x[f + 1]) : 0u;
        }
        row[q] = make_uint4(v[0], v[1], v[2], v[3]);
    }
    __syncwarp();
    float out[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        uint32_t a[2][4];
        const int m = lane >> 3;
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            const __half* src = &tile[mt * 16 + (m & 1) * 8 + (lane & 7)][kt * 16 + (m >> 1) * 8];
            const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(src));
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(a[kt][0]), "=r"(a[kt][1]), "=r"(a[kt][2]), "=r"(a[kt][3])
                         : "r"(addr));
        }
        float acc[4][4];
        dense(a, w.w_in, w.b_in, acc);
        relu_to_a(acc, a);
        dense(a, w.w_1, w.b_1, acc);
        relu_to_a(acc, a);
        out[mt][0] = out[mt][2] = w.b_out[0];
        out[mt][1] = out[mt][3] = w.b_out[1];
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) mma_f16(out[mt], a[kt], w.w_out[kt]);
    }
    // Columns 0 / 1 (direction / magnitude) of row r of tile mt sit in lane 4 (r % 8), registers
    // 2 (r / 8) and 2 (r / 8) + 1.
    const int src = (lane & 7) * 4, upper = (lane >> 3) & 1, tile_of_lane = lane >> 4;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const float d0 = __shfl_sync(FULL_MASK, out[mt][0], src), m0 = __shfl_sync(FULL_MASK, out[mt][1], src);
        const float d1 = __shfl_sync(FULL_MASK, out[mt][2], src), m1 = __shfl_sync(FULL_MASK, out[mt][3], src);
        if (mt == tile_of_lane) {
            direction = upper ? d1 : d0;
            magnitude = upper ? m1 : m0;
        }
    }
}

// The MLP evaluators the update pass is written against: `(x, direction, magnitude)`.
struct FmaMlp {
    const float* w;  // the packed weights, in shared memory
    __device__ __forceinline__ void operator()(float (&x)[FEATURES], float& direction, float& magnitude) const {
        mlp_fma(w, x, direction, magnitude);
    }
};

struct MmaMlp {
    MmaWeights w;
    __half (*tile)[TILE_STRIDE];  // this warp's feature rows
    __device__ __forceinline__ void operator()(float (&x)[FEATURES], float& direction, float& magnitude) const {
        mlp_mma(w, tile, x, direction, magnitude);
    }
};

template <class Mlp>
__device__ __forceinline__ void update(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks,
                                       uint32_t n_chunks, uint32_t first, const StepTensors& ptrs, const Buffers& buf,
                                       const Hyper& h, const Mlp& mlp, float* norm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t current = -1;
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const Chunk ch = chunks[c];
        const float* grad = ptrs.grad[ch.tensor - first];
        if (grad == nullptr) continue;
        const LoptMeta& t = meta[ch.tensor];
        if (ch.tensor != current) {
            load_norms(buf.feat_sum + ch.tensor * FEATURES, t.n, norm);
            current = ch.tensor;
        }
        float* param = ptrs.param[ch.tensor - first];
        const uint64_t end = min(ch.start + CHUNK, t.n);
        // Warp-uniform trip count: the tensor-core path needs every lane in every mma.
        for (uint64_t base = ch.start + warp * 32; base < end; base += THREADS) {
            const uint64_t e = base + lane;
            const bool active = e < end;
            float x[FEATURES];
            Element s{};
            if (active) {
                s = load_element(t, buf, grad, param, e);
                features(t, buf, e, s, x);
#pragma unroll
                for (int f = 0; f < FEATURES; ++f) x[f] *= norm[f];
            } else {
#pragma unroll
                for (int f = 0; f < FEATURES; ++f) x[f] = 0.0f;
            }
            float direction = 0.0f, magnitude = 0.0f;
            mlp(x, direction, magnitude);
            if (active) param[e] = new_param(s.p, direction, magnitude, h);
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, UPDATE_BLOCKS_PER_SM)
    lopt_update_mma(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                    uint32_t first, StepTensors ptrs, Buffers buf, const float* __restrict__ mlp, Hyper h) {
    __shared__ float norm[FEATURES];
    __shared__ __align__(16) __half tiles[WARPS][32][TILE_STRIDE];
    const MmaMlp eval{MmaWeights(mlp), tiles[threadIdx.x >> 5]};
    update(meta, chunks, n_chunks, first, ptrs, buf, h, eval, norm);
}

extern "C" __global__ void __launch_bounds__(THREADS, UPDATE_BLOCKS_PER_SM)
    lopt_update_fma(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                    uint32_t first, StepTensors ptrs, Buffers buf, const float* __restrict__ mlp, Hyper h) {
    __shared__ float norm[FEATURES];
    __shared__ float w[MLP_FLOATS];
    for (int i = threadIdx.x; i < MLP_FLOATS; i += THREADS) w[i] = mlp[i];
    __syncthreads();
    update(meta, chunks, n_chunks, first, ptrs, buf, h, FmaMlp{w}, norm);
}
