// CUDA XLA FFI handler for jax_tq_paged_decode (see docs/DESIGN.md).
//
// The kernel, its variant and the split count come from plan_decode (jax_tq/decode_plan.h), the
// planner jax_tq also calls when it traces the call. Three kernel families:
//   CUDA-core (decode_cuda_core_kernel below): float32 math, every head_dim and width;
//   tensor-core float32-accurate (jax_tq/decode_tensor_core.cuh, v3::decode_tc_f32_kernel): hi / lo
//     float16 splits, head_dim 64 / 128, for calls that ask for float32-accurate products;
//   tensor-core float16 (v3::decode_tc_f16_kernel): 8 warps per CTA, tiles in registers or (where
//     it fits) in a per-warp cp.async ring, several work items per CTA at head_dim 128 K4V4; also
//     head_dim 80 / 96 (padded rows), 192 / 256 (warp pairs) on its ring.
// The attention variants: a sliding window or soft cap runs the float16 kernel's MASKS
// instantiations (ring, head_dim 64 / 128, K and V of one width) or the CUDA-core kernel, as the
// planner says; sinks make the split kernels write partials (a folded window then has a CTA of its
// own even at one split) and the combine adds them.
// The CUDA-core kernel's structure:
// Two launches on the stream, or one (one split, no window or a folded one), or three (a window the
// split kernel does not fold: the window-partial kernel first). A recent-token window (W > 0) is
// folded into the tensor-core v4 kernel's tile loop wherever v4 runs (head_dim 64 / 128, f16
// products): its tokens are tiles of bf16 rows in the same online softmax, read by split 0's CTA with
// one split and no sinks (whose output is final: no combine) or by a CTA of their own (split
// num_splits, writing the last partial) otherwise. Elsewhere:
//   0. window-partial kernel, one CTA per (sequence, KV head, chunk of query heads):
//      the window's tokens as one more partial, in slot num_splits of each head's partials.
//   1. split kernel, grid (num_splits * num_seqs, num_kv_heads * group_tiles), 128 threads.
//      One CTA = one (sequence, split, kv head, tile of up to GT query heads of the GQA group).
//      It streams its token range in chunks of kChunk tokens through a kStages-deep cp.async
//      ring in shared memory (K codes, K norms, V codes, V norms), decodes every K/V row ONCE and
//      uses it for all GT query heads, and keeps an fp32 online softmax (running max per head in
//      log2 units, rescaled) and the V accumulators in registers.
//        K phase: LPT lanes per token, each lane owns D/LPT contiguous coordinates of TPL tokens;
//                 centroid lookups from a 16-entry fp32 shared table (conflict-free), q of the
//                 group in shared memory (broadcast float4 reads), partial dots reduced with
//                 shuffles; the K norm is folded into the score.
//        softmax: one warp per head (chunk max, rescale factor, p, row sum); p * v_norm stored.
//        V phase: one lane per 8 coordinates of a token, acc[GT][8] in registers.
//      Writes (o / l, m + log l) per head into the workspace, or the final output when
//      num_splits == 1 and there is no window.
//   2. combine kernel (num_splits > 1, or a window the split kernel does not fold), one CTA per
//      (sequence, query head), a programmatic dependent launch of the split kernel (sm_90 on; its CTAs
//      wait for the split kernel's end at griddepcontrol.wait): log-sum-exp merge of the head's partials. With a window (W > 0) the
//      split kernels stream the pages' tokens [0, paged_tokens) only, the workspace holds
//      num_splits + 1 partials per (sequence, head) (pstride; the window's last) and the combine
//      merges those written (a folded window with one split writes none).
// Instantiations: head_dim (6) x GT (1, 2, 4, 8; 4 max at d=256) = 23 kernels; k_bits / v_bits are a
// uniform run-time switch inside the K and V phases (smem code rows sized for 4 bits), which keeps
// the build to ~1 min for sm_80 + sm_90. Copy loops use run-time row sizes (not unrolled).
// All pool address arithmetic is int64. Tokens >= seq_len and pages outside [0, num_pages) are
// never read. Empty splits write lse = -inf and are ignored by the combine; a row with no valid
// token is exactly 0.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "jax_tq/cuda_launch.h"
#include "jax_tq/decode_device.cuh"
#include "jax_tq/decode_plan.h"
#include "jax_tq/decode_tensor_core.cuh"
#include "jax_tq/dispatch.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// K phase: s[t][g] = kn_t * <q_g, c_k[codes_t]> (q pre-scaled: log2 units) for the kChunk tokens
// of one stage. LPT lanes per token, each lane owns DL contiguous coordinates of TPL tokens.
// ---------------------------------------------------------------------------------------------
template <int D, int GT, int KB>
__device__ __forceinline__ void k_phase(const uint8_t* kcs, const float* kns, const int* vals,
                                        const float* q_s, const float* kcent_s, float* s_s,
                                        int warp, int lane) {
  using Geo = KGeom<D>;
  constexpr int LPT = Geo::LPT, DL = Geo::DL, TPW = Geo::TPW, TPL = Geo::TPL;
  constexpr int QROW = Geo::QROW;
  constexpr int KROW = Layout<D, GT>::KROW;
  constexpr int KL = DL * KB / 8;  // bytes per lane
  constexpr int NWK = (KL + 3) / 4;
  const int kj = lane % LPT;     // coordinate slice
  const int kslot = lane / LPT;  // token slot in the warp

  uint32_t kw[TPL][NWK];
#pragma unroll
  for (int tt = 0; tt < TPL; ++tt) {
    const int t = tt * (kWarps * TPW) + warp * TPW + kslot;
    load_bytes<KL>(kcs + t * KROW + kj * KL, kw[tt]);
  }
  float acc[GT][TPL];
#pragma unroll
  for (int g = 0; g < GT; ++g)
#pragma unroll
    for (int tt = 0; tt < TPL; ++tt) acc[g][tt] = 0.f;
  const float* qlane = q_s + kj * QROW;
#pragma unroll
  for (int i4 = 0; i4 < DL / 4; ++i4) {
    float cv[4][TPL];
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int tt = 0; tt < TPL; ++tt)
        cv[e][tt] = table_at(kcent_s, code_off4<KB>(kw[tt], i4 * 4 + e));
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      const float4 qv = *reinterpret_cast<const float4*>(qlane + g * LPT * QROW + i4 * 4);
#pragma unroll
      for (int tt = 0; tt < TPL; ++tt) {
        float a = acc[g][tt];
        a = fmaf(qv.x, cv[0][tt], a);
        a = fmaf(qv.y, cv[1][tt], a);
        a = fmaf(qv.z, cv[2][tt], a);
        a = fmaf(qv.w, cv[3][tt], a);
        acc[g][tt] = a;
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < TPL; ++tt) {
    const int t = tt * (kWarps * TPW) + warp * TPW + kslot;
    const bool ok = vals[t] != 0;
    const float kn = kns[t];
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float v = acc[g][tt];
#pragma unroll
      for (int o = LPT / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      float sc = v * kn;
      if (!ok || !(sc > -INFINITY)) sc = -INFINITY;  // invalid token or NaN: no weight
      if ((g % LPT) == kj) s_s[t * GT + g] = sc;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// V phase: acc[g][e] += w[t][g] * c_v[code_t(8 * seg + e)], one lane per 8 coordinates.
// ---------------------------------------------------------------------------------------------
template <int D, int GT, int VB>
__device__ __forceinline__ void v_phase(const uint8_t* vcs, const int* vals, const float* w_s,
                                        const float* vcent_s, float (&acc_v)[GT][8], int warp,
                                        int lane) {
  using Geo = KGeom<D>;
  constexpr int SPT = Geo::SPT, TPWV = Geo::TPWV, VPASS = Geo::VPASS;
  constexpr int VROW = Layout<D, GT>::VROW;
  const int vseg = lane % SPT;
  const int vslot = lane / SPT;
  if (vslot >= TPWV) return;
  for (int t = warp * TPWV + vslot; t < kChunk; t += VPASS) {
    if (vals[t] == 0) continue;
    uint32_t vw[(VB + 3) / 4];
    load_bytes<VB>(vcs + t * VROW + vseg * VB, vw);
    float wv[GT];
    if constexpr (GT % 4 == 0) {
#pragma unroll
      for (int g4 = 0; g4 < GT / 4; ++g4) {
        const float4 x = *reinterpret_cast<const float4*>(w_s + t * GT + 4 * g4);
        wv[4 * g4 + 0] = x.x;
        wv[4 * g4 + 1] = x.y;
        wv[4 * g4 + 2] = x.z;
        wv[4 * g4 + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int g = 0; g < GT; ++g) wv[g] = w_s[t * GT + g];
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float cv = table_at(vcent_s, code_off4<VB>(vw, e));
#pragma unroll
      for (int g = 0; g < GT; ++g) acc_v[g][e] = fmaf(wv[g], cv, acc_v[g][e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The CUDA-core split kernel's phases.
// ---------------------------------------------------------------------------------------------
// The tile's q rows (pre-scaled, log2 units) in q_s's K-phase layout, bad_s (1: the head's q_rot row
// is not all finite, a NaN output row), and the output accumulator o_s zeroed.
template <int D, int GT>
__device__ __forceinline__ void stage_query_tile(const DecodeParams& p, int seq, int kvh, int tile, float* q_s,
                                                 float* o_s, int* bad_s, int tid) {
  using Geo = KGeom<D>;
  if (tid < GT) bad_s[tid] = 0;
  __syncthreads();
  for (int idx = tid; idx < GT * D; idx += kThreads) {
    const int g = idx / D;
    const int dd = idx - g * D;
    const int hl = tile * GT + g;
    float v = 0.f;
    if (hl < p.G) {
      const int h = kvh * p.G + hl;
      const float x = p.q[(static_cast<int64_t>(seq) * p.H + h) * D + dd];
      if (!isfinite(x)) bad_s[g] = 1;
      v = x * p.qscale;
    }
    q_s[(g * Geo::LPT + dd / Geo::DL) * Geo::QROW + (dd % Geo::DL)] = v;
    o_s[idx] = 0.f;
  }
}

// Online softmax of one chunk's scores s_s [kChunk][GT], one warp per head (state m_r, l_r
// replicated in its lanes): the V weights p * v_norm to w_s, each head's rescale factor to alpha_s.
template <int GT, int GPW>
__device__ __forceinline__ void softmax_update(const float* s_s, const float* vns, float (&m_r)[GPW],
                                               float (&l_r)[GPW], float* w_s, float* alpha_s, int warp, int lane) {
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi) {
    const int g = warp + gi * kWarps;
    if (g < GT) {
      const float s0 = s_s[lane * GT + g];
      const float s1 = s_s[(lane + 32) * GT + g];
      const float cmax = warp_max(fmaxf(s0, s1));
      const float m_new = fmaxf(m_r[gi], cmax);
      float alpha, p0, p1;
      if (m_new == -INFINITY) {
        alpha = 1.f;
        p0 = 0.f;
        p1 = 0.f;
      } else {
        alpha = fast_exp2(m_r[gi] - m_new);  // m_r = -inf -> 0
        p0 = fast_exp2(s0 - m_new);          // s = -inf -> 0
        p1 = fast_exp2(s1 - m_new);
      }
      const float psum = warp_sum(p0 + p1);
      l_r[gi] = l_r[gi] * alpha + psum;
      m_r[gi] = m_new;
      w_s[lane * GT + g] = p0 > 0.f ? p0 * vns[lane] : 0.f;
      w_s[(lane + 32) * GT + g] = p1 > 0.f ? p1 * vns[lane + 32] : 0.f;
      if (lane == 0) alpha_s[g] = alpha;
    }
  }
}

// The V accumulators (8 coordinates of segment lane % SPT per lane) summed over token slots and
// warps into o_s.
template <int D, int GT>
__device__ __forceinline__ void reduce_v_accumulators(float (&acc_v)[GT][8], float* o_s, int warp, int lane) {
  using Geo = KGeom<D>;
  constexpr int SPT = Geo::SPT, TPWV = Geo::TPWV, VPASS = Geo::VPASS;
  const int vseg = lane % SPT;
  const int vslot = lane / SPT;
  const bool vactive = vslot < TPWV;
  if constexpr (Geo::kPow2Spt) {
    // Lanes with the same segment differ only in the bits above log2(SPT).
#pragma unroll
    for (int off = SPT; off < 32; off <<= 1)
#pragma unroll
      for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc_v[g][e] += __shfl_xor_sync(0xffffffffu, acc_v[g][e], off);
    for (int r = 0; r < kWarps; ++r) {
      __syncthreads();
      if (warp == r && vslot == 0) {
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < 8; ++e) o_s[g * D + vseg * 8 + e] += acc_v[g][e];
      }
    }
  } else {
    for (int r = 0; r < VPASS; ++r) {
      __syncthreads();
      if (vactive && warp * TPWV + vslot == r) {
#pragma unroll
        for (int g = 0; g < GT; ++g)
#pragma unroll
          for (int e = 0; e < 8; ++e) o_s[g * D + vseg * 8 + e] += acc_v[g][e];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The CUDA-core split kernel.
// ---------------------------------------------------------------------------------------------
template <int D, int GT>
__global__ void __launch_bounds__(kThreads)
    decode_cuda_core_kernel(const DecodeParams p) {
  using L = Layout<D, GT>;
  constexpr int GPW = (GT + kWarps - 1) / kWarps;  // heads per warp in the softmax phase
  static_assert(kChunk == 64, "softmax phase assumes two tokens per lane");

  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float kcent_s[16];
  __shared__ float vcent_s[16];
  uint8_t* kc_s = smem + L::kc_off;
  uint8_t* vc_s = smem + L::vc_off;
  float* kn_s = reinterpret_cast<float*>(smem + L::kn_off);
  float* vn_s = reinterpret_cast<float*>(smem + L::vn_off);
  int* valid_s = reinterpret_cast<int*>(smem + L::valid_off);
  float* q_s = reinterpret_cast<float*>(smem + L::q_off);
  float* s_s = reinterpret_cast<float*>(smem + L::s_off);
  float* w_s = reinterpret_cast<float*>(smem + L::w_off);
  float* alpha_s = reinterpret_cast<float*>(smem + L::alpha_off);
  float* ml_s = reinterpret_cast<float*>(smem + L::ml_off);
  float* o_s = reinterpret_cast<float*>(smem + L::o_off);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int ns = p.num_splits;
  const int seq = blockIdx.x / ns;
  const int split = blockIdx.x - seq * ns;
  const int kvh = blockIdx.y / p.ntiles;
  const int tile = blockIdx.y - kvh * p.ntiles;
  const int kb = p.k_bits, vb = p.v_bits;

  // ---- token range of this split ------------------------------------------------------------
  // A sliding window: the splits share the pages from lo's on (lo = the first visible token; those
  // before it are never read): format.h visible_split_range's ranges, in 32 bits (its 64-bit
  // arithmetic costs this kernel 8-16 registers).
  const int lo = visible_from(p, p.sl[seq]);
  const int lo_page = static_cast<int>(p.pdiv.div(static_cast<uint32_t>(lo)));
  const int base = lo_page * p.page_size;
  const SplitRange range = split_range(paged_len(p, p.sl[seq]) - base, p.max_pages - lo_page, p.page_size, ns, split);
  const int tok0 = base + static_cast<int>(range.tok_begin) > lo ? base + static_cast<int>(range.tok_begin) : lo;
  const int tok_end = base + static_cast<int>(range.tok_end);
  const int ntok = tok_end > tok0 ? tok_end - tok0 : 0;
  const int nchunks = (ntok + kChunk - 1) / kChunk;
  const int32_t* bt_seq = p.bt + static_cast<int64_t>(seq) * p.max_pages;

  // ---- prologue: q (pre-scaled, log2 units), centroids, zero the output accumulator ----------
  __shared__ int bad_s[GT];  // 1: the head's q_rot row is not all finite (a NaN output row)
  stage_query_tile<D, GT>(p, seq, kvh, tile, q_s, o_s, bad_s, tid);
  if (tid < 16) {
    kcent_s[tid] = tid < (1 << kb) ? p.kcent[tid] : 0.f;
    vcent_s[tid] = tid < (1 << vb) ? p.vcent[tid] : 0.f;
  }

  auto issue = [&](int c, int st) {
    const int ctok0 = tok0 + c * kChunk;
    copy_code_rows<L::KROW>(kc_s + st * kChunk * L::KROW, p.kc, p.kcopy, p, bt_seq, ctok0,
                            tok_end, kvh);
    copy_code_rows<L::VROW>(vc_s + st * kChunk * L::VROW, p.vc, p.vcopy, p, bt_seq, ctok0,
                            tok_end, kvh);
    if (tid < kChunk) {
      const int64_t row = token_row(p, bt_seq, ctok0 + tid, tok_end, kvh);
      valid_s[st * kChunk + tid] = row >= 0 ? 1 : 0;
      if (row >= 0) {
        cp_async<4>(kn_s + st * kChunk + tid, p.kn + row);
        cp_async<4>(vn_s + st * kChunk + tid, p.vn + row);
      }
    }
  };

  // Softmax state (owned by warp g % kWarps, replicated in its lanes).
  float m_r[GPW], l_r[GPW];
#pragma unroll
  for (int i = 0; i < GPW; ++i) {
    m_r[i] = -INFINITY;
    l_r[i] = 0.f;
  }
  float acc_v[GT][8];
#pragma unroll
  for (int g = 0; g < GT; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc_v[g][e] = 0.f;

#pragma unroll 1
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) issue(s, s);
    cp_async_commit();
  }

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; everyone is done with chunk c - 1
    {
      const int cn = c + kStages - 1;
      if (cn < nchunks) issue(cn, cn % kStages);
      cp_async_commit();
    }
    const int st = c % kStages;
    const uint8_t* kcs = kc_s + st * kChunk * L::KROW;
    const uint8_t* vcs = vc_s + st * kChunk * L::VROW;
    const float* kns = kn_s + st * kChunk;
    const float* vns = vn_s + st * kChunk;
    const int* vals = valid_s + st * kChunk;

    if (kb == 4) {
      k_phase<D, GT, 4>(kcs, kns, vals, q_s, kcent_s, s_s, warp, lane);
    } else if (kb == 3) {
      k_phase<D, GT, 3>(kcs, kns, vals, q_s, kcent_s, s_s, warp, lane);
    } else {
      k_phase<D, GT, 2>(kcs, kns, vals, q_s, kcent_s, s_s, warp, lane);
    }
    __syncthreads();
    if (p.soft_cap_log2 > 0.f) {  // CTA-uniform
      for (int i = tid; i < kChunk * GT; i += kThreads) s_s[i] = soft_capped(s_s[i], p.soft_cap_log2);
      __syncthreads();
    }

    softmax_update<GT, GPW>(s_s, vns, m_r, l_r, w_s, alpha_s, warp, lane);
    __syncthreads();

    // ---- V phase --------------------------------------------------------------------------------
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      const float a = alpha_s[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc_v[g][e] *= a;
    }
    if (vb == 4) {
      v_phase<D, GT, 4>(vcs, vals, w_s, vcent_s, acc_v, warp, lane);
    } else if (vb == 3) {
      v_phase<D, GT, 3>(vcs, vals, w_s, vcent_s, acc_v, warp, lane);
    } else {
      v_phase<D, GT, 2>(vcs, vals, w_s, vcent_s, acc_v, warp, lane);
    }
  }
  cp_async_wait<0>();

  reduce_v_accumulators<D, GT>(acc_v, o_s, warp, lane);
  // Softmax state to smem.
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi) {
    const int g = warp + gi * kWarps;
    if (g < GT && lane == 0) {
      ml_s[g] = m_r[gi];
      ml_s[GT + g] = l_r[gi];
    }
  }
  __syncthreads();

  // ---- write partials (or the final output when there is a single split) ---------------------
  for (int idx = tid; idx < GT * D; idx += kThreads) {
    const int g = idx / D;
    const int dd = idx - g * D;
    const int hl = tile * GT + g;
    if (hl >= p.G) continue;
    store_head_output<D>(p, seq, kvh * p.G + hl, split, dd, ml_s[g], ml_s[GT + g], o_s[idx], bad_s[g] != 0);
  }
}


// ---------------------------------------------------------------------------------------------
// Combine kernel: one CTA of kCombineThreads per (seq, head), launched as a programmatic dependent
// of the split kernel (its CTAs start while the split kernel's last ones run, and wait for its end
// at pdl_wait). Warp g takes the splits g, g + kCombineGroups, ...: their lse and partial rows in
// one batch of independent loads (one memory latency, not one per split, nor one for the lse and
// another for the rows), merged with a running max of its own (online softmax); then the warps'
// (max, sum, row) states are merged through shared memory.
// ---------------------------------------------------------------------------------------------
constexpr int kCombineThreads = 256;
constexpr int kCombineGroups = kCombineThreads / 32;
constexpr int kCombineBatch = 8;   // splits per warp loaded at once: 64 splits in one pass
constexpr int kCombineMaxD = 256;  // the largest head_dim the handlers accept
constexpr int kCombineCols = kCombineMaxD / 4 / 32;  // float4 columns per lane at most

// The combine's fused epilogue (warp 0): the lane's 32 N coordinates of the merged row (each
// warp's row acc_s[g] weighted by f[g], over wsum), rotated back by Pi_v^T and stored.
template <int N>
__device__ __forceinline__ void combine_rotate_store(const float4 (&acc_s)[kCombineGroups][kCombineMaxD / 4],
                                                     const float (&f)[kCombineGroups], float wsum,
                                                     const int32_t* rot_v, float* buf, float* o, int lane) {
  const float* acc = reinterpret_cast<const float*>(&acc_s[0][0]);
  float x[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int d = N * lane + j;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < kCombineGroups; ++g) sum = f[g] != 0.f ? fmaf(f[g], acc[g * kCombineMaxD + d], sum) : sum;
    x[j] = sum / wsum;
  }
  rotate_row_inverse(x, rot_v, buf, lane);
  store_lane_coords(o, lane, x);
}

__global__ void __launch_bounds__(kCombineThreads, 1)
    paged_decode_combine_kernel(const float* __restrict__ pout, const float* __restrict__ plse,
                                float* __restrict__ out, int ns, int D, const int32_t* rot_v,
                                const float* __restrict__ sinks, int H) {
  __shared__ float m_s[kCombineGroups], l_s[kCombineGroups];
  __shared__ __align__(16) float4 acc_s[kCombineGroups][kCombineMaxD / 4];
  __shared__ __align__(16) float buf[kCombineMaxD];
  const int64_t sh = blockIdx.x;
  const int group = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cols = D / 4;  // float4 columns of a row (head_dim is a multiple of 16)
  const float* lse = plse + sh * ns;
  const float* po = pout + sh * ns * D;
  float* o = out + sh * D;
  // A sink (natural log units, as lse): one more term of the denominator only (sinks are an input,
  // not the split kernel's: read before the wait).
  const float sink = sinks != nullptr ? sinks[sh % H] : -INFINITY;
  pdl_wait();
  float m = -INFINITY, l = 0.f;
  float4 a[kCombineCols];
#pragma unroll
  for (int c = 0; c < kCombineCols; ++c) a[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = group; s0 < ns; s0 += kCombineGroups * kCombineBatch) {
    float ls[kCombineBatch];
    float4 v[kCombineBatch][kCombineCols];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int s = s0 + b * kCombineGroups;
      ls[b] = s < ns ? __ldcg(lse + s) : -INFINITY;  // (through L2: written by the grid before)
#pragma unroll
      for (int c = 0; c < kCombineCols; ++c) {
        const int col = lane + 32 * c;
        v[b][c] = s < ns && col < cols ? __ldcg(reinterpret_cast<const float4*>(po + static_cast<int64_t>(s) * D) + col)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    float mb = m;
    bool nan_lse = false;  // (a window partial's lse may be NaN: its row then is NaN, as any split's weight)
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) mb = fmaxf(mb, ls[b]), nan_lse |= ls[b] != ls[b];
    if (mb == -INFINITY) {  // no split of this batch or before it has a token
      if (nan_lse) m = NAN;  // (fmaxf skips NaN): the warp's weight below is NaN
      continue;
    }
    const float f = expf(m - mb);   // 0 where m = -inf; NaN where both are +inf (a NaN row)
    l *= f;
#pragma unroll
    for (int c = 0; c < kCombineCols; ++c) a[c] = make_float4(a[c].x * f, a[c].y * f, a[c].z * f, a[c].w * f);
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float w = ls[b] == -INFINITY ? 0.f : expf(ls[b] - mb);
      if (w == 0.f) continue;  // an empty split's partial row is never written: skipped, not scaled by 0
      l += w;
#pragma unroll
      for (int c = 0; c < kCombineCols; ++c) {
        a[c].x = fmaf(w, v[b][c].x, a[c].x);
        a[c].y = fmaf(w, v[b][c].y, a[c].y);
        a[c].z = fmaf(w, v[b][c].z, a[c].z);
        a[c].w = fmaf(w, v[b][c].w, a[c].w);
      }
    }
    m = mb;
  }
  if (lane == 0) m_s[group] = m, l_s[group] = l;
#pragma unroll
  for (int c = 0; c < kCombineCols; ++c)
    if (lane + 32 * c < cols) acc_s[group][lane + 32 * c] = a[c];
  __syncthreads();
  // The weights are taken against top = max(lse max, sink), as the CPU handler does: a NaN or +inf
  // sink gives a NaN row; every lse -inf: a row of 0.
  float gmax = m_s[0];
#pragma unroll
  for (int g = 1; g < kCombineGroups; ++g) gmax = fmaxf(gmax, m_s[g]);
  if (gmax == -INFINITY) {
    for (int d = threadIdx.x; d < D; d += kCombineThreads) o[d] = 0.f;
    return;
  }
  const float top = sink != sink ? sink : fmaxf(gmax, sink);
  float f[kCombineGroups], wsum = 0.f;
#pragma unroll
  for (int g = 0; g < kCombineGroups; ++g) {
    f[g] = m_s[g] == -INFINITY ? 0.f : expf(m_s[g] - top);  // NaN where both are +inf
    wsum = f[g] != 0.f ? fmaf(f[g], l_s[g], wsum) : wsum;  // > 0 (or NaN): the max term has weight 1
  }
  if (sinks != nullptr) wsum += expf(sink - top);  // exp(-inf) = 0; NaN stays NaN
  if (rot_v == nullptr) {
    const float* acc = reinterpret_cast<const float*>(&acc_s[0][0]);
    for (int d = threadIdx.x; d < D; d += kCombineThreads) {
      float sum = 0.f;
#pragma unroll
      for (int g = 0; g < kCombineGroups; ++g) sum = f[g] != 0.f ? fmaf(f[g], acc[g * kCombineMaxD + d], sum) : sum;
      o[d] = sum / wsum;
    }
    return;
  }
  // The fused rotation (D = 64 / 128): warp 0 rotates the combined row back, out = Pi_v^T o_rot.
  if (threadIdx.x < 32) {
    if (D == 128) combine_rotate_store<4>(acc_s, f, wsum, rot_v, buf, o, lane);
    else combine_rotate_store<2>(acc_s, f, wsum, rot_v, buf, o, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Window-partial kernel (a recent-token window, W > 0; launched before the split kernel, which it
// does not depend on): one CTA of kCombineThreads per (sequence, KV head, chunk of up to p.hc <=
// win_heads<D>() query heads of its group), so that the chunk's heads share every window row it
// reads. Sequence s of clamped length L reads positions [P0, L), P0 = paged_tokens(L) (format.h),
// from entries p % W of window window_ids[s] (none for an id outside [0, num_windows)):
// score = scale * <q_rot, K row>, value = the V row (bf16 rows of the rotated vectors), and writes
// their softmax state as one more partial, in slot ns (after the splits') of each head's pstride
// = ns + 1 partials, in the split kernels' form, which the combine kernel merges with the splits':
//   1. warp g stages head g's q row (rotated by Pi_k first where the rotation is fused) times
//      scale * log2(e); a row that is not all finite is flagged. Warp w's first batch of window
//      rows is loaded before, so that its latency overlaps the q staging;
//   2. warp w takes the window tokens w, w + 8, w + 16, ... in batches of TB (their K and V rows
//      loaded at once: lane l holds the bf16 pairs l + 32 i of a row), scores each for every head (a
//      warp sum) and keeps an online softmax (m in log2 units, l, o) per head;
//   3. lane 0 of warp g merges head g's window state over the warps: lse = (m + log2 l) ln 2 (natural log, as
//      the split kernels write it), -inf where the head has no window token (its partial output is
//      then not written: the combine skips it), +inf where its q row is not all finite;
//   4. thread (g, c) writes o / l (in V's rotated space), NaN for a non-finite q row (with the
//      splits' +inf lse the combine turns the row into NaN).
// ---------------------------------------------------------------------------------------------
struct WindowPartialParams {
  const float* q;        // [S, H, D]: q_rot, or q where the rotation is fused (rot)
  float* pout;           // [S, H, pstride, D]: slot ns written
  float* plse;           // [S, H, pstride]: slot ns written
  const uint32_t* kwin;  // [num_windows, Hkv, W, D] bf16, read as pairs (coordinates 2i, 2i + 1)
  const uint32_t* vwin;  // [num_windows, Hkv, W, D] bf16
  const int32_t* sl;     // [S]
  const int32_t* ids;    // [S] window ids
  const int32_t* rot;    // [2][D] Hadamard spec words (K, V), or nullptr
  int64_t capacity;      // max_pages * page_size
  int H, Hkv, G, ns, pstride, window, num_windows;
  int hc;                // query heads per CTA, 1 <= hc <= win_heads<D>()
  int chunks;            // CTAs per (sequence, KV head): ceil(G / hc)
  float qscale;          // scale * log2(e)
  int sliding_window;    // DecodeParams': positions before L - sliding_window are not read (0: none)
  float soft_cap_log2;   // DecodeParams': the logit soft cap in log2 units (0: none)
};

// Query heads per window-partial CTA at most (its per-warp window outputs o_s: 16 KB at head_dim
// 128). 4, not 8: at d 128 the kernel then needs 127 registers (sm_90, no spills) instead of 157,
// so two CTAs fit per SM; a group of 8 takes two CTAs, each reading the window rows (32 KB per
// (sequence, KV head) at W 64), the second mostly from L2.
template <int D>
constexpr int win_heads() { return 4; }


// Head g's window state over the NW warps' (m, l): its max mw and sum lw (>= 1 where mw is finite:
// the warp holding the max has a term 2^0).
template <int NW, int HC>
__device__ __forceinline__ void merge_window_state(const float (&m_s)[NW][HC], const float (&l_s)[NW][HC], int g,
                                                   float& mw_out, float& lw_out) {
  float mw = -INFINITY;
#pragma unroll
  for (int w = 0; w < NW; ++w) mw = fmaxf(mw, m_s[w][g]);
  float lw = 0.f;
  if (mw > -INFINITY) {
#pragma unroll
    for (int w = 0; w < NW; ++w) lw = fmaf(l_s[w][g], fast_exp2(m_s[w][g] - mw), lw);  // m = -inf -> 0
  }
  mw_out = mw;
  lw_out = lw;
}

template <int D>
__global__ void __launch_bounds__(kCombineThreads)
    paged_decode_window_partial_kernel(const WindowPartialParams p) {
  constexpr int HC = win_heads<D>();
  constexpr int NW = kCombineThreads / 32;  // warps
  constexpr int NP = (D / 2 + 31) / 32;     // bf16 pairs of a row per lane: pair lane + 32 i
  constexpr int TB = NP <= 2 ? 8 : 4;       // tokens per warp per batch (their rows in registers)
  static_assert(HC <= NW, "one head per warp in the prologue and the merge");
  static_assert(D % 2 == 0, "bf16 pairs");
  __shared__ __align__(16) float q_s[HC][D];  // q rows (log2 units)
  __shared__ __align__(16) float o_s[NW][HC * D];  // each warp's window output per head (rotation buffer first)
  __shared__ float m_s[NW][HC];
  __shared__ float l_s[NW][HC];
  __shared__ float mw_s[HC], lw_s[HC];
  __shared__ int bad_s[HC];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int chunk = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.chunks));
  const int sk = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.chunks));  // seq * Hkv + kvh
  const int seq = sk / p.Hkv;
  const int kvh = sk - seq * p.Hkv;
  const int g0 = chunk * p.hc;
  const int gn = p.G - g0 < p.hc ? p.G - g0 : p.hc;  // query heads of this CTA (1 <= gn <= HC)
  const int64_t row0 = static_cast<int64_t>(seq) * p.H + kvh * p.G + g0;  // (seq, first head) row of q
  const bool fused = fused_rotation_head_dim(D) && p.rot != nullptr;

  // The window's tokens: positions [P0, L), P0 raised to L - sliding_window where that is later.
  const int seq_len = p.sl[seq];
  const int wid = p.ids[seq];
  const int64_t L = clamp_len(seq_len, p.capacity);
  int64_t P0 = paged_tokens(seq_len, p.capacity, p.window);
  if (p.sliding_window > 0 && L - p.sliding_window > P0) P0 = L - p.sliding_window;  // the visible ones only
  const int nw = wid >= 0 && wid < p.num_windows ? static_cast<int>(L - P0) : 0;
  const int64_t win_rows = (static_cast<int64_t>(wid) * p.Hkv + kvh) * p.window;  // entry 0 of (wid, kvh)

  // The K and V rows of the warp's window tokens base + NW * tt (zeros past the window's tokens).
  uint32_t kr[TB][NP], vr[TB][NP];
  auto load_batch = [&](int base) {
#pragma unroll
    for (int tt = 0; tt < TB; ++tt) {
      const int j = base + NW * tt;
      const int64_t e = j < nw ? (P0 + j) % p.window : -1;  // ring entry of position P0 + j
      const uint32_t* kp = p.kwin + (win_rows + e) * (D / 2);
      const uint32_t* vp = p.vwin + (win_rows + e) * (D / 2);
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int c2 = lane + 32 * i;
        const bool ok = e >= 0 && (D / 2 % 32 == 0 || c2 < D / 2);
        kr[tt][i] = ok ? __ldg(kp + c2) : 0u;
        vr[tt][i] = ok ? __ldg(vp + c2) : 0u;
      }
    }
  };
  load_batch(warp);  // the first batch, in flight during the q staging

  // ---- 1. q rows ------------------------------------------------------------------------------
  if (warp < gn) {
    const int g = warp;
    const float* src = p.q + (row0 + g) * D;
    bool finite = true;
    if constexpr (fused_rotation_head_dim(D)) {
      if (fused) {
        constexpr int N = D / 32;
        float x[N];
        load_lane_coords(src, lane, x);
        uint32_t w[N];
        load_rot_words(p.rot, lane, w);
        rotate_row_forward(x, w, o_s[warp], lane);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          finite = finite && isfinite(x[j]);
          q_s[g][N * lane + j] = x[j] * p.qscale;
        }
      }
    }
    if (!fused) {
      for (int c = lane; c < D; c += 32) {
        const float x = src[c];
        finite = finite && isfinite(x);
        q_s[g][c] = x * p.qscale;
      }
    }
    finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) bad_s[g] = !finite;
  }
  __syncthreads();

  // ---- 2. window tokens: warp w takes tokens w + NW * k -----------------------------------------
  float m[HC], l[HC], o[HC][NP][2];
#pragma unroll
  for (int g = 0; g < HC; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < NP; ++i) o[g][i][0] = o[g][i][1] = 0.f;
  }
#pragma unroll 1
  for (int base = warp; base < nw; base += NW * TB) {
    if (base != warp) load_batch(base);  // the first batch is loaded already
#pragma unroll
    for (int g = 0; g < HC; ++g) {
      if (g >= gn) break;  // CTA-uniform
      float2 qv[NP];
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int c2 = lane + 32 * i;
        qv[i] = D / 2 % 32 == 0 || c2 < D / 2 ? *reinterpret_cast<const float2*>(&q_s[g][2 * c2])
                                              : make_float2(0.f, 0.f);
      }
      float s[TB];
      float bm = -INFINITY;
#pragma unroll
      for (int tt = 0; tt < TB; ++tt) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          a = fmaf(qv[i].x, bf16_lo(kr[tt][i]), a);
          a = fmaf(qv[i].y, bf16_hi(kr[tt][i]), a);
        }
        a = warp_sum(a);
        if (p.soft_cap_log2 > 0.f) a = soft_capped(a, p.soft_cap_log2);
        if (base + NW * tt >= nw || !(a > -INFINITY)) a = -INFINITY;  // no such token, or NaN: no weight
        s[tt] = a;
        bm = fmaxf(bm, a);
      }
      const float mn = fmaxf(m[g], bm);
      if (mn == -INFINITY) continue;  // warp-uniform: no weight yet
      const float alpha = fast_exp2(m[g] - mn);  // m = -inf -> 0
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        o[g][i][0] *= alpha;
        o[g][i][1] *= alpha;
      }
#pragma unroll
      for (int tt = 0; tt < TB; ++tt) {
        const float pr = fast_exp2(s[tt] - mn);  // s = -inf -> 0
        l[g] += pr;
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          o[g][i][0] = fmaf(pr, bf16_lo(vr[tt][i]), o[g][i][0]);
          o[g][i][1] = fmaf(pr, bf16_hi(vr[tt][i]), o[g][i][1]);
        }
      }
      m[g] = mn;
    }
  }
