// masked_attention on Hopper (sm_90a): the forward and the backward with wgmma and TMA. build.rs
// compiles this directory for compute_90a only (PTX that loads on compute capability 9.0 and
// nowhere else); the host picks these kernels on such a GPU for f16 / bf16 with head dims up to 128
// (the backward when not deterministic) and falls back to src/cuda/attention.cu elsewhere. Same
// contract as the portable kernels: out [b, h, m, dv] (by o_strides) and the natural log-sum-exp [b, h, m], f32
// softmax statistics, probabilities (and score gradients) rounded to the operand type before their
// products, a row that sees no key gives zeros, -inf and zero gradients. The backward is described
// at backward_ws.
//
// The forward: a block is a producer warpgroup (one warp of it works) and HOPPER_CONSUMERS (2) consumer
// warpgroups, each consumer with its own mask tile of 64 queries (a warp 16 rows); they share the
// block's K / V tiles of 64 keys, which the producer streams with TMA through HOPPER_STAGES_D*
// shared stages over the key tiles any of the block's query tiles sees (tile states as in
// MaskView), with mbarriers saying when a stage is full and when every consumer is done with it.
// The consumers take turns at the tensor cores (FlashAttention-3's ping-pong): in its turn a
// consumer issues S = Q Kᵀ of its current key tile (wgmma m64n64k16, both operands from shared
// memory) and O += P V of the previous one (wgmma m64nDk16, P from registers, V MN-major from
// shared memory), then runs the mask and the online softmax of the current tile while the other
// consumer's products run. Head dims are zero-padded to D (64 or 128) in shared memory. K and V
// tiles are in the 128-byte swizzle TMA writes (see forward_ws); each consumer copies its Q tile
// itself (cp.async) into the no-swizzle core-matrix layout: the 16-byte chunk c of row r of a
// 64 x D tile at (r / 8) * ROW_GROUP + c * 128 + (r % 8) * 16 bytes, ROW_GROUP = D / 8 * 128
// (layouts and descriptors verified by scripts/hopper/wgmma_probe.cu).
#include "attention_common.cuh"
#include "wgmma.cuh"

using namespace fastops;

namespace {

constexpr int CONSUMERS = AC::HOPPER_CONSUMERS;  // warpgroups with a mask tile of 64 queries each
constexpr int BARRIER_BYTES = AC::HOPPER_BARRIER_BYTES;
constexpr int THREADS = 128 * (CONSUMERS + 1);
static_assert(BQ == 64 && BK == 64, "a warpgroup's wgmma tile is 64 queries x 64 keys");

template <int D> struct TileLayout {
    static constexpr int STAGES = D == 64 ? AC::HOPPER_STAGES_D64 : AC::HOPPER_STAGES_D128;  // K / V stages
    static_assert(16 * STAGES <= BARRIER_BYTES, "the mbarriers fit before the tiles");
    static constexpr int BYTES = 64 * D * 2;        // one 64 x D tile of 16-bit elements
    static constexpr int ROW_GROUP = D / 8 * 128;   // bytes between 8-row groups
    static constexpr int CHUNKS = D / 8;            // 16-byte chunks per row
};

// Copies rows [0, rows) and columns [0, cols) (cols a multiple of 8) of a row-major 64 x D global
// tile (rows row_stride elements apart) into the core-matrix layout at shared address dst; the
// rest of the tile becomes zero. The 128 threads of one warpgroup (tid) copy it: eight consecutive
// threads fill one 128-byte core matrix, and a thread's addresses advance by constants.
template <typename T, int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t row_stride, int rows, int64_t cols,
                                          int tid) {
    using L = TileLayout<D>;
    constexpr int ROWS_PER_PASS = 128 / L::CHUNKS, PASSES = 64 / ROWS_PER_PASS;
    const int row = (tid / (8 * L::CHUNKS)) * 8 + tid % 8, chunk = (tid / 8) % L::CHUNKS;
    const uint32_t to = dst + (row / 8) * L::ROW_GROUP + chunk * 128 + (row % 8) * 16;
    const T* from = src + row * row_stride + chunk * 8;
    const int live_rows = chunk * 8 < cols ? rows - row : 0;  // passes below this row count copy
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const bool valid = pass * ROWS_PER_PASS < live_rows;
        cp_async16(to + pass * (ROWS_PER_PASS / 8) * L::ROW_GROUP, valid ? from + pass * ROWS_PER_PASS * row_stride : src,
                   valid ? 16 : 0);
    }
}

// s (64 x 64, this thread's 32) = [accumulate ? s : 0] + A . Bᵀ over 16 of K: both operands
// K-major in shared memory (descriptors a, b).
template <typename T>
__device__ __forceinline__ void wgmma_scores(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
            : "l"(a), "l"(b), "r"(accumulate));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
            : "l"(a), "l"(b), "r"(accumulate));
    }
}

// s (64 x 64, this thread's 32) = [accumulate ? s : 0] + A . Bᵀ over 16 of K: A from registers
// (the m16n8k16 A fragment of each warp's 16 rows), B K-major in shared memory (descriptor b).
template <typename T>
__device__ __forceinline__ void wgmma_scores_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }
}

// o (64 x N, this thread's N / 2) += P . V over 16 keys: P from registers (the m16n8k16 A
// fragment of each warp's 16 rows), V MN-major (transposed) in shared memory (descriptor b).
template <typename T, int N>
__device__ __forceinline__ void wgmma_pv(float (&d)[N / 2], const uint32_t (&p)[4], uint64_t b) {
    static_assert(N == 64 || N == 128, "head tiles of 64 or 128");
    if constexpr (N == 64 && std::is_same_v<T, __half>) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24) : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(b));
    } else if constexpr (N == 64) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24) : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(b));
    } else if constexpr (std::is_same_v<T, __half>) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56) : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(b));
    } else {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56) : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(b));
    }
}

// d (64 x N, this thread's N / 2) = [accumulate ? d : 0] + A . B over 16 of K, both operands
// MN-major (transposed) in shared memory: A (M x K) stored K-row by K-row, as the dSᵀ tile is,
// and B (K x N) as a K / V tile is.
template <typename T, int N>
__device__ __forceinline__ void wgmma_tt(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 32 || N == 64 || N == 128, "32, 64 or 128 columns");
    if constexpr (N == 32 && std::is_same_v<T, __half>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8) : "l"(a), "l"(b), "r"(accumulate));
    } else if constexpr (N == 32) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8) : "l"(a), "l"(b), "r"(accumulate));
    } else if constexpr (N == 64 && std::is_same_v<T, __half>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24) : "l"(a), "l"(b), "r"(accumulate));
    } else if constexpr (N == 64) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24) : "l"(a), "l"(b), "r"(accumulate));
    } else if constexpr (std::is_same_v<T, __half>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56) : "l"(a), "l"(b), "r"(accumulate));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n" : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56) : "l"(a), "l"(b), "r"(accumulate));
    }
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    uint32_t r;
    from_float2<T>(reinterpret_cast<T*>(&r), x, y);
    return r;
}

// A CUtensorMap (the driver's opaque 128-byte TMA descriptor), passed by value as a __grid_constant__
// kernel parameter; mirrored by `TensorMap` in src/attention/cuda.rs.
struct alignas(64) TensorMap {
    uint64_t opaque[16];
};
static_assert(sizeof(TensorMap) == 128, "TensorMap is mirrored by a Rust struct of 128 bytes");

