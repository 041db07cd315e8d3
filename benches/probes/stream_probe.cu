// Streaming-kernel probe (not part of the crate): how close can a read-once / write-once kernel
// get to the device-to-device copy on this GPU, and which access pattern gets there?
// Built and run on the GPU machine: nvcc -O3 -arch=sm_90 stream_probe.cu -o probe && ./probe
// Every variant adds a last-dim bias (as bias_add does) or copies; the result is checked
// against a host reference on the first call. Medians of 30 timed calls after 5 warm-ups.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);    \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

using bf16 = __nv_bfloat16;

template <typename T> __device__ __forceinline__ uint4 add16(uint4 x, uint4 b) {
    if constexpr (sizeof(T) == 4) {
        float* xf = reinterpret_cast<float*>(&x);
        const float* bf = reinterpret_cast<const float*>(&b);
#pragma unroll
        for (int i = 0; i < 4; ++i) xf[i] += bf[i];
    } else {
        __nv_bfloat162* xh = reinterpret_cast<__nv_bfloat162*>(&x);
        const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 a = __bfloat1622float2(xh[i]), c = __bfloat1622float2(bh[i]);
            xh[i] = __floats2bfloat162_rn(a.x + c.x, a.y + c.y);
        }
    }
    return x;
}

// Grid-stride, UNROLL independent 16-byte loads ahead of use (the crate's bias_add shape).
// ADD=false copies. HINT 0 plain, 1 .cs, 2 ld.nc L1::no_allocate + st.cs
template <typename T, bool ADD, int UNROLL, int HINT>
__global__ void gridstride(const uint4* __restrict__ src, uint4* __restrict__ dst, const uint4* __restrict__ bias,
                           uint64_t nvec, uint32_t bias_vecs_mask) {
    const uint64_t tid = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    const uint64_t nth = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t v0 = tid; v0 < nvec; v0 += UNROLL * nth) {
        uint4 x[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            uint64_t v = v0 + k * nth;
            if (v < nvec) {
                if (HINT == 0) x[k] = src[v];
                else if (HINT == 1) x[k] = __ldcs(src + v);
                else x[k] = __ldlu(src + v);
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            uint64_t v = v0 + k * nth;
            if (v < nvec) {
                uint4 y = ADD ? add16<T>(x[k], __ldg(bias + (v & bias_vecs_mask))) : x[k];
                if (HINT == 0) dst[v] = y;
                else __stcs(dst + v, y);
            }
        }
    }
}

// Each thread moves UNROLL consecutive-by-blockDim vectors of one block-sized chunk; one chunk
// per block, no loop (a grid of n / (blockDim * UNROLL * 16 B) blocks).
template <typename T, bool ADD, int UNROLL>
__global__ void oneshot(const uint4* __restrict__ src, uint4* __restrict__ dst, const uint4* __restrict__ bias,
                        uint64_t nvec, uint32_t bias_vecs_mask) {
    const uint64_t base = (uint64_t)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    uint4 x[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        uint64_t v = base + k * blockDim.x;
        if (v < nvec) x[k] = __ldcs(src + v);
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        uint64_t v = base + k * blockDim.x;
        if (v < nvec) __stcs(dst + v, ADD ? add16<T>(x[k], __ldg(bias + (v & bias_vecs_mask))) : x[k]);
    }
}

// Contiguous chunk per block, walked with a block stride, UNROLL loads ahead.
template <typename T, bool ADD, int UNROLL>
__global__ void chunked(const uint4* __restrict__ src, uint4* __restrict__ dst, const uint4* __restrict__ bias,
                        uint64_t nvec, uint32_t bias_vecs_mask) {
    const uint64_t per = (nvec + gridDim.x - 1) / gridDim.x;
    const uint64_t begin = blockIdx.x * per, end = min(nvec, begin + per);
    for (uint64_t v0 = begin + threadIdx.x; v0 < end; v0 += UNROLL * blockDim.x) {
        uint4 x[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            uint64_t v = v0 + k * blockDim.x;
            if (v < end) x[k] = __ldcs(src + v);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            uint64_t v = v0 + k * blockDim.x;
            if (v < end) __stcs(dst + v, ADD ? add16<T>(x[k], __ldg(bias + (v & bias_vecs_mask))) : x[k]);
        }
    }
}

