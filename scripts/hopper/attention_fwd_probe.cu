// A first Hopper (sm_90a) attention forward, outside the crate: how fast a plain wgmma kernel is
// before warp specialisation, and whether the layouts of wgmma_probe.cu carry a whole kernel.
//   nvcc -std=c++17 -O3 --use_fast_math [-DWARPGROUPS=2] \
//       -gencode=arch=compute_90a,code=sm_90a scripts/hopper/attention_fwd_probe.cu -o attn && ./attn [n [check]]
// bf16, causal (m = n), head dim 128, batch 4, 16 heads, n = 4096 (or argv[1]). Each of a block's
// WARPGROUPS warpgroups takes 64 queries and they share the block's K / V tiles: S = Q K^T with
// wgmma m64n64k16 (Q, K in shared memory), the online softmax on the accumulators (mma.sync's
// per-warp layout), O += P V with wgmma m64n128k16 (P from registers, V transposed from shared
// memory); K / V tiles of 64 keys, two cp.async stages. Checks sampled rows against an f64
// reference, then (without `check`) times the kernel: CUDA events, median. Results:
// benches/results/h200-2026-11-24-s15-wgmma-attention-probe.log.
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#ifndef WARPGROUPS
#define WARPGROUPS 2
#endif
// WARPGROUPS warpgroups a block, each with its own 64 queries, sharing the block's K / V tiles.
constexpr int WG = WARPGROUPS, D = 128, BK = 64, THREADS = 128 * WG;
constexpr int TILE_BYTES = 64 * D * 2;  // one 64 x 128 bf16 tile
// Core-matrix layout of a 64 x D tile (no swizzle): 16-byte chunk c8 of row r at
// (r / 8) * ROW_GROUP + c8 * 128 + (r % 8) * 16.
constexpr int ROW_GROUP = (D / 8) * 128;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr >> 4) & 0x3fff) | static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16 |
           static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32;
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// Copies a 64 x D tile (rows row_stride apart) into the core-matrix layout: eight consecutive
// threads fill one 128-byte core matrix (conflict-free shared stores).
// (A warpgroup's 128 threads copy one tile: warpgroup w of the block takes tile w of `count`.)
__device__ __forceinline__ void load_tile(uint32_t dst, const __nv_bfloat16* src, int64_t row_stride) {
#pragma unroll
    for (int i = 0; i < 64 * D / 8 / 128; ++i) {
        const int idx = i * 128 + threadIdx.x % 128, r8 = idx % 8, rest = idx / 8, c8 = rest % (D / 8),
                  group = rest / (D / 8), r = group * 8 + r8;
        cp_async16(dst + group * ROW_GROUP + c8 * 128 + r8 * 16, src + r * row_stride + c8 * 8);
    }
}

// Eight accumulator registers d[i] .. d[i + 7] as read-write asm operands.
#define WG_ACC(d, i)                                                                                              \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),  \
        "+f"(d[i + 7])

// S (64 x 64) = Q . K^T over 16 of the head dim: both operands K-major in shared memory.
__device__ __forceinline__ void wgmma_s(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC(d, 0), WG_ACC(d, 8), WG_ACC(d, 16), WG_ACC(d, 24)
        : "l"(a), "l"(b), "r"(accumulate));
}

