// Device code shared by the paged-prefill kernels (paged_prefill.cu's CUDA-core kernel,
// prefill_tensor_core.cuh): the kernel parameters, the owner of a query row, the tokens a row sees.
#ifndef JAX_TQ_PREFILL_DEVICE_CUH_
#define JAX_TQ_PREFILL_DEVICE_CUH_

#include <cstdint>

#include "jax_tq/format.h"

namespace jax_tq {
namespace cuda {
namespace {

struct PrefillParams {
  const float* q;
  const uint8_t *k_codes, *v_codes;
  const float *k_norms, *v_norms, *k_centroids, *v_centroids;
  const int32_t *block_tables, *seq_lens, *query_start_loc;
  const uint16_t *k_window, *v_window;  // bf16 [num_windows, Hkv, W, d] (W = 0: no window)
  const int32_t* window_ids;            // [S]
  int64_t num_windows, W;
  float* out;
  int64_t T, H, S, max_pages, P, Hkv, page;
  int d, k_bits, v_bits, kpb, vpb;
  int heads_per_cta, rows_per_cta, head_chunks;
  float scale;
  // The attention variants (ffi_checks.h Variants): a row of causal length n sees tokens
  // [n - sliding_window, n) (0: all of [0, n)); logits l become soft_cap tanh(l / soft_cap) (0: none;
  // soft_cap_log2 is the same cap in log2 units, for base-2 logits); sinks [H] (nullptr: none) join
  // each row's softmax denominator.
  int sliding_window;
  float soft_cap, soft_cap_log2;
  const float* sinks;
};

// The first token of the tile (tiles of `tile` tokens from 0) that holds the first token any row of
// a piece sees, its shortest row's causal length being `shortest`: 0 without a sliding window.
__device__ __forceinline__ int64_t first_seen_tile(const PrefillParams& p, int64_t shortest, int tile) {
  const int64_t from = p.sliding_window > 0 ? shortest - p.sliding_window : 0;
  return from > 0 ? from / tile * tile : 0;
}

// Whether the call has a sliding window or soft cap (the kernels' VARIANTS instantiations).
__host__ __device__ __forceinline__ bool has_masks(const PrefillParams& p) {
  return p.sliding_window > 0 || p.soft_cap_log2 > 0.f;
}

// Whether a row of causal length n sees token t (t < n assumed: the causal mask is the caller's).
__device__ __forceinline__ bool inside_window(const PrefillParams& p, int64_t t, int64_t n) {
  return p.sliding_window <= 0 || t >= n - p.sliding_window;
}

// The sequence whose rows contain `row` (query_start_loc non-decreasing), or -1 for a row of none.
__device__ int64_t sequence_of(const PrefillParams& p, int64_t row) {
  int64_t lo = 0, hi = p.S - 1, found = -1;
  while (lo <= hi) {  // the last s with query_start_loc[s] <= row
    const int64_t mid = (lo + hi) / 2;
    if (p.query_start_loc[mid] <= row) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  if (found < 0) return -1;
  const PrefillRows rows = prefill_rows(p.query_start_loc, p.seq_lens, found, p.T, p.max_pages * p.page);
  return row >= rows.begin && row < rows.end ? found : -1;
}

// The window id of sequence s, or -1 where it has none (W = 0) or its id is outside [0, num_windows).
__device__ __forceinline__ int64_t window_of(const PrefillParams& p, int64_t s) {
  if (p.W == 0) return -1;
  const int64_t id = p.window_ids[s];
  return id >= 0 && id < p.num_windows ? id : -1;
}

// The query heads of this CTA: heads [h0, h0 + hc) of KV head g's group (blockIdx.y: KV head x
// head chunk).
struct CtaHeads {
  int64_t g, h0;
  int hc;
};

__device__ __forceinline__ CtaHeads cta_heads(const PrefillParams& p) {
  const int64_t g = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks, group = p.H / p.Hkv;
  const int64_t left = group - chunk * p.heads_per_cta;
  return CtaHeads{g, g * group + chunk * p.heads_per_cta, int(left < p.heads_per_cta ? left : p.heads_per_cta)};
}

// piece(s, rows, a, b) for each sequence piece [a, b) of the flattened rows [begin, end) (rows of
// no sequence are skipped: the memset zeroed them), in order.
template <class F>
__device__ __forceinline__ void for_each_piece(const PrefillParams& p, int64_t begin, int64_t end, F&& piece) {
  for (int64_t row = begin; row < end;) {
    const int64_t s = sequence_of(p, row);
    if (s < 0) {
      ++row;
      continue;
    }
    const PrefillRows rows = prefill_rows(p.query_start_loc, p.seq_lens, s, p.T, p.max_pages * p.page);
    const int64_t b = rows.end < end ? rows.end : end;
    piece(s, rows, row, b);
    row = b;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_PREFILL_DEVICE_CUH_
