// Run-time value -> compile-time constant: f(std::integral_constant<int, V>{}) for the entry V of
// an IntList (format.h: SupportedHeadDims, PackedBits) equal to v, none() where no entry is. Host only.
#ifndef JAX_TQ_DISPATCH_H_
#define JAX_TQ_DISPATCH_H_

#include <optional>
#include <type_traits>

#include "jax_tq/format.h"

namespace jax_tq {

template <int... Vs, class F, class N>
auto with_value(IntList<Vs...>, int v, F&& f, N&& none) -> decltype(none()) {
  std::optional<decltype(none())> result;
  ((v == Vs && (result.emplace(f(std::integral_constant<int, Vs>{})), true)) || ...);
  return result ? std::move(*result) : none();
}

}  // namespace jax_tq

#endif  // JAX_TQ_DISPATCH_H_
