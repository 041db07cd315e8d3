// masked_attention: FlashAttention-2's algorithm (an online softmax over key tiles; a backward
// that recomputes the probabilities from the saved log-sum-exp) with the tiles a mask hides
// skipped and the tiles it keeps whole taken without per-element masking.
//
// Tensor-core kernels (f16 / bf16 operands, f32 accumulation and softmax statistics, mma.sync
// m16n8k16, sm_80 and up): a block of WARPS warps takes query_tiles<D>() mask tiles of 64 queries
// (forward, dq; a warp 16 or 32 rows of them, in key chunks of FORWARD_CHUNK / dq_chunk<D>()) or
// one tile of 64 keys (dk / dv; a warp 16 keys). Head dims are padded with zeros to D (64, 128 or
// 256) in shared memory; the host pads the operands to a multiple of 8 and needs unit column strides and
// 16-byte aligned rows. Probabilities and score gradients are rounded to the operand type before
// their products (as FlashAttention does); everything else stays f32.
// f32 kernels: a warp per query or key row, exact f32 FMA (no tensor cores).
// The backward is two kernels, dq (per query tile, over key tiles) and dk / dv (per key tile, over
// the query tiles of every query head of its group): no atomics, identical bits run to run; or,
// at head tile 128 where the host picks it, one kernel (bwd_tc) that adds dq with float atomics
// (then dq_rows, attention_common.cuh, turns the sum into dq). Each tensor-core kernel has an
// instance per mask family (generated, runs, stored: MaskFamily, attention_common.cuh).
// The delta row kernel serves the Hopper backward (sm90/attention.cu) and the one-pass one.
#include "attention_common.cuh"

using namespace fastops;

namespace {

constexpr int THREADS = AC::WARPS * 32;
constexpr int ROW_WARPS = AC::ROW_WARPS;
static_assert(BQ == AC::WARPS * 16 && BK == AC::WARPS * 16, "a warp per 16 rows of a tile");
static_assert(BK == 64, "a warp's score tile is 16 x 64: 8 accumulator tiles, 4 k-steps of P");

// The backward kernels' operands, in the order of their one argument list; a pass leaves alone
// what it does not write (dq_tc writes delta and dq, dkdv_tc dk and dv, delta_rows delta).
template <typename T> struct BackwardOperands {
    const T* q;
    const T* k;
    const T* v;
    const T* grad_out;
    const T* out;
    const float* lse;
    float* delta;
    T* dq;
    T* dk;
    T* dv;
    const uint8_t* states;
    const uint8_t* dense;
    const int64_t* ids;
};


// Issues the asynchronous copies (cp_async4) of the log-sum-exps and deltas of rows row0 ..
// row0 + BQ - 1 of a [b, h, m] statistic into s_lse / s_delta, zeros for the rows at or past
// `rows` (past m). Read the log-sum-exps through row_lse2, and only where the mask is read for
// rows past m: their stored 0 gives probability exp2(0) = 1 before the mask hides them (their Q
// and dO rows are zero, and a tile that reaches past m is never full).
template <int NTHREADS>
__device__ __forceinline__ void load_row_stats(float* s_lse, float* s_delta, const float* lse, const float* delta,
                                               int64_t row0, int64_t rows) {
    for (int r = threadIdx.x; r < BQ; r += NTHREADS) {
        const bool valid = r < rows;
        const int64_t at = valid ? row0 + r : 0;
        cp_async4(shared_address(s_lse + r), lse + at, valid ? 4 : 0);
        cp_async4(shared_address(s_delta + r), delta + at, valid ? 4 : 0);
    }
}
// A stored natural log-sum-exp as the backward uses it: log2 units, +inf for a row that sees no key
// (lse -inf), so that exp2(x - it) is 0.
__device__ __forceinline__ float row_lse2(float stored) { return stored == -INFINITY ? INFINITY : stored * LOG2E; }

// row_lse2 of row `row` of `lse` read from global memory; +inf for a row past m (`valid` false).
__device__ __forceinline__ float lse_log2(const float* lse, int64_t row, bool valid) {
    return valid ? row_lse2(lse[row]) : INFINITY;
}

// ---- Tensor-core pieces. A warp's accumulator tile of 16 rows x 8 columns holds, in lane
// (g = lane / 4, t = lane % 4), rows g and g + 8, columns 2t and 2t + 1: element r of the four
// is at row g + (r / 2) * 8, column 2t + (r % 2).

// Shared-tile layouts: L::at(row, col) is the element offset of (row, col), col a multiple of 8
// wherever 16 bytes are read or copied at once. Padded<LD>: rows LD elements apart (LD - width
// elements of padding put the eight rows one ldmatrix phase reads in eight different bank groups).
// Swizzled128: rows of 128 16-bit elements with no padding, the 16-byte chunk c of row r stored at
// chunk c ^ (r % 8), which spreads those eight rows over the banks the same way (and one 128-byte
// phase of a cp.async row copy over all 32 banks).
template <int LD> struct Padded {
    __host__ __device__ __forceinline__ static constexpr int at(int row, int col) { return row * LD + col; }
};
struct Swizzled128 {
    __host__ __device__ __forceinline__ static constexpr int at(int row, int col) {
        return row * 128 + (col ^ ((row & 7) << 3));
    }
};
// The layout of the kernels' padded tiles of head dim D.
template <int D> using RowPadded = Padded<D + AC::ROW_PAD>;

// x, opaque to the optimizer: what is computed from it is computed again after this point instead
// of being carried in registers from before it (a swizzled tile's ldmatrix addresses, one per
// k-step and lane, would otherwise be hoisted out of the item loop and pinned in registers).
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// Copies rows [0, rows) and columns [0, cols) (cols a multiple of 8) of a row-major global tile
// into a ROWS x D shared tile of layout L; the rest of the shared tile becomes zero.
// A thread copies one 16-byte column chunk of every (THREADS / (D / 8))-th row, so that its
// addresses advance by constants: one bounds test per copy, none in a whole tile.
template <typename T, int D, int ROWS = 64, int NTHREADS = THREADS, class L = RowPadded<D>>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int64_t rows, int64_t cols) {
    constexpr int CHUNKS = D / 8, ROW_STEP = NTHREADS / CHUNKS, PASSES = ROWS / ROW_STEP;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "whole rows per pass, whole passes per tile");
    const int r0 = threadIdx.x / CHUNKS, col = (threadIdx.x % CHUNKS) * 8;
    // Rows this thread copies: r0 + ROW_STEP * pass for pass < live (0 past the operand's columns).
    const int64_t live_rows = col < cols ? min(rows, static_cast<int64_t>(ROWS)) - r0 : 0;
    const T* from = src + r0 * row_stride + col;
    const uint32_t to = shared_address(tile + L::at(r0, col));
    // Pass `pass`'s row through the layout, as an offset from `to` (a constant step for Padded).
    auto to_row = [&](int pass) {
        return to + (L::at(r0 + pass * ROW_STEP, col) - L::at(r0, col)) * static_cast<int>(sizeof(T));
    };
    const int64_t step = ROW_STEP * row_stride;
    if (live_rows > ROWS - ROW_STEP) {
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) cp_async16(to_row(pass), from + pass * step, 16);
    } else {
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
            const bool valid = pass * ROW_STEP < live_rows;
            cp_async16(to_row(pass), valid ? from + pass * step : src, valid ? 16 : 0);
        }
    }
}

// load_tile's inverse: copies rows [0, rows) and columns [0, cols) (cols a multiple of 8) of a
// ROWS x D shared tile of layout L into a row-major global tile (16-byte aligned rows), 16 bytes a
// thread.
template <typename T, int D, int ROWS, int NTHREADS, class L = RowPadded<D>>
__device__ __forceinline__ void store_tile(T* dst, int64_t row_stride, const T* tile, int64_t rows, int64_t cols) {
    constexpr int CHUNKS = D / 8, ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "whole rows per pass, whole passes per tile");
    const int r0 = threadIdx.x / CHUNKS, col = (threadIdx.x % CHUNKS) * 8;
    if (col >= cols) return;
#pragma unroll
    for (int r = r0; r < ROWS; r += ROW_STEP)
        if (r < rows)
            *reinterpret_cast<uint4*>(dst + r * row_stride + col) = *reinterpret_cast<const uint4*>(tile + L::at(r, col));
}

// A fragment (16 rows from r0 x 16 columns from k0) of a row-major [row][k] shared tile.
template <typename T, class L>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
    ldmatrix_x4<false>(a, shared_address(tile + L::at(r0 + (lane & 15), k0 + (lane >> 4) * 8)));
}

// The same fragment from a shared tile stored [k][row] (columns r0.., rows k0..).
template <typename T, class L>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
    ldmatrix_x4<true>(a, shared_address(tile + L::at(k0 + (lane & 7) + (lane >> 4) * 8, r0 + ((lane >> 3) & 1) * 8)));
}

// B fragments of two 8-column tiles (n0 and n0 + 8; b[0..1] and b[2..3]), k from k0, of a shared
// tile stored [n][k].
template <typename T, class L>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const T* tile, int n0, int k0, int lane) {
    ldmatrix_x4<false>(b, shared_address(tile + L::at(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8)));
}

// The same from a shared tile stored [k][n].
template <typename T, class L>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const T* tile, int k0, int n0, int lane) {
    ldmatrix_x4<true>(b, shared_address(tile + L::at(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8)));
}

// Calls fn(f, nt, r) for every element r of every fragment (f, nt) of MF x NT accumulator fragments.
template <int MF, int NT, class Fn> __device__ __forceinline__ void for_each_entry(Fn&& fn) {
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) fn(f, nt, r);
}

