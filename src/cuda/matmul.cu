// One tiled matrix-product core, three epilogues:
//
//   masked_bmm:     out[b, i, j] = keep(b, i, j) ? (a[b] . b[b])[i, j] : fill (async core: the
//                   tile written through shared memory in 16-byte row pieces)
//   argmin_matmul:  out[b, i]    = argmin_j  scale * (a[b] . b[b])[i, j] + bias[j]
//   span_matmul:    masked_bmm's backward products, each tile reducing over a span of k only,
//                   the gradient operand masked as it lands (async core), 64-wide outputs on
//                   narrow tiles (WarpPart), the longest spans first (span_tile)
//
// Three forms of the core follow: the f32 FMA kernels, the register-staged TF32 kernels (`_tc`)
// and the async core (`_h16`, `_tf32`, `_tf32x3`: cp.async stages, see its section).
//
// The core: a block of 256 threads owns a 128 x 128 output tile and walks k in steps of 8. Each
// step's A (128 x 8) and B (8 x 128) slices are staged in shared memory, transposed so both are
// k-major, with the next step's slices loaded into registers while the current one is used
// (double buffer, one barrier per step). Each thread accumulates an 8 x 8 sub-tile in registers
// as two 4-row and two 4-column halves 64 apart, so its shared-memory reads are float4s that do
// not conflict. Arithmetic is f32 FMA (`_f32` kernels: true f32).
//
// The `_tc` kernels run the same tiles on tensor cores: each of the 8 warps owns a 64 x 32 part
// of the tile as 4 x 4 mma.sync m16n8k8 TF32 products with f32 accumulation. f16 / bf16 values
// are exact in TF32 (10-bit mantissa, 8-bit exponent), so their products are exact and only the
// f32 accumulation order differs from the FMA kernels; f32 inputs are rounded to TF32 (cvt.rna)
// when staged, which is the opt-in reduced-precision mode.
//
// Operands come with arbitrary element strides (batch, outer, k), so transposed or sliced views
// are read in place: the loader picks, per operand, the thread mapping that makes its global
// loads coalesced (k contiguous, outer contiguous, or neither) and uses 4-wide vector loads when
// the host says the view is aligned for them.
//
// masked_bmm reads a plan of 128 x 128 tile states (empty / partial / full, built once per mask):
// an empty tile writes `fill` and does no loads or math, a full tile never reads the mask.
// argmin_matmul keeps each row's running minimum and its index together as one 64-bit key
// (order-preserving float bits above the column index), so one 64-bit atomicMin per row per block
// merges blocks: value and index cannot tear, and ties go to the lowest column whatever the
// block order. Nothing of size m x n is materialised.
#include "common.cuh"
#include "matmul_common.cuh"

using namespace fastops;

namespace {

using fastops_constants::matmul::TILE;  // output tile edge
constexpr int BK = 8;
using fastops_constants::matmul::THREADS;
// Row stride of the k-major shared tiles: 132 spreads the FMA kernels' transposed stores over
// the banks; 136 (8 mod 32) makes the mma fragment loads (4 k rows x 8 outer) conflict-free.
template <bool TC> __host__ __device__ constexpr int smem_stride() { return TC ? TILE + 8 : TILE + 4; }

template <typename T> struct Load4;
template <> struct Load4<float> {
    __device__ __forceinline__ static void run(const float* p, float (&r)[4]) {
        float4 v = *reinterpret_cast<const float4*>(p);
        r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
    }
};
template <typename H> struct Load4Half {
    __device__ __forceinline__ static void run(const H* p, float (&r)[4]) {
        uint2 v = *reinterpret_cast<const uint2*>(p);
        float2 lo = to_float2<H>(reinterpret_cast<const H*>(&v.x));
        float2 hi = to_float2<H>(reinterpret_cast<const H*>(&v.y));
        r[0] = lo.x; r[1] = lo.y; r[2] = hi.x; r[3] = hi.y;
    }
};
template <> struct Load4<__half> : Load4Half<__half> {};
template <> struct Load4<__nv_bfloat16> : Load4Half<__nv_bfloat16> {};

__device__ __forceinline__ float to_tf32(float v) {
    uint32_t bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(v));
    return __uint_as_float(bits);
}

// This thread's four elements of a TILE (outer) x BK (k) slice of one operand, staged through
// registers into shared memory stored k-major: smem[kk][outer]. Construction places the thread
// on its run of four; each `load` reads the next slice along k.
// RUNS > 1 loads RUNS such slices BK apart along k per call (a stage of RUNS * BK).
template <typename T, int RUNS> struct TileLoader {
    const T* ptr;       // the run's first element in the current slice
    int64_t advance;    // elements from one stage to the next (RUNS * BK along k)
    int64_t run_step;   // elements from one run of the stage to the next (BK along k)
    int64_t elem_step;  // elements between the run's four
    int64_t k_left;     // k extent left from the run's first k
    int outer_valid;    // run along outer: its elements inside the operand (0..4); else 0 or 1
    int smem_k, smem_outer;  // position of the run's first element in the k-major slice
    bool along_outer;   // the run goes along outer (else along k)
    bool vectorised;
    float r[RUNS][4];

    __device__ __forceinline__ TileLoader(const T* base, const Operand& op, int64_t outer_len, int64_t k_len) {
        const int t = threadIdx.x;
        int outer, kk;
        if (op.mode == K_CONTIGUOUS) {
            outer = t >> 1; kk = (t & 1) * 4; along_outer = false;
        } else if (op.mode == OUTER_CONTIGUOUS) {
            kk = t >> 5; outer = (t & 31) * 4; along_outer = true;
        } else {
            outer = t & (TILE - 1); kk = (t >> 7) * 4; along_outer = false;
        }
        const int64_t outer_room = outer_len - outer;
        outer_valid = along_outer ? static_cast<int>(max(int64_t(0), min(outer_room, int64_t(4))))
                                  : (outer_room > 0 ? 1 : 0);
        k_left = k_len - kk;
        ptr = base + (outer_room > 0 ? outer * op.outer_stride + kk * op.k_stride : 0);
        advance = RUNS * BK * op.k_stride;
        run_step = BK * op.k_stride;
        elem_step = along_outer ? op.outer_stride : op.k_stride;
        smem_k = kk;
        smem_outer = outer;
        vectorised = op.vectorised != 0;
    }

    __device__ __forceinline__ void load() {
#pragma unroll
        for (int q = 0; q < RUNS; ++q) {
            const int64_t kl = k_left - q * BK;
            const T* p = ptr + q * run_step;
            int valid;
            if (along_outer) valid = kl > 0 ? outer_valid : 0;
            else valid = outer_valid ? static_cast<int>(max(int64_t(0), min(kl, int64_t(4)))) : 0;
            if (vectorised && valid == 4) {
                Load4<T>::run(p, r[q]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) r[q][i] = i < valid ? to_float(p[i * elem_step]) : 0.f;
            }
        }
        ptr += advance;
        k_left -= RUNS * BK;
    }

    // TF32 rounds f32 values to TF32 (round to nearest, ties away) as the mma expects.
    template <int STRIDE, bool TF32>
    __device__ __forceinline__ void store(float (*smem)[STRIDE]) const {
#pragma unroll
        for (int q = 0; q < RUNS; ++q) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = TF32 ? to_tf32(r[q][i]) : r[q][i];
            float* at = &smem[smem_k + q * BK][smem_outer];
            if (along_outer) {
                *reinterpret_cast<float4*>(at) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) at[i * STRIDE] = v[i];
            }
        }
    }
};

