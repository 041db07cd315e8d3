// Softmax probe (not part of the crate): launch shapes for two cases of issue 21, in isolation.
//   rows: softmax over the last dim of [32 * 1024, 4096] f32, a block per row, THREADS x VPT
//         16-byte vectors per row, no persistent loop.
//   cols: softmax over dims [1, 3] of [8, 16, 32, 64, 128] f32: groups of 1024 elements whose
//         lanes (dim 4) are contiguous. A block stages E adjacent lanes of one (dim 0, dim 2)
//         pair in shared memory (one read), reduces over the 1024 elements, writes.
// Built and run on the GPU machine: nvcc -O3 -arch=sm_90 softmax_probe.cu -o sp && ./sp
// Checked against a host reference (sampled rows / groups); medians of 30 timed calls.
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

template <int THREADS> __device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    constexpr int WARPS = THREADS / 32;
    if (WARPS == 1) return v;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < WARPS ? scratch[lane] : (is_max ? -INFINITY : 0.f);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
}

template <int THREADS, int VPT, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) rows(const float4* __restrict__ x, float4* __restrict__ y) {
    __shared__ float scratch[32];
    const uint64_t row = blockIdx.x;
    const float4* xr = x + row * (THREADS * VPT);
    float4* yr = y + row * (THREADS * VPT);
    float4 v[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) v[k] = __ldcs(xr + threadIdx.x + k * THREADS);
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < VPT; ++k) m = fmaxf(m, fmaxf(fmaxf(v[k].x, v[k].y), fmaxf(v[k].z, v[k].w)));
    m = block_reduce<THREADS>(m, true, scratch);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        v[k].x = __expf(v[k].x - m);
        v[k].y = __expf(v[k].y - m);
        v[k].z = __expf(v[k].z - m);
        v[k].w = __expf(v[k].w - m);
        s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    s = block_reduce<THREADS>(s, false, scratch);
    const float inv = 1.f / s;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
        __stcs(yr + threadIdx.x + k * THREADS, make_float4(v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv));
}

// Online max / sum pair folded across threads that hold the same lane.
struct Pair {
    float m, s;
};
__device__ __forceinline__ Pair merge(Pair a, Pair b) {
    const float mx = fmaxf(a.m, b.m);
    if (mx == -INFINITY) return a;
    return {mx, a.s * __expf(a.m - mx) + b.s * __expf(b.m - mx)};
}

// Dims [1, 3] of [8, 16, 32, 64, 128]: block (c, a, lane chunk). E lanes per block, staged.
template <int E, int THREADS, bool ASYNC>
__global__ void __launch_bounds__(THREADS) cols(const float* __restrict__ x, float* __restrict__ y) {
    extern __shared__ __align__(16) float stage[];  // [1024][E], then pairs [THREADS]
    constexpr int J = 1024, UPJ = E / 4;            // 16-byte units per j
    const int chunk = blockIdx.x, c = blockIdx.y, a = blockIdx.z;
    const uint64_t base = (uint64_t)a * (16ull * 32 * 64 * 128) + (uint64_t)c * (64 * 128) + chunk * E;
    for (int u = threadIdx.x; u < J * UPJ; u += THREADS) {
        const int j = u / UPJ, xu = u % UPJ;
        const int b = j / 64, d = j % 64;
        const float* src = x + base + (uint64_t)b * (32ull * 64 * 128) + d * 128 + xu * 4;
        float* dst = stage + j * E + xu * 4;
        if (ASYNC) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src));
        } else {
            *reinterpret_cast<float4*>(dst) = __ldcs(reinterpret_cast<const float4*>(src));
        }
    }
    if (ASYNC) asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    constexpr int PARTS = THREADS / E;
    const int lane = threadIdx.x % E, part = threadIdx.x / E;
    Pair p{-INFINITY, 0.f};
    float m = -INFINITY;
    for (int j = part; j < J; j += PARTS) m = fmaxf(m, stage[j * E + lane]);
    float s = 0.f;
    if (m != -INFINITY)
        for (int j = part; j < J; j += PARTS) s += __expf(stage[j * E + lane] - m);
    p = {m, s};
    Pair* pairs = reinterpret_cast<Pair*>(stage + J * E);
    pairs[threadIdx.x] = p;
    __syncthreads();
    if (threadIdx.x < E) {
        Pair t = pairs[threadIdx.x];
        for (int q = 1; q < PARTS; ++q) t = merge(t, pairs[q * E + threadIdx.x]);
        pairs[threadIdx.x] = {t.m, 1.f / t.s};
    }
    __syncthreads();
    for (int u = threadIdx.x; u < J * UPJ; u += THREADS) {
        const int j = u / UPJ, xu = u % UPJ;
        const int b = j / 64, d = j % 64;
        float4 v = *reinterpret_cast<const float4*>(stage + j * E + xu * 4);
        const Pair p0 = pairs[xu * 4], p1 = pairs[xu * 4 + 1], p2 = pairs[xu * 4 + 2], p3 = pairs[xu * 4 + 3];
        v = make_float4(__expf(v.x - p0.m) * p0.s, __expf(v.y - p1.m) * p1.s, __expf(v.z - p2.m) * p2.s,
                        __expf(v.w - p3.m) * p3.s);
        __stcs(reinterpret_cast<float4*>(y + base + (uint64_t)b * (32ull * 64 * 128) + d * 128 + xu * 4), v);
    }
}

