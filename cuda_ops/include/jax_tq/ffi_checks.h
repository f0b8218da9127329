// jax_tq host-side FFI operand validation: THE single definition of the shape /
// attribute checks of every FFI target, shared by the CPU (.cc) and CUDA (.cu)
// handlers. Plain C++17, host only (never called from device code).
//
// Every message is "<target><tag>: <text>", where <tag> is "" for the CPU
// handlers and " (CUDA)" for the CUDA handlers (Op below), e.g.
//   "jax_tq_compress: rotation has shape [64, 32], expected [64, 64]"
//   "jax_tq_paged_decode (CUDA): num_splits must be >= 1, got 0"
// Tests match on some of these messages: keep them stable.
//
// The element-type (dtype) checks stay in the handlers (each backend has its own
// float-kind enum and wording); they run before the validators below.
#ifndef JAX_TQ_FFI_CHECKS_H_
#define JAX_TQ_FFI_CHECKS_H_

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>
#include <utility>

#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tq {
namespace ffi_checks {

namespace ffi = xla::ffi;

// Backend tags.
constexpr const char kCpuTag[] = "";
constexpr const char kCudaTag[] = " (CUDA)";

// An FFI target as named in error messages; the prefix is only built on the error path.
struct Op {
  const char* name;  // e.g. "jax_tq_compress"
  const char* tag;   // kCpuTag or kCudaTag

  std::string prefix() const { return std::string(name) + tag + ": "; }
  ffi::Error invalid(const std::string& msg) const {
    return ffi::Error::InvalidArgument(prefix() + msg);
  }
  ffi::Error internal(const std::string& msg) const {
    return ffi::Error::Internal(prefix() + msg);
  }
};

// Returns from the enclosing function when `expr` (an ffi::Error) is a failure.
#define JTQ_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    ::xla::ffi::Error _jtq_err = (expr);          \
    if (_jtq_err.failure()) return _jtq_err;      \
  } while (0)

// "[a, b, c]"
template <typename Dims>
std::string dims_str(const Dims& dims) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t v : dims) {
    if (i++) s += ", ";
    s += std::to_string(v);
  }
  return s + "]";
}

// Success when `dims` equals `want`, else "<name> has shape [..], expected [..]".
inline ffi::Error check_dims(const Op& op, const char* name, ffi::Span<const int64_t> dims,
                             std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  if (ok) {
    size_t i = 0;
    for (int64_t w : want) ok = ok && dims[i++] == w;
  }
  if (ok) return ffi::Error::Success();
  return op.invalid(std::string(name) + " has shape " + dims_str(dims) + ", expected " +
                    dims_str(want));
}

// `dims` with every axis before the last `rank - 1` folded into one: a pool [B, P, Hkv, page, pb]
// (vmap's batch axes left in place, so that XLA can alias it without a copy) reads as
// [B * P, Hkv, page, pb]. Fewer than `rank` axes: unchanged (the rank check then fails).
inline std::vector<int64_t> fold_leading(ffi::Span<const int64_t> dims, size_t rank) {
  std::vector<int64_t> out(dims.begin(), dims.end());
  if (dims.size() <= rank) return out;
  const size_t extra = dims.size() - rank;
  int64_t lead = 1;
  for (size_t i = 0; i <= extra; ++i) lead *= dims[i];
  out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(extra));
  out[0] = lead;
  return out;
}

// Success when `dims` has `rank` axes, else "<what>, got [..]".
inline ffi::Error check_rank(const Op& op, ffi::Span<const int64_t> dims, size_t rank,
                             const char* what) {
  if (dims.size() == rank) return ffi::Error::Success();
  return op.invalid(std::string(what) + ", got " + dims_str(dims));
}

inline ffi::Error check_head_dim(const Op& op, int64_t d) {
  if (is_supported_head_dim(static_cast<int>(d))) return ffi::Error::Success();
  return op.invalid("head_dim must be one of 64, 80, 96, 128, 192, 256, got " +
                    std::to_string(d));
}

// `what` names the attribute ("bits", "k_bits", "v_bits").
inline ffi::Error check_bits(const Op& op, const char* what, int32_t bits) {
  if (is_supported_bits(bits)) return ffi::Error::Success();
  return op.invalid(std::string(what) + " must be 2, 3 or 4, got " + std::to_string(bits));
}

inline ffi::Error check_bits_dim(const Op& op, int32_t bits, int64_t d) {
  JTQ_RETURN_IF_ERROR(check_bits(op, "bits", bits));
  return check_head_dim(op, d);
}

// ---------------------------------------------------------------------------
// jax_tq_compress: x [N, d], rotation [d, d], centroids [2**bits]
//   -> codes [N, packed], norms [N]
// ---------------------------------------------------------------------------
struct CompressDims {
  int64_t n, d, pb;
};

