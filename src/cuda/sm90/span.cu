// masked_bmm's backward span products on Hopper (sm_90a): grad_a = (g masked) . bᵀ and
// grad_b = aᵀ . (g masked) with f32 operands as three TF32 passes on wgmma, for the span products
// of src/cuda/matmul.cu (same contract: each output tile reduces over its span of g's tiles, the
// mask applied to g as its stages land). build.rs compiles this file for compute_90a only; the
// host picks a kernel on compute capability 9.0 for f32 in the compensated mode, masked_bmm's k
// at most ROWS (64) and the operands' layouts below, and falls back to the portable kernel
// elsewhere.
//
// Both kernels: 256 threads, two warpgroups, each computing a 64 x 64 output tile with wgmma
// m64n64k8 whose A operand (64 x 8) comes from registers and whose B operand (64 x 8) comes from
// shared memory, K-major (what TF32 wgmma reads) in the no-swizzle core-matrix layout: the 16-byte
// chunk c (4 of k) of row r at (r / 8) GROUP + c 128 + (r % 8) 16 bytes, GROUP = 512. A stage is
// 16 of k (the reduction). Each thread copies (cp.async) three 16-byte chunks of a stage into one
// of STAGES raw buffers; pieces past the operands or the span are not copied and are read as
// zeros. The mask's bytes of a stage of a partial tile (the plan's state, known a tile ahead) come
// with it into the raw buffer when the mask's rows allow 16-byte copies (unit column stride, row
// and batch strides and address multiples of 16); otherwise the split reads them from global
// memory. Stage s, once every thread's copies of it have landed (the barrier of stage s - 1 waits
// for them), is split: each element x becomes big = x rounded to TF32 and small = x - big (g's
// elements the mask hides, all of an empty mask tile's, become zeros first); the B operand's parts
// go to one of two split buffers, the A fragments' to registers. Then a proxy fence (the split's
// generic stores, before wgmma reads them) and one block barrier a stage, which also frees the
// raw buffer of the stage before it for the next copies and the split buffer of the stage before
// that. Each warpgroup then issues the stage's six products into a sum of its own, from zero: the
// small.big and big.small terms (about 2^-11 of it) first, then the two big.big products; while
// they run the thread splits the next stage, then adds the sum into the total with
// round-to-nearest adds (the mma's sums truncate, and on a running total that bias would add up
// over k). Per 16 of k that is two truncations at the scale of the products, as the portable
// `_tf32x3` core takes (one per 8 of k), one of them on a sum of up to twice the size: the same
// error bound to within that factor on its truncation share.
//
// grad_a: a block owns 128 output rows (a warpgroup per 64) and all of the output's columns
// (masked_bmm's k); g (128 rows) and b (k rows) both k-contiguous, rows of 16 f32 a stage. Each
// thread copies two chunks of g and one of b, splits its own chunk of b into the split buffer and
// gathers its A fragments from g's raw rows. grad_b: a block owns all of the output's rows
// (masked_bmm's k) and one column tile of g (a warpgroup per 64 columns); aᵀ and g are both
// outer-contiguous (a's rows and g's rows hold 16 rows of the reduction a stage), the wrong way
// round for a K-major operand: each thread gathers its A fragments from a's raw rows (aᵀ's
// columns) and two 4-row columns of g, which it writes K-major into the split buffer.
#include "common.cuh"
#include "matmul_common.cuh"
#include "wgmma.cuh"

using namespace fastops;

