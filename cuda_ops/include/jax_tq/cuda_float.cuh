// Float element access of the CUDA handlers: the run-time dtype of an XLA buffer (f32 / bf16 /
// f16) and one-element loads / stores through it (CUDA only; the CPU build never includes this).
#ifndef JAX_TQ_CUDA_FLOAT_CUH_
#define JAX_TQ_CUDA_FLOAT_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_tq {
namespace cuda {

enum class FType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// FType of an XLA dtype, or -1 for any other dtype.
inline int ftype_of(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return static_cast<int>(FType::kF32);
    case xla::ffi::DataType::BF16: return static_cast<int>(FType::kBF16);
    case xla::ffi::DataType::F16: return static_cast<int>(FType::kF16);
    default: return -1;
  }
}

__device__ __forceinline__ float load_elem(const void* base, int dtype, int64_t i) {
  if (dtype == static_cast<int>(FType::kF32)) return static_cast<const float*>(base)[i];
  if (dtype == static_cast<int>(FType::kBF16))
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

__device__ __forceinline__ void store_elem(void* base, int dtype, int64_t i, float v) {
  if (dtype == static_cast<int>(FType::kF32)) {
    static_cast<float*>(base)[i] = v;
  } else if (dtype == static_cast<int>(FType::kBF16)) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CUDA_FLOAT_CUH_
