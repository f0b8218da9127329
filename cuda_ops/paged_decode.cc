// CPU XLA FFI handler implementation for jax_tq_paged_decode (see docs/DESIGN.md).
// The handler symbol (ffi::Ffi::Bind) lives in cpu_module.cc.
//
// q is rotated into K's rotated space first (q_rot = Pi_k q, in double). Split-K: for each
// (seq, kv head, split) every K/V token row is decoded once and reused by all query heads of the
// GQA group; each (seq, q head, split) writes its partial (lse = m + log(l), out = o / l) into
// the workspace results, then a log-sum-exp combine gives out_rot, which is rotated back
// (out = out_rot Pi_v, in double) and cast to q's dtype. A row whose q or q_rot (as float32) is
// not finite is NaN. Softmax accumulation is in double with running-max subtraction, so huge
// logits never give inf/NaN.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "jax_tq/ffi_checks.h"
#include "jax_tq/float_io.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// dots[h] = sum_i q[h, i] * k[i] for the G query rows of a group, each summed in i order (so the
// result does not depend on the grouping); four heads per pass, so that their four sums overlap.
void group_dots(const double* q, const double* k, int64_t G, int64_t d, double* dots) {
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


// q_rot rows (double) of every query row, q_rot = q Pi_k^T; also written, as float32, to the
// q_rot workspace. ok[r]: row r of q and of float32(q_rot) are all finite.
void rotate_queries(const void* q, FloatKind kind, const float* rot, int64_t rows, int64_t d,
                    double* q_rot, float* q_rot_ws, std::vector<char>& ok) {
  std::vector<double> rot_d(rot, rot + d * d);
  float row[kMaxHeadDim];
  for (int64_t r = 0; r < rows; ++r) {
    load_row(q, kind, r * d, int(d), row);
    bool finite = true;
    for (int64_t k = 0; k < d; ++k) finite &= std::isfinite(row[k]);
    for (int64_t e = 0; e < d; ++e) {
      const double* pe = &rot_d[e * d];
      double acc = 0.0;
      for (int64_t k = 0; k < d; ++k) acc += double(row[k]) * pe[k];
      q_rot[r * d + e] = acc;
      q_rot_ws[r * d + e] = float(acc);
      finite &= std::isfinite(float(acc));
    }
    ok[r] = finite;
  }
}

// out = o_rot Pi_v for one row (o_rot in double), cast to the result dtype; NaN when !ok.
void store_output_row(const double* o_rot, const float* rot, int64_t d, bool ok, void* out,
                      FloatKind kind, int64_t row) {
  float vals[kMaxHeadDim];
  for (int64_t c = 0; c < d; ++c) {
    double acc = 0.0;
    for (int64_t e = 0; e < d; ++e) acc += o_rot[e] * double(rot[e * d + c]);
    vals[c] = ok ? float(acc) : std::numeric_limits<float>::quiet_NaN();
  }
  store_row(out, kind, row * d, int(d), vals);
}

}  // namespace