namespace {

namespace SS = fastops_constants::span_sm90;
constexpr int TILE = fastops_constants::matmul::TILE;  // mask tile edge; a block's 128 rows or columns
constexpr int THREADS = SS::THREADS;
constexpr int ROWS = SS::COLS;  // masked_bmm's k, at most this: the output's columns (grad_a) or rows (grad_b)
constexpr int STAGES = SS::STAGES;
constexpr int STAGE_K = 16;                       // f32 of k per stage
constexpr int STAGES_PER_TILE = TILE / STAGE_K;   // stages of a mask tile
constexpr uint32_t GROUP = STAGE_K / 4 * 128;     // bytes between 8-row groups of a split tile
static_assert(THREADS == 256 && TILE == 128 && ROWS == 64, "two warpgroups of 64 x 64");
constexpr uint8_t EMPTY = fastops_constants::matmul::TILE_EMPTY, FULL = fastops_constants::matmul::TILE_FULL;

// grad_a's shared memory: raw stages of g's 128 rows and b's ROWS rows (64 bytes of k padded to
// 80, so that 16-byte reads of 8 consecutive rows and the A fragments' 4-byte reads of 8 rows x 4
// of k fall in distinct banks) and of the mask's 128 rows (16 bytes each), then two split buffers
// of b's stage (big, small).
namespace GA {
constexpr uint32_t RAW_ROW = STAGE_K * 4 + 16, MASK_OFF = (TILE + ROWS) * RAW_ROW;
constexpr uint32_t RAW_BYTES = MASK_OFF + TILE * STAGE_K;
constexpr uint32_t SPLIT_BYTES = ROWS * STAGE_K * 4;
static_assert(TILE * STAGE_K == 8 * THREADS && ROWS * STAGE_K == 4 * THREADS, "two chunks of g and one of b a thread");
static_assert(STAGES * RAW_BYTES + 2 * 2 * SPLIT_BYTES == SS::SHARED_BYTES, "the host sizes the launch by it");
}  // namespace GA

// grad_b's: raw stages of 16 of a's rows (ROWS f32, padded so that the A fragments' reads of 4
// rows x 8 columns fall in distinct banks), 16 of g's rows (TILE f32) and 16 of the mask's (TILE
// bytes), then two split buffers of g's stage.
namespace GB {
constexpr uint32_t A_ROW = ROWS * 4 + 32, G_ROW = TILE * 4;
constexpr uint32_t MASK_OFF = STAGE_K * (A_ROW + G_ROW);
constexpr uint32_t RAW_BYTES = MASK_OFF + STAGE_K * TILE;
constexpr uint32_t SPLIT_BYTES = TILE * STAGE_K * 4;
static_assert(STAGE_K * ROWS == 4 * THREADS && STAGE_K * TILE == 8 * THREADS, "one chunk of a and two of g a thread");
static_assert(STAGES * RAW_BYTES + 2 * 2 * SPLIT_BYTES == SS::GRAD_B_SHARED_BYTES, "the host sizes the launch by it");
}  // namespace GB

// d (64 x 64, this thread's 32) = [accumulate ? d : 0] + A . Bᵀ over 8 of k (TF32): A in
// registers, a[v] holding row 16 (warp) + lane / 4 + 8 (v % 2), k lane % 4 + 4 (v / 2) of it (the
// m16n8k8 A fragment, a warp per 16 rows); B K-major in shared memory (descriptor b).
__device__ __forceinline__ void wgmma_m64n64k8_tf32(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                    int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// Keeps the compiler from moving the accumulators' uses across the asm around it (their reads
// after a wgmma wait stay after it).
__device__ __forceinline__ void fence_operands(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// big = x rounded to the nearest TF32 (half away from zero, by integer adds: the portable core's
// `Split`), small = x - big (exact).
__device__ __forceinline__ void split_tf32(uint32_t x, uint32_t& big, uint32_t& small) {
    big = (x + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(__uint_as_float(x) - __uint_as_float(big));
}

// Splits four elements and stores both parts, 16 bytes each, at `offset` of the big and the small
// split buffers.
__device__ __forceinline__ void split_store(unsigned char* big_buf, unsigned char* small_buf, uint32_t offset,
                                            const uint32_t (&e)[4]) {
    uint4 big, low;
    split_tf32(e[0], big.x, low.x);
    split_tf32(e[1], big.y, low.y);
    split_tf32(e[2], big.z, low.z);
    split_tf32(e[3], big.w, low.w);
    *reinterpret_cast<uint4*>(big_buf + offset) = big;
    *reinterpret_cast<uint4*>(small_buf + offset) = low;
}

// The plan's states of a span's mask tiles, for its stages in order: each tile's loaded a tile
// ahead of its use. `at`: the span's first tile, `stride` tiles apart along it; `tiles` 0 when
// unmasked (every stage FULL).
struct SpanStates {
    const uint8_t* at;
    int64_t stride;
    int tiles;
    uint8_t now = FULL, next = FULL;
    int now_tile = -1;
    __device__ __forceinline__ SpanStates(const uint8_t* at_, int64_t stride_, int tiles_)
        : at(at_), stride(stride_), tiles(tiles_) {
        if (tiles > 0) next = at[0];
    }
    __device__ __forceinline__ uint8_t of_stage(int s) {
        if (tiles > 0 && s % STAGES_PER_TILE == 0) {
            const int t = s / STAGES_PER_TILE;
            now = next;
            now_tile = t;
            next = t + 1 < tiles ? at[(t + 1) * stride] : FULL;
        }
        return now;
    }
    // The state of a stage of the current tile or the next (a stage not yet reached by of_stage,
    // at most a tile ahead).
    __device__ __forceinline__ uint8_t ahead(int s) const {
        return s / STAGES_PER_TILE == now_tile ? now : next;
    }
};

// Stores a warpgroup's 64 x 64 accumulator tile (this thread's 32) at rows row0 .., columns
// col0 .. of out (rows x cols, row-major), the part inside it. Accumulator i of this thread: row
// lane / 4 + 8 ((i / 2) % 2) of its warp's 16, column 8 (i / 4) + 2 (lane % 4) + i % 2.
__device__ __forceinline__ void store_wg_tile(const float (&acc)[32], float* out, int64_t row0, int64_t col0,
                                              int64_t rows, int64_t cols) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + warp * 16 + lane / 4 + 8 * h;
        if (row >= rows) continue;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int64_t col = col0 + 8 * nt + 2 * (lane % 4) + e;
                if (col < cols) out[row * cols + col] = acc[4 * nt + 2 * h + e];
            }
        }
    }
}

