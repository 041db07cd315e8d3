// What every attention kernel file shares: the argument structs mirrored by
// src/attention/cuda.rs, the mask tiles (TILE_Q queries x TILE_K keys) and MaskView, which says
// which keys a query sees (tile states, runs of generated masks, single entries).
#pragma once
#include "common.cuh"

namespace AC = fastops_constants::attention;

namespace {

constexpr int BQ = AC::TILE_Q;
constexpr int BK = AC::TILE_K;
constexpr uint8_t TILE_EMPTY = fastops_constants::matmul::TILE_EMPTY;
constexpr uint8_t TILE_FULL = fastops_constants::matmul::TILE_FULL;
constexpr uint8_t TILE_PARTIAL = fastops_constants::matmul::TILE_PARTIAL;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// How far (log2 units) a score may pass its row's exponent reference in the forward before the
// reference moves: probabilities stay below 2^RESCALE_SLACK before normalisation (exact in f32;
// 16-bit P keeps its relative precision), and o is rescaled only when a reference moves.
#ifndef FASTOPS_RESCALE_SLACK
#define FASTOPS_RESCALE_SLACK 8.0f
#endif
constexpr float RESCALE_SLACK = FASTOPS_RESCALE_SLACK;

// The maximum and the sum over the four lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace

struct MaskArgs {
    int64_t dense_strides[4];                         // batch, head, query, key (0 where broadcast)
    int64_t states_batch_stride, states_head_stride;  // in tiles (0 where broadcast)
    int64_t window;                                   // MASK_WINDOW: keys per query, at most m + n + 1
    int32_t kind, doc_causal;
};
static_assert(sizeof(MaskArgs) == 64, "MaskArgs is mirrored by a Rust #[repr(C)] struct of 64 bytes");

// Every operand's strides are (batch, head, row) in elements, its columns unit-stride: q, k, v
// (read), out (written by the forward; read with grad_out, which shares its strides, by the
// backward) and dq, dk, dv (written by the backward). Head-major [b, h, rows, cols] buffers or
// views of a packed token-major [b, rows, heads, cols] one (masked_attention_packed).
struct AttentionArgs {
    int64_t q_strides[3], k_strides[3], v_strides[3];
    int64_t o_strides[3], dq_strides[3], dk_strides[3], dv_strides[3];
    int64_t batch, heads, kv_heads, m, n, d, dv;
    int64_t row_tiles, col_tiles;                      // of 64 queries, of 64 keys
    float scale, scale_log2;                           // scale, scale * log2(e) (> 0, see the host)
    MaskArgs mask;
    int64_t bwd_pair_group;  // the one-pass backward's blocks go this many (batch, kv head) pairs at a time
};
static_assert(sizeof(AttentionArgs) == 320, "AttentionArgs is mirrored by a Rust #[repr(C)] struct of 320 bytes");

namespace {

// Element offset of row `row` of head h of batch entry b in an operand with these strides.
__device__ __forceinline__ int64_t row_offset(const int64_t (&strides)[3], int64_t b, int64_t h, int64_t row) {
    return b * strides[0] + h * strides[1] + row * strides[2];
}

// The states of the tiles of one side (64 keys, or 64 queries) for one tile of the other side of a
// generated mask, worked out once: tiles [lo, hi] hold a position that some position of the tile
// sees, and tiles [full_lo, full_hi] (inside them) are whole tiles every position of which every
// position of the tile sees. A generated mask's states run empty, partial, full, partial, empty
// along either side, so this is every tile's state.
struct TileSpan {
    static_assert(BQ == BK, "one tile size for both sides");
    int lo, hi, full_lo, full_hi;
    __device__ __forceinline__ uint8_t state(int tile) const {
        if (tile < lo || tile > hi) return TILE_EMPTY;
        return tile >= full_lo && tile <= full_hi ? TILE_FULL : TILE_PARTIAL;
    }
    // From positions of the other side (count of them): the tile's positions see [seen_lo,
    // seen_hi] together and each sees all of [all_lo, all_hi]; `ragged` (the tile reaches past its
    // side's end): no tile is full; nor is one that reaches past count.
    static __device__ __forceinline__ TileSpan of_range(int64_t seen_lo, int64_t seen_hi, int64_t all_lo,
                                                        int64_t all_hi, bool ragged, int64_t count) {
        seen_lo = max(seen_lo, static_cast<int64_t>(0));
        seen_hi = min(seen_hi, count - 1);
        if (seen_lo > seen_hi) return TileSpan{1, 0, 1, 0};
        all_lo = max(all_lo, static_cast<int64_t>(0));
        all_hi = min(all_hi, count - 1);
        TileSpan span{static_cast<int>(seen_lo / BK), static_cast<int>(seen_hi / BK), 1, 0};
        if (!ragged && all_lo <= all_hi) {
            span.full_lo = static_cast<int>((all_lo + BK - 1) / BK);
            span.full_hi = static_cast<int>(min((all_hi + 1) / BK, count / BK)) - 1;
        }
        return span;
    }
};

// Which keys each query sees, for one batch entry. Tile states come from the formula of a generated
// mask or from the host's per-tile states (documents, dense); a tile that reaches past m or n is
// never full, so a full tile needs no check at all.
struct MaskView {
    const AttentionArgs& a;
    const uint8_t* states;
    const uint8_t* dense;
    const int64_t* ids;
    int64_t b;

