// small_fc_lopt: one optimizer step over many tensors at once (src/optim/small_fc_lopt/cuda.rs). A launch
// covers a group of up to GROUP tensors; its blocks walk a static list of fixed-size chunks of those
// tensors, so a model with hundreds of tensors costs a handful of launches, not thousands. In order:
//   lopt_square_sums: per matrix, the sums of g^2 over axis d0 and over axis d1 (the Adafactor
//                     reductions), straight from the gradient; lopt_square_sums_tiled takes the
//                     2-D matrices of 512+ columns by row / column tiles.
//   lopt_factors:     a block per matrix: the row / column accumulators (in place), the factors,
//                     and the sums of squares of the features that depend on a row or a column only.
//   lopt_stats:       the sums of the squares of the other normalised-feature inputs per tensor,
//                     taken with this step's momenta and rms, which it computes but does not store
//                     (it is bound by memory), and vectors' Adafactor accumulators, in place.
//   lopt_update_mma / lopt_update_fma: the momenta and rms advanced again and stored in place, the
//                     features rebuilt and normalised, the 39-32-32-2 MLP (f16 tensor cores with f32
//                     accumulation, or f32 FMAs), the parameter written in place.
// Every buffer is f32. The 11 time features are folded into the first layer's bias by the host.
#include "small_fc_lopt.cuh"

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Adds v (active lanes only) to base[idx], with one atomic per warp when every active lane has the
// same idx (a run along the reduced axis). Lane 0 must be active.
__device__ __forceinline__ void add_at(float* base, uint64_t idx, float v, bool active) {
    const uint64_t idx0 = __shfl_sync(FULL_MASK, idx, 0);
    if (__all_sync(FULL_MASK, !active || idx == idx0)) {
        v = warp_sum(active ? v : 0.0f);
        if ((threadIdx.x & 31) == 0) atomicAdd(base + idx0, v);
    } else if (active) {
        atomicAdd(base + idx, v);
    }
}

// Adds the block's sums of squared features into out[0..28] (or, with `store`, writes them there)
// and clears acc. The block's own sum is taken in a fixed order: only the atomic add across blocks
// depends on timing.
__device__ __forceinline__ void flush_sums(float (&acc)[FEATURES], float (*partial)[FEATURES], float* out,
                                           bool store = false) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) {
        const float v = warp_sum(acc[f]);
        if (lane == 0) partial[warp][f] = v;
        acc[f] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x < FEATURES) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += partial[w][threadIdx.x];
        if (store) {
            out[threadIdx.x] = v;
        } else {
            atomicAdd(out + threadIdx.x, v);
        }
    }
    __syncthreads();
}

// The sum over the removed axis of the elements that drop_axis(., inner, outer) maps to `o`, in
// index order and in f64: the deterministic form of the atomic reductions.
__device__ __forceinline__ float ordered_axis_sum(const float* __restrict__ src, uint64_t o, uint64_t inner,
                                                  uint64_t outer) {
    const uint64_t q = o / inner, base = q * outer + (o - q * inner), len = outer / inner;
    double sum = 0.0;
    for (uint64_t k = 0; k < len; ++k) sum += static_cast<double>(src[base + k * inner]);
    return static_cast<float>(sum);
}

}  // namespace

// Shared-memory slots per reduction for a run's partial sums, and chunks per run.
constexpr int SLOTS = 4096;
constexpr uint32_t RUN = fastops_constants::small_fc_lopt::SQUARE_SUM_RUN;

namespace {

// Where one run's squares go for one of the two reductions. The run (up to RUN consecutive
// chunks of one tensor) adds into shared-memory slots when its indices span at most SLOTS values
// ((quotients spanned) x inner), and flushes each slot with one global atomic; otherwise straight
// into the global sums. Either way lanes of a warp that share an index add once.
struct Reduction {
    Divisor inner, outer;
    float* sums;
    uint64_t lo, range;
    bool shared;

