// CUDA XLA FFI handler for jax_tq_merge_attention (docs/DESIGN.md; the CPU handler in
// merge_attention.cc states the semantics). One warp per (row, head), two elements per lane per
// step: a row with weights (1, 0) and no check reads 9 bytes and writes none, so a merge where few
// rows have a second part costs what those rows move.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jax_tq/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kWarps = 8;

ffi_checks::Op cuda_op() { return ffi_checks::Op{"jax_tq_merge_attention", ffi_checks::kCudaTag}; }

__device__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ float2 load2(const __nv_bfloat16* p) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)); }
__device__ float2 load2(const __half* p) { return __half22float2(*reinterpret_cast<const __half2*>(p)); }
__device__ void store2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
__device__ void store2(__nv_bfloat16* p, float2 v) { *reinterpret_cast<__nv_bfloat162*>(p) = __float22bfloat162_rn(v); }
__device__ void store2(__half* p, float2 v) { *reinterpret_cast<__half2*>(p) = __float22half2_rn(v); }

// w x v, or exactly 0 for a zero weight (whatever v holds).
__device__ float term(float w, float v) { return w != 0.0f ? __fmul_rn(w, v) : 0.0f; }

template <typename T>
__global__ void merge_attention_kernel(T* out, const T* other, const float2* weights, const T* q, const bool* check,
                                       int64_t rows, int d) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const float2 w = weights[row];
  const int64_t base = row * d;
  bool poisoned = false;
  if (check[row]) {
    bool finite = true;
    for (int i = 2 * lane; i < d; i += 64) {
      const float2 x = load2(q + base + i);
      finite = finite && isfinite(x.x) && isfinite(x.y);
    }
    poisoned = !__all_sync(0xffffffffu, finite);
  }
  if (!poisoned && w.x == 1.0f && w.y == 0.0f) return;
  const float nan = __int_as_float(0x7fc00000);
  for (int i = 2 * lane; i < d; i += 64) {
    const float2 a = w.x != 0.0f && !poisoned ? load2(out + base + i) : float2{0.0f, 0.0f};
    const float2 b = w.y != 0.0f && !poisoned ? load2(other + base + i) : float2{0.0f, 0.0f};
    const float2 r = poisoned ? float2{nan, nan}
                              : float2{__fadd_rn(term(w.x, a.x), term(w.y, b.x)), __fadd_rn(term(w.x, a.y), term(w.y, b.y))};
    store2(out + base + i, r);
  }
}

template <typename T>
cudaError_t launch(cudaStream_t stream, void* out, const void* other, const float* weights, const void* q,
                   const bool* check, int64_t rows, int d) {
  const unsigned blocks = unsigned((rows + kWarps - 1) / kWarps);
  merge_attention_kernel<T><<<blocks, 32 * kWarps, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(other), reinterpret_cast<const float2*>(weights),
      static_cast<const T*>(q), check, rows, d);
  return cudaGetLastError();
}

}  // namespace

ffi::Error MergeAttentionCudaImpl(cudaStream_t stream, ffi::AnyBuffer out, ffi::AnyBuffer other,
                                  ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer q, ffi::Buffer<ffi::PRED> check,
                                  ffi::Result<ffi::AnyBuffer> result) {
  ffi_checks::MergeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_merge_attention(cuda_op(), out, other, weights, q, check, *result, &dims));
  if (dims.rows == 0) return ffi::Error::Success();
  if ((dims.rows + kWarps - 1) / kWarps > 2147483647) return cuda_op().invalid("too many rows x heads");
  void* dst = result->untyped_data();
  if (dst != out.untyped_data()) {  // XLA honours the alias; a copy keeps this correct anyway
    if (cudaError_t e = cudaMemcpyAsync(dst, out.untyped_data(), result->size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return cuda_op().internal(std::string("copy: ") + cudaGetErrorString(e));
  }
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    return launch<T>(stream, dst, other.untyped_data(), weights.typed_data(), q.untyped_data(), check.typed_data(),
                     dims.rows, int(dims.d));
  };
  const ffi::DataType t = out.element_type();
  const cudaError_t e = t == ffi::DataType::F32    ? run(float{})
                        : t == ffi::DataType::BF16 ? run(__nv_bfloat16{})
                                                   : run(__half{});
  if (e != cudaSuccess) return cuda_op().internal(std::string("kernel launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqMergeAttentionCuda, jax_tq::cuda::MergeAttentionCudaImpl,
                              jax_tq::ffi_checks::BindMergeAttention(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
