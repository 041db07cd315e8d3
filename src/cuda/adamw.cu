// optim::AdamW: one multi-tensor step. A launch takes up to GROUP tensors of one dtype (their
// parameter, gradient and f32 moment addresses travel in the `AdamWTensors` argument); block b
// walks chunk b of the group's chunk list, i.e. CHUNK elements of one tensor. Per element, with
// candle_nn::AdamW's formula (f32 arithmetic, f32 moments):
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p = p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// Memory-bound: reads p, g, m, v and writes p, m, v once (28 bytes per f32 parameter).
#include "common.cuh"

using fastops_constants::adamw::CHUNK;
using fastops_constants::adamw::GROUP;
using fastops_constants::adamw::THREADS;

// Mirrors `AdamWTensors` in src/optim/adamw/cuda.rs.
struct AdamWTensors {
    unsigned long long param[GROUP];
    unsigned long long grad[GROUP];
    unsigned long long m[GROUP];
    unsigned long long v[GROUP];
    unsigned long long n[GROUP];
    // chunk_start[i] is tensor i's first chunk in the group; chunk_start[count] the total.
    unsigned int chunk_start[GROUP + 1];
    unsigned int count;
};
static_assert(sizeof(AdamWTensors) == 5 * 8 * GROUP + 4 * (GROUP + 2), "AdamWTensors layout");

// Mirrors `AdamWHyper` in src/optim/adamw/cuda.rs.
struct AdamWHyper {
    float lr;
    float decay;  // 1 - lr * weight_decay
    float beta1;
    float beta2;
    float scale_m;  // 1 / (1 - beta1^t)
    float scale_v;  // 1 / (1 - beta2^t)
    float eps;
    float pad;
};
static_assert(sizeof(AdamWHyper) == 32, "AdamWHyper layout");

template <typename T>
__device__ __forceinline__ void adamw_step(const AdamWTensors& t, const AdamWHyper& h) {
    const unsigned int chunk = blockIdx.x;
    // The tensor of this chunk: the last i with chunk_start[i] <= chunk (count <= GROUP).
    unsigned int lo = 0, hi = t.count;
    while (hi - lo > 1) {
        const unsigned int mid = (lo + hi) / 2;
        if (t.chunk_start[mid] <= chunk) lo = mid; else hi = mid;
    }
    const unsigned int i = lo;
    const unsigned long long n = t.n[i];
    const unsigned long long begin = (unsigned long long)(chunk - t.chunk_start[i]) * CHUNK;
    const unsigned long long end = begin + CHUNK < n ? begin + CHUNK : n;
    T* __restrict__ p = reinterpret_cast<T*>(t.param[i]);
    const T* __restrict__ g = reinterpret_cast<const T*>(t.grad[i]);
    float* __restrict__ m = reinterpret_cast<float*>(t.m[i]);
    float* __restrict__ v = reinterpret_cast<float*>(t.v[i]);
    const float one_minus_beta1 = 1.0f - h.beta1, one_minus_beta2 = 1.0f - h.beta2;
#pragma unroll 4
    for (unsigned long long e = begin + threadIdx.x; e < end; e += THREADS) {
        const float grad = fastops::to_float(g[e]);
        const float mn = h.beta1 * m[e] + one_minus_beta1 * grad;
        const float vn = h.beta2 * v[e] + one_minus_beta2 * grad * grad;
        m[e] = mn;
        v[e] = vn;
        const float update = (mn * h.scale_m) / (sqrtf(vn * h.scale_v) + h.eps);
        p[e] = fastops::from_float<T>(fastops::to_float(p[e]) * h.decay - h.lr * update);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    adamw_step_f32(const AdamWTensors tensors, const AdamWHyper hyper) {
    adamw_step<float>(tensors, hyper);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    adamw_step_f16(const AdamWTensors tensors, const AdamWHyper hyper) {
    adamw_step<__half>(tensors, hyper);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    adamw_step_bf16(const AdamWTensors tensors, const AdamWHyper hyper) {
    adamw_step<__nv_bfloat16>(tensors, hyper);
}