    __device__ __forceinline__ Reduction(const Divisor& in, const Divisor& out, float* sums_, uint64_t start,
                                         uint64_t end, bool wide)
        : inner(in), outer(out), sums(sums_) {
        const uint64_t q_lo = quotient(start, out, wide), q_hi = quotient(end - 1, out, wide);
        lo = q_lo * in.d;
        range = (q_hi - q_lo + 1) * in.d;
        shared = range <= SLOTS;
    }
};

// Sums of g^2 of elements [start, end) of matrix m into its row and column sums.
__device__ __forceinline__ void square_sums_span(const LoptMeta& m, const float* __restrict__ g, uint64_t start,
                                                 uint64_t end, const Buffers& buf, float (*slots)[SLOTS]) {
    const uint32_t lane = threadIdx.x & 31;
    const Reduction red[2] = {Reduction(m.inner0, m.outer0, buf.row_sum + m.row_sum, start, end, m.wide),
                              Reduction(m.inner1, m.outer1, buf.col_sum + m.col_sum, start, end, m.wide)};
    const bool any_shared = red[0].shared || red[1].shared;
    if (any_shared) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (!red[r].shared) continue;
            for (uint32_t j = threadIdx.x; j < red[r].range; j += THREADS) slots[r][j] = 0.0f;
        }
        __syncthreads();
    }
    for (uint64_t base = start + (threadIdx.x & ~31u); base < end; base += THREADS) {
        const uint64_t e = base + lane;
        const bool active = e < end;
        const float v = active ? g[e] * g[e] : 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint64_t idx = drop_axis(e, red[r].inner, red[r].outer, m.wide);
            if (red[r].shared) {
                add_at(slots[r], idx - red[r].lo, v, active);
            } else {
                add_at(red[r].sums, idx, v, active);
            }
        }
    }
    if (any_shared) {
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (!red[r].shared) continue;
            for (uint32_t j = threadIdx.x; j < red[r].range; j += THREADS) {
                const float v = slots[r][j];
                if (v != 0.0f) atomicAdd(red[r].sums + red[r].lo + j, v);
            }
        }
        __syncthreads();  // the slots are free for the next span
    }
}

}  // namespace

// Blocks take runs of RUN consecutive chunks (a span per tensor in the run).
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_square_sums(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                     uint32_t first, StepTensors ptrs, Buffers buf) {
    __shared__ float slots[2][SLOTS];
    for (uint32_t run = blockIdx.x * RUN; run < n_chunks; run += gridDim.x * RUN) {
        const uint32_t run_end = min(run + RUN, n_chunks);
        for (uint32_t c = run; c < run_end;) {
            const Chunk ch = chunks[c];
            uint32_t last = c;
            while (last + 1 < run_end && chunks[last + 1].tensor == ch.tensor) ++last;
            c = last + 1;
            const LoptMeta& m = meta[ch.tensor];
            const float* __restrict__ g = ptrs.grad[ch.tensor - first];
            if (!m.factored || m.tiled || g == nullptr) continue;
            square_sums_span(m, g, ch.start, min(chunks[last].start + CHUNK, m.n), buf, slots);
        }
    }
}

// The deterministic square sums (set_deterministic / LOptBackend::deterministic): blockIdx.y is
// the tensor of the group, x a block of its row sums then of its column sums, each sum taken in a
// fixed order and written once (no atomics); the gradient is read twice. A sum over a contiguous
// axis takes a warp (lane j adds elements j, j + 32, ..., then a fixed butterfly); sums over a
// strided axis take 32 per block, the block's 8 warps adding interleaved elements (warp w takes
// k = w, w + 8, ..., its lanes adjacent sums, so each load is one 128-byte row segment), then the
// 8 partial sums added in warp order.
constexpr int STRIDED_SUMS = 32;
static_assert(THREADS == STRIDED_SUMS * WARPS, "a block is 32 sums x 8 warps");

__host__ __device__ __forceinline__ uint64_t ordered_sum_blocks(uint64_t count, uint64_t inner) {
    const uint64_t per_block = inner == 1 ? WARPS : STRIDED_SUMS;
    return (count + per_block - 1) / per_block;
}