// Sets every accumulator of MF x NT fragments to zero.
template <int MF, int NT>
__device__ __forceinline__ void zero_fragments(float (&acc)[MF][NT][4]) {
    for_each_entry<MF, NT>([&](int f, int nt, int r) { acc[f][nt][r] = 0.f; });
}

// acc (16 MF x 8 NT) = rows r0.. (MF fragments of 16) of `a_tile` . rows n0.. (8 NT) of
// `b_tile`ᵀ, over all K columns. Each B fragment serves all MF row fragments. Both tiles come from
// load_tile, which zero-fills the columns past the operands' own (d or dv below K), so those add
// exact zeros: a head dim below the kernel's K costs K's time. The loop has no per-step bound
// test, so that ptxas can issue the next step's ldmatrix before this step's mma.
template <typename T, int K, class L, int MF, int NT>
__device__ __forceinline__ void product_abt(float (&acc)[MF][NT][4], const T* a_tile, int r0, const T* b_tile, int n0,
                                            int lane) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of 8-column tiles");
    zero_fragments(acc);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t a[MF][4];
#pragma unroll
        for (int f = 0; f < MF; ++f) load_a<T, L>(a[f], a_tile, r0 + 16 * f, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            load_b<T, L>(b, b_tile, n0 + np * 16, kk * 16, lane);
#pragma unroll
            for (int f = 0; f < MF; ++f) {
                mma_m16n8k16<T>(acc[f][2 * np], a[f], b[0], b[1]);
                mma_m16n8k16<T>(acc[f][2 * np + 1], a[f], b[2], b[3]);
            }
        }
    }
}

// acc1 = rows r0.. of a1 . rows n0.. of b1ᵀ and acc2 the same of a2 and b2 (16 x 8 NT each, as
// product_abt with MF = 1), each k-step issuing the mma of both: twice the independent
// accumulators of one product, for the tensor cores' latency.
template <typename T, int K, class L, int NT>
__device__ __forceinline__ void product_abt_pair(float (&acc1)[1][NT][4], const T* a1, const T* b1,
                                                 float (&acc2)[1][NT][4], const T* a2, const T* b2, int r0, int n0,
                                                 int lane) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of 8-column tiles");
    zero_fragments(acc1);
    zero_fragments(acc2);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t x1[4], x2[4];
        load_a<T, L>(x1, a1, r0, kk * 16, lane);
        load_a<T, L>(x2, a2, r0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t y1[4], y2[4];
            load_b<T, L>(y1, b1, n0 + np * 16, kk * 16, lane);
            load_b<T, L>(y2, b2, n0 + np * 16, kk * 16, lane);
            mma_m16n8k16<T>(acc1[0][2 * np], x1, y1[0], y1[1]);
            mma_m16n8k16<T>(acc2[0][2 * np], x2, y2[0], y2[1]);
            mma_m16n8k16<T>(acc1[0][2 * np + 1], x1, y1[2], y1[3]);
            mma_m16n8k16<T>(acc2[0][2 * np + 1], x2, y2[2], y2[3]);
        }
    }
}

// acc (16 MF x N) += p (16 MF x 16 KS, A fragments) . rows k0.. (16 KS) of `b_tile` (stored
// [k][n]), over all N columns (zero past the operand's own, as in product_abt).
template <typename T, int N, class L, int MF, int KS>
__device__ __forceinline__ void product_pb(float (&acc)[MF][N / 8][4], const uint32_t (&p)[MF][KS][4],
                                           const T* b_tile, int k0, int lane) {
#pragma unroll
    for (int dt = 0; dt < N / 16; ++dt) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            uint32_t b[4];
            load_b_trans<T, L>(b, b_tile, k0 + kk * 16, dt * 16, lane);
#pragma unroll
            for (int f = 0; f < MF; ++f) {
                mma_m16n8k16<T>(acc[f][2 * dt], p[f][kk], b[0], b[1]);
                mma_m16n8k16<T>(acc[f][2 * dt + 1], p[f][kk], b[2], b[3]);
            }
        }
    }
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    uint32_t r;
    from_float2<T>(reinterpret_cast<T*>(&r), x, y);
    return r;
}

