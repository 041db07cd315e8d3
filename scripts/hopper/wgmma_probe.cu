// Checks, on a Hopper GPU, the shared-memory operand layouts and descriptors that the crate's
// Hopper (sm_90a) kernels rely on, against an f64 product on the host:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a scripts/hopper/wgmma_probe.cu -o probe && ./probe
// One warpgroup computes a 64 x 64 tile C = A . op(B) over K = 64 with wgmma m64n64k16 (bf16 in,
// f32 out). Operands sit in shared memory without swizzle, in 8 x 16-byte core matrices: element
// (r, k) of a K-major operand at (r / 8) * MN_STRIDE + (k / 8) * K_STRIDE + (r % 8) * 16 + (k % 8) * 2
// bytes; an MN-major one (16 bytes along MN) at (n / 8) * MN_STRIDE + (k / 8) * K_STRIDE +
// (k % 8) * 16 + (n % 8) * 2. Each case tries both readings of the descriptor's two byte offsets
// (LBO along K and SBO along MN, or the reverse) and prints the relative error of each: the
// reading with an error near 1e-6 is the hardware's.
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

constexpr int M = 64, N = 64, K = 64;
constexpr int MN_STRIDE = (K / 8) * 128;  // bytes between core matrices along M / N (K-major)
constexpr int K_STRIDE = 128;             // bytes between core matrices along K (K-major)
// MN-major B ([K][N] in global): core matrices of 8 k-rows x 8 n-columns.
constexpr int T_MN_STRIDE = 128, T_K_STRIDE = (N / 8) * 128;

__device__ uint64_t descriptor(const void* smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    uint64_t d = 0;
    d |= static_cast<uint64_t>((addr >> 4) & 0x3fff);
    d |= static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16;
    d |= static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32;
    return d;  // base offset 0, no swizzle
}

#define WG_D32(d)                                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),     \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),    \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_REGS                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "   \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

template <int TRANS_B> __device__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS ", %32, %33, 1, 1, 1, 0, %34;\n"
                 : WG_D32(d)
                 : "l"(a), "l"(b), "n"(TRANS_B));
}

template <int TRANS_B> __device__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, %37;\n"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B));
}