    __device__ __forceinline__ uint8_t tile_state(int64_t h, int64_t qt, int64_t kt) const {
        const int64_t r0 = qt * BQ, r1 = min(r0 + BQ, a.m) - 1;
        const int64_t c0 = kt * BK, c1 = min(c0 + BK, a.n) - 1;
        const int64_t offset = a.n - a.m;
        uint8_t state;
        switch (a.mask.kind) {
        case AC::MASK_FULL: state = TILE_FULL; break;
        case AC::MASK_CAUSAL:
            state = c0 > r1 + offset ? TILE_EMPTY : (c1 <= r0 + offset ? TILE_FULL : TILE_PARTIAL);
            break;
        case AC::MASK_WINDOW: {
            const int64_t i0 = r0 + offset, i1 = r1 + offset, w = a.mask.window;
            state = (c0 > i1 || c1 <= i0 - w) ? TILE_EMPTY : ((c1 <= i0 && c0 > i1 - w) ? TILE_FULL : TILE_PARTIAL);
            break;
        }
        default: return stored_tile_state(h, qt, kt);
        }
        if (state == TILE_FULL && (c0 + BK > a.n || r0 + BQ > a.m)) state = TILE_PARTIAL;
        return state;
    }
    // tile_state of a mask with stored tile states (documents, dense).
    __device__ __forceinline__ uint8_t stored_tile_state(int64_t h, int64_t qt, int64_t kt) const {
        const uint8_t state =
            states[b * a.mask.states_batch_stride + h * a.mask.states_head_stride + qt * a.col_tiles + kt];
        return state == TILE_FULL && ((kt + 1) * BK > a.n || (qt + 1) * BQ > a.m) ? TILE_PARTIAL : state;
    }

    // For a formula mask (full, causal, window): every key tile's state for query tile qt (as a
    // query tile: none past m). Query i sits at key position i + n - m and sees keys [first(i),
    // last(i)]; both ends grow with i, so the tile's rows r0 .. r1 see [first(r0), last(r1)]
    // together and each all of [first(r1), last(r0)].
    __device__ __forceinline__ TileSpan formula_span(int64_t qt) const {
        const int64_t r0 = qt * BQ, r1 = min(r0 + BQ, a.m) - 1;
        if (r0 > r1) return TileSpan{1, 0, 1, 0};
        const int64_t shift = a.n - a.m;
        auto first = [&](int64_t i) {
            return a.mask.kind == AC::MASK_WINDOW ? i + shift - a.mask.window + 1 : static_cast<int64_t>(0);
        };
        auto last = [&](int64_t i) { return a.mask.kind == AC::MASK_FULL ? a.n - 1 : i + shift; };
        return TileSpan::of_range(first(r0), last(r1), first(r1), last(r0), r0 + BQ > a.m, a.n);
    }
    // The same from the keys' side: every query tile's state for key tile kt (none past n). Key j
    // is seen by the queries [first(j), last(j)], both ends growing with j.
    __device__ __forceinline__ TileSpan formula_query_span(int64_t kt) const {
        const int64_t c0 = kt * BK, c1 = min(c0 + BK, a.n) - 1;
        if (c0 > c1) return TileSpan{1, 0, 1, 0};
        const int64_t shift = a.n - a.m;
        auto first = [&](int64_t j) { return a.mask.kind == AC::MASK_FULL ? static_cast<int64_t>(0) : j - shift; };
        auto last = [&](int64_t j) {
            return a.mask.kind == AC::MASK_WINDOW ? j - shift + a.mask.window - 1 : a.m - 1;
        };
        return TileSpan::of_range(first(c0), last(c1), first(c1), last(c0), c0 + BK > a.n, a.m);
    }