// The TMA copy of the box at coordinates c0 .. c3 of a 4-d tensor map into shared memory at dst,
// completing (its bytes) on the mbarrier; elements past the tensor's bounds arrive as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// The TMA copy of shared memory at src into the box at coordinates c0 .. c3 of a 4-d tensor map
// (elements past the tensor's bounds are not written), committed as a bulk group.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, int c0, int c1, int c2, int c3, uint32_t src) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
        "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
        : "memory");
}

// Asks the L2 for the box at coordinates c0 .. c3 of a 4-d tensor map (no shared memory written,
// nothing to wait for; a box past the tensor's bounds asks for nothing there).
__device__ __forceinline__ void tma_prefetch_4d(const TensorMap* map, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}

// Asks the L2 for `bytes` (a multiple of 16) from the 16-byte aligned global address p.
__device__ __forceinline__ void prefetch_l2_bytes(const void* p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(reinterpret_cast<uint64_t>(p)), "r"(bytes));
}

// A forward block asks the L2 for the first tiles of the block PREFETCH_AHEAD after its own, so
// that their copies come from L2 rather than DRAM when that block starts: blocks start in index
// order, at the documents rows about one every 0.1 us, so the one named is a few us away (long
// enough for the prefetch to land, short enough for the lines to stay). 0: no prefetch. (The same
// for the backward's K / V tiles made it slower: BENCHMARKS.md, session 53.)
constexpr int PREFETCH_AHEAD = 32;

// Named barriers: 0 is __syncthreads; consumer c takes its turn at the tensor cores at
// TURN_BARRIER + c and syncs its own Q tile at Q_BARRIER + c.
constexpr int TURN_BARRIER = 1, Q_BARRIER = 3;
// Registers a thread of the stored-mask forward's producer and consumer warpgroups keeps
// (setmaxnreg; the launch gives each 168): its producer walks the tile states and spills below
// 56; with 168 its consumers spilled 60 bytes at D = 128 (stored documents 2% slower). The other
// kernels keep 168 (at 56 / 224 causal masks measured 1% slower: BENCHMARKS.md, session 25).
constexpr int PRODUCER_REGISTERS = 56, CONSUMER_REGISTERS = 224;
// The split must fit the block's launch allocation: THREADS threads at the 168 registers that
// __launch_bounds__(THREADS, 1) gives each (setmaxnreg.inc waits for registers the block holds).
static_assert(128 * (PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS) <= THREADS * (65536 / THREADS / 8 * 8),
              "the block's launch registers hold the split");

