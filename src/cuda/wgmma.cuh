// Hopper (sm_90a) helpers shared by the kernels of src/cuda/sm90/: shared-memory matrix
// descriptors, the wgmma fence / commit / wait, the async-proxy fence, mbarriers, bulk copies.
// Included only by files compiled for compute_90a.
#pragma once
#include <cstdint>

namespace {

// The shared-memory matrix descriptor of a no-swizzle operand: start address, the byte distance
// between core matrices along K (leading) and along M / N (stride).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
    return static_cast<uint64_t>((addr >> 4) & 0x3fff) | static_cast<uint64_t>((leading >> 4) & 0x3fff) << 16 |
           static_cast<uint64_t>((stride >> 4) & 0x3fff) << 32;
}
// The same for an operand in the 128-byte swizzle layout (rows of 128 bytes whose 16-byte chunks
// are permuted by the row's index within its 8-row group, in 1024-byte aligned groups; what TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr, uint32_t leading, uint32_t stride) {
    return smem_desc(addr, leading, stride) | (1ull << 62);
}

// A descriptor whose start address is `units` 16-byte units further on: an add to the low word
// only (the caller keeps the address field, 14 bits, from overflowing).
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t units) {
    return (desc & 0xffffffff00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(desc) + units);
}

// Eight accumulator registers d[i] .. d[i + 7] as read-write asm operands.
#define WG_ACC8(d, i)                                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),     \
        "+f"(d[i + 7])

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Makes this thread's completed cp.async writes to shared memory visible to wgmma (async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// mbarriers (shared memory, 8 bytes each).
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Waits until the phase of parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_LOOP:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_LOOP;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the mbarrier (one of its count) and adds `bytes` to the transaction bytes it waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// A 32-bit store to shared memory.
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
// Named barriers (bar.sync / bar.arrive on barrier `id` for `threads` threads).
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A 1-D bulk copy (the TMA unit, async proxy) of `bytes` (a multiple of 16, both addresses
// 16-byte aligned) from global memory into shared memory, completing its bytes on the mbarrier.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

}  // namespace