// The A fragments (16 x 16 KS, KS k-steps of 16) of an accumulator tile, rounded to T.
template <typename T, int KS>
__device__ __forceinline__ void to_a_fragments(uint32_t (&p)[KS][4], const float (&s)[2 * KS][4]) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        p[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        p[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        p[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        p[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// Writes rows [0, 16) of a warp's accumulator (times `factor`) to rows row0.. of an output of
// row stride `row_stride` (unit column stride), rows below `rows` and columns below `cols` only.
template <typename T, int N>
__device__ __forceinline__ void store_rows(T* out, int64_t row_stride, const float (&acc)[N / 8][4], int64_t row0,
                                           int64_t rows, int64_t cols, float factor0, float factor1, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t row = row0 + g + half * 8;
        if (row >= rows) continue;
        const float f = half ? factor1 : factor0;
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            if (col < cols) from_float2<T>(out + row * row_stride + col, acc[nt][2 * half] * f, acc[nt][2 * half + 1] * f);
        }
    }
}

enum class Pass { Forward, Dq, Dkdv };

// Mask tiles of 64 queries per block of the query-tile kernels (forward, dq): two up to D = 128,
// where a warp takes 32 rows so that each K / V fragment it reads from shared memory serves two
// row fragments; one at D = 256, for register room. Mirrored by the host's launch code.
template <int D> __host__ __device__ constexpr int query_tiles() { return D > 128 ? 1 : 2; }

// Pipeline stages of the streamed operands (K / V, or Q / dO for dk / dv): one where two would keep
// a second block off the SM (dq at D = 128) or overflow sm_80's 163 KiB (D = 256), two otherwise.
// Shared tiles are 64 x (D + ROW_PAD) elements each. Mirrored by the host's `shared_bytes`.
template <int D> __host__ __device__ constexpr int stages(Pass pass) {
    return (D > 128 || (D == 128 && pass == Pass::Dq)) ? 1 : 2;
}
template <typename T, int D> __host__ __device__ constexpr int tile_elements() { return 64 * (D + AC::ROW_PAD); }

// The software pipeline of every tensor-core kernel: `load(item, stage)` issues a stage's
// asynchronous copies, `work(item, stage)` consumes it; `next(item)` is the next item to do
// (>= end when none). With two stages the copies of the next item overlap the work on this one,
// issued either before this item's copies are waited for, with a second barrier after the work
// (every warp has left the stage they fill), or, ONE_BARRIER, right after the one barrier an item:
// every warp has then left the previous item's work, the last reader of the other stage
// (ONE_BARRIER_PIPELINE picks the instances). One stage: the copies wait for the barrier after
// the work. Returns with every copy landed, but warps may still be in their last work: a caller
// that reuses the stages after it needs a barrier.
template <int STAGES, bool ONE_BARRIER = false, class Next, class Load, class Work>
__device__ __forceinline__ void pipeline(int64_t first, int64_t end, Next&& next, Load&& load, Work&& work) {
    static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
    static_assert(STAGES == 2 || !ONE_BARRIER, "one barrier an item takes two stages");
    int64_t item = first;
    if (item < end) load(item, 0);
    cp_async_commit();
    int stage = 0;
    while (item < end) {
        const int64_t following = next(item);
        if constexpr (ONE_BARRIER) {
            cp_async_wait<0>();
            __syncthreads();
            if (following < end) load(following, stage ^ 1);
            cp_async_commit();
            work(item, stage);
            stage ^= 1;
        } else {
            if constexpr (STAGES == 2) {
                if (following < end) load(following, stage ^ 1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            work(item, stage);
            __syncthreads();
            if constexpr (STAGES == 1) {
                if (following < end) load(following, 0);
                cp_async_commit();
            } else {
                stage ^= 1;
            }
        }
        item = following;
    }
    cp_async_wait<0>();
}

// Whether a kernel instance's pipeline of S stages takes one barrier an item: the generated
// masks' two-stage pipelines (the runs and stored instances spill registers with it).
template <int S, int MASKS> constexpr bool ONE_BARRIER_PIPELINE = S == 2 && MASKS == FORMULA;


// The pipeline of work whose items come in two halves around one barrier: `produce(item, stage,
// buffer)` writes the item's block-wide scratch buffer `buffer` (of two) from its stage, and
// `consume(item, stage, buffer)` reads every warp's scratch and the stage again. One barrier an
// item, between the halves: before it each thread waits for its copies of the next item, after
// it the item after that is issued into the stage the previous item used (every warp has left
// that item's consume, the last reader of the stage and of the other scratch buffer). So the copies
// of an item have a consume and a produce to land in, and STAGES is 3.
template <int STAGES, class Next, class Load, class Produce, class Consume>
__device__ __forceinline__ void pipeline_one_barrier(int64_t first, int64_t end, Next&& next, Load&& load,
                                                     Produce&& produce, Consume&& consume) {
    static_assert(STAGES == 3, "items i, i + 1 and i + 2 in flight");
    int64_t item = first, following = end;
    if (item < end) {
        load(item, 0);
        following = next(item);
    }
    cp_async_commit();
    if (following < end) load(following, 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    int stage = 0, buffer = 0;
    while (item < end) {
        produce(item, stage, buffer);
        cp_async_wait<0>();
        __syncthreads();
        const int64_t after = following < end ? next(following) : end;
        if (after < end) load(after, stage == 0 ? 2 : stage - 1);
        cp_async_commit();
        consume(item, stage, buffer);
        stage = stage == 2 ? 0 : stage + 1;
        buffer ^= 1;
        item = following;
        following = after;
    }
    cp_async_wait<0>();
}

// Keys per chunk of a key tile in the query-tile kernels: the score registers of a warp are
// 16 MF x KEY_CHUNK.
constexpr int KEY_CHUNK = 32;
constexpr int CHUNK_TILES = KEY_CHUNK / 8, CHUNK_STEPS = KEY_CHUNK / 16;

// The forward's key chunk: the whole key tile, so that each Q fragment a warp reads from shared
// memory serves 64 keys (its o and score registers, 16 MF x (D + 64), still fit at every D).
constexpr int FORWARD_CHUNK = BK;

// The dq kernel's key chunk: a whole key tile at D = 64, where the S and dP registers of a whole
// tile fit beside dq's, KEY_CHUNK above. (dk / dv keep KEY_CHUNK queries a chunk: a whole tile
// there takes them from 168 to 231 registers at D = 64, and measured slower.)
template <int D> __host__ __device__ constexpr int dq_chunk() { return D > 64 ? KEY_CHUNK : BK; }

// The word holding a bit per score of a chunk (stored masks' partial tiles): 32 or 64 bits.
template <bool WIDE> struct KeepWord {
    using type = uint32_t;
};
template <> struct KeepWord<true> {
    using type = uint64_t;
};

// The block of a query-tile kernel (forward, dq): its batch entry, head and MF mask tiles of 64
// queries (the longest rows first, for causal masks), the walk over the key tiles the mask leaves
// to any of them, and the state of each warp's own mask tile (a warp's 16 MF rows lie in one).
// MASKS: the MaskFamily of the kernel instance; L: the layout of the shared Q, K and V tiles.
template <typename T, int D, int MASKS, class L = RowPadded<D>> struct QueryTile {
    static constexpr int MF = query_tiles<D>(), WARP_ROWS = 16 * MF;
    const AttentionArgs& a;
    KernelMask<MASKS> mask;
    int64_t qt0, warp_qt, bh, b, h, i0, rows;
    int64_t kt_first, kt_last;  // generated masks: the key tiles any query of the block may see
    const T* q_tile;
    const T* k_head;
    const T* v_head;

    __device__ __forceinline__ QueryTile(const AttentionArgs& a_, const T* q, const T* k, const T* v,
                                         const uint8_t* states, const uint8_t* dense, const int64_t* ids)
        : a(a_), mask{{a_, states, dense, ids, 0}} {
        const int64_t heads_total = a.batch * a.heads, block = blockIdx.x;
        const int64_t row_blocks = (a.row_tiles + MF - 1) / MF;
        qt0 = (row_blocks - 1 - block / heads_total) * MF;
        warp_qt = qt0 + (threadIdx.x >> 5) * WARP_ROWS / BQ;
        bh = block % heads_total;
        b = bh / a.heads;
        h = bh % a.heads;
        const int64_t hk = h / (a.heads / a.kv_heads);
        mask.view.b = b;
        i0 = qt0 * BQ;
        rows = min(static_cast<int64_t>(BQ * MF), a.m - i0);
        mask.key_tiles(i0, i0 + rows - 1, kt_first, kt_last);
        q_tile = q + b * a.q_strides[0] + h * a.q_strides[1] + i0 * a.q_strides[2];
        k_head = k + b * a.k_strides[0] + hk * a.k_strides[1];
        v_head = v + b * a.v_strides[0] + hk * a.v_strides[1];
    }

    // The first key tile after kt that the mask leaves to any query tile of the block (col_tiles
    // when none; for a generated mask, possibly a tile that turns out empty); next(-1) is the first
    // of all. Called by every thread.
    __device__ __forceinline__ int64_t next(int64_t kt) const {
        if (mask.generated()) {
            const int64_t c = max(kt + 1, kt_first);
            return c <= kt_last ? c : a.col_tiles;
        }
        return next_live(kt, a.col_tiles, [&](int64_t c) {
            bool live = false;
#pragma unroll
            for (int f = 0; f < MF; ++f)
                live |= qt0 + f < a.row_tiles && mask.tile_state(h, qt0 + f, c) != TILE_EMPTY;
            return live;
        });
    }

    // The state of key tile kt for this warp's rows (empty past the last query tile).
    __device__ __forceinline__ uint8_t warp_state(int64_t kt) const {
        return warp_qt < a.row_tiles ? mask.tile_state(h, warp_qt, kt) : TILE_EMPTY;
    }

    // A warp's scores for key chunk c of key tile kt (rows from row0, its tile q_rows from shared
    // row r0 of sq; sk the stage holding tile kt): s = value(q . kᵀ, f, r) entrywise for row
    // fragment f and accumulator element r, and `hidden` where the mask of a partial tile hides
    // the key.
    template <int CHUNK, class Value>
    __device__ __forceinline__ void chunk_scores(float (&s)[MF][CHUNK / 8][4], const T* sq, int r0, const T* sk,
                                                 int64_t kt, int c, bool partial, int64_t row0, int lane,
                                                 Value&& value, float hidden) const {
        constexpr int NT = CHUNK / 8;
        product_abt<T, D, L, MF, NT>(s, sq, r0, sk, c * CHUNK, lane);
#pragma unroll
        for (int f = 0; f < MF; ++f)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) s[f][nt][r] = value(s[f][nt][r], f, r);
        // Full tiles (most of them) skip the mask entirely: a separate, warp-uniform branch. Read
        // into a bit per entry first, the mask's index arithmetic is not live beside the scores.
        if (partial && mask.generated()) {
            const int g = lane >> 2, t = lane & 3;
            const int64_t j0 = kt * BK + c * CHUNK;
#pragma unroll
            for (int f = 0; f < MF; ++f)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    int lo, hi;
                    mask.key_run(row0 + 16 * f + g + half * 8, j0, CHUNK, lo, hi);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = nt * 8 + 2 * t + e;
                            if (col < lo || col > hi) s[f][nt][2 * half + e] = hidden;
                        }
                }
        } else if (partial) {
            static_assert(MF * NT * 4 <= 64, "a bit per score of the chunk in one word");
            using Bits = typename KeepWord<(MF * NT * 4 > 32)>::type;
            const int g = lane >> 2, t = lane & 3;
            const int64_t j0 = kt * BK + c * CHUNK;
            Bits keep = 0;
            for_each_entry<MF, NT>([&](int f, int nt, int r) {
                if (mask.keeps(h, row0 + 16 * f + g + (r >> 1) * 8, j0 + nt * 8 + 2 * t + (r & 1)))
                    keep |= Bits(1) << (f * NT * 4 + nt * 4 + r);
            });
            for_each_entry<MF, NT>([&](int f, int nt, int r) {
                if (!(keep >> (f * NT * 4 + nt * 4 + r) & 1u)) s[f][nt][r] = hidden;
            });
        }
    }

    __device__ __forceinline__ void load_kv(int64_t kt, T* sk, T* sv) const {
        const int64_t j0 = kt * BK, keys = min(static_cast<int64_t>(BK), a.n - j0);
        load_tile<T, D, 64, THREADS, L>(sk, k_head + j0 * a.k_strides[2], a.k_strides[2], keys, a.d);
        load_tile<T, D, 64, THREADS, L>(sv, v_head + j0 * a.v_strides[2], a.v_strides[2], keys, a.dv);
    }

    // Streams the key tiles the block needs through S stages of shared K / V tiles (sk, sv: S
    // tiles each) and calls chunk(kt, c, partial, k_tile, v_tile) for every chunk c of the tiles
    // this warp's rows need (partial: whether the mask must be read).
    template <int S, int CHUNK, class Chunk>
    __device__ __forceinline__ void for_each_key_chunk(T* sk, T* sv, Chunk&& chunk) const {
        constexpr int E = tile_elements<T, D>();
        auto step = [&](int64_t kt) { return next(kt); };
        auto load = [&](int64_t kt, int stage) { load_kv(kt, sk + stage * E, sv + stage * E); };
        auto work = [&](int64_t kt, int stage) {
            const uint8_t state = warp_state(kt);
            if (state == TILE_EMPTY) return;
#pragma unroll(D > 64 ? 1 : BK / CHUNK)
            for (int c = 0; c < BK / CHUNK; ++c) chunk(kt, c, state != TILE_FULL, sk + stage * E, sv + stage * E);
        };
        pipeline<S, ONE_BARRIER_PIPELINE<S, MASKS>>(next(-1), a.col_tiles, step, load, work);
    }
};

// The forward's shared-tile layout: swizzled for the generated masks at D = 128 (fewer registers
// spilled there), padded elsewhere (the runs instance spills when swizzled). The tiles keep the
// padded size either way (the host's shared_bytes).
template <int D, int MASKS>
using ForwardLayout = std::conditional_t<D == 128 && MASKS == FORMULA, Swizzled128, RowPadded<D>>;

// The maximum of a warp fragment row's entries of one half (rows g or g + 8: elements 2 half,
// 2 half + 1 of each of the NT tiles) by a tree of depth log2(2 NT), not a chain of 2 NT.
template <int NT> __device__ __forceinline__ float half_max(const float (&x)[NT][4], int half) {
    static_assert((NT & (NT - 1)) == 0, "NT a power of two");
    float m[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) m[nt] = fmaxf(x[nt][2 * half], x[nt][2 * half + 1]);
#pragma unroll
    for (int width = NT / 2; width > 0; width /= 2)
#pragma unroll
        for (int i = 0; i < width; ++i) m[i] = fmaxf(m[i], m[i + width]);
    return m[0];
}

template <typename T, int D, int MASKS>
__device__ __forceinline__ void forward_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                           T* __restrict__ out, float* __restrict__ lse, const uint8_t* states,
                                           const uint8_t* dense, const int64_t* ids, const AttentionArgs& a) {
    constexpr int S = stages<D>(Pass::Forward), E = tile_elements<T, D>();
    constexpr int MF = query_tiles<D>(), CHUNK = FORWARD_CHUNK, NT = CHUNK / 8;
    using L = ForwardLayout<D, MASKS>;
    extern __shared__ uint4 shared_raw[];
    T* sq = reinterpret_cast<T*>(shared_raw);  // MF tiles
    T* sk = sq + MF * E;                        // S stages
    T* sv = sq + (MF + S) * E;                  // S stages
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const QueryTile<T, D, MASKS, L> tile(a, q, k, v, states, dense, ids);
    const int64_t bh = tile.bh, row0 = tile.i0 + warp * 16 * MF;
    load_tile<T, D, 64 * MF, THREADS, L>(sq, tile.q_tile, a.q_strides[2], tile.rows, a.d);

    float o[MF][D / 8][4];
    zero_fragments(o);
    float row_max[MF][2], row_sum[MF][2];
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row_max[f][half] = -INFINITY;
            row_sum[f][half] = 0.f;
        }

    tile.template for_each_key_chunk<S, CHUNK>(sk, sv, [&](int64_t kt, int c, bool partial, const T* k_tile,
                                                          const T* v_tile) {
            float s[MF][NT][4];
            // Raw scores q . k: scale_log2 > 0 (the host makes it so), so the row maxima scale
            // with it and the exponents take it in one multiply-add.
            tile.template chunk_scores<CHUNK>(s, sq, warp * 16 * MF, k_tile, kt, c, partial, row0, lane,
                                              [&](float x, int, int) { return x; }, -INFINITY);
            // The reference of a row's exponents (row_max, log2 units) moves only when a score
            // passes it by more than RESCALE_SLACK, so most chunks leave o unscaled (one
            // warp-uniform test).
            float alpha[MF][2];
            bool moved = false;
#pragma unroll
            for (int f = 0; f < MF; ++f) {
                const float tile_max[2] = {half_max<NT>(s[f], 0), half_max<NT>(s[f], 1)};
                float base[2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float seen = quad_max(tile_max[half]) * a.scale_log2, old_max = row_max[f][half];
                    const float new_max = seen > old_max + RESCALE_SLACK ? seen : old_max;
                    base[half] = new_max == -INFINITY ? 0.f : new_max;
                    alpha[f][half] = exp2f(old_max - base[half]);
                    moved |= new_max != old_max;
                    row_max[f][half] = new_max;
                    row_sum[f][half] *= alpha[f][half];
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const float p = exp2f(fmaf(s[f][nt][r], a.scale_log2, -base[r >> 1]));
                        s[f][nt][r] = p;
                        row_sum[f][r >> 1] += p;
                    }
            }
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int f = 0; f < MF; ++f)
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                        for (int r = 0; r < 4; ++r) o[f][nt][r] *= alpha[f][r >> 1];
            }
            uint32_t p[MF][CHUNK / 16][4];
#pragma unroll
            for (int f = 0; f < MF; ++f) to_a_fragments<T, CHUNK / 16>(p[f], s[f]);
            product_pb<T, D, L, MF, CHUNK / 16>(o, p, v_tile, c * CHUNK, lane);
    });