// Sets the backward's dq accumulator rows of query tiles qt0 .. qt0 + CONSUMERS - 1 (those below
// row_tiles) of head bh to zero: dq_accum is f32 [b, h, row_tiles, BQ x D] (see backward_ws), so
// the tiles are one contiguous, 16-byte aligned run. `threads` threads from `thread` 0 share it.
template <int D>
__device__ __forceinline__ void zero_dq_tiles(float* __restrict__ dq_accum, const AttentionArgs& a, int64_t bh,
                                              int64_t qt0, int thread, int threads) {
    const int64_t tiles = min(static_cast<int64_t>(CONSUMERS), a.row_tiles - qt0);
    float4* dst = reinterpret_cast<float4*>(dq_accum + (bh * a.row_tiles + qt0) * (BQ * D));
    const int count = static_cast<int>(tiles) * (BQ * D / 4);
    for (int i = thread; i < count; i += threads) dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// Forward block `block`: batch entry b, head h (kv head hk, bh = b * heads + h), query tiles
// qt0 .. qt0 + CONSUMERS - 1 (rows i0 .. i0 + rows - 1), the longest rows first (for causal
// masks). At D = 128 blocks are taken head by head, so that the blocks running at once share
// their heads' K / V in L2 (causal 8192 9% faster, window 3%); at D = 64, row block by row block
// over every head (5% faster there: BENCHMARKS.md).
template <int D> struct ForwardBlock {
    int64_t b, h, hk, bh, qt0, i0, rows;
    __device__ __forceinline__ ForwardBlock(const AttentionArgs& a, int64_t block) {
        const int64_t heads_total = a.batch * a.heads, row_blocks = (a.row_tiles + CONSUMERS - 1) / CONSUMERS;
        const int64_t rank = D == 128 ? block % row_blocks : block / heads_total;
        qt0 = (row_blocks - 1 - rank) * CONSUMERS;
        bh = D == 128 ? block / row_blocks : block % heads_total;
        b = bh / a.heads;
        h = bh % a.heads;
        hk = h / (a.heads / a.kv_heads);
        i0 = qt0 * BQ;
        rows = min(static_cast<int64_t>(BQ * CONSUMERS), a.m - i0);
    }
};

// Asks the L2 for what forward block `block` copies first: its Q rows (row by row, `threads`
// threads from `thread` 0) and, for generated masks, the K / V tiles of its first two key tiles.
template <typename T, int D, int MASKS>
__device__ __forceinline__ void prefetch_forward_block(const T* __restrict__ q, const TensorMap* k_map,
                                                       const TensorMap* v_map, const uint8_t* states,
                                                       const uint8_t* dense, const int64_t* ids,
                                                       const AttentionArgs& a, int64_t block, int thread, int threads) {
    const ForwardBlock<D> at(a, block);
    const T* rows = q + at.b * a.q_strides[0] + at.h * a.q_strides[1] + at.i0 * a.q_strides[2];
    for (int r = thread; r < at.rows; r += threads)
        prefetch_l2_bytes(rows + r * a.q_strides[2], static_cast<uint32_t>(a.d * sizeof(T)));
    if constexpr (MASKS != STORED) {
        if (thread != 0) return;
        const KernelMask<MASKS> mask{{a, states, dense, ids, at.b}};
        int64_t first, last;
        mask.key_tiles(at.i0, at.i0 + at.rows - 1, first, last);
        for (int64_t kt = first; kt <= min(last, first + 1); ++kt)
#pragma unroll
            for (int half = 0; half < D / 64; ++half) {
                const int row = static_cast<int>(kt * BK), head = static_cast<int>(at.hk), entry = static_cast<int>(at.b);
                tma_prefetch_4d(k_map, 64 * half, row, head, entry);
                tma_prefetch_4d(v_map, 64 * half, row, head, entry);
            }
    }
}

// The warp-specialised forward. Warpgroup 0 produces (one thread of it): it streams the K / V
// tiles of the block's key-tile walk through STAGES shared stages with TMA (k_map, v_map: 4-d maps
// of (columns, rows, kv heads, batch) with a box of 64 x 64 in the 128-byte swizzle: columns
// 64 c .. 64 c + 63 of a tile's row r at c * 8192 + r * 128 bytes, zeros past n and d), completing
// on the stage's `full` mbarrier, and reuses a stage once every consumer warp has released it
// (`empty`). K is then a K-major operand of S, V an MN-major one of P V. Warpgroups 1 .. CONSUMERS consume: each owns one mask tile of 64 queries. They
// take turns at the tensor cores (named barriers, in ping-pong): in its turn a consumer issues
// S = Q Kᵀ of the current key tile and O += P V of the previous one, hands the turn over, and
// runs the mask and the online softmax of the current tile while the other consumer's products
// run. MASKS: the MaskFamily of the mask.
template <typename T, int D, int MASKS>
__device__ __forceinline__ void forward_ws(const T* __restrict__ q, const TensorMap* k_map, const TensorMap* v_map,
                                           T* __restrict__ out, float* __restrict__ lse, const uint8_t* states,
                                           const uint8_t* dense, const int64_t* ids, const AttentionArgs& a,
                                           float* __restrict__ dq_zero) {
    using L = TileLayout<D>;
    constexpr int STAGES = L::STAGES;
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    // [full mbarriers | empty mbarriers | ... ] then, from 1024, CONSUMERS Q tiles and STAGES
    // stages of a K tile followed by a V tile.
    const uint32_t base = shared_address(shared_raw);
    const uint32_t full_bar = base, empty_bar = base + 8 * STAGES;
    const uint32_t q_tiles = base + BARRIER_BYTES, kv_stages = q_tiles + CONSUMERS * L::BYTES;
    // (The warpgroup index and the stage through a shuffle: what derives from them, the wgmma
    // descriptors, then stays in uniform registers.)
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0), tid = threadIdx.x % 128;

    const int64_t block = blockIdx.x;
    const ForwardBlock<D> at(a, block);
    const int64_t b = at.b, h = at.h, hk = at.hk, bh = at.bh, qt0 = at.qt0, i0 = at.i0, block_rows = at.rows;
    constexpr bool GENERATED = MASKS != STORED;
    const KernelMask<MASKS> mask{{a, states, dense, ids, b}};
    int64_t kt_first = 0, kt_last = a.col_tiles - 1;
    if constexpr (GENERATED) mask.key_tiles(i0, i0 + block_rows - 1, kt_first, kt_last);
    // The first key tile after kt that any query tile of the block sees (col_tiles when none);
    // producer and consumers walk the same tiles, every thread with the same kt.
    auto next = [&](int64_t kt) -> int64_t {
        if constexpr (GENERATED) {
            const int64_t c = max(kt + 1, kt_first);
            return c <= kt_last ? c : a.col_tiles;
        }
        return next_live(kt, a.col_tiles, [&](int64_t c) {
            bool live = false;
#pragma unroll
            for (int w = 0; w < CONSUMERS; ++w)
                live |= qt0 + w < a.row_tiles && mask.tile_state(h, qt0 + w, c) != TILE_EMPTY;
            return live;
        });
    };

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbarrier_init(full_bar + 8 * st, 1);
            mbarrier_init(empty_bar + 8 * st, CONSUMERS * 4);
        }
    }
    __syncthreads();

    if (wg == 0) {
        // The producer: tile i of the walk into stage i % STAGES, once the consumers have
        // released that stage's previous tile (i - STAGES). Warp 0 walks the tiles (next_live
        // takes a whole warp), its lane 0 issues the copies; the other warps only zero dq_zero
        // (with stored masks the warpgroup gives registers to the consumers first).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS) : "memory");
        if (tid >= 32) {
            // Warps 1 .. 3 ask the L2 for the first tiles of the block PREFETCH_AHEAD later, then
            // zero the backward's dq accumulator rows of the block (when the host asks: gradients
            // tracked), off the consumers' path.
            if (PREFETCH_AHEAD > 0 && block + PREFETCH_AHEAD < gridDim.x)
                prefetch_forward_block<T, D, MASKS>(q, k_map, v_map, states, dense, ids, a, block + PREFETCH_AHEAD,
                                                    tid - 32, 96);
            if (dq_zero != nullptr) zero_dq_tiles<D>(dq_zero, a, bh, qt0, tid - 32, 96);
            return;
        }
        int i = 0;
        for (int64_t kt = next(-1); kt < a.col_tiles; kt = next(kt), ++i) {
            const int stage = i % STAGES;
            if (tid == 0) {
                if (i >= STAGES) mbarrier_wait(empty_bar + 8 * stage, ((i / STAGES) & 1) ^ 1);
                const uint32_t sk = kv_stages + stage * 2 * L::BYTES, bar = full_bar + 8 * stage;
                const int row = static_cast<int>(kt * BK), head = static_cast<int>(hk), entry = static_cast<int>(b);
                mbarrier_arrive_expect_tx(bar, 2 * L::BYTES);
#pragma unroll
                for (int half = 0; half < D / 64; ++half) {
                    tma_load_4d(sk + half * 8192, k_map, 64 * half, row, head, entry, bar);
                    tma_load_4d(sk + L::BYTES + half * 8192, v_map, 64 * half, row, head, entry, bar);
                }
            }
            __syncwarp();
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGISTERS) : "memory");
    const int consumer = wg - 1, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int64_t qt = qt0 + consumer;
    const bool active = qt < a.row_tiles;  // false past the last query tile (a partial block)
    const uint32_t sq = q_tiles + consumer * L::BYTES;
    // (An inactive consumer's Q tile is zeros: its products run, and are ignored.)
    load_tile<T, D>(sq, q + b * a.q_strides[0] + h * a.q_strides[1] + (active ? qt * BQ * a.q_strides[2] : 0),
                    a.q_strides[2], active ? static_cast<int>(min(static_cast<int64_t>(BQ), a.m - qt * BQ)) : 0, a.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    named_sync(Q_BARRIER + consumer, 128);
    // The warp's 16 rows of Q as the A fragments of S's D / 16 k-steps, held in registers for the
    // whole walk (S then reads only K from shared memory). ldmatrix matrix lane / 8 of step kk:
    // rows 16 warp + (lane % 16), 16-byte chunk 2 kk + lane / 16 of the core-matrix layout.
    uint32_t q_frag[D / 16][4];
    {
        const int row = 16 * (tid / 32) + (tid % 16);
        const uint32_t from = sq + (row / 8) * L::ROW_GROUP + (row % 8) * 16 + ((tid % 32) / 16) * 128;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4<false>(q_frag[kk], from + kk * 256);
    }

    float o[D / 2], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < D / 2; ++e) o[e] = 0.f;
    // This thread's rows: row0 and row0 + 8. Accumulator element r of 8-column tile nt is row
    // row0 + (r / 2) * 8, column nt * 8 + 2 t + r % 2 (the mma.sync layout, per warp).
    const int64_t row0 = qt * BQ + warp * 16 + g;

    // The state of key tile kt for this consumer's rows (empty past the walk's end). Generated
    // masks: from the span of tiles the rows see, worked out once (documents in runs: from the
    // keys the rows see, loaded once).
    [[maybe_unused]] TileSpan rows_span{1, 0, 1, 0};
    if constexpr (MASKS == RUNS) rows_span = mask.view.runs_span(active ? qt : a.row_tiles, BQ, true).tiles(a.n);
    else if constexpr (MASKS == FORMULA) rows_span = mask.view.formula_span(active ? qt : a.row_tiles);
    auto state_of = [&](int64_t kt) -> uint8_t {
        if constexpr (GENERATED) return rows_span.state(static_cast<int>(kt));
        return active && kt < a.col_tiles ? mask.tile_state(h, qt, kt) : TILE_EMPTY;
    };
    // Before the turn of the walk's tile `index` (key tile kt, in `state` for this consumer's
    // rows): which of this thread's 32 scores a partial tile keeps (bit nt * 4 + r; worked out
    // before the scores exist, so that the index arithmetic is not live beside them), and the
    // wait for its K / V.
    auto prepare = [&](int index, int64_t kt, uint8_t state, uint32_t& keep) {
        const int stage = index % STAGES;
        const int64_t j0 = kt * BK;
        keep = ~0u;
        if (GENERATED && state == TILE_PARTIAL) {
            keep = 0;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                int lo, hi;
                mask.key_run(row0 + half * 8, j0, BK, lo, hi);
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = nt * 8 + 2 * t + e;
                        if (col >= lo && col <= hi) keep |= 1u << (nt * 4 + 2 * half + e);
                    }
            }
        } else if (!GENERATED && state == TILE_PARTIAL) {
            keep = 0;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    if (mask.keeps(h, row0 + (r >> 1) * 8, j0 + nt * 8 + 2 * t + (r & 1))) keep |= 1u << (nt * 4 + r);
        }
        mbarrier_wait(full_bar + 8 * stage, (index / STAGES) & 1);
    };
    // The descriptors of stage 0's K tile (K-major) and V tile (MN-major): another stage or k-step
    // is the same descriptor plus a constant number of 16-byte units in its address field (shared
    // addresses stay below 2^18, so the 14-bit field does not overflow), one add a wgmma.
    const uint64_t k_desc0 = smem_desc_sw128(kv_stages, 16, 1024);
    const uint64_t v_desc0 = smem_desc_sw128(kv_stages + L::BYTES, 8192, 1024);
    // S = Q Kᵀ of the tile in `stage` (issued and committed, not waited for).
    auto issue_scores = [&](float (&s)[32], int stage) {
        const uint64_t k_desc = desc_plus(k_desc0, stage * (2 * L::BYTES / 16));
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            // Head-dim columns 16 kk .. 16 kk + 15: 32 bytes into the 128-byte rows of half kk / 4.
            wgmma_scores_rs<T>(s, q_frag[kk], desc_plus(k_desc, (kk / 4) * (8192 / 16) + (kk % 4) * (32 / 16)), kk > 0);
        wgmma_commit();
    };
    // O += P V with the V tile in `stage` (issued and committed, not waited for).
    uint32_t p[4][4];  // the A fragments of P's four 16-key steps
    auto issue_pv = [&](int stage) {
        const uint64_t v_desc = desc_plus(v_desc0, stage * (2 * L::BYTES / 16));
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
            // Keys 16 kk .. 16 kk + 15 are two 8-row groups (1024 bytes each) of the V tile; its
            // head-dim halves are 8192 bytes apart.
            wgmma_pv<T, D>(o, p[kk], desc_plus(v_desc, kk * (2048 / 16)));
        wgmma_commit();
    };
    // The online softmax of a tile's raw scores (scale_log2 > 0): masked where `keep` says, the
    // row statistics updated (a row's exponent reference moves only when a score passes it by
    // more than RESCALE_SLACK), s turned into probabilities; alpha rescales what came before.
    auto softmax = [&](float (&s)[32], uint8_t state, uint32_t keep, float (&alpha)[2]) -> bool {
        if (state != TILE_FULL) {
#pragma unroll
            for (int e = 0; e < 32; ++e)
                if (!(keep >> e & 1u)) s[e] = -INFINITY;
        }
        bool moved = false;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[nt * 4 + 2 * half], s[nt * 4 + 2 * half + 1]));
            const float seen = quad_max(tile_max) * a.scale_log2, old_max = row_max[half];
            const float new_max = seen > old_max + RESCALE_SLACK ? seen : old_max;
            const float reference = new_max == -INFINITY ? 0.f : new_max;
            alpha[half] = exp2f(old_max - reference);
            moved |= new_max != old_max;
            row_max[half] = new_max;
            row_sum[half] *= alpha[half];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x = exp2f(fmaf(s[nt * 4 + 2 * half + e], a.scale_log2, -reference));
                    s[nt * 4 + 2 * half + e] = x;
                    row_sum[half] += x;
                }
        }
        return __any_sync(0xffffffffu, moved);
    };
    // P of a tile (zero for a tile this consumer does not see: its P V then adds nothing).
    auto set_p = [&](const float (&s)[32], bool live) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            p[kk][0] = live ? pack2<T>(s[8 * kk], s[8 * kk + 1]) : 0u;
            p[kk][1] = live ? pack2<T>(s[8 * kk + 2], s[8 * kk + 3]) : 0u;
            p[kk][2] = live ? pack2<T>(s[8 * kk + 4], s[8 * kk + 5]) : 0u;
            p[kk][3] = live ? pack2<T>(s[8 * kk + 6], s[8 * kk + 7]) : 0u;
        }
    };
    auto release = [&](int stage) {
        if (lane == 0) mbarrier_arrive(empty_bar + 8 * stage);
    };

    // The turns: every wgmma is issued by the whole warpgroup, unconditionally (a tile this
    // consumer does not see costs its products, which the softmax then ignores). A tile's S is
    // issued in its own turn, its P V in the next one.
    static_assert(CONSUMERS == 2, "the turns are a ping-pong of two consumers");
    const int my_turn = TURN_BARRIER + consumer, other_turn = TURN_BARRIER + (consumer ^ 1);
    // Each consumer walks the key tiles itself, one tile ahead: the next tile and its state (for
    // stored masks, loads of the mask's tile states) are asked for while this tile's S runs.
    int64_t kt = next(-1);
    if (kt < a.col_tiles) {  // the same for the whole block
        if (consumer == 1) named_arrive(other_turn, 256);  // consumer 0 takes the first turn
        float s[32], alpha[2];
        uint32_t keep;
        uint8_t state = state_of(kt);
        prepare(0, kt, state, keep);
        named_sync(my_turn, 256);
        wgmma_fence();
        issue_scores(s, 0);
        named_arrive(other_turn, 256);
        int64_t kt_next = next(kt);
        uint8_t state_next = state_of(kt_next);
        wgmma_wait<0>();
        if (state != TILE_EMPTY) softmax(s, state, keep, alpha);  // o is still zero: no rescale
        set_p(s, state != TILE_EMPTY);
        int stage_prev = 0, index = 1;
        for (; kt_next < a.col_tiles; ++index) {
            const int stage = __shfl_sync(0xffffffffu, index % STAGES, 0);
            kt = kt_next;
            state = state_next;
            prepare(index, kt, state, keep);
            named_sync(my_turn, 256);
            wgmma_fence();
            issue_scores(s, stage);
            issue_pv(stage_prev);
            named_arrive(other_turn, 256);
            kt_next = next(kt);
            state_next = state_of(kt_next);
            wgmma_wait<1>();  // S (the previous tile's P V may still run)
            const bool moved = state != TILE_EMPTY && softmax(s, state, keep, alpha);
            wgmma_wait<0>();  // P V: o and p are free, and so is the previous stage
            release(stage_prev);
            if (moved) {
#pragma unroll
                for (int e = 0; e < D / 2; ++e) o[e] *= alpha[(e >> 1) & 1];
            }
            set_p(s, state != TILE_EMPTY);
            stage_prev = stage;
        }
        named_sync(my_turn, 256);
        wgmma_fence();
        issue_pv(stage_prev);
        named_arrive(other_turn, 256);
        wgmma_wait<0>();
        release(stage_prev);
        if (consumer == 0) named_sync(my_turn, 256);  // consumer 1's last hand-over
    }

    if (!active) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float sum = quad_sum(row_sum[half]), inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t row = row0 + half * 8;
        if (row >= a.m) continue;
        if (t == 0) lse[bh * a.m + row] = sum > 0.f ? (row_max[half] + log2f(sum)) * LN2 : -INFINITY;
        T* dst = out + row_offset(a.o_strides, b, h, row);
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            if (col < a.dv) from_float2<T>(dst + col, o[nt * 4 + 2 * half] * inv, o[nt * 4 + 2 * half + 1] * inv);
        }
    }
}