// The stage loop both kernels share (the pipeline of the header). `issue()` copies the next stage
// not yet copied (or nothing) and commits a group; `split_b(s, state, split)` writes stage s's B
// parts into the split buffer at shared offset `split` (big, then small SPLIT_BYTES further);
// `gather_a(s, state, big, small)` fills this thread's A fragments of stage s. `b_big0` /
// `b_small0`: this warpgroup's B descriptors in split buffer 0 (buffer 1 is 2 SPLIT_BYTES
// further). Returns the total in acc.
template <uint32_t SPLIT_BYTES, class Issue, class SplitB, class GatherA>
__device__ __forceinline__ void span_stages(int stages, SpanStates& states, uint32_t splits, uint64_t b_big0,
                                            uint64_t b_small0, Issue&& issue, SplitB&& split_b, GatherA&& gather_a,
                                            float (&acc)[32]) {
    float part[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    uint32_t a_big[2][4], a_small[2][4];  // two k8 steps
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue();
    cp_async_wait<STAGES - 2>();  // stage 0
    __syncthreads();
    for (int s = 0; s < stages; ++s) {
        const uint8_t state = states.of_stage(s);
        split_b(s, state, splits + (s % 2) * 2 * SPLIT_BYTES);
        fence_async_shared();         // the split's stores, before wgmma reads them
        cp_async_wait<STAGES - 3>();  // this thread's copies of stage s + 1 have landed
        wgmma_wait<0>();              // stage s - 1's products: their sum into the total
        fence_operands(part);
        if (s > 0) {
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] += part[i];
        }
        gather_a(s, state, a_big, a_small);  // (stage s - 1's products no longer read them)
        // Stage s split and stage s + 1 copied by every thread; every warpgroup done with stage
        // s - 1 (its split buffer is the next one's).
        __syncthreads();
        issue();  // stage s + STAGES - 1, into stage s - 1's raw buffer
        const uint32_t at = (s % 2) * (2 * SPLIT_BYTES / 16);  // 16-byte units; a k8 step is 16 more
        wgmma_fence();
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8) {
            wgmma_m64n64k8_tf32(part, a_small[k8], desc_plus(b_big0, at + 16 * k8), k8);
            wgmma_m64n64k8_tf32(part, a_big[k8], desc_plus(b_small0, at + 16 * k8), 1);
        }
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8) wgmma_m64n64k8_tf32(part, a_big[k8], desc_plus(b_big0, at + 16 * k8), 1);
        wgmma_commit();
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    fence_operands(part);
    if (stages > 0) {
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] += part[i];
    }
}