    // Whether the mask is generated (full, causal, window): each query then sees one run of keys,
    // and each key is seen by one run of queries.
    __device__ __forceinline__ bool generated() const { return a.mask.kind <= AC::MASK_WINDOW; }

    // Clamps the run [first, last] of a generated mask to the offsets [lo, hi] from base of a
    // span of len (empty when lo > hi).
    static __device__ __forceinline__ void clamp_run(int64_t first, int64_t last, int64_t base, int len, int& lo,
                                                     int& hi) {
        lo = static_cast<int>(max(min(first - base, static_cast<int64_t>(len)), static_cast<int64_t>(0)));
        hi = static_cast<int>(max(min(last - base, static_cast<int64_t>(len) - 1), static_cast<int64_t>(-1)));
    }

    // For a generated mask: the keys j0 .. j0 + len - 1 that query i sees, as offsets [lo, hi].
    __device__ __forceinline__ void key_run(int64_t i, int64_t j0, int len, int& lo, int& hi) const {
        const int64_t pos = i + a.n - a.m;
        const int64_t last = i >= a.m ? -1 : (a.mask.kind == AC::MASK_FULL ? a.n - 1 : min(pos, a.n - 1));
        const int64_t first = a.mask.kind == AC::MASK_WINDOW ? pos - a.mask.window + 1 : 0;
        clamp_run(first, last, j0, len, lo, hi);
    }

    // For a generated mask: the queries i0 .. i0 + len - 1 that see key j, as offsets [lo, hi].
    __device__ __forceinline__ void query_run(int64_t j, int64_t i0, int len, int& lo, int& hi) const {
        const int64_t shift = a.n - a.m;  // query i sits at key position i + shift
        const int64_t first = a.mask.kind == AC::MASK_FULL ? 0 : max(j - shift, static_cast<int64_t>(0));
        const int64_t last =
            j >= a.n ? -1 : (a.mask.kind == AC::MASK_WINDOW ? min(j - shift + a.mask.window - 1, a.m - 1) : a.m - 1);
        clamp_run(first, last, i0, len, lo, hi);
    }

    // For a generated mask: the key tiles [first, last] holding every key that a query of
    // [i_first, i_last] sees (first > last when none). Tiles inside may still be empty.
    __device__ __forceinline__ void key_tiles(int64_t i_first, int64_t i_last, int64_t& first, int64_t& last) const {
        const int64_t shift = a.n - a.m;  // query i sits at key position i + shift
        i_last = min(i_last, a.m - 1);
        int64_t lo = 0, hi = a.n - 1;
        if (a.mask.kind != AC::MASK_FULL) hi = min(hi, i_last + shift);
        if (a.mask.kind == AC::MASK_WINDOW) lo = max(lo, i_first + shift - a.mask.window + 1);
        first = lo / BK;
        last = (i_first > i_last || lo > hi) ? first - 1 : hi / BK;
    }

    // For a generated mask: the query tiles [first, last] holding every query that sees a key of
    // [j_first, j_last] (first > last when none). Tiles inside may still be empty.
    __device__ __forceinline__ void query_tiles_of(int64_t j_first, int64_t j_last, int64_t& first,
                                                   int64_t& last) const {
        const int64_t shift = a.n - a.m;
        j_last = min(j_last, a.n - 1);
        int64_t lo = 0, hi = a.m - 1;
        if (a.mask.kind != AC::MASK_FULL) lo = max(lo, j_first - shift);
        if (a.mask.kind == AC::MASK_WINDOW) hi = min(hi, j_last - shift + a.mask.window - 1);
        first = lo / BQ;
        last = (j_first > j_last || lo > hi) ? first - 1 : hi / BQ;
    }

