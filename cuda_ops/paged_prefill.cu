// CUDA XLA FFI handler for jax_tq_paged_prefill (docs/DESIGN.md): causal attention of each
// sequence's new query rows over its compressed paged cache. Two kernels, chosen here and nowhere
// else: the tensor-core one (prefill_tensor_core.cuh) for head_dim 64 and 128, this file's
// CUDA-core kernel for the other head_dims.
//
// CUDA-core kernel: a CTA of 4 warps takes a tile of consecutive query rows (tokens) of the flattened
// token axis and up to 16 query heads of one KV head's GQA group: at most 16 (row, head) pairs, 4 per
// warp, each held by the warp's lanes (coordinate lane + 32 k). K and V tokens pass through shared
// memory 16 at a time, decoded once (centroid x norm, float32) for all of the CTA's pairs. A tile
// that spans sequences is processed one sequence piece at a time. Rows of no sequence are zeroed by
// a memset before the kernel. With a recent-token window (W > 0) a sequence's tokens
// [paged_tokens, L) come from its window ring (bf16 rows of the rotated vectors, entry t % W) instead
// of the pages: a row of causal length n reads pages [0, min(n, paged_tokens)) and window positions
// [paged_tokens, n).
//
// Both kernels serve the attention variants (sliding window: a row's tile loop starts at the tile of
// the piece's first visible token; soft cap; sinks in the final normalisation).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "jax_tq/attention_variants.cuh"
#include "jax_tq/cuda_launch.h"
#include "jax_tq/cuda_warp.h"
#include "jax_tq/dispatch.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "jax_tq/prefill_device.cuh"
#include "jax_tq/prefill_tensor_core.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kPairs = 16;                     // (query row, head) pairs per CTA
constexpr int kPairsPerWarp = kPairs / kWarps;
constexpr int kSlots = kMaxHeadDim / 32;       // coordinates per lane
constexpr int kTokens = 16;                    // K / V tokens per shared-memory tile

struct Tile {
  float k[kTokens][kMaxHeadDim];
  float v[kTokens][kMaxHeadDim];
  float k_scale[kTokens];  // scale * k_norm, or 0 with valid = 0 for an invalid page
  int valid[kTokens];
};

// Decodes tokens [t0, t0 + kTokens) of sequence s, KV head g, into the tile (all threads).
__device__ void load_tile(const PrefillParams& p, Tile& tile, int64_t s, int64_t g, int64_t t0, int64_t limit) {
  const int32_t* table = p.block_tables + s * p.max_pages;
  for (int idx = threadIdx.x; idx < kTokens * p.d; idx += kThreads) {
    const int j = idx / p.d, c = idx % p.d;
    const int64_t t = t0 + j;
    const int64_t phys = t < limit ? int64_t(table[t / p.page]) : -1;
    const bool ok = phys >= 0 && phys < p.P;
    float kv = 0.f, vv = 0.f;
    if (ok) {
      const int64_t slot = t % p.page;
      const int64_t nidx = norms_offset(phys, g, slot, p.Hkv, p.page);
      kv = p.k_centroids[get_code(p.k_codes + codes_offset(phys, g, slot, p.Hkv, p.page, p.kpb), c, p.k_bits)];
      vv = p.v_norms[nidx] *
           p.v_centroids[get_code(p.v_codes + codes_offset(phys, g, slot, p.Hkv, p.page, p.vpb), c, p.v_bits)];
      if (c == 0) tile.k_scale[j] = p.scale * p.k_norms[nidx];
    }
    if (c == 0) tile.valid[j] = ok;
    tile.k[j][c] = kv;
    tile.v[j][c] = vv;
  }
}

// The window's tokens [max(t0, paged), min(t0 + kTokens, limit)) of the tile (format.h: positions
// from paged_tokens on; entry t % W of window wid, -1: none), over what load_tile wrote there (its
// zeros, valid 0): the same (token, coordinate) per thread as load_tile, so no barrier between them.
// The rows hold norm * y already: k_scale = scale.
__device__ void load_window_tile(const PrefillParams& p, Tile& tile, int64_t g, int64_t t0, int64_t limit,
                                 int64_t paged, int64_t wid) {
  for (int idx = threadIdx.x; idx < kTokens * p.d; idx += kThreads) {
    const int j = idx / p.d, c = idx % p.d;
    const int64_t t = t0 + j;
    if (t < paged || t >= limit) continue;
    float kv = 0.f, vv = 0.f;
    if (wid >= 0) {
      const int64_t at = ((wid * p.Hkv + g) * p.W + t % p.W) * p.d + c;
      kv = __uint_as_float(uint32_t(p.k_window[at]) << 16);  // bf16 -> f32
      vv = __uint_as_float(uint32_t(p.v_window[at]) << 16);
      if (c == 0) tile.k_scale[j] = p.scale;
    }
    if (c == 0) tile.valid[j] = wid >= 0;
    tile.k[j][c] = kv;
    tile.v[j][c] = vv;
  }
}

