// CPU XLA FFI handlers for the compress family (see docs/DESIGN.md):
//   jax_tq_compress, jax_tq_decompress, jax_tq_write_cache.
// The handler symbols (ffi::Ffi::Bind) live in cpu_module.cc; this file holds the
// implementations.
#include <cmath>
#include <cstdint>
#include <cstring>
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

using ffi_checks::CompressDims;
using ffi_checks::CompressWriteDims;
using ffi_checks::Op;
using namespace cpu_floats;  // NOLINT: load_row, store_row, FloatKind, kDtypeMsg

// ---------------------------------------------------------------------------
// Per-row codec. Workspace sized for kMaxHeadDim.
// ---------------------------------------------------------------------------
struct RowCompressor {
  int d;
  int bits;
  const float* rot;      // [d, d], Pi
  const double* rot_t;   // [d, d], Pi transposed in double (rot_t[k * d + j] = Pi[j, k]), or null
  float boundaries[kMaxCentroids];
  int nb;

  // rows: how many rows the caller will compress. From kTransposeRows rows on, Pi is transposed
  // once into a per-thread buffer, so that the products run over contiguous memory.
  RowCompressor(int d_, int bits_, const float* rot_, const float* centroids, int64_t rows)
      : d(d_), bits(bits_), rot(rot_), rot_t(nullptr), nb((1 << bits_) - 1) {
    for (int i = 0; i < nb; ++i) boundaries[i] = centroid_boundary(centroids, i);
    if (rows >= kTransposeRows) {
      thread_local std::vector<double> buffer;
      buffer.resize(size_t(d) * size_t(d));
      transpose_to_double(rot, d, buffer.data());
      rot_t = buffer.data();
    }
  }

  // x: d floats. Writes packed row (packed_bytes) and returns the norm.
  float operator()(const float* x, uint8_t* row) const {
    double ss = 0.0;
    for (int i = 0; i < d; ++i) ss += double(x[i]) * double(x[i]);
    const double norm = std::sqrt(ss);
    // The reciprocal in double: 1 / 1e38 is below float's normal range, and XLA's CPU threads
    // flush float subnormals to 0 (every code would be the zero code).
    const double inv = norm > 0.0 ? 1.0 / norm : 0.0;
    float u[kMaxHeadDim];
    uint8_t codes[kMaxHeadDim];
    double y[kMaxHeadDim];
    for (int i = 0; i < d; ++i) u[i] = float(double(x[i]) * inv);
    rot_t ? matvec_transposed(rot_t, u, d, y) : rotate(u, y);
    for (int j = 0; j < d; ++j) codes[j] = uint8_t(bucketize(float(y[j]), boundaries, nb));
    pack_row(codes, d, bits, row);
    return float(norm);
  }

 private:
  static constexpr int64_t kTransposeRows = 32;

