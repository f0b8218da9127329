// CPU XLA FFI handler for jax_tq_merge_attention (docs/DESIGN.md): two attentions over disjoint key
// sets merged in place, row (t, h) of out becoming w0 x out + w1 x other (weights [t, h, :]; a zero
// weight's term is 0 and its operand not read), or NaN where check[t, h] is set and q[t, h, :] holds
// a non-finite entry. Rows with weights (1, 0) are left as they are.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "jax_tq/cpu_floats.h"
#include "jax_tq/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cpu {

using cpu_floats::FloatKind;

ffi::Error MergeAttentionImpl(ffi::AnyBuffer out, ffi::AnyBuffer other, ffi::Buffer<ffi::F32> weights,
                              ffi::AnyBuffer q, ffi::Buffer<ffi::PRED> check, ffi::Result<ffi::AnyBuffer> result) {
  static constexpr ffi_checks::Op op{"jax_tq_merge_attention", ffi_checks::kCpuTag};
  ffi_checks::MergeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_merge_attention(op, out, other, weights, q, check, *result, &dims));
  if (result->untyped_data() != out.untyped_data())  // XLA honours the alias; a copy keeps this correct anyway
    std::memcpy(result->untyped_data(), out.untyped_data(), result->size_bytes());
  const FloatKind kind = cpu_floats::kind_of(out.element_type());
  const int n = int(dims.d);
  const float* w = weights.typed_data();
  const bool* checked = check.typed_data();
  std::vector<float> a(n), b(n), x(n);
  for (int64_t r = 0; r < dims.rows; ++r) {
    const int64_t start = r * dims.d;
    bool poisoned = false;
    if (checked[r]) {
      cpu_floats::load_row(q.untyped_data(), kind, start, n, x.data());
      for (int i = 0; i < n; ++i) poisoned = poisoned || !std::isfinite(x[i]);
    }
    const float w0 = w[2 * r], w1 = w[2 * r + 1];
    if (poisoned) {
      std::fill(x.begin(), x.end(), std::numeric_limits<float>::quiet_NaN());
    } else {
      if (w0 == 1.0f && w1 == 0.0f) continue;
      std::fill(a.begin(), a.end(), 0.0f);
      std::fill(b.begin(), b.end(), 0.0f);
      if (w0 != 0.0f) cpu_floats::load_row(result->untyped_data(), kind, start, n, a.data());
      if (w1 != 0.0f) cpu_floats::load_row(other.untyped_data(), kind, start, n, b.data());
      for (int i = 0; i < n; ++i) x[i] = (w0 != 0.0f ? w0 * a[i] : 0.0f) + (w1 != 0.0f ? w1 * b[i] : 0.0f);
    }
    cpu_floats::store_row(result->untyped_data(), kind, start, n, x.data());
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqMergeAttentionCpu, jax_tq::cpu::MergeAttentionImpl,
                              jax_tq::ffi_checks::BindMergeAttention(ffi::Ffi::Bind()));