inline ffi::Error validate_compress(const Op& op, const ffi::AnyBuffer& x,
                                    const ffi::Buffer<ffi::F32>& rotation,
                                    const ffi::Buffer<ffi::F32>& centroids,
                                    const ffi::Buffer<ffi::U8>& codes,
                                    const ffi::Buffer<ffi::F32>& norms, int32_t bits,
                                    CompressDims* out) {
  const auto xd = x.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, xd, 2, "x must be rank 2 [N, d]"));
  const int64_t n = xd[0], d = xd[1];
  JTQ_RETURN_IF_ERROR(check_bits_dim(op, bits, d));
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  JTQ_RETURN_IF_ERROR(check_dims(op, "rotation", rotation.dimensions(), {d, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "centroids", centroids.dimensions(), {int64_t(1) << bits}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes (result)", codes.dimensions(), {n, pb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms (result)", norms.dimensions(), {n}));
  *out = CompressDims{n, d, pb};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_decompress: codes [N, packed], norms [N], rotation [d, d],
//   centroids [2**bits] -> x [N, d]
// ---------------------------------------------------------------------------
inline ffi::Error validate_decompress(const Op& op, const ffi::Buffer<ffi::U8>& codes,
                                      const ffi::Buffer<ffi::F32>& norms,
                                      const ffi::Buffer<ffi::F32>& rotation,
                                      const ffi::Buffer<ffi::F32>& centroids,
                                      const ffi::AnyBuffer& x, int32_t bits, CompressDims* out) {
  const auto xd = x.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, xd, 2, "result x must be rank 2 [N, d]"));
  const int64_t n = xd[0], d = xd[1];
  JTQ_RETURN_IF_ERROR(check_bits_dim(op, bits, d));
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes", codes.dimensions(), {n, pb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms", norms.dimensions(), {n}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "rotation", rotation.dimensions(), {d, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "centroids", centroids.dimensions(), {int64_t(1) << bits}));
  *out = CompressDims{n, d, pb};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// One pool of a cache write (jax_tq_write_cache checks K's and V's): x [T, Hkv, d],
//   codes [P, Hkv, page_size, packed],
//   norms [P, Hkv, page_size], rotation [d, d], centroids [2**bits],
//   slot_mapping [T] -> codes, norms (same shapes as the operands). The pools may carry leading
//   batch axes ([..., P, Hkv, page_size, packed]; slots then index the folded pool).
// ---------------------------------------------------------------------------
struct CompressWriteDims {
  int64_t t_n, hkv, d, pb, num_pages, page_size;
};

inline ffi::Error validate_write_cache(
    const Op& op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U8>& codes_in,
    const ffi::Buffer<ffi::F32>& norms_in, const ffi::Buffer<ffi::F32>& rotation,
    const ffi::Buffer<ffi::F32>& centroids, const ffi::Buffer<ffi::S32>& slot_mapping,
    const ffi::Buffer<ffi::U8>& codes_out, const ffi::Buffer<ffi::F32>& norms_out, int32_t bits,
    CompressWriteDims* out) {
  const auto xd = x.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, xd, 3, "x must be rank 3 [T, Hkv, d]"));
  const int64_t t_n = xd[0], hkv = xd[1], d = xd[2];
  JTQ_RETURN_IF_ERROR(check_bits_dim(op, bits, d));
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  const std::vector<int64_t> cd = fold_leading(codes_in.dimensions(), 4);
  JTQ_RETURN_IF_ERROR(check_rank(op, cd, 4, "codes must be rank 4 [P, Hkv, page_size, packed]"));
  const int64_t num_pages = cd[0], page_size = cd[2];
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes", cd, {num_pages, hkv, page_size, pb}));
  if (norms_in.dimensions().size() + 1 != codes_in.dimensions().size())
    return op.invalid("norms " + dims_str(norms_in.dimensions()) + " and codes " +
                      dims_str(codes_in.dimensions()) + " must have the same leading axes");
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms", fold_leading(norms_in.dimensions(), 3),
                                 {num_pages, hkv, page_size}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "rotation", rotation.dimensions(), {d, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "centroids", centroids.dimensions(), {int64_t(1) << bits}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "slot_mapping", slot_mapping.dimensions(), {t_n}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes (result)", fold_leading(codes_out.dimensions(), 4),
                                 {num_pages, hkv, page_size, pb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms (result)", fold_leading(norms_out.dimensions(), 3),
                                 {num_pages, hkv, page_size}));
  *out = CompressWriteDims{t_n, hkv, d, pb, num_pages, page_size};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_paged_decode: q_rot [S, H, d], k/v codes [P, Hkv, page_size, packed],
