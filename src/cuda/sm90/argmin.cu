// argmin_matmul on Hopper (sm_90a): the products on wgmma, for f32 operands in TF32, one pass
// (the TF32 mode) or three (the default compensated mode: big.big + big.small + small.big with
// big = x rounded to TF32 and small = x - big, as the portable `_tf32x3` core splits them), and
// for f16 / bf16 operands in one exact pass (f32 accumulation).
// build.rs compiles this file for compute_90a only; the host picks it on compute capability 9.0
// for `a` with k-contiguous rows starting on 16-byte boundaries of at most MAX_ROW_BYTES, and falls
// back to src/cuda/matmul.cu elsewhere. Same contract as the portable argmin: per row the lowest
// ordered score scale * (a . b)[i, j] + bias[j] and its column merged into a 64-bit key with one
// atomicMin per row and block (ties to the lowest column, NaN above every number).
//
// A block owns ROWS = 128 rows of a and walks its column tiles of COLS = 128 (starting at a
// tile that depends on the row tile, so that concurrent blocks read different parts of b). Its
// consumer warpgroups (two, 64 rows each) copy the row tile once into shared memory (cp.async)
// and, for f32, split it there; `b` arrives already copied (f32: split) and laid out as the
// stages (`argmin_split_b_sm90_*`: per batch entry, column tile and slice of STAGE_K_BYTES of k,
// the parts of COLS rows each, zeros past n and k), so a producer thread streams each stage with
// one bulk copy (TMA) through STAGES buffers, on `full` / `empty` mbarriers. Both operands are
// K-major in the no-swizzle core-matrix layout: the 16-byte chunk c of k of row r of a tile with
// C chunks a row at (r / 8) * C * 128 + c * 128 + (r % 8) * 16 bytes. A consumer issues m64n128
// products of 32 bytes of k (k8 in TF32, k16 in 16 bits; its 64 rows times the stage), keeps one
// stage's products in flight while it issues the next, and at the end of a column tile waits for
// them and folds the tile's 64 x 128 scores into its running minima (registers).
//
// Accuracy: the three passes accumulate in the wgmma accumulators over all of k, whose adds
// truncate: at most 3 k / 8 truncations of the running sum (2^-23 relative each), 5.7e-6 at
// k = 128, the order of an f32 FMA dot product's worst case (k 2^-24).
#include "common.cuh"
#include "matmul_common.cuh"
#include "wgmma.cuh"

using namespace fastops;

namespace {

namespace AS = fastops_constants::argmin_sm90;
constexpr int THREADS = AS::THREADS;
constexpr int ROWS = AS::ROWS;
constexpr int COLS = AS::COLS;
constexpr int STAGE_K_BYTES = AS::STAGE_K_BYTES;
constexpr int STAGES = AS::STAGES;
constexpr int CONSUMERS = 2;        // warpgroups of 64 rows; warpgroup 0 produces
constexpr int CONSUMER_BARRIER = 1;  // named barrier of the consumers' 256 threads
static_assert(THREADS == (CONSUMERS + 1) * 128 && ROWS == CONSUMERS * 64, "a producer and two warpgroups of 64 rows");
static_assert(COLS == 128, "the products are m64n128k8");
static_assert(STAGE_K_BYTES % 32 == 0, "a stage is whole products (32 bytes of k each)");

constexpr uint32_t CHUNK_BYTES = 16;                          // a core matrix row: 16 bytes of k
constexpr uint32_t STAGE_GROUP = STAGE_K_BYTES / 16 * 128;    // bytes between 8-row groups of a stage
constexpr uint32_t STAGE_PART = COLS * STAGE_K_BYTES;         // one part of a stage

// The operand element: f32 as TF32 in PASSES (1 or 3) products, or a 16-bit float (one exact
// pass). A product takes 32 bytes of k (8 TF32, 16 16-bit elements).
template <typename T, int PASSES> struct Elem {
    static_assert(sizeof(T) == 4 || PASSES == 1, "16-bit operands take one pass");
    static constexpr int PER_CHUNK = 16 / sizeof(T);           // elements per 16-byte chunk
    static constexpr int STAGE_K = STAGE_K_BYTES / sizeof(T);  // k of one stage
    static constexpr int PARTS = PASSES == 3 ? 2 : 1;          // big (and small) copies
};

// Mirrors `SplitArgs` in src/matmul/argmin/cuda.rs: the split copy of b.
struct SplitArgs {
    int64_t padded_k;      // k rounded up to a stage (STAGE_K_BYTES of elements)
    int64_t padded_cols;   // n rounded up to COLS
    int64_t batch_stride;  // elements between the split copies of two batch entries (0: shared)
};
static_assert(sizeof(SplitArgs) == 24, "SplitArgs is mirrored by a Rust #[repr(C)] struct of 24 bytes");

// x rounded to the nearest TF32 (half away from zero, by integer adds; the mma reads the top 19
// bits), as the portable core's `Split`. PASSES == 1 leaves the low bits for the mma to drop.
template <int PASSES> __device__ __forceinline__ uint32_t tf32_big(uint32_t x) {
    return PASSES == 3 ? (x + 0x1000u) & 0xffffe000u : x + 0x1000u;
}
__device__ __forceinline__ uint32_t tf32_small(uint32_t x, uint32_t big) {
    return __float_as_uint(__uint_as_float(x) - __uint_as_float(big));
}

// d (64 x 128, this thread's 64) = [accumulate ? d : 0] + A . Bᵀ over 32 bytes of k, both
// operands K-major in shared memory (descriptors a, b): SHAPE_TYPES names the instruction's shape
// and operand types, TAIL its trailing immediates (the 16-bit forms take two transpose flags).
#define WGMMA_M64N128_SS(SHAPE_TYPES, TAIL)                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "  \
                 "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, "  \
                 "%29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "   \
                 "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, "  \
                 "%65, p, 1, 1" TAIL ";\n}\n"                                                                  \
                 : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24), WG_ACC8(d, 32),               \
                   WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56)                                              \
                 : "l"(a), "l"(b), "r"(accumulate))

