// Bias-add: dst[e] = src[e] + bias[(e / inner) % channels] over a dense buffer of n elements.
// `inner` is the product of the dims after the bias dim (1 for NHWC / last-dim, H*W for NCHW).
//
// Memory-bound: each element is read once and written once, so the kernel is built around 16-byte
// accesses. The destination is split into a scalar head (until it is 16-byte aligned), a vector
// body and a scalar tail; the source is read with vector loads when it shares the destination's
// alignment, element by element otherwise (a storage offset can misalign it). The bias is staged
// in shared memory in its own dtype, and the channel of each vector is tracked incrementally
// across the grid-stride loop, so the loop has no integer division.
#include "common.cuh"

using namespace fastops;

namespace {

__device__ __forceinline__ uint32_t channel_of(uint64_t e, uint64_t inner, uint32_t channels) {
    return static_cast<uint32_t>((e / inner) % channels);
}

// `src == nullptr` means in place (src is dst): launching with one pointer twice would need two
// borrows of the same buffer on the Rust side.
template <typename T, CacheHint H>
__device__ void bias_add(const T* src, T* dst, const T* bias, uint64_t n, uint64_t inner,
                         uint32_t channels, uint32_t bias_in_smem) {
    constexpr int VEC = vec_width<T>();
    constexpr int UNROLL = fastops_constants::bias_add::UNROLL;
    if (src == nullptr) src = dst;
    extern __shared__ __align__(16) unsigned char smem_raw[];

    const T* bias_src = bias;
    if (bias_in_smem) {
        T* smem_bias = reinterpret_cast<T*>(smem_raw);
        for (uint32_t i = threadIdx.x; i < channels; i += blockDim.x) smem_bias[i] = bias[i];
        __syncthreads();
        bias_src = smem_bias;
    }
    const bool bias_vectorisable = aligned16(bias_src);

    const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t nthreads = static_cast<uint64_t>(gridDim.x) * blockDim.x;

    const uint64_t misalign = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    const uint64_t head = min(n, static_cast<uint64_t>(misalign / sizeof(T)));
    const uint64_t nvec = (n - head) / VEC;
    const uint64_t tail_start = head + nvec * VEC;

    // Scalar head and tail (fewer than VEC elements each).
    if (tid < head) {
        dst[tid] = from_float<T>(to_float(src[tid]) + to_float(bias_src[channel_of(tid, inner, channels)]));
    }
    if (tid < n - tail_start) {
        const uint64_t e = tail_start + tid;
        dst[e] = from_float<T>(to_float(src[e]) + to_float(bias_src[channel_of(e, inner, channels)]));
    }
    if (tid >= nvec) return;

    const bool src_vectorisable = aligned16(src + head);
    const uint4* src_vec = reinterpret_cast<const uint4*>(src + head);
    uint4* dst_vec = reinterpret_cast<uint4*>(dst + head);

    // Position of this thread's first vector: channel c and offset r inside the channel's run.
    uint64_t e0 = head + tid * VEC;
    uint64_t q = e0 / inner;
    uint64_t r = e0 - q * inner;
    uint32_t c = static_cast<uint32_t>(q % channels);
    // The same decomposition of the grid stride, to advance (c, r) without dividing.
    const uint64_t stride = nthreads * VEC;
    const uint64_t stride_q = stride / inner;
    const uint64_t stride_r = stride - stride_q * inner;
    const uint32_t stride_c = static_cast<uint32_t>(stride_q % channels);

    // UNROLL independent 16-byte loads are issued before the first use, so enough bytes are in
    // flight per thread to cover HBM latency at the occupancy the register count allows.
    for (uint64_t v0 = tid; v0 < nvec; v0 += UNROLL * nthreads) {
        Vec16<T> x[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t v = v0 + k * nthreads;
            if (v >= nvec) break;
            if (src_vectorisable) {
                x[k].raw = load16<H>(src_vec + v);
            } else {
                const T* s = src + head + v * VEC;
#pragma unroll
                for (int j = 0; j < VEC; ++j) x[k].lanes[j] = s[j];
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t v = v0 + k * nthreads;
            if (v >= nvec) break;
            float b[VEC];
            if (r + VEC <= inner) {
                // The whole vector lies in one channel (NCHW-like layouts).
                const float bc = to_float(bias_src[c]);
#pragma unroll
                for (int j = 0; j < VEC; ++j) b[j] = bc;
            } else if (inner == 1 && c + VEC <= channels && (c % VEC) == 0 && bias_vectorisable) {
                // Last-dim bias: VEC consecutive channels, one 16-byte shared-memory read per lane.
                Vec16<T> bv;
                bv.raw = *reinterpret_cast<const uint4*>(bias_src + c);
#pragma unroll
                for (int j = 0; j < VEC; j += 2) {
                    const float2 pair = to_float2(bv.lanes + j);
                    b[j] = pair.x;
                    b[j + 1] = pair.y;
                }
            } else {
                uint64_t rr = r;
                uint32_t cc = c;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    b[j] = to_float(bias_src[cc]);
                    if (++rr == inner) {
                        rr = 0;
                        if (++cc == channels) cc = 0;
                    }
                }
            }
            Vec16<T> y;
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const float2 xs = to_float2(x[k].lanes + j);
                from_float2(y.lanes + j, xs.x + b[j], xs.y + b[j + 1]);
            }
            store16<H>(dst_vec + v, y.raw);

            // Advance (c, r) by one grid stride.
            r += stride_r;
            if (r >= inner) {
                r -= inner;
                c += 1;
            }
            c += stride_c;
            if (c >= channels) c -= channels;
        }
    }
}

}  // namespace

#define BIAS_ADD_KERNEL(NAME, HINT, T, SUFFIX)                                                     \
    extern "C" __global__ void __launch_bounds__(fastops_constants::bias_add::THREADS) NAME##_##SUFFIX(const T* src, T* dst, const T* bias, uint64_t n,  \
                                               uint64_t inner, uint32_t channels,                \
                                               uint32_t bias_in_smem) {                          \
        bias_add<T, HINT>(src, dst, bias, n, inner, channels, bias_in_smem);                     \
    }

#define BIAS_ADD_STREAMING(T, SUFFIX) BIAS_ADD_KERNEL(bias_add, CacheHint::Streaming, T, SUFFIX)
FASTOPS_FLOAT_KERNELS(BIAS_ADD_STREAMING)

// Cache-hint variants, f32 only: the bench compares them with the default above.
BIAS_ADD_KERNEL(bias_add_volatile, CacheHint::Volatile, float, f32)
BIAS_ADD_KERNEL(bias_add_plain, CacheHint::Default, float, f32)