// Where this thread's accumulator acc[i][j] sits in the tile: row_of(i), col_of(j). Columns come
// in runs of RUN adjacent ones (j = RUN * r ... RUN * r + RUN - 1), which the epilogues store
// together.
template <bool TC> struct AccLayout;
// FMA kernels: an 8 x 8 sub-tile as two 4-row and two 4-column halves 64 apart.
template <> struct AccLayout<false> {
    static constexpr int RUN = 4;
    int ty, tx;
    __device__ __forceinline__ AccLayout() : ty(threadIdx.x >> 4), tx(threadIdx.x & 15) {}
    __device__ __forceinline__ static int half(int lane16, int i) { return (i < 4 ? 0 : 64 - 4) + lane16 * 4 + i; }
    __device__ __forceinline__ int row_of(int i) const { return half(ty, i); }
    __device__ __forceinline__ int col_of(int j) const { return half(tx, j); }
};
// Tensor-core kernels: warp w owns rows 64 * (w / 4) + [0, 64) and columns 32 * (w % 4) + [0, 32)
// as 4 x 4 m16n8 fragments; acc[2 * mi + h][2 * ni + c] is fragment (mi, ni)'s element
// (row g + 8 h, column 2 t + c), with g = lane / 4 and t = lane % 4 (the mma C layout).
template <> struct AccLayout<true> {
    static constexpr int RUN = 2;
    int row_base, col_base;
    __device__ __forceinline__ AccLayout() {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        row_base = (warp >> 2) * 64 + (lane >> 2);
        col_base = (warp & 3) * 32 + 2 * (lane & 3);
    }
    __device__ __forceinline__ int row_of(int i) const { return row_base + (i >> 1) * 16 + (i & 1) * 8; }
    __device__ __forceinline__ int col_of(int j) const { return col_base + (j >> 1) * 8 + (j & 1); }
};

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Runs `product` on fragment (mi, ni) of the mma accumulator layout (AccLayout<true>) as the
// mma's C registers c0..c3: rows g and g + 8, columns 2 t and 2 t + 1.
template <class Product>
__device__ __forceinline__ void on_fragment(float (&acc)[8][8], int mi, int ni, Product&& product) {
    float c[4] = {acc[2 * mi][2 * ni], acc[2 * mi][2 * ni + 1], acc[2 * mi + 1][2 * ni], acc[2 * mi + 1][2 * ni + 1]};
    product(c);
    acc[2 * mi][2 * ni] = c[0];
    acc[2 * mi][2 * ni + 1] = c[1];
    acc[2 * mi + 1][2 * ni] = c[2];
    acc[2 * mi + 1][2 * ni + 1] = c[3];
}

// Stage depth along k: the tensor-core kernels do 8x less work per k than the FMA kernels, so
// they stage 16 per barrier (two mma k-steps) to keep global loads covered.
template <bool TC> __host__ __device__ constexpr int staged_k() { return TC ? 2 * BK : BK; }

// One stage of the product from the k-major shared tiles into the accumulators.
template <bool TC, int S>
__device__ __forceinline__ void slice_product(const float (*As)[S], const float (*Bs)[S], float (&acc)[8][8]) {
    if constexpr (TC) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int m0 = (warp >> 2) * 64, n0 = (warp & 3) * 32;
#pragma unroll
        for (int k0 = 0; k0 < staged_k<TC>(); k0 += BK) {
        uint32_t af[4][4], bf[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            const int row = m0 + mi * 16 + g;
            af[mi][0] = __float_as_uint(As[k0 + t][row]);
            af[mi][1] = __float_as_uint(As[k0 + t][row + 8]);
            af[mi][2] = __float_as_uint(As[k0 + t + 4][row]);
            af[mi][3] = __float_as_uint(As[k0 + t + 4][row + 8]);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = n0 + ni * 8 + g;
            bf[ni][0] = __float_as_uint(Bs[k0 + t][col]);
            bf[ni][1] = __float_as_uint(Bs[k0 + t + 4][col]);
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                on_fragment(acc, mi, ni, [&](float (&c)[4]) { mma_tf32(c, af[mi], bf[ni]); });
            }
        }
    } else {
        const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[kk][64 + tx * 4]);
            const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
}

// Shared memory of one block: double-buffered k-major slices of A and B.
template <bool TC> struct Staging {
    static constexpr int S = smem_stride<TC>();
    float a[2][staged_k<TC>()][S];
    float b[2][staged_k<TC>()][S];
};

// The accumulators (AccLayout<TC>) of this thread for the tile at (row0, col0) of batch `batch`.
template <typename T, bool TC>
__device__ __forceinline__ void tile_product(const Problem& p, const T* a, const T* b, int64_t batch,
                                             int64_t row0, int64_t col0, float (&acc)[8][8], Staging<TC>& sm) {
    // Tensor cores take f32 operands rounded to TF32; f16 / bf16 are already exact in TF32.
    constexpr bool ROUND = TC && sizeof(T) == 4;
    constexpr int S = Staging<TC>::S;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    constexpr int RUNS = staged_k<TC>() / BK;
    TileLoader<T, RUNS> la(a + batch * p.a.batch_stride + row0 * p.a.outer_stride, p.a, p.m - row0, p.k);
    TileLoader<T, RUNS> lb(b + batch * p.b.batch_stride + col0 * p.b.outer_stride, p.b, p.n - col0, p.k);
    const int64_t steps = (p.k + staged_k<TC>() - 1) / staged_k<TC>();
    if (steps == 0) return;
    la.load();
    lb.load();
    la.template store<S, ROUND>(sm.a[0]);
    lb.template store<S, ROUND>(sm.b[0]);
    __syncthreads();
    for (int64_t s = 0; s < steps; ++s) {
        const int cur = s & 1;
        const bool more = s + 1 < steps;
        if (more) {
            la.load();
            lb.load();
        }
        slice_product<TC, S>(sm.a[cur], sm.b[cur], acc);
        if (more) {
            la.template store<S, ROUND>(sm.a[cur ^ 1]);
            lb.template store<S, ROUND>(sm.b[cur ^ 1]);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// The async core (`_h16` and `_tf32` / `_tf32x3` kernels): operands whose contiguous dim is k or
// outer and whose rows start on 16-byte boundaries. The same 128 x 128 tiles, warps and
// accumulator layout as the TF32 core, but no staging registers: cp.async copies 16-byte chunks
// from global to shared memory (STAGES stages of 64 bytes of k, three in flight while one is
// used; dynamic shared memory, 80 KiB per block), and the fragments are read straight from the
// stage buffers. An argmin block runs one pipeline through all of its column tiles
// (`stream_tiles`), so a short k (k-means) does not refill it at every tile. Where the time went
// before (ncu on the H200, k-means n = 2^20, c = 4096, d = 128): per-stage 64-bit copy placement
// and the other layout's if-converted loads cost as many instructions as the products, and a
// per-tile pipeline restart and epilogue took 77% of the 16-bit kernel's instructions.
// * f16 / bf16 (`_h16`): ldmatrix loads the fragments (transposed on the way when the operand is
//   outer-contiguous) and mma.m16n8k16 multiplies them; products of 16-bit values are exact in
//   the f32 accumulators.
// * f32 (`_tf32`, `_tf32x3`): ldmatrix (k-contiguous; a 32-bit element is two b16 halves, which
//   gives the TF32 fragment layout) or conflict-free scalar loads (outer-contiguous), then
//   mma.m16n8k8 TF32. One pass rounds each operand to TF32 (the opt-in TF32 mode). Three passes
//   are the f32-accurate default: each operand x is split into big = tf32(x) and small = x - big
//   (`Split`),
//   and big.big + big.small + small.big is accumulated (small terms first). The dropped
//   small.small term and the small parts' own truncation leave a relative error per product of
//   about 2^-21, the same order as f32 rounding of the accumulation itself.

constexpr int STAGE_K_BYTES = 64;  // k per stage: 32 16-bit or 16 f32 elements
constexpr int ROW_PAD_BYTES = 16;  // [outer][k] rows of 80 bytes: ldmatrix's 8 rows hit distinct banks
constexpr int KROW_BYTES = STAGE_K_BYTES + ROW_PAD_BYTES;
constexpr int OUTER_PAD = 8;       // [k][outer] rows of TILE + 8 elements (8 mod 32 words for f32)
constexpr int STAGE_BYTES = TILE * KROW_BYTES;  // per operand and stage, either layout
constexpr int STAGES = 4;
// A stage copy has L2 fetch the whole 128-byte line of its source: a k-major operand's rows are
// read 64 bytes a stage, so the next stage finds its bytes in L2 (measured: bf16 masked_bmm
// fwd+bwd 1.5-2% faster, no case slower; 256 bytes slowed the TF32 forward by 1.5%).
constexpr int STAGE_PREFETCH = 128;
template <typename T> __host__ __device__ constexpr int stage_k() { return STAGE_K_BYTES / sizeof(T); }
template <typename T> __host__ __device__ constexpr int outer_row() { return TILE + OUTER_PAD; }
static_assert(stage_k<uint16_t>() * outer_row<uint16_t>() * 2 <= STAGE_BYTES, "16-bit [k][outer] fits a stage");
static_assert(stage_k<float>() * outer_row<float>() * 4 <= STAGE_BYTES, "f32 [k][outer] fits a stage");

// Dynamic shared memory of the async kernels (`matmul::ASYNC_SHARED_BYTES` on the host).
struct AsyncStaging {
    uint8_t a[STAGES][STAGE_BYTES];
    uint8_t b[STAGES][STAGE_BYTES];
};
static_assert(sizeof(AsyncStaging) == fastops_constants::matmul::ASYNC_SHARED_BYTES, "the host sizes the launch by it");


// Copies of one operand's TILE (outer) x stage_k (k) stages: two 16-byte chunks per thread, into
// smem[outer][k] (K_MAJOR: k contiguous in global) or smem[k][outer] (outer contiguous). Chunks
// past the operand's edge are zero-filled (a partial chunk copies its valid bytes only).
// Everything but the stage's k is worked out once per tile: a stage's copies cost a few
// instructions per chunk, not the 64-bit index arithmetic of a fresh placement (which made the
// copies as costly as the products for short k).
template <typename T, bool K_MAJOR> struct StageCopier {
    static constexpr int CHUNK = 16 / sizeof(T);     // elements per 16-byte chunk
    static constexpr int ROW_CHUNKS = TILE / CHUNK;  // chunks per [k][outer] row
    const T* origin;  // chunk 0's source at k 0 (chunk 1 is 64 rows or THREADS / ROW_CHUNKS k further)
    int64_t walk;     // the operand's non-unit stride: outer (K_MAJOR) or k
    int cap[2];       // K_MAJOR: CHUNK if the chunk's row is inside the operand, else 0;
                      // else: the chunk's elements inside the operand along outer (0..CHUNK)

    __device__ __forceinline__ static int chunk(int q) { return threadIdx.x + q * THREADS; }
    __device__ __forceinline__ static int outer_of(int q) {
        return K_MAJOR ? chunk(q) >> 2 : (chunk(q) % ROW_CHUNKS) * CHUNK;
    }
    __device__ __forceinline__ static int k_of(int q) { return K_MAJOR ? (chunk(q) & 3) * CHUNK : chunk(q) / ROW_CHUNKS; }
    __device__ __forceinline__ static uint32_t dst_of(int q) {
        return K_MAJOR ? outer_of(q) * KROW_BYTES + k_of(q) * int(sizeof(T))
                       : (k_of(q) * outer_row<T>() + outer_of(q)) * int(sizeof(T));
    }

    // `tile` is the operand's (outer 0, k 0) element of the tile; `outer_len` its extent along
    // outer from there. K_MAJOR operands have k stride 1, the others outer stride 1.
    __device__ __forceinline__ StageCopier(const T* tile, const Operand& op, int64_t outer_len)
        : walk(K_MAJOR ? op.outer_stride : op.k_stride) {
        origin = tile + (K_MAJOR ? outer_of(0) * walk + k_of(0) : outer_of(0) + k_of(0) * walk);
        set_outer_len(outer_len);
    }

    __device__ __forceinline__ void set_outer_len(int64_t outer_len) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int64_t room = outer_len - outer_of(q);
            cap[q] = K_MAJOR ? (room > 0 ? CHUNK : 0) : static_cast<int>(min(max(room, int64_t(0)), int64_t(CHUNK)));
        }
    }

    // Moves to the tile `outer` elements further along outer, `outer_len` from its edge.
    __device__ __forceinline__ void next_tile(int64_t outer, int64_t outer_len) {
        origin += K_MAJOR ? outer * walk : outer;
        set_outer_len(outer_len);
    }

    // The stage at k0 into the stage buffer at shared address `buf`; `k_left` is the operand's k
    // extent from k0 (clamped to int). `any` is a valid address, the source of chunks that copy
    // nothing (a kernel argument: it costs no register).
    __device__ __forceinline__ void copy(uint32_t buf, int64_t k0, int k_left, const T* any) const {
        constexpr int NEXT = K_MAJOR ? THREADS / 4 : THREADS / ROW_CHUNKS;  // chunk 1's offset in walks
        const T* at = origin + (K_MAJOR ? k0 : k0 * walk);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int valid = K_MAJOR ? min(max(k_left - k_of(q), 0), cap[q]) : (k_left > k_of(q) ? cap[q] : 0);
            const T* src = valid > 0 ? at + q * NEXT * walk : any;
            cp_async16_prefetch<STAGE_PREFETCH>(buf + dst_of(q), src, valid * int(sizeof(T)));
        }
    }
};