#pragma unroll
  for (int g = 0; g < HC; ++g) {
    if (g >= gn) break;
    if (lane == 0) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      const int c2 = lane + 32 * i;
      if (D / 2 % 32 == 0 || c2 < D / 2)
        *reinterpret_cast<float2*>(&o_s[warp][g * D + 2 * c2]) = make_float2(o[g][i][0], o[g][i][1]);
    }
  }
  __syncthreads();

  // ---- 3. per head: the window's state over the warps, its lse ----------------------------------
  if (warp < gn && lane == 0) {
    const int g = warp;
    float mw, lw;
    merge_window_state<NW, HC>(m_s, l_s, g, mw, lw);
    mw_s[g] = mw;
    lw_s[g] = lw;
    p.plse[(row0 + g) * p.pstride + p.ns] = bad_s[g] ? INFINITY : mw > -INFINITY ? (mw + log2f(lw)) * kLn2 : -INFINITY;
  }
  __syncthreads();

  // ---- 4. the window's partial outputs ------------------------------------------------------------
  for (int idx = tid; idx < gn * D; idx += kCombineThreads) {
    const int g = idx / D;
    const int c = idx - g * D;
    const float mw = mw_s[g];
    float val;
    if (bad_s[g]) {
      val = __int_as_float(0x7fc00000);
    } else if (mw > -INFINITY) {
      float ow = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) ow = fmaf(o_s[w][g * D + c], fast_exp2(m_s[w][g] - mw), ow);
      val = ow / lw_s[g];
    } else {
      continue;  // no window token: lse = -inf, the combine skips this partial
    }
    p.pout[((row0 + g) * p.pstride + p.ns) * D + c] = val;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