#pragma unroll
    for (int f = 0; f < MF; ++f) {
        float inv[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float sum = quad_sum(row_sum[f][half]);
            inv[half] = sum > 0.f ? 1.f / sum : 0.f;
            const int64_t row = row0 + 16 * f + g + half * 8;
            if (t == 0 && row < a.m) lse[bh * a.m + row] = sum > 0.f ? (row_max[f][half] + log2f(sum)) * LN2 : -INFINITY;
        }
        store_rows<T, D>(out + row_offset(a.o_strides, tile.b, tile.h, 0), a.o_strides[2], o[f], row0 + 16 * f, a.m,
                         a.dv, inv[0], inv[1], lane);
    }
}

// dq = scale * sum over keys of dS K, dS = P * (dO Vᵀ - delta), per query tile; delta = rowsum(dO * O)
// (in f32 from the operand type), which the dk / dv pass reads, is written here.
template <typename T, int D, int MASKS>
__device__ __forceinline__ void dq_tc(const BackwardOperands<T>& ops, const AttentionArgs& a) {
    constexpr int S = stages<D>(Pass::Dq), E = tile_elements<T, D>();
    constexpr int MF = query_tiles<D>(), CHUNK = dq_chunk<D>(), NT = CHUNK / 8;
    extern __shared__ uint4 shared_raw[];
    T* sq = reinterpret_cast<T*>(shared_raw);  // MF tiles
    T* sdo = sq + MF * E;                       // MF tiles
    T* sk = sq + 2 * MF * E;                    // S stages
    T* sv = sq + (2 * MF + S) * E;              // S stages
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const QueryTile<T, D, MASKS> tile(a, ops.q, ops.k, ops.v, ops.states, ops.dense, ops.ids);
    const int64_t bh = tile.bh, row0 = tile.i0 + warp * 16 * MF;
    load_tile<T, D, 64 * MF>(sq, tile.q_tile, a.q_strides[2], tile.rows, a.d);
    load_tile<T, D, 64 * MF>(sdo, ops.grad_out + row_offset(a.o_strides, tile.b, tile.h, tile.i0), a.o_strides[2],
                             tile.rows, a.dv);

    float row_lse[MF][2], row_delta[MF][2];
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t row = row0 + 16 * f + g + half * 8;
            row_lse[f][half] = lse_log2(ops.lse, bh * a.m + row, row < a.m);
            // The four lanes of a quad share the row: lane t takes columns 8 t.. of every 32.
            float sum = 0.f;
            if (row < a.m) {
                const int64_t at = row_offset(a.o_strides, tile.b, tile.h, row);
                const T* o_row = ops.out + at;
                const T* g_row = ops.grad_out + at;
                for (int64_t col = 8 * t; col < a.dv; col += 32)
#pragma unroll
                    for (int e = 0; e < 8; ++e) sum = fmaf(to_float(o_row[col + e]), to_float(g_row[col + e]), sum);
            }
            sum = quad_sum(sum);
            row_delta[f][half] = sum;
            if (t == 0 && row < a.m) ops.delta[bh * a.m + row] = sum;
        }
    float acc[MF][D / 8][4];
    zero_fragments(acc);

    tile.template for_each_key_chunk<S, CHUNK>(sk, sv, [&](int64_t kt, int c, bool partial, const T* k_tile, const T* v_tile) {
            // The probabilities: exp2(x * scale_log2 - lse), 0 where hidden.
            float s[MF][NT][4], dp[MF][NT][4];
            tile.template chunk_scores<CHUNK>(
                s, sq, warp * 16 * MF, k_tile, kt, c, partial, row0, lane,
                [&](float x, int f, int r) { return exp2f(fmaf(x, a.scale_log2, -row_lse[f][r >> 1])); }, 0.f);
            product_abt<T, D, RowPadded<D>, MF, NT>(dp, sdo, warp * 16 * MF, v_tile, c * CHUNK, lane);
            uint32_t ds[MF][CHUNK / 16][4];
#pragma unroll
            for (int f = 0; f < MF; ++f) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const float p = s[f][nt][r];
                        s[f][nt][r] = p * (dp[f][nt][r] - row_delta[f][r >> 1]);
                    }
                to_a_fragments<T, CHUNK / 16>(ds[f], s[f]);
            }
            product_pb<T, D, RowPadded<D>, MF, CHUNK / 16>(acc, ds, k_tile, c * CHUNK, lane);
    });
#pragma unroll
    for (int f = 0; f < MF; ++f)
        store_rows<T, D>(ops.dq + row_offset(a.dq_strides, tile.b, tile.h, 0), a.dq_strides[2], acc[f], row0 + 16 * f,
                         a.m, a.d, a.scale, a.scale, lane);
}

// acc[nt][r] = value(acc[nt][r], the statistic of its column, nt, r) for a warp's accumulator
// whose columns are queries; `stats` holds this lane's first column's statistic (column 2t of
// the chunk; 8-byte aligned), its neighbour next to it and those of tile nt 8 further on.
template <int NT, class Value>
__device__ __forceinline__ void per_column(float (&acc)[NT][4], const float* stats, Value&& value) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float2 pair = *reinterpret_cast<const float2*>(stats + nt * 8);
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = value(acc[nt][r], (r & 1) ? pair.y : pair.x, nt, r);
    }
}

// The same for MF x NT accumulator fragments whose rows are queries: `stats` holds the statistic
// of the warp's first row and those after it (value(x, stat, f, nt, r)).
template <int MF, int NT, class Value>
__device__ __forceinline__ void per_row(float (&acc)[MF][NT][4], const float* stats, int lane, Value&& value) {
    const int g = lane >> 2;
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float stat = stats[16 * f + g + 8 * half];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    acc[f][nt][2 * half + e] = value(acc[f][nt][2 * half + e], stat, f, nt, 2 * half + e);
        }
}