// O (64 x 128) += P . V over 16 keys: P from registers, V transposed (MN-major) in shared memory.
__device__ __forceinline__ void wgmma_o(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
        "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
        : WG_ACC(d, 0), WG_ACC(d, 8), WG_ACC(d, 16), WG_ACC(d, 24), WG_ACC(d, 32), WG_ACC(d, 40), WG_ACC(d, 48),
          WG_ACC(d, 56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

__device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
}

// The online softmax of one key tile's scores s (raw; the diagonal tile masked here), o rescaled,
// and O += P V issued (not waited for) with V at shared address sv_tile.
__device__ __forceinline__ void softmax_pv(float (&s)[32], float (&o)[64], float (&row_max)[2], float (&row_sum)[2],
                                           int kt, int qt, int row0, int t, uint32_t sv_tile, float scale_log2) {
    if (kt >= qt) {  // the diagonal tile (and past it): key j visible to query i iff j <= i
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int key = kt * BK + nt * 8 + 2 * t + (r & 1), row = row0 + (r >> 1) * 8;
                if (key > row) s[nt * 4 + r] = -INFINITY;
            }
    }
    float alpha[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float mx = row_max[half];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * half], s[nt * 4 + 2 * half + 1]) * scale_log2);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[half] = exp2f(row_max[half] - mx);
        row_max[half] = mx;
        row_sum[half] *= alpha[half];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = exp2f(fmaf(s[nt * 4 + 2 * half + e], scale_log2, -mx));
                s[nt * 4 + 2 * half + e] = p;
                row_sum[half] += p;
            }
    }
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) o[nt * 4 + r] *= alpha[r >> 1];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t a[4] = {pack(s[8 * kk], s[8 * kk + 1]), pack(s[8 * kk + 2], s[8 * kk + 3]),
                               pack(s[8 * kk + 4], s[8 * kk + 5]), pack(s[8 * kk + 6], s[8 * kk + 7])};
        // V [key][d]: 16 keys a step are two 8-key core-matrix rows, ROW_GROUP bytes apart.
        wgmma_o(o, a, desc(sv_tile + kk * 2 * ROW_GROUP, ROW_GROUP, 128));
    }
}

