// masked_attention on Hopper (sm_90a): the forward with wgmma. build.rs compiles this directory
// for compute_90a only (PTX that loads on compute capability 9.0 and nowhere else); the host picks
// these kernels on such a GPU for f16 / bf16 with head dims up to 128 and falls back to
// src/cuda/attention.cu elsewhere. Same contract as the portable forward: out [b, h, m, dv] and
// the natural log-sum-exp [b, h, m], f32 softmax statistics, probabilities rounded to the operand
// type before P V, a row that sees no key gives zeros and -inf.
//
// A block has HOPPER_WARPGROUPS warpgroups; warpgroup w takes mask tile qt0 + w (64 queries, a
// warp 16 rows) and they share the block's K / V tiles of 64 keys, streamed through two cp.async
// stages over the key tiles any of the block's query tiles sees (tile states as in MaskView). Per
// key tile a warpgroup with a non-empty tile computes S = Q Kᵀ (wgmma m64n64k16, both operands from
// shared memory), masks a partial tile entry by entry, runs the online softmax on the accumulators
// and issues O += P V (wgmma m64nDk16, P from registers, V transposed from shared memory). Head
// dims are zero-padded to D (64 or 128) in shared memory. Shared tiles use the no-swizzle
// core-matrix layout: the 16-byte chunk c of row r of a 64 x D tile sits at
// (r / 8) * ROW_GROUP + c * 128 + (r % 8) * 16 bytes, ROW_GROUP = D / 8 * 128 (layouts and
// descriptors verified by scripts/hopper/wgmma_probe.cu).
#include "attention_common.cuh"

using namespace fastops;

namespace {

constexpr int WARPGROUPS = AC::HOPPER_WARPGROUPS;
constexpr int THREADS = 128 * WARPGROUPS;
static_assert(BQ == 64 && BK == 64, "a warpgroup's wgmma tile is 64 queries x 64 keys");

template <int D> struct TileLayout {
    static constexpr int BYTES = 64 * D * 2;        // one 64 x D tile of 16-bit elements
    static constexpr int ROW_GROUP = D / 8 * 128;   // bytes between 8-row groups
    static constexpr int CHUNKS = D / 8;            // 16-byte chunks per row
};

// The shared-memory matrix descriptor of a no-swizzle operand: start address, the byte distance
// between core matrices along K (leading) and along M / N (stride).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
    return static_cast<uint64_t>((addr >> 4) & 0x3fff) | static_cast<uint64_t>((leading >> 4) & 0x3fff) << 16 |
           static_cast<uint64_t>((stride >> 4) & 0x3fff) << 32;
}

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

// Eight accumulator registers d[i] .. d[i + 7] as read-write asm operands.
#define WG_ACC8(d, i)                                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),     \
        "+f"(d[i + 7])

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

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Makes this thread's completed cp.async writes to shared memory visible to wgmma (async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    uint32_t r;
    from_float2<T>(reinterpret_cast<T*>(&r), x, y);
    return r;
}