//   k/v norms [P, Hkv, page_size], k/v centroids [2**bits],
//   block_tables [S, max_pages], seq_lens [S], k_window / v_window [num_windows, Hkv, W, d],
//   window_ids [S], rotation [2, 0] or [2, d]
//   -> out_rot [S, H, d], partial_out [S, H, ns (+1), d], partial_lse [S, H, ns (+1)]
// (+1: with a window, the window's partial follows the splits')
// rotation [2, d] (the fused rotation, d a power of two): the K and V codecs' Hadamard spec words
// (format.h); q is then the unrotated query and out_rot the unrotated output.
// ---------------------------------------------------------------------------
// The K / V pools and centroids of an attention target (paged decode, paged prefill), against
// num_heads H and head_dim d.
struct PoolDims {
  int64_t P, Hkv, page, kpb, vpb;
};

inline ffi::Error check_pools(const Op& op, int64_t H, int64_t d, int32_t k_bits, int32_t v_bits,
                              const ffi::Buffer<ffi::U8>& k_codes, const ffi::Buffer<ffi::F32>& k_norms,
                              const ffi::Buffer<ffi::U8>& v_codes, const ffi::Buffer<ffi::F32>& v_norms,
                              const ffi::Buffer<ffi::F32>& k_centroids,
                              const ffi::Buffer<ffi::F32>& v_centroids, PoolDims* out) {
  const auto kd = k_codes.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, kd, 4, "k_codes must be rank 4 [P, Hkv, page_size, packed]"));
  const int64_t P = kd[0], Hkv = kd[1], page = kd[2];
  const int64_t kpb = packed_bytes(static_cast<int>(d), k_bits);
  const int64_t vpb = packed_bytes(static_cast<int>(d), v_bits);
  if (Hkv <= 0 || H % Hkv != 0)
    return op.invalid("num_heads (" + std::to_string(H) + ") must be a multiple of num_kv_heads (" +
                      std::to_string(Hkv) + ")");
  JTQ_RETURN_IF_ERROR(check_dims(op, "k_codes", kd, {P, Hkv, page, kpb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "k_norms", k_norms.dimensions(), {P, Hkv, page}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "v_codes", v_codes.dimensions(), {P, Hkv, page, vpb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "v_norms", v_norms.dimensions(), {P, Hkv, page}));
  JTQ_RETURN_IF_ERROR(
      check_dims(op, "k_centroids", k_centroids.dimensions(), {int64_t(1) << k_bits}));
  JTQ_RETURN_IF_ERROR(
      check_dims(op, "v_centroids", v_centroids.dimensions(), {int64_t(1) << v_bits}));
  *out = PoolDims{P, Hkv, page, kpb, vpb};
  return ffi::Error::Success();
}

// The recent-token window of an attention target or a cache write (format.h "Recent-token
// window"): k_window, v_window bf16 [num_windows, Hkv, window, d] (num_windows * window may be 0:
// no window); `ids` int32 [rows] (window_ids of the sequences, or window_slots of written tokens).
// The pools may carry leading batch axes, folded into num_windows like the page pools'.
struct WindowDims {
  int64_t num_windows, window;
  bool on() const { return num_windows > 0 && window > 0; }
};

inline ffi::Error check_window(const Op& op, int64_t Hkv, int64_t d, const ffi::Buffer<ffi::BF16>& k_window,
                               const ffi::Buffer<ffi::BF16>& v_window, const ffi::Buffer<ffi::S32>& ids,
                               const char* ids_name, int64_t rows, WindowDims* out) {
  const std::vector<int64_t> kw = fold_leading(k_window.dimensions(), 4);
  JTQ_RETURN_IF_ERROR(check_rank(op, kw, 4, "k_window must be rank 4 [num_windows, Hkv, window, d]"));
  const int64_t num_windows = kw[0], window = kw[2];
  JTQ_RETURN_IF_ERROR(check_dims(op, "k_window", kw, {num_windows, Hkv, window, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "v_window", fold_leading(v_window.dimensions(), 4), {num_windows, Hkv, window, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, ids_name, ids.dimensions(), {rows}));
  *out = WindowDims{num_windows, window};
  return ffi::Error::Success();
}

// The window pools of jax_tq_write_cache (operands 11-13, results 4-5): as check_window with
// window_slots [T], and results of the operands' shapes.
inline ffi::Error validate_window_write(const Op& op, int64_t T, int64_t Hkv, int64_t d,
                                       const ffi::Buffer<ffi::BF16>& k_window_in,
                                       const ffi::Buffer<ffi::BF16>& v_window_in,
                                       const ffi::Buffer<ffi::S32>& window_slots,
                                       const ffi::Buffer<ffi::BF16>& k_window_out,
                                       const ffi::Buffer<ffi::BF16>& v_window_out, WindowDims* out) {
  JTQ_RETURN_IF_ERROR(check_window(op, Hkv, d, k_window_in, v_window_in, window_slots, "window_slots", T, out));
  const std::initializer_list<int64_t> want = {out->num_windows, Hkv, out->window, d};
  JTQ_RETURN_IF_ERROR(check_dims(op, "k_window (result)", fold_leading(k_window_out.dimensions(), 4), want));
  return check_dims(op, "v_window (result)", fold_leading(v_window_out.dimensions(), 4), want);
}

// jax_tq_write_cache's rotation_spec (operand 14): int32 [2, 0] (the dense rotations only), or
// [2, d] with K and V of one head_dim d: the Hadamard spec words (format.h) of K's and V's rotation,
// which the CUDA handler may apply instead of the dense matrices (the same Pi). *present: [2, d].
inline ffi::Error validate_rotation_spec(const Op& op, const ffi::Buffer<ffi::S32>& spec, int64_t dk, int64_t dv,
                                         bool* present) {
  const auto dims = spec.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, dims, 2, "rotation_spec must be rank 2 [2, d] or [2, 0]"));
  *present = dims[1] != 0;
  if (!*present) return check_dims(op, "rotation_spec", dims, {2, 0});
  if (dk != dv) return op.invalid("rotation_spec [2, d] needs k and v of one head_dim");
  return check_dims(op, "rotation_spec", dims, {2, dk});
}

struct DecodeDims {
  int64_t S, H, d;        // q_rot
  int64_t P, Hkv, page;   // k/v pools
  int64_t kpb, vpb;       // packed bytes per K / V row
  int64_t max_pages, ns;  // block_tables columns, num_splits
  bool fused;             // rotation is [2, d]: the handler rotates q and the output itself
  WindowDims win;         // the recent-token window (win.on(): the last tokens come from it)
  int64_t pstride;        // partials per (seq, head): ns, plus one for the window's (win.on())
};

inline ffi::Error validate_paged_decode(
    const Op& op, const ffi::Buffer<ffi::F32>& q_rot, const ffi::Buffer<ffi::U8>& k_codes,
    const ffi::Buffer<ffi::F32>& k_norms, const ffi::Buffer<ffi::U8>& v_codes,
    const ffi::Buffer<ffi::F32>& v_norms, const ffi::Buffer<ffi::F32>& k_centroids,
    const ffi::Buffer<ffi::F32>& v_centroids, const ffi::Buffer<ffi::S32>& block_tables,
    const ffi::Buffer<ffi::S32>& seq_lens, const ffi::Buffer<ffi::BF16>& k_window,
    const ffi::Buffer<ffi::BF16>& v_window, const ffi::Buffer<ffi::S32>& window_ids,
    const ffi::Buffer<ffi::S32>& rotation, const ffi::Buffer<ffi::F32>& out_rot,
    const ffi::Buffer<ffi::F32>& partial_out, const ffi::Buffer<ffi::F32>& partial_lse,
    int32_t k_bits, int32_t v_bits, int32_t num_splits, DecodeDims* out) {
  JTQ_RETURN_IF_ERROR(check_bits(op, "k_bits", k_bits));
  JTQ_RETURN_IF_ERROR(check_bits(op, "v_bits", v_bits));
  if (num_splits < 1) return op.invalid("num_splits must be >= 1, got " + std::to_string(num_splits));
  const auto qd = q_rot.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, qd, 3, "q_rot must be rank 3 [S, H, d]"));
  const int64_t S = qd[0], H = qd[1], d = qd[2];
  JTQ_RETURN_IF_ERROR(check_head_dim(op, d));
  PoolDims pools;
  JTQ_RETURN_IF_ERROR(check_pools(op, H, d, k_bits, v_bits, k_codes, k_norms, v_codes, v_norms,
                                  k_centroids, v_centroids, &pools));
  const int64_t P = pools.P, Hkv = pools.Hkv, page = pools.page, kpb = pools.kpb, vpb = pools.vpb;
  const auto bd = block_tables.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, bd, 2, "block_tables must be rank 2 [S, max_pages]"));
  const int64_t max_pages = bd[1];
  const int64_t ns = num_splits;
  JTQ_RETURN_IF_ERROR(check_dims(op, "block_tables", bd, {S, max_pages}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "seq_lens", seq_lens.dimensions(), {S}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "out_rot (result)", out_rot.dimensions(), {S, H, d}));
  const auto rd = rotation.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, rd, 2, "rotation must be rank 2 [2, 0] or [2, d]"));
  const bool fused = rd[1] != 0;
  if (rd[0] != 2 || (fused && rd[1] != d))
    return op.invalid("rotation must be [2, 0] or [2, " + std::to_string(d) + "], got [" +
                      std::to_string(rd[0]) + ", " + std::to_string(rd[1]) + "]");
  if (fused && (d & (d - 1)) != 0)
    return op.invalid("the fused (Hadamard) rotation needs a power-of-two head_dim, got " + std::to_string(d));
  WindowDims win;
  JTQ_RETURN_IF_ERROR(check_window(op, Hkv, d, k_window, v_window, window_ids, "window_ids", S, &win));
  // The workspace holds each split's partial and, with a window, the window's after them.
  const int64_t pstride = ns + (win.on() ? 1 : 0);
  JTQ_RETURN_IF_ERROR(
      check_dims(op, "partial_out (result)", partial_out.dimensions(), {S, H, pstride, d}));
  JTQ_RETURN_IF_ERROR(
      check_dims(op, "partial_lse (result)", partial_lse.dimensions(), {S, H, pstride}));
  *out = DecodeDims{S, H, d, P, Hkv, page, kpb, vpb, max_pages, ns, fused, win, pstride};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_qjl_compress: x [N, d], rotation [d, d], centroids [2**bits], sketch [d, d]
