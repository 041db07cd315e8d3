// What the matmul kernels (src/cuda/matmul.cu) and the Hopper argmin (src/cuda/sm90/argmin.cu)
// share: the operand / problem structs mirrored by src/matmul/core/, the argmin arguments and
// its ordered 64-bit keys, the block-to-tile mapping.
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

}  // namespace