    // MASK_RUNS (documents whose ids form one contiguous run each; m == n): `ids` then holds per
    // position p of the batch entry the first (low 32 bits) and last (high 32 bits) position of
    // p's document. Query i sees keys [first(i), causal ? i : last(i)] and key j is seen by the
    // queries [causal ? j : first(j), last(j)]. Both ends of either run never decrease with the
    // position and the runs of neighbouring positions meet or overlap, so the keys that a run of
    // queries sees form one run (and the queries that see a run of keys): every tile of the
    // ranges below holds a query (key) of the run.
    __device__ __forceinline__ int2 document_of(int64_t p) const {
        const uint64_t r = static_cast<uint64_t>(__ldg(ids + b * a.n + p));
        return make_int2(static_cast<int>(r & 0xffffffffu), static_cast<int>(r >> 32));
    }
    // The run of the other side that position p (below m == n) sees: as a query its keys, as a
    // key its queries.
    __device__ __forceinline__ int2 runs_seen(int64_t p, bool as_query) const {
        int2 run = document_of(p);
        if (a.mask.doc_causal) {
            if (as_query) run.y = static_cast<int>(p);
            else run.x = static_cast<int>(p);
        }
        return run;
    }
    // What position p sees of the other side's base .. base + len - 1, as offsets [lo, hi]
    // (key_run / query_run of a generated mask; nothing past m == n).
    __device__ __forceinline__ void runs_run(int64_t p, bool as_query, int64_t base, int len, int& lo, int& hi) const {
        const int2 run = p < a.n ? runs_seen(p, as_query) : make_int2(0, -1);
        clamp_run(run.x, run.y, base, len, lo, hi);
    }
    // The tiles of `tile` positions holding what positions p_first .. p_last see together
    // (key_tiles / query_tiles_of of a generated mask; first > last when none).
    __device__ __forceinline__ void runs_tiles(int64_t p_first, int64_t p_last, bool as_query, int tile,
                                               int64_t& first, int64_t& last) const {
        p_last = min(p_last, a.n - 1);
        if (p_first > p_last) {
            first = 0;
            last = -1;
            return;
        }
        first = runs_seen(p_first, as_query).x / tile;
        last = runs_seen(p_last, as_query).y / tile;
    }
    // What one span of positions (a query tile's rows, or a key tile's keys) sees of the other
    // side, loaded once: together the span sees [lo, hi], each position all of [full_lo,
    // full_hi]. `ragged`: the span's tile reaches past m (n), so no tile of it is full.
    struct RunSpan {
        int64_t lo, hi, full_lo, full_hi;
        bool ragged;
        // The state of the tile of this span and the other side's tile [x0, x0 + len) (len its
        // tile size, the tile clamped to `count` positions).
        __device__ __forceinline__ uint8_t state(int64_t x0, int len, int64_t count) const {
            const int64_t x1 = min(x0 + len, count) - 1;
            if (x0 > x1 || x1 < lo || x0 > hi) return TILE_EMPTY;
            const bool full = !ragged && x0 + len <= count && x0 >= full_lo && x1 <= full_hi;
            return full ? TILE_FULL : TILE_PARTIAL;
        }
        // The span as the other side's tile states (state(x * 64, 64, count) for every tile x).
        __device__ __forceinline__ TileSpan tiles(int64_t count) const {
            return TileSpan::of_range(lo, hi, full_lo, full_hi, ragged, count);
        }
    };
    // The span of tile t (of `tile` positions, queries or keys): its positions p0 .. p1 see
    // seen(p0).x .. seen(p1).y together, and each sees seen(p1).x .. seen(p0).y.
    __device__ __forceinline__ RunSpan runs_span(int64_t t, int tile, bool as_query) const {
        const int64_t p0 = t * tile, p1 = min(p0 + tile, a.n) - 1;
        if (p0 > p1) return RunSpan{1, 0, 1, 0, true};
        const int2 s0 = runs_seen(p0, as_query), s1 = runs_seen(p1, as_query);
        return RunSpan{s0.x, s1.y, s1.x, s0.y, p0 + tile > a.n};
    }