__device__ __forceinline__ void ordered_square_sums(const float* __restrict__ g, float* __restrict__ sums,
                                                    uint64_t count, uint64_t inner, uint64_t outer, uint64_t block,
                                                    float (*partial)[STRIDED_SUMS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (inner == 1) {
        const uint64_t o = block * WARPS + warp, len = outer;
        if (o >= count) return;  // warp-uniform
        const float* src = g + o * outer;
        float sum = 0.0f;
        for (uint64_t k = lane; k < len; k += 32) sum = fmaf(src[k], src[k], sum);
        sum = warp_sum(sum);
        if (lane == 0) sums[o] = sum;
        return;
    }
    const uint64_t o = block * STRIDED_SUMS + lane, len = outer / inner;
    float sum = 0.0f;
    if (o < count) {
        const uint64_t q = o / inner, base = q * outer + (o - q * inner);
        for (uint64_t k = warp; k < len; k += WARPS) {
            const float v = g[base + k * inner];
            sum = fmaf(v, v, sum);
        }
    }
    partial[warp][lane] = sum;
    __syncthreads();
    if (warp == 0 && o < count) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += partial[w][lane];
        sums[o] = total;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_square_sums_ordered(const LoptMeta* __restrict__ meta, uint32_t first, StepTensors ptrs, Buffers buf) {
    const LoptMeta& m = meta[first + blockIdx.y];
    const float* __restrict__ g = ptrs.grad[blockIdx.y];
    if (!m.factored || g == nullptr) return;
    __shared__ float partial[WARPS][STRIDED_SUMS];
    const uint64_t row_blocks = ordered_sum_blocks(m.rows, m.inner0.d);
    if (blockIdx.x < row_blocks) {
        ordered_square_sums(g, buf.row_sum + m.row_sum, m.rows, m.inner0.d, m.outer0.d, blockIdx.x, partial);
    } else {
        ordered_square_sums(g, buf.col_sum + m.col_sum, m.cols, m.inner1.d, m.outer1.d, blockIdx.x - row_blocks,
                            partial);
    }
}

using fastops_constants::small_fc_lopt::TILE_COLS;  // four columns per thread
static_assert(TILE_COLS == 4 * THREADS, "a tile row is one float4 per thread");
constexpr int ROW_BATCH = 8;

// Mirrors `SumTile` in src/optim/small_fc_lopt/cuda.rs: rows [row_start, row_start + rows) and columns
// [col_start, col_start + TILE_COLS) of a row-major 2-D gradient with `cols` columns.
struct SumTile {
    uint32_t tensor, rows;
    uint64_t row_start;
    uint32_t col_start, cols;
    uint32_t rows_into_col_sum, pad;
};
static_assert(sizeof(SumTile) == 32, "SumTile is mirrored by a Rust #[repr(C)] struct of 32 bytes");

// The square sums of 2-D gradients, a tile per block iteration: each thread owns four columns of
// the tile and keeps their sums in registers; rows go in batches of ROW_BATCH (that many loads in
// flight per thread), each row's sum reduced over the warp, then over the block's warps. One
// global atomic per row and per column of a tile, none on shared memory.
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_square_sums_tiled(const LoptMeta* __restrict__ meta, const SumTile* __restrict__ tiles, uint32_t n_tiles,
                           uint32_t first, StepTensors ptrs, Buffers buf) {
    __shared__ float partial[2][ROW_BATCH][WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int parity = 0;
    for (uint32_t i = blockIdx.x; i < n_tiles; i += gridDim.x) {
        const SumTile tile = tiles[i];
        const float* __restrict__ g = ptrs.grad[tile.tensor - first];
        if (g == nullptr) continue;
        const LoptMeta& m = meta[tile.tensor];
        float* row_sums = tile.rows_into_col_sum ? buf.col_sum + m.col_sum : buf.row_sum + m.row_sum;
        float* col_sums = tile.rows_into_col_sum ? buf.row_sum + m.row_sum : buf.col_sum + m.col_sum;
        // Four adjacent columns per thread (one 16-byte load) when rows are 16-byte aligned,
        // else four columns THREADS apart.
        const bool wide_loads = tile.cols % 4 == 0 && reinterpret_cast<uintptr_t>(g) % 16 == 0;
        uint32_t col[4];
        bool in[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            col[j] = tile.col_start + (wide_loads ? 4 * threadIdx.x + j : threadIdx.x + THREADS * j);
            in[j] = col[j] < tile.cols;
        }
        float col_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint32_t r0 = 0; r0 < tile.rows; r0 += ROW_BATCH) {
            float4 v[ROW_BATCH];
#pragma unroll
            for (int r = 0; r < ROW_BATCH; ++r) {
                v[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (r0 + r >= tile.rows) continue;
                const float* row = g + (tile.row_start + r0 + r) * tile.cols;
                if (wide_loads) {
                    if (in[0]) v[r] = *reinterpret_cast<const float4*>(row + col[0]);
                } else {
                    v[r].x = in[0] ? row[col[0]] : 0.0f;
                    v[r].y = in[1] ? row[col[1]] : 0.0f;
                    v[r].z = in[2] ? row[col[2]] : 0.0f;
                    v[r].w = in[3] ? row[col[3]] : 0.0f;
                }
            }
            float row_part[ROW_BATCH];
#pragma unroll
            for (int r = 0; r < ROW_BATCH; ++r) {
                const float a = v[r].x * v[r].x, b = v[r].y * v[r].y, c = v[r].z * v[r].z, d = v[r].w * v[r].w;
                col_acc[0] += a;
                col_acc[1] += b;
                col_acc[2] += c;
                col_acc[3] += d;
                row_part[r] = warp_sum((a + b) + (c + d));
            }
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < ROW_BATCH; ++r) partial[parity][r][warp] = row_part[r];
            }
            __syncthreads();
            // The next batch writes the other buffer, so one barrier per batch is enough.
            if (threadIdx.x < ROW_BATCH && r0 + threadIdx.x < tile.rows) {
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) sum += partial[parity][threadIdx.x][w];
                atomicAdd(row_sums + tile.row_start + r0 + threadIdx.x, sum);
            }
            parity ^= 1;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (in[j]) atomicAdd(col_sums + col[j], col_acc[j]);
        }
    }
}