// q, k, v, out: [bh, n, D] contiguous; causal, m = n.
__global__ void __launch_bounds__(THREADS, WG <= 2 ? 2 : 1) attention_fwd(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                          const __nv_bfloat16* v, __nv_bfloat16* out, int bh_count,
                                                          int n, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int wg = threadIdx.x / 128;
    const uint32_t sq = smem_addr(smem) + wg * TILE_BYTES, sk = smem_addr(smem) + WG * TILE_BYTES,
                   sv = sk + 2 * TILE_BYTES;
    const int tiles = n / 64, blocks_per_head = (tiles + WG - 1) / WG;  // the last block may be partial
    const int qb = blocks_per_head - 1 - blockIdx.x / bh_count, bh = blockIdx.x % bh_count;  // longest rows first
    const int qt = qb * WG + wg;  // this warpgroup's 64-query tile
    const int last_kt = min(qb * WG + WG - 1, tiles - 1);  // the block's last key tile
    const bool active = qt < tiles;                          // false past n (a partial last block)
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t head = static_cast<int64_t>(bh) * n * D;
    // Warpgroup w copies Q tile w; warpgroups 0 and (WG - 1) copy K and V.
    if (active) load_tile(sq, q + head + static_cast<int64_t>(qt) * 64 * D, D);
    if (wg == 0) load_tile(sk, k + head, D);
    if (wg == WG - 1) load_tile(sv, v + head, D);
    asm volatile("cp.async.commit_group;\n" ::);

    float o[64], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    const int row0 = qt * 64 + warp * 16 + g;  // this lane's rows: row0, row0 + 8
    for (int kt = 0; kt <= last_kt; ++kt) {
        const int stage = kt & 1;
        if (kt < last_kt) {
            if (wg == 0) load_tile(sk + (stage ^ 1) * TILE_BYTES, k + head + static_cast<int64_t>(kt + 1) * BK * D, D);
            if (wg == WG - 1)
                load_tile(sv + (stage ^ 1) * TILE_BYTES, v + head + static_cast<int64_t>(kt + 1) * BK * D, D);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();

        // Past this warpgroup's diagonal it only joins the barriers (the same barrier instructions
        // for every thread: __syncthreads under a condition that differs between warps is undefined).
        if (kt <= qt) {
            float s[32];
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_s(s, desc(sq + kk * 256, 128, ROW_GROUP), desc(sk + stage * TILE_BYTES + kk * 256, 128, ROW_GROUP),
                        kk > 0);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

            softmax_pv(s, o, row_max, row_sum, kt, qt, row0, t, sv + stage * TILE_BYTES, scale_log2);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
        __syncthreads();  // this stage's K / V are read before the next iteration overwrites them
    }
    if (!active) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float sum = row_sum[half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.f / sum;
        __nv_bfloat16* dst = out + head + static_cast<int64_t>(row0 + half * 8) * D;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
            *reinterpret_cast<__nv_bfloat162*>(dst + nt * 8 + 2 * t) =
                __floats2bfloat162_rn(o[nt * 4 + 2 * half] * inv, o[nt * 4 + 2 * half + 1] * inv);
    }
}

int main(int argc, char** argv) {
    const int batch = 4, heads = 16, n = argc > 1 ? std::atoi(argv[1]) : 4096, bh = batch * heads;
    if (n % 64 != 0) {
        std::printf("n must be a multiple of 64\n");
        return 2;
    }
    const size_t elems = static_cast<size_t>(bh) * n * D;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<__nv_bfloat16> hq(elems), hk(elems), hv(elems), ho(elems);
    for (size_t i = 0; i < elems; ++i) {
        hq[i] = __float2bfloat16(normal(rng));
        hk[i] = __float2bfloat16(normal(rng));
        hv[i] = __float2bfloat16(normal(rng));
    }
    __nv_bfloat16 *q, *k, *v, *o;
    cudaMalloc(&q, elems * 2);
    cudaMalloc(&k, elems * 2);
    cudaMalloc(&v, elems * 2);
    cudaMalloc(&o, elems * 2);
    cudaMemcpy(q, hq.data(), elems * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(k, hk.data(), elems * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(v, hv.data(), elems * 2, cudaMemcpyHostToDevice);
    cudaMemset(o, 0xff, elems * 2);  // poison
    const float scale = 1.f / std::sqrt(static_cast<float>(D)), scale_log2 = scale * 1.4426950408889634f;
    const int smem = (WG + 4) * TILE_BYTES;
    cudaFuncSetAttribute(attention_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const dim3 grid(bh * ((n / 64 + WG - 1) / WG));
    attention_fwd<<<grid, THREADS, smem>>>(q, k, v, o, bh, n, scale_log2);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        std::printf("kernel failed: %s\n", cudaGetErrorString(err));
        return 1;
    }
    cudaMemcpy(ho.data(), o, elems * 2, cudaMemcpyDeviceToHost);
    // Sampled rows of the first and last head against f64.
    double num = 0, den = 0;
    int bad = 0;
    for (int head : {0, bh - 1})
        for (int row : {0, 1, 63, 64, 65, 127, 1000, n / 2 + 7, n - 65, n - 2, n - 1}) {
            if (row >= n) continue;
            const size_t base = static_cast<size_t>(head) * n * D;
            std::vector<double> p(row + 1);
            double mx = -1e300;
            for (int j = 0; j <= row; ++j) {
                double dot = 0;
                for (int x = 0; x < D; ++x)
                    dot += static_cast<double>(__bfloat162float(hq[base + static_cast<size_t>(row) * D + x])) *
                           __bfloat162float(hk[base + static_cast<size_t>(j) * D + x]);
                p[j] = dot * scale;
                mx = std::max(mx, p[j]);
            }
            double sum = 0;
            for (int j = 0; j <= row; ++j) sum += p[j] = std::exp(p[j] - mx);
            for (int x = 0; x < D; ++x) {
                double want = 0;
                for (int j = 0; j <= row; ++j) want += p[j] * __bfloat162float(hv[base + static_cast<size_t>(j) * D + x]);
                want /= sum;
                const double got = __bfloat162float(ho[base + static_cast<size_t>(row) * D + x]);
                if (std::isnan(got)) ++bad;
                num += (got - want) * (got - want);
                den += want * want;
            }
        }
    const double rel = std::sqrt(num / den);
    std::printf("n %d: sampled rows rel err %.3e, NaN %d -> %s\n", n, rel, bad, (rel < 1e-2 && bad == 0) ? "ok" : "FAILED");
    if (argc > 2) return (rel < 1e-2 && bad == 0) ? 0 : 1;  // `./attn N check`: no timing (for the sanitizers)
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<float> times;
    for (int i = 0; i < 30; ++i) {
        cudaEventRecord(start);
        attention_fwd<<<grid, THREADS, smem>>>(q, k, v, o, bh, n, scale_log2);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms;
        cudaEventElapsedTime(&ms, start, stop);
        if (i >= 5) times.push_back(ms * 1000.f);
    }
    std::sort(times.begin(), times.end());
    const double us = times[times.size() / 2];
    const double flops = 4.0 * bh * D * (static_cast<double>(n) * (n + 1) / 2);
    std::printf("n %d, %d warpgroup(s) a block: median %.1f us, %.1f TFLOP/s (causal, b 4 h 16 d 128 bf16)\n", n, WG, us, flops / us * 1e-6);
    return (rel < 1e-2 && bad == 0) ? 0 : 1;
}