// Messages: "jax_tq_paged_decode (CUDA): ..."; the operand checks are shared with the CPU
// handler (jax_tq/ffi_checks.h).
constexpr ffi_checks::Op kOp{"jax_tq_paged_decode", ffi_checks::kCudaTag};

ffi::Error invalid(const std::string& msg) { return kOp.invalid(msg); }

ffi::Error cuda_error(const char* what, cudaError_t e) {
  return kOp.internal(std::string(what) + ": " + cudaGetErrorString(e));
}

int copy_gran(int64_t bytes, uintptr_t ptr) {
  if (bytes % 16 == 0 && ptr % 16 == 0) return 16;
  if (bytes % 4 == 0 && ptr % 4 == 0) return 4;
  return 2;
}

// JTQ_DEV_ONLY_D=<head_dim>: developer builds that instantiate one head_dim only.
#if defined(JTQ_DEV_ONLY_D)
#define JTQ_HAS_D(x) (JTQ_DEV_ONLY_D == (x))
#else
#define JTQ_HAS_D(x) 1
#endif

template <int D>
using Dim = std::integral_constant<int, D>;
template <int B>
using Bits = std::integral_constant<int, B>;

// f(Dim<D>{}) for a run-time head_dim d compiled into this build; none() for any other.
template <class F, class N>
auto with_head_dim(int d, F f, N none) -> decltype(none()) {
  return with_value(SupportedHeadDims{}, d, [&](auto dim) -> decltype(none()) {
    if constexpr (JTQ_HAS_D(decltype(dim)::value)) return f(dim);
    else return none();
  }, none);
}

