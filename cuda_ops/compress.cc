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
using ffi_checks::WindowDims;
using namespace cpu_floats;  // NOLINT: load_row, store_row, FloatKind, kDtypeMsg

// ---------------------------------------------------------------------------
// The fitted scale's code search (format.h "Fitted scale"): for each candidate k, codes_k[j] =
// #{i : fit_boundary(centroids, k, i) < fl32(y_j)}; the candidate of the largest
// <y, c[codes_k]>^2 / |c[codes_k]|^2 (in double; the first k on ties) wins. Writes its codes and
// returns <y, c[codes]> / |c[codes]|^2 (0 where no candidate has a gain above -1, e.g. a NaN y).
//   bounds: [kFitCandidates][kMaxCentroids] scaled boundaries (nb of each used); values: the
//   centroids in double.
// ---------------------------------------------------------------------------
double fit_codes(const double* y, int d, const float (*bounds)[kMaxCentroids], int nb,
                 const double* values, uint8_t* codes) {
  float yf[kMaxHeadDim];
  for (int j = 0; j < d; ++j) yf[j] = float(y[j]);
  uint8_t cand[kMaxHeadDim];
  double best_dot = 0.0, best_sq = 1.0, best_gain = -1.0;
  for (int j = 0; j < d; ++j) codes[j] = 0;
  for (int k = 0; k < kFitCandidates; ++k) {
    for (int j = 0; j < d; ++j) cand[j] = 0;
    for (int i = 0; i < nb; ++i) {  // j innermost: one boundary against the whole row (vectorizes)
      const float b = bounds[k][i];
      for (int j = 0; j < d; ++j) cand[j] = uint8_t(cand[j] + (b < yf[j] ? 1 : 0));
    }
    double dot = 0.0, sq = 0.0;
    for (int j = 0; j < d; ++j) {
      const double c = values[cand[j]];
      dot += y[j] * c;
      sq += c * c;
    }
    const double gain = dot * dot / sq;
    if (gain > best_gain) {  // strictly: the first k keeps a tie
      best_gain = gain;
      best_dot = dot;
      best_sq = sq;
      for (int j = 0; j < d; ++j) codes[j] = cand[j];
    }
  }
  return best_dot / best_sq;
}

// ---------------------------------------------------------------------------
// Per-row codec. Workspace sized for kMaxHeadDim.
// ---------------------------------------------------------------------------
struct RowCompressor {
  int d;
  int bits;
  bool fit;              // the fitted scale (format.h) instead of ||x||
  const float* rot;      // [d, d], Pi
  const double* rot_t;   // [d, d], Pi transposed in double (rot_t[k * d + j] = Pi[j, k]), or null
  float boundaries[kMaxCentroids];
  int nb;
  float fit_bounds[kFitCandidates][kMaxCentroids];  // fit only: fit_boundary(centroids, k, i)
  double values[kMaxCentroids];                     // fit only: the centroids in double

  // rows: how many rows the caller will compress. From kTransposeRows rows on, Pi is transposed
  // once into a per-thread buffer, so that the products run over contiguous memory.
  RowCompressor(int d_, int bits_, const float* rot_, const float* centroids, int64_t rows,
                bool fit_ = false)
      : d(d_), bits(bits_), fit(fit_), rot(rot_), rot_t(nullptr), nb((1 << bits_) - 1) {
    for (int i = 0; i < nb; ++i) boundaries[i] = centroid_boundary(centroids, i);
    if (fit) {
      for (int k = 0; k < kFitCandidates; ++k)
        for (int i = 0; i < nb; ++i) fit_bounds[k][i] = fit_boundary(centroids, k, i);
      for (int i = 0; i <= nb; ++i) values[i] = double(centroids[i]);
    }
    if (rows >= kTransposeRows) {
      thread_local std::vector<double> buffer;
      buffer.resize(size_t(d) * size_t(d));
      transpose_to_double(rot, d, buffer.data());
      rot_t = buffer.data();
    }
  }

  // x: d floats. y <- the unit rotated vector Pi (x / ||x||) in double (u = x / ||x|| rounded to
  // float32 first; 0 for a zero x); returns ||x|| in double.
  double rotate_unit(const float* x, double* y) const {
    double ss = 0.0;
    for (int i = 0; i < d; ++i) ss += double(x[i]) * double(x[i]);
    const double norm = stored_norm(std::sqrt(ss));
    // The reciprocal in double: 1 / 1e38 is below float's normal range, and XLA's CPU threads
    // flush float subnormals to 0 (every code would be the zero code).
    const double inv = norm > 0.0 ? 1.0 / norm : 0.0;
    float u[kMaxHeadDim];
    for (int i = 0; i < d; ++i) u[i] = float(double(x[i]) * inv);
    rot_t ? matvec_transposed(rot_t, u, d, y) : rotate(u, y);
    return norm;
  }