// Which part of the block's output tile and of each stage a warp computes.
// * WIDE: warp w owns rows 64 (w / 4) + [0, 64) and columns 32 (w % 4) + [0, 32) of the tile
//   (AccLayout<true>) and runs every k-step of each stage.
// * NARROW_N (at most 64 of the tile's columns inside the output) and NARROW_M (at most 64 rows):
//   half of the warps' own parts lie outside the output. Each such warp (a helper) computes the
//   part of an owner warp instead, over the odd k-steps of each stage while the owner runs the
//   even ones; `join_narrow` then adds the helper's sums into the owner's. The same products in
//   half the mma per warp. (The masked_bmm backward's products are 64 wide when k is 64.)
enum TileShape : int { WIDE = 0, NARROW_N = 1, NARROW_M = 2 };
struct WarpPart {
    int m0, n0;   // the first row and column of the part computed (in the tile)
    int step0;    // the k-step of each stage it starts at (0 or 1; narrow shapes run one step)
    int slot;     // narrow shapes: the owner's index among the owners (0..3), where sums meet
    bool helper;  // narrow shapes: its sums go to the owner of the same part
    __device__ __forceinline__ explicit WarpPart(int shape) {
        const int warp = threadIdx.x >> 5;
        if (shape == NARROW_N) {
            m0 = (warp >> 2) * 64;
            n0 = (warp & 1) * 32;
            step0 = (warp >> 1) & 1;
            slot = (warp >> 2) * 2 + (warp & 1);
        } else if (shape == NARROW_M) {
            m0 = 0;
            n0 = (warp & 3) * 32;
            step0 = warp >> 2;
            slot = warp & 3;
        } else {
            m0 = (warp >> 2) * 64;
            n0 = (warp & 3) * 32;
            step0 = 0;
            slot = 0;
        }
        helper = step0 != 0;
    }
};

// This thread's ldmatrix row address (byte offset in a stage buffer at k 0) for the warp's first
// 16-row block of A and first pair of 8-column blocks of B; the others follow at fixed strides.
// The k-major offsets serve both element sizes: 16 bytes of k are 8 halves or 4 f32, the k
// half-step of a 16-bit m16n8k16 fragment and of an f32 m16n8k8 one. (f32 operands that are
// outer-major do not use ldmatrix.)
template <bool AK, bool BK> struct FragmentOffsets {
    uint32_t a, b;

    __device__ __forceinline__ explicit FragmentOffsets(const WarpPart& part) {
        constexpr int OPAD = outer_row<uint16_t>();
        const int lane = threadIdx.x & 31;
        const int m0 = part.m0, n0 = part.n0;
        a = AK ? (m0 + (lane & 15)) * KROW_BYTES + (lane >> 4) * 16
               : 2 * (((lane & 7) + ((lane >> 4) << 3)) * OPAD + m0 + ((lane >> 3) & 1) * 8);
        b = BK ? (n0 + (lane & 7) + ((lane >> 4) << 3)) * KROW_BYTES + ((lane >> 3) & 1) * 16
               : 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * OPAD + n0 + (lane >> 4) * 8);
    }
};

// Bytes from one k-step of a stage to the next in an operand's stage buffer: 16 elements of k
// (16-bit) or 8 (f32) are 32 bytes of a k-major row, or that many [k][outer] rows.
template <typename T, bool K_MAJOR> __host__ __device__ constexpr int step_bytes() {
    return K_MAJOR ? 32 : (sizeof(T) == 2 ? 16 : 8) * outer_row<T>() * int(sizeof(T));
}

// A stage's products, 16-bit: for each k16 step, the warp's 4 A fragments (16 rows each) and 4 B
// fragments (8 columns each) by ldmatrix, then 16 mma. AK / BK: the operand's stage is k-major.
// STEPS: the k-steps run from a_base / b_base on (a narrow tile's warps run one).
template <typename T, bool AK, bool BK, int STEPS = stage_k<T>() / 16>
__device__ __forceinline__ void stage_product16(uint32_t a_base, uint32_t b_base, const FragmentOffsets<AK, BK>& off,
                                                float (&acc)[8][8]) {
#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        uint32_t af[4][4], bf[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            // 16 rows further: 16 smem rows ([outer][k]) or 16 elements along a row ([k][outer]).
            const uint32_t addr = a_base + off.a + mi * (AK ? 16 * KROW_BYTES : 32) + step * step_bytes<T, AK>();
            ldmatrix_x4<!AK>(af[mi], addr);
        }
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            uint32_t r[4];
            const uint32_t addr = b_base + off.b + np * (BK ? 16 * KROW_BYTES : 32) + step * step_bytes<T, BK>();
            ldmatrix_x4<!BK>(r, addr);
            bf[2 * np][0] = r[0];
            bf[2 * np][1] = r[1];
            bf[2 * np + 1][0] = r[2];
            bf[2 * np + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                on_fragment(acc, mi, ni, [&](float (&c)[4]) { mma_m16n8k16<T>(c, af[mi], bf[ni][0], bf[ni][1]); });
            }
    }
}