ffi::Error head_dim_not_built(int d) { return invalid("head_dim " + std::to_string(d) + " not compiled in"); }

// f(Bits<KB>{}, Bits<VB>{}) for run-time K / V widths kb, vb of the packed widths; none() for any other.
template <class F, class N>
auto with_widths(int kb, int vb, F f, N none) -> decltype(none()) {
  return with_value(PackedBits{}, kb, [&](auto k) {
    return with_value(PackedBits{}, vb, [&](auto v) { return f(k, v); }, none);
  }, none);
}

// ---- launches ----------------------------------------------------------------------------------

template <int D, int GT>
ffi::Error launch_cuda_core(cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  auto kernel = decode_cuda_core_kernel<D, GT>;
  constexpr int smem = Layout<D, GT>::total;
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return cuda_error("cudaFuncSetAttribute", e);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error("CUDA-core split kernel launch", e);
  return ffi::Error::Success();
}

// A tensor-core kernel (decode_tensor_core.cuh) on `threads` threads with its table space. One
// instantiation per kernel: the shared-memory attribute is remembered per kernel.
template <auto kKernel, int kSmem = v3::kSmemBytes>
ffi::Error launch_mma(int threads, const char* name, cudaStream_t stream, const DecodeParams& p,
                      dim3 grid) {
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kKernel, kSmem); e != cudaSuccess)
    return cuda_error((std::string(name) + " shared memory attribute").c_str(), e);
  kKernel<<<grid, threads, kSmem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error((std::string(name) + " split kernel launch").c_str(), e);
  return ffi::Error::Success();
}