    // Whether query i of head h sees key j; false outside 0 <= i < m, 0 <= j < n.
    __device__ __forceinline__ bool keeps(int64_t h, int64_t i, int64_t j) const {
        if (i >= a.m || j >= a.n) return false;
        const int64_t pos = i + a.n - a.m;
        switch (a.mask.kind) {
        case AC::MASK_FULL: return true;
        case AC::MASK_CAUSAL: return j <= pos;
        case AC::MASK_WINDOW: return j <= pos && pos - j < a.mask.window;
        case AC::MASK_RUNS: {
            const int2 keys = runs_seen(i, true);
            return j >= keys.x && j <= keys.y;
        }
        default: return stored_keeps(h, i, j);
        }
    }
    // keeps of a stored mask (documents, dense), for 0 <= i < m, 0 <= j < n.
    __device__ __forceinline__ bool stored_keeps(int64_t h, int64_t i, int64_t j) const {
        if (a.mask.kind == AC::MASK_DOCUMENTS) {
            const int64_t* row = ids + b * a.m;
            return row[i] == row[j] && (!a.mask.doc_causal || j <= i);
        }
        const int64_t* s = a.mask.dense_strides;
        return dense[b * s[0] + h * s[1] + i * s[2] + j * s[3]] != 0;
    }
};

// How a kernel instance reads its mask: FORMULA (full, causal and window masks, in closed form),
// RUNS (documents whose ids form contiguous runs: MaskView's runs_*, read per position), STORED
// (tile states and entries in memory: other documents, dense masks). Every kernel that reads a
// mask has an instance of each (`generated`, `runs`, `stored` in its name); the host picks by the
// mask's kind. FORMULA and RUNS masks are "generated": each query sees one run of keys and each
// key is seen by one run of queries.
enum MaskFamily { FORMULA, RUNS, STORED };
template <int MASKS> struct KernelMask {
    MaskView view;
    __device__ __forceinline__ constexpr bool generated() const { return MASKS != STORED; }
    __device__ __forceinline__ uint8_t tile_state(int64_t h, int64_t qt, int64_t kt) const {
        if constexpr (MASKS == RUNS) return view.runs_span(qt, BQ, true).state(kt * BK, BK, view.a.n);
        else if constexpr (MASKS == STORED) return view.stored_tile_state(h, qt, kt);
        else return view.tile_state(h, qt, kt);
    }
    // A generated mask's every query tile state for key tile kt (TileSpan; empty past n).
    __device__ __forceinline__ TileSpan query_span(int64_t kt) const {
        if constexpr (MASKS == RUNS) return view.runs_span(kt, BK, false).tiles(view.a.m);
        else return view.formula_query_span(kt);
    }
    __device__ __forceinline__ void key_run(int64_t i, int64_t j0, int len, int& lo, int& hi) const {
        if constexpr (MASKS == RUNS) view.runs_run(i, true, j0, len, lo, hi);
        else view.key_run(i, j0, len, lo, hi);
    }
    __device__ __forceinline__ void query_run(int64_t j, int64_t i0, int len, int& lo, int& hi) const {
        if constexpr (MASKS == RUNS) view.runs_run(j, false, i0, len, lo, hi);
        else view.query_run(j, i0, len, lo, hi);
    }
    __device__ __forceinline__ void key_tiles(int64_t i_first, int64_t i_last, int64_t& first, int64_t& last) const {
        if constexpr (MASKS == RUNS) view.runs_tiles(i_first, i_last, true, BK, first, last);
        else view.key_tiles(i_first, i_last, first, last);
    }
    __device__ __forceinline__ void query_tiles_of(int64_t j_first, int64_t j_last, int64_t& first,
                                                   int64_t& last) const {
        if constexpr (MASKS == RUNS) view.runs_tiles(j_first, j_last, false, BQ, first, last);
        else view.query_tiles_of(j_first, j_last, first, last);
    }
    __device__ __forceinline__ bool keeps(int64_t h, int64_t i, int64_t j) const {
        if constexpr (MASKS == STORED) return i < view.a.m && j < view.a.n && view.stored_keeps(h, i, j);
        else return view.keeps(h, i, j);
    }
};

// The first item in (item, end) for which live(item) holds (end when none), the lanes of a warp
// testing 32 items at a time. Every lane of the warp must call it, with the same arguments; it
// replaces a serial walk whose every step waits on a load of the mask's tile states.
template <class Live>
__device__ __forceinline__ int64_t next_live(int64_t item, int64_t end, Live&& live) {
    const int lane = threadIdx.x & 31;
    for (int64_t base = item + 1; base < end; base += 32) {
        const int64_t candidate = base + lane;
        const unsigned found = __ballot_sync(0xffffffffu, candidate < end && live(candidate));
        if (found) return base + __ffs(found) - 1;
    }
    return end;
}

// *p += x, element by element: one 16-byte reduction in L2 from sm_90, four float atomics before.
__device__ __forceinline__ void red_add4(float4* p, float4 x) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w)
                 : "memory");