// dv = sum over queries of Pᵀ dO and dk = scale * sum of dSᵀ Q, per key tile, over the query tiles
// of every query head that reads this kv head. PARTS: 1 dv, 2 dk, 3 both. MASKS: the MaskFamily of
// the kernel instance.
template <typename T, int D, int PARTS, int MASKS>
__device__ __forceinline__ void dkdv_tc(const BackwardOperands<T>& ops, const AttentionArgs& a) {
    constexpr int S = stages<D>(Pass::Dkdv), E = tile_elements<T, D>();
    extern __shared__ uint4 shared_raw[];
    T* sk = reinterpret_cast<T*>(shared_raw);
    T* sv = sk + E;
    T* sq = sk + 2 * E;         // S stages
    T* sdo = sk + (2 + S) * E;  // S stages
    float* s_lse = reinterpret_cast<float*>(sk + (2 + 2 * S) * E);  // [S][BQ]
    float* s_delta = s_lse + S * BQ;                                // [S][BQ]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t kv_total = a.batch * a.kv_heads;
    const int64_t block = blockIdx.x;
    const int64_t kt = block / kv_total;  // the key tiles most queries see first (causal masks)
    const int64_t bhk = block % kv_total, b = bhk / a.kv_heads, hk = bhk % a.kv_heads;
    const int64_t group = a.heads / a.kv_heads, h0 = hk * group;
    const KernelMask<MASKS> mask{{a, ops.states, ops.dense, ops.ids, b}};
    const int64_t j0 = kt * BK, keys = min(static_cast<int64_t>(BK), a.n - j0);
    load_tile<T, D>(sk, ops.k + b * a.k_strides[0] + hk * a.k_strides[1] + j0 * a.k_strides[2], a.k_strides[2], keys, a.d);
    load_tile<T, D>(sv, ops.v + b * a.v_strides[0] + hk * a.v_strides[1] + j0 * a.v_strides[2], a.v_strides[2], keys, a.dv);

    float acc_dk[1][(PARTS & 2) ? D / 8 : 1][4], acc_dv[1][(PARTS & 1) ? D / 8 : 1][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

    // Items: (query head - h0) * row_tiles + query tile.
    const int64_t end = group * a.row_tiles;
    int64_t qt_first, qt_last;  // generated masks: the query tiles that may see this key tile
    mask.query_tiles_of(j0, j0 + BK - 1, qt_first, qt_last);
    auto next = [&](int64_t item) {
        if (mask.generated()) {
            if (qt_first > qt_last) return end;
            int64_t head = item < 0 ? 0 : item / a.row_tiles, qt = item < 0 ? qt_first : item % a.row_tiles + 1;
            qt = max(qt, qt_first);
            if (qt > qt_last) {
                ++head;
                qt = qt_first;
            }
            return head < group ? head * a.row_tiles + qt : end;
        }
        return next_live(item, end, [&](int64_t i) {
            return mask.tile_state(h0 + i / a.row_tiles, i % a.row_tiles, kt) != TILE_EMPTY;
        });
    };
    auto load = [&](int64_t item, int stage) {
        const int64_t h = h0 + item / a.row_tiles, i0 = (item % a.row_tiles) * BQ, rows = min(static_cast<int64_t>(BQ), a.m - i0);
        const int64_t bh = b * a.heads + h;
        load_tile<T, D>(sq + stage * E, ops.q + b * a.q_strides[0] + h * a.q_strides[1] + i0 * a.q_strides[2],
                        a.q_strides[2], rows, a.d);
        load_tile<T, D>(sdo + stage * E, ops.grad_out + row_offset(a.o_strides, b, h, i0), a.o_strides[2], rows, a.dv);
        load_row_stats<THREADS>(s_lse + stage * BQ, s_delta + stage * BQ, ops.lse, ops.delta, bh * a.m + i0, rows);
    };
    auto work = [&](int64_t item, int stage) {
        const int64_t h = h0 + item / a.row_tiles, qt = item % a.row_tiles, i0 = qt * BQ;
        const uint8_t state = mask.tile_state(h, qt, kt);
        if (state == TILE_EMPTY) return;  // the same for the whole block
        const bool partial = state != TILE_FULL;
        const int64_t key = j0 + warp * 16 + g;
        // The 64 queries of the item in chunks of KEY_CHUNK (the score registers are 16 x KEY_CHUNK).
#pragma unroll(D > 64 ? 1 : BQ / KEY_CHUNK)
        for (int c = 0; c < BQ / KEY_CHUNK; ++c) {
            const int col0 = c * KEY_CHUNK + 2 * t;  // this lane's first query column in the item
            float st[1][CHUNK_TILES][4];              // Sᵀ: rows are keys, columns queries
            float dpt[1][CHUNK_TILES][4];             // dPᵀ = V dOᵀ (dk only)
            auto& s = st[0];
            auto& dp = dpt[0];
            if constexpr (PARTS == 3)  // both products at once (twice the independent mma)
                product_abt_pair<T, D, RowPadded<D>, CHUNK_TILES>(st, sk, sq + stage * E, dpt, sv, sdo + stage * E,
                                                                  warp * 16, c * KEY_CHUNK, lane);
            else
                product_abt<T, D, RowPadded<D>, 1, CHUNK_TILES>(st, sk, warp * 16, sq + stage * E, c * KEY_CHUNK,
                                                                lane);
            per_column(s, s_lse + stage * BQ + col0,
                       [&](float x, float lse, int, int) { return exp2f(fmaf(x, a.scale_log2, -row_lse2(lse))); });
            if (partial && mask.generated()) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    int lo, hi;
                    mask.query_run(key + half * 8, i0 + c * KEY_CHUNK, KEY_CHUNK, lo, hi);
#pragma unroll
                    for (int nt = 0; nt < CHUNK_TILES; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = nt * 8 + 2 * t + e;
                            if (col < lo || col > hi) s[nt][2 * half + e] = 0.f;
                        }
                }
            } else if (partial) {
#pragma unroll
                for (int nt = 0; nt < CHUNK_TILES; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        if (!mask.keeps(h, i0 + col0 + nt * 8 + (r & 1), key + (r >> 1) * 8)) s[nt][r] = 0.f;
            }
            if constexpr ((PARTS & 1) != 0) {
                uint32_t p[1][CHUNK_STEPS][4];
                to_a_fragments<T, CHUNK_STEPS>(p[0], s);
                product_pb<T, D, RowPadded<D>, 1, CHUNK_STEPS>(acc_dv, p, sdo + stage * E, c * KEY_CHUNK, lane);
            }
            if constexpr ((PARTS & 2) != 0) {
                if constexpr (PARTS != 3)
                    product_abt<T, D, RowPadded<D>, 1, CHUNK_TILES>(dpt, sv, warp * 16, sdo + stage * E,
                                                                    c * KEY_CHUNK, lane);
                per_column(s, s_delta + stage * BQ + col0,
                           [&](float x, float delta_j, int nt, int r) { return x * (dp[nt][r] - delta_j); });
                uint32_t ds[1][CHUNK_STEPS][4];
                to_a_fragments<T, CHUNK_STEPS>(ds[0], s);
                product_pb<T, D, RowPadded<D>, 1, CHUNK_STEPS>(acc_dk, ds, sq + stage * E, c * KEY_CHUNK, lane);
            }
        }
    };
    pipeline<S, ONE_BARRIER_PIPELINE<S, MASKS>>(next(-1), end, next, load, work);
    const int64_t row0 = j0 + warp * 16;
    if constexpr ((PARTS & 2) != 0)
        store_rows<T, D>(ops.dk + row_offset(a.dk_strides, b, hk, 0), a.dk_strides[2], acc_dk[0], row0, a.n, a.d,
                         a.scale, a.scale, lane);
    if constexpr ((PARTS & 1) != 0)
        store_rows<T, D>(ops.dv + row_offset(a.dv_strides, b, hk, 0), a.dv_strides[2], acc_dv[0], row0, a.n, a.dv, 1.f,
                         1.f, lane);
}


// ---- The one-pass backward (head tile 128; the host picks it, see one_pass_backward in
// src/attention/cuda.rs). A block of ONE_PASS_WARPS warps owns ONE_PASS_KEYS keys and walks the
// query tiles of every query head of its group, Q / dO in ONE_PASS_STAGES stages: S and dP once
// per 64 queries (a warp 32 queries x 32 keys), P and dS through shared memory (two buffers,
// alternate items), dK / dV accumulated per warp over 32 keys x 64 head columns, and dS K (a warp
// 32 queries x 32 head columns) added into dq_accum (f32, zeroed; the fragment order of
// dq_fragment<128, 2>, attention_common.cuh) by 16-byte reductions, which
// attention_dq_rows_d128_* then scales into dq: dq's bits depend on the order of the additions.
// Every shared tile is Swizzled128 (no padding), which is what lets the third stage and the second
// P / dS buffer fit, and those are what let an item take one barrier (pipeline_one_barrier).
constexpr int BWD_THREADS = AC::ONE_PASS_WARPS * 32, BWD_KEYS = AC::ONE_PASS_KEYS;
static_assert(BWD_THREADS == 256 && BWD_KEYS == 128, "the warp roles of bwd_tc: 2 x 4 over S, 4 x 2 over dK / dV");