//   -> codes [N, packed], norms [N], signs [N, d/8], gamma [N]
// ---------------------------------------------------------------------------
struct QjlCompressDims {
  int64_t n, d, pb, sb;
};

inline ffi::Error validate_qjl_compress(const Op& op, const ffi::AnyBuffer& x,
                                        const ffi::Buffer<ffi::F32>& rotation,
                                        const ffi::Buffer<ffi::F32>& centroids,
                                        const ffi::Buffer<ffi::F32>& sketch,
                                        const ffi::Buffer<ffi::U8>& codes,
                                        const ffi::Buffer<ffi::F32>& norms,
                                        const ffi::Buffer<ffi::U8>& signs,
                                        const ffi::Buffer<ffi::F32>& gamma, int32_t bits,
                                        QjlCompressDims* out) {
  const auto xd = x.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, xd, 2, "x must be rank 2 [N, d]"));
  const int64_t n = xd[0], d = xd[1];
  JTQ_RETURN_IF_ERROR(check_bits_dim(op, bits, d));
  const int64_t pb = packed_bytes(static_cast<int>(d), bits), sb = sign_bytes(static_cast<int>(d));
  JTQ_RETURN_IF_ERROR(check_dims(op, "rotation", rotation.dimensions(), {d, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "centroids", centroids.dimensions(), {int64_t(1) << bits}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "sketch", sketch.dimensions(), {d, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes (result)", codes.dimensions(), {n, pb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms (result)", norms.dimensions(), {n}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "signs (result)", signs.dimensions(), {n, sb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "gamma (result)", gamma.dimensions(), {n}));
  *out = QjlCompressDims{n, d, pb, sb};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_qjl_scores: q_rot [B, Q, d], q_sketch [B, Q, d], codes [B, S, packed], norms [B, S],
//   signs [B, S, d/8], gamma [B, S], centroids [2**bits] -> scores [B, Q, S]
// ---------------------------------------------------------------------------
struct QjlScoresDims {
  int64_t b, q, s, d, pb, sb;
};

inline ffi::Error validate_qjl_scores(
    const Op& op, const ffi::Buffer<ffi::F32>& q_rot, const ffi::Buffer<ffi::F32>& q_sketch,
    const ffi::Buffer<ffi::U8>& codes, const ffi::Buffer<ffi::F32>& norms,
    const ffi::Buffer<ffi::U8>& signs, const ffi::Buffer<ffi::F32>& gamma,
    const ffi::Buffer<ffi::F32>& centroids, const ffi::Buffer<ffi::F32>& scores, int32_t bits,
    QjlScoresDims* out) {
  const auto qd = q_rot.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, qd, 3, "q_rot must be rank 3 [B, Q, d]"));
  const int64_t b = qd[0], q = qd[1], d = qd[2];
  JTQ_RETURN_IF_ERROR(check_bits_dim(op, bits, d));
  const int64_t pb = packed_bytes(static_cast<int>(d), bits), sb = sign_bytes(static_cast<int>(d));
  const auto cd = codes.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, cd, 3, "codes must be rank 3 [B, S, packed]"));
  const int64_t s = cd[1];
  JTQ_RETURN_IF_ERROR(check_dims(op, "q_sketch", q_sketch.dimensions(), {b, q, d}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "codes", cd, {b, s, pb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "norms", norms.dimensions(), {b, s}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "signs", signs.dimensions(), {b, s, sb}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "gamma", gamma.dimensions(), {b, s}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "centroids", centroids.dimensions(), {int64_t(1) << bits}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "scores (result)", scores.dimensions(), {b, q, s}));
  *out = QjlScoresDims{b, q, s, d, pb, sb};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_paged_prefill: q_rot [T, H, d], the pools, block_tables [S, max_pages], seq_lens [S],
//   query_start_loc [S + 1] -> out_rot [T, H, d]
// ---------------------------------------------------------------------------
struct PrefillDims {
  int64_t T, H, d, S, max_pages;
  PoolDims pools;
  WindowDims win;
};

inline ffi::Error validate_paged_prefill(
    const Op& op, const ffi::Buffer<ffi::F32>& q_rot, const ffi::Buffer<ffi::U8>& k_codes,
    const ffi::Buffer<ffi::F32>& k_norms, const ffi::Buffer<ffi::U8>& v_codes,
    const ffi::Buffer<ffi::F32>& v_norms, const ffi::Buffer<ffi::F32>& k_centroids,
    const ffi::Buffer<ffi::F32>& v_centroids, const ffi::Buffer<ffi::S32>& block_tables,
    const ffi::Buffer<ffi::S32>& seq_lens, const ffi::Buffer<ffi::BF16>& k_window,
    const ffi::Buffer<ffi::BF16>& v_window, const ffi::Buffer<ffi::S32>& window_ids,
    const ffi::Buffer<ffi::S32>& query_start_loc, const ffi::Buffer<ffi::F32>& out_rot, int32_t k_bits,
    int32_t v_bits, PrefillDims* out) {
  JTQ_RETURN_IF_ERROR(check_bits(op, "k_bits", k_bits));
  JTQ_RETURN_IF_ERROR(check_bits(op, "v_bits", v_bits));
  const auto qd = q_rot.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, qd, 3, "q_rot must be rank 3 [T, H, d]"));
  const int64_t T = qd[0], H = qd[1], d = qd[2];
  JTQ_RETURN_IF_ERROR(check_head_dim(op, d));
  PoolDims pools;
  JTQ_RETURN_IF_ERROR(check_pools(op, H, d, k_bits, v_bits, k_codes, k_norms, v_codes, v_norms,
                                  k_centroids, v_centroids, &pools));
  const auto bd = block_tables.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, bd, 2, "block_tables must be rank 2 [S, max_pages]"));
  const int64_t S = bd[0], max_pages = bd[1];
  JTQ_RETURN_IF_ERROR(check_dims(op, "seq_lens", seq_lens.dimensions(), {S}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "query_start_loc", query_start_loc.dimensions(), {S + 1}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "out_rot (result)", out_rot.dimensions(), {T, H, d}));
  WindowDims win;
  JTQ_RETURN_IF_ERROR(check_window(op, pools.Hkv, d, k_window, v_window, window_ids, "window_ids", S, &win));
  *out = PrefillDims{T, H, d, S, max_pages, pools, win};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// The attention variants of jax_tq_paged_decode / jax_tq_paged_prefill (jax_tq/variants.py):