  // y_j = sum_k Pi[j, k] u_k, summed in k order in double (the same bits as matvec_transposed,
  // which the constructor's transposed copy serves);
  // kRows outputs at a time, so that their kRows independent sums overlap.
  void rotate(const float* u, double* y) const {
    constexpr int kRows = 8;  // every supported head_dim is a multiple of 16
    for (int j0 = 0; j0 < d; j0 += kRows) {
      double acc[kRows] = {};
      for (int k = 0; k < d; ++k) {
        const double uk = u[k];
        for (int r = 0; r < kRows; ++r) acc[r] += double(rot[int64_t(j0 + r) * d + k]) * uk;
      }
      for (int r = 0; r < kRows; ++r) y[j0 + r] = acc[r];
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// jax_tq_compress: x [N, d] -> codes [N, packed], norms [N]
// ---------------------------------------------------------------------------
ffi::Error CompressImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                        ffi::Buffer<ffi::F32> centroids,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits) {
  static constexpr Op op{"jax_tq_compress", ffi_checks::kCpuTag};
  const FloatKind k = kind_of(x.element_type());
  if (k == FloatKind::kOther) return op.invalid(std::string("x") + kDtypeMsg);
  CompressDims dims;
  JTQ_RETURN_IF_ERROR(
      ffi_checks::validate_compress(op, x, rotation, centroids, *codes, *norms, bits, &dims));
  const int64_t n = dims.n, d = dims.d, pb = dims.pb;

  RowCompressor comp(int(d), bits, rotation.typed_data(), centroids.typed_data(), n);
  const void* xp = x.untyped_data();
  uint8_t* cp = codes->typed_data();
  float* np_ = norms->typed_data();
  float row[kMaxHeadDim];
  for (int64_t i = 0; i < n; ++i) {
    load_row(xp, k, i * d, int(d), row);
    np_[i] = comp(row, cp + i * pb);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_decompress: codes [N, packed], norms [N] -> x [N, d]
// ---------------------------------------------------------------------------
ffi::Error DecompressImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> norms,
                          ffi::Buffer<ffi::F32> rotation, ffi::Buffer<ffi::F32> centroids,
                          ffi::Result<ffi::AnyBuffer> x, int32_t bits) {
  static constexpr Op op{"jax_tq_decompress", ffi_checks::kCpuTag};
  const FloatKind k = kind_of(x->element_type());
  if (k == FloatKind::kOther)
    return op.invalid(std::string("result x") + kDtypeMsg);
  CompressDims dims;
  JTQ_RETURN_IF_ERROR(
      ffi_checks::validate_decompress(op, codes, norms, rotation, centroids, *x, bits, &dims));
  const int64_t n = dims.n, d = dims.d, pb = dims.pb;

  const float* rot = rotation.typed_data();
  const float* cent = centroids.typed_data();
  const uint8_t* cp = codes.typed_data();
  const float* nrm = norms.typed_data();
  void* xp = x->untyped_data();
  uint8_t c[kMaxHeadDim];
  double acc[kMaxHeadDim];
  float out[kMaxHeadDim];
  for (int64_t i = 0; i < n; ++i) {
    unpack_row(cp + i * pb, int(d), bits, c);
    for (int j = 0; j < d; ++j) acc[j] = 0.0;
    // x_hat = norm * (c @ Pi): x_j = norm * sum_k cent[c_k] * Pi[k, j]
    for (int kk = 0; kk < d; ++kk) {
      const double ck = cent[c[kk]];
      const float* pk = rot + int64_t(kk) * d;
      for (int j = 0; j < d; ++j) acc[j] += ck * double(pk[j]);
    }
    const float nv = nrm[i];
    for (int j = 0; j < d; ++j) out[j] = nv * float(acc[j]);
    store_row(xp, k, i * d, int(d), out);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Cache writes: x [T, Hkv, d] written into paged codes/norms at slots.
// ---------------------------------------------------------------------------
namespace {

// Validates one pool's operands, copies the pool when the results are not aliased to it, and
// writes x's rows at slot_mapping. `name` ("x", "k" or "v") names x in messages.
ffi::Error write_pool(const Op& op, const char* name, const ffi::AnyBuffer& x,
                      const ffi::Buffer<ffi::U8>& codes_in, const ffi::Buffer<ffi::F32>& norms_in,
                      const ffi::Buffer<ffi::F32>& rotation, const ffi::Buffer<ffi::F32>& centroids,
                      const ffi::Buffer<ffi::S32>& slot_mapping, ffi::Buffer<ffi::U8>& codes_out,
                      ffi::Buffer<ffi::F32>& norms_out, int32_t bits) {
  const FloatKind k = kind_of(x.element_type());
  if (k == FloatKind::kOther) return op.invalid(std::string(name) + kDtypeMsg);
  CompressWriteDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_compress_write(op, x, codes_in, norms_in, rotation,
                                                          centroids, slot_mapping, codes_out,
                                                          norms_out, bits, &dims));
  const int64_t t_n = dims.t_n, hkv = dims.hkv, d = dims.d, pb = dims.pb;
  const int64_t num_pages = dims.num_pages, page_size = dims.page_size;

  uint8_t* cp = codes_out.typed_data();
  float* np_ = norms_out.typed_data();
  if (static_cast<const void*>(cp) != codes_in.untyped_data() && codes_in.size_bytes() > 0)
    std::memcpy(cp, codes_in.untyped_data(), codes_in.size_bytes());
  if (static_cast<const void*>(np_) != norms_in.untyped_data() && norms_in.size_bytes() > 0)
    std::memcpy(np_, norms_in.untyped_data(), norms_in.size_bytes());

  const int64_t total_slots = num_pages * page_size;
  RowCompressor comp(int(d), bits, rotation.typed_data(), centroids.typed_data(), t_n * hkv);
  const int32_t* slots = slot_mapping.typed_data();
  const void* xp = x.untyped_data();
  float row[kMaxHeadDim];
  for (int64_t t = 0; t < t_n; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= total_slots) continue;
    const int64_t page = s / page_size, off = s % page_size;
    for (int64_t h = 0; h < hkv; ++h) {
      load_row(xp, k, (t * hkv + h) * d, int(d), row);
      np_[norms_offset(page, h, off, hkv, page_size)] =
          comp(row, cp + codes_offset(page, h, off, hkv, page_size, pb));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------------------
// jax_tq_write_cache: k and v written into their pools at the same slots.
// ---------------------------------------------------------------------------
ffi::Error WriteCacheImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::U8> k_codes_in,
                          ffi::Buffer<ffi::F32> k_norms_in, ffi::Buffer<ffi::U8> v_codes_in,
                          ffi::Buffer<ffi::F32> v_norms_in, ffi::Buffer<ffi::F32> k_rotation,
                          ffi::Buffer<ffi::F32> k_centroids, ffi::Buffer<ffi::F32> v_rotation,
                          ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> slot_mapping,
                          ffi::Result<ffi::Buffer<ffi::U8>> k_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> k_norms_out,
                          ffi::Result<ffi::Buffer<ffi::U8>> v_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> v_norms_out, int32_t k_bits,
                          int32_t v_bits) {
  static constexpr Op op{"jax_tq_write_cache", ffi_checks::kCpuTag};
  JTQ_RETURN_IF_ERROR(write_pool(op, "k", k, k_codes_in, k_norms_in, k_rotation, k_centroids,
                                 slot_mapping, *k_codes_out, *k_norms_out, k_bits));
  return write_pool(op, "v", v, v_codes_in, v_norms_in, v_rotation, v_centroids, slot_mapping,
                    *v_codes_out, *v_norms_out, v_bits);
}

}  // namespace cpu
}  // namespace jax_tq
