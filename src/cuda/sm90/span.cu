// masked_bmm's backward product grad_a = (g masked) . bᵀ on Hopper (sm_90a): f32 operands as
// three TF32 passes on wgmma, for the grad_a span product of src/cuda/matmul.cu (same contract:
// each output row tile reduces over its span of g's column tiles, the mask applied to g as its
// stages land). build.rs compiles this file for compute_90a only; the host picks it on compute
// capability 9.0 for f32 in the compensated mode with g and b k-contiguous on 16-byte boundaries
// and an output of at most COLS columns (masked_bmm's k), and falls back to the portable kernel
// elsewhere.
//
// A block owns 128 output rows (two warpgroups of 64) and all COLS columns. A stage is 16 f32 of
// k of g's 128 rows and of b's COLS rows. Each thread copies (cp.async) its own three 16-byte
// chunks of a stage (two of g's rows, 64 apart, and one of b's) into STAGES raw buffers of
// RAW_ROW-byte rows; rows past the operand are not copied and k past the span is zero-filled.
// Once its chunks of a stage have landed, the thread masks and splits them: g's elements the mask
// hides (all of an empty mask tile's) and everything past the operand become zeros, and each
// element x becomes big = x rounded to TF32 and small = x - big, written into one of two split
// buffers in the no-swizzle core-matrix layout (the 16-byte chunk c of row r at (r / 8) GROUP +
// c 128 + (r % 8) 16 bytes, GROUP = 512), K-major for both operands. Then a proxy fence (the
// split's generic stores, before wgmma reads them) and one block barrier a stage, which also
// frees the raw buffer of the stage before it for the next copies and the split buffer of the
// stage before that. Each warpgroup then issues the stage's products (wgmma m64n64k8, 8 of k each) into a
// sum of its own, from zero: the small.big and big.small terms (about 2^-11 of it) first, then
// the two big.big products; while they run, the thread copies and splits the next stage, then
// adds the sum into the total with round-to-nearest adds (the mma's sums truncate, and on a
// running total that bias would add up over k). Per 16 of k that is two truncations at the
// scale of the products, as the portable `_tf32x3` core takes (one per 8 of k), one of them on
// a sum of up to twice the size: the same error bound to within that factor on its truncation
// share.
#include "common.cuh"
#include "matmul_common.cuh"
#include "wgmma.cuh"

using namespace fastops;

namespace {

namespace SS = fastops_constants::span_sm90;
constexpr int TILE = fastops_constants::matmul::TILE;  // output rows of a block; mask tile edge
constexpr int THREADS = SS::THREADS;
constexpr int COLS = SS::COLS;
constexpr int STAGES = SS::STAGES;
constexpr int STAGE_K = 16;                    // f32 of k per stage
constexpr int CHUNKS = STAGE_K / 4;            // 16-byte chunks of a row per stage
constexpr uint32_t GROUP = CHUNKS * 128;       // bytes between 8-row groups of a split tile
constexpr uint32_t A_BYTES = TILE * STAGE_K * 4;  // g's split stage (big or small)
constexpr uint32_t B_BYTES = COLS * STAGE_K * 4;  // b's
constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
// Raw stages: rows of 64 bytes padded to 80, so that the split's 16-byte reads of 8 consecutive
// rows fall in distinct banks.
constexpr uint32_t RAW_ROW = STAGE_K * 4 + 16, RAW_BYTES = (TILE + COLS) * RAW_ROW;
static_assert(THREADS == 256 && TILE == 128, "two warpgroups of 64 rows");
static_assert(TILE * CHUNKS == 2 * THREADS && COLS * CHUNKS == THREADS, "two chunks of g and one of b a thread");
// Raw stages, then two split buffers (big and small each).
static_assert(STAGES * RAW_BYTES + 2 * 2 * STAGE_BYTES == SS::SHARED_BYTES,
              "the host sizes the launch by it");
constexpr uint8_t EMPTY = fastops_constants::matmul::TILE_EMPTY, FULL = fastops_constants::matmul::TILE_FULL;

// d (64 x 64, this thread's 32) = [accumulate ? d : 0] + A . Bᵀ over 8 of k (TF32), both operands
// K-major in shared memory (descriptors a, b).
__device__ __forceinline__ void wgmma_m64n64k8_tf32(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, "
        "%33, p, 1, 1;\n}\n"
        : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
        : "l"(a), "l"(b), "r"(accumulate));
}

