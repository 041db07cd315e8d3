// Tile summary of a u8 mask: for each tile_rows x tile_cols tile of each [rows, cols] matrix of
// the batch, 0 when no element is kept (nonzero), 1 when some are, 2 when all are. Any strides
// (elements of one byte); a block per tile, a grid-stride loop over tiles.
#include "common.cuh"

struct TileSummaryArgs {
    int64_t batch_stride, row_stride, col_stride;
    uint64_t rows, cols, row_tiles, col_tiles, tiles;
    uint32_t tile_rows, tile_cols;
};
static_assert(sizeof(TileSummaryArgs) == 72, "TileSummaryArgs is mirrored by a Rust #[repr(C)] struct of 72 bytes");

extern "C" __global__ void __launch_bounds__(fastops_constants::tile_summary::THREADS)
    tile_summary(const uint8_t* __restrict__ mask, uint8_t* __restrict__ states, TileSummaryArgs a) {
    for (uint64_t t = blockIdx.x; t < a.tiles; t += gridDim.x) {
        const uint64_t tj = t % a.col_tiles, ti = (t / a.col_tiles) % a.row_tiles, b = t / (a.col_tiles * a.row_tiles);
        const uint64_t r0 = ti * a.tile_rows, c0 = tj * a.tile_cols;
        const uint32_t nr = static_cast<uint32_t>(min(static_cast<uint64_t>(a.tile_rows), a.rows - r0));
        const uint32_t nc = static_cast<uint32_t>(min(static_cast<uint64_t>(a.tile_cols), a.cols - c0));
        const uint8_t* base = mask + static_cast<int64_t>(b) * a.batch_stride + static_cast<int64_t>(r0) * a.row_stride +
                              static_cast<int64_t>(c0) * a.col_stride;
        int any = 0, all = 1;
        for (uint32_t i = threadIdx.x; i < nr * nc; i += blockDim.x) {
            const uint32_t r = i / nc, c = i - r * nc;
            const bool keep = base[static_cast<int64_t>(r) * a.row_stride + static_cast<int64_t>(c) * a.col_stride] != 0;
            any |= keep;
            all &= keep;
        }
        any = __syncthreads_or(any);
        all = __syncthreads_and(all);
        if (threadIdx.x == 0) states[t] = static_cast<uint8_t>((any ? 1 : 0) + (all ? 1 : 0));
    }
}