// The float32-accurate tensor-core kernel (hi / lo products). KB / VB: compile-time code widths, or
// 0: the run-time p.k_bits / p.v_bits.
template <int D, int GT, int KB = 4, int VB = 4>
ffi::Error launch_tc_f32(cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  return launch_mma<v3::decode_tc_f32_kernel<D, GT, true, KB, VB>>(kThreads, "tensor-core f32", stream, p, grid);
}

// The float16 tensor-core kernel. RING: its tiles through a per-warp cp.async ring; HALVES = 2: warp
// pairs; ITEMS = 2, 4 or 8: that many work items (query-head rows blockIdx.y * ITEMS + i) per CTA of
// 16 warps (ITEMS divides grid.y, the rows).
template <int D, int GT, bool RING, int KB = 4, int VB = 4, int HALVES = 1, int ITEMS = 1, bool MASKS = false>
ffi::Error launch_tc_f16(cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  constexpr int smem = v3::kSmemBytes + (RING ? v3::v4_ring_bytes<D, KB, VB, HALVES, ITEMS>() : 0);
  grid.y /= ITEMS;
  return launch_mma<v3::decode_tc_f16_kernel<D, GT, RING, KB, VB, HALVES, ITEMS, MASKS>, smem>(
      v3::v4_threads(ITEMS), "tensor-core f16", stream, p, grid);
}