// ---- The backward (dk, dv and dq of a block of 128 keys; delta = rowsum(dO * O) comes from the
// portable attention_delta_* before it).

constexpr int BWD_WARPGROUPS = 2;  // a warpgroup per 64-key tile of the block's 128 keys
constexpr int BWD_THREADS = 128 * BWD_WARPGROUPS, BWD_KEYS = 64 * BWD_WARPGROUPS;

template <int D> struct BackwardLayout {
    static constexpr int STAGES = D == 64 ? AC::HOPPER_BWD_STAGES_D64 : AC::HOPPER_BWD_STAGES_D128;
    static_assert(8 * (STAGES + 1) <= BARRIER_BYTES, "the mbarriers fit before the tiles");
    static constexpr int BYTES = 64 * D * 2;  // one 64 x D tile of 16-bit elements
    // After the mbarriers: a K and a V tile per warpgroup, STAGES stages of a Q and a dO tile;
    // then two buffers (alternate items) of each warpgroup's dSᵀ tile (64 x 64: buffer p of
    // warpgroup c at DS + (2 p + c) DS_BYTES) and per warpgroup two buffers (alternate items) of
    // the 64 log-sum-exps (log2 units) and deltas of an item.
    static constexpr int KV = BARRIER_BYTES, STAGE0 = KV + BWD_WARPGROUPS * 2 * BYTES;
    static constexpr int DS = STAGE0 + STAGES * 2 * BYTES, DS_BYTES = 64 * 64 * 2;
    static constexpr int STATS = DS + 2 * BWD_WARPGROUPS * DS_BYTES, STATS_BYTES = 2 * 2 * 64 * 4;
    static constexpr int SHARED = STATS + BWD_WARPGROUPS * STATS_BYTES;
    static_assert(SHARED <= 227 * 1024, "the layout fits an SM's shared memory");
};