ffi::Error PagedDecodeImpl(ffi::AnyBuffer q_in, ffi::Buffer<ffi::U8> k_codes,
                           ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                           ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                           ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> k_rotation,
                           ffi::Buffer<ffi::F32> v_rotation, ffi::Result<ffi::AnyBuffer> out_q,
                           ffi::Result<ffi::Buffer<ffi::F32>> q_rot_ws,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_rot,
                           ffi::Result<ffi::Buffer<ffi::S32>> row_flags,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t k_bits,
                           int32_t v_bits, int32_t num_splits, float scale,
                           int32_t /*f16_products: the CPU kernel always computes in float64*/) {
  // ---- validation --------------------------------------------------------
  static constexpr ffi_checks::Op op{"jax_tq_paged_decode", ffi_checks::kCpuTag};
  ffi_checks::DecodeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_paged_decode(
      op, q_in, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
      seq_lens, k_rotation, v_rotation, *out_q, *q_rot_ws, *out_rot, *row_flags, *partial_out, *partial_lse,
      k_bits, v_bits, num_splits, &dims));
  const int64_t S = dims.S, H = dims.H, d = dims.d;
  const int64_t P = dims.P, Hkv = dims.Hkv, page = dims.page;
  const int64_t kpb = dims.kpb, vpb = dims.vpb, max_pages = dims.max_pages, ns = dims.ns;

  const FloatKind kind = kind_of(q_in.element_type());
  std::vector<double> q_rot(S * H * d);
  std::vector<char> row_ok(S * H);
  rotate_queries(q_in.untyped_data(), kind, k_rotation.typed_data(), S * H, d, q_rot.data(),
                 q_rot_ws->typed_data(), row_ok);
  const double* q = q_rot.data();
  const float* v_rot = v_rotation.typed_data();
  void* out_final = out_q->untyped_data();
  const uint8_t* kc = k_codes.typed_data();
  const float* kn = k_norms.typed_data();
  const uint8_t* vc = v_codes.typed_data();
  const float* vn = v_norms.typed_data();
  const float* kcent = k_centroids.typed_data();
  const float* vcent = v_centroids.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int32_t* sl = seq_lens.typed_data();
  float* out = out_rot->typed_data();
  float* pout = partial_out->typed_data();
  float* plse = partial_lse->typed_data();

  const int64_t G = (Hkv > 0) ? H / Hkv : 0;  // query heads per kv head
  const double dscale = double(scale);

  // Per-group workspace: running max / sum / unnormalised output per query head.
  std::vector<double> m(G), l(G), o(G * d);
  std::vector<double> qg(G * d);  // query rows of the group, in double
  std::vector<double> dots(G);    // q . k of each query head for the current token
  // Double copy of each split's lse for the combine (the f32 workspace copy loses
  // ~ulp(max logit) which matters for huge logits); o/l is combined from the f32
  // workspace.
  std::vector<double> lse_d(G * ns);
  uint8_t codes[kMaxHeadDim];
  double krow[kMaxHeadDim], vrow[kMaxHeadDim];

  for (int64_t s = 0; s < S; ++s) {
    const int32_t* bts = bt + s * max_pages;

    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t h0 = g * G;
      for (int64_t hh = 0; hh < G; ++hh)
        for (int64_t i = 0; i < d; ++i) qg[hh * d + i] = q[((s * H) + h0 + hh) * d + i];

      for (int64_t sp = 0; sp < ns; ++sp) {
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.0);
        std::fill(o.begin(), o.end(), 0.0);
        const SplitRange range = split_range(sl[s], max_pages, page, ns, sp);
        const int64_t seq_len = range.seq_len, p_begin = range.page_begin, p_end = range.page_end;

        for (int64_t j = p_begin; j < p_end; ++j) {
          const int64_t phys = bts[j];
          if (phys < 0 || phys >= P) continue;  // invalid entry: contributes nothing
          const int64_t ntok = std::min(page, seq_len - j * page);
          for (int64_t t = 0; t < ntok; ++t) {
            // Decode K and V rows once for the whole group.
            const int64_t nidx = norms_offset(phys, g, t, Hkv, page);
            unpack_row(kc + codes_offset(phys, g, t, Hkv, page, kpb), int(d), k_bits, codes);
            for (int64_t i = 0; i < d; ++i) krow[i] = kcent[codes[i]];
            unpack_row(vc + codes_offset(phys, g, t, Hkv, page, vpb), int(d), v_bits, codes);
            const double vnorm = vn[nidx];
            for (int64_t i = 0; i < d; ++i) vrow[i] = vnorm * double(vcent[codes[i]]);
            const double kscale = dscale * double(kn[nidx]);

            group_dots(qg.data(), krow, G, d, dots.data());
            for (int64_t hh = 0; hh < G; ++hh) {
              const double score = kscale * dots[hh];
              if (!(score > kNegInf)) continue;  // -inf (or NaN) logit contributes nothing
              double* oh = &o[hh * d];
              double p;
              if (score > m[hh]) {
                const double alpha = std::exp(m[hh] - score);  // 0 when m = -inf
                l[hh] *= alpha;
                for (int64_t i = 0; i < d; ++i) oh[i] *= alpha;
                m[hh] = score;
                p = 1.0;
              } else {
                p = std::exp(score - m[hh]);
              }
              l[hh] += p;
              for (int64_t i = 0; i < d; ++i) oh[i] += p * vrow[i];
            }
          }
        }

        // Write partials for this split.
        for (int64_t hh = 0; hh < G; ++hh) {
          const int64_t h = h0 + hh;
          const int64_t li = (s * H + h) * ns + sp;
          float* po = pout + li * d;
          if (l[hh] > 0.0) {
            lse_d[hh * ns + sp] = m[hh] + std::log(l[hh]);
            plse[li] = float(lse_d[hh * ns + sp]);
            const double inv = 1.0 / l[hh];
            for (int64_t i = 0; i < d; ++i) po[i] = float(o[hh * d + i] * inv);
          } else {
            lse_d[hh * ns + sp] = kNegInf;
            plse[li] = -std::numeric_limits<float>::infinity();
            for (int64_t i = 0; i < d; ++i) po[i] = 0.0f;
          }
        }
      }

      // Log-sum-exp combine of the splits.
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = h0 + hh;
        const double* lse = &lse_d[hh * ns];
        const float* po = pout + (s * H + h) * ns * d;
        float* oh = out + (s * H + h) * d;
        double gmax = kNegInf;
        for (int64_t sp = 0; sp < ns; ++sp) gmax = std::max(gmax, lse[sp]);
        double acc[kMaxHeadDim] = {0.0};
        const int64_t row = s * H + h;
        if (!(gmax > kNegInf)) {
          for (int64_t i = 0; i < d; ++i) oh[i] = 0.0f;
          store_output_row(acc, v_rot, d, row_ok[row], out_final, kind, row);
          continue;
        }
        double wsum = 0.0;
        for (int64_t sp = 0; sp < ns; ++sp) {
          if (!(lse[sp] > kNegInf)) continue;
          const double w = std::exp(lse[sp] - gmax);
          wsum += w;
          for (int64_t i = 0; i < d; ++i) acc[i] += w * double(po[sp * d + i]);
        }
        const double inv = 1.0 / wsum;  // wsum >= 1 (the max split has w = 1)
        for (int64_t i = 0; i < d; ++i) {
          acc[i] *= inv;
          oh[i] = float(acc[i]);
        }
        store_output_row(acc, v_rot, d, row_ok[row], out_final, kind, row);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq
