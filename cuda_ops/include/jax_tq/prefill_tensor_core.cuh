// Tensor-core paged prefill (jax_tq_paged_prefill, head_dim 64 or 128): flash attention of many
// query rows over compressed pages, the K / V of each 64-token tile decoded ONCE into shared memory
// (f16 centroids, 128-byte swizzle: wgmma.cuh) and read by every query row and head of the CTA:
// by Hopper's wgmma in sm_90a code (the tensor cores read K / V from shared memory once per
// warpgroup), by ldmatrix + mma.sync elsewhere (each warp reads the whole tile).
//
// A CTA of 4 warps takes 64 (query token, head) rows of one sequence and one KV head's GQA group:
// kRows / Gc consecutive tokens x Gc heads (Gc = min(group, kRows)), row r = token r / Gc, head
// r % Gc; warp w holds rows 16w .. 16w + 15 as an m16n8k16 A operand (FlashAttention-2's layout,
// arXiv 2307.08691; the same registers are a wgmma A operand of the CTA's one warpgroup, as in
// FlashAttention-3, arXiv 2407.08608). Per 64-token tile:
//   1. every thread decodes its chunks of 32 K and 32 V codes (prefetched into registers during the
//      previous tile's MMAs) through a pair table (byte -> f16x2 of two centroids) into the tile;
//      the norms stay out of the tile: S is scaled per token by the K norm, P by the V norm;
//   2. S = Q K^T, scaled (and soft-capped), the causal mask on the tiles that reach a row's position
//      and the sliding window's on those before a row's first visible token (tiles before every
//      row's first are skipped);
//   3. online softmax in base 2 (the query pre-scaled by a power of two so that |q| < 1 in f16, the
//      power, scale and log2(e) applied to the f32 scores);
//   4. O += (P * v_norm) V (P from S's accumulators in registers; V read MN-major).
// Tokens from the recent-token window (format.h) enter the tile as their bf16 rows (norm included),
// invalid block-table entries and tokens past the piece's longest row as zero rows of bias -inf.
// Sinks join each row's denominator when it is stored.
// A CTA tile of flattened tokens that spans sequences runs one piece (sequence) after another.
#ifndef JAX_TQ_PREFILL_TENSOR_CORE_CUH_
#define JAX_TQ_PREFILL_TENSOR_CORE_CUH_

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "jax_tq/attention_variants.cuh"
#include "jax_tq/code_loads.cuh"
#include "jax_tq/format.h"
#include "jax_tq/mma.cuh"
#include "jax_tq/prefill_device.cuh"
#include "jax_tq/wgmma.cuh"