// TF32 operands: 8 of k.
__device__ __forceinline__ void wgmma_tf32(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    WGMMA_M64N128_SS("m64n128k8.f32.tf32.tf32", "");
}

// 16-bit operands: 16 of k.
template <typename T>
__device__ __forceinline__ void wgmma_16bit(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    if constexpr (std::is_same_v<T, __half>) {
        WGMMA_M64N128_SS("m64n128k16.f32.f16.f16", ", 0, 0");
    } else {
        WGMMA_M64N128_SS("m64n128k16.f32.bf16.bf16", ", 0, 0");
    }
}

// The split copy of b, laid out as the main kernel's stages so that each stage is one bulk copy:
// per batch entry, column tile, k slice of STAGE_K and part (0: big, 1: small; 16-bit operands
// are copied as they are), a block of COLS x STAGE_K elements in the core-matrix layout (element
// (r, kk) at (r / 8) * STAGE_K * 8 + (kk / PER_CHUNK) * 8 * PER_CHUNK + (r % 8) * PER_CHUNK +
// kk % PER_CHUNK). Zeros past n and k.
template <typename T, int PASSES>
__device__ __forceinline__ void split_b(const T* __restrict__ b, Problem p, SplitArgs s, T* __restrict__ out) {
    using E = Elem<T, PASSES>;
    constexpr int BLOCK = COLS * E::STAGE_K;
    const int64_t entries = p.b.batch_stride == 0 ? 1 : p.batch;
    const int64_t slices = s.padded_k / E::STAGE_K;
    const uint64_t blocks = entries * (s.padded_cols / COLS) * slices;  // (entry, column tile, slice)
    const uint64_t total = blocks * BLOCK;
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        const uint64_t blk = i / BLOCK;
        const int o = static_cast<int>(i % BLOCK);
        const int in_group = o % (E::STAGE_K * 8), in_chunk_column = in_group % (8 * E::PER_CHUNK);
        const int r = (o / (E::STAGE_K * 8)) * 8 + in_chunk_column / E::PER_CHUNK;
        const int kk = (in_group / (8 * E::PER_CHUNK)) * E::PER_CHUNK + in_chunk_column % E::PER_CHUNK;
        const int64_t slice = blk % slices, tile_of_entry = blk / slices;
        const int64_t ct = tile_of_entry % (s.padded_cols / COLS), entry = tile_of_entry / (s.padded_cols / COLS);
        const int64_t j = ct * COLS + r, kidx = slice * E::STAGE_K + kk;
        const bool inside = j < p.n && kidx < p.k;
        const int64_t at = entry * p.b.batch_stride + j * p.b.outer_stride + kidx * p.b.k_stride;
        T* dst = out + blk * (E::PARTS * BLOCK) + o;
        if constexpr (sizeof(T) == 4) {
            const uint32_t x = inside ? __float_as_uint(b[at]) : 0u;
            const uint32_t big = tf32_big<PASSES>(x);
            dst[0] = __uint_as_float(big);
            if constexpr (PASSES == 3) dst[BLOCK] = __uint_as_float(tf32_small(x, big));
        } else {
            dst[0] = inside ? b[at] : from_float<T>(0.0f);
        }
    }
}

