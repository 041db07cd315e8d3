// Bias-add: dst[e] = src[e] + bias[(e / inner) % channels] over a dense buffer of n elements,
// clamped to [0, ceiling] in f32 before the store when a clipped ReLU is fused.
// `inner` is the product of the dims after the bias dim (1 for NHWC / last-dim, H*W for NCHW).
//
// Memory-bound: each element is read once and written once, in 16-byte accesses. The
// destination is split into a scalar head (until it is 16-byte aligned), a vector body and a
// scalar tail; the source is read with vector loads when it shares the destination's alignment,
// element by element otherwise (a storage offset can misalign it). Each thread moves one vector
// (the grid covers the body; a grid-stride loop takes the rest only past 2^31 blocks): on the
// H200 this reaches the device-to-device copy rate, where persistent grid-stride blocks with
// several loads in flight per thread stop at 85-93% of it (BENCHMARKS.md, bias_add). The channel
// of a vector is found with two divisions by invariant 64-bit integers (multiply-high); the
// bias is read through L1.
#include "common.cuh"

using namespace fastops;

namespace {

// n / d for any 64-bit n by multiply-high (Granlund & Montgomery, round-up method):
// t = umulhi(multiplier, n), q = (t + ((n - t) >> shift1)) >> shift2.
struct FastDiv64 {
    uint64_t divisor, multiplier;
    uint32_t shift1, shift2;
    __device__ __forceinline__ uint64_t div(uint64_t n) const {
        const uint64_t t = __umul64hi(multiplier, n);
        return (t + ((n - t) >> shift1)) >> shift2;
    }
};
static_assert(sizeof(FastDiv64) == 24, "FastDiv64 is mirrored by a Rust #[repr(C)] struct of 24 bytes");

struct BiasAddShape {
    uint64_t n;  // elements of src / dst
    FastDiv64 inner, channels;
    float ceiling;     // the fused clipped ReLU's upper bound (used when clamped != 0)
    uint32_t clamped;  // nonzero: dst = clamp(src + bias, 0, ceiling)
};
static_assert(sizeof(BiasAddShape) == 64, "BiasAddShape is mirrored by a Rust #[repr(C)] struct of 64 bytes");

// Channel c of element e and e's offset r inside its channel's run of `inner` elements.
__device__ __forceinline__ void locate(const BiasAddShape& s, uint64_t e, uint64_t& c, uint64_t& r) {
    const uint64_t q = s.inner.div(e);
    r = e - q * s.inner.divisor;
    c = q - s.channels.div(q) * s.channels.divisor;
}

// `src == nullptr` means in place (src is dst): launching with one pointer twice would need two
// borrows of the same buffer on the Rust side.
template <typename T, CacheHint H>
__device__ void bias_add(const T* src, T* dst, const T* __restrict__ bias, const BiasAddShape& s) {
    constexpr int VEC = vec_width<T>();
    if (src == nullptr) src = dst;
    const uint64_t n = s.n, inner = s.inner.divisor, channels = s.channels.divisor;
    const bool clamped = s.clamped != 0;
    const float ceiling = s.ceiling;
    auto activate = [&](float v) { return clamped ? clipped_relu(v, ceiling) : v; };
    const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t nthreads = static_cast<uint64_t>(gridDim.x) * blockDim.x;

    const uint64_t misalign = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    const uint64_t head = min(n, static_cast<uint64_t>(misalign / sizeof(T)));
    const uint64_t nvec = (n - head) / VEC;
    const uint64_t tail_start = head + nvec * VEC;
    auto scalar = [&](uint64_t e) {
        uint64_t c, r;
        locate(s, e, c, r);
        dst[e] = from_float<T>(activate(to_float(src[e]) + to_float(__ldg(bias + c))));
    };
    // Scalar head and tail (fewer than VEC elements each).
    if (tid < head) scalar(tid);
    if (tid < n - tail_start) scalar(tail_start + tid);

    const bool src_vectorisable = aligned16(src + head);
    const bool bias_vectorisable = aligned16(bias);
    const uint4* src_vec = reinterpret_cast<const uint4*>(src + head);
    uint4* dst_vec = reinterpret_cast<uint4*>(dst + head);
    for (uint64_t v = tid; v < nvec; v += nthreads) {
        Vec16<T> x;
        if (src_vectorisable) {
            x.raw = load16<H>(src_vec + v);
        } else {
            const T* p = src + head + v * VEC;
#pragma unroll
            for (int j = 0; j < VEC; ++j) x.lanes[j] = p[j];
        }
        const uint64_t e = head + v * VEC;
        uint64_t c, r = 0;
        if (inner == 1) c = e - s.channels.div(e) * channels;  // last-dim bias: one division
        else locate(s, e, c, r);
        float b[VEC];
        if (r + VEC <= inner) {
            // The whole vector lies in one channel (NCHW-like layouts).
            const float bc = to_float(__ldg(bias + c));
#pragma unroll
            for (int j = 0; j < VEC; ++j) b[j] = bc;
        } else if (inner == 1 && c + VEC <= channels && (c % VEC) == 0 && bias_vectorisable) {
            // Last-dim bias: VEC consecutive channels, one 16-byte read.
            Vec16<T> bv;
            bv.raw = __ldg(reinterpret_cast<const uint4*>(bias + c));
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const float2 pair = to_float2(bv.lanes + j);
                b[j] = pair.x;
                b[j + 1] = pair.y;
            }
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                b[j] = to_float(__ldg(bias + c));
                if (++r == inner) {
                    r = 0;
                    if (++c == channels) c = 0;
                }
            }
        }
        Vec16<T> y;
#pragma unroll
        for (int j = 0; j < VEC; j += 2) {
            const float2 xs = to_float2(x.lanes + j);
            from_float2(y.lanes + j, activate(xs.x + b[j]), activate(xs.y + b[j + 1]));
        }
        store16<H>(dst_vec + v, y.raw);
    }
}