namespace jax_tq {
namespace cuda {
namespace {
namespace prefill_tc {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // (token, head) rows per CTA
constexpr int kTile = 64;           // K / V tokens per tile
constexpr int kLutCopies = 8;       // copies of each table entry (lane % 8 reads its own)
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct Smem {
  __half k[kTile * D];  // row t: token t's D centroids, in wgmma.cuh's swizzled layout (chunk_offset)
  __half v[kTile * D];
  uint32_t lut[2][256][kLutCopies];  // [K / V][byte e] = f16x2 (c[e & 15], c[e >> 4])
  float k_scale[kTile];              // K norm (1 for a window row, 0 for none)
  float v_scale[kTile];
  float bias[kTile];                 // 0, or -inf for a token that is not there
};

// Offset (in halves) of 16-byte chunk `chunk` of tile row `t`: wgmma.cuh's 128-byte swizzle (blocks
// of 64 columns; chunk ^ (t & 7) within a block), which also puts the 8 rows an ldmatrix reads at
// one logical chunk in 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int chunk_offset(int t, int chunk) {
  return (chunk >> 3) * (kTile * 64) + t * 64 + (((chunk & 7) ^ (t & 7)) << 3);
}

// Bytes from a 1024-byte boundary to the start of the swizzled tiles (the dynamic shared memory
// is allocated with kSmemAlign extra bytes).
constexpr int kSmemAlign = 1024;

__device__ __forceinline__ float ex2(float x) {  // exp2, ex2.approx (exp2(-inf) = 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Both pair tables (entries of codes beyond 2^bits - 1 repeat the last centroid and are never read).
__device__ void build_luts(uint32_t (*lut)[256][kLutCopies], const float* kc, int k_bits, const float* vc,
                           int v_bits) {
  for (int i = threadIdx.x; i < 2 * 256; i += kThreads) {
    const int table = i >> 8, e = i & 255;
    const float* c = table ? vc : kc;
    const int top = (1 << (table ? v_bits : k_bits)) - 1;
    const int lo = (e & 15) < top ? (e & 15) : top, hi = (e >> 4) < top ? (e >> 4) : top;
    const uint32_t entry = h2_bits(__floats2half2_rn(c[lo], c[hi]));
#pragma unroll
    for (int copy = 0; copy < kLutCopies; ++copy) lut[table][e][copy] = entry;
  }
}

// One sequence piece's constants: rows [a, b) of sequence s, heads [h0, h0 + hc) of KV head g.
struct Piece {
  int64_t s, a, b, g, h0;
  int hc;
  PrefillRows rows;
  int64_t paged;   // tokens [0, paged) from the pages, [paged, seq_len) from the window
  int64_t window;  // window id, -1: none
  int64_t limit;   // tokens the piece's longest row sees
  int64_t first;   // tokens its shortest row sees
};

// A thread's share of the next tile, loaded into registers while the current one is consumed.
template <int D>
struct Pending {
  static constexpr int kChunks = D / 32;                    // 32-code chunks of a token row
  static constexpr int kPerThread = kTile * kChunks / kThreads;
  uint32_t k[kPerThread][4], v[kPerThread][4];  // nibble words (code i of a word in bits 4i..)
  int kind[kPerThread];                         // 0 none, 1 pages, 2 window
  float k_norm, v_norm, bias;                   // token threadIdx.x of the tile (threads < kTile)
};

template <int D, int KB, int VB>
__device__ __forceinline__ void prefetch(const PrefillParams& p, const Piece& pc, int64_t t0, Pending<D>& pend) {
  constexpr int kChunks = Pending<D>::kChunks;
  const int32_t* table = p.block_tables + pc.s * p.max_pages;
#pragma unroll
  for (int i = 0; i < Pending<D>::kPerThread; ++i) {
    const int task = threadIdx.x + kThreads * i, j = task / kChunks, chunk = task % kChunks;
    const int64_t t = t0 + j;
    int kind = 0;
    if (t < pc.limit && t < pc.paged) {
      const int64_t phys = table[t / p.page];
      if (phys >= 0 && phys < p.P) {
        kind = 1;
        const int64_t row = (phys * p.Hkv + pc.g) * p.page + t % p.page;
        load_nibbles<KB, 4, GlobalMem, align_of(4 * KB)>(p.k_codes + row * p.kpb + chunk * 4 * KB, pend.k[i]);
        load_nibbles<VB, 4, GlobalMem, align_of(4 * VB)>(p.v_codes + row * p.vpb + chunk * 4 * VB, pend.v[i]);
      }
    } else if (t < pc.limit && pc.window >= 0) {
      kind = 2;
    }
    pend.kind[i] = kind;
  }
  if (threadIdx.x < kTile) {
    const int64_t t = t0 + threadIdx.x;
    pend.k_norm = 0.f, pend.v_norm = 0.f, pend.bias = -INFINITY;
    if (t < pc.limit && t < pc.paged) {
      const int64_t phys = table[t / p.page];
      if (phys >= 0 && phys < p.P) {
        const int64_t n = norms_offset(phys, pc.g, t % p.page, p.Hkv, p.page);
        pend.k_norm = __ldg(p.k_norms + n), pend.v_norm = __ldg(p.v_norms + n), pend.bias = 0.f;
      }
    } else if (t < pc.limit && pc.window >= 0) {
      pend.k_norm = 1.f, pend.v_norm = 1.f, pend.bias = 0.f;
    }
  }
}

// 8 bf16 (one 16-byte chunk of a window row) as 8 f16.
__device__ __forceinline__ uint4 bf16x8_to_f16(uint4 x) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    r[i] = h2_bits(__floats2half2_rn(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xFFFF0000u)));
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// Writes the pending tile into shared memory (all threads; a barrier before and after).
template <int D>
__device__ __forceinline__ void store_tile(const PrefillParams& p, const Piece& pc, int64_t t0, const Pending<D>& pend,
                                           Smem<D>& sm) {
  constexpr int kChunks = Pending<D>::kChunks;
  const int copy = threadIdx.x & (kLutCopies - 1);
#pragma unroll
  for (int i = 0; i < Pending<D>::kPerThread; ++i) {
    const int task = threadIdx.x + kThreads * i, j = task / kChunks, chunk = task % kChunks;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
      if (pend.kind[i] == 1) {
        const uint32_t kw = pend.k[i][w], vw = pend.v[i][w];
        kx = make_uint4(sm.lut[0][kw & 255][copy], sm.lut[0][(kw >> 8) & 255][copy],
                        sm.lut[0][(kw >> 16) & 255][copy], sm.lut[0][kw >> 24][copy]);
        vx = make_uint4(sm.lut[1][vw & 255][copy], sm.lut[1][(vw >> 8) & 255][copy],
                        sm.lut[1][(vw >> 16) & 255][copy], sm.lut[1][vw >> 24][copy]);
      } else if (pend.kind[i] == 2) {
        const int64_t at = ((pc.window * p.Hkv + pc.g) * p.W + window_entry(t0 + j, p.W)) * D + chunk * 32 + 8 * w;
        kx = bf16x8_to_f16(__ldg(reinterpret_cast<const uint4*>(p.k_window + at)));
        vx = bf16x8_to_f16(__ldg(reinterpret_cast<const uint4*>(p.v_window + at)));
      }
      *reinterpret_cast<uint4*>(sm.k + chunk_offset<D>(j, 4 * chunk + w)) = kx;
      *reinterpret_cast<uint4*>(sm.v + chunk_offset<D>(j, 4 * chunk + w)) = vx;
    }
  }
  if (threadIdx.x < kTile) {
    sm.k_scale[threadIdx.x] = pend.k_norm;
    sm.v_scale[threadIdx.x] = pend.v_norm;
    sm.bias[threadIdx.x] = pend.bias;
  }
#if JTQ_WGMMA
  fence_async_shared();
#endif
}

// The warp's query rows as A fragments (k-step ks: dims 16 ks ..), each row scaled by a power of
// two 2^-e so that |q| < 1 in f16; factor[h] = scale * log2(e) * 2^e turns its products into base-2
// logits. Row h (0: gid, 1: gid + 8) of the warp: finite[h] false for a row whose query is not all
// finite (entered as zeros, its output NaN), visible[h] the tokens it sees (0 for a padding row).
template <int D>
struct QueryRows {
  uint32_t a[D / 16][4];
  float factor[2];
  int64_t visible[2];
  bool finite[2], real[2];
  int64_t token[2], head[2];
};

template <int D>
__device__ __forceinline__ void load_query(const PrefillParams& p, const Piece& pc, QueryRows<D>& qr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  float x[2][D / 16][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + gid + 8 * h;
    const bool real = r < int(pc.b - pc.a) * pc.hc;
    qr.real[h] = real;
    qr.token[h] = pc.a + (real ? r / pc.hc : 0);
    qr.head[h] = pc.h0 + (real ? r % pc.hc : 0);
    qr.visible[h] = real ? pc.rows.causal_len(qr.token[h]) : 0;
    const float* src = p.q + (qr.token[h] * p.H + qr.head[h]) * D;
    float amax = 0.f;
    bool ok = true;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float2 v = real ? *reinterpret_cast<const float2*>(src + 16 * ks + 8 * half + 2 * t4) : make_float2(0.f, 0.f);
        x[h][ks][2 * half] = v.x, x[h][ks][2 * half + 1] = v.y;
        ok = ok && isfinite(v.x) && isfinite(v.y);
        amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
      }
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {  // the 4 lanes of a row
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      ok = __shfl_xor_sync(0xffffffffu, int(ok), o) && ok;
    }
    qr.finite[h] = ok;
    int e = 0;
    if (ok) frexpf(amax, &e);
    const float down = ldexpf(1.f, -e);
    qr.factor[h] = p.scale * kLog2e * ldexpf(1.f, e);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
      for (int c = 0; c < 4; ++c) x[h][ks][c] = ok ? x[h][ks][c] * down : 0.f;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    qr.a[ks][0] = h2_bits(__floats2half2_rn(x[0][ks][0], x[0][ks][1]));
    qr.a[ks][1] = h2_bits(__floats2half2_rn(x[1][ks][0], x[1][ks][1]));
    qr.a[ks][2] = h2_bits(__floats2half2_rn(x[0][ks][2], x[0][ks][3]));
    qr.a[ks][3] = h2_bits(__floats2half2_rn(x[1][ks][2], x[1][ks][3]));
  }
}

// Online softmax state and output accumulators of the warp's 16 rows (C fragments: o[n] holds dims
// 8n + 2 t4, +1 of rows gid (o[n][0..1]) and gid + 8 (o[n][2..3])); l is the lane's partial sum.
template <int D>
struct Accumulators {
  float o[D / 8][4];
  float m[2], l[2];
};

// S = Q K^T of the tile, in base-2 logits with the mask (causal, on tiles `masked`) applied: s[j]
// holds tokens 8 j + 2 t4, +1. VARIANTS: the logits soft-capped, and the sliding window's mask too.
template <int D, bool VARIANTS>
__device__ __forceinline__ void tile_scores(const PrefillParams& p, const QueryRows<D>& qr, const Smem<D>& sm,
                                            int64_t t0, bool masked, float (&s)[kTile / 8][4]) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
#if JTQ_WGMMA
  const uint32_t k_tile = smem_u32(sm.k);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)  // K-major: dims 16 ks .. at byte 32 (ks % 4) of block ks / 4
    wgmma_m64n64k16<0>(s, qr.a[ks], sw128_desc(k_tile + (ks >> 2) * (kTile * 128) + (ks & 3) * 32, 16, 1024), ks > 0);
  wgmma_commit();
  wgmma_wait_all();
  fence_operands(s);