// The span [k0, k0 + k_len) of g's tiles of an output tile, clamped to the reduction length.
struct SpanRange {
    int64_t k0, k_len;
    int stages, tiles;
};
__device__ __forceinline__ SpanRange span_range(const uint32_t* span, int64_t k) {
    const int64_t k0 = min(int64_t(span[0]) * TILE, k), k1 = min(int64_t(span[1]) * TILE, k);
    const int64_t k_len = max(k1 - k0, int64_t(0));
    return {k0, k_len, static_cast<int>((k_len + STAGE_K - 1) / STAGE_K), static_cast<int>((k_len + TILE - 1) / TILE)};
}

// How much of stage s is inside the span: 0 .. STAGE_K of its k.
__device__ __forceinline__ int stage_k_left(const SpanRange& r, int s) {
    return static_cast<int>(min(r.k_len - int64_t(s) * STAGE_K, int64_t(STAGE_K)));
}

// Chunk `id` of a split stage of a k-contiguous operand: bytes 16 id .. 16 id + 15 of the buffer,
// which the core-matrix layout gives to row (id / 32) 8 + id % 8, k 4 ((id / 8) % 4) .. + 3 of the
// stage. (Consecutive threads write consecutive 16 bytes, and a warp's copies read 64 contiguous
// bytes of each of 8 rows.)
struct Chunk {
    uint32_t offset;
    int row, col;
};
__device__ __forceinline__ Chunk chunk_of(int id) {
    static_assert(GROUP == 4 * 128, "a row group is 4 chunks of 8 rows");
    return {static_cast<uint32_t>(16 * id), (id / 32) * 8 + id % 8, 4 * ((id / 8) % 4)};
}