// An f32 fragment register split for PASSES TF32 products. big is x rounded to nearest TF32 by
// integer adds (half a TF32 ulp, then the 13 low bits cleared: two instructions, where cvt.rna
// takes four); +-inf stay inf, and so does a NaN whose payload lies only in those 13 bits (which
// the mma, reading the top 19 bits, would also see as inf). One pass needs no clearing: the mma
// ignores the low bits.
// small = x - big is exact (its own bits beyond TF32 are ignored by the mma, a truncation of at
// most 2^-11 of the small part).
template <int PASSES, int N> struct Split {
    uint32_t big[N], small[N];
    __device__ __forceinline__ Split(const uint32_t (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const uint32_t half_up = x[i] + 0x1000u;
            if constexpr (PASSES == 3) {
                big[i] = half_up & 0xffffe000u;
                small[i] = __float_as_uint(__uint_as_float(x[i]) - __uint_as_float(big[i]));
            } else {
                big[i] = half_up;
            }
        }
    }
};

// A stage's products, f32 as TF32: for each k8 step, the warp's 4 B fragments (split once) and,
// one at a time, its 4 A fragments (split as they are used, which keeps the registers of the
// split B fragments, one split A fragment and the accumulators under the cap). ROUND: fragments
// whose three products are interleaved; four spill at the 128-register cap and measured 1.3%
// slower on k-means than two. Af / Bf are the stage buffers as floats at the first k-step run,
// a_base / b_base their shared addresses; STEPS as in stage_product16.
template <int PASSES, bool AK, bool BK, int STEPS = stage_k<float>() / 8, int ROUND = 2>
__device__ __forceinline__ void stage_product_f32(uint32_t a_base, uint32_t b_base, const float* Af, const float* Bf,
                                                  const FragmentOffsets<AK, BK>& off, const WarpPart& part,
                                                  float (&acc)[8][8]) {
    constexpr int OROW = outer_row<float>();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = part.m0, n0 = part.n0;
#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        uint32_t braw[4][2];
        if constexpr (BK) {
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                uint32_t r[4];
                ldmatrix_x4<false>(r, b_base + off.b + np * 16 * KROW_BYTES + step * 32);
                braw[2 * np][0] = r[0];
                braw[2 * np][1] = r[1];
                braw[2 * np + 1][0] = r[2];
                braw[2 * np + 1][1] = r[3];
            }
        } else {
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const float* at = Bf + (step * 8 + t) * OROW + n0 + ni * 8 + g;
                braw[ni][0] = __float_as_uint(at[0]);
                braw[ni][1] = __float_as_uint(at[4 * OROW]);
            }
        }
        Split<PASSES, 2> bs[4] = {braw[0], braw[1], braw[2], braw[3]};
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            uint32_t araw[4];
            if constexpr (AK) {
                ldmatrix_x4<false>(araw, a_base + off.a + mi * 16 * KROW_BYTES + step * 32);
            } else {
                const float* at = Af + (step * 8 + t) * OROW + m0 + mi * 16 + g;
                araw[0] = __float_as_uint(at[0]);
                araw[1] = __float_as_uint(at[8]);
                araw[2] = __float_as_uint(at[4 * OROW]);
                araw[3] = __float_as_uint(at[4 * OROW + 8]);
            }
            const Split<PASSES, 4> as(araw);
            if constexpr (PASSES == 3) {
                // The mma rounds its f32 sums toward zero; on a running total that bias adds up
                // over k (5x the FMA kernel's error at k = 512). So each k8 step's three products
                // start from zero, and the total takes them with round-to-nearest adds. The
                // products go in rounds over the four fragments, so that consecutive mma do not
                // wait on each other.
#pragma unroll
                for (int n0 = 0; n0 < 4; n0 += ROUND) {
                    float part[ROUND][4];
#pragma unroll
                    for (int r = 0; r < ROUND; ++r) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) part[r][e] = 0.f;
                        mma_tf32(part[r], as.small, bs[n0 + r].big);
                    }
#pragma unroll
                    for (int r = 0; r < ROUND; ++r) mma_tf32(part[r], as.big, bs[n0 + r].small);
#pragma unroll
                    for (int r = 0; r < ROUND; ++r) mma_tf32(part[r], as.big, bs[n0 + r].big);
#pragma unroll
                    for (int r = 0; r < ROUND; ++r)
                        on_fragment(acc, mi, n0 + r, [&](float (&c)[4]) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) c[e] += part[r][e];
                        });
                }
            } else {
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    on_fragment(acc, mi, ni, [&](float (&c)[4]) { mma_tf32(c, as.big, bs[ni].big); });
            }
        }
    }
}

// The async core's main loop over a run of `tiles` output tiles that share their rows: columns
// col0, col0 + col_step, ... . After each tile's last stage, `tile_done(col)` reads the
// accumulators. The stages stream across tiles: the next tile's first copies are in flight while
// a tile finishes and its epilogue runs, so a short k (k-means: d = 64 is 4 stages) does not
// drain and refill the pipeline at every tile. a_tile / b_tile: the operands' first tile.
// NARROW: the warps split as `shape` (NARROW_N / NARROW_M, see WarpPart) and the caller joins
// their sums (`join_narrow`); only for a single tile.
// `prepare(k, a_stage, b_stage, Bool<AK>, Bool<BK>)` sees each stage once it has landed, before
// its products (k: the stage's first k in its tile); it returns whether it wrote to the stage
// buffers (then a block barrier makes the writes visible to every warp).
template <bool V> struct Bool { static constexpr bool value = V; };
struct NoPrepare {
    template <class A, class B>
    __device__ __forceinline__ bool operator()(int64_t, uint8_t*, uint8_t*, A, B) const { return false; }
};
template <typename T, int PASSES, bool AK, bool BK, bool NARROW, class TileDone, class Prepare>
__device__ __forceinline__ void stream_tiles_as(const Problem& p, const T* a, const T* b, const T* a_tile,
                                                const T* b_tile, int64_t row0,
                                                int64_t col0, int64_t col_step, int64_t tiles, float (&acc)[8][8],
                                                AsyncStaging& sm, int shape, TileDone& tile_done, Prepare& prepare) {
    auto zero = [&] {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    };
    constexpr int KS = stage_k<T>();
    const int64_t steps = (p.k + KS - 1) / KS;
    if (steps == 0) {
        for (int64_t t = 0; t < tiles; ++t) {
            zero();
            tile_done(col0 + t * col_step);
        }
        return;
    }
    StageCopier<T, AK> ca(a_tile, p.a, p.m - row0);
    StageCopier<T, BK> cb(b_tile, p.b, p.n - col0);
    const WarpPart part(NARROW ? shape : WIDE);
    const FragmentOffsets<AK, BK> off(part);
    // The warp's first k-step in a stage buffer (0 but in a narrow tile's helpers).
    const int a_step = part.step0 * step_bytes<T, AK>(), b_step = part.step0 * step_bytes<T, BK>();
    constexpr int STAGE_STEPS = NARROW ? 1 : stage_k<T>() / (sizeof(T) == 2 ? 16 : 8);
    const uint32_t a_smem = shared_address(sm.a[0]), b_smem = shared_address(sm.b[0]);
    // Counts of stages fit an int: B alone holds TILE * KS elements per tile stage.
    const int total = static_cast<int>(tiles * steps);
    // The copy side: flat stage `issued`, which is stage `issue_step` of the tile at `issue_col`.
    int issued = 0, issue_step = 0, issue_buf = 0;
    int64_t issue_col = col0;
    auto issue = [&] {
        if (issued < total) {
            const int64_t k0 = issue_step * KS;
            const int k_left = static_cast<int>(min(p.k - k0, int64_t(INT_MAX)));
            ca.copy(a_smem + issue_buf * STAGE_BYTES, k0, k_left, a);
            cb.copy(b_smem + issue_buf * STAGE_BYTES, k0, k_left, b);
            issue_buf = issue_buf + 1 == STAGES ? 0 : issue_buf + 1;
            if (++issued < total && ++issue_step == steps) {
                issue_step = 0;
                issue_col += col_step;
                cb.next_tile(col_step, p.n - issue_col);
            }
        }
        cp_async_commit();  // possibly empty: one group per stage keeps the count uniform
    };
    // The block's warps may still read the stage buffers for an earlier product.
    __syncthreads();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) issue();
    int step = 0, cur = 0;
    int64_t col = col0;
    zero();
    for (int s = 0; s < total; ++s) {
        cp_async_wait<STAGES - 2>();  // stage s has landed (for this thread) ...
        __syncthreads();  // ... and for every thread, which are all done with stage s - 1
        issue();
        if (prepare(int64_t(step) * KS, sm.a[cur], sm.b[cur], Bool<AK>{}, Bool<BK>{})) __syncthreads();
        const uint32_t a_buf = a_smem + cur * STAGE_BYTES + a_step, b_buf = b_smem + cur * STAGE_BYTES + b_step;
        if constexpr (sizeof(T) == 2) {
            stage_product16<T, AK, BK, STAGE_STEPS>(a_buf, b_buf, off, acc);
        } else {
            stage_product_f32<PASSES, AK, BK, STAGE_STEPS>(a_buf, b_buf,
                                                           reinterpret_cast<const float*>(sm.a[cur] + a_step),
                                                           reinterpret_cast<const float*>(sm.b[cur] + b_step), off,
                                                           part, acc);
        }
        cur = cur + 1 == STAGES ? 0 : cur + 1;
        if (++step == steps) {
            step = 0;
            tile_done(col);
            col += col_step;
            // Cleared here, in the branch, not at a tile's first stage: a conditional clear
            // there becomes 64 selects in every stage.
            if (s + 1 < total) zero();
        }
    }
}