// ---- what the planner asks of the device --------------------------------------------------------

// Resident CTAs per SM of `kernel` on the current device (asked once per device), at most `cap`.
template <auto kKernel>
int64_t resident_ctas(int threads, int smem, int cap) {
  static std::atomic<int> known[64];
  return once_per_device(known, 1, [threads, smem, cap](int) {
    int ctas = 0;
    if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kKernel, threads, smem) != cudaSuccess) {
      ctas = 1;
    }
    return ctas < 1 ? 1 : ctas > cap ? cap : ctas;
  });
}

// Whether the float16 kernel's ring variant keeps its residency (v4_ctas_per_sm) on the current
// device: yes on sm_90 (227 KB of shared memory per SM); sm_80's 164 KB holds one.
template <int D, int GT, int KB, int VB, int HALVES = 1, int ITEMS = 1>
bool ring_fits() {
  constexpr int smem = v3::kSmemBytes + v3::v4_ring_bytes<D, KB, VB, HALVES, ITEMS>();
  constexpr int want = v3::v4_ctas_per_sm(ITEMS);
  return resident_ctas<v3::decode_tc_f16_kernel<D, GT, true, KB, VB, HALVES, ITEMS>>(
             v3::v4_threads(ITEMS), smem, want) >= want;
}

// ring_fits for run-time arguments, of the ring kernels this build has; false for any other.
bool ring_fits_any(int d, int tile, int kb, int vb, int halves, int items) {
  return with_head_dim(d, [&](auto dim) -> bool {
    constexpr int D = decltype(dim)::value;
    if (items > 1) {
      if constexpr (D == 128) {
        if (tile != 4 || kb != 4 || vb != 4 || halves != 1) return false;
        switch (items) {
          case 2: return ring_fits<128, 4, 4, 4, 1, 2>();
          case 4: return ring_fits<128, 4, 4, 4, 1, 4>();
          case 8: return ring_fits<128, 4, 4, 4, 1, 8>();
          default: return false;
        }
      }
      return false;
    }
    if constexpr (D == 192) {
      return tile == 4 && halves == 2 && kb == 4 && vb == 4 && ring_fits<192, 4, 4, 4, 2>();
    } else {
      constexpr int kHalves = D == 256 ? 2 : 1;
      if (halves != kHalves || (kHalves == 2 && tile != 4)) return false;
      return with_widths(kb, vb, [&](auto k, auto v) -> bool {
        constexpr int KB = decltype(k)::value, VB = decltype(v)::value;
        if constexpr (kHalves == 2) return ring_fits<D, 4, KB, VB, 2>();
        else return tile == 4 ? ring_fits<D, 4, KB, VB>() : ring_fits<D, 8, KB, VB>();
      }, [] { return false; });
    }
  }, [] { return false; });
}

DeviceCaps cuda_decode_caps() {
  DeviceCaps caps;
  caps.cuda = true;
  caps.sm_count = std::max(1, device_sm_count(1));
#if JTQ_HAS_D(128)
  constexpr int kCapD = 128;
#else
  constexpr int kCapD = 64;
#endif
  caps.f32_ctas_per_sm = resident_ctas<v3::decode_tc_f32_kernel<kCapD, 4, true, 4, 4>>(kThreads, v3::kSmemBytes,
                                                                                        v3::kCtasPerSm);
  caps.f16_ctas_per_sm = resident_ctas<v3::decode_tc_f16_kernel<kCapD, 4, false, 4, 4, 1, 1>>(
      v3::v4_threads(1), v3::kSmemBytes, v3::v4_ctas_per_sm(1));
  caps.ring_fits = ring_fits_any;
  return caps;
}

// ---- the plan's launch ------------------------------------------------------------------------

template <int D>
ffi::Error launch_cuda_core_tile(int gt, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  switch (gt) {
    case 1: return launch_cuda_core<D, 1>(stream, p, grid);
    case 2: return launch_cuda_core<D, 2>(stream, p, grid);
    case 4: return launch_cuda_core<D, 4>(stream, p, grid);
    default: return launch_cuda_core<D, (D >= 192 ? 4 : 8)>(stream, p, grid);
  }
}

template <int D>
ffi::Error launch_tc_f32_plan(const DecodePlan& plan, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  const bool four = plan.head_tile <= 4;
  if (p.k_bits != 4 || p.v_bits != 4)  // other widths: the variants that read them at run time
    return four ? launch_tc_f32<D, 4, 0, 0>(stream, p, grid) : launch_tc_f32<D, 8, 0, 0>(stream, p, grid);
  return four ? launch_tc_f32<D, 4>(stream, p, grid) : launch_tc_f32<D, 8>(stream, p, grid);
}

// A sliding window or soft cap: the MASKS kernels, on the ring with K and V of one width B (the
// planner's choice for them: decode_plan.h masks_fit).
template <int D, int B>
ffi::Error launch_tc_f16_masks(const DecodePlan& plan, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  if (!plan.ring) return invalid("tensor-core f16 kernel: a sliding window or soft cap needs its ring");
  if constexpr (D == 128 && B == 4) {
    switch (plan.items) {
      case 2: return launch_tc_f16<D, 4, true, B, B, 1, 2, true>(stream, p, grid);
      case 4: return launch_tc_f16<D, 4, true, B, B, 1, 4, true>(stream, p, grid);
      case 8: return launch_tc_f16<D, 4, true, B, B, 1, 8, true>(stream, p, grid);
      default: break;
    }
  }
  return plan.head_tile <= 4 ? launch_tc_f16<D, 4, true, B, B, 1, 1, true>(stream, p, grid)
                             : launch_tc_f16<D, 8, true, B, B, 1, 1, true>(stream, p, grid);
}

// head_dim 64 / 128: several items per CTA, else the ring, else tiles in registers.
template <int D, int KB, int VB>
ffi::Error launch_tc_f16_unpadded(const DecodePlan& plan, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  if (p.sliding_window > 0 || p.soft_cap_log2 > 0.f) {
    if constexpr (KB == VB) return launch_tc_f16_masks<D, KB>(plan, stream, p, grid);
    else return invalid("tensor-core f16 kernel: a sliding window or soft cap needs K and V of one width");
  }
  const bool four = plan.head_tile <= 4;
  if constexpr (D == 128 && KB == 4 && VB == 4) {
    switch (plan.items) {
      case 2: return launch_tc_f16<D, 4, true, KB, VB, 1, 2>(stream, p, grid);
      case 4: return launch_tc_f16<D, 4, true, KB, VB, 1, 4>(stream, p, grid);
      case 8: return launch_tc_f16<D, 4, true, KB, VB, 1, 8>(stream, p, grid);
      default: break;
    }
  }
  if (plan.ring)
    return four ? launch_tc_f16<D, 4, true, KB, VB>(stream, p, grid) : launch_tc_f16<D, 8, true, KB, VB>(stream, p, grid);
  if constexpr (KB == 4 && VB == 4)
    return four ? launch_tc_f16<D, 4, false>(stream, p, grid) : launch_tc_f16<D, 8, false>(stream, p, grid);
  else  // other widths share one register variant that reads them at run time
    return four ? launch_tc_f16<D, 4, false, 0, 0>(stream, p, grid) : launch_tc_f16<D, 8, false, 0, 0>(stream, p, grid);
}