// acc (16 MF x 8 NT) += A B over K, B stored [k][n] (columns n0..); A stored [row][k] (rows
// r0..), or [k][row] where A_K_MAJOR (so that the product is Aᵀ B of the stored tile); both
// tiles of layout L.
template <typename T, int K, class L, int MF, int NT, bool A_K_MAJOR = false>
__device__ __forceinline__ void product_ab(float (&acc)[MF][NT][4], const T* a_tile, int r0, const T* b_tile, int n0,
                                           int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t x[MF][4];
#pragma unroll
        for (int f = 0; f < MF; ++f) {
            if constexpr (A_K_MAJOR) load_a_trans<T, L>(x[f], a_tile, r0 + 16 * f, kk * 16, lane);
            else load_a<T, L>(x[f], a_tile, r0 + 16 * f, kk * 16, lane);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t y[4];
            load_b_trans<T, L>(y, b_tile, kk * 16, n0 + np * 16, lane);
#pragma unroll
            for (int f = 0; f < MF; ++f) {
                mma_m16n8k16<T>(acc[f][2 * np], x[f], y[0], y[1]);
                mma_m16n8k16<T>(acc[f][2 * np + 1], x[f], y[2], y[3]);
            }
        }
    }
}

template <typename T, int MASKS>
__device__ __forceinline__ void bwd_tc(const BackwardOperands<T>& ops, float* dq_accum, const AttentionArgs& a) {
    constexpr int D = 128, KB = BWD_KEYS, STAGES = AC::ONE_PASS_STAGES;
    using L = Swizzled128;  // every tile below: rows of 128 elements (D or KB)
    constexpr int KE = KB * D, QE = BQ * D, PE = BQ * KB;
    extern __shared__ uint4 shared_raw[];
    T* sk = reinterpret_cast<T*>(shared_raw);
    T* sv = sk + KE;
    T* sq = sv + KE;               // STAGES stages
    T* sdo = sq + STAGES * QE;     // STAGES stages
    T* sp = sdo + STAGES * QE;     // P [BQ][KB], two buffers
    T* sds = sp + 2 * PE;          // dS [BQ][KB], two buffers
    float* s_lse = reinterpret_cast<float*>(sds + 2 * PE);  // [STAGES][BQ]
    float* s_delta = s_lse + STAGES * BQ;                    // [STAGES][BQ]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // The block: keys j0 .. j0 + KB - 1 of (b, hk). Blocks go bwd_pair_group (batch, kv head)
    // pairs at a time, key block by key block within a group (the keys most queries see first,
    // for causal masks), so that the blocks running at once share a few heads' Q / dO tiles and
    // dq_accum rows in L2; a group of every pair is key block by key block over all heads.
    const int64_t kv_total = a.batch * a.kv_heads, key_blocks = (a.n + KB - 1) / KB;
    const int64_t block = blockIdx.x;
    const int64_t pair_group = min(max(a.bwd_pair_group, static_cast<int64_t>(1)), kv_total);
    const int64_t first_pair = block / (pair_group * key_blocks) * pair_group;
    const int64_t pairs = min(pair_group, kv_total - first_pair), within = block - first_pair * key_blocks;
    const int64_t kb = within / pairs;
    const int64_t bhk = first_pair + within % pairs, b = bhk / a.kv_heads, hk = bhk % a.kv_heads;
    const int64_t group = a.heads / a.kv_heads, h0 = hk * group;
    const KernelMask<MASKS> mask{{a, ops.states, ops.dense, ops.ids, b}};
    const int64_t j0 = kb * KB, keys = min(static_cast<int64_t>(KB), a.n - j0);
    load_tile<T, D, KB, BWD_THREADS, L>(sk, ops.k + b * a.k_strides[0] + hk * a.k_strides[1] + j0 * a.k_strides[2],
                                      a.k_strides[2], keys, a.d);
    load_tile<T, D, KB, BWD_THREADS, L>(sv, ops.v + b * a.v_strides[0] + hk * a.v_strides[1] + j0 * a.v_strides[2],
                                      a.v_strides[2], keys, a.dv);
    // Warp roles: S / dP and dQ rows (queries), S / dP keys, dK / dV keys and head columns, dQ
    // head columns; the mask tile of this warp's 32 keys of S.
    const int q_row = 32 * (warp / 4), s_key = 32 * (warp % 4);
    const int kv_row = 32 * (warp / 2), kv_col = 64 * (warp % 2), dq_col = 32 * (warp % 4);
    const int64_t warp_kt = 2 * kb + (warp % 4) / 2;
    // Generated masks: every query tile's state for this warp's key tile, worked out once.
    const TileSpan warp_span = mask.generated() ? mask.query_span(warp_kt) : TileSpan{1, 0, 1, 0};

    float acc_dk[2][8][4], acc_dv[2][8][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

    // Items: (query head - h0) << 32 | query tile, so that no step divides.
    const int64_t end = group << 32;
    int64_t qt_first, qt_last;
    mask.query_tiles_of(j0, j0 + KB - 1, qt_first, qt_last);
    auto next = [&](int64_t item) -> int64_t {
        int64_t head = item < 0 ? 0 : item >> 32, qt = item < 0 ? 0 : (item & 0xffffffffll) + 1;
        if constexpr (MASKS != STORED) {  // mask.generated(), as a constant
            if (qt_first > qt_last) return end;
            qt = max(qt, qt_first);
            if (qt > qt_last) {
                ++head;
                qt = qt_first;
            }
            return head < group ? head << 32 | qt : end;
        } else {
            for (; head < group; ++head, qt = 0) {
                const int64_t h = h0 + head;
                const int64_t found = next_live(qt - 1, a.row_tiles, [&](int64_t c) {
                    bool any = mask.tile_state(h, c, 2 * kb) != TILE_EMPTY;
                    if (2 * kb + 1 < a.col_tiles) any |= mask.tile_state(h, c, 2 * kb + 1) != TILE_EMPTY;
                    return any;
                });
                if (found < a.row_tiles) return head << 32 | found;
            }
            return end;
        }
    };
    auto load = [&](int64_t item, int stage) {
        const int64_t h = h0 + (item >> 32), i0 = (item & 0xffffffffll) * BQ, rows = min(static_cast<int64_t>(BQ), a.m - i0);
        const int64_t bh = b * a.heads + h;
        load_tile<T, D, 64, BWD_THREADS, L>(sq + stage * QE, ops.q + b * a.q_strides[0] + h * a.q_strides[1] + i0 * a.q_strides[2],
                                          a.q_strides[2], rows, a.d);
        load_tile<T, D, 64, BWD_THREADS, L>(sdo + stage * QE, ops.grad_out + row_offset(a.o_strides, b, h, i0),
                                          a.o_strides[2], rows, a.dv);
        load_row_stats<BWD_THREADS>(s_lse + stage * BQ, s_delta + stage * BQ, ops.lse, ops.delta, bh * a.m + i0, rows);
    };
    // S and dP of an item, then its P and dS into buffer `buffer`.
    auto scores = [&](int64_t item, int stage, int buffer) {
        const int lane = opaque(threadIdx.x & 31);
        const T* sq_ = sq + stage * QE;
        const T* sdo_ = sdo + stage * QE;
        const float* s_lse_ = s_lse + stage * BQ;
        const float* s_delta_ = s_delta + stage * BQ;
        const int64_t h = h0 + (item >> 32), qt = item & 0xffffffffll, i0 = qt * BQ;
        const uint8_t state = mask.generated() ? warp_span.state(static_cast<int>(qt))
                                               : (warp_kt < a.col_tiles ? mask.tile_state(h, qt, warp_kt) : TILE_EMPTY);
        // S and dP (32 queries x 32 keys a warp), then P and dS into shared memory.
        float s[2][4][4], dp[2][4][4];
        if (state != TILE_EMPTY) {
            product_abt<T, D, L, 2, 4>(s, sq_, q_row, sk, s_key, lane);
            product_abt<T, D, L, 2, 4>(dp, sdo_, q_row, sv, s_key, lane);
            // P = exp2(S scale_log2 - lse), then zero where a partial tile's mask hides the key
            // (a separate, warp-uniform branch), then dS = P (dP - delta).
            per_row(s, s_lse_ + q_row, lane,
                    [&](float x, float lse, int, int, int) { return exp2f(fmaf(x, a.scale_log2, -row_lse2(lse))); });
            if (state != TILE_FULL) {
                if (mask.generated()) {
#pragma unroll
                    for (int f = 0; f < 2; ++f)
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            int lo, hi;
                            mask.key_run(i0 + q_row + 16 * f + g + 8 * half, j0 + s_key, 32, lo, hi);
#pragma unroll
                            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const int col = nt * 8 + 2 * t + e;
                                    if (col < lo || col > hi) s[f][nt][2 * half + e] = 0.f;
                                }
                        }
                } else {
                    uint32_t keep = 0;
                    for_each_entry<2, 4>([&](int f, int nt, int r) {
                        if (mask.keeps(h, i0 + q_row + 16 * f + g + (r >> 1) * 8, j0 + s_key + nt * 8 + 2 * t + (r & 1)))
                            keep |= 1u << (f * 16 + nt * 4 + r);
                    });
                    for_each_entry<2, 4>([&](int f, int nt, int r) {
                        if (!(keep >> (f * 16 + nt * 4 + r) & 1u)) s[f][nt][r] = 0.f;
                    });
                }
            }
            per_row(dp, s_delta_ + q_row, lane,
                    [&](float x, float delta, int f, int nt, int r) { return s[f][nt][r] * (x - delta); });
        } else {
            zero_fragments(s);
            zero_fragments(dp);
        }
        T* sp_ = sp + buffer * PE;
        T* sds_ = sds + buffer * PE;
#pragma unroll
        for (int f = 0; f < 2; ++f)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int at = L::at(q_row + 16 * f + g + 8 * half, s_key + nt * 8 + 2 * t);
                    *reinterpret_cast<uint32_t*>(sp_ + at) = pack2<T>(s[f][nt][2 * half], s[f][nt][2 * half + 1]);
                    *reinterpret_cast<uint32_t*>(sds_ + at) = pack2<T>(dp[f][nt][2 * half], dp[f][nt][2 * half + 1]);
                }
    };
    // The products of an item's P and dS (every warp's, in buffer `buffer`).
    auto gradients = [&](int64_t item, int stage, int buffer) {
        const int lane = opaque(threadIdx.x & 31);
        const T* sq_ = sq + stage * QE;
        const T* sdo_ = sdo + stage * QE;
        const T* sp_ = sp + buffer * PE;
        const T* sds_ = sds + buffer * PE;
        const int64_t h = h0 + (item >> 32), qt = item & 0xffffffffll;
        // dV += Pᵀ dO and dK += dSᵀ Q (32 keys x 64 head columns a warp).
        product_ab<T, BQ, L, 2, 8, true>(acc_dv, sp_, kv_row, sdo_, kv_col, lane);
        product_ab<T, BQ, L, 2, 8, true>(acc_dk, sds_, kv_row, sq_, kv_col, lane);
        // dQ += scale * dS K over the block's 128 keys (32 queries x 32 head columns a warp).
        float acc_dq[2][4][4];
        zero_fragments(acc_dq);
        product_ab<T, KB, L, 2, 4>(acc_dq, sds_, q_row, sk, dq_col, lane);
        // Into dq_accum in fragment order (attention_common.cuh; two column blocks of 64).
        float4* dq_tile = reinterpret_cast<float4*>(dq_accum);
#pragma unroll
        for (int f = 0; f < 2; ++f)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
                red_add4(dq_fragment<D, 2>(dq_tile, (b * a.heads + h) * a.row_tiles + qt, q_row / 16 + f,
                                           dq_col / 8 + nt, lane),
                         make_float4(acc_dq[f][nt][0], acc_dq[f][nt][1], acc_dq[f][nt][2], acc_dq[f][nt][3]));
    };
    pipeline_one_barrier<STAGES>(next(-1), end, next, load, scores, gradients);
    // dK (times the scale) and dV through the K and V tiles' room (free once every warp has left
    // the loop), then out 16 bytes a thread.
    __syncthreads();