// Rows a thread of lopt_factors loads before it uses any.
constexpr int FACTOR_ROWS = 4;

// A block per matrix: row and column accumulators from the means of g^2 (+1e-30, as the
// reference adds it to every square), the per-batch means of the rows over axis d1, then the
// factors: row_factor = srsqrt(row / (mean over d1 + 1e-9)), col_factor = srsqrt(col).
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_factors(const LoptMeta* __restrict__ meta, uint32_t first, uint32_t count, StepTensors ptrs,
                 Buffers buf, Decays d, uint32_t deterministic) {
    __shared__ float partial[WARPS][FEATURES];
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
        const LoptMeta& m = meta[first + i];
        if (!m.factored || m.n == 0 || ptrs.grad[i] == nullptr) continue;
        // The features that depend on the row or the column only (13..24: the accumulators and
        // their inverse square roots): their per-tensor sums of squares are taken here, once per
        // row and column and weighted by the elements sharing it, instead of once per element.
        float feature_sq[FEATURES];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) feature_sq[f] = 0.0f;
        float* row = buf.row + m.row;
        float* col = buf.col + m.col;
        // FACTOR_ROWS rows a thread, THREADS apart, loaded before any is used (this block alone
        // walks the matrix, so the loop's latency is the kernel's). Loads past the last row read
        // the last row again and are not used.
        for (uint64_t base = threadIdx.x & ~31u; base < m.rows; base += THREADS * FACTOR_ROWS) {
            float mean[FACTOR_ROWS], prev[FACTOR_ROWS][3];
#pragma unroll
            for (int j = 0; j < FACTOR_ROWS; ++j) {
                const uint64_t r = min(base + j * THREADS + lane, m.rows - 1);
                mean[j] = buf.row_sum[m.row_sum + r] * m.inv_size0 + 1e-30f;
#pragma unroll
                for (int k = 0; k < 3; ++k) prev[j][k] = row[k * m.rows + r];
            }
#pragma unroll
            for (int j = 0; j < FACTOR_ROWS; ++j) {
                if (base + j * THREADS >= m.rows) break;  // warp-uniform: add_at needs lane 0 active
                const uint64_t r = base + j * THREADS + lane;
                const bool active = r < m.rows;
                const uint64_t b = drop_axis(r, m.row_inner1, m.row_outer1, m.wide);
#pragma unroll
                for (int k = 0; k < 3; ++k) {
                    float v = 0.0f;
                    if (active) {
                        v = d.adafactor[k] * prev[j][k] + d.adafactor_rest[k] * mean[j];
                        row[k * m.rows + r] = v;
                        const float inv = 1.0f / sqrtf(v + 1e-8f);  // as the per-element feature
                        feature_sq[13 + k] += v * v;
                        feature_sq[19 + k] += inv * inv;
                    }
                    if (!deterministic) add_at(buf.batch_sum + m.batch + k * m.batches, b, v, active);
                }
            }
        }
        for (uint64_t c = threadIdx.x; c < m.cols; c += THREADS) {
            const float mean = buf.col_sum[m.col_sum + c] * m.inv_size1 + 1e-30f;
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                const float v = d.adafactor[k] * col[k * m.cols + c] + d.adafactor_rest[k] * mean;
                col[k * m.cols + c] = v;
                buf.col_factor[m.col + k * m.cols + c] = srsqrt(v);
                const float inv = 1.0f / sqrtf(v + 1e-8f);
                feature_sq[16 + k] += v * v;
                feature_sq[22 + k] += inv * inv;
            }
        }
        // Each row index is shared by size(d0) elements, each column index by size(d1).
        const float per_row = static_cast<float>(m.n / m.rows), per_col = static_cast<float>(m.n / m.cols);
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            feature_sq[13 + k] *= per_row;
            feature_sq[19 + k] *= per_row;
            feature_sq[16 + k] *= per_col;
            feature_sq[22 + k] *= per_col;
        }
        // Also a barrier: the batch sums are complete after it (only this block adds to them),
        // and the row accumulators are all written.
        flush_sums(feature_sq, partial, buf.feat_sum + (first + i) * FEATURES);
        if (deterministic) {
            const uint64_t inner = m.row_inner1.d, outer = m.row_outer1.d, len = outer / inner;
            if (len >= 4 * THREADS && m.batches <= 64) {
                // Few long sums: the block takes each, thread t adding elements t, t + THREADS,
                // ..., then the warps' sums in warp order.
                for (uint64_t b = 0; b < m.batches; ++b) {
                    const uint64_t q = b / inner, base = q * outer + (b - q * inner);
                    for (int k = 0; k < 3; ++k) {
                        const float* src = row + k * m.rows + base;
                        float sum = 0.0f;
                        for (uint64_t j = threadIdx.x; j < len; j += THREADS) sum += src[j * inner];
                        sum = warp_sum(sum);
                        if (lane == 0) partial[threadIdx.x >> 5][0] = sum;
                        __syncthreads();
                        if (threadIdx.x == 0) {
                            float total = 0.0f;
                            for (int w = 0; w < WARPS; ++w) total += partial[w][0];
                            buf.batch_sum[m.batch + k * m.batches + b] = total;
                        }
                        __syncthreads();
                    }
                }
            } else {
                for (uint64_t b = threadIdx.x; b < m.batches; b += THREADS) {
#pragma unroll
                    for (int k = 0; k < 3; ++k)
                        buf.batch_sum[m.batch + k * m.batches + b] =
                            ordered_axis_sum(row + k * m.rows, b, inner, outer);
                }
                __syncthreads();
            }
        }
        for (uint64_t base = threadIdx.x; base < m.rows; base += THREADS * FACTOR_ROWS) {
            float acc[FACTOR_ROWS][3], batch[FACTOR_ROWS][3];
#pragma unroll
            for (int j = 0; j < FACTOR_ROWS; ++j) {
                const uint64_t r = min(base + j * THREADS, m.rows - 1);
                const uint64_t b = drop_axis(r, m.row_inner1, m.row_outer1, m.wide);
#pragma unroll
                for (int k = 0; k < 3; ++k) {
                    acc[j][k] = row[k * m.rows + r];
                    batch[j][k] = __ldcg(buf.batch_sum + m.batch + k * m.batches + b);
                }
            }
#pragma unroll
            for (int j = 0; j < FACTOR_ROWS; ++j) {
                const uint64_t r = base + j * THREADS;
                if (r >= m.rows) break;
#pragma unroll
                for (int k = 0; k < 3; ++k) {
                    const float mean = batch[j][k] * m.inv_size1;
                    buf.row_factor[m.row + k * m.rows + r] = srsqrt(acc[j][k] / (mean + 1e-9f));
                }
            }
        }
    }
}