// Rows [a, b) of sequence s, heads [h0, h0 + hc) of KV head g's group. VARIANTS: a sliding window or
// soft cap (sinks need no flag: they enter when a row is stored).
template <bool VARIANTS>
__device__ void attend_piece(const PrefillParams& p, Tile& tile, int64_t s, int64_t a, int64_t b, int64_t g,
                             int64_t h0, int hc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const PrefillRows rows = prefill_rows(p.query_start_loc, p.seq_lens, s, p.T, p.max_pages * p.page);
  const int pairs = int(b - a) * hc;
  float q[kPairsPerWarp][kSlots], o[kPairsPerWarp][kSlots], m[kPairsPerWarp], l[kPairsPerWarp];
  int64_t len[kPairsPerWarp];
  bool finite[kPairsPerWarp];
#pragma unroll
  for (int w = 0; w < kPairsPerWarp; ++w) {
    const int pair = warp + kWarps * w;
    const bool real = pair < pairs;
    const int64_t row = a + (real ? pair / hc : 0), head = h0 + (real ? pair % hc : 0);
    len[w] = real ? rows.causal_len(row) : 0;
    bool ok = true;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int c = lane + 32 * k;
      q[w][k] = real && c < p.d ? p.q[(row * p.H + head) * p.d + c] : 0.f;
      ok = ok && isfinite(q[w][k]);
      o[w][k] = 0.f;
    }
    finite[w] = __all_sync(0xffffffffu, ok);
    m[w] = -INFINITY;
    l[w] = 0.f;
  }
  const int64_t limit = rows.causal_len(b - 1);  // the piece's longest row
  // Window (W > 0): the sequence's tokens from `paged` (format.h paged_tokens) on are in window
  // `wid` (-1: none). W = 0: paged is the sequence's clamped length >= limit, every token paged.
  const int64_t paged = paged_tokens(p.seq_lens[s], p.max_pages * p.page, p.W);
  const int64_t page_limit = limit < paged ? limit : paged;
  for (int64_t t0 = VARIANTS ? first_seen_tile(p, rows.causal_len(a), kTokens) : 0; t0 < limit; t0 += kTokens) {
    __syncthreads();  // the previous tile (or piece) has been read
    load_tile(p, tile, s, g, t0, page_limit);
    if (p.W > 0 && t0 + kTokens > paged) {  // the tile reaches the window's positions
      const int64_t id = p.window_ids[s];
      load_window_tile(p, tile, g, t0, limit, paged, id >= 0 && id < p.num_windows ? id : -1);
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kPairsPerWarp; ++w) {
      for (int j = 0; j < kTokens; ++j) {
        if (t0 + j >= len[w] || (VARIANTS && !inside_window(p, t0 + j, len[w])) || !tile.valid[j]) continue;
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < kSlots; ++k)  // coordinates past d are not in the tile (stale shared memory)
          if (lane + 32 * k < p.d) dot = fmaf(q[w][k], tile.k[j][lane + 32 * k], dot);
        float score = warp_sum(dot) * tile.k_scale[j];  // the tests above are warp-uniform
        if (VARIANTS && p.soft_cap > 0.f) score = p.soft_cap * tanhf(score / p.soft_cap);
        if (!(score > -INFINITY)) continue;
        float weight;
        if (score > m[w]) {
          const float alpha = __expf(m[w] - score);  // 0 when m = -inf
          l[w] *= alpha;
#pragma unroll
          for (int k = 0; k < kSlots; ++k) o[w][k] *= alpha;
          m[w] = score;
          weight = 1.f;
        } else {
          weight = __expf(score - m[w]);
        }
        l[w] += weight;
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          if (lane + 32 * k < p.d) o[w][k] = fmaf(weight, tile.v[j][lane + 32 * k], o[w][k]);
      }
    }
  }