#pragma unroll
    for (int f = 0; f < 2; ++f)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int at = L::at(kv_row + 16 * f + g + 8 * half, kv_col + nt * 8 + 2 * t);
                *reinterpret_cast<uint32_t*>(sk + at) =
                    pack2<T>(acc_dk[f][nt][2 * half] * a.scale, acc_dk[f][nt][2 * half + 1] * a.scale);
                *reinterpret_cast<uint32_t*>(sv + at) = pack2<T>(acc_dv[f][nt][2 * half], acc_dv[f][nt][2 * half + 1]);
            }
    __syncthreads();
    store_tile<T, D, KB, BWD_THREADS, L>(ops.dk + row_offset(a.dk_strides, b, hk, j0), a.dk_strides[2], sk, keys, a.d);
    store_tile<T, D, KB, BWD_THREADS, L>(ops.dv + row_offset(a.dv_strides, b, hk, j0), a.dv_strides[2], sv, keys, a.dv);
}

// The one argument list of the backward kernels, and their operands from it.
#define BACKWARD_PARAMS(T)                                                                                            \
    const T *q, const T *k, const T *v, const T *grad_out, const T *out, const float *lse, float *delta, T *dq, T *dk, \
        T *dv, const uint8_t *states, const uint8_t *dense, const int64_t *ids, AttentionArgs a
#define BACKWARD_OPERANDS(T)                                                                                          \
    BackwardOperands<T> { q, k, v, grad_out, out, lse, delta, dq, dk, dv, states, dense, ids }

// ---- f32: a warp per row, a lane per 8 columns (lane + 32 e), dot products reduced across the warp.

constexpr int PER_LANE = 8;  // 256 / 32

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <typename T>
__device__ __forceinline__ void load_row(float (&r)[PER_LANE], const T* src, int64_t cols, int lane) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
        const int64_t c = lane + 32 * e;
        r[e] = c < cols ? to_float(src[c]) : 0.f;
    }
}

__device__ __forceinline__ float dot(const float (&x)[PER_LANE], const float (&y)[PER_LANE]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) s = fmaf(x[e], y[e], s);
    return warp_sum(s);
}

// delta = rowsum(dO * O) in f32, for the Hopper and one-pass backwards: out and grad_out are
// [b, h, m, dv] by o_strides (dv a multiple of 8 up to 256, rows 16-byte aligned), delta
// [b * h * m]. A row is read
// 16 bytes a lane by `lanes` lanes (the power of two >= dv / 8), so a warp covers 32 / lanes rows
// a step; it takes DELTA_STEPS steps at once, every load issued before the first sum, and walks
// the rows grid-strided (any grid is correct; the host sizes it by delta_rows_per_warp).
template <typename T>
__device__ __forceinline__ void delta_rows(const BackwardOperands<T>& ops, const AttentionArgs& a) {
    constexpr int STEPS = AC::DELTA_STEPS;
    const int lane = threadIdx.x & 31, chunks = static_cast<int>(a.dv / 8);
    int lanes = 1;
    while (lanes < chunks) lanes *= 2;
    const int per_step = 32 / lanes, sub = lane / lanes, chunk = lane % lanes;
    const int64_t rows = a.batch * a.heads * a.m, per_warp = static_cast<int64_t>(per_step) * STEPS;
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * ROW_WARPS + (threadIdx.x >> 5);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * ROW_WARPS * per_warp;
    // Head-major contiguous rows (masked_attention's) lie at row * dv; others (the packed op's
    // token-major rows) at their (b, h, i) by o_strides, in 32-bit quotients where rows fit.
    const bool dense_rows =
        a.o_strides[2] == a.dv && a.o_strides[1] == a.m * a.dv && a.o_strides[0] == a.heads * a.m * a.dv;
    const bool rows32 = rows <= 0xffffffffll;
    const uint32_t m32 = static_cast<uint32_t>(a.m), h32 = static_cast<uint32_t>(a.heads);
    auto row_at = [&](int64_t row) -> int64_t {
        if (dense_rows) return row * a.dv;
        if (rows32) {
            const uint32_t r = static_cast<uint32_t>(row), bh = r / m32;
            return row_offset(a.o_strides, bh / h32, bh % h32, r - bh * m32);
        }
        const int64_t bh = row / a.m;
        return row_offset(a.o_strides, bh / a.heads, bh % a.heads, row - bh * a.m);
    };
    for (int64_t first = warp * per_warp; first < rows; first += stride) {
        uint4 o8[STEPS], g8[STEPS];
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            const int64_t row = first + s * per_step + sub;
            o8[s] = g8[s] = make_uint4(0, 0, 0, 0);  // zero bits: 0 in f16 and bf16
            if (row < rows && chunk < chunks) {
                const int64_t at = row_at(row) + 8 * chunk;
                o8[s] = *reinterpret_cast<const uint4*>(ops.out + at);
                g8[s] = *reinterpret_cast<const uint4*>(ops.grad_out + at);
            }
        }
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            const T* o_half = reinterpret_cast<const T*>(&o8[s]);
            const T* g_half = reinterpret_cast<const T*>(&g8[s]);
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) sum = fmaf(to_float(o_half[e]), to_float(g_half[e]), sum);
            for (int offset = lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            const int64_t row = first + s * per_step + sub;
            if (chunk == 0 && row < rows) ops.delta[row] = sum;
        }
    }
}

template <typename T>
__device__ __forceinline__ void store_row(T* dst, const float (&r)[PER_LANE], float factor, int64_t cols, int lane) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
        const int64_t c = lane + 32 * e;
        if (c < cols) dst[c] = from_float<T>(r[e] * factor);
    }
}

// Calls visit(j) for every key j query i of head h sees, in order.
template <class Visit>
__device__ __forceinline__ void for_visible_keys(const MaskView& mask, int64_t h, int64_t i, Visit&& visit) {
    const AttentionArgs& a = mask.a;
    const int64_t qt = i / BQ;
    for (int64_t kt = 0; kt < a.col_tiles; ++kt) {
        const uint8_t state = mask.tile_state(h, qt, kt);
        if (state == TILE_EMPTY) continue;
        const int64_t end = min(kt * BK + BK, a.n);
        for (int64_t j = kt * BK; j < end; ++j)
            if (state == TILE_FULL || mask.keeps(h, i, j)) visit(j);
    }
}

// The query row of a warp of the row kernels (forward, dq); `valid` is false past the last row.
template <typename T> struct QueryRow {
    MaskView mask;
    int64_t row, i, h;
    bool valid;
    int64_t b;
    const T* q_row;
    const T* k_head;
    const T* v_head;

    __device__ __forceinline__ QueryRow(const AttentionArgs& a, const T* q, const T* k, const T* v,
                                        const uint8_t* states, const uint8_t* dense, const int64_t* ids)
        : mask{a, states, dense, ids, 0} {
        row = static_cast<int64_t>(blockIdx.x) * ROW_WARPS + (threadIdx.x >> 5);
        valid = row < a.batch * a.heads * a.m;
        const int64_t r = valid ? row : 0, bh = r / a.m;
        b = bh / a.heads;
        const int64_t hk = (bh % a.heads) / (a.heads / a.kv_heads);
        i = r % a.m;
        h = bh % a.heads;
        mask.b = b;
        q_row = q + b * a.q_strides[0] + h * a.q_strides[1] + i * a.q_strides[2];
        k_head = k + b * a.k_strides[0] + hk * a.k_strides[1];
        v_head = v + b * a.v_strides[0] + hk * a.v_strides[1];
    }
};