namespace {

// lopt_stats over one chunk: the squared features of this step's accumulators into acc (the
// momenta and rms themselves are stored by the update pass; a vector's Adafactor accumulators
// here). The pass is bound by the loads in flight: each thread loads STATS_ELEMS elements (THREADS
// apart) before it uses any of them, the chunk's tail one at a time. One loop per kind of tensor:
// with the kind a run-time branch inside one loop, ptxas spilled a matrix's six factors around it.
// Two elements a thread and two resident blocks (114 registers) keep ~85% of DRAM's peak busy on
// an H100; four elements (128 registers) measured the same.
constexpr uint32_t STATS_ELEMS = 2;
constexpr uint32_t STATS_BLOCKS = 2;
template <bool WIDE>
__device__ __forceinline__ void stats_span(const ChunkStreams& c, const Decays& d, float (&acc)[FEATURES]) {
    const uint32_t count = c.count;
    auto loop = [&](auto kind) {
        constexpr bool factored = decltype(kind)::value;
        auto add = [&](Inputs& s, uint32_t o) {
            advance_moments(d, s);
            if (!factored) advance_vector_accumulators(c, o, d, s);
            float x[FEATURES];
            features<false>(factored, s, x);
#pragma unroll
            for (int f = 0; f < FEATURES; ++f) {
                // A matrix's row / column features (13..24) are summed by lopt_factors.
                if (!(factored && f >= 13 && f < 25)) acc[f] = fmaf(x[f], x[f], acc[f]);
            }
        };
        constexpr uint32_t E = STATS_ELEMS;
        uint32_t o = threadIdx.x;
        for (; o + (E - 1) * THREADS < count; o += E * THREADS) {
            Inputs s[E];
#pragma unroll
            for (uint32_t e = 0; e < E; ++e) s[e] = load_inputs<false, WIDE>(c, factored, o + e * THREADS);
#pragma unroll
            for (uint32_t e = 0; e < E; ++e) add(s[e], o + e * THREADS);
        }
        for (; o < count; o += THREADS) {
            Inputs s = load_inputs<false, WIDE>(c, factored, o);
            add(s, o);
        }
    };
    if (c.factored) {
        loop(std::true_type{});
    } else {
        loop(std::false_type{});
    }
}

}  // namespace