// The other head_dims, on the ring only: 80 / 96 rows padded to 128 coordinates (head tiles of 4 or
// 8), 256 warp pairs (head tiles of 4), 192 warp pairs of padded halves (K4V4, head tiles of 4).
template <int D, int KB, int VB>
ffi::Error launch_tc_f16_wide(const DecodePlan& plan, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  if constexpr (D == 192) {
    if constexpr (KB == 4 && VB == 4) return launch_tc_f16<192, 4, true, 4, 4, 2>(stream, p, grid);
    else return invalid("tensor-core f16 kernel: head_dim 192 needs K4V4");
  } else if constexpr (D == 256) {
    return launch_tc_f16<256, 4, true, KB, VB, 2>(stream, p, grid);
  } else {
    return plan.head_tile <= 4 ? launch_tc_f16<D, 4, true, KB, VB, 1>(stream, p, grid)
                               : launch_tc_f16<D, 8, true, KB, VB, 1>(stream, p, grid);
  }
}

ffi::Error launch_plan(const DecodePlan& plan, int d, cudaStream_t stream, const DecodeParams& p, dim3 grid) {
  return with_head_dim(d, [&](auto dim) -> ffi::Error {
    constexpr int D = decltype(dim)::value;
    constexpr bool kUnpadded = D == 64 || D == 128;
    switch (plan.kernel) {
      case DecodeKernel::kTensorCoreF16:
        return with_widths(p.k_bits, p.v_bits, [&](auto k, auto v) -> ffi::Error {
          constexpr int KB = decltype(k)::value, VB = decltype(v)::value;
          if constexpr (kUnpadded) return launch_tc_f16_unpadded<D, KB, VB>(plan, stream, p, grid);
          else return launch_tc_f16_wide<D, KB, VB>(plan, stream, p, grid);
        }, [] { return invalid("tensor-core f16 kernel: K and V of 2, 3 or 4 bits"); });
      case DecodeKernel::kTensorCoreF32:
        if constexpr (kUnpadded) return launch_tc_f32_plan<D>(plan, stream, p, grid);
        else return invalid("tensor-core f32 kernel: head_dim 64 or 128 only");
      default:
        return launch_cuda_core_tile<D>(plan.head_tile, stream, p, grid);
    }
  }, [d] { return head_dim_not_built(d); });
}

// Query heads per window-partial CTA at most, for a run-time head_dim.
int win_heads_of(int d) { return d <= 128 ? win_heads<128>() : win_heads<256>(); }

// Query heads per window-partial CTA: the most (min(G, win_heads)), halved while the grid has fewer
// than kWinMinCtas CTAs, down to one head per CTA (small batches: more CTAs, each reading the
// (sequence, KV head)'s window rows again, from L2 mostly; e.g. 1 sequence x 8 KV heads x G 4:
// 32 CTAs of one head instead of 8 of four).
constexpr int64_t kWinMinCtas = 128;
int window_heads_per_cta(int64_t S, int64_t Hkv, int64_t G, int d) {
  int64_t hc = G < win_heads_of(d) ? G : win_heads_of(d);
  while (hc > 1 && S * Hkv * ((G + hc - 1) / hc) < kWinMinCtas) hc = (hc + 1) / 2;
  return static_cast<int>(hc);
}

// The window's partials (slot wp.ns), before the split kernel (ctas: num_seqs * num_kv_heads * wp.chunks).
ffi::Error launch_window_partial(int d, cudaStream_t stream, const WindowPartialParams& wp, int64_t ctas) {
  if (ctas == 0) return ffi::Error::Success();
  return with_head_dim(d, [&](auto dim) -> ffi::Error {
    paged_decode_window_partial_kernel<decltype(dim)::value><<<static_cast<unsigned>(ctas), kCombineThreads, 0, stream>>>(wp);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error("window partial kernel launch", e);
    return ffi::Error::Success();
  }, [d] { return head_dim_not_built(d); });
}

// The largest power of two up to 16 that divides the first n addresses.
int common_alignment(const void* const* ptrs, int n) {
  int align = 16;
  for (int i = 0; i < n; ++i)
    while (reinterpret_cast<uintptr_t>(ptrs[i]) % align != 0) align /= 2;
  return align;
}

}  // namespace

DecodePlan PlanDecodeOnDevice(const DecodeProblem& problem) { return plan_decode(problem, cuda_decode_caps()); }

#ifdef JTQ_TRACE_PHASES
// The phase trace buffer (kTraceWords words) into dst, then zeroed; false on a CUDA error.
bool ReadPhaseTrace(unsigned long long* dst) {
  if (cudaDeviceSynchronize() != cudaSuccess) return false;
  if (cudaMemcpyFromSymbol(dst, g_phase_trace, sizeof(g_phase_trace)) != cudaSuccess) return false;
  static unsigned long long zeros[kTraceWords];
  return cudaMemcpyToSymbol(g_phase_trace, zeros, sizeof(g_phase_trace)) == cudaSuccess;
}
int PhaseTraceWords() { return kTraceWords; }
#endif

ffi::Error PagedDecodeCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> q_rot,
                               ffi::Buffer<ffi::U8> k_codes, ffi::Buffer<ffi::F32> k_norms,
                               ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_norms,
                               ffi::Buffer<ffi::F32> k_centroids,
                               ffi::Buffer<ffi::F32> v_centroids,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::BF16> k_window, ffi::Buffer<ffi::BF16> v_window,
                               ffi::Buffer<ffi::S32> window_ids, ffi::Buffer<ffi::S32> rotation,
                               ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::Buffer<ffi::F32>> out_rot,
                               ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t k_bits,
                               int32_t v_bits, int32_t num_splits, float scale,
                               int32_t f16_products, int32_t kernel, int32_t sliding_window,
                               float soft_cap) {
  // ---- validation (shared with the CPU handler) ----------------------------------------------
  ffi_checks::DecodeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_paged_decode(
      kOp, q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
      seq_lens, k_window, v_window, window_ids, rotation, *out_rot, *partial_out, *partial_lse, k_bits, v_bits,
      num_splits, &dims));
  ffi_checks::Variants variants;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_variants(kOp, sinks, dims.H, sliding_window, soft_cap, &variants));
  const int64_t S = dims.S, H = dims.H, d = dims.d;
  const int64_t P = dims.P, Hkv = dims.Hkv, page = dims.page;
  const int64_t kpb = dims.kpb, vpb = dims.vpb, max_pages = dims.max_pages, ns = dims.ns;
  if (S == 0 || H == 0) return ffi::Error::Success();
  if (page <= 0) return invalid("page_size must be >= 1");
  if (max_pages * page >= (int64_t(1) << 31) - kChunk * kStages)
    return invalid("max_pages * page_size must be < 2^31");
  if (S * ns >= (int64_t(1) << 31)) return invalid("num_seqs * num_splits too large");
  const bool win = dims.win.on();  // the recent-token window (format.h): its tokens in the window-partial kernel
  const int64_t pstride = dims.pstride;  // partials per (sequence, head): ns, + 1 with a window (its partial last)
  if (pstride != ns + (win ? 1 : 0)) return invalid("partial workspace stride mismatch");
  if (win && dims.win.window >= (int64_t(1) << 31)) return invalid("window too long");

  if (kernel < 0 || kernel > static_cast<int32_t>(DecodeKernel::kTensorCoreF16))
    return invalid("kernel must be 0 (the planner's choice), 1, 2 or 3, got " + std::to_string(kernel));
  const int64_t G = H / Hkv;
  DecodeProblem problem;
  problem.num_seqs = S;
  problem.num_heads = H;
  problem.num_kv_heads = Hkv;
  problem.head_dim = d;
  problem.max_pages = max_pages;
  problem.page_size = page;
  problem.k_bits = k_bits;
  problem.v_bits = v_bits;
  problem.f16_products = f16_products != 0;
  problem.window = win;
  problem.hadamard = dims.fused;
  problem.num_splits = ns;
  problem.kernel = static_cast<DecodeKernel>(kernel);
  problem.variants = variants.any();
  const void* pools[] = {k_codes.untyped_data(), v_codes.untyped_data(), k_norms.untyped_data(),
                         v_norms.untyped_data(), k_window.untyped_data(), v_window.untyped_data()};
  problem.alignment = common_alignment(pools, win ? 6 : 4);  // the windows count only where there is one
  const DecodePlan plan = plan_decode(problem, cuda_decode_caps());
  const int gt = plan.head_tile;
  const int64_t ntiles = (G + gt - 1) / gt;
  if (Hkv * ntiles > 65535) return invalid("num_kv_heads * ceil(group / 8) must be <= 65535");

  DecodeParams p;
  p.q = q_rot.typed_data();
  p.kc = k_codes.typed_data();
  p.kn = k_norms.typed_data();
  p.vc = v_codes.typed_data();
  p.vn = v_norms.typed_data();
  p.kcent = k_centroids.typed_data();
  p.vcent = v_centroids.typed_data();
  p.bt = block_tables.typed_data();
  p.sl = seq_lens.typed_data();
  p.out = out_rot->typed_data();
  p.pout = partial_out->typed_data();
  p.plse = partial_lse->typed_data();
  p.S = static_cast<int>(S);
  p.H = static_cast<int>(H);
  p.Hkv = static_cast<int>(Hkv);
  p.G = static_cast<int>(G);
  p.ntiles = static_cast<int>(ntiles);
  p.P = static_cast<int>(P < (int64_t(1) << 31) - 1 ? P : (int64_t(1) << 31) - 1);
  p.page_size = static_cast<int>(page);
  p.max_pages = static_cast<int>(max_pages);
  p.num_splits = static_cast<int>(ns);
  p.pdiv = make_fastdiv(static_cast<uint32_t>(page));
  p.qscale = scale * kLog2e;
  for (int which = 0; which < 2; ++which) {
    CopyPlan& c = which == 0 ? p.kcopy : p.vcopy;
    c.bytes = static_cast<int>(which == 0 ? kpb : vpb);
    c.gran = copy_gran(c.bytes, reinterpret_cast<uintptr_t>(which == 0 ? static_cast<const void*>(p.kc)
                                                                        : static_cast<const void*>(p.vc)));
    c.segs = c.bytes / c.gran;
    c.segdiv = make_fastdiv(static_cast<uint32_t>(c.segs));
  }
  p.k_bits = k_bits;
  p.v_bits = v_bits;
  p.rot = dims.fused ? rotation.typed_data() : nullptr;
  p.trace = nullptr;