__device__ __forceinline__ void span_grad_a(const float* __restrict__ g, const float* __restrict__ b,
                                            const uint32_t* __restrict__ spans, const uint8_t* __restrict__ mask,
                                            const uint8_t* __restrict__ plan, float* __restrict__ out, Problem p,
                                            SpanArgs sa) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const uint32_t shared = shared_address(shared_raw);
    const uint32_t raws = shared, splits = shared + STAGES * GA::RAW_BYTES;
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile = span_tile(blockIdx.x, spans, p, sa, row_tiles, col_tiles);
    const int64_t row0 = tile.row_tile * TILE;
    const SpanRange range = span_range(spans + tile.batch * sa.spans_batch_stride + 2 * tile.row_tile, p.k);

    const int tid = threadIdx.x, lane = tid % 32, warp = (tid % 128) / 32;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for the wgmma
    // This thread's copies: two chunks of g's rows (64 apart) and one of b's, of each stage.
    const Chunk chunks[3] = {chunk_of(tid), chunk_of(tid + THREADS), chunk_of(tid)};
    const int g_rows = static_cast<int>(min(p.m - row0, int64_t(TILE))), b_rows = static_cast<int>(min(p.n, int64_t(ROWS)));
    const float* chunk_src[3];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
        const Chunk c = chunks[q];
        chunk_src[q] = q < 2 ? g + tile.batch * p.a.batch_stride + (row0 + c.row) * p.a.outer_stride + range.k0 + c.col
                             : b + tile.batch * p.b.batch_stride + c.row * p.b.outer_stride + range.k0 + c.col;
    }
    SpanStates states(plan + tile.batch * sa.plan_batch_stride + tile.row_tile * sa.plan_col_tiles +
                          range.k0 / TILE,
                      1, sa.masked ? range.tiles : 0);
    // The mask's 16 bytes of a stage of row tid of the tile go to shared memory with the stage
    // when the tile is partial and the mask's rows allow 16-byte copies.
    const bool mask_copies = sa.masked && sa.mask_col_stride == 1 && sa.mask_row_stride % 16 == 0 &&
                             sa.mask_batch_stride % 16 == 0 && reinterpret_cast<uintptr_t>(mask) % 16 == 0;
    const uint8_t* mask_src = mask + tile.batch * sa.mask_batch_stride + (row0 + tid) * sa.mask_row_stride + range.k0;
    int issued = 0;
    auto issue = [&] {
        if (issued < range.stages) {
            const int k_left = stage_k_left(range, issued);
            const uint32_t raw = raws + (issued % STAGES) * GA::RAW_BYTES;
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                const Chunk c = chunks[q];
                const bool live = c.row < (q < 2 ? g_rows : b_rows);
                const int bytes = 4 * min(max(k_left - c.col, 0), 4);
                const uint32_t dst = raw + (q < 2 ? c.row : TILE + c.row) * GA::RAW_ROW + 4 * c.col;
                if (live && bytes > 0) cp_async16(dst, chunk_src[q] + int64_t(issued) * STAGE_K, bytes);
            }
            const uint8_t state = states.ahead(issued);
            if (mask_copies && state != FULL && state != EMPTY && tid < g_rows)
                cp_async16(raw + GA::MASK_OFF + 16 * tid, mask_src + int64_t(issued) * STAGE_K, k_left);
            ++issued;
        }
        cp_async_commit();
    };
    // b: this thread's chunk, split into the buffer (b has no mask).
    auto split_b = [&](int s, uint8_t, uint32_t split) {
        const Chunk c = chunks[2];
        const int k_left = stage_k_left(range, s);
        const unsigned char* raw = shared_raw + (s % STAGES) * GA::RAW_BYTES;
        uint32_t e[4] = {0u, 0u, 0u, 0u};
        if (c.row < b_rows && c.col < k_left) {
            const uint4 v = *reinterpret_cast<const uint4*>(raw + (TILE + c.row) * GA::RAW_ROW + 4 * c.col);
            e[0] = v.x, e[1] = v.y, e[2] = v.z, e[3] = v.w;
#pragma unroll
            for (int j = 1; j < 4; ++j)
                if (c.col + j >= k_left) e[j] = 0u;  // past the span's k
        }
        split_store(shared_raw + (split - shared), shared_raw + (split - shared) + GA::SPLIT_BYTES, c.offset, e);
    };
    // g: this thread's A fragments (rows 64 wg + 16 warp + lane / 4 + 8 h of the tile, k
    // lane % 4 + 4 j of the stage), masked and split.
    const int frag_row = wg * 64 + warp * 16 + lane / 4;
    const bool frag_live[2] = {frag_row < g_rows, frag_row + 8 < g_rows};
    const uint8_t* keep_at = mask + tile.batch * sa.mask_batch_stride + (row0 + frag_row) * sa.mask_row_stride +
                             (range.k0 + lane % 4) * sa.mask_col_stride;
    auto gather_a = [&](int s, uint8_t state, uint32_t (&big)[2][4], uint32_t (&small)[2][4]) {
        const int k_left = stage_k_left(range, s);
        const unsigned char* raw = shared_raw + (s % STAGES) * GA::RAW_BYTES;
        const uint8_t* keep = keep_at + int64_t(s) * STAGE_K * sa.mask_col_stride;
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int h = v % 2, k = lane % 4 + 4 * (2 * k8 + v / 2);
                bool live = frag_live[h] && k < k_left && state != EMPTY;
                if (live && state != FULL) {
                    if (mask_copies) live = raw[GA::MASK_OFF + 16 * (frag_row + 8 * h) + k] != 0;
                    else live = keep[h * 8 * sa.mask_row_stride + (k - lane % 4) * sa.mask_col_stride] != 0;
                }
                const uint32_t x = live ? *reinterpret_cast<const uint32_t*>(raw + (frag_row + 8 * h) * GA::RAW_ROW + 4 * k) : 0u;
                split_tf32(x, big[k8][v], small[k8][v]);
            }
        }
    };
    // Every warpgroup reads all of b's split stage.
    const uint64_t b_big0 = smem_desc(splits, 128, GROUP), b_small0 = smem_desc(splits + GA::SPLIT_BYTES, 128, GROUP);
    float acc[32];
    span_stages<GA::SPLIT_BYTES>(range.stages, states, splits, b_big0, b_small0, issue, split_b, gather_a, acc);
    store_wg_tile(acc, out + tile.batch * p.m * p.n, row0 + wg * 64, 0, p.m, p.n);
}