//   sinks [H] (a per-head logit in the softmax denominator only) or [0] (none); sliding_window >= 1
//   (the query at position p sees positions > p - sliding_window) or 0 (none); soft_cap > 0 (logits
//   l become soft_cap * tanh(l / soft_cap)) or 0 (none).
// ---------------------------------------------------------------------------
struct Variants {
  bool sinks;              // sinks is [H]
  int64_t sliding_window;  // 0: none
  double soft_cap;         // 0: none
  bool any() const { return sinks || sliding_window > 0 || soft_cap > 0.0; }
  // The soft cap for kernels working in log2 units (c log2 e), and in natural units, as floats: 0
  // for none, or where c log2 e overflows float (such a cap changes only logits beyond ~1e38).
  float soft_cap_log2() const {
    const double c = soft_cap * 1.4426950408889634;
    return c < double(FLT_MAX) ? static_cast<float>(c) : 0.f;
  }
  float soft_cap_natural() const { return soft_cap_log2() > 0.f ? static_cast<float>(soft_cap) : 0.f; }
};

inline ffi::Error validate_variants(const Op& op, const ffi::Buffer<ffi::F32>& sinks, int64_t H,
                                    int32_t sliding_window, float soft_cap, Variants* out) {
  const auto sd = sinks.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, sd, 1, "sinks must be rank 1 [num_heads] or [0]"));
  if (sd[0] != 0 && sd[0] != H)
    return op.invalid("sinks must be [" + std::to_string(H) + "] (num_heads) or [0] (none), got " + dims_str(sd));
  if (sliding_window < 0)
    return op.invalid("sliding_window must be >= 1 (or 0: none), got " + std::to_string(sliding_window));
  if (!(soft_cap >= 0.0f) || !std::isfinite(soft_cap) || (soft_cap > 0.0f && soft_cap < FLT_MIN))
    return op.invalid("soft_cap must be finite and a normal float32 > 0 (or 0: none), got " + std::to_string(soft_cap));
  *out = Variants{sd[0] != 0, sliding_window, double(soft_cap)};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// jax_tq_merge_attention: out [T, H, d] f32|bf16|f16 (in place), other and q [T, H, d] of out's