// The dynamic shared memory the block was launched with.
__device__ __forceinline__ uint32_t dynamic_shared_bytes() {
    uint32_t bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
    return bytes;
}

// The descriptor of k-step kk (16 of K) of a 64-row tile in the 128-byte swizzle as TMA writes it
// (64-column halves 8192 bytes apart): K-major, K running along the rows (Q Kᵀ's operands) ...
__device__ __forceinline__ uint64_t kmajor_sw128(uint32_t tile, int kk) {
    return smem_desc_sw128(tile + (kk / 4) * 8192 + (kk % 4) * 32, 16, 1024);
}
// ... or MN-major, K running down the rows (V in P V; 16 rows are two 1024-byte groups).
__device__ __forceinline__ uint64_t mnmajor_sw128(uint32_t tile, int kk) {
    return smem_desc_sw128(tile + kk * 2048, 8192, 1024);
}

// Waits until at most PENDING of this thread's bulk groups have not read their shared memory.
template <int PENDING> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
}

// Named barriers: DKV_BARRIER + c when warpgroup c's dk / dv are staged; BOTH_DS_BARRIER (the
// block) when both dSᵀ tiles of an item are.
constexpr int DKV_BARRIER = 3, BOTH_DS_BARRIER = 5;

// The backward of 128 keys (two mask tiles) of a (batch entry, kv head): warpgroup c owns key
// tile 2 kb + c. K and V arrive once by TMA; the block then walks the items (query head of the
// group, query tile) whose mask tile is not empty for either key tile, streaming each item's Q
// and dO tiles by TMA through STAGES stages (q_map, do_map: as k_map, 64 x 64 boxes in the
// 128-byte swizzle, zeros past m and d) that both warpgroups read; a stage is refilled once the
// block barrier of the item after its own shows every warp done with it. Per item, each warpgroup
// with accumulator rows its 64 keys and columns the item's 64 queries (thread layout as in the
// forward):
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (wgmma, operands K-major in shared memory),
//   Pᵀ = exp2(Sᵀ scale_log2 - lse2) (0 where the mask hides), dSᵀ = Pᵀ (dPᵀ - delta),
//   dV += Pᵀ dO and dK += dSᵀ Q (A from registers, B MN-major),
//   dSᵀ to shared memory (two buffers, alternate items); once both warpgroups' dSᵀ tiles are
//   there (a block barrier an item), warpgroup c computes head-dim half c of dQ = dS K over the
//   block's 128 keys (A and B MN-major) and adds it into dq_accum by 16-byte reductions
//   (`red.global.add.v4.f32`, straight from the accumulator registers), so the order of the
//   additions varies run to run (the deterministic backward stays portable).
//   dq_accum is f32 [b, h, row_tiles, 2 (column halves), 64 x D / 2 in fragment order]: entry
//   ((warp * D / 16 + nt) * 32 + g * 4 + t) * 4 + r of a block is row warp * 16 + g + (r / 2) * 8,
//   column 8 nt + 2 t + r % 2 of the half; it sums dS K, which dq_rows scales into dq.
// dk = scale * dK and dv = dV go at the end into the warpgroup's own K and V tiles (the same
// swizzled layout) and from there to dk_map / dv_map (as k_map, over dk and dv) by TMA stores,
// which write rows below n and columns below d / dv only.
template <typename T, int D, int MASKS>
__device__ __forceinline__ void backward_ws(const TensorMap* q_map, const TensorMap* k_map, const TensorMap* v_map,
                                            const TensorMap* do_map, const float* __restrict__ lse,
                                            const float* __restrict__ delta, const TensorMap* dk_map, const TensorMap* dv_map,
                                            float* __restrict__ dq_accum, const uint8_t* states, const uint8_t* dense,
                                            const int64_t* ids, const AttentionArgs& a) {
    using L = BackwardLayout<D>;
    constexpr int STAGES = L::STAGES, BYTES = L::BYTES, DQ_COLS = D / BWD_WARPGROUPS;
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const uint32_t base = shared_address(shared_raw);
    const uint32_t kv_bar = base, full_bar = base + 8;
    // This warpgroup's statistics: [2][lse2 64, delta 64].
    float* stats = reinterpret_cast<float*>(shared_raw + L::STATS + (threadIdx.x / 128) * L::STATS_BYTES);
    // The warpgroup and warp indices through a shuffle: the compiler then keeps what derives from
    // them (the wgmma descriptors) in uniform registers.
    const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = __shfl_sync(0xffffffffu, (tid % 128) / 32, 0);
    const int wtid = tid % 128;  // the thread in its warpgroup
    const uint32_t sk = base + L::KV + wg * 2 * BYTES, sv = sk + BYTES;

    // The block: keys j0 .. j0 + 127 of (b, hk). Blocks go head by head, so that the blocks
    // running at once share their heads' Q / dO tiles and dq_accum rows in L2; within a head, the
    // keys most queries see first (causal masks).
    const int64_t key_blocks = (a.col_tiles + BWD_WARPGROUPS - 1) / BWD_WARPGROUPS, block = blockIdx.x;
    const int64_t kb = block % key_blocks, bhk = block / key_blocks, b = bhk / a.kv_heads, hk = bhk % a.kv_heads;
    const int64_t group = a.heads / a.kv_heads, h0 = hk * group, j0 = kb * BWD_KEYS;
    const int64_t kt = 2 * kb + wg;  // this warpgroup's key tile
    constexpr bool GENERATED = MASKS != STORED;
    const KernelMask<MASKS> mask{{a, states, dense, ids, b}};
    // Items: (query head h0 + head, query tile qt), head by head, those whose mask tile is not
    // empty for either key tile of the block; head == group past the last. In 32 bits and without
    // divisions on the generated masks' walk (the host keeps group * row_tiles below 2^31).
    struct Item {
        int head, qt;
    };
    const int groups = static_cast<int>(group), row_tiles = static_cast<int>(a.row_tiles);
    const Item done{groups, 0};
    int qt_first, qt_last;  // generated masks: the query tiles that may see the block's keys
    {
        int64_t first, last;
        mask.query_tiles_of(j0, j0 + BWD_KEYS - 1, first, last);
        qt_first = static_cast<int>(first);
        qt_last = static_cast<int>(last);
    }
    auto state_of = [&](int64_t h, int64_t qt, int64_t tile) {
        return tile < a.col_tiles ? mask.tile_state(h, qt, tile) : TILE_EMPTY;
    };
    auto live = [&](int head, int qt) {
        return state_of(h0 + head, qt, 2 * kb) != TILE_EMPTY || state_of(h0 + head, qt, 2 * kb + 1) != TILE_EMPTY;
    };
    // The first live item after `it` (done when none); every thread of a warp calls it alike.
    auto next = [&](Item it) -> Item {
        if constexpr (GENERATED) {
            // Every query tile of [qt_first, qt_last] sees a key of the block (the queries that see
            // one of its keys form one run, the same for every head), so no tile of the range is
            // empty for both key tiles.
            if (qt_first > qt_last) return done;
            if (++it.qt > qt_last) {
                ++it.head;
                it.qt = qt_first;
            }
            return it.head >= groups ? done : it;
        } else {
            const int end = groups * row_tiles;
            const int found = static_cast<int>(next_live(it.head * row_tiles + it.qt, end, [&](int64_t c) {
                const unsigned candidate = static_cast<unsigned>(c);
                return live(static_cast<int>(candidate / row_tiles), static_cast<int>(candidate % row_tiles));
            }));
            return found >= end ? done : Item{found / row_tiles, found % row_tiles};
        }
    };
    const Item before_first{0, GENERATED ? qt_first - 1 : -1};  // next(before_first) is the first item
    // One thread: the copies of an item's Q and dO tiles into `stage`.
    auto issue = [&](Item it, int stage) {
        const uint32_t sq = base + L::STAGE0 + stage * 2 * BYTES, bar = full_bar + 8 * stage;
        const int head = static_cast<int>(h0) + it.head, row = it.qt * BQ;
        mbarrier_arrive_expect_tx(bar, 2 * BYTES);
#pragma unroll
        for (int half = 0; half < D / 64; ++half) {
            tma_load_4d(sq + half * 8192, q_map, 64 * half, row, head, static_cast<int>(b), bar);
            tma_load_4d(sq + BYTES + half * 8192, do_map, 64 * half, row, head, static_cast<int>(b), bar);
        }
    };
    // An item's statistics, loaded an item ahead into two registers and stored to shared memory
    // (log-sum-exps in log2 units, +inf where the row sees no key or lies past m, so that its
    // probabilities are 0; deltas) at the end of the item before, converted only then (a
    // conversion at the load would wait for it there). At D = 64 each thread of the warpgroup
    // loads one (entry wtid); at D = 128 threads 0 .. 63 load both of row wtid at once (each the
    // faster there: BENCHMARKS.md, session 22).
    constexpr bool STATS_BY_EVERY_THREAD = D == 64;
    auto load_stats = [&](Item it) -> float2 {
        const int64_t row = static_cast<int64_t>(it.qt) * BQ + wtid % 64;
        const bool none = it.head >= groups || row >= a.m;
        const int64_t at = (b * a.heads + h0 + it.head) * a.m + row;
        if constexpr (STATS_BY_EVERY_THREAD) {
            return make_float2(none ? (wtid < 64 ? -INFINITY : 0.f) : (wtid < 64 ? lse[at] : delta[at]), 0.f);
        } else {
            if (wtid >= 64 || none) return make_float2(-INFINITY, 0.f);
            return make_float2(lse[at], delta[at]);
        }
    };
    auto store_stats = [&](float* to, float2 loaded) {
        if constexpr (STATS_BY_EVERY_THREAD) {
            const float x = loaded.x;
            to[wtid] = wtid >= 64 ? x : (x == -INFINITY ? INFINITY : x * LOG2E);
        } else if (wtid < 64) {
            to[wtid] = loaded.x == -INFINITY ? INFINITY : loaded.x * LOG2E;
            to[64 + wtid] = loaded.y;
        }
    };

    if (dynamic_shared_bytes() < L::SHARED) __trap();  // the host's layout differs from this one
    if (tid == 0) {
        mbarrier_init(kv_bar, 1);
        for (int st = 0; st < STAGES; ++st) mbarrier_init(full_bar + 8 * st, 1);
    }
    __syncthreads();
    Item item = next(before_first);
    const bool any_item = item.head < groups;  // the same for the whole block
    // Warp COPY_WARP of warpgroup 0 walks the items to copy (`ahead`) and issues their copies
    // (block thread 32 * COPY_WARP); thread 0 copies K / V. (At D = 64 warp 1 copying is the
    // faster.)
    constexpr int COPY_WARP = D == 64 ? 1 : 0;  // (measured: BENCHMARKS.md, session 22)
    Item ahead = item;
    if (tid == 0 && any_item) {
        mbarrier_arrive_expect_tx(kv_bar, BWD_WARPGROUPS * 2 * BYTES);
        const int head = static_cast<int>(hk), entry = static_cast<int>(b);
#pragma unroll
        for (int c = 0; c < BWD_WARPGROUPS; ++c) {
            const uint32_t to = base + L::KV + c * 2 * BYTES;
            const int row = static_cast<int>(j0 + 64 * c);
#pragma unroll
            for (int half = 0; half < D / 64; ++half) {
                tma_load_4d(to + half * 8192, k_map, 64 * half, row, head, entry, kv_bar);
                tma_load_4d(to + BYTES + half * 8192, v_map, 64 * half, row, head, entry, kv_bar);
            }
        }
    }
    if (wg == 0 && warp == COPY_WARP && any_item) {
        for (int st = 0; st < STAGES && ahead.head < groups; ++st) {
            if (tid == 32 * COPY_WARP) issue(ahead, st);
            ahead = next(ahead);
        }
        __syncwarp();
    }
    store_stats(stats, load_stats(item));
    __syncthreads();

    float dk_acc[D / 2], dv_acc[D / 2];
#pragma unroll
    for (int e = 0; e < D / 2; ++e) dk_acc[e] = dv_acc[e] = 0.f;
    const int64_t key0 = kt * BK + warp * 16 + g;  // this thread's keys: key0 and key0 + 8
    // Generated masks: the query tiles' states for this warpgroup's key tile, worked out once
    // (documents in runs: from the queries that see its keys, loaded once).
    [[maybe_unused]] TileSpan keys_span{1, 0, 1, 0};
    if constexpr (MASKS == RUNS) keys_span = mask.view.runs_span(kt, BK, false).tiles(a.m);
    else if constexpr (MASKS == FORMULA) keys_span = mask.view.formula_query_span(kt);
    // Descriptors, computed once: a descriptor plus n addresses the tile n * 16 bytes further on
    // (shared addresses stay below 2^18, so the 14-bit address field does not overflow).
    const uint64_t k_kmajor = kmajor_sw128(sk, 0), v_kmajor = kmajor_sw128(sv, 0);
    const uint64_t q_kmajor = kmajor_sw128(base + L::STAGE0, 0), q_mnmajor = mnmajor_sw128(base + L::STAGE0, 0);
    // dQ's A: warpgroup c's dSᵀ tile of buffer p, ds_step(p, c) further on; its B: warpgroup c's
    // K tile, kv_step(c) further on, from this warpgroup's column half (the second 64-column box
    // at D = 128, 64 bytes into the swizzled rows at D = 64).
    const uint64_t ds_mnmajor = mnmajor_sw128(base + L::DS, 0);
    const uint64_t kq_mnmajor = mnmajor_sw128(base + L::KV, 0) + wg * ((D == 128 ? 8192 : DQ_COLS * 2) / 16);
    auto ds_step = [](int p, int c) -> uint32_t { return (2 * p + c) * (L::DS_BYTES / 16); };
    auto kv_step = [](int c) -> uint32_t { return c * (2 * BYTES / 16); };
    auto kstep = [](int kk) -> uint32_t { return (kk / 4) * (8192 / 16) + (kk % 4) * 2; };
    auto mnstep = [](int kk) -> uint32_t { return kk * (2048 / 16); };
    // Sᵀ = K Qᵀ of item `index` (its stage full first) into st, as one commit group, done before
    // the loop goes on (so ptxas sees each product's whole life in one iteration): the first
    // item's before the loop, each next one's under the dQ products and the dQ staging of the
    // item before.
    static_assert(STAGES >= 3, "item i + 1's stage is not the one refilled during item i");
    auto issue_scores = [&](float(&st)[32], int index) {
        const int stage = __shfl_sync(0xffffffffu, index % STAGES, 0);
        mbarrier_wait(full_bar + 8 * stage, (index / STAGES) & 1);
        const uint64_t q_k = q_kmajor + stage * (2 * BYTES / 16);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) wgmma_scores<T>(st, k_kmajor + kstep(kk), q_k + kstep(kk), kk > 0);
        wgmma_commit();
    };
    float st[32];
    if (any_item) {
        mbarrier_wait(kv_bar, 0);
        issue_scores(st, 0);
        wgmma_wait<0>();
    }
    for (int index = 0; item.head < groups; ++index) {
        const int stage = __shfl_sync(0xffffffffu, index % STAGES, 0);
        const int64_t h = h0 + item.head, qt = item.qt, i0 = qt * BQ;
        uint8_t state;
        if constexpr (GENERATED) state = keys_span.state(static_cast<int>(qt));
        else state = state_of(h, qt, kt);
        // Which of this thread's 32 entries (bit nt * 4 + r: key key0 + (r / 2) * 8, query
        // i0 + nt * 8 + 2 t + r % 2) the mask keeps (none of an empty tile: its products run,
        // and add zeros).
        uint32_t keep = ~0u;
        if (state == TILE_EMPTY) {
            keep = 0;
        } else if (state != TILE_FULL) {
            keep = 0;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                if constexpr (GENERATED) {
                    int lo, hi;
                    mask.query_run(key0 + half * 8, i0, BQ, lo, hi);
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = nt * 8 + 2 * t + e;
                            if (col >= lo && col <= hi) keep |= 1u << (nt * 4 + 2 * half + e);
                        }
                } else {
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (mask.keeps(h, i0 + nt * 8 + 2 * t + e, key0 + half * 8)) keep |= 1u << (nt * 4 + 2 * half + e);
                }
            }
        }
        const Item item_next = next(item);
        const float2 next_stats = load_stats(item_next);  // stored at the end of the item

        // The products in five commit groups, each waited for only where its result is needed:
        // dPᵀ (Sᵀ is done); then Pᵀ (while dPᵀ runs) and dV += Pᵀ dO; then dSᵀ (while dV runs)
        // and dK += dSᵀ Q; dQ once both warpgroups' dSᵀ tiles are in shared memory, and the next
        // item's Sᵀ under it.
        const uint32_t stage_step = stage * (2 * BYTES / 16);  // descriptor units: 16 bytes
        const uint64_t q_k = q_kmajor + stage_step, do_k = q_k + BYTES / 16;
        const uint64_t q_mn = q_mnmajor + stage_step, do_mn = q_mn + BYTES / 16;
        float dpt[32];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) wgmma_scores<T>(dpt, v_kmajor + kstep(kk), do_k + kstep(kk), kk > 0);
        wgmma_commit();

        const float* item_stats = stats + (index & 1) * 128;
        uint32_t pf[4][4], dsf[4][4];  // Pᵀ and dSᵀ as A fragments of 16 queries each, rounded to T
        // A hidden score becomes -inf (probability 0) on a tile the mask cuts, outside the
        // exponentials' loop: most tiles are full.
        if (state != TILE_FULL) {
#pragma unroll
            for (int e = 0; e < 32; ++e)
                if (!(keep >> e & 1u)) st[e] = -INFINITY;
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float2 l2 = *reinterpret_cast<const float2*>(item_stats + nt * 8 + 2 * t);
#pragma unroll
            for (int r = 0; r < 4; ++r)
                st[nt * 4 + r] = exp2f(fmaf(st[nt * 4 + r], a.scale_log2, -((r & 1) ? l2.y : l2.x)));
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) pf[kk][w] = pack2<T>(st[8 * kk + 2 * w], st[8 * kk + 2 * w + 1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_pv<T, D>(dv_acc, pf[kk], do_mn + mnstep(kk));
        wgmma_commit();
        wgmma_wait<1>();  // dPᵀ
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float2 dl = *reinterpret_cast<const float2*>(item_stats + 64 + nt * 8 + 2 * t);
#pragma unroll
            for (int r = 0; r < 4; ++r) dpt[nt * 4 + r] = st[nt * 4 + r] * (dpt[nt * 4 + r] - ((r & 1) ? dl.y : dl.x));
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) dsf[kk][w] = pack2<T>(dpt[8 * kk + 2 * w], dpt[8 * kk + 2 * w + 1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_pv<T, D>(dk_acc, dsf[kk], q_mn + mnstep(kk));
        wgmma_commit();
        // dSᵀ (keys x queries) into shared memory in the 128-byte swizzle: word w of step kk is
        // key row warp * 16 + g + (w % 2) * 8, query columns 8 (2 kk + w / 2) + 2 t, + 1. The
        // buffer was last read by the item before the previous one, whose dQ products both
        // warpgroups waited for before the previous item's block barrier.
        const uint32_t sds = base + L::DS + (2 * (index & 1) + wg) * L::DS_BYTES;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const int row = warp * 16 + g + (w & 1) * 8, chunk = 2 * kk + (w >> 1);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + row * 128 + ((chunk ^ g) << 4) + 4 * t),
                             "r"(dsf[kk][w])
                             : "memory");
            }
        // The next item's statistics, into the buffer the previous item read (before its block
        // barrier, which every warp passed after those reads).
        store_stats(stats + ((index + 1) & 1) * 128, next_stats);
        fence_async_shared();
        named_sync(BOTH_DS_BARRIER, BWD_THREADS);  // both warpgroups' dSᵀ tiles are written
        // Every warp of the block has waited for the previous item's products, the last readers
        // of its Q / dO stage: the stage takes the next item to copy.
        if (wg == 0 && warp == COPY_WARP && index > 0) {
            if (ahead.head < groups) {
                if (lane == 0) issue(ahead, (index - 1) % STAGES);
                ahead = next(ahead);
            }
            __syncwarp();
        }
        // This warpgroup's head-dim half of dQ over the block's 128 keys, added into the item's
        // block of dq_accum in fragment order (thread (warp, lane)'s 8-column tile nt as the float4
        // at (warp * DQ_COLS / 8 + nt) * 32 + lane) by 16-byte reductions: a warp's instruction
        // covers 512 contiguous bytes.
        {
            float dq[DQ_COLS / 2];
            wgmma_fence();
#pragma unroll
            for (int c = 0; c < BWD_WARPGROUPS; ++c)
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    wgmma_tt<T, DQ_COLS>(dq, ds_mnmajor + ds_step(index & 1, c) + mnstep(kk),
                                         kq_mnmajor + kv_step(c) + mnstep(kk), c > 0 || kk > 0);
            wgmma_commit();
            if (item_next.head < groups) {
                wgmma_wait<1>();  // dV and dK (their A fragments are free), dQ may run
                issue_scores(st, index + 1);
                wgmma_wait<1>();  // dQ; the next Sᵀ may run
            } else {
                wgmma_wait<0>();  // (dV, dK and) dQ
            }
            float4* warp_dq = reinterpret_cast<float4*>(dq_accum + ((b * a.heads + h) * a.row_tiles + qt) * (64 * D) +
                                                        wg * (64 * DQ_COLS)) +
                              (warp * (DQ_COLS / 8)) * 32 + lane;
#pragma unroll
            for (int nt = 0; nt < DQ_COLS / 8; ++nt)
                red_add4(warp_dq + nt * 32, make_float4(dq[nt * 4], dq[nt * 4 + 1], dq[nt * 4 + 2], dq[nt * 4 + 3]));
        }
        wgmma_wait<0>();  // the next item's Sᵀ (unconditional, so that ptxas sees it done)
        item = item_next;
    }
    // Both warpgroups' last dQ products, which read both K tiles, are done.
    named_sync(BOTH_DS_BARRIER, BWD_THREADS);

    // Every product of the warpgroup has been waited for, and only it reads its K and V tiles:
    // dk and dv take their place (row r's 16-byte chunk c of a 64-column box at
    // box * 8192 + r * 128 + (c ^ r % 8) * 16, the layout TMA reads), then go out by TMA.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + half * 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const uint32_t at = (nt / 8) * 8192 + row * 128 + (((nt % 8) ^ g) << 4) + 4 * t;
            st_shared_u32(sk + at, pack2<T>(dk_acc[nt * 4 + 2 * half] * a.scale, dk_acc[nt * 4 + 2 * half + 1] * a.scale));
            st_shared_u32(sv + at, pack2<T>(dv_acc[nt * 4 + 2 * half], dv_acc[nt * 4 + 2 * half + 1]));
        }
    }
    fence_async_shared();
    named_sync(DKV_BARRIER + wg, 128);
    if (wtid == 0) {
        const int row = static_cast<int>(kt * BK), head = static_cast<int>(hk), entry = static_cast<int>(b);
#pragma unroll
        for (int box = 0; box < D / 64; ++box) {
            tma_store_4d(dk_map, 64 * box, row, head, entry, sk + box * 8192);
            tma_store_4d(dv_map, 64 * box, row, head, entry, sv + box * 8192);
        }
        bulk_wait_read<0>();  // shared memory stays until the stores have read it
    }
}

}  // namespace