// Adds the squares of every element's features, taken with this step's accumulators, into
// feat_sum[tensor * 28 + f] (zeroed by the host). The momenta and rms are computed from the previous
// step's, which stay in place for the update pass; vectors' Adafactor accumulators are updated in
// place. STATS_BLOCKS resident blocks per multiprocessor (their registers hold STATS_ELEMS elements).
extern "C" __global__ void __launch_bounds__(THREADS, STATS_BLOCKS)
    lopt_stats(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks, uint32_t first,
               StepTensors ptrs, Buffers buf, Decays d, float* chunk_sums) {
    __shared__ float partial[WARPS][FEATURES];
    __shared__ ChunkStreams streams;
    float acc[FEATURES];
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) acc[f] = 0.0f;
    int64_t current = -1;  // the tensor acc belongs to (block-uniform)
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const Chunk ch = chunks[c];
        const float* grad = ptrs.grad[ch.tensor - first];
        if (grad == nullptr) continue;
        if (ch.tensor != current && chunk_sums == nullptr) {
            if (current >= 0) flush_sums(acc, partial, buf.feat_sum + current * FEATURES);
            current = ch.tensor;
        }
        enter_chunk<Unit<WARPS>>(streams, meta[ch.tensor], ch, grad, ptrs.param[ch.tensor - first], buf, [] {},
                    [&](auto wide) { stats_span<decltype(wide)::value>(streams, d, acc); });
        if (chunk_sums != nullptr) flush_sums(acc, partial, chunk_sums + static_cast<uint64_t>(c) * FEATURES, true);
    }
    if (current >= 0) flush_sums(acc, partial, buf.feat_sum + current * FEATURES);
}

