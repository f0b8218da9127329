// The paged-decode planner: which kernel runs a decode call, with how many split-K parts, and
// whether it applies the Hadamard rotations itself. One function, plan_decode(), called by the CUDA
// handler at each launch and by jax_tq (through the modules' plan_decode()) when it traces a call, so
// the split count and the rotations chosen in Python are those of the kernel that runs.
// Host only, no CUDA: what the planner needs of a device comes in as DeviceCaps (the CUDA module asks
// the device; the CPU module takes a description, for tests of GPU plans on any machine).
#ifndef JAX_TQ_DECODE_PLAN_H_
#define JAX_TQ_DECODE_PLAN_H_

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "jax_tq/format.h"

namespace jax_tq {

// The kernel families (a family's variants are plan fields). Values are the "kernel" attribute of
// jax_tq_paged_decode and the index of kDecodeKernelNames.
enum class DecodeKernel : int32_t {
  kAuto = 0,           // the planner's choice (a request only)
  kCudaCore = 1,       // float32 CUDA-core math: every head_dim and width
  kTensorCoreF32 = 2,  // mma.sync with hi / lo float16 splits, float32-accurate: head_dim 64 / 128
  kTensorCoreF16 = 3,  // mma.sync on float16 products: head_dim 64 / 128, and 80 / 96 / 192 / 256 where its ring fits
  kCpu = 4,            // the C++ CPU kernel (float64)
};
inline constexpr const char* kDecodeKernelNames[] = {"auto", "cuda-core", "tensor-core-f32", "tensor-core-f16",
                                                     "cpu"};

// One decode call, as its shapes and attributes say (decode_problem_error: what makes it invalid).
struct DecodeProblem {
  int64_t num_seqs = 0, num_heads = 0, num_kv_heads = 1, head_dim = 0, max_pages = 0, page_size = 1;
  int k_bits = 4, v_bits = 4;
  bool f16_products = true;  // the caller allows float16 products (bf16 / f16 queries, precision not HIGHEST)
  bool window = false;       // the cache keeps a recent-token window
  bool hadamard = false;     // both codecs carry a Hadamard spec (the kernel may apply the rotations)
  int64_t num_splits = 0;    // the caller's split count, or 0: the planner's
  int alignment = 16;        // bytes every pool is aligned to (XLA's buffers: 16 or more)
  DecodeKernel kernel = DecodeKernel::kAuto;  // a requested family, used wherever it can run the call
  bool variants = false;     // a sliding window, logit soft cap or sinks: on CUDA the float16 tensor-core
                             // kernel where masks_fit, else the CUDA-core kernel serves them
};

// Why a problem cannot be planned (a kernel would refuse it), or "" when it can.
inline std::string decode_problem_error(const DecodeProblem& p) {
  constexpr int64_t kMax = (int64_t(1) << 31) - 1;
  if (p.num_seqs < 0 || p.num_seqs > kMax) return "num_seqs must be in [0, 2^31)";
  if (p.num_kv_heads < 1 || p.num_kv_heads > kMax) return "num_kv_heads must be in [1, 2^31)";
  if (p.num_heads < p.num_kv_heads || p.num_heads > kMax || p.num_heads % p.num_kv_heads != 0)
    return "num_heads must be a positive multiple of num_kv_heads (GQA)";
  if (!is_supported_head_dim(static_cast<int>(p.head_dim < 0 || p.head_dim > 1024 ? 0 : p.head_dim)))
    return "head_dim is not a supported head_dim (format.h SupportedHeadDims)";
  if (!is_supported_bits(p.k_bits) || !is_supported_bits(p.v_bits)) return "k_bits and v_bits must be 2, 3 or 4";
  if (p.page_size < 1 || p.page_size > kMax) return "page_size must be in [1, 2^31)";
  if (p.max_pages < 0 || p.max_pages > kMax) return "max_pages must be in [0, 2^31)";
  if (p.num_splits < 0 || p.num_splits > kMax) return "num_splits must be in [0, 2^31) (0: the planner's)";
  return "";
}

// What the planner needs of the device.
struct DeviceCaps {
  bool cuda = false;  // false: the CPU kernel
  int64_t sm_count = 1;
  int64_t f32_ctas_per_sm = 1;  // resident CTAs of the tensor-core float32-accurate kernel
  int64_t f16_ctas_per_sm = 1;  // of the float16 one (one work item per CTA)
  // Whether the float16 kernel's ring variant for (head_dim, head tile, K bits, V bits, halves,
  // work items per CTA) keeps its residency (f16_ctas_per_sm; one CTA of 16 warps with several
  // items) on the device; false where no such kernel is built.
  std::function<bool(int, int, int, int, int, int)> ring_fits;
};

struct DecodePlan {
  DecodeKernel kernel = DecodeKernel::kCpu;
  int head_tile = 1;        // query heads of one GQA group per CTA
  bool ring = false;        // float16 kernel: whole one-page tiles through a per-warp cp.async ring
  int halves = 1;           // float16 kernel: 2 = warp pairs, each half of the coordinates (head_dim 192 / 256)
  int items = 1;            // float16 kernel, head_dim 128 K4V4: work items per CTA of 16 warps
  bool folds_window = false;    // the window's tokens join the split kernel's tile loop (no window kernel)
  bool fused_rotation = false;  // the kernel computes q_rot = Pi_k q and out = Pi_v^T o_rot itself
  bool f16_rounding = false;    // products round q, p and the centroids to float16
  int64_t num_splits = 1;
};

// Each split streams at least this many tokens (and 4 pages), so that its prefetch has work to
// overlap and the combine stays cheap next to the split's own work.
inline constexpr int64_t kMinTokensPerSplit = 256;

// Query heads per CTA: the whole group up to 4, else 8 (4 from head_dim 192 on: warp pairs).
inline int decode_head_tile(int64_t group, int64_t head_dim) {
  if (group <= 1) return 1;
  if (group == 2) return 2;
  if (group <= 4) return 4;
  return head_dim >= 192 ? 4 : 8;
}

// Alignment (bytes) a code pool needs for the tensor-core kernels' per-lane loads of `lane_bytes`
// (a K lane: head_dim * bits / 32 bytes, a V lane: / 64): 3-bit codes are read as 4-byte words.
inline int code_alignment(int bits, int64_t lane_bytes) { return bits == 3 ? 4 : static_cast<int>(lane_bytes); }

inline int64_t gqa_group(const DecodeProblem& p) { return p.num_heads / p.num_kv_heads; }

// head_dim 64 / 128, K and V of any packed width, pools aligned to the per-lane loads.
inline bool tensor_core_fits(const DecodeProblem& p) {
  if ((p.head_dim != 64 && p.head_dim != 128) || !is_supported_bits(p.k_bits) || !is_supported_bits(p.v_bits))
    return false;
  return p.alignment % code_alignment(p.k_bits, p.head_dim * p.k_bits / 32) == 0 &&
         p.alignment % code_alignment(p.v_bits, p.head_dim * p.v_bits / 64) == 0;
}

inline bool ring_pools(const DecodeProblem& p) { return p.page_size % 16 == 0 && p.alignment % 16 == 0; }

// The float16 kernel's other head_dims run on its ring only: 80 / 96 (rows padded to 128), 192
// (K4V4) and 256 as warp pairs.
inline bool wide_fits(const DecodeProblem& p, const DeviceCaps& caps, int tile) {
  const int64_t d = p.head_dim;
  if ((d != 80 && d != 96 && d != 192 && d != 256) || !is_supported_bits(p.k_bits) ||
      !is_supported_bits(p.v_bits) || !ring_pools(p))
    return false;
  if (d == 192 && (p.k_bits != 4 || p.v_bits != 4)) return false;
  const int halves = d >= 192 ? 2 : 1;
  return caps.ring_fits && caps.ring_fits(static_cast<int>(d), tile <= 4 ? 4 : 8, p.k_bits, p.v_bits, halves, 1);
}

// Where the float16 kernel serves the attention variants (its MASKS variant): float16 products, its
// ring at head_dim 64 / 128, K and V of one width (the presets').
inline bool masks_fit(const DecodeProblem& p, const DeviceCaps& caps, int tile) {
  return p.f16_products && tensor_core_fits(p) && p.k_bits == p.v_bits && ring_pools(p) && caps.ring_fits &&
         caps.ring_fits(static_cast<int>(p.head_dim), tile <= 4 ? 4 : 8, p.k_bits, p.v_bits, 1, 1);
}

inline bool family_fits(DecodeKernel k, const DecodeProblem& p, const DeviceCaps& caps, int tile) {
  switch (k) {
    case DecodeKernel::kCudaCore: return true;
    case DecodeKernel::kTensorCoreF32: return tensor_core_fits(p);
    case DecodeKernel::kTensorCoreF16: return p.f16_products && (tensor_core_fits(p) || wide_fits(p, caps, tile));
    default: return false;
  }
}

// The split count whose units * splits CTAs best fill whole waves of `slots` resident CTAs (a last,
// partly filled wave leaves SMs idle), preferring fewer splits unless more fill clearly (>= 2 points)
// better; searched up to ~4 waves or max_splits. extra: CTAs per unit beside its splits' when there
// are several (a folded window's own CTA).
inline int64_t whole_wave_splits(int64_t units, int64_t slots, int64_t max_splits, int extra) {
  if (units < 1) units = 1;
  if (slots < 1) slots = 1;
  // 4 waves are reached by splits = 4 * slots / units + 1 at the latest: the search's bound
  const int64_t reach = 4 * slots / units + 1;
  const int64_t last = max_splits < 1 ? 1 : (max_splits < reach ? max_splits : reach);
  int64_t best = 1;
  double best_fill = 0.0;
  for (int64_t splits = 1; splits <= last; ++splits) {
    const double waves = static_cast<double>(units) * static_cast<double>(splits + (splits > 1 ? extra : 0)) /
                         static_cast<double>(slots);
    const double fill = waves / std::ceil(waves);
    if (fill > best_fill + 0.02) best = splits, best_fill = fill;
    if (waves >= 4) break;
  }
  return best;
}

// Split-K count on a GPU, at most one split per kMinTokensPerSplit tokens (and 4 pages):
// tensor-core kernels: the count whose (sequence, KV head, head tile, split) CTAs best fill whole
// waves of their resident CTAs; the CUDA-core kernel: one wave of 2 CTAs per SM for head tiles of 4
// or 8 query heads, 4 else.
inline int64_t auto_splits(const DecodeProblem& p, const DeviceCaps& caps, const DecodePlan& plan) {
  const int64_t min_pages = kMinTokensPerSplit / p.page_size > 4 ? kMinTokensPerSplit / p.page_size : 4;
  const int64_t by_length = p.max_pages / min_pages > 1 ? p.max_pages / min_pages : 1;
  const int64_t group = gqa_group(p);
  if (plan.kernel == DecodeKernel::kCudaCore) {
    const int64_t wanted = (plan.head_tile >= 4 ? 2 : 4) * caps.sm_count;
    const int64_t units = p.num_seqs * p.num_kv_heads * ((group + plan.head_tile - 1) / plan.head_tile);
    const int64_t by_occupancy = units > 0 ? (wanted + units - 1) / units : wanted;
    const int64_t splits = by_occupancy < by_length ? by_occupancy : by_length;
    return splits > 1 ? splits : 1;
  }
  const int64_t per_sm = plan.kernel == DecodeKernel::kTensorCoreF16 ? caps.f16_ctas_per_sm : caps.f32_ctas_per_sm;
  const int64_t tile = group <= 4 ? 4 : plan.head_tile;  // the tensor-core kernels pad smaller groups to 4
  const int64_t units = p.num_seqs * p.num_kv_heads * ((group + tile - 1) / tile);
  return whole_wave_splits(units > 1 ? units : 1, per_sm * caps.sm_count, by_length, plan.folds_window ? 1 : 0);
}

// Work items per CTA for the float16 kernel at head_dim 128, K4V4, head tiles of 4 (1: one item
// per CTA): of 2, 4 and 8 dividing the rows, the one with the fewest waves of one CTA per SM for
// the least work per SM (waves * items), ties to more items; else 2 where it divides and fits.
inline int choose_items(const DecodeProblem& p, const DeviceCaps& caps, const DecodePlan& plan) {
  if (p.head_dim != 128 || p.k_bits != 4 || p.v_bits != 4 || plan.head_tile > 4 || !plan.ring) return 1;
  const int64_t rows = p.num_kv_heads * ((gqa_group(p) + 3) / 4);
  const int64_t ctas_x = p.num_seqs * (plan.num_splits + (plan.folds_window && plan.num_splits > 1 ? 1 : 0));
  int best = 0;
  int64_t best_cost = 0;
  for (int items : {2, 4, 8}) {
    if (rows % items != 0) continue;
    const int64_t ctas = ctas_x * (rows / items);
    const int64_t waves = caps.sm_count > 0 ? (ctas + caps.sm_count - 1) / caps.sm_count : 1;
    if (best == 0 || waves * items <= best_cost) best = items, best_cost = waves * items;
  }
  for (int items : {best, 2})
    if (items > 1 && rows % items == 0 && caps.ring_fits && caps.ring_fits(128, 4, 4, 4, 1, items)) return items;
  return 1;
}

// The plan of one call (a problem decode_problem_error accepts). A requested family runs wherever it can run the call (the tensor-core
// float32-accurate kernel also serves calls that allow float16 products); the planner's choice elsewhere.
inline DecodePlan plan_decode(const DecodeProblem& p, const DeviceCaps& caps) {
  DecodePlan plan;
  plan.head_tile = decode_head_tile(gqa_group(p), p.head_dim);
  const int64_t max_splits = p.max_pages > 1 ? p.max_pages : 1;
  if (!caps.cuda) {
    plan.kernel = DecodeKernel::kCpu;
    plan.fused_rotation = p.hadamard && fused_rotation_head_dim(p.head_dim);
    plan.num_splits = p.num_splits > 0 ? (p.num_splits < max_splits ? p.num_splits : max_splits) : 1;
    return plan;
  }
  if (p.variants) {  // the float32-accurate tensor-core kernel does not serve them
    const bool f16 = p.kernel != DecodeKernel::kCudaCore && masks_fit(p, caps, plan.head_tile);
    plan.kernel = f16 ? DecodeKernel::kTensorCoreF16 : DecodeKernel::kCudaCore;
  } else if (p.kernel != DecodeKernel::kAuto && family_fits(p.kernel, p, caps, plan.head_tile)) {
    plan.kernel = p.kernel;
  } else if (family_fits(DecodeKernel::kTensorCoreF16, p, caps, plan.head_tile)) {
    plan.kernel = DecodeKernel::kTensorCoreF16;
  } else if (tensor_core_fits(p)) {
    plan.kernel = DecodeKernel::kTensorCoreF32;
  } else {
    plan.kernel = DecodeKernel::kCudaCore;
  }
  const bool tc = plan.kernel == DecodeKernel::kTensorCoreF32 || plan.kernel == DecodeKernel::kTensorCoreF16;
  const bool unpadded = p.head_dim == 64 || p.head_dim == 128;
  if (plan.kernel == DecodeKernel::kTensorCoreF16) {
    plan.f16_rounding = true;
    plan.halves = p.head_dim >= 192 ? 2 : 1;
    const int ring_tile = plan.head_tile <= 4 ? 4 : 8;
    plan.ring = !unpadded || (ring_pools(p) && caps.ring_fits &&
                              caps.ring_fits(static_cast<int>(p.head_dim), ring_tile, p.k_bits, p.v_bits, 1, 1));
    plan.folds_window = p.window && unpadded && p.alignment % 16 == 0;
  }
  plan.fused_rotation = p.hadamard && fused_rotation_head_dim(p.head_dim) && tc;
  plan.num_splits = p.num_splits > 0 ? (p.num_splits < max_splits ? p.num_splits : max_splits)
                                     : auto_splits(p, caps, plan);
  if (plan.kernel == DecodeKernel::kTensorCoreF16 && unpadded) plan.items = choose_items(p, caps, plan);
  return plan;
}

}  // namespace jax_tq

#endif  // JAX_TQ_DECODE_PLAN_H_