#ifdef JTQ_TRACE_PHASES
  if (void* trace = nullptr; cudaGetSymbolAddress(&trace, g_phase_trace) == cudaSuccess)
    p.trace = static_cast<unsigned long long*>(trace);
#endif
  p.window = win ? static_cast<int>(dims.win.window) : 0;
  p.pstride = static_cast<int>(pstride);
  p.sliding_window = static_cast<int>(variants.sliding_window);
  // A cap beyond float's range changes no float logit: none (its float c would be inf, c tanh(s / c) NaN).
  p.soft_cap_log2 = variants.soft_cap_log2();
  p.soft_cap_inv = p.soft_cap_log2 > 0.f ? 1.f / p.soft_cap_log2 : 0.f;
  p.sinks = variants.sinks ? sinks.typed_data() : nullptr;
  if (variants.any() && plan.kernel != DecodeKernel::kCudaCore && plan.kernel != DecodeKernel::kTensorCoreF16)
    return invalid("the attention variants run on the CUDA-core and float16 tensor-core kernels only (the "
                   "planner's choice for them)");
  if (P == 0) {  // nothing can be read: every row is 0 (all page ids are out of range)
    p.P = 0;
  }

  // A window is folded into the float16 tensor-core kernel's tile loop where the plan says so; else
  // its partial comes from the window-partial kernel.
  p.kwin = nullptr;
  p.vwin = nullptr;
  p.window_ids = window_ids.typed_data();
  p.num_windows = static_cast<int>(dims.win.num_windows < (int64_t(1) << 31) - 1 ? dims.win.num_windows
                                                                                : (int64_t(1) << 31) - 1);
  // A folded window has a CTA of its own (split ns, partial slot ns) wherever the splits write
  // partials; at one split without sinks it joins split 0's CTA, whose output is final.
  const bool window_cta = ns > 1 || p.sinks != nullptr;
  p.window_split = window_cta ? static_cast<int>(ns) : 0;
  const bool fold = win && plan.folds_window;
  if (fold) {
    p.kwin = static_cast<const uint16_t*>(k_window.untyped_data());
    p.vwin = static_cast<const uint16_t*>(v_window.untyped_data());
  }
  p.grid_splits = static_cast<int>(ns) + (fold && window_cta ? 1 : 0);
  if (S * p.grid_splits >= (int64_t(1) << 31)) return invalid("num_seqs * num_splits too large");
  // Checked before any launch. XLA's buffers are aligned, and head_dim is validated above.
  // The combine merges the pstride partials of each (sequence, head): the splits' and, with a
  // window, the window's (also with one split); W = 0 and one split: no combine.
  const bool combine = ns > 1 || (win && !fold) || p.sinks != nullptr;  // writes_partials(p)
  if (combine && reinterpret_cast<uintptr_t>(p.pout) % 16 != 0)
    return invalid("partial_out workspace is not 16-byte aligned");
  if (combine && d > kCombineMaxD) return invalid("head_dim above the combine kernel's 256");
  if (dims.fused && (!plan.fused_rotation || reinterpret_cast<uintptr_t>(p.rot) % 16 != 0))
    return invalid(std::string("the fused (Hadamard) rotation runs on the tensor-core kernels only (head_dim 64 or 128, K and "
                               "V of 2, 3 or 4 bits, code pools aligned to the per-lane loads, a 16-byte aligned "
                               "rotation operand); this call's plan: ") +
                   kDecodeKernelNames[static_cast<int>(plan.kernel)]);
  WindowPartialParams wp{};
  int64_t win_ctas = 0;
  if (win && !fold) {
    wp.hc = window_heads_per_cta(S, Hkv, G, static_cast<int>(d));
    wp.chunks = static_cast<int>((G + wp.hc - 1) / wp.hc);
    win_ctas = S * Hkv * wp.chunks;
    if (win_ctas >= (int64_t(1) << 31)) return invalid("too many (sequence, KV head, head chunk) CTAs for the window");
    if (reinterpret_cast<uintptr_t>(k_window.untyped_data()) % 4 != 0 ||
        reinterpret_cast<uintptr_t>(v_window.untyped_data()) % 4 != 0)
      return invalid("k_window / v_window buffers are not 4-byte aligned");
    wp.q = p.q;
    wp.pout = p.pout;
    wp.plse = p.plse;
    wp.kwin = static_cast<const uint32_t*>(k_window.untyped_data());
    wp.vwin = static_cast<const uint32_t*>(v_window.untyped_data());
    wp.sl = p.sl;
    wp.ids = window_ids.typed_data();
    wp.rot = p.rot;
    wp.capacity = max_pages * page;
    wp.H = p.H;
    wp.Hkv = p.Hkv;
    wp.G = p.G;
    wp.ns = p.num_splits;
    wp.pstride = p.pstride;
    wp.window = p.window;
    wp.num_windows = static_cast<int>(dims.win.num_windows < (int64_t(1) << 31) - 1 ? dims.win.num_windows
                                                                                   : (int64_t(1) << 31) - 1);
    wp.qscale = p.qscale;
    wp.sliding_window = p.sliding_window;
    wp.soft_cap_log2 = p.soft_cap_log2;
  }
  // The window's partials first (independent of the split kernel), then the splits', then the combine.
  if (win && !fold) {
    if (auto e = launch_window_partial(static_cast<int>(d), stream, wp, win_ctas); e.failure()) return e;
  }
  const dim3 grid(static_cast<unsigned>(S * p.grid_splits), static_cast<unsigned>(Hkv * ntiles));
  if (auto e = launch_plan(plan, static_cast<int>(d), stream, p, grid); e.failure()) return e;
  if (combine) {
    // ns = pstride: the combine's partial count and stride (the window's partial is the last).
    static std::atomic<int> combine_code[64];
    cudaError_t e = launch_dependent(compiled_for_sm90(combine_code, paged_decode_combine_kernel),
                                     paged_decode_combine_kernel, dim3(static_cast<unsigned>(S * H)),
                                     dim3(kCombineThreads), 0, stream, p.pout, p.plse, p.out, static_cast<int>(pstride),
                                     static_cast<int>(d), p.rot ? p.rot + d : nullptr, p.sinks, p.H);
    if (e != cudaSuccess) return cuda_error("combine kernel launch", e);
  }
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace jax_tq

// Command-buffer compatible: the handler only launches kernels on the given stream (its launch
// parameters depend on shapes, attributes and buffer addresses only), so XLA may capture it into
// a CUDA graph together with the surrounding ops.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedDecodeCuda, jax_tq::cuda::PagedDecodeCudaImpl,
                              jax_tq::ffi_checks::BindPagedDecode(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