// out[e] = grad[e] where 0 < ys[e] < ceiling (rounded to T, as the stored ys were), else 0:
// the gradient behind a fused clipped ReLU. Memory-bound; 16-byte vectors when the three
// buffers are aligned, element by element otherwise; a grid-stride loop.
template <typename T>
__device__ void clipped_relu_grad(const T* __restrict__ ys, const T* __restrict__ grad, T* __restrict__ out,
                                  uint64_t n, float ceiling_in) {
    constexpr int VEC = vec_width<T>();
    const float ceiling = to_float(from_float<T>(ceiling_in));
    const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t nthreads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t scalar_start = 0;
    if (aligned16(ys) && aligned16(grad) && aligned16(out)) {
        const uint64_t nvec = n / VEC;
        for (uint64_t v = tid; v < nvec; v += nthreads) {
            Vec16<T> y, g, o;
            y.raw = load16<CacheHint::Streaming>(reinterpret_cast<const uint4*>(ys) + v);
            g.raw = load16<CacheHint::Streaming>(reinterpret_cast<const uint4*>(grad) + v);
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
                const float2 yy = to_float2(y.lanes + j), gg = to_float2(g.lanes + j);
                from_float2(o.lanes + j, through_clipped_relu(gg.x, yy.x, ceiling),
                            through_clipped_relu(gg.y, yy.y, ceiling));
            }
            store16<CacheHint::Streaming>(reinterpret_cast<uint4*>(out) + v, o.raw);
        }
        scalar_start = nvec * VEC;
    }
    for (uint64_t e = scalar_start + tid; e < n; e += nthreads)
        out[e] = from_float<T>(through_clipped_relu(to_float(grad[e]), to_float(ys[e]), ceiling));
}

}  // namespace

#define CLIPPED_RELU_GRAD_KERNEL(T, SUFFIX)                                                        \
    extern "C" __global__ void __launch_bounds__(fastops_constants::bias_add::THREADS)             \
        bias_add_clipped_relu_grad_##SUFFIX(const T* ys, const T* grad, T* out, uint64_t n,        \
                                            float ceiling) {                                       \
        clipped_relu_grad<T>(ys, grad, out, n, ceiling);                                           \
    }
FASTOPS_FLOAT_KERNELS(CLIPPED_RELU_GRAD_KERNEL)

#define BIAS_ADD_KERNEL(NAME, HINT, T, SUFFIX)                                                     \
    extern "C" __global__ void __launch_bounds__(fastops_constants::bias_add::THREADS)            \
        NAME##_##SUFFIX(const T* src, T* dst, const T* bias, BiasAddShape shape) {                 \
        bias_add<T, HINT>(src, dst, bias, shape);                                                  \
    }

#define BIAS_ADD_STREAMING(T, SUFFIX) BIAS_ADD_KERNEL(bias_add, CacheHint::Streaming, T, SUFFIX)
FASTOPS_FLOAT_KERNELS(BIAS_ADD_STREAMING)

// Cache-hint variants, f32 only: the bench compares them with the default above.
BIAS_ADD_KERNEL(bias_add_volatile, CacheHint::Volatile, float, f32)
BIAS_ADD_KERNEL(bias_add_plain, CacheHint::Default, float, f32)
