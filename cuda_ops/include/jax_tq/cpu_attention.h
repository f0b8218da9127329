// jax_tq CPU attention helpers (host only), shared by the paged decode and paged prefill handlers:
// the GQA group's q.k dots and the online-softmax update of one query row, in double.
#ifndef JAX_TQ_CPU_ATTENTION_H_
#define JAX_TQ_CPU_ATTENTION_H_

#include <cmath>
#include <cstdint>
#include <limits>

namespace jax_tq {
namespace cpu {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// dots[h] = sum_i q[h, i] * k[i] for the G query rows of a group, each summed in i order (so the
// result does not depend on the grouping); four heads per pass, so that their four sums overlap.
inline void group_dots(const double* q, const double* k, int64_t G, int64_t d, double* dots) {
  int64_t h = 0;
  for (; h + 4 <= G; h += 4) {
    const double *q0 = q + h * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int64_t i = 0; i < d; ++i) {
      a0 += q0[i] * k[i];
      a1 += q1[i] * k[i];
      a2 += q2[i] * k[i];
      a3 += q3[i] * k[i];
    }
    dots[h] = a0;
    dots[h + 1] = a1;
    dots[h + 2] = a2;
    dots[h + 3] = a3;
  }
  for (; h < G; ++h) {
    double a = 0.0;
    for (int64_t i = 0; i < d; ++i) a += q[h * d + i] * k[i];
    dots[h] = a;
  }
}

// Adds a token of logit `score` and value row v[d] to a row's running max m, sum l and
// unnormalised output o[d] (running-max subtraction: huge logits never give inf / NaN). A -inf or
// NaN logit contributes nothing.
inline void online_softmax_add(double score, const double* v, int64_t d, double& m, double& l, double* o) {
  if (!(score > kNegInf)) return;
  double p;
  if (score > m) {
    const double alpha = std::exp(m - score);  // 0 when m = -inf
    l *= alpha;
    for (int64_t i = 0; i < d; ++i) o[i] *= alpha;
    m = score;
    p = 1.0;
  } else {
    p = std::exp(score - m);
  }
  l += p;
  for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
}

}  // namespace cpu
}  // namespace jax_tq

#endif  // JAX_TQ_CPU_ATTENTION_H_
