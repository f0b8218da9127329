// Division by a divisor known only at run time but fixed for a launch: the host computes a magic
// multiplier once, and a kernel divides by a multiply-high, an add and a shift (against ~20
// instructions of a 32-bit division). Hacker's Delight, 2nd ed., section 10-9 ("unsigned division
// by divisors >= 1", the variant with the add): l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1,
// n / d = (mulhi(n, m) + n) >> l, exact for every 0 <= n < 2^31 (the add cannot carry out).
#ifndef JAX_TQ_UINT_DIV_H_
#define JAX_TQ_UINT_DIV_H_

#include <cstdint>

namespace jax_tq {

struct UintDiv {
  uint32_t d = 1, m = 1, l = 0;  // divisor 1: (0 + n) >> 0

  UintDiv() = default;
  // divisor >= 1 (a divisor < 1 is taken as 1: callers divide only where it is >= 1)
  explicit UintDiv(int64_t divisor) {
    d = divisor < 1 ? 1u : static_cast<uint32_t>(divisor);
    l = 0;
    while ((uint64_t(1) << l) < d) ++l;
    m = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
  }

  // n / d for 0 <= n < 2^31
#if defined(__CUDACC__)
  __host__ __device__
#endif
  uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    return (__umulhi(n, m) + n) >> l;
#else
    return (static_cast<uint32_t>((uint64_t(n) * m) >> 32) + n) >> l;
#endif
  }

  // n % d for 0 <= n < 2^31
#if defined(__CUDACC__)
  __host__ __device__
#endif
  uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

}  // namespace jax_tq

#endif  // JAX_TQ_UINT_DIV_H_
