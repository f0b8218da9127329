// Warp-wide reductions for the CUDA kernels (device only): every lane of a full warp ends with
// the result (xor butterfly). Used by qjl.cu and paged_prefill.cu; paged_decode.cu keeps its own
// copy until its next GPU run (its source is the one measured on the H200).
#ifndef JAX_TQ_CUDA_WARP_H_
#define JAX_TQ_CUDA_WARP_H_

namespace jax_tq {
namespace cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CUDA_WARP_H_