// stream_tiles_as for the operands' layouts (one copy of the loop per layout pair, so the stage
// products carry no layout branches).
template <typename T, int PASSES, bool NARROW = false, class TileDone, class Prepare = NoPrepare>
__device__ __forceinline__ void stream_tiles(const Problem& p, const T* a, const T* b, int64_t batch, int64_t row0,
                                             int64_t col0, int64_t col_step, int64_t tiles, float (&acc)[8][8],
                                             AsyncStaging& sm, TileDone&& tile_done, int shape = WIDE,
                                             Prepare&& prepare = Prepare{}) {
    const T* a_tile = a + batch * p.a.batch_stride + row0 * p.a.outer_stride;
    const T* b_tile = b + batch * p.b.batch_stride + col0 * p.b.outer_stride;
    const bool ak = p.a.mode == K_CONTIGUOUS, bk = p.b.mode == K_CONTIGUOUS;
    if (ak && bk) {
        stream_tiles_as<T, PASSES, true, true, NARROW>(p, a, b, a_tile, b_tile, row0, col0, col_step, tiles, acc, sm,
                                                       shape, tile_done, prepare);
    } else if (ak) {
        stream_tiles_as<T, PASSES, true, false, NARROW>(p, a, b, a_tile, b_tile, row0, col0, col_step, tiles, acc, sm,
                                                        shape, tile_done, prepare);
    } else if (bk) {
        stream_tiles_as<T, PASSES, false, true, NARROW>(p, a, b, a_tile, b_tile, row0, col0, col_step, tiles, acc, sm,
                                                        shape, tile_done, prepare);
    } else {
        stream_tiles_as<T, PASSES, false, false, NARROW>(p, a, b, a_tile, b_tile, row0, col0, col_step, tiles, acc,
                                                         sm, shape, tile_done, prepare);
    }
}

// A narrow tile's sums joined (see WarpPart): each helper parks its accumulators in the stage
// buffers, which the main loop no longer uses, and the owner of the same part adds them. Every
// thread of the block calls it, after stream_tiles with the same shape.
__device__ __forceinline__ void join_narrow(float (&acc)[8][8], AsyncStaging& sm, int shape) {
    static_assert(sizeof(AsyncStaging::a) >= 64 * 128 * sizeof(float), "the helpers' sums fit the A stages");
    const WarpPart part(shape);
    float* parked = reinterpret_cast<float*>(sm.a[0]);
    const int at = part.slot * 32 + (threadIdx.x & 31);  // [accumulator][owner thread]: no conflicts
    __syncthreads();  // every warp is done with the stage buffers
    if (part.helper) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) parked[(i * 8 + j) * 128 + at] = acc[i][j];
    }
    __syncthreads();
    if (!part.helper) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] += parked[(i * 8 + j) * 128 + at];
    }
}

// The cores, as the kernels' template parameter: f32 FMA, register-staged TF32, and the async
// core (16-bit native, or f32 in one or three TF32 passes).
enum Core : int { FMA = 0, TC = 1, ASYNC = 2, ASYNC_X3 = 3 };
template <int CORE> __host__ __device__ constexpr bool tensor_cores() { return CORE != FMA; }
template <int CORE> __host__ __device__ constexpr bool is_async() { return CORE >= ASYNC; }
template <int CORE> __host__ __device__ constexpr int passes() { return CORE == ASYNC_X3 ? 3 : 1; }

// The staging buffers of a core: FMA / TF32 (static Staging<TC>) or async (dynamic AsyncStaging).
template <int CORE> __device__ __forceinline__ auto& staging() {
    if constexpr (is_async<CORE>()) {
        extern __shared__ __align__(16) uint8_t dynamic_smem[];
        return *reinterpret_cast<AsyncStaging*>(dynamic_smem);
    } else {
        __shared__ __align__(16) Staging<tensor_cores<CORE>()> sm;
        return sm;
    }
}

template <typename T, int CORE, class S>
__device__ __forceinline__ void product(const Problem& p, const T* a, const T* b, int64_t batch, int64_t row0,
                                        int64_t col0, float (&acc)[8][8], S& sm) {
    if constexpr (is_async<CORE>()) {
        stream_tiles<T, passes<CORE>()>(p, a, b, batch, row0, col0, TILE, 1, acc, sm, [](int64_t) {});
    } else {
        tile_product<T, tensor_cores<CORE>()>(p, a, b, batch, row0, col0, acc, sm);
    }
}

// ---------------------------------------------------------------------------------------------
// masked_bmm

enum TileState : uint8_t {
    EMPTY = fastops_constants::matmul::TILE_EMPTY,
    PARTIAL = fastops_constants::matmul::TILE_PARTIAL,
    FULL = fastops_constants::matmul::TILE_FULL
};

// Mirrors `MaskArgs` in src/matmul/masked_bmm/cuda.rs.
struct MaskArgs {
    int64_t mask_batch_stride;  // elements between batches of the mask (0: one mask for all)
    int64_t plan_batch_stride;  // tiles between batches of the plan (0: one plan for all)
    float fill;
};
static_assert(sizeof(MaskArgs) == 24, "MaskArgs is mirrored by a Rust #[repr(C)] struct of 24 bytes");

// RUN adjacent outputs of one row; vector stores when the row starts are aligned for them.
template <typename T, int RUN>
__device__ __forceinline__ void store_run(T* out, int64_t col, int64_t n, const float (&v)[RUN], bool vec_ok) {
    if (vec_ok && col + RUN <= n) {
        if constexpr (sizeof(T) == 4 && RUN == 4) {
            *reinterpret_cast<float4*>(out + col) = make_float4(v[0], v[1], v[2], v[3]);
        } else if constexpr (sizeof(T) == 4) {
            *reinterpret_cast<float2*>(out + col) = make_float2(v[0], v[1]);
        } else {
#pragma unroll
            for (int j = 0; j < RUN; j += 2) from_float2<T>(out + col + j, v[j], v[j + 1]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < RUN; ++j)
            if (col + j < n) out[col + j] = from_float<T>(v[j]);
    }
}

// Stores this thread's part of the tile at (row0, col0) of `out_b` (`[m, n]`, row-major), RUN
// adjacent columns at a time: `value(i, j, row, col)` gives the output for accumulator acc[i][j]
// at (row, col), which may lie past n (then it is not stored).
template <typename T, int CORE, class Value>
__device__ __forceinline__ void store_tile(T* out_b, const Problem& p, int64_t row0, int64_t col0, Value&& value) {
    using Layout = AccLayout<tensor_cores<CORE>()>;
    constexpr int RUN = Layout::RUN;
    const Layout at;
    // Vector stores need every row start aligned: n a multiple of RUN.
    const bool vec_ok = (p.n % RUN) == 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t row = row0 + at.row_of(i);
        if (row >= p.m) continue;
#pragma unroll
        for (int r = 0; r < 8 / RUN; ++r) {
            const int64_t col = col0 + at.col_of(r * RUN);
            float v[RUN];
#pragma unroll
            for (int j = 0; j < RUN; ++j) v[j] = value(i, r * RUN + j, row, col + j);
            store_run<T, RUN>(out_b + row * p.n, col, p.n, v, vec_ok);
        }
    }
}