extern "C" __global__ void __launch_bounds__(AC::ROW_WARPS * 32)
    attention_fwd_rows_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                           float* __restrict__ out, float* __restrict__ lse, const uint8_t* states,
                           const uint8_t* dense, const int64_t* ids, AttentionArgs a) {
    using T = float;
    const int lane = threadIdx.x & 31;
    const QueryRow<T> w(a, q, k, v, states, dense, ids);
    if (!w.valid) return;
    const int64_t row = w.row;
    float qr[PER_LANE], o[PER_LANE] = {}, vr[PER_LANE], kr[PER_LANE];
    load_row(qr, w.q_row, a.d, lane);
    float mx = -INFINITY, sum = 0.f;
    for_visible_keys(w.mask, w.h, w.i, [&](int64_t j) {
        load_row(kr, w.k_head + j * a.k_strides[2], a.d, lane);
        load_row(vr, w.v_head + j * a.v_strides[2], a.dv, lane);
        const float x = dot(qr, kr) * a.scale_log2;
        const float new_max = fmaxf(mx, x), alpha = exp2f(mx - new_max), p = exp2f(x - new_max);
        sum = sum * alpha + p;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) o[e] = fmaf(p, vr[e], o[e] * alpha);
        mx = new_max;
    });
    store_row(out + row_offset(a.o_strides, w.b, w.h, w.i), o, sum > 0.f ? 1.f / sum : 0.f, a.dv, lane);
    if (lane == 0) lse[row] = sum > 0.f ? (mx + log2f(sum)) * LN2 : -INFINITY;
}

extern "C" __global__ void __launch_bounds__(AC::ROW_WARPS * 32) attention_dq_rows_f32(BACKWARD_PARAMS(float)) {
    using T = float;
    const int lane = threadIdx.x & 31;
    const QueryRow<T> w(a, q, k, v, states, dense, ids);
    if (!w.valid) return;
    const int64_t row = w.row;
    float qr[PER_LANE], gr[PER_LANE], kr[PER_LANE], vr[PER_LANE], acc[PER_LANE] = {};
    load_row(qr, w.q_row, a.d, lane);
    load_row(gr, grad_out + row_offset(a.o_strides, w.b, w.h, w.i), a.dv, lane);
    load_row(vr, out + row_offset(a.o_strides, w.b, w.h, w.i), a.dv, lane);
    const float row_lse = lse_log2(lse, row, true), row_delta = dot(gr, vr);
    if (lane == 0) delta[row] = row_delta;
    for_visible_keys(w.mask, w.h, w.i, [&](int64_t j) {
        load_row(kr, w.k_head + j * a.k_strides[2], a.d, lane);
        load_row(vr, w.v_head + j * a.v_strides[2], a.dv, lane);
        const float p = exp2f(dot(qr, kr) * a.scale_log2 - row_lse);
        const float ds = p * (dot(gr, vr) - row_delta);
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) acc[e] = fmaf(ds, kr[e], acc[e]);
    });
    store_row(dq + row_offset(a.dq_strides, w.b, w.h, w.i), acc, a.scale, a.d, lane);
}

extern "C" __global__ void __launch_bounds__(AC::ROW_WARPS * 32) attention_dkdv_rows_f32(BACKWARD_PARAMS(float)) {
    using T = float;
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * ROW_WARPS + (threadIdx.x >> 5);
    if (row >= a.batch * a.kv_heads * a.n) return;
    const int64_t bhk = row / a.n, j = row % a.n, b = bhk / a.kv_heads, hk = bhk % a.kv_heads;
    const int64_t group = a.heads / a.kv_heads, kt = j / BK;
    const MaskView mask{a, states, dense, ids, b};
    float kr[PER_LANE], vr[PER_LANE], qr[PER_LANE], gr[PER_LANE], acc_k[PER_LANE] = {}, acc_v[PER_LANE] = {};
    load_row(kr, k + b * a.k_strides[0] + hk * a.k_strides[1] + j * a.k_strides[2], a.d, lane);
    load_row(vr, v + b * a.v_strides[0] + hk * a.v_strides[1] + j * a.v_strides[2], a.dv, lane);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t bh = b * a.heads + h;
        for (int64_t qt = 0; qt < a.row_tiles; ++qt) {
            const uint8_t state = mask.tile_state(h, qt, kt);
            if (state == TILE_EMPTY) continue;
            const int64_t end = min(qt * BQ + BQ, a.m);
            for (int64_t i = qt * BQ; i < end; ++i) {
                if (state != TILE_FULL && !mask.keeps(h, i, j)) continue;
                load_row(qr, q + b * a.q_strides[0] + h * a.q_strides[1] + i * a.q_strides[2], a.d, lane);
                load_row(gr, grad_out + row_offset(a.o_strides, b, h, i), a.dv, lane);
                const float p = exp2f(dot(qr, kr) * a.scale_log2 - lse_log2(lse, bh * a.m + i, true));
                const float ds = p * (dot(gr, vr) - delta[bh * a.m + i]);
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) {
                    acc_v[e] = fmaf(p, gr[e], acc_v[e]);
                    acc_k[e] = fmaf(ds, qr[e], acc_k[e]);
                }
            }
        }
    }
    store_row(dk + row_offset(a.dk_strides, b, hk, j), acc_k, a.scale, a.d, lane);
    store_row(dv + row_offset(a.dv_strides, b, hk, j), acc_v, 1.f, a.dv, lane);
}

}  // namespace

// Exported kernels: attention_{fwd,dq,dkdv}_{generated,runs,stored}_d{64,128,256}_{f16,bf16}
// (tensor cores; where D = 256 dkdv runs on a grid of two y-slices, dv in the first and dk in the
// second, so that each keeps one accumulator), the one-pass backward
// attention_bwd_{generated,runs,stored}_d128_* and its attention_dq_rows_d128_*,
// attention_delta_{f16,bf16} (delta alone, before the Hopper and one-pass backwards) and
// attention_{fwd,dq,dkdv}_rows_f32. Each tensor-core kernel has an instance per MaskFamily
// (generated: full, causal, window; runs: documents in contiguous runs, MASK_RUNS; stored: tile
// states in memory). The backward kernels take one argument list, BACKWARD_PARAMS. The two-pass
// backward runs dq (which writes delta), then dk / dv (which reads it).
#define ATTENTION_TC(T, RUST, D, MASKS, FAMILY)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                             \
        attention_fwd_##FAMILY##_d##D##_##RUST(const T* q, const T* k, const T* v, T* out, float* lse,                \
                                               const uint8_t* states, const uint8_t* dense, const int64_t* ids,       \
                                               AttentionArgs a) {                                                     \
        forward_tc<T, D, MASKS>(q, k, v, out, lse, states, dense, ids, a);                                            \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_dq_##FAMILY##_d##D##_##RUST(BACKWARD_PARAMS(T)) { \
        dq_tc<T, D, MASKS>(BACKWARD_OPERANDS(T), a);                                                                  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                             \
        attention_dkdv_##FAMILY##_d##D##_##RUST(BACKWARD_PARAMS(T)) {                                                 \
        if constexpr (D > 128) {                                                                                      \
            if (blockIdx.y == 0)                                                                                      \
                dkdv_tc<T, D, 1, MASKS>(BACKWARD_OPERANDS(T), a);                                                     \
            else                                                                                                      \
                dkdv_tc<T, D, 2, MASKS>(BACKWARD_OPERANDS(T), a);                                                     \
        } else {                                                                                                      \
            dkdv_tc<T, D, 3, MASKS>(BACKWARD_OPERANDS(T), a);                                                         \
        }                                                                                                             \
    }

#define ATTENTION_TC_MASKS(T, RUST, MASKS, FAMILY)                                                                    \
    ATTENTION_TC(T, RUST, 64, MASKS, FAMILY)                                                                          \
    ATTENTION_TC(T, RUST, 128, MASKS, FAMILY)                                                                         \
    ATTENTION_TC(T, RUST, 256, MASKS, FAMILY)                                                                         \
    extern "C" __global__ void __launch_bounds__(BWD_THREADS)                                                         \
        attention_bwd_##FAMILY##_d128_##RUST(BACKWARD_PARAMS(T), float* dq_accum) {                                   \
        bwd_tc<T, MASKS>(BACKWARD_OPERANDS(T), dq_accum, a);                                                          \
    }

#define ATTENTION_TC_TYPE(T, RUST)                                                                                    \
    ATTENTION_TC_MASKS(T, RUST, FORMULA, generated)                                                                   \
    ATTENTION_TC_MASKS(T, RUST, RUNS, runs)                                                                           \
    ATTENTION_TC_MASKS(T, RUST, STORED, stored)                                                                       \
    extern "C" __global__ void __launch_bounds__(AC::DQ_ROWS_THREADS)                                               \
        attention_dq_rows_d128_##RUST(const float4* dq_accum, T* dq, AttentionArgs a) {                               \
        dq_rows<T, 128, 2>(dq_accum, dq, a);                                                                          \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(AC::ROW_WARPS * 32) attention_delta_##RUST(BACKWARD_PARAMS(T)) {     \
        delta_rows<T>(BACKWARD_OPERANDS(T), a);                                                                       \
    }
ATTENTION_TC_TYPE(__half, f16)
ATTENTION_TC_TYPE(__nv_bfloat16, bf16)