// GENERATED: the mask is full, causal or a window (its tiles and runs in closed form); otherwise
// it has tile states and entries in memory (documents, dense). Two instances, so that neither
// carries the other's registers.
template <typename T, int D, bool GENERATED>
__device__ __forceinline__ void forward_wgmma(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, T* __restrict__ out, float* __restrict__ lse,
                                              const uint8_t* states, const uint8_t* dense, const int64_t* ids,
                                              const AttentionArgs& a) {
    using L = TileLayout<D>;
    extern __shared__ __align__(128) unsigned char shared_raw[];
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // WARPGROUPS Q tiles, then two stages of K, then two of V.
    const uint32_t sq = shared_address(shared_raw) + wg * L::BYTES;
    const uint32_t sk = shared_address(shared_raw) + WARPGROUPS * L::BYTES, sv = sk + 2 * L::BYTES;

    // The block: batch entry b, head h, query tiles qt0 .. qt0 + WARPGROUPS - 1 (the longest rows
    // first, for causal masks).
    const int64_t heads_total = a.batch * a.heads, block = blockIdx.x;
    const int64_t row_blocks = (a.row_tiles + WARPGROUPS - 1) / WARPGROUPS;
    const int64_t qt0 = (row_blocks - 1 - block / heads_total) * WARPGROUPS, bh = block % heads_total;
    const int64_t b = bh / a.heads, h = bh % a.heads, hk = h / (a.heads / a.kv_heads);
    const int64_t qt = qt0 + wg;
    const bool active = qt < a.row_tiles;  // false past the last query tile (a partial block)
    const MaskView mask{a, states, dense, ids, b};
    const int64_t i0 = qt0 * BQ, block_rows = min(static_cast<int64_t>(BQ * WARPGROUPS), a.m - i0);
    int64_t kt_first = 0, kt_last = a.col_tiles - 1;
    if constexpr (GENERATED) mask.key_tiles(i0, i0 + block_rows - 1, kt_first, kt_last);
    // The first key tile after kt that any query tile of the block sees (col_tiles when none);
    // called by every thread with the same kt.
    auto next = [&](int64_t kt) -> int64_t {
        if constexpr (GENERATED) {
            const int64_t c = max(kt + 1, kt_first);
            return c <= kt_last ? c : a.col_tiles;
        }
        return next_live(kt, a.col_tiles, [&](int64_t c) {
            bool live = false;
#pragma unroll
            for (int w = 0; w < WARPGROUPS; ++w)
                live |= qt0 + w < a.row_tiles && mask.tile_state(h, qt0 + w, c) != TILE_EMPTY;
            return live;
        });
    };
    // Warpgroup 0 copies K, the last warpgroup V (addresses recomputed from the arguments at
    // each copy: nothing of them stays live in registers across the softmax).
    auto load_kv = [&](int64_t kt, int stage) {
        const int64_t j0 = kt * BK;
        const int keys = static_cast<int>(min(static_cast<int64_t>(BK), a.n - j0));
        if (wg == 0)
            load_tile<T, D>(sk + stage * L::BYTES, k + b * a.k_strides[0] + hk * a.k_strides[1] + j0 * a.k_strides[2],
                            a.k_strides[2], keys, a.d, tid);
        if (wg == WARPGROUPS - 1)
            load_tile<T, D>(sv + stage * L::BYTES, v + b * a.v_strides[0] + hk * a.v_strides[1] + j0 * a.v_strides[2],
                            a.v_strides[2], keys, a.dv, tid);
    };

    if (active)
        load_tile<T, D>(sq, q + b * a.q_strides[0] + h * a.q_strides[1] + qt * BQ * a.q_strides[2], a.q_strides[2],
                        static_cast<int>(min(static_cast<int64_t>(BQ), a.m - qt * BQ)), a.d, tid);
    int64_t kt = next(-1);
    if (kt < a.col_tiles) load_kv(kt, 0);
    cp_async_commit();

    float o[D / 2], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    // This thread's rows: row0 and row0 + 8. Accumulator element r of 8-column tile nt is row
    // row0 + (r / 2) * 8, column nt * 8 + 2 t + r % 2 (the mma.sync layout, per warp).
    const int64_t row0 = qt * BQ + warp * 16 + g;
    int stage = 0;
    while (kt < a.col_tiles) {
        const int64_t following = next(kt);
        if (following < a.col_tiles) load_kv(following, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_async_shared();
        __syncthreads();
        // Every thread takes both barriers of every step; a warpgroup whose tile is empty only
        // waits at them.
        const uint8_t state = active ? mask.tile_state(h, qt, kt) : TILE_EMPTY;
        if (state != TILE_EMPTY) {
            // Which of this thread's 32 scores a partial tile keeps (bit nt * 4 + r), worked out
            // before the scores exist so that its index arithmetic is not live beside them.
            const int64_t j0 = kt * BK;
            uint32_t keep = ~0u;
            if (GENERATED && state != TILE_FULL) {
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
            } else if (!GENERATED && state != TILE_FULL) {
                keep = 0;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        if (mask.keeps(h, row0 + (r >> 1) * 8, j0 + nt * 8 + 2 * t + (r & 1))) keep |= 1u << (nt * 4 + r);
            }
            float s[32];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_scores<T>(s, smem_desc(sq + kk * 256, 128, L::ROW_GROUP),
                                smem_desc(sk + stage * L::BYTES + kk * 256, 128, L::ROW_GROUP), kk > 0);
            wgmma_commit();
            wgmma_wait_all();
            if (state != TILE_FULL) {
#pragma unroll
                for (int i = 0; i < 32; ++i)
                    if (!(keep >> i & 1u)) s[i] = -INFINITY;
            }
            // The online softmax (raw scores; scale_log2 > 0): a row's exponent reference moves
            // only when a score passes it by more than RESCALE_SLACK.
            float alpha[2];
            bool moved = false;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[nt * 4 + 2 * half], s[nt * 4 + 2 * half + 1]));
                const float seen = quad_max(tile_max) * a.scale_log2, old_max = row_max[half];
                const float new_max = seen > old_max + RESCALE_SLACK ? seen : old_max;
                const float base = new_max == -INFINITY ? 0.f : new_max;
                alpha[half] = exp2f(old_max - base);
                moved |= new_max != old_max;
                row_max[half] = new_max;
                row_sum[half] *= alpha[half];
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(fmaf(s[nt * 4 + 2 * half + e], a.scale_log2, -base));
                        s[nt * 4 + 2 * half + e] = p;
                        row_sum[half] += p;
                    }
            }
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const uint32_t p[4] = {pack2<T>(s[8 * kk], s[8 * kk + 1]), pack2<T>(s[8 * kk + 2], s[8 * kk + 3]),
                                       pack2<T>(s[8 * kk + 4], s[8 * kk + 5]), pack2<T>(s[8 * kk + 6], s[8 * kk + 7])};
                // Keys 16 kk .. 16 kk + 15 are two 8-row groups of the V tile.
                wgmma_pv<T, D>(o, p, smem_desc(sv + stage * L::BYTES + kk * 2 * L::ROW_GROUP, L::ROW_GROUP, 128));
            }
            wgmma_commit();
            wgmma_wait_all();
        }
        __syncthreads();  // this stage's K / V are read before the next step's copies overwrite them
        stage ^= 1;
        kt = following;
    }
    cp_async_wait<0>();
    if (!active) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float sum = quad_sum(row_sum[half]), inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t row = row0 + half * 8;
        if (row >= a.m) continue;
        if (t == 0) lse[bh * a.m + row] = sum > 0.f ? (row_max[half] + log2f(sum)) * LN2 : -INFINITY;
        T* dst = out + (bh * a.m + row) * a.dv;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * t;
            if (col < a.dv) from_float2<T>(dst + col, o[nt * 4 + 2 * half] * inv, o[nt * 4 + 2 * half + 1] * inv);
        }
    }
}

}  // namespace

// Exported kernels: attention_fwd_sm90_{generated,stored}_d{64,128}_{f16,bf16} (generated:
// full, causal and window masks; stored: documents and dense masks), with the arguments of the
// portable attention_fwd_d*_* (src/cuda/attention.cu).
#define ATTENTION_SM90_MASK(T, RUST, D, KIND, GENERATED)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                          \
        attention_fwd_sm90_##KIND##_d##D##_##RUST(const T* q, const T* k, const T* v, T* out, float* lse,             \
                                                  const uint8_t* states, const uint8_t* dense, const int64_t* ids,    \
                                                  AttentionArgs a) {                                                  \
        forward_wgmma<T, D, GENERATED>(q, k, v, out, lse, states, dense, ids, a);                                     \
    }
#define ATTENTION_SM90(T, RUST, D) ATTENTION_SM90_MASK(T, RUST, D, generated, true) ATTENTION_SM90_MASK(T, RUST, D, stored, false)
ATTENTION_SM90(__half, f16, 64)
ATTENTION_SM90(__half, f16, 128)
ATTENTION_SM90(__nv_bfloat16, bf16, 64)
ATTENTION_SM90(__nv_bfloat16, bf16, 128)
