// What the matmul kernels (src/cuda/matmul.cu) and the Hopper ones (src/cuda/sm90/argmin.cu,
// src/cuda/sm90/span.cu) share: the operand / problem structs mirrored by src/matmul/core/, the
// argmin arguments and its ordered 64-bit keys, the span products' arguments, the block-to-tile
// mappings.
#pragma once
#include <cstdint>
#include "fastops_constants.cuh"

namespace {

enum LoadMode : int {
    K_CONTIGUOUS = fastops_constants::matmul::K_CONTIGUOUS,
    OUTER_CONTIGUOUS = fastops_constants::matmul::OUTER_CONTIGUOUS,
    STRIDED = fastops_constants::matmul::STRIDED
};

// One operand as the kernels see it: element strides of a [batch, outer, k] view (outer = m for
// A, n for B). Mirrors `OperandArgs` in src/matmul/core/ (repr(C)).
struct Operand {
    int64_t batch_stride;
    int64_t outer_stride;
    int64_t k_stride;
    int32_t mode;        // LoadMode
    int32_t vectorised;  // 1: 4-element runs along the contiguous dim are aligned; 2: 8-element runs too
};
static_assert(sizeof(Operand) == 32, "Operand is mirrored by a Rust #[repr(C)] struct of 32 bytes");

// Mirrors `ProblemArgs` in src/matmul/core/.
struct Problem {
    Operand a, b;
    int64_t batch, m, n, k;
};
static_assert(sizeof(Problem) == 96, "Problem is mirrored by a Rust #[repr(C)] struct of 96 bytes");

// Decodes block `blk` of a grid laid out as [batch][row tile][column group].
struct TileIndex {
    int64_t batch, row_tile, col_group;
    TileIndex() = default;
    __device__ __forceinline__ TileIndex(uint64_t blk, int64_t row_tiles, int64_t col_groups) {
        col_group = blk % col_groups;
        const uint64_t rest = blk / col_groups;
        row_tile = rest % row_tiles;
        batch = rest / row_tiles;
    }
};

// Float bits mapped so unsigned order is numeric order (a sign-dependent xor), every NaN folded
// into one positive NaN that sorts above +inf (a row of NaN scores still gets an index). -0 sorts
// just below +0: the epilogue folds a -0 bias into +0, so a score is -0 only when it rounds to
// zero from below.
__device__ __forceinline__ uint32_t ordered_bits(float v) {
    const uint32_t bits = isnan(v) ? 0x7fc00000u : __float_as_uint(v);
    return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

__device__ __forceinline__ unsigned long long min_key(unsigned long long x, unsigned long long y) {
    return x < y ? x : y;
}

// Mirrors `ArgminArgs` in src/matmul/argmin/cuda.rs.
struct ArgminArgs {
    int64_t col_groups;  // blocks sharing a row tile, each taking every col_groups-th column tile
    float scale;
};
static_assert(sizeof(ArgminArgs) == 16, "ArgminArgs is mirrored by a Rust #[repr(C)] struct of 16 bytes");

// Mirrors `SpanArgs` in src/matmul/backward/cuda.rs.
struct SpanArgs {
    int64_t spans_batch_stride;  // u32 pairs between batches of the spans (0: one set for all)
    // masked: the gradient operand (A for grad_a, B for grad_b) is the unmasked output gradient
    // g [rows, cols], and the kernel applies the mask as the stages land (async core only; the
    // host masks g first for the other cores). The u8 mask's element strides (batch 0 when
    // shared) and the plan's: tiles between batches (0 when shared), tiles along a row.
    int64_t mask_batch_stride, mask_row_stride, mask_col_stride;
    int64_t plan_batch_stride, plan_col_tiles;
    int32_t by_cols;             // spans indexed by the output's column tile (else its row tile)
    int32_t masked;
};
static_assert(sizeof(SpanArgs) == 56, "SpanArgs is mirrored by a Rust #[repr(C)] struct of 56 bytes");

// The output tile of span-product block `blk`, longest spans first. Blocks start in index order
// and each runs as long as its span, so a grid laid out [batch][row tile][column tile] ends with a
// few long blocks on an otherwise idle GPU: with a causal mask (spans growing one tile per tile)
// a list-scheduling estimate leaves ~23% of the block slots idle over the grid at b = 64, 2048 x
// 2048, two blocks an SM. Here the spanned dim's tiles are outermost (then batch, then the other
// dim), walked from whichever end has the longer span in batch 0's spans: longest first for spans
// that grow or shrink monotonically along the tiles (causal, either orientation; windows and
// bands are even), and only an order, never a result, for any other mask.
__device__ __forceinline__ TileIndex span_tile(uint64_t blk, const uint32_t* spans, const Problem& p,
                                               const SpanArgs& sa, int64_t row_tiles, int64_t col_tiles) {
    const int64_t spanned = sa.by_cols ? col_tiles : row_tiles, other = sa.by_cols ? row_tiles : col_tiles;
    constexpr int64_t TILE_EDGE = fastops_constants::matmul::TILE;
    auto length = [&](int64_t t) {  // negative for an empty span
        return min(int64_t(spans[2 * t + 1]) * TILE_EDGE, p.k) - min(int64_t(spans[2 * t]) * TILE_EDGE, p.k);
    };
    const bool from_end = length(spanned - 1) > length(0);
    TileIndex tile;
    const int64_t o = static_cast<int64_t>(blk % static_cast<uint64_t>(other));
    const uint64_t rest = blk / static_cast<uint64_t>(other);
    tile.batch = static_cast<int64_t>(rest % static_cast<uint64_t>(p.batch));
    const int64_t rank = static_cast<int64_t>(rest / static_cast<uint64_t>(p.batch));
    const int64_t s = from_end ? spanned - 1 - rank : rank;
    tile.row_tile = sa.by_cols ? o : s;
    tile.col_group = sa.by_cols ? s : o;
    return tile;
}

}  // namespace
