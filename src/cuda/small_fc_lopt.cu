// small_fc_lopt, the two per-element passes of one tensor's step (src/optim/fused.rs):
//   lopt_stats:  updates the element's momenta, rms (and for vectors Adafactor) accumulators,
//                writes them, builds the 28 normalised-feature inputs in registers and adds their
//                squares into 28 sums (warp shuffles, a block reduction, one atomic per block per
//                feature).
//   lopt_update: rebuilds the features, scales them by the per-tensor norms, evaluates the
//                39-32-32-2 MLP with its weights in shared memory, and writes the new parameter.
// The small per-row / per-column Adafactor tensors of matrices are computed before these passes;
// the 11 time features are folded into the first layer's bias by the host.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int FEATURES = 28;
constexpr int HIDDEN = 32;

// Mirrors `LoptTensor` in src/optim/fused.rs (repr(C)).
struct LoptTensor {
    const float* grad;
    const float* param;
    const float* momentum[3];
    const float* rms;
    // Matrix (rank >= 2): per-row (axis d0 removed) and per-column (axis d1 removed) tensors.
    const float* row[3];
    const float* col[3];
    const float* row_factor[3];
    const float* col_factor[3];
    // Vector (rank <= 1): per-element accumulators; null for matrices.
    const float* full[3];
    uint64_t n;
    uint64_t inner0, size0;  // stride and size of axis d0
    uint64_t inner1, size1;  // stride and size of axis d1
    uint32_t factored;
    uint32_t pad;
};

__device__ __forceinline__ uint64_t drop_axis(uint64_t e, uint64_t inner, uint64_t size) {
    const uint64_t outer = e / (inner * size);
    return outer * inner + e % inner;
}

__device__ __forceinline__ float srsqrt(float x) { return 1.0f / sqrtf(fmaxf(x, 1e-9f)); }

// The state of one element after this step's accumulator updates.
struct Element {
    float g, p, m[3], v, full[3];
};

// Element e with the accumulators as stored (pass 2 reads what pass 1 wrote).
__device__ __forceinline__ Element load_element(const LoptTensor& t, uint64_t e) {
    Element x;
    x.g = t.grad[e];
    x.p = t.param[e];
#pragma unroll
    for (int k = 0; k < 3; ++k) x.m[k] = t.momentum[k][e];
    x.v = t.rms[e];
    if (!t.factored) {
#pragma unroll
        for (int k = 0; k < 3; ++k) x.full[k] = t.full[k][e];
    }
    return x;
}

__device__ __forceinline__ void features(const LoptTensor& t, uint64_t e, const Element& s, float (&x)[FEATURES]) {
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
        const uint64_t r = drop_axis(e, t.inner0, t.size0);
        const uint64_t c = drop_axis(e, t.inner1, t.size1);
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const float rf = t.row_factor[k][r], cf = t.col_factor[k][c];
            const float rk = t.row[k][r], ck = t.col[k][c];
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

// Decays of the three momenta, the rms and the three Adafactor accumulators.
struct Decays {
    float momentum[3], rms, adafactor[3], pad;
};

}  // namespace

// Pass 1: updates the accumulators of every element from the stored ones (t holds the previous
// step's) and writes them to out: momentum k at [k n, (k+1) n), rms at [3n, 4n), and for vectors
// the Adafactor accumulator k at [(4+k) n, (5+k) n). Sums of the squared features go to
// sums[0..28] (zeroed by the host).
extern "C" __global__ void __launch_bounds__(THREADS) lopt_stats(LoptTensor t, Decays d, float* out, float* sums) {
    __shared__ float partial[THREADS / 32][FEATURES];
    float acc[FEATURES];
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) acc[f] = 0.0f;
    const uint64_t n = t.n;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
        Element s = load_element(t, e);
        const float g2 = s.g * s.g;
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            s.m[k] = d.momentum[k] * s.m[k] + (1.0f - d.momentum[k]) * s.g;
            out[k * n + e] = s.m[k];
        }
        s.v = d.rms * s.v + (1.0f - d.rms) * g2;
        out[3 * n + e] = s.v;
        if (!t.factored) {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                s.full[k] = d.adafactor[k] * s.full[k] + (1.0f - d.adafactor[k]) * (g2 + 1e-30f);
                out[(4 + k) * n + e] = s.full[k];
            }
        }
        float x[FEATURES];
        features(t, e, s, x);
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) acc[f] = fmaf(x[f], x[f], acc[f]);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) {
        float v = acc[f];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) partial[warp][f] = v;
    }
    __syncthreads();
    if (threadIdx.x < FEATURES) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) v += partial[w][threadIdx.x];
        atomicAdd(sums + threadIdx.x, v);
    }
}

// mlp: w_in [32, 28] (the normalised-feature columns), b_eff [32] (bias plus time features),
// w_1 [32, 32], b_1 [32], w_out [2, 32], b_out [2], packed in that order.
constexpr int MLP_FLOATS = HIDDEN * FEATURES + HIDDEN + HIDDEN * HIDDEN + HIDDEN + 2 * HIDDEN + 2;

extern "C" __global__ void __launch_bounds__(THREADS) lopt_update(LoptTensor t, const float* sums, const float* mlp,
                                                                  float step_mult, float exp_mult, float lr,
                                                                  float weight_decay, float* out) {
    __shared__ float w[MLP_FLOATS];
    __shared__ float norm[FEATURES];
    for (int i = threadIdx.x; i < MLP_FLOATS; i += THREADS) w[i] = mlp[i];
    // The per-tensor norms from pass 1's sums of squares: 1 / sqrt(mean + 1e-5).
    if (threadIdx.x < FEATURES) norm[threadIdx.x] = 1.0f / sqrtf(sums[threadIdx.x] / static_cast<float>(t.n) + 1e-5f);
    __syncthreads();
    const float* w_in = w;
    const float* b_eff = w_in + HIDDEN * FEATURES;
    const float* w_1 = b_eff + HIDDEN;
    const float* b_1 = w_1 + HIDDEN * HIDDEN;
    const float* w_out = b_1 + HIDDEN;
    const float* b_out = w_out + 2 * HIDDEN;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < t.n; e += stride) {
        const Element s = load_element(t, e);
        float x[FEATURES];
        features(t, e, s, x);
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) x[f] *= norm[f];
        float h1[HIDDEN];
#pragma unroll
        for (int j = 0; j < HIDDEN; ++j) {
            float s = b_eff[j];
#pragma unroll
            for (int f = 0; f < FEATURES; ++f) s = fmaf(w_in[j * FEATURES + f], x[f], s);
            h1[j] = s > 0.0f || s != s ? s : 0.0f;  // relu that keeps NaN, as torch's does
        }
        float direction = b_out[0], magnitude = b_out[1];
#pragma unroll 4
        for (int j = 0; j < HIDDEN; ++j) {
            float s = b_1[j];
#pragma unroll
            for (int i = 0; i < HIDDEN; ++i) s = fmaf(w_1[j * HIDDEN + i], h1[i], s);
            s = s > 0.0f || s != s ? s : 0.0f;
            direction = fmaf(w_out[j], s, direction);
            magnitude = fmaf(w_out[HIDDEN + j], s, magnitude);
        }
        const float step = direction * expf(exp_mult * magnitude) * step_mult;
        float p = s.p - lr * step;
        if (weight_decay > 0.0f) p -= lr * weight_decay * p;
        out[e] = p;
    }
}