template <typename T, int PASSES>
__device__ __forceinline__ void argmin_sm90(const T* __restrict__ a, const T* __restrict__ b_split,
                                            const float* __restrict__ bias, unsigned long long* __restrict__ keys,
                                            Problem p, ArgminArgs am, SplitArgs s) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const uint32_t shared = shared_address(shared_raw);
    using E = Elem<T, PASSES>;
    const int kp = static_cast<int>(s.padded_k);
    const int chunks = kp / E::PER_CHUNK;     // 16-byte chunks of a row of the row tile
    const uint32_t row_group = chunks * 128;  // bytes between 8-row groups of the row tile
    const uint32_t tile_bytes = ROWS * kp * sizeof(T);
    const uint32_t x_big = shared, x_small = shared + tile_bytes;
    const uint32_t stages = shared + (PASSES == 3 ? 2 : 1) * tile_bytes;
    constexpr uint32_t STAGE_BYTES = (PASSES == 3 ? 2 : 1) * STAGE_PART;
    const uint32_t full = stages + STAGES * STAGE_BYTES;  // STAGES mbarriers: a stage has landed
    const uint32_t empty = full + STAGES * 8;              // STAGES mbarriers: both consumers are done
    // A launch with less shared memory than this layout needs is a host bug: stop, never overrun.
    uint32_t launched_bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(launched_bytes));
    if (empty + STAGES * 8 - shared > launched_bytes) __trap();

    const int64_t row_tiles = (p.m + ROWS - 1) / ROWS, col_tiles = (p.n + COLS - 1) / COLS;
    const TileIndex tile(blockIdx.x, row_tiles, am.col_groups);
    const int64_t row0 = tile.row_tile * ROWS;
    const int64_t tiles = (col_tiles - tile.col_group + am.col_groups - 1) / am.col_groups;
    const int steps_per_tile = kp / E::STAGE_K;
    const int64_t total_steps = tiles * steps_per_tile;
    // Blocks start their walk at different column tiles (by row tile), so that the blocks running
    // at once do not all read the same stage of b from the same L2 lines.
    const int64_t first_tile = tile.row_tile % tiles;
    auto column_tile = [&](int64_t t) {
        const int64_t walk = t + first_tile < tiles ? t + first_tile : t + first_tile - tiles;
        return tile.col_group + walk * am.col_groups;
    };

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbarrier_init(full + 8 * st, 1);
            mbarrier_init(empty + 8 * st, CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // The warpgroup index, warp-uniform as far as the compiler knows (a shuffle), so that the
    // consumers' wgmma are not on a divergent path.
    const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    if (warpgroup == 0) {
        // The producer: one thread streams the walk's stages of b, one bulk copy each, into the
        // next buffer once both consumers have released its previous stage.
        if (threadIdx.x != 0) return;
        const T* b_entry = b_split + (p.b.batch_stride == 0 ? 0 : tile.batch * s.batch_stride);
        for (int64_t step = 0; step < total_steps; ++step) {
            const uint32_t slot = static_cast<uint32_t>(step % STAGES);
            if (step >= STAGES) mbarrier_wait(empty + 8 * slot, static_cast<uint32_t>(step / STAGES - 1) & 1);
            const int64_t block = column_tile(step / steps_per_tile) * steps_per_tile + step % steps_per_tile;
            mbarrier_arrive_expect_tx(full + 8 * slot, STAGE_BYTES);
            bulk_load(stages + slot * STAGE_BYTES, b_entry + block * (STAGE_BYTES / sizeof(T)), STAGE_BYTES, full + 8 * slot);
        }
        return;
    }

    // The consumers: warpgroup wg multiplies rows [64 wg, 64 wg + 64) of the row tile.
    const int tid = threadIdx.x - 128, wg = warpgroup - 1, warp = (tid % 128) / 32, lane = tid % 32;
    {
        // The row tile: rows past m and k past p.k arrive as zeros.
        const T* a_entry = a + tile.batch * p.a.batch_stride;
        for (int i = tid; i < ROWS * chunks; i += CONSUMERS * 128) {
            const int r = i / chunks, c = i % chunks;
            const int64_t row = row0 + r;
            const int64_t k_left = p.k - E::PER_CHUNK * static_cast<int64_t>(c);
            const int bytes =
                row < p.m && k_left > 0 ? static_cast<int>(k_left < E::PER_CHUNK ? k_left : E::PER_CHUNK) * sizeof(T) : 0;
            const T* src = bytes > 0 ? a_entry + row * p.a.outer_stride + E::PER_CHUNK * c : a;
            cp_async16(x_big + (r / 8) * row_group + c * 128 + (r % 8) * CHUNK_BYTES, src, bytes);
        }
        cp_async_commit();
        cp_async_wait<0>();
        named_sync(CONSUMER_BARRIER, CONSUMERS * 128);
        // f32: split it in place (the layout does not matter: element by element).
        if constexpr (sizeof(T) == 4) {
            for (uint32_t off = tid * 16; off < tile_bytes; off += CONSUMERS * 128 * 16) {
                uint4 v = *reinterpret_cast<uint4*>(shared_raw + off);
                uint4 big;
                big.x = tf32_big<PASSES>(v.x), big.y = tf32_big<PASSES>(v.y);
                big.z = tf32_big<PASSES>(v.z), big.w = tf32_big<PASSES>(v.w);
                *reinterpret_cast<uint4*>(shared_raw + off) = big;
                if constexpr (PASSES == 3) {
                    uint4 small;
                    small.x = tf32_small(v.x, big.x), small.y = tf32_small(v.y, big.y);
                    small.z = tf32_small(v.z, big.z), small.w = tf32_small(v.w, big.w);
                    *reinterpret_cast<uint4*>(shared_raw + tile_bytes + off) = small;
                }
            }
        }
        fence_async_shared();  // the split's stores, before wgmma reads them
        named_sync(CONSUMER_BARRIER, CONSUMERS * 128);
    }

    const uint32_t a_big = x_big + wg * 8 * row_group, a_small = x_small + wg * 8 * row_group;
    // This thread's rows (two) and running minima.
    const int64_t rows[2] = {row0 + wg * 64 + warp * 16 + lane / 4, row0 + wg * 64 + warp * 16 + lane / 4 + 8};
    uint32_t best_bits[2] = {~0u, ~0u}, best_col[2] = {~0u, ~0u};
    float acc[64];
    // Releases stage `step`'s buffer (its products are done): one arrival per warpgroup, by a
    // predicated instruction rather than a branch (a divergent branch while products are in
    // flight makes the compiler wait for them).
    const uint32_t releaser = tid % 128 == 0;
    auto release = [&](int64_t step) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
                         empty + 8 * static_cast<uint32_t>(step % STAGES)),
                     "r"(releaser)
                     : "memory");
    };

    for (int64_t t = 0; t < tiles; ++t) {
        for (int in_tile = 0; in_tile < steps_per_tile; ++in_tile) {
            const int64_t step = t * steps_per_tile + in_tile;
            const uint32_t slot = static_cast<uint32_t>(step % STAGES);
            mbarrier_wait(full + 8 * slot, static_cast<uint32_t>(step / STAGES) & 1);
            const uint32_t stage = stages + slot * STAGE_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k8 = 0; k8 < STAGE_K_BYTES / 32; ++k8) {
                // 32 bytes of k a product: two 16-byte chunks, 128 bytes apart in both layouts.
                const uint32_t a_off = (in_tile * (STAGE_K_BYTES / 16) + 2 * k8) * 128, b_off = 2 * k8 * 128;
                const uint64_t ab = smem_desc(a_big + a_off, 128, row_group);
                const uint64_t bb = smem_desc(stage + b_off, 128, STAGE_GROUP);
                const int accumulate = in_tile > 0 || k8 > 0;
                if constexpr (sizeof(T) == 2) {
                    wgmma_16bit<T>(acc, ab, bb, accumulate);
                } else if constexpr (PASSES == 3) {
                    const uint64_t as = smem_desc(a_small + a_off, 128, row_group);
                    const uint64_t bs = smem_desc(stage + STAGE_PART + b_off, 128, STAGE_GROUP);
                    wgmma_tf32(acc, as, bb, accumulate);  // small terms first
                    wgmma_tf32(acc, ab, bs, 1);
                    wgmma_tf32(acc, ab, bb, 1);
                } else {
                    wgmma_tf32(acc, ab, bb, accumulate);
                }
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous step's products
            if (in_tile > 0) release(step - 1);
        }
        wgmma_wait<0>();
        release((t + 1) * steps_per_tile - 1);
        // The column tile's scores into the running minima: accumulator i of this thread holds
        // row lane / 4 + 8 ((i / 2) % 2) of the warp's 16 and column 8 (i / 4) + 2 (lane % 4) + i % 2.
        // Per row the smallest score over the thread's 32 columns (fminf takes a number over a
        // NaN), the first column holding it, then one compare of (ordered score, column): the
        // lowest column wins a tie whatever the tile order. Columns past n score NaN;
        // a thread whose first column is past n skips the tile.
        const int64_t col0 = column_tile(t) * COLS;
        const int64_t my_col0 = col0 + 2 * (lane % 4);
        if (my_col0 < p.n) {
            const float* tile_bias = bias + my_col0;
            const int64_t cols_left = p.n - my_col0;
            float cb[32];
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int off = 8 * (j / 2) + j % 2;
                cb[j] = off < cols_left ? tile_bias[off] + 0.0f : __int_as_float(0x7fc00000);  // -0 -> +0
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v[32];
#pragma unroll
                for (int j = 0; j < 32; ++j) v[j] = fmaf(am.scale, acc[4 * (j / 2) + 2 * h + j % 2], cb[j]);
                float low = v[0];
#pragma unroll
                for (int j = 1; j < 32; ++j) low = fminf(low, v[j]);
                const uint32_t bits = ordered_bits(low);
                // Most tiles do not reach the running minimum: only those that do (or tie it)
                // look for the column.
                if (bits <= best_bits[h]) {
                    int first = 0;
#pragma unroll
                    for (int j = 31; j >= 0; --j) first = v[j] == low ? j : first;
                    const uint32_t col = static_cast<uint32_t>(my_col0 + 8 * (first / 2) + first % 2);
                    if (bits < best_bits[h] || col < best_col[h]) {
                        best_bits[h] = bits;
                        best_col[h] = col;
                    }
                }
            }
        }
    }
    // The four lanes of a quad hold the same rows.
    unsigned long long* keys_b = keys + tile.batch * p.m;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        unsigned long long best = (static_cast<unsigned long long>(best_bits[h]) << 32) | best_col[h];
        best = min_key(best, __shfl_xor_sync(0xffffffffu, best, 1));
        best = min_key(best, __shfl_xor_sync(0xffffffffu, best, 2));
        if (lane % 4 == 0 && rows[h] < p.m && best != ~0ull) atomicMin(keys_b + rows[h], best);
    }
}

}  // namespace

// `argmin_split_b_sm90_<mode>(b, problem, split, out)` and `argmin_matmul_sm90_<mode>(a, b_split,
// bias, keys, problem, argmin, split)`; mode tf32x3 (f32 compensated), tf32, f16 or bf16.
#define ARGMIN_SM90_KERNELS(T, MODE, PASSES)                                                                 \
    extern "C" __global__ void argmin_split_b_sm90_##MODE(const T* b, Problem p, SplitArgs s, T* out) {       \
        split_b<T, PASSES>(b, p, s, out);                                                                     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                  \
        argmin_matmul_sm90_##MODE(const T* a, const T* b_split, const float* bias, unsigned long long* keys,  \
                                  Problem p, ArgminArgs am, SplitArgs s) {                                    \
        argmin_sm90<T, PASSES>(a, b_split, bias, keys, p, am, s);                                             \
    }

ARGMIN_SM90_KERNELS(float, tf32x3, 3)
ARGMIN_SM90_KERNELS(float, tf32, 1)
ARGMIN_SM90_KERNELS(__half, f16, 1)
ARGMIN_SM90_KERNELS(__nv_bfloat16, bf16, 1)
