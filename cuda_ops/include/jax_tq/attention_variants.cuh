// Device helpers of the attention variants (jax_tq/variants.py, ffi_checks.h Variants) shared by
// the decode and prefill kernels: the logit soft cap and a softmax denominator with a sink.
#ifndef JAX_TQ_ATTENTION_VARIANTS_CUH_
#define JAX_TQ_ATTENTION_VARIANTS_CUH_

#include <cmath>

namespace jax_tq {
namespace cuda {

// The logit soft cap c > 0 (Gemma 2, arXiv 2408.00118): c tanh(s / c), in whatever units s and c
// share (natural or log2); -inf (a masked token) and NaN stay.
__device__ __forceinline__ float soft_capped(float s, float c) { return s > -INFINITY ? c * tanhf(s / c) : s; }

// c tanh(s / c) for kernels whose products are float16 already (the tensor-core decode kernel), in
// three instructions: tanh.approx (relative error <= 2^-10.99: like rounding the capped logit to
// float16, below a bfloat16 query's own rounding, 2^-9), inv_c = 1 / c. NaN stays NaN (the caller's
// mask); -inf gives -c, +inf c.
__device__ __forceinline__ float soft_capped_fast(float s, float c, float inv_c) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s * inv_c));
  return c * t;
}

// 1 / (l + e^(sink - m)) for a row whose softmax weights sum to l > 0 relative to its largest
// logit m (attention sinks, gpt-oss: the sink is a logit with no value row), shifted by the larger
// of m and sink so that neither term overflows; e is 2 for logits in log2 units (base2), else e.
// A NaN sink gives NaN.
__device__ __forceinline__ float inverse_with_sink(float l, float m, float sink, bool base2) {
  if (sink > m) {
    const float lift = base2 ? exp2f(m - sink) : expf(m - sink);
    return lift / (l * lift + 1.f);
  }
  return 1.f / (l + (base2 ? exp2f(sink - m) : expf(sink - m)));
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_ATTENTION_VARIANTS_CUH_
