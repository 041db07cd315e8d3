// small_fc_lopt's update pass on Hopper (sm_90a): lopt_update_mma_11 of src/cuda/small_fc_lopt.cu
// (same walk, features, operand splits, output layer and arithmetic contract: small_fc_lopt.cuh)
// with its two dense layers on wgmma instead of mma.sync. build.rs compiles this file for
// compute_90a only; the host picks `lopt_update_wgmma` on compute capability 9.0 when the tensor-core
// MLP splits both layers (the default), and the portable kernel elsewhere.
//
// A warpgroup (four consecutive warps, 128 elements) evaluates together: warp w of the group holds
// rows 16 w .. 16 w + 15 of two m64n32k16 products, its own 32 elements as two 16-row tiles, with
// the A fragments in registers (the m16n8k16 A layout, built as the mma.sync kernel builds them) and
// the accumulators in the m16n8 layout per warp. So a warp's split, ReLU and output-layer code is
// the mma.sync kernel's; only the products change: per layer and 16-row tile, six wgmma (two k
// steps of 16, each lo.hi, hi.lo, hi.hi, in the mma.sync kernel's order) where the mma.sync
// kernel issues 24 mma.m16n8k16, with B (the weights) read by the tensor cores from shared memory
// instead of loaded into registers a fragment at a time.
//
// B operands: a layer's weights W (32 n x 32 k, f16 hi and lo parts) K-major in the no-swizzle
// core-matrix layout: the 16-byte chunk c (8 of k) of row n at (n / 8) B_GROUP + c 128 + (n % 8) 16
// bytes, B_GROUP = 512; k step s starts 256 bytes further on.
#include "small_fc_lopt.cuh"
#include "wgmma.cuh"

namespace {

static_assert(THREADS % 128 == 0, "whole warpgroups");
static_assert(HIDDEN == 32, "the products are m64n32k16, two k steps per layer");
constexpr uint32_t B_GROUP = 4 * 128;                   // bytes between 8-row groups of n
constexpr uint32_t B_BYTES = HIDDEN / 8 * B_GROUP;      // one part of one layer
constexpr uint32_t K_STEP_UNITS = 2 * 128 / 16;         // a k step of 16, in descriptor units

struct WgmmaWeights {
    __align__(128) unsigned char b[2][2][B_BYTES];  // [layer][hi, lo]
    OutputWeights out;

    // Every thread of the block calls it; it returns with the weights visible to wgmma.
    __device__ __forceinline__ void fill(const float* __restrict__ mlp) {
        for (int i = threadIdx.x; i < 2 * HIDDEN * 4; i += blockDim.x) {
            const int layer = i / (HIDDEN * 4), n = (i / 4) % HIDDEN, c = i % 4;
            uint32_t hi[4], lo[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int k = c * 8 + 2 * j;
                const Split2 v = split_half2(weight_at(mlp, layer, k, n), weight_at(mlp, layer, k + 1, n));
                hi[j] = v.hi;
                lo[j] = v.lo;
            }
            const uint32_t at = (n / 8) * B_GROUP + c * 128 + (n % 8) * 16;
            *reinterpret_cast<uint4*>(&b[layer][0][at]) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *reinterpret_cast<uint4*>(&b[layer][1][at]) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
        out.fill(mlp);
        fence_async_shared();  // the generic stores above, before wgmma reads them
        __syncthreads();
    }
};

// d (64 x 32, this thread's 16) += A . Bᵀ over 16 of k: A from registers (the m16n8k16 A fragment
// of each warp's 16 rows), B K-major in shared memory (descriptor b).
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"
        : WG_ACC8(d, 0), WG_ACC8(d, 8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Keeps the compiler from moving uses of one tile's accumulators across the asm around it: after
// a wait, their reads stay after it; before a wgmma fence, their initial values are in registers
// before it (left to be materialised after the fence, they made ptxas serialize every wgmma).
__device__ __forceinline__ void fence_acc(float (&acc)[4][4]) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(acc[nt][i])::"memory");
}

// Issues one 16-row tile's products of one layer (acc holding its bias on entry): per k step,
// lo.hi, hi.lo, then hi.hi. The caller fences before and commits after.
__device__ __forceinline__ void layer_products(float (&acc)[4][4], const SplitA& a, uint64_t hi, uint64_t lo) {
    float(&d)[16] = reinterpret_cast<float(&)[16]>(acc);
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
        const uint64_t b_hi = desc_plus(hi, kt * K_STEP_UNITS), b_lo = desc_plus(lo, kt * K_STEP_UNITS);
        wgmma_m64n32k16(d, a.lo[kt], b_hi);
        wgmma_m64n32k16(d, a.hi[kt], b_lo);
        wgmma_m64n32k16(d, a.hi[kt], b_hi);
    }
}

// The warpgroup's 128 elements (each lane its own, x already normalised; copies for idle lanes)
// through the MLP; each lane gets its element's direction and magnitude. (Issuing the two tiles'
// products in separate commit groups, so that one tile's ReLU and split overlap the other's
// products, measured no faster: BENCHMARKS.md, small_fc_lopt, session 55.)
struct WgmmaMlp {
    static constexpr uint32_t WARPS_TOGETHER = 4;
    static constexpr uint32_t UNIT_WARPS = 4;  // each warpgroup walks its own chunks
    const WgmmaWeights& w;        // in shared memory
    __half (*tile)[TILE_STRIDE];  // this warp's feature rows

    __device__ __forceinline__ uint64_t desc(int layer, int part) const {
        return smem_desc(fastops::shared_address(w.b[layer][part]), 128, B_GROUP);
    }

    __device__ __forceinline__ void operator()(float (&x)[FEATURES], float& direction, float& magnitude) const {
        SplitA a[2];
        features_to_a<true>(tile, x, a);
        float acc[2][4][4] = {};  // the first layer's bias rides in the constant slot
#pragma unroll
        for (int layer = 0; layer < 2; ++layer) {
            if (layer == 1) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    relu_to_a(acc[mt], a[mt]);
                    bias_to_acc(w.out, acc[mt]);
                }
            }
            fence_acc(acc[0]);
            fence_acc(acc[1]);
            wgmma_fence();
            const uint64_t hi = desc(layer, 0), lo = desc(layer, 1);
            layer_products(acc[0], a[0], hi, lo);
            layer_products(acc[1], a[1], hi, lo);
            wgmma_commit();
            wgmma_wait<0>();
            fence_acc(acc[0]);
            fence_acc(acc[1]);
        }
        output_layer(w.out, acc, direction, magnitude);
    }
};

}  // namespace

// The update pass with both layers split (lopt_update_mma_11's contract), on wgmma.
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    lopt_update_wgmma(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                      uint32_t first, StepTensors ptrs, Buffers buf, const float* __restrict__ mlp, Decays d,
                      Hyper h) {
    __shared__ __align__(16) __half tiles[WARPS][32][TILE_STRIDE];
    __shared__ WgmmaWeights weights;
    weights.fill(mlp);
    const WgmmaMlp eval{weights, tiles[threadIdx.x >> 5]};
    update(meta, chunks, n_chunks, first, ptrs, buf, d, h, eval);
}