#else
    float* q = reinterpret_cast<float*>(p);
    atomicAdd(q, x.x);
    atomicAdd(q + 1, x.y);
    atomicAdd(q + 2, x.z);
    atomicAdd(q + 3, x.w);
#endif
}

// The layout of dq_accum, the f32 sum of dS K that the atomic backwards (Hopper's, the portable
// one-pass) add into with red_add4, straight from mma accumulators: for each (batch, head) and
// query tile of BQ rows, COL_BLOCKS blocks of D / COL_BLOCKS head columns; in each, per 16-row
// fragment and 8-column tile, the float4 of every lane (rows g and g + 8, columns 2 t and 2 t + 1,
// g = lane / 4, t = lane % 4). dq_fragment is the float4 of the fragment at (row, col) of tile bh_tile.
template <int D, int COL_BLOCKS>
__device__ __forceinline__ float4* dq_fragment(float4* dq_accum, int64_t bh_tile, int row16, int col8, int lane) {
    constexpr int COLS = D / COL_BLOCKS;
    const int64_t block = bh_tile * COL_BLOCKS + col8 * 8 / COLS;
    return dq_accum + ((block * (BQ / 16) + row16) * (COLS / 8) + col8 % (COLS / 8)) * 32 + lane;
}

// dq = scale * dq_accum (T [b, h, m, d] by dq_strides, rows 16-byte aligned) from that layout. A
// block of DQ_ROWS_THREADS threads per (query tile, column block) unit, grid-strided: it reads the
// unit's float4 in order (coalesced), parks the scaled values as T in a row-major shared tile, then
// writes whole 16-byte pieces of rows (rows below m, columns below d), so that every 32-byte sector
// of dq is written by one instruction.
template <typename T, int D, int COL_BLOCKS>
__device__ __forceinline__ void dq_rows(const float4* __restrict__ dq_accum, T* __restrict__ dq, const AttentionArgs& a) {
    constexpr int THREADS = AC::DQ_ROWS_THREADS, COLS = D / COL_BLOCKS, PER_BLOCK = BQ / 16 * COLS / 8 * 32;
    constexpr int LD = COLS + 8, PIECES = BQ * COLS / 8;  // shared row stride (elements); 16-byte pieces
    static_assert(PER_BLOCK % THREADS == 0 && COLS % 8 == 0, "whole float4 rounds and 16-byte pieces");
    __shared__ __align__(16) T tile[BQ * LD];
    const int64_t units = a.batch * a.heads * a.row_tiles * COL_BLOCKS;
    for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
        const int64_t bh_tile = unit / COL_BLOCKS, bh = bh_tile / a.row_tiles, row0 = (bh_tile % a.row_tiles) * BQ;
        const int64_t col0 = (unit % COL_BLOCKS) * COLS;
        T* dq_head = dq + row_offset(a.dq_strides, bh / a.heads, bh % a.heads, 0);
        const float4* src = dq_accum + unit * PER_BLOCK;
#pragma unroll
        for (int k = 0; k < PER_BLOCK / THREADS; ++k) {
            const int within = k * THREADS + static_cast<int>(threadIdx.x), lane = within % 32, fragment = within / 32;
            const int row = fragment / (COLS / 8) * 16 + lane / 4, col = fragment % (COLS / 8) * 8 + 2 * (lane % 4);
            const float4 x = src[within];
            fastops::from_float2<T>(tile + row * LD + col, x.x * a.scale, x.y * a.scale);
            fastops::from_float2<T>(tile + (row + 8) * LD + col, x.z * a.scale, x.w * a.scale);
        }
        __syncthreads();
        for (int piece = threadIdx.x; piece < PIECES; piece += THREADS) {
            const int row = piece / (COLS / 8), col = piece % (COLS / 8) * 8;
            if (row0 + row < a.m && col0 + col < a.d)
                *reinterpret_cast<uint4*>(dq_head + (row0 + row) * a.dq_strides[2] + col0 + col) =
                    *reinterpret_cast<const uint4*>(tile + row * LD + col);
        }
        __syncthreads();  // the tile is free for the next unit
    }
}

}  // namespace
