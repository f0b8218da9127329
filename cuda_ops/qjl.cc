// CPU XLA FFI handlers for the QJL family (TurboQuant_prod, docs/DESIGN.md):
//   jax_tq_qjl_compress (mse codes + norm + QJL sign bits + residual norm gamma),
//   jax_tq_qjl_scores (raw <q, k> estimates over compressed keys).
// The handler symbols (ffi::Ffi::Bind) live in cpu_module.cc; this file holds the
// implementations. Products and sums run in double, in index order.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "jax_tq/cpu_floats.h"
#include "jax_tq/cpu_matvec.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cpu {
namespace {

using ffi_checks::Op;
using namespace cpu_floats;  // NOLINT: load_row, FloatKind, kDtypeMsg

// m [d, d] transposed into double (cpu_matvec.h).
std::vector<double> transposed(const float* m, int d) {
  std::vector<double> out(size_t(d) * size_t(d));
  transpose_to_double(m, d, out.data());
  return out;
}

struct QjlRow {
  float norm, gamma;
};

// One vector: codes (packed), sign bits (packed), norm and gamma (TurboQuant, Algorithm 2).
QjlRow compress_row(const float* x, int d, int bits, const std::vector<double>& rot_t,
                    const std::vector<double>& sketch_t, const float* centroids,
                    const float* boundaries, uint8_t* codes_row, uint8_t* signs_row) {
  double ss = 0.0;
  for (int i = 0; i < d; ++i) ss += double(x[i]) * double(x[i]);
  const double norm = stored_norm(std::sqrt(ss));
  const double inv = norm > 0.0 ? 1.0 / norm : 0.0;
  double u[kMaxHeadDim], y[kMaxHeadDim], r[kMaxHeadDim], s[kMaxHeadDim];
  uint8_t codes[kMaxHeadDim];
  for (int i = 0; i < d; ++i) u[i] = double(float(double(x[i]) * inv));
  matvec_transposed(rot_t.data(), u, d, y);
  double rr = 0.0;
  for (int j = 0; j < d; ++j) {
    codes[j] = uint8_t(bucketize(float(y[j]), boundaries, (1 << bits) - 1));
    r[j] = y[j] - double(centroids[codes[j]]);
    rr += r[j] * r[j];
  }
  matvec_transposed(sketch_t.data(), r, d, s);
  float s_f[kMaxHeadDim];
  for (int i = 0; i < d; ++i) s_f[i] = float(s[i]);
  pack_row(codes, d, bits, codes_row);
  pack_sign_bits(s_f, d, signs_row);
  return QjlRow{float(norm), float(std::sqrt(rr))};
}

}  // namespace

// ---------------------------------------------------------------------------
// jax_tq_qjl_compress: x [N, d] -> codes [N, packed], norms [N], signs [N, d/8], gamma [N]
// ---------------------------------------------------------------------------
ffi::Error QjlCompressImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                           ffi::Buffer<ffi::F32> centroids, ffi::Buffer<ffi::F32> sketch,
                           ffi::Result<ffi::Buffer<ffi::U8>> codes,
                           ffi::Result<ffi::Buffer<ffi::F32>> norms,
                           ffi::Result<ffi::Buffer<ffi::U8>> signs,
                           ffi::Result<ffi::Buffer<ffi::F32>> gamma, int32_t bits) {
  static constexpr Op op{"jax_tq_qjl_compress", ffi_checks::kCpuTag};
  const FloatKind k = kind_of(x.element_type());
  if (k == FloatKind::kOther) return op.invalid(std::string("x") + kDtypeMsg);
  ffi_checks::QjlCompressDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_qjl_compress(op, x, rotation, centroids, sketch, *codes,
                                                        *norms, *signs, *gamma, bits, &dims));
  const int d = int(dims.d);
  const std::vector<double> rot_t = transposed(rotation.typed_data(), d);
  const std::vector<double> sketch_t = transposed(sketch.typed_data(), d);
  float boundaries[kMaxCentroids];
  for (int i = 0; i + 1 < (1 << bits); ++i) boundaries[i] = centroid_boundary(centroids.typed_data(), i);
  float row[kMaxHeadDim];
  for (int64_t i = 0; i < dims.n; ++i) {
    load_row(x.untyped_data(), k, i * d, d, row);
    const QjlRow out = compress_row(row, d, bits, rot_t, sketch_t, centroids.typed_data(), boundaries,
                                    codes->typed_data() + i * dims.pb, signs->typed_data() + i * dims.sb);
    norms->typed_data()[i] = out.norm;
    gamma->typed_data()[i] = out.gamma;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_qjl_scores: scores[b, q, s] = norms[b, s] * (<q_rot[b, q], c[codes[b, s]]>
//   + qjl_scale * gamma[b, s] * <q_sketch[b, q], signs[b, s]>)
// ---------------------------------------------------------------------------
ffi::Error QjlScoresImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::F32> q_sketch,
                         ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> norms,
                         ffi::Buffer<ffi::U8> signs, ffi::Buffer<ffi::F32> gamma,
                         ffi::Buffer<ffi::F32> centroids, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                         int32_t bits, float qjl_scale) {
  static constexpr Op op{"jax_tq_qjl_scores", ffi_checks::kCpuTag};
  ffi_checks::QjlScoresDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_qjl_scores(op, q_rot, q_sketch, codes, norms, signs, gamma,
                                                      centroids, *scores, bits, &dims));
  const int d = int(dims.d);
  double values[kMaxHeadDim], key_signs[kMaxHeadDim];
  uint8_t key_codes[kMaxHeadDim];
  for (int64_t b = 0; b < dims.b; ++b) {
    for (int64_t s = 0; s < dims.s; ++s) {
      const int64_t key = b * dims.s + s;
      unpack_row(codes.typed_data() + key * dims.pb, d, bits, key_codes);
      for (int j = 0; j < d; ++j) {
        values[j] = double(centroids.typed_data()[key_codes[j]]);
        key_signs[j] = double(sign_value(signs.typed_data() + key * dims.sb, j));
      }
      const double norm = norms.typed_data()[key];
      const double qjl_weight = double(qjl_scale) * double(gamma.typed_data()[key]);
      for (int64_t q = 0; q < dims.q; ++q) {
        const float* qr = q_rot.typed_data() + (b * dims.q + q) * d;
        const float* qs = q_sketch.typed_data() + (b * dims.q + q) * d;
        double mse = 0.0, qjl = 0.0;
        for (int j = 0; j < d; ++j) {
          mse += double(qr[j]) * values[j];
          qjl += double(qs[j]) * key_signs[j];
        }
        scores->typed_data()[(b * dims.q + q) * dims.s + s] = float(norm * (mse + qjl_weight * qjl));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlCompressCpu, jax_tq::cpu::QjlCompressImpl,
                              jax_tq::ffi_checks::BindQjlCompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlScoresCpu, jax_tq::cpu::QjlScoresImpl,
                              jax_tq::ffi_checks::BindQjlScores(ffi::Ffi::Bind()));
