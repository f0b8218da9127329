// Hopper warpgroup MMA (wgmma, sm_90a) helpers for the tensor-core prefill kernel (A from registers:
// the m16n8k16 A fragment of each warp, warp w holding rows 16w .. 16w + 15 of the warpgroup's 64)
// and the cache write of compress.cu (A from shared memory); B from shared memory through a matrix
// descriptor, f32 accumulators in the layout of eight m16n8 C fragments (d[j]: columns
// 8j + 2 (lane % 4), +1 of rows lane / 4 and + 8).
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" (wgmma.mma_async, matrix
// descriptor format, canonical 128-byte swizzle layouts).
//
// Shared-memory layout of a B tile (both K-major and MN-major use it): blocks of 64 b16 columns,
// each [rows][64] with 128-byte rows; the 16-byte chunk c of row r at chunk c ^ (r % 8); each block
// 1024-byte aligned (the swizzle is on address bits 4-6 XOR 7-9).
#ifndef JAX_TQ_WGMMA_CUH_
#define JAX_TQ_WGMMA_CUH_

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JTQ_WGMMA 1
#else
#define JTQ_WGMMA 0
#endif

namespace jax_tq {
namespace cuda {
namespace {

// Descriptor of a 128-byte-swizzled tile at shared address `addr` (1024-byte aligned atom, plus a
// k offset below 128 bytes for K-major), leading / stride byte offsets lbo / sbo.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// sw128_desc(addr + bytes, lbo, sbo) from desc = sw128_desc(addr, lbo, sbo), for addr + bytes below
// 2^18 (shared memory always is): the start address field, bits 0-13, takes bytes / 16 without a carry.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

#if JTQ_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy shared-memory writes made visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from reading accumulators before the wait (their values come from the async MMA).
__device__ __forceinline__ void fence_operands(float (&d)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// d (64 x 64, f32) = A (64 x 16 f16, registers) * B (16 x 64 f16, descriptor) + (accumulate ? d : 0).
// TRANS_B 0: B stored K-major (N rows of K); 1: MN-major (K rows of N).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
}
// d (64 x 64, f32) = A (64 x 16) * B (16 x 64) + (accumulate ? d : 0), both from shared memory
// through descriptors, both K-major; BF16: bf16 operands, else f16.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t adesc, uint64_t bdesc, int accumulate) {
#define JTQ_WGMMA_SS(TYPE)                                                                                           \
  asm volatile(                                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                                 \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                           \
      "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                               \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),    \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),    \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),    \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),    \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                  \
      : "l"(adesc), "l"(bdesc), "r"(accumulate))
  if constexpr (BF16) JTQ_WGMMA_SS("bf16");
  else JTQ_WGMMA_SS("f16");
#undef JTQ_WGMMA_SS
}

// Waits until at most N of the warp's committed wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The 128 threads of warpgroup `wg` of the CTA meet at named barrier 1 + wg (0 is __syncthreads').
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}
#endif  // JTQ_WGMMA

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_WGMMA_CUH_