// The deterministic end of lopt_stats (which then writes each chunk's sums to chunk_sums): a
// block per tensor of the group adds its chunks' sums into feat_sum in chunk order, in f64.
// Tensor i's chunks are [chunk_starts[i], chunk_starts[i + 1]).
extern "C" __global__ void __launch_bounds__(THREADS)
    lopt_chunk_sums(const uint32_t* __restrict__ chunk_starts, uint32_t first, uint32_t count, StepTensors ptrs,
                    Buffers buf, const float* __restrict__ chunk_sums) {
    for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
        if (ptrs.grad[i] == nullptr || threadIdx.x >= FEATURES) continue;
        double sum = 0.0;
        for (uint32_t c = chunk_starts[i]; c < chunk_starts[i + 1]; ++c)
            sum += chunk_sums[static_cast<uint64_t>(c) * FEATURES + threadIdx.x];
        buf.feat_sum[static_cast<uint64_t>(first + i) * FEATURES + threadIdx.x] += static_cast<float>(sum);
    }
}

namespace {

// ---- f32 FMAs: each thread evaluates its element's MLP with the weights in shared memory.

__device__ __forceinline__ void mlp_fma(const float* w, float (&x)[FEATURES], float& direction, float& magnitude) {
    float h1[HIDDEN];
#pragma unroll
    for (int j = 0; j < HIDDEN; ++j) {
        float s = w[B_EFF + j];
#pragma unroll
        for (int f = 0; f < FEATURES; ++f) s = fmaf(w[W_IN + j * FEATURES + f], x[f], s);
        h1[j] = relu_keep_nan(s);
    }
    direction = w[B_OUT];
    magnitude = w[B_OUT + 1];
#pragma unroll 4
    for (int j = 0; j < HIDDEN; ++j) {
        float s = w[B_1 + j];
#pragma unroll
        for (int i = 0; i < HIDDEN; ++i) s = fmaf(w[W_1 + j * HIDDEN + i], h1[i], s);
        s = relu_keep_nan(s);
        direction = fmaf(w[W_OUT + j], s, direction);
        magnitude = fmaf(w[W_OUT + HIDDEN + j], s, magnitude);
    }
}

// ---- f16 tensor cores (mma.sync): a warp evaluates its 32 elements as two 16-row tiles of
// mma.m16n8k16 (the operand splits and the output layer as small_fc_lopt.cuh describes).

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    fastops::mma_m16n8k16<__half>(c, a, b[0], b[1]);
}

// The MLP as the tensor-core loop reads it, built once per block in shared memory: each lane's B
// fragments (k = 2 t + {0, 1} and 2 t + 8 + {0, 1}, n = g, with g = lane / 4 and t = lane % 4),
// hi and lo packed so that one 16-byte load brings both; the second layer's bias and the output
// layer in f32. Shared rather than in registers: 90 fewer registers per thread buy twice the
// resident warps, which is what the latency-bound update loop needs.
struct MmaWeights {
    uint4 frag[2][2][4][32];  // [layer][k tile][n tile][lane]: hi.x, hi.y, lo.x, lo.y
    OutputWeights out;

    __device__ __forceinline__ void fill(const float* __restrict__ mlp) {
        for (int i = threadIdx.x; i < 2 * 2 * 4 * 32; i += blockDim.x) {
            const int lane = i & 31, nt = (i >> 5) & 3, kt = (i >> 7) & 1, layer = i >> 8;
            const int g = lane >> 2, t = lane & 3, k = kt * 16 + 2 * t, n = nt * 8 + g;
            auto at = [&](int kk) { return weight_at(mlp, layer, kk, n); };
            const Split2 first = split_half2(at(k), at(k + 1)), second = split_half2(at(k + 8), at(k + 9));
            frag[layer][kt][nt][lane] = make_uint4(first.hi, second.hi, first.lo, second.lo);
        }
        out.fill(mlp);
        __syncthreads();
    }
};

// acc[tile][n tile] (holding its bias on entry) += a . W for both 16-row tiles, interleaved so
// that each warp keeps eight independent accumulator chains in flight.
template <bool SPLIT>
__device__ __forceinline__ void dense(const SplitA (&a)[2], const uint4 (&w)[2][4][32], float (&acc)[2][4][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const uint4 b = w[kt][nt][lane];
            const uint32_t hi[2] = {b.x, b.y}, lo[2] = {b.z, b.w};
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                if constexpr (SPLIT) {
                    mma_f16(acc[mt][nt], a[mt].lo[kt], hi);
                    mma_f16(acc[mt][nt], a[mt].hi[kt], lo);
                }
                mma_f16(acc[mt][nt], a[mt].hi[kt], hi);
            }
        }
    }
}