#pragma unroll
  for (int w = 0; w < kPairsPerWarp; ++w) {
    const int pair = warp + kWarps * w;
    if (pair >= pairs) continue;
    const int64_t row = a + pair / hc, head = h0 + pair % hc;
    float inv = l[w] > 0.f ? 1.f / l[w] : 0.f;
    if (p.sinks != nullptr && l[w] > 0.f) inv = inverse_with_sink(l[w], m[w], p.sinks[head], false);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int c = lane + 32 * k;
      if (c < p.d) p.out[(row * p.H + head) * p.d + c] = finite[w] ? o[w][k] * inv : NAN;
    }
  }
}

template <bool VARIANTS>
__global__ void __launch_bounds__(kThreads) paged_prefill_kernel(PrefillParams p) {
  __shared__ Tile tile;
  const CtaHeads heads = cta_heads(p);
  const int64_t tile_begin = int64_t(blockIdx.x) * p.rows_per_cta;
  const int64_t tile_end = tile_begin + p.rows_per_cta < p.T ? tile_begin + p.rows_per_cta : p.T;
  for_each_piece(p, tile_begin, tile_end, [&](int64_t s, const PrefillRows&, int64_t a, int64_t b) {
    attend_piece<VARIANTS>(p, tile, s, a, b, heads.g, heads.h0, heads.hc);
  });
}

ffi_checks::Op cuda_op() { return ffi_checks::Op{"jax_tq_paged_prefill", ffi_checks::kCudaTag}; }

ffi::Error launch_error(const char* what, cudaError_t e) {
  return cuda_op().internal(std::string(what) + ": " + cudaGetErrorString(e));
}

template <int D, int KB, int VB, bool VARIANTS>
ffi::Error launch_tensor_core(cudaStream_t stream, const PrefillParams& p, dim3 grid) {
  auto kernel = prefill_tc::prefill_tc_kernel<D, KB, VB, VARIANTS>;
  constexpr int smem = sizeof(prefill_tc::Smem<D>) + prefill_tc::kSmemAlign;
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return launch_error("tensor-core prefill shared memory attribute", e);
  kernel<<<grid, prefill_tc::kThreads, smem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return launch_error("tensor-core prefill launch", e);
  return ffi::Error::Success();
}

// The tensor-core kernel (head_dim 64 / 128): kRows / heads_per_cta tokens x heads_per_cta heads
// per CTA.
ffi::Error run_tensor_core(cudaStream_t stream, PrefillParams p, int64_t group) {
  p.heads_per_cta = int(group < prefill_tc::kRows ? group : prefill_tc::kRows);
  p.head_chunks = int((group + p.heads_per_cta - 1) / p.heads_per_cta);
  p.rows_per_cta = prefill_tc::kRows / p.heads_per_cta;
  const int64_t tiles = (p.T + p.rows_per_cta - 1) / p.rows_per_cta, heads = p.Hkv * p.head_chunks;
  if (tiles > 2147483647 || heads > 65535)
    return cuda_op().invalid("too many query rows or heads: T " + std::to_string(p.T) + ", KV heads x head chunks " +
                             std::to_string(heads));
  const dim3 grid{unsigned(tiles), unsigned(heads)};
  auto none = [] { return cuda_op().internal("tensor-core prefill: no kernel for these bits"); };
  auto by_bits = [&](auto d) {
    return with_value(PackedBits{}, p.k_bits, [&](auto kb) {
      return with_value(PackedBits{}, p.v_bits, [&](auto vb) {
        constexpr int D = decltype(d)::value, KB = decltype(kb)::value, VB = decltype(vb)::value;
        if (!has_masks(p)) return launch_tensor_core<D, KB, VB, false>(stream, p, grid);
        if constexpr (KB == VB) return launch_tensor_core<D, KB, VB, true>(stream, p, grid);
        else return cuda_op().internal("tensor-core prefill: a sliding window or soft cap needs K and V of one width");
      }, none);
    }, none);
  };
  return p.d == 128 ? by_bits(std::integral_constant<int, 128>{}) : by_bits(std::integral_constant<int, 64>{});
}

// head_dim 64 / 128; a sliding window or soft cap only with K and V of one width (the presets: fewer
// instantiations), else the CUDA-core kernel.
bool tensor_core_serves(const PrefillParams& p) {
  return (p.d == 64 || p.d == 128) && (!has_masks(p) || p.k_bits == p.v_bits);
}