// Exported kernels: attention_fwd_sm90_{generated,runs,stored}_d{64,128}_{f16,bf16} (generated:
// full, causal and window masks; runs: documents in contiguous runs, `ids` holding each position's
// document as MaskView::document_of reads it; stored: other documents and dense masks), with the arguments of the
// portable attention_fwd_d*_* (src/cuda/attention.cu) but TMA maps of k and v for their pointers,
// and dq_zero: null, or the backward's dq accumulator (f32 [b, h, row_tiles, 64 x D]), which the
// forward then sets to zero on the way (the backward's memset, off its path).
#define ATTENTION_SM90_MASK(T, RUST, D, KIND, MASKS)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) attention_fwd_sm90_##KIND##_d##D##_##RUST(               \
        const T* q, const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, T* out,         \
        float* lse, const uint8_t* states, const uint8_t* dense, const int64_t* ids, AttentionArgs a,                 \
        float* dq_zero) {                                                                                             \
        forward_ws<T, D, MASKS>(q, &k_map, &v_map, out, lse, states, dense, ids, a, dq_zero);                     \
    }
#define ATTENTION_SM90(T, RUST, D)                                                                                    \
    ATTENTION_SM90_MASK(T, RUST, D, generated, FORMULA)                                                               \
    ATTENTION_SM90_MASK(T, RUST, D, runs, RUNS) ATTENTION_SM90_MASK(T, RUST, D, stored, STORED)