// The masked_bmm tile of the async core stored through shared memory: the mma layout's stores use
// 8 of each 32-byte run of a row per instruction (half of every sector the L2 sees, which bound
// the forward by L2 traffic), so the block parks its accumulators in the stage buffers, rounded to
// T (rows padded to 8 mod 32 words: the 8-byte f32 and 4-byte 16-bit writes of a warp hit distinct
// banks), and writes whole 16-byte pieces of rows. A partial tile's pieces take `fill` where the
// mask (contiguous rows, `mask_b` at row 0) holds 0 on the way out, after the accumulators are
// dead. Needs n * sizeof(T) a multiple of 16 and out_b 16-byte aligned. Every thread of the block
// calls it after the product (the stage buffers are reused).
constexpr int PARKED_ROW_BYTES = TILE * 4 + 32;  // f32: 136 words a row; 16-bit: 136 elements
template <typename T>
__device__ __forceinline__ void store_masked_tile_parked(T* out_b, const Problem& p, int64_t row0, int64_t col0,
                                                         const float (&acc)[8][8], bool partial,
                                                         const uint8_t* mask_b, float fill, AsyncStaging& sm) {
    constexpr int ROW = sizeof(T) == 4 ? PARKED_ROW_BYTES : PARKED_ROW_BYTES / 2;  // bytes per parked row
    static_assert(TILE * PARKED_ROW_BYTES <= sizeof(AsyncStaging), "an f32 tile fits the stage buffers");
    uint8_t* parked = sm.a[0];
    const AccLayout<true> at;
    __syncthreads();  // every warp is done with the stage buffers
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = at.row_of(i);
#pragma unroll
        for (int j = 0; j < 8; j += 2)
            from_float2<T>(reinterpret_cast<T*>(parked + r * ROW) + at.col_of(j), acc[i][j], acc[i][j + 1]);
    }
    __syncthreads();
    constexpr int PIECE = 16 / sizeof(T), ROW_PIECES = TILE / PIECE;
    const T fill_t = from_float<T>(fill);
    for (int q = threadIdx.x; q < TILE * ROW_PIECES; q += THREADS) {
        const int r = q / ROW_PIECES, c = (q % ROW_PIECES) * PIECE;
        const int64_t row = row0 + r, col = col0 + c;
        // n is a multiple of PIECE: a piece is wholly inside the row or wholly past it.
        if (row >= p.m || col >= p.n) continue;
        uint4 piece = *reinterpret_cast<const uint4*>(parked + r * ROW + c * sizeof(T));
        if (partial) {
            T* values = reinterpret_cast<T*>(&piece);
            const uint8_t* keep = mask_b + row * p.n + col;
#pragma unroll
            for (int e = 0; e < PIECE; ++e)
                if (keep[e] == 0) values[e] = fill_t;
        }
        *reinterpret_cast<uint4*>(out_b + row * p.n + col) = piece;
    }
}

// `fill` over the tile at (row0, col0) in 16-byte pieces (an empty tile, where
// store_masked_tile_parked applies: nothing to park).
template <typename T>
__device__ __forceinline__ void fill_tile(T* out_b, const Problem& p, int64_t row0, int64_t col0, float fill) {
    constexpr int PIECE = 16 / sizeof(T), ROW_PIECES = TILE / PIECE;
    uint4 piece;
    T* values = reinterpret_cast<T*>(&piece);
#pragma unroll
    for (int e = 0; e < PIECE; ++e) values[e] = from_float<T>(fill);
    for (int q = threadIdx.x; q < TILE * ROW_PIECES; q += THREADS) {
        const int64_t row = row0 + q / ROW_PIECES, col = col0 + (q % ROW_PIECES) * PIECE;
        if (row < p.m && col < p.n) *reinterpret_cast<uint4*>(out_b + row * p.n + col) = piece;
    }
}

template <typename T, int CORE>
__device__ __forceinline__ void masked_bmm(const T* __restrict__ a, const T* __restrict__ b,
                                           const uint8_t* __restrict__ mask, const uint8_t* __restrict__ plan,
                                           T* __restrict__ out, Problem p, MaskArgs mk) {
    auto& sm = staging<CORE>();
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile(blockIdx.x, row_tiles, col_tiles);
    const int64_t row0 = tile.row_tile * TILE, col0 = tile.col_group * TILE;
    const uint8_t state = plan[tile.batch * mk.plan_batch_stride + tile.row_tile * col_tiles + tile.col_group];

    float acc[8][8];
    if (state != EMPTY) {
        product<T, CORE>(p, a, b, tile.batch, row0, col0, acc, sm);
    }
    const uint8_t* mask_b = mask + tile.batch * mk.mask_batch_stride;
    auto value = [&](int i, int j, int64_t row, int64_t col) {
        if (state == EMPTY) return mk.fill;
        if (state == FULL) return acc[i][j];
        const bool keep = col < p.n && mask_b[row * p.n + col] != 0;
        return keep ? acc[i][j] : mk.fill;
    };
    T* out_b = out + tile.batch * p.m * p.n;
    if constexpr (is_async<CORE>()) {
        // Rows start on 16-byte boundaries (the output is a fresh contiguous allocation).
        if ((p.n * int64_t(sizeof(T))) % 16 == 0) {
            if (state == EMPTY) {
                fill_tile<T>(out_b, p, row0, col0, mk.fill);
            } else {
                store_masked_tile_parked<T>(out_b, p, row0, col0, acc, state == PARTIAL, mask_b, mk.fill, sm);
            }
            return;
        }
    }
    store_tile<T, CORE>(out_b, p, row0, col0, value);
}

// ---------------------------------------------------------------------------------------------
// span_matmul: masked_bmm's backward products, `(g masked) . b^T` and `a^T . (g masked)`, with the
// reduction limited to the mask tiles that are not empty. Each output row tile (grad_a: rows are
// the mask's rows) or column tile (grad_b: columns are the mask's columns) reads its span of
// reduction tiles [first, end) from the plan: the first and one past the last non-empty mask
// tile along its row or column of tiles. The masked gradient is zero outside the mask, so tiles
// outside the span add nothing; a causal mask halves the work.