#else
  const int m = lane >> 3, r = lane & 7;
#pragma unroll
  for (int j = 0; j < kTile / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int jp = 0; jp < kTile / 16; ++jp) {
      uint32_t b[4];
      ldmatrix_x4(b, smem_u32(sm.k + chunk_offset<D>(16 * jp + 8 * (m >> 1) + r, 2 * ks + (m & 1))));
      mma16816(s[2 * jp], qr.a[ks], b[0], b[1]);
      mma16816(s[2 * jp + 1], qr.a[ks], b[2], b[3]);
    }
  }
#endif
  for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 8 * j + 2 * t4 + (e & 1), h = e >> 1;
      float x;
      if constexpr (VARIANTS) {  // c tanh(l / c) before the bias (a bias of -inf: no such token)
        const float l = s[j][e] * qr.factor[h] * sm.k_scale[tok];
        x = (p.soft_cap_log2 > 0.f ? p.soft_cap_log2 * tanhf(l / p.soft_cap_log2) : l) + sm.bias[tok];
        if (masked && (t0 + tok >= qr.visible[h] || !inside_window(p, t0 + tok, qr.visible[h]))) x = -INFINITY;
      } else {
        x = fmaf(s[j][e] * qr.factor[h], sm.k_scale[tok], sm.bias[tok]);
        if (masked && t0 + tok >= qr.visible[h]) x = -INFINITY;
      }
      s[j][e] = x;
    }
  }
}