void set_variants(const ffi_checks::Variants& variants, const ffi::Buffer<ffi::F32>& sinks, PrefillParams& p) {
  p.sliding_window = static_cast<int>(variants.sliding_window);
  p.soft_cap = variants.soft_cap_natural();
  p.soft_cap_log2 = variants.soft_cap_log2();
  p.sinks = variants.sinks ? sinks.typed_data() : nullptr;
}

}  // namespace

ffi::Error PagedPrefillCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                                ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                                ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                                ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::BF16> k_window,
                                ffi::Buffer<ffi::BF16> v_window, ffi::Buffer<ffi::S32> window_ids,
                                ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::F32> sinks,
                                ffi::Result<ffi::Buffer<ffi::F32>> out_rot, int32_t k_bits, int32_t v_bits,
                                float scale, bool f16_products, int32_t sliding_window, float soft_cap) {
  ffi_checks::PrefillDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_paged_prefill(cuda_op(), q_rot, k_codes, k_norms, v_codes, v_norms,
                                                         k_centroids, v_centroids, block_tables, seq_lens,
                                                         k_window, v_window, window_ids, query_start_loc,
                                                         *out_rot, k_bits, v_bits, &dims));
  ffi_checks::Variants variants;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_variants(cuda_op(), sinks, dims.H, sliding_window, soft_cap, &variants));
  const int64_t bytes = dims.T * dims.H * dims.d * int64_t(sizeof(float));
  if (bytes == 0) return ffi::Error::Success();
  if (cudaError_t e = cudaMemsetAsync(out_rot->typed_data(), 0, size_t(bytes), stream); e != cudaSuccess)
    return cuda_op().internal(std::string("memset: ") + cudaGetErrorString(e));
  if (dims.S == 0) return ffi::Error::Success();
  PrefillParams p{};
  p.q = q_rot.typed_data();
  p.k_codes = k_codes.typed_data();
  p.v_codes = v_codes.typed_data();
  p.k_norms = k_norms.typed_data();
  p.v_norms = v_norms.typed_data();
  p.k_centroids = k_centroids.typed_data();
  p.v_centroids = v_centroids.typed_data();
  p.block_tables = block_tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.query_start_loc = query_start_loc.typed_data();
  if (dims.win.on()) {
    p.k_window = static_cast<const uint16_t*>(k_window.untyped_data());
    p.v_window = static_cast<const uint16_t*>(v_window.untyped_data());
    p.window_ids = window_ids.typed_data();
    p.num_windows = dims.win.num_windows;
    p.W = dims.win.window;
  }  // else W = 0 (p is zero-initialized): no window
  p.out = out_rot->typed_data();
  p.T = dims.T, p.H = dims.H, p.S = dims.S, p.max_pages = dims.max_pages;
  p.P = dims.pools.P, p.Hkv = dims.pools.Hkv, p.page = dims.pools.page;
  p.d = int(dims.d), p.k_bits = k_bits, p.v_bits = v_bits, p.kpb = int(dims.pools.kpb), p.vpb = int(dims.pools.vpb);
  const int64_t group = dims.H / dims.pools.Hkv;
  p.heads_per_cta = int(group < kPairs ? group : kPairs);
  p.head_chunks = int((group + p.heads_per_cta - 1) / p.heads_per_cta);
  p.rows_per_cta = kPairs / p.heads_per_cta;
  p.scale = scale;
  set_variants(variants, sinks, p);
  if (f16_products && tensor_core_serves(p)) return run_tensor_core(stream, p, group);
  const int64_t tiles = (dims.T + p.rows_per_cta - 1) / p.rows_per_cta;
  const int64_t heads = dims.pools.Hkv * p.head_chunks;
  if (tiles > 2147483647 || heads > 65535)
    return cuda_op().invalid("too many query rows or heads: T " + std::to_string(dims.T) + ", KV heads x head chunks " +
                             std::to_string(heads));
  const dim3 grid{unsigned(tiles), unsigned(heads)};
  if (has_masks(p)) paged_prefill_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  else paged_prefill_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return cuda_op().internal(std::string("kernel launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedPrefillCuda, jax_tq::cuda::PagedPrefillCudaImpl,
                              jax_tq::ffi_checks::BindPagedPrefill(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