// mode: 0 both K-major (C = A B^T, B [N][K]); 1 B MN-major (C = A B, B [K][N]); 2 as 1 with A from
// registers. swap: the descriptors' LBO / SBO readings exchanged.
__global__ void probe(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, int mode, int swap) {
    __shared__ alignas(128) __nv_bfloat16 sa[M * K], sb[N * K];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // A [M][K] row-major -> K-major core matrices.
    for (int i = tid; i < M * K; i += 128) {
        const int r = i / K, k = i % K;
        sa[((r / 8) * MN_STRIDE + (k / 8) * K_STRIDE + (r % 8) * 16 + (k % 8) * 2) / 2] = a[i];
    }
    for (int i = tid; i < N * K; i += 128) {
        if (mode == 0) {  // b [N][K]
            const int n = i / K, k = i % K;
            sb[((n / 8) * MN_STRIDE + (k / 8) * K_STRIDE + (n % 8) * 16 + (k % 8) * 2) / 2] = b[i];
        } else {  // b [K][N]
            const int k = i / N, n = i % N;
            sb[((n / 8) * T_MN_STRIDE + (k / 8) * T_K_STRIDE + (k % 8) * 16 + (n % 8) * 2) / 2] = b[i];
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    for (int kk = 0; kk < K / 16; ++kk) {
        // A K-major: a k-step of 16 is two core matrices along K.
        const uint32_t a_lbo = swap ? MN_STRIDE : K_STRIDE, a_sbo = swap ? K_STRIDE : MN_STRIDE;
        const uint64_t da = descriptor(reinterpret_cast<const char*>(sa) + kk * 2 * K_STRIDE, a_lbo, a_sbo);
        if (mode == 0) {
            const uint64_t db = descriptor(reinterpret_cast<const char*>(sb) + kk * 2 * K_STRIDE, a_lbo, a_sbo);
            wgmma_ss<0>(d, da, db);
        } else {
            const uint32_t b_lbo = swap ? T_MN_STRIDE : T_K_STRIDE, b_sbo = swap ? T_K_STRIDE : T_MN_STRIDE;
            const uint64_t db = descriptor(reinterpret_cast<const char*>(sb) + kk * 2 * T_K_STRIDE, b_lbo, b_sbo);
            if (mode == 1) {
                wgmma_ss<1>(d, da, db);
            } else {
                // The mma.sync A fragment of this warp's 16 rows: (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8).
                const int g = lane / 4, t = lane % 4, r = warp * 16 + g, k = kk * 16 + 2 * t;
                uint32_t frag[4];
                const int rows[4] = {r, r + 8, r, r + 8}, cols[4] = {k, k, k + 8, k + 8};
                for (int j = 0; j < 4; ++j) {
                    __nv_bfloat162 pair;
                    pair.x = a[rows[j] * K + cols[j]];
                    pair.y = a[rows[j] * K + cols[j] + 1];
                    frag[j] = *reinterpret_cast<uint32_t*>(&pair);
                }
                wgmma_rs<1>(d, frag, db);
            }
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // Accumulators: warp w rows 16 w + g (+ 8), columns 8 j + 2 t (+ 1), as mma.sync's per 8 columns.
    const int g = lane / 4, t = lane % 4;
    for (int j = 0; j < N / 8; ++j)
        for (int r = 0; r < 4; ++r) {
            const int row = warp * 16 + g + (r / 2) * 8, col = j * 8 + 2 * t + (r % 2);
            c[row * N + col] = d[j * 4 + r];
        }
}

// ./probe runs every case, each in its own process (a wrong reading can fault, which ends the
// CUDA context); ./probe MODE SWAP runs one.
int main(int argc, char** argv) {
    if (argc < 3) {
        int failures = 0;
        for (int mode = 0; mode < 3; ++mode)
            for (int swap = 0; swap < 2; ++swap) {
                char cmd[4096];
                std::snprintf(cmd, sizeof cmd, "'%s' %d %d", argv[0], mode, swap);
                const int rc = std::system(cmd);
                if (!swap && rc != 0) ++failures;
            }
        std::printf("%s\n", failures ? "the LBO = K, SBO = MN reading FAILED for some case"
                                      : "LBO along K, SBO along MN: all cases pass");
        return failures ? 1 : 0;
    }
    const int only_mode = std::atoi(argv[1]), only_swap = std::atoi(argv[2]);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<__nv_bfloat16> ha(M * K), hb(N * K);
    std::vector<double> fa(M * K), fb(N * K);
    for (int i = 0; i < M * K; ++i) { ha[i] = __float2bfloat16(u(rng)); fa[i] = __bfloat162float(ha[i]); }
    for (int i = 0; i < N * K; ++i) { hb[i] = __float2bfloat16(u(rng)); fb[i] = __bfloat162float(hb[i]); }
    __nv_bfloat16 *da, *db;
    float* dc;
    cudaMalloc(&da, M * K * 2);
    cudaMalloc(&db, N * K * 2);
    cudaMalloc(&dc, M * N * 4);
    cudaMemcpy(da, ha.data(), M * K * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb.data(), N * K * 2, cudaMemcpyHostToDevice);
    const char* names[3] = {"A K-major smem, B K-major smem (C = A B^T)", "A K-major smem, B MN-major smem (C = A B)",
                            "A registers, B MN-major smem (C = A B)"};
    int failures = 0;
    for (int mode = only_mode; mode <= only_mode; ++mode)
        for (int swap = only_swap; swap <= only_swap; ++swap) {
            cudaMemset(dc, 0xff, M * N * 4);  // poison: NaN
            probe<<<1, 128>>>(da, db, dc, mode, swap);
            const cudaError_t err = cudaDeviceSynchronize();
            std::vector<float> hc(M * N);
            cudaMemcpy(hc.data(), dc, M * N * 4, cudaMemcpyDeviceToHost);
            double num = 0, den = 0;
            for (int i = 0; i < M; ++i)
                for (int j = 0; j < N; ++j) {
                    double ref = 0;
                    for (int k = 0; k < K; ++k) ref += fa[i * K + k] * (mode == 0 ? fb[j * K + k] : fb[k * N + j]);
                    const double e = hc[i * N + j] - ref;
                    num += std::isnan(hc[i * N + j]) ? 1e30 : e * e;
                    den += ref * ref;
                }
            const double rel = std::sqrt(num / den);
            std::printf("%-45s %-22s %s rel err %.3e\n", names[mode], swap ? "LBO=MN, SBO=K" : "LBO=K, SBO=MN",
                        err == cudaSuccess ? "ok  " : cudaGetErrorString(err), rel);
            if (!(rel < 1e-5)) ++failures;
        }
    return failures ? 1 : 0;
}