// The mask applied to one landed stage of the gradient operand: `stage` holds TILE (outer) x
// stage_k (k) elements, k-major rows of KROW_BYTES or [k][outer] rows (K_MAJOR false). An empty
// mask tile clears the stage; a partial one clears the elements whose mask byte is 0. `keep` is
// the mask at (outer 0, k 0) of the stage, `outer_stride` / `k_stride` its strides; elements past
// outer_len / k_len are the copies' zero fill and are left alone. K_FASTEST: consecutive threads
// take consecutive k (the mask's contiguous dim), else consecutive outer.
template <typename T, bool K_MAJOR>
__device__ __forceinline__ void mask_stage(uint8_t* stage, uint8_t state, const uint8_t* __restrict__ keep,
                                           int64_t outer_stride, int64_t k_stride, int outer_len, int k_len,
                                           bool k_fastest) {
    if (state == EMPTY) {
        uint4* words = reinterpret_cast<uint4*>(stage);
        for (int i = threadIdx.x; i < STAGE_BYTES / 16; i += THREADS) words[i] = make_uint4(0, 0, 0, 0);
        return;
    }
    constexpr int KS = stage_k<T>();
    constexpr int PER_THREAD = TILE * KS / THREADS, BATCH = 4;
    static_assert(PER_THREAD * THREADS == TILE * KS && PER_THREAD % BATCH == 0, "a stage splits evenly");
    // This thread's elements are (o + i o_step, kk + i k_step), i < PER_THREAD: a fixed step in
    // the mask and in the stage buffer.
    const int t = threadIdx.x;
    const int o = k_fastest ? t / KS : t % TILE, kk = k_fastest ? t % KS : t / TILE;
    const int o_step = k_fastest ? THREADS / KS : 0, k_step = k_fastest ? 0 : THREADS / TILE;
    const uint8_t* at = keep + o * outer_stride + kk * k_stride;
    const int64_t at_step = o_step * outer_stride + k_step * k_stride;
    constexpr int KROW = KROW_BYTES / int(sizeof(T)), OROW = outer_row<T>();
    T* dst = reinterpret_cast<T*>(stage) + (K_MAJOR ? o * KROW + kk : kk * OROW + o);
    const int dst_step = K_MAJOR ? o_step * KROW + k_step : k_step * OROW + o_step;
    // BATCH mask bytes are loaded before any is used, so their latencies overlap. (The batches
    // stay a loop: unrolled, the main loop around this spills.)
#pragma unroll 1
    for (int b0 = 0; b0 < PER_THREAD; b0 += BATCH) {
        uint8_t kept[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = b0 + j;
            kept[j] = o + i * o_step < outer_len && kk + i * k_step < k_len ? at[i * at_step] : 1;
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
            if (kept[j] == 0) dst[(b0 + j) * dst_step] = from_float<T>(0.f);
    }
}

// span_matmul's `prepare` (see stream_tiles_as) when the gradient operand comes unmasked: each
// landed stage of it is masked by the mask tile it lies in (g's column tile for grad_a, its row
// tile for grad_b). What is fixed per block lives in shared memory (`Fixed`, written by thread 0
// before the pipeline's first barrier), so the main loop keeps no registers for it.
template <typename T> struct StageMask {
    struct Fixed {
        const uint8_t* plan_line;  // the plan's tile states along the span's direction, at k tile 0
        const uint8_t* keep;       // the mask at (outer 0, k 0) of the span
        int64_t plan_step;         // tiles between consecutive k tiles in the plan
        int64_t outer_stride, k_stride;
        int64_t k0, k_total;       // the span's first k (a multiple of TILE) and length
        int outer_len;             // the tile's extent inside the output along outer (<= TILE)
        int by_cols;
    };
    Fixed* fixed;  // null: the gradient operand is masked already
    bool enabled;

    __device__ __forceinline__ StageMask(Fixed* storage, const SpanArgs& sa, const uint8_t* mask,
                                         const uint8_t* plan, const TileIndex& tile, int64_t row0, int64_t col0,
                                         int64_t k0, int64_t k_total, const Problem& p)
        : fixed(storage), enabled(sa.masked != 0) {
        if (!enabled || threadIdx.x != 0) return;
        const uint8_t* plan_b = plan + tile.batch * sa.plan_batch_stride;
        const uint8_t* mask_b = mask + tile.batch * sa.mask_batch_stride;
        Fixed f;
        f.k0 = k0;
        f.k_total = k_total;
        f.by_cols = sa.by_cols;
        if (sa.by_cols) {
            // grad_b = a^T . g: g is B, its outer the columns, its k the rows.
            f.plan_line = plan_b + tile.col_group;
            f.plan_step = sa.plan_col_tiles;
            f.keep = mask_b + k0 * sa.mask_row_stride + col0 * sa.mask_col_stride;
            f.outer_stride = sa.mask_col_stride;
            f.k_stride = sa.mask_row_stride;
            f.outer_len = static_cast<int>(min(p.n - col0, int64_t(TILE)));
        } else {
            // grad_a = g . b^T: g is A, its outer the rows, its k the columns.
            f.plan_line = plan_b + tile.row_tile * sa.plan_col_tiles;
            f.plan_step = 1;
            f.keep = mask_b + row0 * sa.mask_row_stride + k0 * sa.mask_col_stride;
            f.outer_stride = sa.mask_row_stride;
            f.k_stride = sa.mask_col_stride;
            f.outer_len = static_cast<int>(min(p.m - row0, int64_t(TILE)));
        }
        *fixed = f;
    }

    template <class AK, class BK>
    __device__ __forceinline__ bool operator()(int64_t k, uint8_t* a_stage, uint8_t* b_stage, AK, BK) const {
        if (!enabled) return false;
        const Fixed& f = *fixed;
        const uint8_t state = f.plan_line[((f.k0 + k) / TILE) * f.plan_step];
        if (state == FULL) return false;
        const int k_len = static_cast<int>(min(f.k_total - k, int64_t(stage_k<T>())));
        const uint8_t* keep = f.keep + k * f.k_stride;
        if (f.by_cols) {
            mask_stage<T, BK::value>(b_stage, state, keep, f.outer_stride, f.k_stride, f.outer_len, k_len, false);
        } else {
            mask_stage<T, AK::value>(a_stage, state, keep, f.outer_stride, f.k_stride, f.outer_len, k_len, true);
        }
        return true;
    }
};

template <typename T, int CORE>
__device__ __forceinline__ void span_matmul(const T* __restrict__ a, const T* __restrict__ b,
                                            const uint32_t* __restrict__ spans, const uint8_t* __restrict__ mask,
                                            const uint8_t* __restrict__ plan, T* __restrict__ out, Problem p,
                                            SpanArgs sa) {
    auto& sm = staging<CORE>();
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile = span_tile(blockIdx.x, spans, p, sa, row_tiles, col_tiles);
    const int64_t row0 = tile.row_tile * TILE, col0 = tile.col_group * TILE;
    const uint32_t* span =
        spans + tile.batch * sa.spans_batch_stride + 2 * (sa.by_cols ? tile.col_group : tile.row_tile);
    const int64_t k0 = min(int64_t(span[0]) * TILE, p.k), k1 = min(int64_t(span[1]) * TILE, p.k);
    // The span as a problem of its own: reduction [k0, k1) (k0 is a multiple of TILE, so the
    // operands' alignment is unchanged); an empty span gives zero accumulators.
    Problem q = p;
    q.k = max(k1 - k0, int64_t(0));
    float acc[8][8];
    const T* a_span = a + k0 * p.a.k_stride;
    const T* b_span = b + k0 * p.b.k_stride;
    if constexpr (is_async<CORE>()) {
        // The products are 64 wide when masked_bmm's k is 64: a narrow tile runs them in half
        // the mma per warp (WarpPart).
        const int shape = p.n - col0 <= TILE / 2 ? NARROW_N : p.m - row0 <= TILE / 2 ? NARROW_M : WIDE;
        __shared__ typename StageMask<T>::Fixed mask_fixed;
        const StageMask<T> prepare(&mask_fixed, sa, mask, plan, tile, row0, col0, k0, q.k, p);
        if (shape != WIDE) {
            stream_tiles<T, passes<CORE>(), true>(q, a_span, b_span, tile.batch, row0, col0, TILE, 1, acc, sm,
                                                  [](int64_t) {}, shape, prepare);
            join_narrow(acc, sm, shape);
        } else {
            stream_tiles<T, passes<CORE>()>(q, a_span, b_span, tile.batch, row0, col0, TILE, 1, acc, sm,
                                            [](int64_t) {}, WIDE, prepare);
        }
    } else {
        product<T, CORE>(q, a_span, b_span, tile.batch, row0, col0, acc, sm);
    }
    store_tile<T, CORE>(out + tile.batch * p.m * p.n, p, row0, col0,
                        [&](int i, int j, int64_t, int64_t) { return acc[i][j]; });
}

// ---------------------------------------------------------------------------------------------
// argmin_matmul

template <typename T, int CORE>
__device__ __forceinline__ void argmin_matmul(const T* __restrict__ a, const T* __restrict__ b,
                                              const float* __restrict__ bias, unsigned long long* __restrict__ keys,
                                              Problem p, ArgminArgs am) {
    auto& sm = staging<CORE>();
    constexpr bool TC = tensor_cores<CORE>();
    const AccLayout<TC> at;
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile(blockIdx.x, row_tiles, am.col_groups);
    const int64_t row0 = tile.row_tile * TILE;

    // Per row: the smallest ordered score seen and its column. A thread meets its columns in
    // increasing order (j, then tiles), so a strict < keeps the lowest column of a tie; the
    // 64-bit key is built once per row, not per score.
    uint32_t best_bits[8], best_col[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        best_bits[i] = ~0u;
        best_col[i] = ~0u;
    }
    // The async kernels park the minima in shared memory between tiles (16 KiB per block): the
    // 16 registers they would hold through the main loop are what the TF32 x3 products need to
    // keep several mma in flight.
    constexpr bool PARK = is_async<CORE>();
    __shared__ uint2 parked[PARK ? 8 : 1][PARK ? THREADS : 1];
    auto park = [&] {
        if constexpr (PARK) {
#pragma unroll
            for (int i = 0; i < 8; ++i) parked[i][threadIdx.x] = make_uint2(best_bits[i], best_col[i]);
        }
    };
    auto unpark = [&] {
        if constexpr (PARK) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint2 v = parked[i][threadIdx.x];
                best_bits[i] = v.x;
                best_col[i] = v.y;
            }
        }
    };
    park();
    float acc[8][8];
    // The tile's scores into the running minima, a row at a time: the row's smallest score over
    // this thread's 8 columns (fminf takes a number over a NaN), the first of those columns that
    // holds it (the lowest: col_of is increasing), then one ordered-key compare per row. Columns
    // past n score NaN, so they never hold a number's minimum; a row with only NaN scores takes
    // the thread's first column, which is in range (else the thread has no columns here).
    auto consume = [&](int64_t col0) {
        if (col0 + at.col_of(0) >= p.n) return;
        float cb[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int64_t col = col0 + at.col_of(j);
            cb[j] = col < p.n ? bias[col] + 0.0f : __int_as_float(0x7fc00000);  // -0 -> +0
        }
        unpark();
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = fmaf(am.scale, acc[i][j], cb[j]);
            float low = v[0];
#pragma unroll
            for (int j = 1; j < 8; ++j) low = fminf(low, v[j]);
            int first = 0;
#pragma unroll
            for (int j = 7; j >= 0; --j) first = v[j] == low ? j : first;
            const uint32_t bits = ordered_bits(low);
            // Every key is below the all-ones start (the largest is a NaN's, 0xffc00000), so the
            // first score always takes; the FMA / register-staged TF32 kernels keep the explicit
            // first-score test, without which their register allocation spills.
            if (bits < best_bits[i] || (!is_async<CORE>() && best_col[i] == ~0u)) {
                best_bits[i] = bits;
                best_col[i] = static_cast<uint32_t>(col0 + at.col_of(first));
            }
        }
        park();
    };
    if constexpr (is_async<CORE>()) {
        // One pipeline through all of the block's column tiles.
        const int64_t tiles = (col_tiles - tile.col_group + am.col_groups - 1) / am.col_groups;
        stream_tiles<T, passes<CORE>()>(p, a, b, tile.batch, row0, tile.col_group * TILE, am.col_groups * TILE,
                                        tiles, acc, sm, consume);
        unpark();
    } else {
        for (int64_t ct = tile.col_group; ct < col_tiles; ct += am.col_groups) {
            const int64_t col0 = ct * TILE;
            product<T, CORE>(p, a, b, tile.batch, row0, col0, acc, sm);
            consume(col0);
        }
    }
    unsigned long long best[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
        best[i] = (static_cast<unsigned long long>(best_bits[i]) << 32) | static_cast<unsigned long long>(best_col[i]);
    // Threads holding the same rows: the 16 lanes of a half-warp (FMA layout), or the 4 lanes
    // with the same lane / 4 (mma layout; the 4 warps of a row band meet in the atomics).
    constexpr int FIRST_OFFSET = TC ? 2 : 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int off = FIRST_OFFSET; off > 0; off >>= 1)
            best[i] = min_key(best[i], __shfl_xor_sync(0xffffffffu, best[i], off));
    }
    if ((threadIdx.x & (2 * FIRST_OFFSET - 1)) == 0) {
        unsigned long long* keys_b = keys + tile.batch * p.m;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int64_t row = row0 + at.row_of(i);
            if (row < p.m && best[i] != ~0ull) atomicMin(keys_b + row, best[i]);
        }
    }
}

}  // namespace