__device__ __forceinline__ void span_grad_b(const float* __restrict__ a_t, const float* __restrict__ g,
                                            const uint32_t* __restrict__ spans, const uint8_t* __restrict__ mask,
                                            const uint8_t* __restrict__ plan, float* __restrict__ out, Problem p,
                                            SpanArgs sa) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const uint32_t shared = shared_address(shared_raw);
    const uint32_t raws = shared, splits = shared + STAGES * GB::RAW_BYTES;
    const int64_t row_tiles = (p.m + TILE - 1) / TILE, col_tiles = (p.n + TILE - 1) / TILE;
    const TileIndex tile = span_tile(blockIdx.x, spans, p, sa, row_tiles, col_tiles);
    const int64_t col0 = tile.col_group * TILE;
    const SpanRange range = span_range(spans + tile.batch * sa.spans_batch_stride + 2 * tile.col_group, p.k);

    const int tid = threadIdx.x, lane = tid % 32, warp = (tid % 128) / 32;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for the wgmma
    // This thread's copies of each stage: a's row tid / 16 (columns 4 (tid % 16) ..) and g's
    // rows tid / 32 and 8 + tid / 32 (columns 4 (tid % 32) ..).
    const int a_row = tid / 16, a_col = 4 * (tid % 16), g_row = tid / 32, g_col = 4 * (tid % 32);
    const int a_bytes = 4 * static_cast<int>(min(max(p.m - a_col, int64_t(0)), int64_t(4)));
    const int g_bytes = 4 * static_cast<int>(min(max(p.n - col0 - g_col, int64_t(0)), int64_t(4)));
    const float* a_src = a_t + tile.batch * p.a.batch_stride + a_col + (range.k0 + a_row) * p.a.k_stride;
    const float* g_src = g + tile.batch * p.b.batch_stride + col0 + g_col + (range.k0 + g_row) * p.b.k_stride;
    SpanStates states(plan + tile.batch * sa.plan_batch_stride + (range.k0 / TILE) * sa.plan_col_tiles +
                          tile.col_group,
                      sa.plan_col_tiles, sa.masked ? range.tiles : 0);
    // The mask's 16 rows x 128 columns of a stage go to shared memory with it, row tid / 8,
    // columns 16 (tid % 8) .. of the tile from thread tid < 128, when the tile is partial and the
    // mask's rows allow 16-byte copies.
    const bool mask_copies = sa.masked && sa.mask_col_stride == 1 && sa.mask_row_stride % 16 == 0 &&
                             sa.mask_batch_stride % 16 == 0 && reinterpret_cast<uintptr_t>(mask) % 16 == 0;
    const int mask_row = tid / 8, mask_col = 16 * (tid % 8);
    const int mask_bytes = tid < TILE ? static_cast<int>(min(max(p.n - col0 - mask_col, int64_t(0)), int64_t(16))) : 0;
    const uint8_t* mask_src =
        mask + tile.batch * sa.mask_batch_stride + (range.k0 + mask_row) * sa.mask_row_stride + col0 + mask_col;
    int issued = 0;
    auto issue = [&] {
        if (issued < range.stages) {
            const int k_left = stage_k_left(range, issued);
            const uint32_t raw = raws + (issued % STAGES) * GB::RAW_BYTES, raw_g = raw + STAGE_K * GB::A_ROW;
            const int64_t step = int64_t(issued) * STAGE_K;
            if (a_row < k_left && a_bytes > 0)
                cp_async16(raw + a_row * GB::A_ROW + 4 * a_col, a_src + step * p.a.k_stride, a_bytes);
            if (g_bytes > 0) {
                const float* src = g_src + step * p.b.k_stride;
                if (g_row < k_left) cp_async16(raw_g + g_row * GB::G_ROW + 4 * g_col, src, g_bytes);
                if (g_row + 8 < k_left) cp_async16(raw_g + (g_row + 8) * GB::G_ROW + 4 * g_col, src + 8 * p.b.k_stride, g_bytes);
            }
            const uint8_t state = states.ahead(issued);
            if (mask_copies && state != FULL && state != EMPTY && mask_row < k_left && mask_bytes > 0)
                cp_async16(raw + GB::MASK_OFF + TILE * mask_row + mask_col, mask_src + step * sa.mask_row_stride,
                           mask_bytes);
            ++issued;
        }
        cp_async_commit();
    };
    // g: column gn of the tile, rows 4 kq .. 4 kq + 3 of the stage for kq = tid / TILE and
    // 2 + tid / TILE: two K-major chunks, masked and split.
    const int gn = tid % TILE, kq0 = tid / TILE;
    const bool gn_live = col0 + gn < p.n;
    const uint8_t* keep_at = mask + tile.batch * sa.mask_batch_stride + range.k0 * sa.mask_row_stride +
                             (col0 + gn) * sa.mask_col_stride;
    auto split_b = [&](int s, uint8_t state, uint32_t split) {
        const int k_left = gn_live && state != EMPTY ? stage_k_left(range, s) : 0;
        const unsigned char* raw_g = shared_raw + (s % STAGES) * GB::RAW_BYTES + STAGE_K * GB::A_ROW;
        const uint8_t* keep = keep_at + int64_t(s) * STAGE_K * sa.mask_row_stride;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int kq = kq0 + 2 * q;
            uint32_t e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 4 * kq + i;
                bool live = r < k_left;
                if (live && state != FULL) {
                    if (mask_copies) live = raw_g[GB::MASK_OFF - STAGE_K * GB::A_ROW + TILE * r + gn] != 0;  // the mask rows
                    else live = keep[r * sa.mask_row_stride] != 0;
                }
                e[i] = live ? *reinterpret_cast<const uint32_t*>(raw_g + r * GB::G_ROW + 4 * gn) : 0u;
            }
            split_store(shared_raw + (split - shared), shared_raw + (split - shared) + GB::SPLIT_BYTES,
                        (gn / 8) * GROUP + kq * 128 + (gn % 8) * 16, e);
        }
    };
    // aᵀ: this thread's A fragments (a's columns 16 warp + lane / 4 + 8 h, its rows lane % 4 +
    // 4 j of the stage), split.
    const int frag_col = warp * 16 + lane / 4;
    const bool frag_live[2] = {frag_col < p.m, frag_col + 8 < p.m};
    auto gather_a = [&](int s, uint8_t, uint32_t (&big)[2][4], uint32_t (&small)[2][4]) {
        const int k_left = stage_k_left(range, s);
        const unsigned char* raw = shared_raw + (s % STAGES) * GB::RAW_BYTES;
#pragma unroll
        for (int k8 = 0; k8 < 2; ++k8) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int h = v % 2, r = lane % 4 + 4 * (2 * k8 + v / 2);
                const uint32_t x = frag_live[h] && r < k_left
                                       ? *reinterpret_cast<const uint32_t*>(raw + r * GB::A_ROW + 4 * (frag_col + 8 * h))
                                       : 0u;
                split_tf32(x, big[k8][v], small[k8][v]);
            }
        }
    };
    // This warpgroup's 64 columns of g's split stage.
    const uint64_t b_big0 = smem_desc(splits + wg * 8 * GROUP, 128, GROUP),
                   b_small0 = smem_desc(splits + GB::SPLIT_BYTES + wg * 8 * GROUP, 128, GROUP);
    float acc[32];
    span_stages<GB::SPLIT_BYTES>(range.stages, states, splits, b_big0, b_small0, issue, split_b, gather_a, acc);
    store_wg_tile(acc, out + tile.batch * p.m * p.n, 0, col0 + wg * 64, p.m, p.n);
}

}  // namespace

// `span_grad_a_sm90_tf32x3_f32(g, b, spans, mask, plan, out, problem, span_args)`: the arguments
// of the portable `span_matmul_*` (a = g, b = bᵀ as the problem's operands, spans by row tile).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    span_grad_a_sm90_tf32x3_f32(const float* g, const float* b, const uint32_t* spans, const uint8_t* mask,
                                const uint8_t* plan, float* out, Problem p, SpanArgs sa) {
    span_grad_a(g, b, spans, mask, plan, out, p, sa);
}

// `span_grad_b_sm90_tf32x3_f32(a_t, g, spans, mask, plan, out, problem, span_args)`: the same for
// grad_b (a = aᵀ, b = g as the problem's operands, spans by column tile).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    span_grad_b_sm90_tf32x3_f32(const float* a_t, const float* g, const uint32_t* spans, const uint8_t* mask,
                                const uint8_t* plan, float* out, Problem p, SpanArgs sa) {
    span_grad_b(a_t, g, spans, mask, plan, out, p, sa);
}