// TMA (cp.async.bulk) pipeline: tiles of TILE bytes through STAGES shared-memory buffers; thread 0
// issues the bulk loads and stores, all threads add the bias in shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_u32(smem)), "r"(bytes)
                 : "memory");
}

template <typename T, bool ADD, int TILE, int STAGES>
__global__ void __launch_bounds__(256) tma(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                           const uint4* __restrict__ bias, uint64_t nvec, uint32_t bias_vecs_mask) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + STAGES * TILE);
    constexpr uint32_t TV = TILE / 16;
    const uint64_t ntiles = nvec / TV;  // the probe sizes are whole tiles
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&bars[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](uint64_t tile, int s) {
        mbar_expect_tx(&bars[s], TILE);
        bulk_load(smem + s * TILE, src + tile * TV, TILE, &bars[s]);
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < STAGES; ++s) {
            uint64_t t = blockIdx.x + (uint64_t)s * gridDim.x;
            if (t < ntiles) issue(t, s);
        }
    uint32_t it = 0;
    for (uint64_t t = blockIdx.x; t < ntiles; t += gridDim.x, ++it) {
        const int s = it % STAGES;
        mbar_wait(&bars[s], (it / STAGES) & 1);
        uint4* buf = reinterpret_cast<uint4*>(smem + s * TILE);
        if (ADD) {
            for (uint32_t i = threadIdx.x; i < TV; i += blockDim.x) {
                const uint64_t v = t * TV + i;
                buf[i] = add16<T>(buf[i], __ldg(bias + (v & bias_vecs_mask)));
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            bulk_store(dst + t * TV, buf, TILE);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            const uint64_t next = t + (uint64_t)STAGES * gridDim.x;
            if (next < ntiles) {
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                issue(next, s);
            }
        }
        if (!ADD) __syncwarp();
    }
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Timer {
    cudaEvent_t a, b;
    Timer() {
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
    }
};

template <class F> float median_us(F&& f) {
    Timer t;
    for (int i = 0; i < 5; ++i) f();
    std::vector<float> v;
    for (int i = 0; i < 30; ++i) {
        CK(cudaEventRecord(t.a));
        f();
        CK(cudaEventRecord(t.b));
        CK(cudaEventSynchronize(t.b));
        float ms;
        CK(cudaEventElapsedTime(&ms, t.a, t.b));
        v.push_back(ms * 1000.f);
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static int g_sms;

template <typename T> void run_dtype(const char* name, uint64_t rows, uint64_t cols) {
    const uint64_t n = rows * cols, bytes = n * sizeof(T), nvec = bytes / 16;
    const uint32_t bias_vecs = cols * sizeof(T) / 16;  // a power of two in the probe's shapes
    std::vector<T> hx(n), hb(cols);
    uint32_t s = 12345;
    auto rnd = [&]() {
        s = s * 1664525u + 1013904223u;
        return ((s >> 8) & 0xffff) / 65536.f - 0.5f;
    };
    for (auto& v : hx) v = (T)rnd();
    for (auto& v : hb) v = (T)rnd();
    T *x, *y, *b;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&y, bytes));
    CK(cudaMalloc(&b, cols * sizeof(T)));
    CK(cudaMemcpy(x, hx.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb.data(), cols * sizeof(T), cudaMemcpyHostToDevice));
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    uint4* ys = reinterpret_cast<uint4*>(y);
    const uint4* bs = reinterpret_cast<const uint4*>(b);
    const uint32_t mask = bias_vecs - 1;
    std::vector<T> hy(n);
    auto check = [&](const char* what, bool add) {
        CK(cudaMemcpy(hy.data(), y, bytes, cudaMemcpyDeviceToHost));
        uint64_t bad = 0;
        for (uint64_t i = 0; i < n; i += 997) {
            float want = (float)hx[i] + (add ? (float)hb[i % cols] : 0.f);
            float got = (float)hy[i];
            if (fabsf(want - got) > 1e-2f * (1 + fabsf(want))) ++bad;
        }
        if (bad) printf("  !! %s: %llu mismatches\n", what, (unsigned long long)bad);
    };
    auto report = [&](const char* what, float us) {
        printf("%-5s %-44s %9.1f us %7.1f GB/s\n", name, what, us, 2.0 * bytes / us / 1e3);
        fflush(stdout);
    };
    float copy = median_us([&] { CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); });
    report("cudaMemcpy d2d", copy);
    char label[128];
    auto poison = [&] { CK(cudaMemset(y, 0xff, bytes)); };
#define GS(ADD, U, H, BPS)                                                                                      \
    {                                                                                                           \
        poison();                                                                                               \
        int grid = BPS * g_sms;                                                                                 \
        auto f = [&] { gridstride<T, ADD, U, H><<<grid, 256>>>(xs, ys, bs, nvec, mask); };                       \
        f();                                                                                                    \
        CK(cudaDeviceSynchronize());                                                                            \
        snprintf(label, sizeof label, "gridstride %s u%d hint%d %d/SM", ADD ? "add " : "copy", U, H, BPS);      \
        check(label, ADD);                                                                                      \
        report(label, median_us(f));                                                                            \
    }
    GS(false, 4, 1, 2) GS(false, 4, 1, 4) GS(false, 4, 1, 8) GS(false, 8, 1, 4) GS(false, 4, 0, 4)
    GS(true, 4, 1, 2) GS(true, 4, 1, 3) GS(true, 4, 1, 4) GS(true, 4, 1, 8) GS(true, 8, 1, 2) GS(true, 8, 1, 4)
    GS(true, 2, 1, 8) GS(true, 4, 2, 4) GS(true, 4, 0, 4)
#define OS(ADD, U, THREADS)                                                                                     \
    {                                                                                                           \
        poison();                                                                                               \
        uint64_t grid = (nvec + (uint64_t)THREADS * U - 1) / ((uint64_t)THREADS * U);                           \
        auto f = [&] { oneshot<T, ADD, U><<<grid, THREADS>>>(xs, ys, bs, nvec, mask); };                          \
        f();                                                                                                    \
        CK(cudaDeviceSynchronize());                                                                            \
        snprintf(label, sizeof label, "oneshot %s u%d t%d", ADD ? "add " : "copy", U, THREADS);                \
        check(label, ADD);                                                                                      \
        report(label, median_us(f));                                                                            \
    }
    OS(false, 4, 256) OS(true, 1, 256) OS(true, 2, 256) OS(true, 4, 256) OS(true, 8, 256) OS(true, 4, 128) OS(true, 4, 512)
#define CH(ADD, U, BPS)                                                                                         \
    {                                                                                                           \
        poison();                                                                                               \
        int grid = BPS * g_sms;                                                                                 \
        auto f = [&] { chunked<T, ADD, U><<<grid, 256>>>(xs, ys, bs, nvec, mask); };                              \
        f();                                                                                                    \
        CK(cudaDeviceSynchronize());                                                                            \
        snprintf(label, sizeof label, "chunked %s u%d %d/SM", ADD ? "add " : "copy", U, BPS);                   \
        check(label, ADD);                                                                                      \
        report(label, median_us(f));                                                                            \
    }
    CH(false, 4, 4) CH(true, 4, 2) CH(true, 4, 4) CH(true, 4, 8) CH(true, 8, 4)
#define TM(ADD, TILE, STAGES, BPS)                                                                              \
    {                                                                                                           \
        poison();                                                                                               \
        const int smem = TILE * STAGES + 64;                                                                    \
        CK(cudaFuncSetAttribute(tma<T, ADD, TILE, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
        int grid = BPS * g_sms;                                                                                 \
        auto f = [&] { tma<T, ADD, TILE, STAGES><<<grid, 256, smem>>>(xs, ys, bs, nvec, mask); };                 \
        f();                                                                                                    \
        CK(cudaGetLastError());                                                                                 \
        CK(cudaDeviceSynchronize());                                                                            \
        snprintf(label, sizeof label, "tma %s tile%d x%d %d/SM", ADD ? "add " : "copy", TILE, STAGES, BPS);     \
        check(label, ADD);                                                                                      \
        report(label, median_us(f));                                                                            \
    }
    TM(false, 16384, 4, 1) TM(true, 16384, 4, 1) TM(true, 16384, 6, 1) TM(true, 32768, 4, 1) TM(true, 8192, 8, 1)
    TM(true, 16384, 4, 2) TM(true, 8192, 4, 3) TM(true, 8192, 6, 2) TM(true, 4096, 8, 3)
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(b));
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    g_sms = p.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB\n", p.name, g_sms, p.l2CacheSize >> 20);
    run_dtype<float>("f32", 16384, 4096);
    run_dtype<bf16>("bf16", 16384, 8192);
    run_dtype<float>("f32x2", 16384, 8192);
    return 0;
}