//   dtype, weights f32 [T, H, 2], check pred [T, H] -> out [T, H, d]
// ---------------------------------------------------------------------------
struct MergeDims {
  int64_t rows, d;  // rows: T x H
};

inline ffi::Error validate_merge_attention(const Op& op, const ffi::AnyBuffer& out, const ffi::AnyBuffer& other,
                                           const ffi::Buffer<ffi::F32>& weights, const ffi::AnyBuffer& q,
                                           const ffi::Buffer<ffi::PRED>& check, const ffi::AnyBuffer& result,
                                           MergeDims* dims) {
  const auto od = out.dimensions();
  JTQ_RETURN_IF_ERROR(check_rank(op, od, 3, "out must be rank 3 [T, H, d]"));
  const int64_t T = od[0], H = od[1], d = od[2];
  const ffi::DataType t = out.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return op.invalid("out: dtype must be float32, bfloat16 or float16");
  if (d % 2 != 0 || d > kMaxHeadDim)
    return op.invalid("head_dim must be even and at most " + std::to_string(kMaxHeadDim) + ", got " +
                      std::to_string(d));
  const std::pair<const char*, const ffi::AnyBuffer*> rows[] = {{"other", &other}, {"q", &q}, {"result", &result}};
  for (const auto& [name, buf] : rows) {
    JTQ_RETURN_IF_ERROR(check_dims(op, name, buf->dimensions(), {T, H, d}));
    if (buf->element_type() != t) return op.invalid(std::string(name) + " must have out's dtype");
  }
  JTQ_RETURN_IF_ERROR(check_dims(op, "weights", weights.dimensions(), {T, H, 2}));
  JTQ_RETURN_IF_ERROR(check_dims(op, "check", check.dimensions(), {T, H}));
  *dims = MergeDims{T * H, d};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Operand / result / attribute binding of each FFI target (docs/DESIGN.md), for
// XLA_FFI_DEFINE_HANDLER_SYMBOL. `b` is ffi::Ffi::Bind() on CPU and
// ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>() on CUDA.
// ---------------------------------------------------------------------------
template <typename B>
auto BindCompress(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()           // x [N, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // rotation [d, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // centroids [2**bits]
      .template Ret<ffi::Buffer<ffi::U8>>()         // codes [N, packed]
      .template Ret<ffi::Buffer<ffi::F32>>()        // norms [N]
      .template Attr<int32_t>("bits")
      .template Attr<int32_t>("fit_scale");  // 1: the fitted scale (format.h), 0: ||x||
}

template <typename B>
auto BindDecompress(B b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::U8>>()     // codes [N, packed]
      .template Arg<ffi::Buffer<ffi::F32>>()        // norms [N]
      .template Arg<ffi::Buffer<ffi::F32>>()        // rotation [d, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // centroids [2**bits]
      .template Ret<ffi::AnyBuffer>()               // x [N, d]
      .template Attr<int32_t>("bits");
}

// jax_tq_write_cache: K and V written into their pools (same slot_mapping) in one call.
template <typename B>
auto BindWriteCache(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()           // k [T, Hkv, d]
      .template Arg<ffi::AnyBuffer>()               // v [T, Hkv, d]
      .template Arg<ffi::Buffer<ffi::U8>>()         // k_codes [P, Hkv, page, packed_k]
      .template Arg<ffi::Buffer<ffi::F32>>()        // k_norms [P, Hkv, page]
      .template Arg<ffi::Buffer<ffi::U8>>()         // v_codes [P, Hkv, page, packed_v]
      .template Arg<ffi::Buffer<ffi::F32>>()        // v_norms [P, Hkv, page]
      .template Arg<ffi::Buffer<ffi::F32>>()        // k_rotation [d, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // k_centroids [2**k_bits]
      .template Arg<ffi::Buffer<ffi::F32>>()        // v_rotation [d, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // v_centroids [2**v_bits]
      .template Arg<ffi::Buffer<ffi::S32>>()        // slot_mapping [T]
      .template Arg<ffi::Buffer<ffi::BF16>>()       // k_window [num_windows, Hkv, window, d]
      .template Arg<ffi::Buffer<ffi::BF16>>()       // v_window [num_windows, Hkv, window, d]
      .template Arg<ffi::Buffer<ffi::S32>>()        // window_slots [T] (entry w * window + p % window)
      .template Arg<ffi::Buffer<ffi::S32>>()        // rotation_spec [2, d] (K's, V's Hadamard spec) or [2, 0]
      .template Ret<ffi::Buffer<ffi::U8>>()         // k_codes (aliases operand 2)
      .template Ret<ffi::Buffer<ffi::F32>>()        // k_norms (aliases operand 3)
      .template Ret<ffi::Buffer<ffi::U8>>()         // v_codes (aliases operand 4)
      .template Ret<ffi::Buffer<ffi::F32>>()        // v_norms (aliases operand 5)
      .template Ret<ffi::Buffer<ffi::BF16>>()       // k_window (aliases operand 11)
      .template Ret<ffi::Buffer<ffi::BF16>>()       // v_window (aliases operand 12)
      .template Attr<int32_t>("k_bits")
      .template Attr<int32_t>("v_bits")
      .template Attr<int32_t>("k_fit_scale")
      .template Attr<int32_t>("v_fit_scale");
}

// The operands that paged decode and paged prefill share, in their order. By reference: a Binding
// cannot be moved into a function (its move constructor is private), only chained.
template <typename B>
auto BindAttentionOperands(B&& b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::F32>>()    // q_rot [S, H, d] (prefill: [T, H, d])
      .template Arg<ffi::Buffer<ffi::U8>>()         // k_codes
      .template Arg<ffi::Buffer<ffi::F32>>()        // k_norms
      .template Arg<ffi::Buffer<ffi::U8>>()         // v_codes
      .template Arg<ffi::Buffer<ffi::F32>>()        // v_norms
      .template Arg<ffi::Buffer<ffi::F32>>()        // k_centroids
      .template Arg<ffi::Buffer<ffi::F32>>()        // v_centroids
      .template Arg<ffi::Buffer<ffi::S32>>()        // block_tables [S, max_pages]
      .template Arg<ffi::Buffer<ffi::S32>>()        // seq_lens [S]
      .template Arg<ffi::Buffer<ffi::BF16>>()       // k_window [num_windows, Hkv, window, d]
      .template Arg<ffi::Buffer<ffi::BF16>>()       // v_window [num_windows, Hkv, window, d]
      .template Arg<ffi::Buffer<ffi::S32>>();       // window_ids [S]
}

template <typename B>
auto BindPagedDecode(B b) {
  return BindAttentionOperands(std::move(b))
      .template Arg<ffi::Buffer<ffi::S32>>()        // rotation [2, 0] or [2, d] (fused)
      .template Arg<ffi::Buffer<ffi::F32>>()        // sinks [H] or [0] (none)
      .template Ret<ffi::Buffer<ffi::F32>>()        // out_rot [S, H, d]
      .template Ret<ffi::Buffer<ffi::F32>>()        // partial_out [S, H, ns, d]
      .template Ret<ffi::Buffer<ffi::F32>>()        // partial_lse [S, H, ns]
      .template Attr<int32_t>("k_bits")
      .template Attr<int32_t>("v_bits")
      .template Attr<int32_t>("num_splits")
      .template Attr<float>("scale")
      .template Attr<int32_t>("f16_products")   // 1: q, p and centroids may enter products as f16
      .template Attr<int32_t>("kernel")         // a requested kernel family (decode_plan.h), 0: the planner's
      .template Attr<int32_t>("sliding_window")  // 0: none
      .template Attr<float>("soft_cap");         // 0: none
}

template <typename B>
auto BindQjlCompress(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()           // x [N, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // rotation [d, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // centroids [2**bits]
      .template Arg<ffi::Buffer<ffi::F32>>()        // sketch [d, d]
      .template Ret<ffi::Buffer<ffi::U8>>()         // codes [N, packed]
      .template Ret<ffi::Buffer<ffi::F32>>()        // norms [N]
      .template Ret<ffi::Buffer<ffi::U8>>()         // signs [N, d/8]
      .template Ret<ffi::Buffer<ffi::F32>>()        // gamma [N]
      .template Attr<int32_t>("bits");
}

template <typename B>
auto BindQjlScores(B b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::F32>>()    // q_rot [B, Q, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // q_sketch [B, Q, d]
      .template Arg<ffi::Buffer<ffi::U8>>()         // codes [B, S, packed]
      .template Arg<ffi::Buffer<ffi::F32>>()        // norms [B, S]
      .template Arg<ffi::Buffer<ffi::U8>>()         // signs [B, S, d/8]
      .template Arg<ffi::Buffer<ffi::F32>>()        // gamma [B, S]
      .template Arg<ffi::Buffer<ffi::F32>>()        // centroids [2**bits]
      .template Ret<ffi::Buffer<ffi::F32>>()        // scores [B, Q, S]
      .template Attr<int32_t>("bits")
      .template Attr<float>("qjl_scale");
}

template <typename B>
auto BindPagedPrefill(B b) {
  return BindAttentionOperands(std::move(b))
      .template Arg<ffi::Buffer<ffi::S32>>()        // query_start_loc [S + 1]
      .template Arg<ffi::Buffer<ffi::F32>>()        // sinks [H] or [0] (none)
      .template Ret<ffi::Buffer<ffi::F32>>()        // out_rot [T, H, d]
      .template Attr<int32_t>("k_bits")
      .template Attr<int32_t>("v_bits")
      .template Attr<float>("scale")
      .template Attr<bool>("f16_products")          // float16 tensor-core products allowed (CUDA)
      .template Attr<int32_t>("sliding_window")     // 0: none
      .template Attr<float>("soft_cap");            // 0: none
}

// jax_tq_merge_attention: two attentions' outputs merged in place (merge_attention.cc).
template <typename B>
auto BindMergeAttention(B b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()           // out [T, H, d] (the result aliases it)
      .template Arg<ffi::AnyBuffer>()               // other [T, H, d]
      .template Arg<ffi::Buffer<ffi::F32>>()        // weights [T, H, 2]: out's, other's
      .template Arg<ffi::AnyBuffer>()               // q [T, H, d]
      .template Arg<ffi::Buffer<ffi::PRED>>()       // check [T, H]
      .template Ret<ffi::AnyBuffer>();              // out [T, H, d]
}

}  // namespace ffi_checks
}  // namespace jax_tq

#endif  // JAX_TQ_FFI_CHECKS_H_
