// jax_tq CPU handlers' d x d products in double (host only), shared by compress.cc (the rotation)
// and qjl.cc (the rotation and the QJL sketch): the matrix transposed once into double, then
// y = M v over contiguous memory, each y_j summed in k order (the same bits as a row-wise loop).
#ifndef JAX_TQ_CPU_MATVEC_H_
#define JAX_TQ_CPU_MATVEC_H_

#include <cstddef>
#include <cstdint>

namespace jax_tq {
namespace cpu {

// m_t[k * d + j] = m[j, k] (m row-major float [d, d]).
inline void transpose_to_double(const float* m, int d, double* m_t) {
  for (int j = 0; j < d; ++j)
    for (int k = 0; k < d; ++k) m_t[size_t(k) * d + j] = double(m[int64_t(j) * d + k]);
}

// y = M v for M given as transpose_to_double's m_t; v of float or double.
template <typename T>
inline void matvec_transposed(const double* m_t, const T* v, int d, double* y) {
  for (int j = 0; j < d; ++j) y[j] = 0.0;
  for (int k = 0; k < d; ++k) {
    const double vk = v[k];
    const double* col = m_t + size_t(k) * d;
    for (int j = 0; j < d; ++j) y[j] += col[j] * vk;
  }
}

}  // namespace cpu
}  // namespace jax_tq

#endif  // JAX_TQ_CPU_MATVEC_H_