// The warp's 32 elements (lane = element, x already normalised; copies for idle lanes) through the
// MLP; each lane gets its element's direction and magnitude.
template <bool SPLIT_IN, bool SPLIT_HIDDEN>
__device__ __forceinline__ void mlp_mma(const MmaWeights& w, __half (*tile)[TILE_STRIDE], const float (&x)[FEATURES],
                                        float& direction, float& magnitude) {
    SplitA a[2];
    features_to_a<SPLIT_IN>(tile, x, a);
    float acc[2][4][4] = {};  // the first layer's bias rides in the constant slot
    dense<SPLIT_IN>(a, w.frag[0], acc);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        relu_to_a(acc[mt], a[mt]);
        bias_to_acc(w.out, acc[mt]);
    }
    dense<SPLIT_HIDDEN>(a, w.frag[1], acc);
    output_layer(w.out, acc, direction, magnitude);
}

// The MLP evaluators the update pass is written against: `(x, direction, magnitude)`, a warp at
// a time.
struct FmaMlp {
    static constexpr uint32_t WARPS_TOGETHER = 1;
    static constexpr uint32_t UNIT_WARPS = WARPS;  // chunks walked by the whole block
    const float* w;  // the packed weights, in shared memory
    __device__ __forceinline__ void operator()(float (&x)[FEATURES], float& direction, float& magnitude) const {
        mlp_fma(w, x, direction, magnitude);
    }
};

template <bool SPLIT_IN, bool SPLIT_HIDDEN>
struct MmaMlp {
    static constexpr uint32_t WARPS_TOGETHER = 1;
    static constexpr uint32_t UNIT_WARPS = WARPS;  // chunks walked by the whole block
    const MmaWeights& w;  // in shared memory
    __half (*tile)[TILE_STRIDE];  // this warp's feature rows
    __device__ __forceinline__ void operator()(float (&x)[FEATURES], float& direction, float& magnitude) const {
        mlp_mma<SPLIT_IN, SPLIT_HIDDEN>(w, tile, x, direction, magnitude);
    }
};

}  // namespace

// Tensor-core update kernels, one per choice of split layers: `lopt_update_mma_<in><hidden>`.
#define LOPT_UPDATE_MMA(SPLIT_IN, SPLIT_HIDDEN)                                                \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) lopt_update_mma_##SPLIT_IN##SPLIT_HIDDEN(   \
        const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks, uint32_t first, \
        StepTensors ptrs, Buffers buf, const float* __restrict__ mlp, Decays d, Hyper h) {                      \
        __shared__ __align__(16) __half tiles[WARPS][32][TILE_STRIDE];                                          \
        __shared__ MmaWeights weights;                                                                          \
        weights.fill(mlp);                                                                                      \
        const MmaMlp<SPLIT_IN, SPLIT_HIDDEN> eval{weights, tiles[threadIdx.x >> 5]};                            \
        update(meta, chunks, n_chunks, first, ptrs, buf, d, h, eval);                                           \
    }
LOPT_UPDATE_MMA(1, 1)
#ifdef FASTOPS_TUNING
// Accuracy / speed studies only (`--features tuning`, FASTOPS_LOPT_SPLIT): fewer split layers.
LOPT_UPDATE_MMA(0, 0)
LOPT_UPDATE_MMA(0, 1)
LOPT_UPDATE_MMA(1, 0)
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 2)
    lopt_update_fma(const LoptMeta* __restrict__ meta, const Chunk* __restrict__ chunks, uint32_t n_chunks,
                    uint32_t first, StepTensors ptrs, Buffers buf, const float* __restrict__ mlp, Decays d,
                    Hyper h) {
    __shared__ float w[MLP_FLOATS];
    for (int i = threadIdx.x; i < MLP_FLOATS; i += THREADS) w[i] = mlp[i];
    __syncthreads();
    update(meta, chunks, n_chunks, first, ptrs, buf, d, h, FmaMlp{w});
}