// big = x rounded to the nearest TF32 (half away from zero, by integer adds: the portable core's
// `Split`), small = x - big (exact).
__device__ __forceinline__ void split_tf32(uint32_t x, uint32_t& big, uint32_t& small) {
    big = (x + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(__uint_as_float(x) - __uint_as_float(big));
}

// Chunk `id` of a stage buffer: bytes 16 id .. 16 id + 15, which the core-matrix layout gives to
// row (id / 32) 8 + id % 8 of the tile, k 4 ((id / 8) % 4) .. + 3 of the stage. (So consecutive
// threads touch consecutive 16 bytes of shared memory, and a warp's copies read 64 contiguous
// bytes of each of 8 rows.)
struct Chunk {
    uint32_t offset;  // in the stage buffer
    int row, col;     // the tile's row, the stage's first k of the chunk
};
__device__ __forceinline__ Chunk chunk_of(int id) {
    static_assert(GROUP == 4 * 128, "a row group is 4 chunks of 8 rows");
    return {static_cast<uint32_t>(16 * id), (id / 32) * 8 + id % 8, 4 * ((id / 8) % CHUNKS)};
}

__device__ __forceinline__ void span_grad_a(const float* __restrict__ g, const float* __restrict__ b,
                                            const uint32_t* __restrict__ spans, const uint8_t* __restrict__ mask,
                                            const uint8_t* __restrict__ plan, float* __restrict__ out, Problem p,
                                            SpanArgs sa) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const uint32_t shared = shared_address(shared_raw);
    const uint32_t raws = shared, splits = shared + STAGES * RAW_BYTES;
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile = span_tile(blockIdx.x, spans, p, sa, row_tiles, col_tiles);
    const int64_t row0 = tile.row_tile * TILE;
    const uint32_t* span = spans + tile.batch * sa.spans_batch_stride + 2 * tile.row_tile;
    const int64_t k0 = min(int64_t(span[0]) * TILE, p.k), k1 = min(int64_t(span[1]) * TILE, p.k);
    const int64_t k_len = max(k1 - k0, int64_t(0));
    const int stages = static_cast<int>((k_len + STAGE_K - 1) / STAGE_K);

    const int tid = threadIdx.x;
    // This thread's chunks of a split stage: two of g's (rows 64 apart), one of b's.
    const Chunk a_chunk[2] = {chunk_of(tid), chunk_of(tid + THREADS)};
    const Chunk b_chunk = chunk_of(tid);
    const int64_t g_rows = min(p.m - row0, int64_t(TILE)), b_rows = min(p.n, int64_t(COLS));
    // This thread's copies: its own three chunks (of the raw rows), from k0.
    const float* chunk_src[3];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
        const Chunk c = q < 2 ? a_chunk[q] : b_chunk;
        chunk_src[q] = q < 2 ? g + tile.batch * p.a.batch_stride + (row0 + c.row) * p.a.outer_stride + k0 + c.col
                             : b + tile.batch * p.b.batch_stride + c.row * p.b.outer_stride + k0 + c.col;
    }
    // The mask of g: the plan's tile states along the row tile from k0 on, and its elements.
    const uint8_t* plan_at = plan + tile.batch * sa.plan_batch_stride + tile.row_tile * sa.plan_col_tiles + k0 / TILE;
    const uint8_t* mask_at = mask + tile.batch * sa.mask_batch_stride + row0 * sa.mask_row_stride + k0 * sa.mask_col_stride;

    int issued = 0;
    auto issue = [&] {
        if (issued < stages) {
            const int64_t k_left = k_len - int64_t(issued) * STAGE_K;
            const uint32_t raw = raws + (issued % STAGES) * RAW_BYTES;
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                const Chunk c = q < 2 ? a_chunk[q] : b_chunk;
                const bool live = q < 2 ? c.row < g_rows : c.row < b_rows;
                const int bytes = 4 * static_cast<int>(min(max(k_left - c.col, int64_t(0)), int64_t(4)));
                const uint32_t dst = raw + (q < 2 ? c.row : TILE + c.row) * RAW_ROW + 4 * c.col;
                if (live && bytes > 0) cp_async16(dst, chunk_src[q] + int64_t(issued) * STAGE_K, bytes);
            }
            ++issued;
        }
        cp_async_commit();
    };

    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for the wgmma
    // The wgmma descriptors of split buffer 0 (big, small): this warpgroup's 64 rows of g (8 row
    // groups) and all COLS rows of b. The other buffer or k8 step is the same descriptor plus a
    // number of 16-byte units in its address field (shared addresses stay below 2^18).
    const uint64_t a_big0 = smem_desc(splits + wg * 8 * GROUP, 128, GROUP), b_big0 = smem_desc(splits + A_BYTES, 128, GROUP);
    const uint64_t a_small0 = smem_desc(splits + STAGE_BYTES + wg * 8 * GROUP, 128, GROUP),
                   b_small0 = smem_desc(splits + STAGE_BYTES + A_BYTES, 128, GROUP);
    // acc: the total, which takes each stage's products (part, from zero) with round-to-nearest
    // adds.
    float acc[32], part[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue();
    for (int s = 0; s < stages; ++s) {
        cp_async_wait<STAGES - 2>();  // this thread's chunks of stage s have landed
        const uint32_t raw = raws + (s % STAGES) * RAW_BYTES;
        const uint32_t big_at = splits + (s % 2) * 2 * STAGE_BYTES, small_at = big_at + STAGE_BYTES;
        // Mask and split this thread's chunks (g's two, b's one).
        const uint8_t state = sa.masked ? plan_at[s / (TILE / STAGE_K)] : FULL;
        const int64_t k_left = k_len - int64_t(s) * STAGE_K;
#pragma unroll
        for (int q = 0; q < 3; ++q) {
            const Chunk c = q < 2 ? a_chunk[q] : b_chunk;
            const int raw_row = q < 2 ? c.row : TILE + c.row;
            // (A partial stage copied only the 16-byte pieces that hold some of k.)
            const bool live = (q < 2 ? c.row < g_rows : c.row < b_rows) && c.col < k_left;
            uint4 v = live ? *reinterpret_cast<const uint4*>(shared_raw + (raw - shared) + raw_row * RAW_ROW + 4 * c.col)
                           : make_uint4(0, 0, 0, 0);
            uint32_t* e = reinterpret_cast<uint32_t*>(&v);
            if (k_left < STAGE_K) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (c.col + j >= k_left) e[j] = 0u;  // past the span's k
            }
            if (q < 2 && state != FULL) {
                // g's elements where the mask hides them (all of an empty tile's) become zeros.
                const uint8_t* keep = mask_at + c.row * sa.mask_row_stride + (int64_t(s) * STAGE_K + c.col) * sa.mask_col_stride;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const bool inside = live && c.col + j < k_left;
                    if (state == EMPTY || (inside && keep[j * sa.mask_col_stride] == 0)) e[j] = 0u;
                }
            }
            const uint32_t at = q < 2 ? c.offset : A_BYTES + c.offset;
            uint4 big, low;
            split_tf32(v.x, big.x, low.x);
            split_tf32(v.y, big.y, low.y);
            split_tf32(v.z, big.z, low.z);
            split_tf32(v.w, big.w, low.w);
            *reinterpret_cast<uint4*>(shared_raw + (big_at - shared) + at) = big;
            *reinterpret_cast<uint4*>(shared_raw + (small_at - shared) + at) = low;
        }
        fence_async_shared();  // the split's stores, before wgmma reads them
        // Stage s - 1's products, which ran under this stage's copies and split: their sum into
        // the total, and their buffers free.
        wgmma_wait<0>();
        if (s > 0) {
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] += part[i];
        }
        __syncthreads();  // stage s split by every thread; every warpgroup done with stage s - 1
        issue();          // stage s + STAGES - 1, into stage s - 1's raw buffer
        // Two k8 steps (8 of k: two 16-byte chunks, 256 bytes further).
        const uint32_t at_buf = (s % 2) * (2 * STAGE_BYTES / 16), at_small = at_buf;
        wgmma_fence();
        // The small terms first (from zero), then the big.big products of both k8 steps.
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8) {
            const uint64_t a_big = desc_plus(a_big0, at_buf + 16 * k8), b_big = desc_plus(b_big0, at_buf + 16 * k8);
            wgmma_m64n64k8_tf32(part, desc_plus(a_small0, at_small + 16 * k8), b_big, k8);
            wgmma_m64n64k8_tf32(part, a_big, desc_plus(b_small0, at_small + 16 * k8), 1);
        }
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8)
            wgmma_m64n64k8_tf32(part, desc_plus(a_big0, at_buf + 16 * k8), desc_plus(b_big0, at_buf + 16 * k8), 1);
        wgmma_commit();
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    if (stages > 0) {
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] += part[i];
    }

    // Accumulator i of this thread: row lane / 4 + 8 ((i / 2) % 2) of its warp's 16, column
    // 8 (i / 4) + 2 (lane % 4) + i % 2.
    const int warp = (tid % 128) / 32, lane = tid % 32;
    float* out_b = out + tile.batch * p.m * p.n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + wg * 64 + warp * 16 + lane / 4 + 8 * h;
        if (row >= p.m) continue;
#pragma unroll
        for (int nt = 0; nt < COLS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int64_t col = 8 * nt + 2 * (lane % 4) + e;
                if (col < p.n) out_b[row * p.n + col] = acc[4 * nt + 2 * h + e];
            }
        }
    }
}

}  // namespace

// `span_grad_a_sm90_tf32x3_f32(g, b, spans, mask, plan, out, problem, span_args)`: the arguments
// of the portable `span_matmul_*` (a = g, b = bᵀ as the problem's operands).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    span_grad_a_sm90_tf32x3_f32(const float* g, const float* b, const uint32_t* spans, const uint8_t* mask,
                                const uint8_t* plan, float* out, Problem p, SpanArgs sa) {
    span_grad_a(g, b, spans, mask, plan, out, p, sa);
}

