// CPU XLA FFI handler implementation for jax_tq_paged_prefill (see docs/DESIGN.md): causal
// attention of each sequence's new query rows over its compressed paged cache (the new tokens
// already written). The handler symbol (ffi::Ffi::Bind) lives in cpu_module.cc.
//
// For each (sequence, KV head) every K / V token row is decoded once and serves every query row
// that sees it (rows at or after the token's position) and every query head of the GQA group.
// Softmax accumulation in double with running-max subtraction (cpu_attention.h). With a
// recent-token window (format.h) the sequence's tokens [paged_tokens, seq_len) come from the
// window ring (bf16 rows of the rotated K / V) instead of the pages.
//
// Variants (ffi_checks.h, jax_tq/variants.py): with a sliding window w, token t serves the rows at
// positions t .. t + w - 1 only; a soft cap maps each logit l to cap * tanh(l / cap); the head's
// sink joins each row's denominator (exp(sink - m), no value row).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "jax_tq/cpu_attention.h"
#include "jax_tq/cpu_floats.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cpu {

using cpu_floats::bf16_to_f32;

ffi::Error PagedPrefillImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                            ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                            ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                            ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::BF16> k_window,
                            ffi::Buffer<ffi::BF16> v_window, ffi::Buffer<ffi::S32> window_ids,
                            ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::F32> sinks,
                            ffi::Result<ffi::Buffer<ffi::F32>> out_rot, int32_t k_bits, int32_t v_bits,
                            float scale, bool /*f16_products: float64 here*/, int32_t sliding_window,
                            float soft_cap) {
  static constexpr ffi_checks::Op op{"jax_tq_paged_prefill", ffi_checks::kCpuTag};
  ffi_checks::PrefillDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_paged_prefill(op, q_rot, k_codes, k_norms, v_codes, v_norms,
                                                         k_centroids, v_centroids, block_tables, seq_lens,
                                                         k_window, v_window, window_ids, query_start_loc,
                                                         *out_rot, k_bits, v_bits, &dims));
  ffi_checks::Variants variants;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_variants(op, sinks, dims.H, sliding_window, soft_cap, &variants));
  const double cap = variants.soft_cap;
  auto logit = [cap](double l) { return cap > 0.0 ? cap * std::tanh(l / cap) : l; };
  const float* sink = variants.sinks ? sinks.typed_data() : nullptr;
  const int64_t sw = variants.sliding_window;
  const int64_t T = dims.T, H = dims.H, d = dims.d, max_pages = dims.max_pages;
  const int64_t P = dims.pools.P, Hkv = dims.pools.Hkv, page = dims.pools.page;
  const int64_t G = H / Hkv;
  const float* q = q_rot.typed_data();
  float* out = out_rot->typed_data();
  std::fill(out, out + T * H * d, 0.0f);  // rows of no sequence stay zero
  // The recent-token window (format.h): W = 0 when there is none (every token from the pages).
  const int64_t num_windows = dims.win.num_windows, W = dims.win.on() ? dims.win.window : 0;
  const uint16_t* kw = static_cast<const uint16_t*>(k_window.untyped_data());
  const uint16_t* vw = static_cast<const uint16_t*>(v_window.untyped_data());

  uint8_t codes[kMaxHeadDim];
  double krow[kMaxHeadDim], vrow[kMaxHeadDim];
  std::vector<double> qg, m, l, o, dots(G);
  std::vector<bool> row_ok;
  for (int64_t s = 0; s < dims.S; ++s) {
    const PrefillRows rows = prefill_rows(query_start_loc.typed_data(), seq_lens.typed_data(), s, T,
                                          max_pages * page);
    const int64_t q_len = rows.end - rows.begin, R = q_len * G;  // R rows: (query row, head of the group)
    if (q_len == 0) continue;
    const int32_t* table = block_tables.typed_data() + s * max_pages;
    // Tokens [0, paged) sit in the pages, positions [paged, seq_len) in the window ring (none for
    // an id outside [0, num_windows)): the cache as it stands, whatever row reads it.
    const int64_t paged = paged_tokens(rows.seq_len, max_pages * page, W);
    const int64_t wid = W > 0 ? int64_t(window_ids.typed_data()[s]) : -1;
    const bool window_ok = wid >= 0 && wid < num_windows;
    qg.assign(R * d, 0.0);
    o.assign(R * d, 0.0);
    m.assign(R, kNegInf);
    l.assign(R, 0.0);
    row_ok.assign(R, true);
    for (int64_t g = 0; g < Hkv; ++g) {
      std::fill(o.begin(), o.end(), 0.0);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0);
      for (int64_t r = 0; r < R; ++r) {
        const float* src = q + ((rows.begin + r / G) * H + g * G + r % G) * d;
        bool ok = true;
        for (int64_t i = 0; i < d; ++i) {
          qg[r * d + i] = src[i];
          ok = ok && std::isfinite(src[i]);
        }
        row_ok[r] = ok;
      }
      int64_t first_row = 0;  // the first query row that sees token t (rows see more tokens as i grows)
      int64_t end_row = q_len;  // past the last row that sees it (a sliding window: causal_len <= t + sw)
      if (sw > 0) end_row = 0;
      for (int64_t t = 0; t < rows.seq_len; ++t) {
        while (first_row < q_len && rows.causal_len(rows.begin + first_row) <= t) ++first_row;
        while (sw > 0 && end_row < q_len && rows.causal_len(rows.begin + end_row) <= t + sw) ++end_row;
        if (first_row >= end_row) continue;  // no row sees token t
        double kscale;
        if (t < paged) {
          const int64_t phys = table[t / page];
          if (phys < 0 || phys >= P) continue;  // invalid entry: its tokens contribute nothing
          const int64_t nidx = norms_offset(phys, g, t % page, Hkv, page);
          unpack_row(k_codes.typed_data() + codes_offset(phys, g, t % page, Hkv, page, dims.pools.kpb), int(d),
                     k_bits, codes);
          for (int64_t i = 0; i < d; ++i) krow[i] = k_centroids.typed_data()[codes[i]];
          unpack_row(v_codes.typed_data() + codes_offset(phys, g, t % page, Hkv, page, dims.pools.vpb), int(d),
                     v_bits, codes);
          const double vnorm = v_norms.typed_data()[nidx];
          for (int64_t i = 0; i < d; ++i) vrow[i] = vnorm * double(v_centroids.typed_data()[codes[i]]);
          kscale = double(scale) * double(k_norms.typed_data()[nidx]);
        } else {
          if (!window_ok) continue;  // no window ring: the sequence's last tokens contribute nothing
          const int64_t base = ((wid * Hkv + g) * W + window_entry(t, W)) * d;
          for (int64_t i = 0; i < d; ++i) krow[i] = double(bf16_to_f32(kw[base + i]));
          for (int64_t i = 0; i < d; ++i) vrow[i] = double(bf16_to_f32(vw[base + i]));
          kscale = double(scale);
        }
        for (int64_t i = first_row; i < end_row; ++i) {
          group_dots(&qg[i * G * d], krow, G, d, dots.data());
          for (int64_t hh = 0; hh < G; ++hh) {
            const int64_t r = i * G + hh;
            online_softmax_add(logit(kscale * dots[hh]), vrow, d, m[r], l[r], &o[r * d]);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* dst = out + ((rows.begin + r / G) * H + g * G + r % G) * d;
        double inv = l[r] > 0.0 ? 1.0 / l[r] : 0.0;
        if (sink != nullptr && l[r] > 0.0) {  // o / (l + exp(sink - m)), shifted by the larger of m and sink
          const double sk = double(sink[g * G + r % G]);
          const double lift = std::exp(m[r] - sk);  // <= 1 where the sink is the larger
          inv = sk > m[r] ? lift / (l[r] * lift + 1.0) : 1.0 / (l[r] + std::exp(sk - m[r]));
        }
        for (int64_t i = 0; i < d; ++i)
          dst[i] = row_ok[r] ? float(o[r * d + i] * inv) : std::numeric_limits<float>::quiet_NaN();
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedPrefillCpu, jax_tq::cpu::PagedPrefillImpl,
                              jax_tq::ffi_checks::BindPagedPrefill(ffi::Ffi::Bind()));