  // Codes of y (rotate_unit's) into the packed row (packed_bytes); returns the stored norm:
  // ||x||, or with the fitted scale ||x|| <y, c[codes]> / |c[codes]|^2.
  float encode(const double* y, double norm, uint8_t* row) const {
    uint8_t codes[kMaxHeadDim];
    if (fit) {
      const double gain = fit_codes(y, d, fit_bounds, nb, values, codes);
      pack_row(codes, d, bits, row);
      return float(norm * gain);
    }
    for (int j = 0; j < d; ++j) codes[j] = uint8_t(bucketize(float(y[j]), boundaries, nb));
    pack_row(codes, d, bits, row);
    return float(norm);
  }

  // x: d floats. Writes packed row (packed_bytes) and returns the stored norm.
  float operator()(const float* x, uint8_t* row) const {
    double y[kMaxHeadDim];
    const double norm = rotate_unit(x, y);
    return encode(y, norm, row);
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
                        ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits,
                        int32_t fit_scale) {
  static constexpr Op op{"jax_tq_compress", ffi_checks::kCpuTag};
  const FloatKind k = kind_of(x.element_type());
  if (k == FloatKind::kOther) return op.invalid(std::string("x") + kDtypeMsg);
  CompressDims dims;
  JTQ_RETURN_IF_ERROR(
      ffi_checks::validate_compress(op, x, rotation, centroids, *codes, *norms, bits, &dims));
  const int64_t n = dims.n, d = dims.d, pb = dims.pb;

  RowCompressor comp(int(d), bits, rotation.typed_data(), centroids.typed_data(), n, fit_scale != 0);
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
// Cache writes: x [T, Hkv, d] written into paged codes/norms at slots, and into the window ring
// at window_slots.
// ---------------------------------------------------------------------------
namespace {

// Copies an operand into its result when XLA did not alias them.
template <ffi::DataType T>
void copy_unless_aliased(const ffi::Buffer<T>& in, ffi::Buffer<T>& out) {
  if (out.untyped_data() != in.untyped_data() && in.size_bytes() > 0)
    std::memcpy(out.untyped_data(), in.untyped_data(), in.size_bytes());
}

// Writes x's rows (validated: dims) at slot_mapping into the pool and at window_slots into the
// window ring (win: its dims; window null where there is none). A token goes to the pages, the
// window, both or neither; its rotation runs once for both.
void write_pool(const ffi::AnyBuffer& x, const CompressWriteDims& dims,
                const ffi::Buffer<ffi::F32>& rotation, const ffi::Buffer<ffi::F32>& centroids,
                const ffi::Buffer<ffi::S32>& slot_mapping, ffi::Buffer<ffi::U8>& codes_out,
                ffi::Buffer<ffi::F32>& norms_out, int32_t bits, bool fit,
                const ffi::Buffer<ffi::S32>& window_slots, const WindowDims& win,
                uint16_t* window) {
  const FloatKind k = kind_of(x.element_type());
  const int64_t t_n = dims.t_n, hkv = dims.hkv, d = dims.d, pb = dims.pb;
  const int64_t page_size = dims.page_size;
  const int64_t total_slots = dims.num_pages * page_size;
  const int64_t W = win.window, total_entries = win.on() ? win.num_windows * W : 0;
  uint8_t* cp = codes_out.typed_data();
  float* np_ = norms_out.typed_data();
  RowCompressor comp(int(d), bits, rotation.typed_data(), centroids.typed_data(), t_n * hkv, fit);
  const int32_t* slots = slot_mapping.typed_data();
  const int32_t* wslots = window_slots.typed_data();
  const void* xp = x.untyped_data();
  float row[kMaxHeadDim];
  double y[kMaxHeadDim];
  for (int64_t t = 0; t < t_n; ++t) {
    const int64_t s = slots[t];
    const bool to_pages = s >= 0 && s < total_slots;
    const int64_t ws = total_entries > 0 ? wslots[t] : -1;
    const bool to_window = ws >= 0 && ws < total_entries;
    if (!to_pages && !to_window) continue;
    const int64_t page = to_pages ? s / page_size : 0, off = to_pages ? s % page_size : 0;
    const int64_t wid = to_window ? ws / W : 0, entry = to_window ? ws % W : 0;
    for (int64_t h = 0; h < hkv; ++h) {
      load_row(xp, k, (t * hkv + h) * d, int(d), row);
      const double norm = comp.rotate_unit(row, y);
      if (to_pages)
        np_[norms_offset(page, h, off, hkv, page_size)] =
            comp.encode(y, norm, cp + codes_offset(page, h, off, hkv, page_size, pb));
      if (to_window) {
        // bf16(fl32(||x|| * y_j)), y the codes' unit rotated vector.
        uint16_t* dst = window + ((wid * hkv + h) * W + entry) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = f32_to_bf16(float(norm * y[j]));
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// jax_tq_write_cache: k and v written into their pools at the same slots, and into their window
// rings at the same window_slots.
// ---------------------------------------------------------------------------
ffi::Error WriteCacheImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::U8> k_codes_in,
                          ffi::Buffer<ffi::F32> k_norms_in, ffi::Buffer<ffi::U8> v_codes_in,
                          ffi::Buffer<ffi::F32> v_norms_in, ffi::Buffer<ffi::F32> k_rotation,
                          ffi::Buffer<ffi::F32> k_centroids, ffi::Buffer<ffi::F32> v_rotation,
                          ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> slot_mapping,
                          ffi::Buffer<ffi::BF16> k_window_in, ffi::Buffer<ffi::BF16> v_window_in,
                          ffi::Buffer<ffi::S32> window_slots, ffi::Buffer<ffi::S32> rotation_spec,
                          ffi::Result<ffi::Buffer<ffi::U8>> k_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> k_norms_out,
                          ffi::Result<ffi::Buffer<ffi::U8>> v_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> v_norms_out,
                          ffi::Result<ffi::Buffer<ffi::BF16>> k_window_out,
                          ffi::Result<ffi::Buffer<ffi::BF16>> v_window_out, int32_t k_bits,
                          int32_t v_bits, int32_t k_fit_scale, int32_t v_fit_scale) {
  static constexpr Op op{"jax_tq_write_cache", ffi_checks::kCpuTag};
  if (kind_of(k.element_type()) == FloatKind::kOther) return op.invalid(std::string("k") + kDtypeMsg);
  CompressWriteDims kd, vd;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_write_cache(op, k, k_codes_in, k_norms_in, k_rotation,
                                                          k_centroids, slot_mapping, *k_codes_out,
                                                          *k_norms_out, k_bits, &kd));
  if (kind_of(v.element_type()) == FloatKind::kOther) return op.invalid(std::string("v") + kDtypeMsg);
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_write_cache(op, v, v_codes_in, v_norms_in, v_rotation,
                                                          v_centroids, slot_mapping, *v_codes_out,
                                                          *v_norms_out, v_bits, &vd));
  WindowDims win;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_window_write(op, kd.t_n, kd.hkv, kd.d, k_window_in,
                                                        v_window_in, window_slots, *k_window_out,
                                                        *v_window_out, &win));
  bool spec_present;  // the CPU applies the dense rotations (the same Pi) either way
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_rotation_spec(op, rotation_spec, kd.d, vd.d, &spec_present));
  // The window pools share K's [Hkv, d] (validated above); V's rows must fit them.
  if (win.on() && (vd.hkv != kd.hkv || vd.d != kd.d))
    return op.invalid("v has shape " + ffi_checks::dims_str(v.dimensions()) + ", expected k's " +
                      ffi_checks::dims_str(k.dimensions()) + " with a window");

  copy_unless_aliased(k_codes_in, *k_codes_out);
  copy_unless_aliased(k_norms_in, *k_norms_out);
  copy_unless_aliased(v_codes_in, *v_codes_out);
  copy_unless_aliased(v_norms_in, *v_norms_out);
  copy_unless_aliased(k_window_in, *k_window_out);
  copy_unless_aliased(v_window_in, *v_window_out);

  uint16_t* kw = static_cast<uint16_t*>(k_window_out->untyped_data());
  uint16_t* vw = static_cast<uint16_t*>(v_window_out->untyped_data());
  write_pool(k, kd, k_rotation, k_centroids, slot_mapping, *k_codes_out, *k_norms_out, k_bits,
             k_fit_scale != 0, window_slots, win, kw);
  write_pool(v, vd, v_rotation, v_centroids, slot_mapping, *v_codes_out, *v_norms_out, v_bits,
             v_fit_scale != 0, window_slots, win, vw);
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressCpu, jax_tq::cpu::CompressImpl,
                              jax_tq::ffi_checks::BindCompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqDecompressCpu, jax_tq::cpu::DecompressImpl,
                              jax_tq::ffi_checks::BindDecompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqWriteCacheCpu, jax_tq::cpu::WriteCacheImpl,
                              jax_tq::ffi_checks::BindWriteCache(ffi::Ffi::Bind()));