ATTENTION_SM90(__half, f16, 64)
ATTENTION_SM90(__half, f16, 128)
ATTENTION_SM90(__nv_bfloat16, bf16, 64)
ATTENTION_SM90(__nv_bfloat16, bf16, 128)

// attention_bwd_sm90_{generated,runs,stored}_d{64,128}_{f16,bf16}: dk, dv and dq (into dq_accum, f32,
// zeroed by the host or the forward, which attention_dq_rows_sm90_d*_* then turns into dq) after
// attention_delta_*; a block of two warpgroups
// per 128 keys of a (batch entry, kv head); TMA maps of q, k, v and grad_out (read) and of dk and
// dv (written).
#define ATTENTION_SM90_BWD_MASK(T, RUST, D, KIND, MASKS)                                                          \
    extern "C" __global__ void __launch_bounds__(BWD_THREADS, 1) attention_bwd_sm90_##KIND##_d##D##_##RUST(     \
        const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,                             \
        const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap do_map, const float* lse,          \
        const float* delta, const __grid_constant__ TensorMap dk_map, const __grid_constant__ TensorMap dv_map,      \
        float* dq_accum, const uint8_t* states, const uint8_t* dense,                                                 \
        const int64_t* ids, AttentionArgs a) {                                                                        \
        backward_ws<T, D, MASKS>(&q_map, &k_map, &v_map, &do_map, lse, delta, &dk_map, &dv_map, dq_accum, states,     \
                                 dense, ids, a);                                                                      \
    }
#define ATTENTION_SM90_BWD(T, RUST, D)                                                                                \
    ATTENTION_SM90_BWD_MASK(T, RUST, D, generated, FORMULA)                                                           \
    ATTENTION_SM90_BWD_MASK(T, RUST, D, runs, RUNS) ATTENTION_SM90_BWD_MASK(T, RUST, D, stored, STORED)              \
    extern "C" __global__ void __launch_bounds__(AC::DQ_ROWS_THREADS)                                               \
        attention_dq_rows_sm90_d##D##_##RUST(const float4* dq_accum, T* dq, AttentionArgs a) {                        \
        dq_rows<T, D, BWD_WARPGROUPS>(dq_accum, dq, a);                                                               \
    }
ATTENTION_SM90_BWD(__half, f16, 64)
ATTENTION_SM90_BWD(__half, f16, 128)
ATTENTION_SM90_BWD(__nv_bfloat16, bf16, 64)
ATTENTION_SM90_BWD(__nv_bfloat16, bf16, 128)