// The online softmax update with tile scores s (turned into weights p in place).
template <int D>
__device__ __forceinline__ void softmax_update(float (&s)[kTile / 8][4], Accumulators<D>& acc) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(acc.m[h], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with no token yet: weights 0
    const float alpha = ex2(acc.m[h] - base);
    acc.m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
      s[j][2 * h] = ex2(s[j][2 * h] - base);
      s[j][2 * h + 1] = ex2(s[j][2 * h + 1] - base);
      sum += s[j][2 * h] + s[j][2 * h + 1];
    }
    acc.l[h] = acc.l[h] * alpha + sum;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc.o[n][2 * h] *= alpha, acc.o[n][2 * h + 1] *= alpha;
  }
}

// O += (P * v_norm) V over the tile.
template <int D>
__device__ __forceinline__ void accumulate_v(const float (&p)[kTile / 8][4], const Smem<D>& sm, Accumulators<D>& acc) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  uint32_t a[kTile / 16][4];  // P * v_norm as A fragments: tokens 16 kk ..
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const int lo = 16 * kk + 2 * t4, hi = lo + 8;
    const float vl0 = sm.v_scale[lo], vl1 = sm.v_scale[lo + 1], vh0 = sm.v_scale[hi], vh1 = sm.v_scale[hi + 1];
    a[kk][0] = half2_satfinite(p[2 * kk][0] * vl0, p[2 * kk][1] * vl1);
    a[kk][1] = half2_satfinite(p[2 * kk][2] * vl0, p[2 * kk][3] * vl1);
    a[kk][2] = half2_satfinite(p[2 * kk + 1][0] * vh0, p[2 * kk + 1][1] * vh1);
    a[kk][3] = half2_satfinite(p[2 * kk + 1][2] * vh0, p[2 * kk + 1][3] * vh1);
  }