// Column index (the low half of each key) of every row.
extern "C" __global__ void argmin_keys_to_index(const unsigned long long* __restrict__ keys,
                                                uint32_t* __restrict__ out, uint64_t rows) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < rows;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        out[i] = static_cast<uint32_t>(keys[i] & 0xffffffffull);
    }
}

// `name_f32`: f32 FMA; `name_tc_<dtype>`: register-staged TF32 tensor cores (TF32-rounded f32,
// exact f16 / bf16); the async core: `name_h16_<dtype>` (f16 / bf16), `name_tf32_f32` (f32 rounded
// to TF32) and `name_tf32x3_f32` (f32 in three TF32 passes).
#define MATMUL_KERNELS(T, SUFFIX, VARIANT, CORE)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS, fastops_constants::matmul::BLOCKS_PER_SM)                            \
        masked_bmm##VARIANT##SUFFIX(const T* a, const T* b, const uint8_t* mask, const uint8_t* plan,     \
                                    T* out, Problem p, MaskArgs mk) {                                      \
        masked_bmm<T, CORE>(a, b, mask, plan, out, p, mk);                                                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, fastops_constants::matmul::BLOCKS_PER_SM)                            \
        argmin_matmul##VARIANT##SUFFIX(const T* a, const T* b, const float* bias,                          \
                                       unsigned long long* keys, Problem p, ArgminArgs am) {               \
        argmin_matmul<T, CORE>(a, b, bias, keys, p, am);                                                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, fastops_constants::matmul::BLOCKS_PER_SM)                            \
        span_matmul##VARIANT##SUFFIX(const T* a, const T* b, const uint32_t* spans, const uint8_t* mask,   \
                                     const uint8_t* plan, T* out, Problem p, SpanArgs sa) {                \
        span_matmul<T, CORE>(a, b, spans, mask, plan, out, p, sa);                                         \
    }

MATMUL_KERNELS(float, f32, _, FMA)
MATMUL_KERNELS(float, f32, _tc_, TC)
MATMUL_KERNELS(__half, f16, _tc_, TC)
MATMUL_KERNELS(__nv_bfloat16, bf16, _tc_, TC)
MATMUL_KERNELS(__half, f16, _h16_, ASYNC)
MATMUL_KERNELS(__nv_bfloat16, bf16, _h16_, ASYNC)
MATMUL_KERNELS(float, f32, _tf32_, ASYNC)
MATMUL_KERNELS(float, f32, _tf32x3_, ASYNC_X3)

// masked_bmm's output gradient behind its mask: out[b, i, j] = keep(b, i, j) ? g[b, i, j] : 0, a
// block per 128 x 128 tile read by the plan's state: an empty tile writes zeros without reading
// g, a full tile copies, a partial tile reads the mask. g and out are contiguous [batch, rows,
// cols]; the mask is any-strided u8 (batch stride 0 when shared), the plan [plan batch, row
// tiles, col tiles] (batch stride 0 when shared). VEC: 16-byte accesses (cols and g's offset
// multiples of the vector width).
struct MaskGradArgs {
    int64_t mask_batch_stride, mask_row_stride, mask_col_stride, plan_batch_stride;
    uint64_t batch, rows, cols, row_tiles, col_tiles;
};
static_assert(sizeof(MaskGradArgs) == 72, "MaskGradArgs is mirrored by a Rust #[repr(C)] struct of 72 bytes");

namespace {

template <typename T, bool VEC>
__device__ __forceinline__ void mask_grad(const T* __restrict__ g, const uint8_t* __restrict__ mask,
                                          const uint8_t* __restrict__ plan, T* __restrict__ out, MaskGradArgs a) {
    constexpr int V = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;
    const uint64_t tiles = a.batch * a.row_tiles * a.col_tiles;
    for (uint64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const uint64_t tj = t % a.col_tiles, ti = (t / a.col_tiles) % a.row_tiles, b = t / (a.col_tiles * a.row_tiles);
        const uint8_t state = plan[static_cast<int64_t>(b) * a.plan_batch_stride + ti * a.col_tiles + tj];
        const uint64_t r0 = ti * TILE, c0 = tj * TILE;
        const uint32_t nr = static_cast<uint32_t>(min(static_cast<uint64_t>(TILE), a.rows - r0));
        const uint32_t nc = static_cast<uint32_t>(min(static_cast<uint64_t>(TILE), a.cols - c0));
        const uint32_t chunks = (nc + V - 1) / V;
        const uint64_t base = (b * a.rows + r0) * a.cols + c0;
        const uint8_t* keep = mask + static_cast<int64_t>(b) * a.mask_batch_stride +
                              static_cast<int64_t>(r0) * a.mask_row_stride + static_cast<int64_t>(c0) * a.mask_col_stride;
        for (uint32_t i = threadIdx.x; i < nr * chunks; i += blockDim.x) {
            const uint32_t r = i / chunks, c = (i - r * chunks) * V;
            const uint64_t at = base + static_cast<uint64_t>(r) * a.cols + c;
            const uint8_t* keep_row = keep + static_cast<int64_t>(r) * a.mask_row_stride;
            if constexpr (VEC) {
                Vec16<T> v;
                if (state == fastops_constants::matmul::TILE_EMPTY) {
                    v.raw = make_uint4(0, 0, 0, 0);
                } else {
                    v.raw = __ldcs(reinterpret_cast<const uint4*>(g + at));
                    if (state == fastops_constants::matmul::TILE_PARTIAL) {
#pragma unroll
                        for (int e = 0; e < V; ++e)
                            if (keep_row[static_cast<int64_t>(c + e) * a.mask_col_stride] == 0) v.lanes[e] = from_float<T>(0.0f);
                    }
                }
                __stcs(reinterpret_cast<uint4*>(out + at), v.raw);
            } else {
                T x = from_float<T>(0.0f);
                if (state != fastops_constants::matmul::TILE_EMPTY &&
                    (state == fastops_constants::matmul::TILE_FULL || keep_row[static_cast<int64_t>(c) * a.mask_col_stride] != 0))
                    x = g[at];
                out[at] = x;
            }
        }
    }
}

}  // namespace

#define MASK_GRAD_KERNELS(T, SUFFIX)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS) mask_grad_vec_##SUFFIX(                            \
        const T* g, const uint8_t* mask, const uint8_t* plan, T* out, MaskGradArgs a) {                    \
        mask_grad<T, true>(g, mask, plan, out, a);                                                         \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) mask_grad_scalar_##SUFFIX(                         \
        const T* g, const uint8_t* mask, const uint8_t* plan, T* out, MaskGradArgs a) {                    \
        mask_grad<T, false>(g, mask, plan, out, a);                                                        \
    }
FASTOPS_FLOAT_KERNELS(MASK_GRAD_KERNELS)
