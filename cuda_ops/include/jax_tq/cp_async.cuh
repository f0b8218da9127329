// cp.async helpers shared by the kernels that stage global memory in shared memory (the decode
// kernels through decode_device.cuh, the tensor-core cache write in compress.cu). PTX ISA, "cp.async".
#ifndef JAX_TQ_CP_ASYNC_CUH_
#define JAX_TQ_CP_ASYNC_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tq {
namespace cuda {
namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes < 16: the rest zero-filled (0: src is not read).
__device__ __forceinline__ void cp_async16_zfill(void* dst_smem, const void* src_gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem),
               "r"(src_bytes)
               : "memory");
}

// 16 bytes global -> shared address dst (smem_addr's).
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src_gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src_gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CP_ASYNC_CUH_