#if JTQ_WGMMA
  // MN-major V: 16 token rows (two 8-row atoms, 1024 bytes apart) x one 64-dim block per wgmma.
  const uint32_t v_tile = smem_u32(sm.v);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk)
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
      wgmma_m64n64k16<1>(*reinterpret_cast<float(*)[8][4]>(&acc.o[8 * blk]), a[kk],
                         sw128_desc(v_tile + blk * (kTile * 128) + kk * (16 * 128), 1024, 1024), 1);
  wgmma_commit();
  wgmma_wait_all();
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) fence_operands(*reinterpret_cast<float(*)[8][4]>(&acc.o[8 * blk]));
#else
  const int m = lane >> 3, r = lane & 7;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_u32(sm.v + chunk_offset<D>(16 * kk + 8 * (m & 1) + r, 2 * np + (m >> 1))));
      mma16816(acc.o[2 * np], a[kk], b[0], b[1]);
      mma16816(acc.o[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
#endif
}

template <int D>
__device__ __forceinline__ void store_rows(const PrefillParams& p, const QueryRows<D>& qr, Accumulators<D>& acc) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = acc.l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (!qr.real[h]) continue;
    float inv = l > 0.f ? 1.f / l : 0.f;
    if (p.sinks != nullptr && l > 0.f) inv = inverse_with_sink(l, acc.m[h], p.sinks[qr.head[h]] * kLog2e, true);
    float* dst = p.out + (qr.token[h] * p.H + qr.head[h]) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float2 v = qr.finite[h] ? make_float2(acc.o[n][2 * h] * inv, acc.o[n][2 * h + 1] * inv)
                                    : make_float2(NAN, NAN);
      *reinterpret_cast<float2*>(dst + 8 * n + 2 * t4) = v;
    }
  }
}

template <int D, int KB, int VB, bool VARIANTS>
__device__ void attend_piece(const PrefillParams& p, const Piece& pc, Smem<D>& sm) {
  QueryRows<D> qr;
  load_query<D>(p, pc, qr);
  Accumulators<D> acc;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc.o[n][0] = acc.o[n][1] = acc.o[n][2] = acc.o[n][3] = 0.f;
  acc.m[0] = acc.m[1] = -INFINITY;
  acc.l[0] = acc.l[1] = 0.f;
  Pending<D> pend;
  const int64_t begin = VARIANTS ? first_seen_tile(p, pc.first, kTile) : 0;
  // The tiles from which no row's window starts later (before: the window's mask)
  const int64_t unmasked_from = VARIANTS && p.sliding_window > 0 ? pc.limit - p.sliding_window : 0;
  if (begin < pc.limit) prefetch<D, KB, VB>(p, pc, begin, pend);
  for (int64_t t0 = begin; t0 < pc.limit; t0 += kTile) {
    __syncthreads();  // the previous tile (or piece) has been read
    store_tile<D>(p, pc, t0, pend, sm);
    __syncthreads();
    if (t0 + kTile < pc.limit) prefetch<D, KB, VB>(p, pc, t0 + kTile, pend);
    float s[kTile / 8][4];
    tile_scores<D, VARIANTS>(p, qr, sm, t0, t0 + kTile > pc.first || t0 < unmasked_from, s);
    softmax_update<D>(s, acc);
    accumulate_v<D>(s, sm, acc);
  }
  store_rows<D>(p, qr, acc);
}

// Grid: (CTA tiles of rows_per_cta flattened tokens, Hkv * head_chunks); the tiles run in reverse
// order, so that the last rows (the longest causal spans) start first. VARIANTS: a sliding window or
// soft cap (sinks need no flag: they enter when a row is stored).
template <int D, int KB, int VB, bool VARIANTS>
__global__ void __launch_bounds__(kThreads) prefill_tc_kernel(PrefillParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t misaligned = smem_u32(smem_raw) & (kSmemAlign - 1);
  Smem<D>& sm = *reinterpret_cast<Smem<D>*>(smem_raw + (misaligned ? kSmemAlign - misaligned : 0));
  build_luts(sm.lut, p.k_centroids, KB, p.v_centroids, VB);
  const CtaHeads heads = cta_heads(p);
  const int64_t tile_begin = int64_t(gridDim.x - 1 - blockIdx.x) * p.rows_per_cta;
  const int64_t tile_end = tile_begin + p.rows_per_cta < p.T ? tile_begin + p.rows_per_cta : p.T;
  for_each_piece(p, tile_begin, tile_end, [&](int64_t s, const PrefillRows& rows, int64_t a, int64_t b) {
    Piece pc;
    pc.s = s, pc.g = heads.g, pc.h0 = heads.h0, pc.hc = heads.hc, pc.rows = rows, pc.a = a, pc.b = b;
    pc.paged = paged_tokens(rows.seq_len, p.max_pages * p.page, p.W);
    pc.window = window_of(p, s);
    pc.limit = rows.causal_len(b - 1);
    pc.first = rows.causal_len(a);
    __syncthreads();  // the tables are built (first piece); the previous piece is done
    attend_piece<D, KB, VB, VARIANTS>(p, pc, sm);
  });
}

}  // namespace prefill_tc
}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_PREFILL_TENSOR_CORE_CUH_