template <class F> float median_us(F&& f) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 5; ++i) f();
    std::vector<float> v;
    for (int i = 0; i < 30; ++i) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms * 1000.f);
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    const uint64_t n = 32ull * 1024 * 4096, bytes = n * 4;
    std::vector<float> hx(n), hy(n);
    uint32_t s = 777;
    for (auto& v : hx) {
        s = s * 1664525u + 1013904223u;
        v = ((s >> 8) & 0xffff) / 8192.f - 4.f;
    }
    float *x, *y;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&y, bytes));
    CK(cudaMemcpy(x, hx.data(), bytes, cudaMemcpyHostToDevice));
    auto report = [&](const char* what, float us, uint64_t nbytes) {
        printf("%-40s %9.1f us %7.1f GB/s\n", what, us, 2.0 * nbytes / us / 1e3);
        fflush(stdout);
    };
    report("cudaMemcpy d2d 512 MiB", median_us([&] { CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); }), bytes);
    auto check_rows = [&](const char* what) {
        CK(cudaMemcpy(hy.data(), y, bytes, cudaMemcpyDeviceToHost));
        for (uint64_t r = 0; r < 32 * 1024; r += 1237) {
            double m = -1e30, sum = 0;
            for (int i = 0; i < 4096; ++i) m = std::max(m, (double)hx[r * 4096 + i]);
            for (int i = 0; i < 4096; ++i) sum += std::exp(hx[r * 4096 + i] - m);
            for (int i = 0; i < 4096; i += 61) {
                double want = std::exp(hx[r * 4096 + i] - m) / sum;
                if (std::fabs(want - hy[r * 4096 + i]) > 1e-5 * want + 1e-9) {
                    printf("  !! %s mismatch row %llu col %d: %g vs %g\n", what, (unsigned long long)r, i, want,
                           hy[r * 4096 + i]);
                    return;
                }
            }
        }
    };
#define ROWS(T, V, MINB)                                                                    \
    {                                                                                       \
        CK(cudaMemset(y, 0xff, bytes));                                                     \
        auto f = [&] { rows<T, V, MINB><<<32 * 1024, T>>>((const float4*)x, (float4*)y); }; \
        f();                                                                                \
        CK(cudaDeviceSynchronize());                                                        \
        check_rows("rows " #T "x" #V);                                                      \
        report("rows threads " #T " vectors " #V " minblocks " #MINB, median_us(f), bytes); \
    }
    ROWS(1024, 1, 2) ROWS(512, 2, 4) ROWS(512, 2, 3) ROWS(256, 4, 8) ROWS(256, 4, 6) ROWS(128, 8, 12) ROWS(128, 8, 8)

    // [8, 16, 32, 64, 128] dims [1, 3]: the first 2^25 elements of x.
    const uint64_t n2 = 8ull * 16 * 32 * 64 * 128, bytes2 = n2 * 4;
    report("cudaMemcpy d2d 128 MiB", median_us([&] { CK(cudaMemcpyAsync(y, x, bytes2, cudaMemcpyDeviceToDevice)); }), bytes2);
    auto check_cols = [&](const char* what) {
        CK(cudaMemcpy(hy.data(), y, bytes2, cudaMemcpyDeviceToHost));
        for (int a = 0; a < 8; a += 3)
            for (int c = 0; c < 32; c += 7)
                for (int e = 0; e < 128; e += 13) {
                    auto at = [&](int b, int d) { return (uint64_t)a * 16 * 32 * 64 * 128 + (uint64_t)b * 32 * 64 * 128 + c * 64 * 128 + d * 128 + e; };
                    double m = -1e30, sum = 0;
                    for (int b = 0; b < 16; ++b)
                        for (int d = 0; d < 64; ++d) m = std::max(m, (double)hx[at(b, d)]);
                    for (int b = 0; b < 16; ++b)
                        for (int d = 0; d < 64; ++d) sum += std::exp(hx[at(b, d)] - m);
                    for (int b = 0; b < 16; b += 5)
                        for (int d = 0; d < 64; d += 9) {
                            double want = std::exp(hx[at(b, d)] - m) / sum;
                            if (std::fabs(want - hy[at(b, d)]) > 1e-5 * want + 1e-9) {
                                printf("  !! %s mismatch: %g vs %g\n", what, want, hy[at(b, d)]);
                                return;
                            }
                        }
                }
    };
#define COLS(E, T, ASYNC)                                                                                      \
    {                                                                                                          \
        CK(cudaMemset(y, 0xff, bytes2));                                                                       \
        const int smem = 1024 * E * 4 + T * 8;                                                                 \
        CK(cudaFuncSetAttribute(cols<E, T, ASYNC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));        \
        auto f = [&] { cols<E, T, ASYNC><<<dim3(128 / E, 32, 8), T, smem>>>(x, y); };                          \
        f();                                                                                                   \
        CK(cudaGetLastError());                                                                                \
        CK(cudaDeviceSynchronize());                                                                           \
        check_cols("cols " #E);                                                                                \
        report("cols lanes " #E " threads " #T " async " #ASYNC, median_us(f), bytes2);                        \
    }
    COLS(8, 256, true) COLS(16, 256, true) COLS(16, 512, true) COLS(32, 256, true) COLS(32, 512, true)
    COLS(32, 1024, true) COLS(16, 256, false) COLS(32, 512, false)
    return 0;
}
