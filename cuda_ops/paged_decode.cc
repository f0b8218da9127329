// CPU XLA FFI handler implementation for jax_tq_paged_decode (see docs/DESIGN.md).
// The handler symbol (ffi::Ffi::Bind) lives in cpu_module.cc.
//
// Split-K: for each (seq, kv head, split) every K/V token row is decoded once and
// reused by all query heads of the GQA group; each (seq, q head, split) writes its
// partial (lse = m + log(l), out = o / l) into the workspace results, then a
// log-sum-exp combine produces out_rot. Softmax accumulation is in double with
// running-max subtraction, so huge logits never give inf/NaN.
//
// Recent-token window (format.h): the splits cut the tokens [0, paged_tokens) of the pages; the
// window's positions [paged_tokens, L) (bf16 rows of the rotated K / V) join the last split's
// online softmax, so that the combine merges them as it merges pages.
//
// Variants (ffi_checks.h, jax_tq/variants.py): a sliding window skips the positions < L - window;
// a soft cap maps each logit l to cap * tanh(l / cap); the head's sink joins the combine's
// denominator (exp(sink - m), no value row).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "jax_tq/cpu_attention.h"
#include "jax_tq/cpu_floats.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cpu {
namespace {

using cpu_floats::bf16_to_f32;

// x <- H_un x, the unnormalized Sylvester Hadamard transform of a power-of-two length d.
void fwht(double* x, int64_t d) {
  for (int64_t h = 1; h < d; h <<= 1)
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const double a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// x <- Pi x (inverse: Pi^T x) for Pi = H D2 P H D1 given by its spec words (format.h), in double.
void rotate_row(const int32_t* spec, int64_t d, bool inverse, double* x) {
  double tmp[kMaxHeadDim];
  const double norm = 1.0 / static_cast<double>(d);  // the two 1 / sqrt(d) of the normalized H
  auto word = [&](int64_t i) { return static_cast<uint32_t>(spec[i]); };
  auto perm = [&](int64_t i) { return static_cast<int64_t>(rot_perm(word(i))) & (d - 1); };
  if (!inverse) {
    for (int64_t i = 0; i < d; ++i) x[i] = (rot_neg1(word(i)) ? -x[i] : x[i]) * norm;
    fwht(x, d);
    for (int64_t i = 0; i < d; ++i) tmp[i] = rot_neg2(word(i)) ? -x[perm(i)] : x[perm(i)];
    fwht(tmp, d);
    std::copy(tmp, tmp + d, x);
    return;
  }
  for (int64_t i = 0; i < d; ++i) x[i] *= norm;
  fwht(x, d);
  for (int64_t i = 0; i < d; ++i) tmp[perm(i)] = rot_neg2(word(i)) ? -x[i] : x[i];
  fwht(tmp, d);
  for (int64_t i = 0; i < d; ++i) x[i] = rot_neg1(word(i)) ? -tmp[i] : tmp[i];
}

}  // namespace

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                           ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                           ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                           ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::BF16> k_window,
                           ffi::Buffer<ffi::BF16> v_window, ffi::Buffer<ffi::S32> window_ids,
                           ffi::Buffer<ffi::S32> rotation, ffi::Buffer<ffi::F32> sinks,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_rot,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t k_bits,
                           int32_t v_bits, int32_t num_splits, float scale,
                           int32_t /*f16_products: the CPU kernel always computes in float64*/,
                           int32_t /*kernel: a CUDA kernel family, nothing to choose here*/,
                           int32_t sliding_window, float soft_cap) {
  // ---- validation --------------------------------------------------------
  static constexpr ffi_checks::Op op{"jax_tq_paged_decode", ffi_checks::kCpuTag};
  ffi_checks::DecodeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_paged_decode(
      op, q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
      seq_lens, k_window, v_window, window_ids, rotation, *out_rot, *partial_out, *partial_lse,
      k_bits, v_bits, num_splits, &dims));
  ffi_checks::Variants variants;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_variants(op, sinks, dims.H, sliding_window, soft_cap, &variants));
  const int64_t S = dims.S, H = dims.H, d = dims.d;
  const int64_t P = dims.P, Hkv = dims.Hkv, page = dims.page;
  const int64_t kpb = dims.kpb, vpb = dims.vpb, max_pages = dims.max_pages, ns = dims.ns;

  const float* q = q_rot.typed_data();
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
  // The recent-token window (format.h): W = 0 when there is none (every token from the pages).
  const int64_t num_windows = dims.win.num_windows, W = dims.win.on() ? dims.win.window : 0;
  const uint16_t* kw = static_cast<const uint16_t*>(k_window.untyped_data());
  const uint16_t* vw = static_cast<const uint16_t*>(v_window.untyped_data());
  const int32_t* wids = window_ids.typed_data();
  const int64_t capacity = max_pages * page;
  const int32_t* rot_k = dims.fused ? rotation.typed_data() : nullptr;  // fused: q and out unrotated
  const int32_t* rot_v = dims.fused ? rot_k + d : nullptr;

  const int64_t G = (Hkv > 0) ? H / Hkv : 0;  // query heads per kv head
  const double dscale = double(scale);
  const double cap = variants.soft_cap;
  auto logit = [cap](double l) { return cap > 0.0 ? cap * std::tanh(l / cap) : l; };
  const float* sink = variants.sinks ? sinks.typed_data() : nullptr;

  // Per-group workspace: running max / sum / unnormalised output per query head.
  std::vector<double> m(G), l(G), o(G * d);
  std::vector<double> qg(G * d);  // query rows of the group, in double
  std::vector<double> dots(G);    // q . k of each query head for the current token
  std::vector<bool> row_ok(G);    // the head's q_rot row is all finite (else a NaN output row)
  // Double copy of each split's lse for the combine (the f32 workspace copy loses
  // ~ulp(max logit) which matters for huge logits); o/l is combined from the f32
  // workspace.
  std::vector<double> lse_d(G * ns);
  uint8_t codes[kMaxHeadDim];
  double krow[kMaxHeadDim], vrow[kMaxHeadDim];

  for (int64_t s = 0; s < S; ++s) {
    const int32_t* bts = bt + s * max_pages;
    // The pages hold tokens [0, paged); the window positions [paged, len) (none for an id outside
    // [0, num_windows)).
    const int64_t len = clamp_len(sl[s], capacity);
    const int64_t paged = paged_tokens(sl[s], capacity, W);
    const int64_t wid = W > 0 ? int64_t(wids[s]) : -1;
    const bool window_ok = wid >= 0 && wid < num_windows;
    // The query sits at position len - 1: a sliding window shows it positions [lo, len) only.
    const int64_t lo = variants.sliding_window > 0 ? std::max<int64_t>(0, len - variants.sliding_window) : 0;

    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t h0 = g * G;
      for (int64_t hh = 0; hh < G; ++hh) {
        row_ok[hh] = true;
        double* qrow = &qg[hh * d];
        for (int64_t i = 0; i < d; ++i) qrow[i] = q[((s * H) + h0 + hh) * d + i];
        if (rot_k != nullptr) rotate_row(rot_k, d, false, qrow);
        // Not finite in float32 (as the GPU kernels see a fused rotation that overflows): a NaN row.
        for (int64_t i = 0; i < d; ++i)
          row_ok[hh] = row_ok[hh] && std::fabs(qrow[i]) <= std::numeric_limits<float>::max();
      }

      for (int64_t sp = 0; sp < ns; ++sp) {
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.0);
        std::fill(o.begin(), o.end(), 0.0);
        // The split's pages, those before the sliding window's first page shared by no split (the
        // CUDA kernels' ranges): its tokens before lo are skipped.
        const VisibleSplit range =
            visible_split_range(sl[s], max_pages, page, W, variants.sliding_window, ns, sp);
        for (int64_t j = range.tok_begin / page; j * page < range.tok_end; ++j) {
          const int64_t phys = bts[j];
          if (phys < 0 || phys >= P) continue;  // invalid entry: contributes nothing
          const int64_t ntok = std::min(page, range.tok_end - j * page);
          for (int64_t t = std::max<int64_t>(0, range.first_visible - j * page); t < ntok; ++t) {
            // Decode K and V rows once for the whole group.
            const int64_t nidx = norms_offset(phys, g, t, Hkv, page);
            unpack_row(kc + codes_offset(phys, g, t, Hkv, page, kpb), int(d), k_bits, codes);
            for (int64_t i = 0; i < d; ++i) krow[i] = kcent[codes[i]];
            unpack_row(vc + codes_offset(phys, g, t, Hkv, page, vpb), int(d), v_bits, codes);
            const double vnorm = vn[nidx];
            for (int64_t i = 0; i < d; ++i) vrow[i] = vnorm * double(vcent[codes[i]]);
            const double kscale = dscale * double(kn[nidx]);

            group_dots(qg.data(), krow, G, d, dots.data());
            for (int64_t hh = 0; hh < G; ++hh)
              online_softmax_add(logit(kscale * dots[hh]), vrow, d, m[hh], l[hh], &o[hh * d]);
          }
        }

        // The window's tokens follow the last split's pages (rows of the rotated K / V, bf16).
        if (sp == ns - 1 && window_ok) {
          for (int64_t p = std::max(paged, lo); p < len; ++p) {
            const int64_t base = ((wid * Hkv + g) * W + window_entry(p, W)) * d;
            for (int64_t i = 0; i < d; ++i) krow[i] = double(bf16_to_f32(kw[base + i]));
            for (int64_t i = 0; i < d; ++i) vrow[i] = double(bf16_to_f32(vw[base + i]));
            group_dots(qg.data(), krow, G, d, dots.data());
            for (int64_t hh = 0; hh < G; ++hh)
              online_softmax_add(logit(dscale * dots[hh]), vrow, d, m[hh], l[hh], &o[hh * d]);
          }
        }

        // Write partials for this split.
        for (int64_t hh = 0; hh < G; ++hh) {
          const int64_t h = h0 + hh;
          const int64_t li = (s * H + h) * dims.pstride + sp;
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
        const float* po = pout + (s * H + h) * dims.pstride * d;
        float* oh = out + (s * H + h) * d;
        if (!row_ok[hh]) {
          for (int64_t i = 0; i < d; ++i) oh[i] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        double gmax = kNegInf;
        for (int64_t sp = 0; sp < ns; ++sp) gmax = std::max(gmax, lse[sp]);
        if (!(gmax > kNegInf)) {
          for (int64_t i = 0; i < d; ++i) oh[i] = 0.0f;
          continue;
        }
        // The sink (a logit without a value row) joins the denominator; both shifted by the larger.
        const double top = sink != nullptr ? std::max(gmax, double(sink[h])) : gmax;
        double acc[kMaxHeadDim] = {0.0};
        double wsum = sink != nullptr ? std::exp(double(sink[h]) - top) : 0.0;
        for (int64_t sp = 0; sp < ns; ++sp) {
          if (!(lse[sp] > kNegInf)) continue;
          const double w = std::exp(lse[sp] - top);
          wsum += w;
          for (int64_t i = 0; i < d; ++i) acc[i] += w * double(po[sp * d + i]);
        }
        const double inv = 1.0 / wsum;  // wsum >= 1 (the larger of the max split and the sink has w = 1)
        for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
        if (rot_v != nullptr) rotate_row(rot_v, d, true, acc);
        for (int64_t i = 0; i < d; ++i) oh[i] = float(acc[i]);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedDecodeCpu, jax_tq::cpu::PagedDecodeImpl,
                              jax_tq::ffi_checks::BindPagedDecode(ffi::Ffi::Bind()));
