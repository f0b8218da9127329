// v3 and v4 split kernels for jax_tq_paged_decode: tensor-core (mma.sync m16n8k16, f16 in, f32
// accumulate) versions of the split kernel:
//   head_dim 64 or 128 (Dims<D>; v4's ring also: 80 / 96 as rows padded to 128, 256 as warp pairs
//   of two halves of 128, 192 as pairs of padded halves; see launch_wide in paged_decode.cu), K and
//   V of 2, 3 or 4 bits each, GQA tile GT in {4, 8} (padded to
//   the MMA's n = 8 heads; groups of 1 or 2 run in the 4-head tile). The layouts below are written
//   for head_dim 128 and 4-bit codes; at 64 a lane holds half the codes (K: (D/4)*t4.., V:
//   (D/8)*gid..), with half the k-steps and m-tiles, and the ring stores 32-byte rows in the order
//   ring_row64. 2- and 3-bit codes are spread to the same 4-bit nibbles when loaded (load_nibbles),
//   or, in v4's ring, turned into table keys of their own width (load_k_keys; 3-bit K and V at
//   head_dim 128 straight from the bit stream: k3_key_words, v3_key_words; 2- and 3-bit V in
//   tile_accumulate_v_b). The fused rotation: head_dim 64 and 128 (fused_rotation_head_dim).
// Chosen by plan_decode (jax_tq/decode_plan.h): v3 is the tensor-core float32-accurate kernel, v4
// the float16 one; the CUDA-core kernel serves every other configuration. v4 (at the end of this file) is
// v3's tile loop with 8 warps per CTA, for f16 products, with its tiles in registers or (RING, the
// default where it fits) in a per-warp cp.async ring; v3 keeps f32-accurate (hi / lo) products.
// v4's MASKS instantiations (ring, head_dim 64 / 128) add the sliding window (split ranges from the
// first visible token's page, the tokens before it masked with the norms) and the logit soft cap.
// History and measurements: docs/performance.md.
//
// Included by paged_decode.cu (whose handler launches these kernels); the helpers it uses
// (DecodeParams, token_row, fast_exp2, merge_warps_and_store, ...) are decode_device.cuh's.
//
// Contract (identical to the CUDA-core kernel's): same grid (num_splits * num_seqs, num_kv_heads * group_tiles),
// 128 threads (v4: 256; two items per CTA: 512 on a grid.y of half the rows), same per-split token range
// (paged_len: with a window, the pages' tokens only), same partial (o / l, m + log l) writes (or the
// final output when num_splits == 1 and there is no window: writes_partials), so the combine
// kernels apply unchanged. Tokens >=
// tok_end and block-table entries outside [0, P) never contribute: v3 never reads them; v4's
// one-page tiles read their codes from inside a real page (page 0 for an invalid id; no read past
// a pool) and give them weight 0 (finite centroids: 0 * c = 0). Empty splits write lse = -inf; a
// row with no valid token is exactly 0; pool addressing is int64.
//
// ---- Fragment layouts relied on (PTX ISA, mma.m16n8k16, .f16 A/B, .f32 C/D) ------------------
//   lane = 4 * gid + t4 (gid = groupID = lane >> 2, t4 = threadID_in_group = lane & 3).
//   A (16 x 16, row-major), four .f16x2 registers; the lower 16 bits hold the lower column:
//     a0: (row gid,     cols 2*t4, 2*t4+1)     a1: (row gid + 8, cols 2*t4, 2*t4+1)
//     a2: (row gid,     cols 2*t4+8, 2*t4+9)   a3: (row gid + 8, cols 2*t4+8, 2*t4+9)
//   B (16 x 8, "col"), two .f16x2 registers; lower 16 bits = lower row (k):
//     b0: (rows 2*t4, 2*t4+1, col gid)         b1: (rows 2*t4+8, 2*t4+9, col gid)
//   C / D (16 x 8, f32):
//     c0: (row gid, col 2*t4)  c1: (row gid, col 2*t4+1)
//     c2: (row gid+8, col 2*t4) c3: (row gid+8, col 2*t4+1)
//
// ---- K phase: S^T[16 tokens x 8 heads] = Kdec[16 x 128] * Q^T[128 x 8] ------------------------
//   Rows of A = tokens (identity: row r = token r of the 16-token tile). The contraction index is
//   PERMUTED (any permutation works as long as A and B agree): in k-step ks (0..7), k position
//   2*t4 + e (e = 0, 1) is coordinate 32*t4 + 4*ks + e and k position 2*t4 + 8 + e is coordinate
//   32*t4 + 4*ks + 2 + e. So lane (gid, t4) needs bytes 16*t4 .. 16*t4+15 of the 64-byte code
//   rows of tokens gid and gid + 8 (one 16-byte load each), and in step ks uses byte 2*ks
//   (-> a0 / a1) and byte 2*ks + 1 (-> a2 / a3): one byte = two consecutive coordinates
//   (low nibble = even coordinate = lower half), looked up in a 256-entry half2 table.
//   B = Q^T: lane needs q[head gid][32*t4 .. 32*t4+31], kept in registers (hi / lo f16 split).
//   Three MMAs per k-step: Khi*Qhi (own accumulator) + Khi*Qlo + Klo*Qhi (second accumulator).
//   Each head's q is pre-scaled by scale * log2(e) and a power of two so that |q| < 1 (no f16
//   overflow with huge logits); the power of two and the K norm are applied to the f32 scores.
//   S fragment: the lane holds tokens gid, gid + 8 for heads 2*t4, 2*t4 + 1.
//
// ---- softmax: per head in f32, lane state m / l for heads 2*t4, 2*t4 + 1 (m replicated over the
//   8 gid lanes, l a per-lane partial summed at the end); P = p * v_norm goes through a per-warp
//   16 x 8 shared tile to be re-read in the B layout of the V MMA (v3). v4 converts the lane's two
//   token rows of S^T to f16x2 and transposes each 8 x 8 half in registers (movmatrix), which gives
//   that B layout directly, with tokens in mma order (below).
//
// ---- V phase: O^T[128 dims x 8 heads] += Vdec^T[128 x 16 tokens] * P^T[16 tokens x 8 heads] ---
//   Eight m-tiles mt (16 output rows each). Both the rows and the contraction are PERMUTED:
//     row r of m-tile mt (r = gid + 8*h2)  ->  coordinate 16*gid + 2*mt + h2
//     k position 2*t4 + e   -> token 4*t4 + e,   k position 2*t4 + 8 + e -> token 4*t4 + 2 + e
//     (v3; v4: k position j -> token j, so its lanes read tokens 2t4, 2t4+1, 2t4+8, 2t4+9 where
//     the text below says 4t4 .. 4t4+3).
//   So lane (gid, t4) needs bytes 8*gid .. 8*gid+7 of the code rows of tokens 4*t4 .. 4*t4+3 (one
//   8-byte load each), and in m-tile mt byte mt of each: a0 = (low nibbles of tokens 4t4, 4t4+1),
//   a1 = (high nibbles of tokens 4t4, 4t4+1), a2 / a3 the same for tokens 4t4+2, 4t4+3, each a
//   lookup of the index (code_a | code_b << 4) in the same kind of 256-entry half2 table.
//   B = P^T: b0 = (P[4t4][gid], P[4t4+1][gid]), b1 = (P[4t4+2][gid], P[4t4+3][gid]), hi / lo.
//   O fragment: c0 / c2 = coordinates 16gid+2mt / +1 of head 2t4, c1 / c3 the same of head 2t4+1
//   (the same heads as the lane's softmax state: the rescale by alpha is lane-local).
//
// Each warp streams its own 16-token tiles (tile i -> warp i % 4; v4: i % 8), codes / norms loaded
// straight from global memory into registers one tile ahead (v4's ring variant: by cp.async into a
// per-warp shared-memory ring, 2-4 tiles ahead); no block barrier in the main loop; the
// warps are merged through shared memory at the end.
//
// Range: the V weights p * v_norm are taken relative to a running max that includes log2 v_norm,
// so they are <= 1 for any norm up to the float32 rounding of that max (v3: 2^(half the logits'
// float32 spacing), <= 2^8 below logits of 2^27; beyond f16's range they saturate) (v4: <= 2^8,
// its max moves lazily, see kLazyMax); contributions
// far below the running max lose relative (not absolute) precision in f16 subnormals. In particular, if EVERY token's V norm is below ~2^-14
// (6e-5) the weights are f16 subnormals: the output keeps an absolute error of ~1e-8 * |c| but
// its relative error grows (real V vectors have norms of order 1 and above).
#ifndef JAX_TQ_DECODE_TENSOR_CORE_CUH_
#define JAX_TQ_DECODE_TENSOR_CORE_CUH_

#include <cuda_fp16.h>

#include <cstdint>

#include "jax_tq/code_loads.cuh"
#include "jax_tq/decode_device.cuh"
#include "jax_tq/format.h"
#include "jax_tq/mma.cuh"

namespace jax_tq {
namespace cuda {
namespace {
namespace v3 {

constexpr int kNH = 8;      // MMA n: heads per tile (GT padded)
constexpr int kTT = 16;     // tokens per warp tile

// Per-head_dim geometry of the tile loop (D = 64 or 128; the layouts in the header comment are
// written for 128: a lane's K bytes are (D / 8) * t4 .. of a row, its V bytes (D / 16) * gid ..).
// Head_dim 256 runs as two halves of 128 coordinates (v4's warp pairs); Dims<256> serves its
// query staging only.
template <int D>
struct Dims {
  static_assert(D == 64 || D == 128 || D == 256, "tensor-core decode: head_dim 64, 128 or 256 (halves)");
  static constexpr int kKS = D / 16;   // K-phase k-steps = V-phase m-tiles
  static constexpr int kKW = D / 32;   // 32-bit words of a lane's K codes per token
  static constexpr int kVW = D / 64;   // 32-bit words of a lane's V codes per token
  static constexpr int kQL = D / 32;   // query coordinates per lane in the prologue
};

constexpr int kWRow = 10;   // padded row (floats) of the per-warp P tile: conflict-free B reads
constexpr int kCtasPerSm = 3;                 // residency the launch bounds and shared memory allow
constexpr int kSmemBytes = 256 * 256;  // interleaved K / V tables (o_s and the q staging alias them)

// (x0, x1) -> hi = f16x2(x0, x1) (x0 in the lower half), lo = f16x2 of the rounding residuals.
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  hi = h2_bits(h);
  lo = h2_bits(__floats2half2_rn(x0 - hf.x, x1 - hf.y));
}

// The 8 x 8 b16 matrix whose row lane / 4 holds this lane's x (elements 2 (lane % 4), +1), transposed in
// registers (the same fragment layout): the f16x2 weights of a token row of S^T's accumulator become
// the P^T B operand of the V MMA (tokens 2 (lane % 4), +1 of head lane / 4).
__device__ __forceinline__ uint32_t transpose8x8_b16(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// split2 with both parts saturated: identical for |x| <= 65504; a larger x gives a finite, too
// small pair instead of inf and -inf (whose products would make NaN).
__device__ __forceinline__ void split2_satfinite(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = half2_satfinite(x0, x1);
  const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  lo = half2_satfinite(x0 - hf.x, x1 - hf.y);
}

// Centroid-pair look-up tables, K and V interleaved: entry e (a code byte) = f16x2 (c[e & 15],
// c[e >> 4]), as {hi, lo} when SPLIT (f32-accurate products) or hi only. Entry e holds its K part
// at e*256 + [0, 128) and its V part at e*256 + [128, 256). Each 128-byte part holds 16 copies of
// the 8-byte {hi, lo} or 32 copies of the 4-byte hi, and lane l reads copy l & 15 (resp. l): every
// lane of a (half-)warp reads its own bank(s), so the random look-ups never conflict. A look-up's
// shared-memory offset is ONE byte permute: byte 0 = the lane's copy offset (+128 for V), byte 1 =
// the code byte, bytes 2-3 = 0.
// KQUAD / VQUAD (2-bit K / V codes in v4's ring): that part holds quad entries instead, 16 copies
// of 8 bytes: one look-up (quad) gives two adjacent registers of an MMA's A fragment (tile_dots,
// tile_accumulate_v_b). Entry e (a key of four codes: two nibbles of raw codes, pair_nibbles) of
// K's = {f16x2 (c[e & 3], c[(e >> 2) & 3]), f16x2 (c[(e >> 4) & 3], c[e >> 6])} (a nibble per
// register), of V's = {f16x2 (c[e & 3], c[(e >> 4) & 3]), f16x2 (c[(e >> 2) & 3], c[e >> 6])} (a
// nibble per half: one token's two coordinates are rows gid and gid + 8).
template <bool SPLIT, bool KQUAD = false, bool VQUAD = false>
struct PairLut {
  const uint8_t* table;
  uint32_t k_lane, v_lane;  // byte-0 offsets of this lane's copy in the K and V parts
  __device__ __forceinline__ PairLut(const uint8_t* smem, int lane)
      : table(smem),
        k_lane(SPLIT || KQUAD ? 8u * (lane & 15) : 4u * lane),
        v_lane(128u + (SPLIT || VQUAD ? 8u * (lane & 15) : 4u * lane)) {}
  // Shared-memory offset of the entry keyed by byte j (0..3) of `word` in the part at `lane_off`.
  __device__ __forceinline__ static uint32_t offset(uint32_t word, int j, uint32_t lane_off) {
    return __byte_perm(word, lane_off, 0x7604u | (static_cast<uint32_t>(j) << 4));
  }
  // The quad entry of byte j (0..3) of `word`, from the (quad) part at `lane_off`.
  __device__ __forceinline__ uint2 quad(uint32_t word, int j, uint32_t lane_off) const {
    return *reinterpret_cast<const uint2*>(table + offset(word, j, lane_off));
  }
  // Entry of byte j (0..3) of `word`, from the part at `lane_off` (k_lane or v_lane).
  __device__ __forceinline__ uint2 at(uint32_t word, int j, uint32_t lane_off) const {
    const uint32_t off = offset(word, j, lane_off);
    if constexpr (SPLIT) return *reinterpret_cast<const uint2*>(table + off);
    else return make_uint2(*reinterpret_cast<const uint32_t*>(table + off), 0u);
  }
};

// The 128-byte part of entry e of one table (is_v: the V part) filled with v: the thread's 16-byte
// stores rotated by thread so that a quarter warp's stores hit distinct banks.
__device__ __forceinline__ void store_lut_part(uint8_t* smem, int is_v, int e, uint4 v) {
  uint4* part = reinterpret_cast<uint4*>(smem + e * 256 + is_v * 128);
#pragma unroll
  for (int j = 0; j < 8; ++j) part[(j + threadIdx.x) & 7] = v;
}

// Entry e of one table (is_v: the V part) = f16x2 (c_lo, c_hi).
template <bool SPLIT>
__device__ __forceinline__ void store_lut_entry(uint8_t* smem, int is_v, int e, float c_lo, float c_hi) {
  uint32_t hi, lo;
  split2(c_lo, c_hi, hi, lo);
  store_lut_part(smem, is_v, e, SPLIT ? make_uint4(hi, lo, hi, lo) : make_uint4(hi, hi, hi, hi));
}

// Quad entry e of one table (is_v: the V part; PairLut's quad layout) from the 4 centroids c of its codes.
__device__ __forceinline__ void store_quad_entry(uint8_t* smem, int is_v, int e, const float (&c)[4]) {
  const uint32_t q01 = h2_bits(__floats2half2_rn(c[0], c[1])), q23 = h2_bits(__floats2half2_rn(c[2], c[3]));
  store_lut_part(smem, is_v, e, make_uint4(q01, q23, q01, q23));
}

// Fill both tables (T threads, 512 entries).
// (2- and 3-bit codes enter the tables as nibbles 0..3 / 0..7, see ldg_codes; entries of larger
// nibbles repeat centroids and are never read.)
template <bool SPLIT, int T = kThreads>
__device__ __forceinline__ void build_pair_luts(uint8_t* smem, const float* kcent, const float* vcent,
                                                int k_bits, int v_bits) {
  for (int i = threadIdx.x; i < 512; i += T) {
    const int is_v = i >> 8;
    const int e = i & 255;
    const float* cent = is_v ? vcent : kcent;
    const int mask = (1 << (is_v ? v_bits : k_bits)) - 1;
    store_lut_entry<SPLIT>(smem, is_v, e, cent[e & mask], cent[(e >> 4) & mask]);
  }
}

// The centroids of table entry e = threadIdx.x (< 256) of both tables, loaded at kernel start so
// that their latency overlaps the query loads instead of following them (v4: 256 threads, one K
// and one V entry each).
struct LutSeed {
  float k_lo, k_hi, v_lo, v_hi;
  float k_q2, k_q3, v_q2, v_q3;  // quad entries' second register (PairLut: K bits 4-5 and 6-7, V 2-3 and 6-7)
};

// k_shift / v_shift: the tables' key shift S (entry e = (c[e & M], c[(e >> S) & M]), see
// load_k_keys): 4 for nibble keys, the code width for keys taken straight from 2- / 3-bit codes;
// of a quad table, that of its entries' first register (K 2, V 4).
template <bool KQUAD = false, bool VQUAD = false>
__device__ __forceinline__ LutSeed load_lut_seed(const float* kcent, const float* vcent, int k_bits, int v_bits,
                                                 int k_shift, int v_shift) {
  const int e = threadIdx.x & 255;
  const int km = (1 << k_bits) - 1, vm = (1 << v_bits) - 1;
  LutSeed seed = {ld_early(kcent + (e & km)), ld_early(kcent + ((e >> k_shift) & km)), ld_early(vcent + (e & vm)),
                  ld_early(vcent + ((e >> v_shift) & vm)), 0.f, 0.f, 0.f, 0.f};
  if constexpr (KQUAD) seed.k_q2 = ld_early(kcent + ((e >> 4) & 3)), seed.k_q3 = ld_early(kcent + ((e >> 6) & 3));
  if constexpr (VQUAD) seed.v_q2 = ld_early(vcent + ((e >> 2) & 3)), seed.v_q3 = ld_early(vcent + ((e >> 6) & 3));
  return seed;
}

// Entry e of the K (is_v 0) or V table: a quad entry where QUAD, else a pair entry.
template <bool SPLIT, bool QUAD>
__device__ __forceinline__ void store_seed_entry(uint8_t* smem, int is_v, int e, const LutSeed& seed) {
  static_assert(!(SPLIT && QUAD), "quad entries: f16 products");
  const float lo = is_v ? seed.v_lo : seed.k_lo, hi = is_v ? seed.v_hi : seed.k_hi;
  if constexpr (QUAD) store_quad_entry(smem, is_v, e, {lo, hi, is_v ? seed.v_q2 : seed.k_q2, is_v ? seed.v_q3 : seed.k_q3});
  else store_lut_entry<SPLIT>(smem, is_v, e, lo, hi);
}

template <bool SPLIT, bool KQUAD = false, bool VQUAD = false>
__device__ __forceinline__ void build_pair_luts(uint8_t* smem, const LutSeed& seed) {
  store_seed_entry<SPLIT, KQUAD>(smem, 0, threadIdx.x & 255, seed);
  store_seed_entry<SPLIT, VQUAD>(smem, 1, threadIdx.x & 255, seed);
}

// Two items per CTA: item 0's 256 threads build the K table, item 1's the V table (entry e = tid).
template <bool SPLIT, bool KQUAD = false, bool VQUAD = false>
__device__ __forceinline__ void build_item_lut(uint8_t* smem, const LutSeed& seed, int item, int tid) {
  if (item == 0) store_seed_entry<SPLIT, KQUAD>(smem, 0, tid, seed);
  else store_seed_entry<SPLIT, VQUAD>(smem, 1, tid, seed);
}

// ---- pair keys: the v4 ring's K codes (and 2-bit V codes) without the spread to nibbles --------
// The tile loop looks up two codes with one byte, the table key: entry e of a table of key shift S
// is (c[e & M], c[(e >> S) & M]) (M = 2^bits - 1; the byte's other bits are ignored). Nibble
// words are keys of shift 4; 2- and 3-bit codes make keys of shift 2 / 3 with fewer instructions:
// K key word w of a lane holds the keys of its pairs 4w .. 4w + 3 (coordinates 2p, 2p + 1 of its
// chunk), one per byte, as nibble words do.

// The 4 keys (shift 3) of a 3-bit group (24 bits; bits above are ignored): pair p's 6 bits
// moved from bit 6p to byte p.
__device__ __forceinline__ uint32_t pair_keys3(uint32_t x) {
  x = (x & 0x0000FFFFu) | ((x << 4) & 0xFFFF0000u);   // pairs 2, 3 to bits 16, 22
  return (x & 0x003F003Fu) | ((x << 2) & 0xFFC0FFC0u);  // pairs 1, 3 to bits 8, 24
}

// K key words of a lane's 8N codes of width BITS at src (load_nibbles' chunk): 4-bit nibble words
// (shift 4); 2-bit: a word's 8 pairs are its nibbles, keys (shift 2) of the word and of it >> 4
// interleaved by a byte permute; 3-bit: pair_keys3 per group (shift 3).
// AL: src's alignment (load_nibbles).
template <int BITS, int N, class Mem, int AL = 16>
__device__ __forceinline__ void load_k_keys(const uint8_t* src, uint32_t (&w)[N]) {
  if constexpr (BITS == 4) {
    load_nibbles<4, N, Mem, AL>(src, w);
  } else if constexpr (BITS == 2) {
    static_assert(N == 2 || N == 4, "2-bit K chunks: 4 or 8 bytes");
    uint32_t raw[N / 2];
    load_words<N / 2, Mem, AL>(src, raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint32_t hi = raw[i] >> 4;
      w[2 * i] = __byte_perm(raw[i], hi, 0x5140u);
      w[2 * i + 1] = __byte_perm(raw[i], hi, 0x7362u);
    }
  } else {
    load_groups3<N, Mem, AL>(src, w);
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = pair_keys3(w[i]);
  }
}

// V codes of a lane's chunk for tile_accumulate_v: nibble words, or with BITS 2 the raw codes
// (D/8 codes = one word at head_dim 128, 16 bits at 64, in w[0]) from which it makes keys itself,
// or with V3 (3-bit codes, head_dim 128: N = 2) the 48 raw bits (load_stream3_48: w[0] bits 0-31,
// w[1] bits 32-47; v3_key_words).
template <int BITS, int N, class Mem, int AL = 16, bool V3 = false>
__device__ __forceinline__ void load_v_codes(const uint8_t* src, uint32_t (&w)[N]) {
  if constexpr (V3) {
    static_assert(BITS == 3 && N == 2, "3-bit V streams: chunks of 6 bytes");
    load_stream3_48<Mem, AL>(src, w[0], w[1]);
  } else if constexpr (BITS == 2) {
    static_assert(N == 1 || N == 2, "2-bit V chunks: 2 or 4 bytes");
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = 0u;
    w[0] = N == 2 ? Mem::template at<uint32_t>(src) : Mem::template at<unsigned short>(src);
  } else {
    load_nibbles<BITS, N, Mem, AL>(src, w);
  }
}

// ---- 3-bit codes looked up straight from their bit stream (v4's ring, head_dim 128) ------------
// A lane's 32 K codes of a token are 96 bits, three words s[0..2] (load_k_codes with K3); pair p
// (codes 2p, 2p + 1: one key of shift 3) is the 6 bits at 6p. Pairs p and p + 4 lie 24 bits apart,
// so one funnel shift of the stream puts both on byte boundaries (bytes 0 and 3 of the word), and
// pairs 0, 4, 8 and 12 already are (bits 0, 24, 48, 72): the 16 keys are bytes of s[0..2] and of six
// shifted words (k3_key_words), instead of pair_keys3's words (4 x 6 instructions) made from
// load_groups3's (3 more). Bits 6-7 of a key byte are the next pair's (or 0): the table ignores them.
__device__ __forceinline__ void k3_key_words(const uint32_t (&s)[4], uint32_t (&kw)[9]) {
  kw[0] = s[0];                              // pairs 0, 4 (bytes 0, 3)
  kw[1] = s[1];                              // pair 8 (byte 2)
  kw[2] = s[2];                              // pair 12 (byte 1)
  kw[3] = __funnelshift_r(s[0], s[1], 6);   // pairs 1, 5
  kw[4] = __funnelshift_r(s[0], s[1], 12);  // pairs 2, 6
  kw[5] = __funnelshift_r(s[0], s[1], 18);  // pairs 3, 7
  kw[6] = __funnelshift_r(s[1], s[2], 22);  // pairs 9, 13
  kw[7] = __funnelshift_r(s[1], s[2], 28);  // pairs 10, 14
  kw[8] = s[2] >> 2;                        // pairs 11, 15
}
// The word of k3_key_words (k3_key_word) and its byte (k3_key_byte) that hold pair p's key.
__host__ __device__ constexpr int k3_key_word(int p) {
  return (p & 3) != 0 ? 3 + 3 * (p >> 3) + (p & 3) - 1 : p < 8 ? 0 : p < 12 ? 1 : 2;
}
__host__ __device__ constexpr int k3_key_byte(int p) {
  return (p & 3) != 0 || p < 8 ? 3 * ((p >> 2) & 1) : p < 12 ? 2 : 1;
}

// (a & m) | (b & ~m) as one LOP3 (written in C, the compiler narrows the masks by the known zero
// bits of shifted operands and splits the select in two).
__device__ __forceinline__ uint32_t bit_select(uint32_t a, uint32_t b, uint32_t m) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
  return d;
}
// The nibbles of words a and b paired byte by byte: byte j of lo = (a's low nibble of byte j, b's
// low nibble above it), of hi the same of their high nibbles. One shift and one LOP3 each.
__device__ __forceinline__ void pair_nibbles(uint32_t a, uint32_t b, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kLow = 0x0F0F0F0Fu;
  lo = bit_select(a, b << 4, kLow);
  hi = bit_select(a >> 4, b, kLow);
}
// Bits b of a word whose stream positions first + b are the low code of a 6-bit pair (mod 6 < 3).
__host__ __device__ constexpr uint32_t low_code_bits3(int first) {
  uint32_t m = 0;
  for (int b = 0; b < 32; ++b)
    if ((first + b) % 6 < 3) m |= 1u << b;
  return m;
}
// V keys of shift 3 (tile_accumulate_v_b's V3) from the 48-bit streams (lo, hi) of two tokens x, y
// (a lane's 16 codes of V rows e, e + 1): the key of m-tile mt's row gid (coordinate 2mt of the
// chunk) is x[2mt] | y[2mt] << 3, of row gid + 8 x[2mt + 1] | y[2mt + 1] << 3: the even-row stream
// E = (x & L) | ((y << 3) & ~L) and the odd-row stream O = ((x >> 3) & L) | (y & ~L) (L: the low code
// of each pair) hold them at bit 6mt, and one funnel shift by 6k puts those of mt = k and k + 4 at
// bytes 0 and 3: ke[k] / ko[k] (k = mt & 3, byte 3 (mt >> 2)). 14 instructions for the 16 keys.
__device__ __forceinline__ void v3_key_words(uint32_t xl, uint32_t xh, uint32_t yl, uint32_t yh, uint32_t (&ke)[4],
                                             uint32_t (&ko)[4]) {
  constexpr uint32_t kLo = low_code_bits3(0), kHi = low_code_bits3(32);
  const uint32_t el = bit_select(xl, yl << 3, kLo), eh = bit_select(xh, __funnelshift_l(yl, yh, 3), kHi);
  const uint32_t ol = bit_select(__funnelshift_r(xl, xh, 3), yl, kLo), oh = bit_select(xh >> 3, yh, kHi);
  ke[0] = el, ko[0] = ol;
#pragma unroll
  for (int k = 1; k < 4; ++k) ke[k] = __funnelshift_r(el, eh, 6 * k), ko[k] = __funnelshift_r(ol, oh, 6 * k);
}

// K codes of a lane for tile_dots: load_k_keys' key words, or with QUAD (2-bit codes) the raw words
// (N / 2: a byte holds the codes of coordinates 4 b .. 4 b + 3, one quad look-up), or with K3
// (3-bit codes, N = 4) the 96 raw bits in w[0..2] (k3_key_words; w[3] = 0).
template <int BITS, int N, class Mem, int AL, bool QUAD, bool K3 = false>
__device__ __forceinline__ void load_k_codes(const uint8_t* src, uint32_t (&w)[N]) {
  if constexpr (QUAD) {
    static_assert(BITS == 2 && (N == 2 || N == 4), "quad keys: 2-bit K chunks of 4 or 8 bytes");
    load_words<N / 2, Mem, AL>(src, reinterpret_cast<uint32_t(&)[N / 2]>(w));
  } else if constexpr (K3) {
    static_assert(BITS == 3 && N == 4, "3-bit stream keys: K chunks of 12 bytes");
    load_stream3<Mem, AL>(src, w[0], w[1], w[2]);
    w[3] = 0u;
  } else {
    load_k_keys<BITS, N, Mem, AL>(src, w);
  }
}

// BITS 0: the width is the runtime `bits` (2, 3 or 4); otherwise BITS.
template <int BITS, int N>
__device__ __forceinline__ void ldg_codes(const uint8_t* src, int bits, uint32_t (&w)[N]) {
  if constexpr (BITS != 0) {
    load_nibbles<BITS, N, GlobalMem>(src, w);
  } else if (bits == 4) {
    load_nibbles<4, N, GlobalMem>(src, w);
  } else if (bits == 3) {
    load_nibbles<3, N, GlobalMem>(src, w);
  } else {
    load_nibbles<2, N, GlobalMem>(src, w);
  }
}

// One tile of a warp, held in registers: its codes as table keys (nibble words, see ldg_codes; in
// v4's ring, load_k_keys / load_v_codes).
template <int D>
struct Tile {
  uint32_t k0[Dims<D>::kKW], k1[Dims<D>::kKW];  // K codes (D/4)*t4 .. of tokens gid, gid + 8
  uint32_t v[4][Dims<D>::kVW];                  // V codes (D/8)*gid .. of tokens 4*t4 + e (v4: v4_v_token)
  float kn0, kn1;  // K norms of tokens gid, gid + 8 (NaN: token masked; v4's ring: as stored, see consume_tile)
  float vn0, vn1;  // V norms of tokens gid, gid + 8 (0 when masked; v4's ring: as stored)
};

// v4's one-page tile: its block-table entry (-1 past the split's end) and its first row inside the
// page (rows of the KV heads before its own, plus the tile's first token's offset in the page).
struct TilePage {
  int phys;
  int row_in_page;
};

// ---- pieces shared by the v3 and v4 kernels (identical code in both) ---------------------------

// q of the tile's query heads HPW * warp .. + HPW - 1 (0 past the group), and with the fused
// rotation (p.rot) the lane's words of Pi_k's spec: read at kernel start, before the tiles' copies,
// so that these few loads do not queue behind the copies.
// Padded rows (v4, head_dim 80 / 96 / 192): the staged row is D / DB blocks of DB coordinates whose
// first DV hold q's coordinates blk * DV .. (a row of (D / DB) * DV floats in p.q), the rest 0.
template <int D, int HPW>
struct QueryRows {
  float x[HPW][Dims<D>::kQL];  // coordinates kQL * lane .. of each head's staged row
  uint32_t rot[Dims<D>::kQL];  // the fused rotation's spec words kQL * lane ..
};

template <int D, int GT, int HPW, int DV = D, int DB = D>
__device__ __forceinline__ QueryRows<D, HPW> load_query_rows(const DecodeParams& p, int seq, int kvh, int tile,
                                                             int warp, int lane) {
  constexpr int QL = Dims<D>::kQL;
  constexpr int DQ = (D / DB) * DV;  // q's head_dim
  QueryRows<D, HPW> r = {};
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) {
    const int g = HPW * warp + hh;
    const int hl = tile * GT + g;
    if (g < GT && hl < p.G) {
      const float* qrow = p.q + (static_cast<int64_t>(seq) * p.H + kvh * p.G + hl) * DQ;
#pragma unroll
      for (int j = 0; j < QL; ++j) {
        const int at = QL * lane + j, blk = at / DB, c = at - blk * DB;
        if (DV == DB || c < DV) r.x[hh][j] = ld_early(qrow + blk * DV + c);
      }
    }
  }
  if constexpr (fused_rotation_head_dim(D) && DV == DB) {
    if (p.rot != nullptr) load_rot_words(p.rot, lane, r.rot);  // warp-uniform
  }
  return r;
}

// Staged q rows of 128 floats: 16-byte unit u of row r is stored at unit u ^ ((u >> 3) | (r & 1) << 2),
// so that query_fragments' float4 loads (a quarter warp: rows of one parity pair, units 8 t4 + ks)
// hit 8 distinct bank quads instead of one; a warp's stage_queries stores (one row, units = lanes)
// stay conflict-free.
__device__ __forceinline__ int q_swizzled_unit(int row, int unit) { return unit ^ ((unit >> 3) | (row & 1) << 2); }

// The rows of load_query_rows, rotated where the rotation is fused (rot_buf: D floats of the
// warp's shared memory), scaled by scale * log2(e) and then by a per-head power of two so that
// |q| < 1 (no f16 overflow with huge logits), into q_s [kNH][D]; the powers of two into qexp_s; 1
// into bad_s where the head's q_rot row is not all finite (its output row is NaN; the row is staged
// as zeros).
template <int D, int HPW, int DV = D, int DB = D>
__device__ __forceinline__ void stage_queries(const DecodeParams& p, QueryRows<D, HPW>& r, float* q_s,
                                              float* qexp_s, int* bad_s, int warp, int lane, float* rot_buf) {
  constexpr int QL = Dims<D>::kQL;  // coordinates QL * lane .. + QL - 1 of the row
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) {
    const int g = HPW * warp + hh;
    float (&x)[QL] = r.x[hh];
    if constexpr (fused_rotation_head_dim(D) && DV == DB) {
      if (p.rot != nullptr) rotate_row_forward(x, r.rot, rot_buf, lane);  // warp-uniform
    }
    bool lane_finite = true;
#pragma unroll
    for (int j = 0; j < QL; ++j) lane_finite = lane_finite && isfinite(x[j]);
    const bool finite = __all_sync(0xffffffffu, lane_finite);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < QL; ++j) {
      x[j] = finite ? x[j] * p.qscale : 0.f;
      amax = fmaxf(amax, fabsf(x[j]));
    }
    if (lane == 0) bad_s[g] = !finite;
    const float mx = warp_max(amax);
    int ex = 0;
    if (mx > 0.f && mx <= 3.0e38f) frexpf(mx, &ex);  // mx < 2^ex
    const float down = ldexpf(1.f, -ex);
    if constexpr (D == 128) {
      *reinterpret_cast<float4*>(q_s + g * D + 4 * q_swizzled_unit(g, lane)) =
          make_float4(x[0] * down, x[1] * down, x[2] * down, x[3] * down);
    } else {
#pragma unroll
      for (int j = 0; j < QL; ++j) q_s[g * D + QL * lane + j] = x[j] * down;
    }
    if (lane == 0) qexp_s[g] = ldexpf(1.f, ex);
  }
}

// o *= alpha of the fragment's head: c0 / c2 belong to head 2t4 (alpha[0]), c1 / c3 to 2t4 + 1.
template <int MT>
__device__ __forceinline__ void rescale_output(float (&o)[MT][4], const float (&alpha)[2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    o[mt][0] *= alpha[0];
    o[mt][2] *= alpha[0];
    o[mt][1] *= alpha[1];
    o[mt][3] *= alpha[1];
  }
}

// B fragments of Q^T: head gid, coordinates (D/4)*t4 + 4*ks + {0,1} (b0), {2,3} (b1), f16 hi / lo.
// q_s rows are `stride` floats apart (a warp pair's half: q_s at its first coordinate, stride 2D);
// rows of 128 floats in q_swizzled_unit order (stage_queries).
template <int D>
__device__ __forceinline__ void query_fragments(const float* q_s, int gid, int t4,
                                                uint32_t (&qh)[Dims<D>::kKS][2], uint32_t (&ql)[Dims<D>::kKS][2],
                                                int stride = D) {
  const bool swizzled = D == 128 && stride == 128;
  const float* qrow = q_s + gid * stride;
#pragma unroll
  for (int ks = 0; ks < Dims<D>::kKS; ++ks) {
    const int unit = (D / 16) * t4 + ks;
    const float4 v = *reinterpret_cast<const float4*>(qrow + 4 * (swizzled ? q_swizzled_unit(gid, unit) : unit));
    split2(v.x, v.y, qh[ks][0], ql[ks][0]);
    split2(v.z, v.w, qh[ks][1], ql[ks][1]);
  }
}

// Kdec * Q^T of one tile before the norms (tile_scores' fragment layout).
// K3: cur holds 3-bit K streams (load_k_codes' K3), looked up with keys of shift 3 (k3_key_words).
template <int D, bool SPLIT, bool KQUAD = false, bool VQ = false, bool K3 = false>
__device__ __forceinline__ void tile_dots(const Tile<D>& cur, const uint32_t (&qh)[Dims<D>::kKS][2],
                                          const uint32_t (&ql)[Dims<D>::kKS][2], const PairLut<SPLIT, KQUAD, VQ>& ilut,
                                          float (&s)[4]) {
  float sh[2][4] = {}, sx[2][4] = {};  // even / odd k-steps: two independent MMA chains (sx: SPLIT)
  const uint32_t (&ka)[Dims<D>::kKW] = cur.k0;
  const uint32_t (&kb)[Dims<D>::kKW] = cur.k1;
  static_assert(!K3 || (D == 128 && !SPLIT && !KQUAD), "3-bit stream keys: head_dim 128, f16");
  uint32_t wa[9], wb[9];  // K3: the key words of tokens gid, gid + 8
  if constexpr (K3) k3_key_words(ka, wa), k3_key_words(kb, wb);
#pragma unroll
  for (int ks = 0; ks < Dims<D>::kKS; ++ks) {
    if constexpr (K3) {
      // Pairs 2ks (coordinates 4ks, 4ks + 1: k 2t4, 2t4 + 1) and 2ks + 1 (k 2t4 + 8, + 9).
      const uint32_t a0 = ilut.at(wa[k3_key_word(2 * ks)], k3_key_byte(2 * ks), ilut.k_lane).x;
      const uint32_t a1 = ilut.at(wb[k3_key_word(2 * ks)], k3_key_byte(2 * ks), ilut.k_lane).x;
      const uint32_t a2 = ilut.at(wa[k3_key_word(2 * ks + 1)], k3_key_byte(2 * ks + 1), ilut.k_lane).x;
      const uint32_t a3 = ilut.at(wb[k3_key_word(2 * ks + 1)], k3_key_byte(2 * ks + 1), ilut.k_lane).x;
      const uint32_t ahi[4] = {a0, a1, a2, a3};
      mma16816(sh[ks & 1], ahi, qh[ks][0], qh[ks][1]);
      continue;
    }
    if constexpr (KQUAD) {
      // Raw byte ks of a token: coordinates 4ks, 4ks + 1 (k 2t4, 2t4 + 1) in its low nibble, 4ks + 2,
      // 4ks + 3 (k 2t4 + 8, + 9) in its high one. Keys: the low (high) nibbles of tokens gid and
      // gid + 8 side by side, so that one quad entry is a0, a1 (a2, a3): adjacent registers.
      uint32_t lo, hi;
      pair_nibbles(ka[ks >> 2], kb[ks >> 2], lo, hi);
      const uint2 e0 = ilut.quad(lo, ks & 3, ilut.k_lane), e1 = ilut.quad(hi, ks & 3, ilut.k_lane);
      const uint32_t ahi[4] = {e0.x, e0.y, e1.x, e1.y};
      mma16816(sh[ks & 1], ahi, qh[ks][0], qh[ks][1]);
      continue;
    }
    const int w = ks >> 1;
    const int j0 = (ks & 1) * 2;  // byte of the word: 2ks, then 2ks+1
    const uint2 t00 = ilut.at(ka[w], j0, ilut.k_lane);      // token gid,   byte 2ks
    const uint2 t01 = ilut.at(kb[w], j0, ilut.k_lane);      // token gid+8, byte 2ks
    const uint2 t10 = ilut.at(ka[w], j0 + 1, ilut.k_lane);  // token gid,   byte 2ks+1
    const uint2 t11 = ilut.at(kb[w], j0 + 1, ilut.k_lane);  // token gid+8, byte 2ks+1
    const uint32_t ahi[4] = {t00.x, t01.x, t10.x, t11.x};
    mma16816(sh[ks & 1], ahi, qh[ks][0], qh[ks][1]);
    if constexpr (SPLIT) {
      const uint32_t alo[4] = {t00.y, t01.y, t10.y, t11.y};
      mma16816(sx[ks & 1], ahi, ql[ks][0], ql[ks][1]);
      mma16816(sx[ks & 1], alo, qh[ks][0], qh[ks][1]);
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    s[c] = sh[0][c] + sh[1][c];
    if constexpr (SPLIT) s[c] += sx[0][c] + sx[1][c];
  }
}

// The dot products s of tile_dots times the heads' powers of two and the K norms, in log2 units;
// a masked token (NaN norm) or a NaN product gives -inf.
template <int D>
__device__ __forceinline__ void scale_scores(const Tile<D>& cur, float qx0, float qx1, float (&s)[4]) {
  s[0] *= qx0 * cur.kn0;
  s[1] *= qx1 * cur.kn0;
  s[2] *= qx0 * cur.kn1;
  s[3] *= qx1 * cur.kn1;
#pragma unroll
  for (int c = 0; c < 4; ++c)
    if (!(s[c] > -INFINITY)) s[c] = -INFINITY;  // masked token (NaN norm) or NaN: no weight
}

// The dot products of tile_dots times the K norms (per token; v4: the heads' powers of two and the
// -inf of masked tokens follow in SoftmaxState::weigh<true>).
template <int D>
__device__ __forceinline__ void norm_scores(const Tile<D>& cur, float (&s)[4]) {
  s[0] *= cur.kn0;
  s[1] *= cur.kn0;
  s[2] *= cur.kn1;
  s[3] *= cur.kn1;
}

// The MASKS kernels' scores: scale_scores' products with the logit soft cap (p.soft_cap_log2 > 0)
// applied, a NaN left NaN (soft_capped_fast keeps it; consume_tile makes it -inf).
template <int D>
__device__ __forceinline__ void capped_scores(const DecodeParams& p, const Tile<D>& cur, float qx0, float qx1,
                                              float (&s)[4]) {
  s[0] *= qx0 * cur.kn0;
  s[1] *= qx1 * cur.kn0;
  s[2] *= qx0 * cur.kn1;
  s[3] *= qx1 * cur.kn1;
  if (p.soft_cap_log2 > 0.f) {  // CTA-uniform
#pragma unroll
    for (int c = 0; c < 4; ++c) s[c] = soft_capped_fast(s[c], p.soft_cap_log2, p.soft_cap_inv);
  }
}

// S^T = Kdec * Q^T for one tile, in log2 units: s[0] (token gid, head 2t4), s[1] (gid, 2t4+1),
// s[2] (gid+8, 2t4), s[3] (gid+8, 2t4+1); a masked token (NaN norm) or a NaN product gives -inf.
template <int D, bool SPLIT>
__device__ __forceinline__ void tile_scores(const Tile<D>& cur, const uint32_t (&qh)[Dims<D>::kKS][2],
                                            const uint32_t (&ql)[Dims<D>::kKS][2], float qx0, float qx1,
                                            const PairLut<SPLIT>& ilut, float (&s)[4]) {
  tile_dots<D, SPLIT>(cur, qh, ql, ilut, s);
  scale_scores<D>(cur, qx0, qx1, s);
}

// The V MMAs of tile_accumulate_v from nibble words: B = (ph, pl). V4: the words are raw 4-bit
// codes, paired by pair_nibbles (with 3-bit codes spread to nibbles, the compiler pairs the C
// expression's known-zero bits in fewer instructions).
template <int D, bool SPLIT, bool KQ = false, bool VQ = false, bool V4 = false>
__device__ __forceinline__ void tile_accumulate_v_nibbles(const uint32_t (&v)[4][Dims<D>::kVW], uint32_t ph0,
                                                          uint32_t pl0, uint32_t ph1, uint32_t pl1,
                                                          const PairLut<SPLIT, KQ, VQ>& ilut, float (&o)[Dims<D>::kKS][4]) {
  constexpr int VW = Dims<D>::kVW;
  uint32_t lo01[VW], hi01[VW], lo23[VW], hi23[VW];  // byte mt of word (mt >> 2): table indices
#pragma unroll
  for (int wd = 0; wd < VW; ++wd) {
    const uint32_t x0 = v[0][wd];
    const uint32_t x1 = v[1][wd];
    const uint32_t x2 = v[2][wd];
    const uint32_t x3 = v[3][wd];
    if constexpr (V4) {
      pair_nibbles(x0, x1, lo01[wd], hi01[wd]);
      pair_nibbles(x2, x3, lo23[wd], hi23[wd]);
    } else {
      lo01[wd] = (x0 & 0x0F0F0F0Fu) | ((x1 & 0x0F0F0F0Fu) << 4);
      hi01[wd] = ((x0 >> 4) & 0x0F0F0F0Fu) | (x1 & 0xF0F0F0F0u);
      lo23[wd] = (x2 & 0x0F0F0F0Fu) | ((x3 & 0x0F0F0F0Fu) << 4);
      hi23[wd] = ((x2 >> 4) & 0x0F0F0F0Fu) | (x3 & 0xF0F0F0F0u);
    }
  }
#pragma unroll
  for (int mt = 0; mt < Dims<D>::kKS; ++mt) {
    const int wd = mt >> 2;
    const int jb = mt & 3;
    const uint2 e0 = ilut.at(lo01[wd], jb, ilut.v_lane);  // row gid   (coord 16gid+2mt),   tok 4t4+{0,1}
    const uint2 e1 = ilut.at(hi01[wd], jb, ilut.v_lane);  // row gid+8 (coord 16gid+2mt+1), tok 4t4+{0,1}
    const uint2 e2 = ilut.at(lo23[wd], jb, ilut.v_lane);  // row gid,   tok 4t4+{2,3}
    const uint2 e3 = ilut.at(hi23[wd], jb, ilut.v_lane);  // row gid+8, tok 4t4+{2,3}
    const uint32_t ahi[4] = {e0.x, e1.x, e2.x, e3.x};
    mma16816(o[mt], ahi, ph0, ph1);
    if constexpr (SPLIT) {
      const uint32_t alo[4] = {e0.y, e1.y, e2.y, e3.y};
      mma16816(o[mt], ahi, pl0, pl1);
      mma16816(o[mt], alo, ph0, ph1);
    }
  }
}

// The V MMAs of one tile with P^T's B fragments given: (ph0, pl0) for the k positions of the lane's
// V rows 0, 1 and (ph1, pl1) for rows 2, 3 (hi / lo, lo 0 unless SPLIT).
// V2: v holds raw 2-bit codes (load_v_codes), looked up with keys of shift 2. V3: 3-bit streams
// (load_v_codes' V3), looked up with keys of shift 3 (v3_key_words). V4: raw 4-bit nibble words.
template <int D, bool SPLIT, bool V2, bool KQ = false, bool VQ = false, bool V3 = false, bool V4 = false>
__device__ __forceinline__ void tile_accumulate_v_b(const uint32_t (&v)[4][Dims<D>::kVW], uint32_t ph0, uint32_t pl0,
                                                    uint32_t ph1, uint32_t pl1, const PairLut<SPLIT, KQ, VQ>& ilut,
                                                    float (&o)[Dims<D>::kKS][4]) {
  if constexpr (V3) {
    static_assert(D == 128 && !SPLIT && !V2 && !VQ, "3-bit V streams: head_dim 128, f16");
    uint32_t e01[4], o01[4], e23[4], o23[4];  // rows gid / gid + 8 of tokens (0, 1) and (2, 3)
    v3_key_words(v[0][0], v[0][1], v[1][0], v[1][1], e01, o01);
    v3_key_words(v[2][0], v[2][1], v[3][0], v[3][1], e23, o23);
#pragma unroll
    for (int mt = 0; mt < Dims<D>::kKS; ++mt) {
      const int k = mt & 3, jb = 3 * (mt >> 2);
      const uint32_t ahi[4] = {ilut.at(e01[k], jb, ilut.v_lane).x, ilut.at(o01[k], jb, ilut.v_lane).x,
                               ilut.at(e23[k], jb, ilut.v_lane).x, ilut.at(o23[k], jb, ilut.v_lane).x};
      mma16816(o[mt], ahi, ph0, ph1);
    }
  } else if constexpr (V2) {
    // Nibble mt of a raw word holds coordinates 2mt (bits 0-1) and 2mt + 1 (bits 2-3). Pair keys:
    // the even / odd coordinate for tokens (0, 1) and (2, 3) in nibble mt, then byte mt >> 1 of
    // the word (mt even) or of the word >> 4 (mt odd).
    constexpr uint32_t kEven = 0x33333333u;
    const uint32_t x0 = v[0][0], x1 = v[1][0], x2 = v[2][0], x3 = v[3][0];
    if constexpr (VQ) {
      // Quad keys: nibble mt of two tokens' raw words side by side, in byte mt >> 1 of
      // pair_nibbles' lo (mt even) or hi (mt odd): the V quad entry (PairLut) a0, a1 of tokens 0, 1,
      // or a2, a3 of tokens 2, 3.
      uint32_t q01[2], q23[2];
      pair_nibbles(x0, x1, q01[0], q01[1]);
      pair_nibbles(x2, x3, q23[0], q23[1]);
#pragma unroll
      for (int mt = 0; mt < Dims<D>::kKS; ++mt) {
        const uint2 e0 = ilut.quad(q01[mt & 1], mt >> 1, ilut.v_lane), e1 = ilut.quad(q23[mt & 1], mt >> 1, ilut.v_lane);
        const uint32_t ahi[4] = {e0.x, e0.y, e1.x, e1.y};
        mma16816(o[mt], ahi, ph0, ph1);
      }
    } else {
      const uint32_t ev01 = (x0 & kEven) | ((x1 << 2) & ~kEven), od01 = ((x0 >> 2) & kEven) | (x1 & ~kEven);
      const uint32_t ev23 = (x2 & kEven) | ((x3 << 2) & ~kEven), od23 = ((x2 >> 2) & kEven) | (x3 & ~kEven);
      const uint32_t keys[2][4] = {{ev01, od01, ev23, od23}, {ev01 >> 4, od01 >> 4, ev23 >> 4, od23 >> 4}};
#pragma unroll
      for (int mt = 0; mt < Dims<D>::kKS; ++mt) {
        const uint32_t (&k)[4] = keys[mt & 1];
        const int jb = mt >> 1;
        const uint32_t ahi[4] = {ilut.at(k[0], jb, ilut.v_lane).x, ilut.at(k[1], jb, ilut.v_lane).x,
                                 ilut.at(k[2], jb, ilut.v_lane).x, ilut.at(k[3], jb, ilut.v_lane).x};
        mma16816(o[mt], ahi, ph0, ph1);
      }
    }
  } else {
    tile_accumulate_v_nibbles<D, SPLIT, KQ, VQ, V4>(v, ph0, pl0, ph1, pl1, ilut, o);
  }
}

// O^T += Vdec^T * P^T for one tile (v3); P (the V weights) from the warp's tile wt: [kTT][kWRow].
template <int D, bool SPLIT>
__device__ __forceinline__ void tile_accumulate_v(const uint32_t (&v)[4][Dims<D>::kVW], const float* wt, int gid,
                                                  int t4, const PairLut<SPLIT>& ilut,
                                                  float (&o)[Dims<D>::kKS][4]) {
  auto w = [&](int e) { return wt[(4 * t4 + e) * kWRow + gid]; };
  // B of the V MMA: head gid, tokens 4t4 + {0,1} (b0), 4t4 + {2,3} (b1).
  uint32_t ph0, pl0 = 0u, ph1, pl1 = 0u;
  if constexpr (SPLIT) {  // v3's weights may pass 65504 at logits beyond 2^28 (header: Range)
    split2_satfinite(w(0), w(1), ph0, pl0);
    split2_satfinite(w(2), w(3), ph1, pl1);
  } else {
    ph0 = half2_satfinite(w(0), w(1));
    ph1 = half2_satfinite(w(2), w(3));
  }
  tile_accumulate_v_b<D, SPLIT, false>(v, ph0, pl0, ph1, pl1, ilut, o);
}

// Coordinate dd of row g of the fused epilogues' o_s (head_dim D): o_swizzled at 128, plain at 64.
template <int D>
__device__ __forceinline__ int o_row_at(int g, int dd) {
  return D == 128 ? o_swizzled(g, dd) : g * D + dd;
}

// merge_tile_state's fused-rotation epilogue (head_dim D = 64 / 128, one split, no window).
// rot_v_s: Pi_v's spec words in shared memory (a lane's N as one vector), or null: read from p.rot.
template <int D, int GT, int W>
__device__ __forceinline__ void merge_rotate_and_store(const DecodeParams& p, float (&m_s)[W][kNH],
                                                       float (&l_s)[W][kNH], float (&o_s)[W][kNH * D],
                                                       const int* bad_s, int warp, int gid, int t4, int seq,
                                                       int split, int kvh, int tile, float* rot_buf,
                                                       const LaneWords<D / 32>* rot_v_s) {
  constexpr int N = D / 32;  // coordinates per lane
  static_assert((W * kNH + GT) * D * 4 <= kSmemBytes, "the fused rotation's rows after o_s");
  float* rows_s = &o_s[0][0] + W * kNH * D;
  merge_warps_and_store<D, GT, kNH, W, 32 * W, D == 128>(p, m_s, l_s, o_s, bad_s, seq, split, kvh, tile, rows_s);
  __syncthreads();
  const int lane = 4 * gid + t4;
  for (int g = warp; g < GT && tile * GT + g < p.G; g += W) {  // v3: 4 warps, up to 8 rows
    float x[N];
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = rows_s[g * D + N * lane + j];
    if (rot_v_s != nullptr) {
      uint32_t w[N];
      rot_words_of(rot_v_s[lane], w);
      rotate_row_inverse(x, w, rot_buf, lane);
    } else {
      rotate_row_inverse(x, p.rot + D, rot_buf, lane);
    }
    store_lane_coords(p.out + (static_cast<int64_t>(seq) * p.H + kvh * p.G + tile * GT + g) * D, lane, x);
  }
}

// The fused epilogue for a CTA of several items (merge_tile_state's FAST): after the warps' states
// are in shared memory, warp g merges head g's row over the W warps itself (each lane its N
// coordinates), rotates it back and stores it: no merged-rows pass and its barrier.
template <int D, int GT, int W>
__device__ __forceinline__ void merge_rotate_per_warp(const DecodeParams& p, float (&m_s)[W][kNH],
                                                      float (&l_s)[W][kNH], float (&o_s)[W][kNH * D],
                                                      const int* bad_s, int warp, int lane, int seq, int kvh,
                                                      int tile, float* rot_buf, const LaneWords<D / 32>* rot_v_s,
                                                      unsigned trace_cta = ~0u) {
  constexpr int N = D / 32;
  bool stamped = false;
  for (int g = warp; g < GT && tile * GT + g < p.G; g += W) {
    float M = m_s[0][g];
#pragma unroll
    for (int w = 1; w < W; ++w) M = fmaxf(M, m_s[w][g]);
    float L = 0.f, x[N] = {};
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float f = fast_exp2(m_s[w][g] - M);  // m = -inf -> 0 (its l and o are 0)
        L = fmaf(l_s[w][g], f, L);
        float ow[N];
        load_lane_coords(&o_s[w][o_row_at<D>(g, N * lane)], 0, ow);  // the lane's N coordinates
#pragma unroll
        for (int j = 0; j < N; ++j) x[j] = fmaf(ow[j], f, x[j]);
      }
    }
    {
      // head_output_value with one division for the lane's N coordinates (f16-product kernels:
      // x * (1 / L) is within an ulp of x / L)
      const bool bad = bad_s[g] != 0;
      const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
      for (int j = 0; j < N; ++j) x[j] = bad ? __int_as_float(0x7fc00000) : L > 0.f ? x[j] * inv : 0.f;
    }
    if (!stamped) trace_phase(p, trace_cta, warp, lane, 7);
    uint32_t words[N];
    rot_words_of(rot_v_s[lane], words);
    rotate_row_inverse(x, words, rot_buf, lane);
    if (!stamped) trace_phase(p, trace_cta, warp, lane, 8);
    stamped = true;
    store_lane_coords(p.out + (static_cast<int64_t>(seq) * p.H + kvh * p.G + tile * GT + g) * D, lane, x);
  }
  if (!stamped) {
    trace_phase(p, trace_cta, warp, lane, 7);
    trace_phase(p, trace_cta, warp, lane, 8);
  }
}

// After a warp-independent tile loop: each warp's (m, l, o) into shared memory (o_s reuses the
// tables: every warp must be past its loop), merged over the W warps and stored. With the fused
// rotation and one split, the merged rows go to the table space after o_s and warp w rotates rows
// w, w + W, ... back (out = Pi_v^T o_rot, head_dim 64 / 128; rot_buf: the warp's D floats, free
// after its loop;
// rot_v_s: Pi_v's spec words staged in shared memory, or null to read them from p.rot).
// Warp pairs (HALVES = 2): `warp` is the pair (one of W), whose two warps hold the same m and l and
// the coordinates half * DV .. of o (DV = D / HALVES). A tile of DW > DV coordinates (padded rows)
// holds DV real ones. FAST: the fused epilogue by merge_rotate_per_warp (with rot_v_s).
template <int D, int GT, int W, int DW = D, int HALVES = 1, bool FAST = false>
__device__ __forceinline__ void merge_tile_state(const DecodeParams& p, const float (&o)[Dims<DW>::kKS][4],
                                                 const float (&m)[2], float (&l)[2],
                                                 float (&o_s)[W][kNH * D], float (&m_s)[W][kNH],
                                                 float (&l_s)[W][kNH], const int* bad_s, int warp, int gid,
                                                 int t4, int seq, int split, int kvh, int tile, float* rot_buf,
                                                 int half = 0, const LaneWords<D / 32>* rot_v_s = nullptr,
                                                 unsigned trace_cta = ~0u) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], off);
  }
  __syncthreads();
  const int trace_warp = warp * HALVES + half;  // the kernel's warp (pairs: `warp` is the pair)
  trace_phase(p, trace_cta, trace_warp, 4 * gid + t4, 5);
  // Head_dim 128 in one warp: o_swizzled rows, float4 stores of the GT real heads (the lane's
  // coordinates 16 gid + 4 j .. + 3 are o[2 j][hh], o[2 j][2 + hh], o[2 j + 1][hh], o[2 j + 1][2 + hh]).
  constexpr bool kSwz = D == 128 && DW == 128 && HALVES == 1;
  constexpr bool kFusedRows = fused_rotation_head_dim(D) && DW == D && HALVES == 1;  // the fused epilogues' rows
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    constexpr int DV = D / HALVES;
    if constexpr (kSwz) {
      const int h = 2 * t4 + hh;
      if (h < GT) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<float4*>(&o_s[warp][o_swizzled(h, 16 * gid + 4 * j)]) =
              make_float4(o[2 * j][hh], o[2 * j][2 + hh], o[2 * j + 1][hh], o[2 * j + 1][2 + hh]);
      }
    } else {
      float* orow = &o_s[warp][(2 * t4 + hh) * D + half * DV + (DW / 8) * gid];
      if (DV == DW || (DW / 8) * gid < DV) {
#pragma unroll
        for (int mt = 0; mt < Dims<DW>::kKS; ++mt)
          *reinterpret_cast<float2*>(orow + 2 * mt) = make_float2(o[mt][hh], o[mt][2 + hh]);
      }
    }
    if (gid == 0 && half == 0) {
      m_s[warp][2 * t4 + hh] = m[hh];
      l_s[warp][2 * t4 + hh] = l[hh];
    }
  }
  __syncthreads();
  trace_phase(p, trace_cta, trace_warp, 4 * gid + t4, 6);
  // The other epilogues stamp the per-warp epilogue's two inner phases at their end.
  auto stamp_inner = [&]() {
    trace_phase(p, trace_cta, trace_warp, 4 * gid + t4, 7);
    trace_phase(p, trace_cta, trace_warp, 4 * gid + t4, 8);
  };
  if (!kFusedRows || p.rot == nullptr || writes_partials(p)) {
    merge_warps_and_store<D, GT, kNH, W, 32 * W * HALVES, kSwz>(p, m_s, l_s, o_s, bad_s, seq, split, kvh, tile);
    stamp_inner();
    return;
  }
  if constexpr (kFusedRows && FAST) {
    if (rot_v_s != nullptr) {
      merge_rotate_per_warp<D, GT, W>(p, m_s, l_s, o_s, bad_s, warp, 4 * gid + t4, seq, kvh, tile, rot_buf, rot_v_s,
                                   trace_cta);
      return;
    }
  }
  if constexpr (kFusedRows)
    merge_rotate_and_store<D, GT, W>(p, m_s, l_s, o_s, bad_s, warp, gid, t4, seq, split, kvh, tile, rot_buf, rot_v_s);
  stamp_inner();
}

// SPLIT: q, P and the centroids enter the MMAs as f16 hi + lo (3 MMAs per product, ~f32 accurate);
// otherwise as f16 (1 MMA; relative error ~2^-11 per product term, for bf16 / f16 queries).
// With one-page tiles the page id of a warp's next-but-one tile is read one iteration ahead, so the
// code loads of its next tile never wait for a block-table read first (one memory latency per tile
// instead of two).
// KB / VB: the K / V code width (2, 3 or 4), or 0: the runtime p.k_bits / p.v_bits (ldg_codes).
template <int D, int GT, bool SPLIT, int KB = 4, int VB = 4>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    decode_tc_f32_kernel(const DecodeParams p) {
  static_assert(GT == 4 || GT == 8, "v3: GT in {4, 8}");
  static_assert(kNH == 2 * kWarps, "prologue: two heads per warp");
  static_assert(kWarps * kNH * D * 4 <= kSmemBytes, "o_s must fit in the table space");
  constexpr int KS = Dims<D>::kKS;
  const int krow = D * (KB ? KB : p.k_bits) / 8, vrow = D * (VB ? VB : p.v_bits) / 8;  // code bytes per row

  extern __shared__ __align__(16) uint8_t smem[];  // kSmemBytes: interleaved K / V tables
  __shared__ float qexp_s[kNH];
  __shared__ int bad_s[kNH];  // heads whose q_rot row is not all finite (NaN output rows)
  __shared__ float w_s[kWarps][kTT * kWRow];
  __shared__ float m_s[kWarps][kNH];
  __shared__ float l_s[kWarps][kNH];
  auto& o_s = *reinterpret_cast<float(*)[kWarps][kNH * D]>(smem);  // after the main loop only

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int t4 = lane & 3;
  const int ns = p.num_splits;
  const int seq = blockIdx.x / ns;
  const int split = blockIdx.x - seq * ns;
  const int kvh = blockIdx.y / p.ntiles;
  const int tile = blockIdx.y - kvh * p.ntiles;

  // ---- token range of this split (identical to v1) ------------------------------------------
  const SplitRange range = split_range(paged_len(p, p.sl[seq]), p.max_pages, p.page_size, ns, split);
  const int tok0 = static_cast<int>(range.tok_begin);
  const int tok_end = static_cast<int>(range.tok_end);
  const int ntok = tok_end > tok0 ? tok_end - tok0 : 0;
  const int ntt = (ntok + kTT - 1) / kTT;
  const int32_t* bt_seq = p.bt + static_cast<int64_t>(seq) * p.max_pages;

  // ---- prologue: q (scaled, per-head power of two) staged in the table space, then the tables -
  float* q_s = reinterpret_cast<float*>(smem);
  QueryRows<D, 2> qrows = load_query_rows<D, GT, 2>(p, seq, kvh, tile, warp, lane);
  stage_queries<D, 2>(p, qrows, q_s, qexp_s, bad_s, warp, lane, w_s[warp]);
  __syncthreads();
  uint32_t qh[KS][2], ql[KS][2];
  query_fragments<D>(q_s, gid, t4, qh, ql);
  const float qx0 = qexp_s[2 * t4], qx1 = qexp_s[2 * t4 + 1];
  __syncthreads();  // q_s consumed by every warp: the tables may overwrite it
  build_pair_luts<SPLIT>(smem, p.kcent, p.vcent, p.k_bits, p.v_bits);
  __syncthreads();
  const PairLut<SPLIT> ilut(smem, lane);

  // Split ranges start on a page boundary, so with page_size a multiple of 16 every 16-token
  // tile lies in one page: one block-table read per tile, rows row0 + t.
  const bool one_page_tiles = (p.page_size & (kTT - 1)) == 0;
  auto tile_page = [&](int ti) -> int {  // physical page of tile ti (one_page_tiles), -1 past the end
    return ti < ntt ? __ldg(bt_seq + p.pdiv.div(static_cast<uint32_t>(tok0 + ti * kTT))) : -1;
  };
  // phys: tile ti's physical page, read ahead by the caller (used with one_page_tiles only).
  auto load = [&](int ti, Tile<D>& t, int phys) {
    t = Tile<D>{};
    t.kn0 = t.kn1 = __int_as_float(0x7fc00000);  // NaN: score -> -inf
    if (ti >= ntt) return;
    const int base = tok0 + ti * kTT;
    int64_t r0, r1, rv[4];
    if (one_page_tiles) {
      const uint32_t lp = p.pdiv.div(static_cast<uint32_t>(base));
      const bool page_ok = phys >= 0 && phys < p.P;
      const int64_t row0 = (static_cast<int64_t>(phys) * p.Hkv + kvh) * p.page_size +
                           (base - static_cast<int>(lp) * p.page_size);
      const int n = page_ok ? tok_end - base : 0;  // valid tokens of this tile (may exceed 16)
      r0 = gid < n ? row0 + gid : -1;
      r1 = gid + 8 < n ? row0 + gid + 8 : -1;
#pragma unroll
      for (int e = 0; e < 4; ++e) rv[e] = 4 * t4 + e < n ? row0 + 4 * t4 + e : -1;
    } else {
      r0 = token_row(p, bt_seq, base + gid, tok_end, kvh);
      r1 = token_row(p, bt_seq, base + gid + 8, tok_end, kvh);
#pragma unroll
      for (int e = 0; e < 4; ++e) rv[e] = token_row(p, bt_seq, base + 4 * t4 + e, tok_end, kvh);
    }
    if (r0 >= 0) {
      ldg_codes<KB>(p.kc + r0 * krow + (krow / 4) * t4, p.k_bits, t.k0);
      t.kn0 = __ldg(p.kn + r0);
      t.vn0 = __ldg(p.vn + r0);
    }
    if (r1 >= 0) {
      ldg_codes<KB>(p.kc + r1 * krow + (krow / 4) * t4, p.k_bits, t.k1);
      t.kn1 = __ldg(p.kn + r1);
      t.vn1 = __ldg(p.vn + r1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (rv[e] >= 0) ldg_codes<VB>(p.vc + rv[e] * vrow + (vrow / 8) * gid, p.v_bits, t.v[e]);
  };

  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  float o[KS][4];
#pragma unroll
  for (int mt = 0; mt < KS; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[mt][c] = 0.f;

  float* wt = w_s[warp];
  Tile<D> cur, nxt;
  int phys_next = one_page_tiles ? tile_page(warp + kWarps) : -1;
  load(warp, cur, one_page_tiles ? tile_page(warp) : -1);

#pragma unroll 1
  for (int ti = warp; ti < ntt; ti += kWarps) {
    load(ti + kWarps, nxt, phys_next);
    if (one_page_tiles) phys_next = tile_page(ti + 2 * kWarps);

    // ---- S^T = Kdec * Q^T ------------------------------------------------------------------
    float s[4];
    tile_scores<D, SPLIT>(cur, qh, ql, qx0, qx1, ilut, s);

    // ---- online softmax (f32), heads 2t4 + hh ----------------------------------------------
    // The V MMA weight of a token is p * v_norm = +-exp2(s + log2 |v_norm| - m): the running max
    // m covers s and s + log2 |v_norm|, so every |weight| (and p) is <= 1 and fits f16 for any
    // norm; the sign is the norm's, and a NaN norm gives a NaN weight (as in the reference).
    // l sums exp2(s - m) against the same m.
    const float lv0 = __log2f(fabsf(cur.vn0));  // 0 (masked) -> -inf: weight 0
    const float lv1 = __log2f(fabsf(cur.vn1));
    __syncwarp();  // previous tile's P reads are done
    float alpha[2];
    bool grew = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float ua = s[hh] + lv0, ub = s[2 + hh] + lv1;
      float tm = fmaxf(fmaxf(s[hh], s[2 + hh]), fmaxf(ua, ub));
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, off));
      const float mn = fmaxf(m[hh], tm);
      const bool any = mn > -INFINITY;
      grew |= m[hh] > -INFINITY && mn > m[hh];              // o != 0 needs rescaling
      alpha[hh] = any ? fast_exp2(m[hh] - mn) : 1.f;        // m = -inf -> 0
      const float pa = any ? fast_exp2(s[hh] - mn) : 0.f;   // s = -inf -> 0
      const float pb = any ? fast_exp2(s[2 + hh] - mn) : 0.f;
      l[hh] = l[hh] * alpha[hh] + pa + pb;
      m[hh] = mn;
      // (s - mn) + log2 |v_norm|, not ua - mn: s and mn are close (their difference is exact),
      // while ua = s + log2 |v_norm| rounds to s's spacing, ~0.01 at logits of 1e5 (1e-2 relative
      // output error there; every weight lost at 1e10).
      wt[gid * kWRow + 2 * t4 + hh] = any ? copysignf(fast_exp2((s[hh] - mn) + lv0), cur.vn0) : 0.f;
      wt[(gid + 8) * kWRow + 2 * t4 + hh] = any ? copysignf(fast_exp2((s[2 + hh] - mn) + lv1), cur.vn1) : 0.f;
    }
    if (__any_sync(0xffffffffu, grew)) {
      rescale_output(o, alpha);
    }
    __syncwarp();
    tile_accumulate_v<D, SPLIT>(cur.v, wt, gid, t4, ilut, o);

    cur = nxt;
  }

  merge_tile_state<D, GT, kWarps>(p, o, m, l, o_s, m_s, l_s, bad_s, warp, gid, t4, seq, split, kvh, tile, w_s[warp]);
}


// ---- v4: the v3 tile loop with 8 warps per CTA sharing one set of tables ---------------------
// v3 is issue- and latency-bound at 12 warps per SM (3 CTAs of 4 warps: its 139 registers and the
// 64 KB of tables per CTA). v4 runs 8 warps per CTA over the same tables, 2 CTAs per SM (16 warps)
// within 128 registers, which the fast path makes room for: a one-page tile's loads always read
// inside a real page (a tile past the split end or a page id outside [0, P) reads page 0), so its
// codes need no zero fill; masked tokens get a NaN K norm (score -inf) and a 0 V norm (weight 0);
// the addresses are one 64-bit row base per pool plus per-lane constant offsets.
constexpr int kW4 = 8;                 // warps per CTA
constexpr int kT4 = 32 * kW4;          // threads per CTA
constexpr int kCtasPerSm4 = 2;
// Work items per CTA (ITEMS): one CTA of 8 warps (two per SM), or one CTA of 16 warps per SM that
// serves ITEMS = 2, 4 or 8 items (query-head rows) with 16 / ITEMS warps each.
constexpr int v4_threads(int items) { return items == 1 ? kT4 : 2 * kT4; }
constexpr int v4_ctas_per_sm(int items) { return items == 1 ? kCtasPerSm4 : 1; }
constexpr int v4_item_warps(int items) { return items == 1 ? kW4 : 2 * kW4 / items; }

// v4 with RING (the default where it fits, see use_ring in paged_decode.cu): each warp streams
// its one-page tiles through its own shared-memory ring of ring_stages() stages by cp.async. A tile
// is copied from its stage into registers at the start of its step, and the stage is refilled at
// once with the tile that many steps ahead; at head_dim 128 and 4 bits, two tiles (4.3 KB) per warp
// are in flight during a step's math instead of one held in a second register set. Stage layout
// (head_dim 128, 4 bits: 2176 bytes): K codes [0, 1024), V codes
// [1024, 2048), K norms [2048, 2112), V norms [2112, 2176); the code rows (16 tokens x 64 bytes =
// 64 units of 16 bytes, unit u = 4 * token + chunk) are stored at unit ring_swizzle(u), which makes
// the K reads (16 bytes of tokens gid, gid + 8; a quarter warp: tokens 2j, 2j + 1, chunks 0-3), the
// V reads (8 bytes of tokens v_token(e) = 2t4 + c; a half warp: tokens c, c + 2, c + 4, c + 6,
// chunks 0-1 or 2-3) and the copies (a quarter warp: the units of tokens 2j, 2j + 1) conflict-free:
// bit 2 of the unit (token parity) is flipped by bit 1 of the token and bit 1 (chunk pair) by bit 2.
// (Before, u ^ ((u >> 2) & 4) ^ ((u >> 4) & 2) served the V reads of tokens 4t4 + e; with v4's
// tokens 2t4 + c it put them 2-way in conflict: 4 wavefronts per V read instead of 2, ~8 of the
// ~100 shared wavefronts per tile, measured by ncu.) (V codes loaded straight into registers
// instead, through L1, measured slower: 108.8 against 97.9 us at (32, 8192); the L1 pipe that
// serves shared memory served them too.)
// At head_dim 64 (32-byte rows, 2 units each) token row r is stored at row slot ring_row64(r), a
// permutation inside each block of 4 rows that puts the V reads' rows (one instruction: v4's
// tokens 2t4 + c, c in {0, 1, 8, 9}) into 4 different 8-bank groups; the K reads (8 bytes of rows
// gid, gid + 8) and the copies stay contiguous per half warp. Stage: K [0, 512), V [512, 1024),
// norms [1024, 1152). Both layouts are checked at compile time (ring_layout_conflict_free).
__host__ __device__ constexpr int ring_swizzle(int u) { return u ^ ((u >> 1) & 4) ^ ((u >> 3) & 2); }
__host__ __device__ constexpr int ring_row64(int r) { return (r & ~3) | ((r + (r >> 2)) & 3); }

// Other code widths (KB / VB bits, 2 or 3 on either side): a stage holds 16 K rows of D * KB / 8
// bytes, 16 V rows, then the norms; rows of 32 bytes are stored at ring_row64, others in order.
// Narrower stages are more of them (ring_stages), so that about as many bytes per warp are in
// flight as with 4-bit codes.
template <int D, int KB = 4, int VB = 4>
constexpr int stage_bytes() { return kTT * (D * KB / 8 + D * VB / 8) + 2 * kTT * 4; }
// Per-warp ring bytes: at most 5 KB, which keeps 2 CTAs (64 KB of tables each) on an sm_90 SM;
// 4.5 KB with warp pairs (HALVES = 2), whose score exchange takes 1 KB per warp more.
// (ring_fits in paged_decode.cu asks the device; RingFitsOnDevice reports it to the GPU tests.)
// Two work items per CTA (ITEMS = 2: one CTA of 16 warps per SM, both items reading one pair of
// tables): the 64 KB of the second CTA's tables go to the rings, 8.5 KB per warp (4 stages at
// head_dim 128, 4 bits).
constexpr int kRingWarpBudget = 5120;
constexpr int kPairRingWarpBudget = 4608;
constexpr int kItemsRingWarpBudget = 8704;
// Eight items: their q rows (4 KB per item) take the room of the fourth stage. (Four items keep 4
// stages with 1.3 KB to spare: 231,168 of sm_90's 232,448 bytes per block; more per-item shared
// arrays would make them not fit (items_fit(4), asserted in the GPU tests; the handler then runs 2).)
constexpr int kManyItemsRingWarpBudget = 6528;
template <int D, int KB = 4, int VB = 4, int HALVES = 1, int ITEMS = 1>
constexpr int ring_stages() {
  constexpr int budget = ITEMS == 8   ? kManyItemsRingWarpBudget
                         : ITEMS > 1  ? kItemsRingWarpBudget
                         : HALVES == 1 ? kRingWarpBudget
                                       : kPairRingWarpBudget;
  constexpr int n = budget / stage_bytes<D, KB, VB>();
  return n < 2 ? 2 : n > 4 ? 4 : n;
}
template <int D, int KB = 4, int VB = 4, int HALVES = 1, int ITEMS = 1>
constexpr int ring_bytes() {
  return v4_threads(ITEMS) / 32 * ring_stages<D, KB, VB, HALVES, ITEMS>() * stage_bytes<D, KB, VB>();
}
// Coordinates of one warp's share of a tile in v4's loop: head_dim / HALVES, padded to 64 or 128
// (head_dim 80 and 96, and 192 as pairs, run in the 128-coordinate loop). The kernel's ring and the
// launch's shared-memory size both come from it (through stage_width).
constexpr int tile_width(int d, int halves) { return d / halves <= 64 ? 64 : 128; }
// Packed padded rows (one warp per tile; a K or V row that is not whole 8-byte copy units: head_dim
// 96's 36-byte 3-bit rows, head_dim 80's 20- and 30-byte 2- and 3-bit rows): a stage holds the
// tile's rows at the pool's stride, copied as whole 16-byte units of the 16-row blocks; see the
// kernel. Other padded configurations pad each stage row to the 128-coordinate layout.
constexpr bool packed_rows(int d, int halves, int kb, int vb) {
  return halves == 1 && d != tile_width(d, halves) && ((d * kb / 8) % 8 != 0 || (d * vb / 8) % 8 != 0);
}
// Coordinates of a stage row: head_dim where rows are packed, else tile_width.
constexpr int stage_width(int d, int halves, int kb, int vb) {
  return packed_rows(d, halves, kb, vb) ? d : tile_width(d, halves);
}
template <int D, int KB, int VB, int HALVES, int ITEMS = 1>
constexpr int v4_ring_bytes() { return ring_bytes<stage_width(D, HALVES, KB, VB), KB, VB, HALVES, ITEMS>(); }

// Byte offset in a stage's 16-row block of code rows of R bytes of byte `b` of row r: 64-byte
// rows in 16-byte units at ring_swizzle, 32-byte rows at ring_row64, other widths in order.
template <int R>
__host__ __device__ constexpr int ring_offset(int r, int b) {
  if constexpr (R == 64) return 16 * ring_swizzle(4 * r + (b >> 4)) + (b & 15);
  else if constexpr (R == 32) return 32 * ring_row64(r) + b;
  else return R * r + b;
}
// The same for whole 16-byte unit u of the block (copied by cp.async).
template <int R>
__host__ __device__ constexpr int ring_unit_offset(int u) {
  if constexpr (R == 64) return 16 * ring_swizzle(u);
  else if constexpr (R == 32) return 32 * ring_row64(u >> 1) + 16 * (u & 1);
  else return 16 * u;
}
// v4's V code row e (0..3) of lane (gid, t4): the V MMA's k position 2t4 + (e & 1) + 8 (e >> 1),
// where the weights' register transpose puts that token's weight (the kernel and the bank check).
__host__ __device__ constexpr int v4_v_token(int t4, int e) { return 2 * t4 + (e & 1) + 8 * (e >> 1); }
// True when each 128-byte phase of one warp-wide shared access touches all 32 banks once (one
// wavefront per phase): phases of 32 / 16 / 8 lanes for 4- / 8- / 16-byte accesses; offset(lane)
// is the lane's byte offset.
template <typename Offset>
constexpr bool phases_conflict_free(Offset offset, int bytes) {
  const int lanes = 128 / bytes;
  for (int first = 0; first < 32; first += lanes) {
    uint32_t banks = 0;
    for (int lane = first; lane < first + lanes; ++lane)
      for (int w = 0; w < bytes / 4; ++w) banks |= 1u << ((offset(lane) / 4 + w) % 32);
    if (banks != 0xffffffffu) return false;
  }
  return true;
}
// The ring's 4-bit code blocks of R-byte rows (R = 64: head_dim 128, 32: head_dim 64): v4's K
// reads (R / 4 bytes of tokens gid and gid + 8, from byte (R / 4) t4), V reads (R / 8 bytes of token
// v4_v_token(t4, e), from byte (R / 8) gid) and 16-byte copies (unit
// lane + 32 c) each take the fewest wavefronts.
template <int R>
constexpr bool ring_layout_conflict_free() {
  constexpr int kBytes = R / 4, vBytes = R / 8;
  for (int h = 0; h < 2; ++h) {
    auto k_read = [h](int lane) { return ring_offset<R>((lane >> 2) + 8 * h, (R / 4) * (lane & 3)); };
    if (!phases_conflict_free(k_read, kBytes)) return false;
  }
  for (int e = 0; e < 4; ++e) {
    auto v_read = [e](int lane) {
      return ring_offset<R>(v4_v_token(lane & 3, e), (R / 8) * (lane >> 2));
    };
    if (!phases_conflict_free(v_read, vBytes)) return false;
  }
  for (int c = 0; c < R / 32; ++c) {
    auto copy = [c](int lane) { return ring_unit_offset<R>(lane + 32 * c); };
    if (!phases_conflict_free(copy, 16)) return false;
  }
  return true;
}
static_assert(ring_layout_conflict_free<64>() && ring_layout_conflict_free<32>(),
              "the ring's code layout puts a K read, V read or copy in bank conflict");
// v4's running max moves only when a tile's max exceeds it by more than this (log2 units): the
// f16 V weights stay <= 2^8 and the rescale of o is rare.
constexpr float kLazyMax = 8.f;
constexpr float kLazyMaxWeight = 256.f;  // 2^kLazyMax


// ---- the folded window (format.h "Window"): its tokens as tiles of v4's loop ------------------
// The window CTA (split p.window_split) of a sequence of clamped length L reads positions [P0, L)
// (P0 = paged_tokens, raised to the first visible token under a sliding window) from entries
// (P0 + j) % W of window win_id. Its bf16 rows enter the MMAs as f16
// of row * 2^-8 (exact for |x| in [2^-6, 1.6e7]; below, f16 subnormals: an absolute error under
// 2^-17; beyond, inf), and the K and V "norms" of its tokens are 2^8 (kWindowNorm): the same score
// and weight scaling as a code tile's, so the two kinds of tiles share the online softmax.
constexpr float kWindowNorm = 256.f;
constexpr float kWindowScale = 1.f / kWindowNorm;

struct WindowSpan {
  int64_t row0;  // row of entry 0 of (win_id, kvh) in [num_windows, Hkv, W]
  int p0;        // the first window position
  int n;         // window tokens (0: none, or an id outside [0, num_windows))
};

template <bool MASKS>
__device__ __forceinline__ WindowSpan window_span(const DecodeParams& p, int win_id, int kvh, int seq_len) {
  const int capacity = p.max_pages * p.page_size;
  const int len = seq_len < 0 ? 0 : (seq_len > capacity ? capacity : seq_len);
  int p0 = len > p.window ? len - p.window : 0;
  if constexpr (MASKS) p0 = max(p0, visible_from(p, seq_len));
  const bool ok = static_cast<uint32_t>(win_id) < static_cast<uint32_t>(p.num_windows);
  return {ok ? (static_cast<int64_t>(win_id) * p.Hkv + kvh) * p.window : 0, p0, ok ? len - p0 : 0};
}

// Row of window token j (0 <= j), or -1 past the window's tokens.
__device__ __forceinline__ int64_t window_token_row(const DecodeParams& p, const WindowSpan& ws, int j) {
  return j < ws.n ? ws.row0 + (ws.p0 + j) % p.window : -1;
}

// N 32-bit words (bf16 pairs) of row `row` from coordinate c0 (aligned to the loads: 16 bytes for N a
// multiple of 4, else 8), or zeros (row < 0).
template <int N>
__device__ __forceinline__ void load_window_words(const uint16_t* pool, int64_t row, int d, int c0,
                                                  uint32_t (&w)[N]) {
  static_assert(N % 2 == 0, "8- or 16-byte loads");
  if (row < 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = 0u;
    return;
  }
  if constexpr (N % 4 == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(pool + row * d + c0);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = __ldg(src + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else {
    const uint2* src = reinterpret_cast<const uint2*>(pool + row * d + c0);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint2 v = __ldg(src + i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  }
}

// f16x2 of (a, b) * 2^-8 from bf16 values (the lower half a).
__device__ __forceinline__ uint32_t window_h2(float a, float b) {
  return h2_bits(__floats2half2_rn(a * kWindowScale, b * kWindowScale));
}

// Scores of window tokens j0 + gid, j0 + gid + 8 in tile_dots' layout (K rows for A: coordinates
// (D/4) t4 + 4 ks + {0, 1} / {2, 3} in k-step ks), and their K norms (kWindowNorm, NaN: no token).
// Rows are read in PARTS pieces (fewer live registers).
template <int D>
__device__ __forceinline__ void window_scores(const DecodeParams& p, const WindowSpan& ws, int j0, int gid, int t4,
                                              const uint32_t (&qh)[Dims<D>::kKS][2], float (&s)[4], float& kn0,
                                              float& kn1) {
  constexpr int PARTS = D == 128 ? 4 : 2;
  constexpr int KW = D / 8 / PARTS;  // bf16 pairs of a lane's D / 4 coordinates, per part
  constexpr int KSP = Dims<D>::kKS / PARTS;
  const int64_t ra = window_token_row(p, ws, j0 + gid), rb = window_token_row(p, ws, j0 + gid + 8);
  float sh[2][4] = {};
#pragma unroll
  for (int part = 0; part < PARTS; ++part) {
    uint32_t ka[KW], kb[KW];
    load_window_words<KW>(p.kwin, ra, D, (D / 4) * t4 + 2 * KW * part, ka);
    load_window_words<KW>(p.kwin, rb, D, (D / 4) * t4 + 2 * KW * part, kb);
#pragma unroll
    for (int k = 0; k < KSP; ++k) {
      const int ks = KSP * part + k;
      const uint32_t a[4] = {window_h2(bf16_lo(ka[2 * k]), bf16_hi(ka[2 * k])),
                             window_h2(bf16_lo(kb[2 * k]), bf16_hi(kb[2 * k])),
                             window_h2(bf16_lo(ka[2 * k + 1]), bf16_hi(ka[2 * k + 1])),
                             window_h2(bf16_lo(kb[2 * k + 1]), bf16_hi(kb[2 * k + 1]))};
      mma16816(sh[ks & 1], a, qh[ks][0], qh[ks][1]);
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) s[c] = sh[0][c] + sh[1][c];
  const float nan = __int_as_float(0x7fc00000);
  kn0 = ra >= 0 ? kWindowNorm : nan;
  kn1 = rb >= 0 ? kWindowNorm : nan;
}

// O^T += Vwin^T * P^T for window tokens j0 .. j0 + 15: A rows are coordinates (D/8) gid + 2 mt + {0, 1}
// of m-tile mt, its k positions the tokens v4_v_token(t4, e) (e = 0..3), where (ph0, ph1) put their weights.
template <int D>
__device__ __forceinline__ void window_accumulate_v(const DecodeParams& p, const WindowSpan& ws, int j0, int gid,
                                                    int t4, uint32_t ph0, uint32_t ph1, float (&o)[Dims<D>::kKS][4]) {
  constexpr int PARTS = D == 128 ? 4 : 2;
  constexpr int VW = D / 16 / PARTS;  // bf16 pairs of a lane's D / 8 coordinates, per part
  int64_t rows[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) rows[e] = window_token_row(p, ws, j0 + v4_v_token(t4, e));
#pragma unroll
  for (int part = 0; part < PARTS; ++part) {
    uint32_t v[4][VW];
#pragma unroll
    for (int e = 0; e < 4; ++e) load_window_words<VW>(p.vwin, rows[e], D, (D / 8) * gid + 2 * VW * part, v[e]);
#pragma unroll
    for (int k = 0; k < VW; ++k) {
      const int mt = VW * part + k;
      const uint32_t a[4] = {window_h2(bf16_lo(v[0][k]), bf16_lo(v[1][k])),
                             window_h2(bf16_hi(v[0][k]), bf16_hi(v[1][k])),
                             window_h2(bf16_lo(v[2][k]), bf16_lo(v[3][k])),
                             window_h2(bf16_hi(v[2][k]), bf16_hi(v[3][k]))};
      mma16816(o[mt], a, ph0, ph1);
    }
  }
}

// The window CTA's (win_id, kvh) K and V rows to L2, at kernel start (they are read after its page tiles).
template <int D>
__device__ __forceinline__ void prefetch_window_l2(const DecodeParams& p, int win_id, int kvh, int tid, int nthreads) {
  if (static_cast<uint32_t>(win_id) >= static_cast<uint32_t>(p.num_windows)) return;
  const int64_t first = (static_cast<int64_t>(win_id) * p.Hkv + kvh) * p.window * D;  // element
  const int lines = (p.window * D * 2 + 127) / 128;
  for (int i = tid; i < 2 * lines; i += nthreads) {
    const uint16_t* pool = i < lines ? p.kwin : p.vwin;
    const char* addr = reinterpret_cast<const char*>(pool + first) + 128 * (i < lines ? i : i - lines);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(addr));
  }
}

// F16Shape::kLateMask: head_dim 64 K4V4 (MASKS too), K4V3, K3V4, K2V2 (MASKS too); head_dim 128 all
// but K3V2, K4V2, K4V3, K2V2 with MASKS, K4V4 with one item or (with MASKS) two (these spilled).
__host__ __device__ constexpr bool late_mask_shape(int d, int kb, int vb, int items, bool masks) {
  if (d == 64) return (kb == 4 && vb >= 3) || (kb == 3 && vb == 4) || (kb == 2 && vb == 2);
  if (d != 128 || (vb == 2 && kb != 2) || (kb == 4 && vb == 3) || (kb == 2 && vb == 2 && masks)) return false;
  return !(kb == 4 && vb == 4 && (items == 1 ? !masks : items == 2 && masks));
}

// The compile-time shape of one decode_tc_f16_kernel instantiation (its comment says what each
// parameter selects).
template <int D_, int GT_, bool RING_, int KB_, int VB_, int HALVES_, int ITEMS_, bool MASKS_>
struct F16Shape {
  static constexpr int D = D_, GT = GT_, KB = KB_, VB = VB_, HALVES = HALVES_, ITEMS = ITEMS_;
  static constexpr bool RING = RING_;
  // The sliding window and soft cap in the tile loop (the sinks need no kernel code: partials).
  static constexpr bool MASKS = MASKS_;
  static_assert(!MASKS || (RING && HALVES == 1 && (D == 64 || D == 128)), "masks: the ring at head_dim 64 / 128");
  static_assert(ITEMS == 1 || ((ITEMS == 2 || ITEMS == 4 || ITEMS == 8) && RING && HALVES == 1 && GT == 4),
                "several items: 2, 4 or 8, ring, head tiles of 4");
  static_assert(!RING || (KB != 0 && VB != 0), "the ring's stage layout needs compile-time widths");
  static_assert(GT == 4 || GT == 8, "v4: GT in {4, 8}");
  static_assert(kNH == kW4, "prologue: one head per warp");
  static_assert(HALVES == 1 || (HALVES == 2 && RING && (D == 256 || D == 192)), "warp pairs: head_dim 256 or 192, ring");
  static constexpr int kb = KB ? KB : 4, vb = VB ? VB : 4;  // the ring's code widths
  static constexpr int DV = D / HALVES;              // coordinates of a warp's share of a tile
  static constexpr int DW = tile_width(D, HALVES);  // the tile loop's coordinates (DV padded)
  static constexpr bool PADDED = DV != DW;
  static_assert(!PADDED || (RING && DV % 16 == 0), "padded rows: ring");
  static constexpr bool PACKED = packed_rows(D, HALVES, kb, vb);
  static constexpr int DS = stage_width(D, HALVES, kb, vb);  // coordinates of a stage row
  static constexpr int IW = v4_item_warps(ITEMS);  // warps per item
  static constexpr int NP = IW / HALVES;  // tile streams: the item's warps, or the warp pairs
  static constexpr int HPW = kNH / IW;    // heads each warp stages in the prologue (rows past GT: zeros)
  static_assert(HPW * IW == kNH, "the prologue stages every head row of the tile");
  static_assert(NP * kNH * D * 4 <= kSmemBytes, "o_s must fit in the table space");
  static constexpr int kStage = stage_bytes<DS, kb, vb>();
  static constexpr int kStages = ring_stages<DS, kb, vb, HALVES, ITEMS>();
  static_assert(ITEMS != 2 || (NP * kNH + GT) * D * 4 <= 2 * kW4 * kStages * kStage,
                "the second item's o_s and merged rows in the rings");
  static_assert(ITEMS <= 2 || ITEMS * NP * kNH * D * 4 <= kSmemBytes, "the items' o_s in the table space");
  static_assert(!RING || v4_threads(ITEMS) / 32 * kStages * kStage == v4_ring_bytes<D, kb, vb, HALVES, ITEMS>(),
                "the launch's shared-memory size (v4_ring_bytes) must be the ring's");
  static constexpr int KS = Dims<DW>::kKS;
  static constexpr int RK = DW * kb / 8, RV = DW * vb / 8;    // ring: code bytes per K / V row
  static constexpr int RKG = DV * kb / 8, RVG = DV * vb / 8;  // ... of them in the pools
  static constexpr int SK = DS * kb / 8, SV = DS * vb / 8;    // ... a stage row's stride
  // Table key shifts (load_k_keys): the ring's 2- / 3-bit K and 2-bit V codes make their own keys.
  static constexpr bool V2 = RING && VB == 2;
  static constexpr bool QUADK = RING && KB == 2;  // K looked up four codes at a time: PairLut's KQUAD
  static constexpr bool QUADV = V2;               // ... V: its VQUAD
  static constexpr bool K3 = RING && KB == 3 && DW == 128;  // 3-bit K keys from the bit stream (k3_key_words)
  static constexpr bool V3 = RING && VB == 3 && DW == 128;  // ... V keys (v3_key_words)
  static constexpr int KSHIFT = RING && (KB == 2 || KB == 3) ? KB : 4, VSHIFT = V3 ? 3 : 4;  // (2-bit: quads)
  // The folded window (format.h "Window"; p.kwin): read by the CTA of split p.window_split, after
  // its page tiles.
  static constexpr bool FOLD = HALVES == 1 && !PADDED && (D == 64 || D == 128);
  static constexpr int QROW = HALVES * DW;  // staged q row: DW coordinates per half, zeros past DV
  // Several items: q rows staged outside the tables, the first copies issued before the q staging.
  static constexpr bool kSeveral = ITEMS >= 2;
  // Two or four items per CTA (128 registers, the loop's limit): the compiler rematerializes
  // lane-derived addresses from %tid in every tile (~20 instructions); empty asm statements make
  // them opaque, so they stay in registers (SASS: 1514 -> 1424 instructions per pass of the
  // two-items loop, 4 tiles). At 8 items (3 stages) it made the loop reload a spilled register.
  // One item per CTA at head_dim 128 (the same 128 registers): pinned where the loop still fits
  // without new spills (SASS, sm_90a, common-path instructions per tile: K2V2 248 -> 229, K2V4
  // 308 -> 281, K4V2 289 -> 265, K3V2 334 -> 324, K3V4 379 -> 363, K4V3 423 -> 411 (its 2
  // spills as before), K4V4 309 -> 289 (1 spill); K2V3 and K3V3 spilled 3-5 registers). With
  // 3-bit keys from the bit stream (k3_key_words, v3_key_words) and one V alignment shift per lane
  // (TileRing::kV3LaneShift) they fit without spills, with kPinLut: K3V3 (and with MASKS) pinned.
  // Head_dim 64: every width pinned (no spills; per tile K4V4 190.2 -> 187.5, K3V3 287.8 ->
  // 282.2, K2V2 165.0 -> 163.0); its lane offsets not (kPinLut: K3V4 and K3V2 grow).
  static constexpr bool kPinOne =
      ITEMS == 1 && HALVES == 1 && ((D == 128 && !(KB == 4 && VB == 4 && MASKS)) || D == 64);
  static constexpr bool kPinned = ITEMS == 2 || ITEMS == 4 || kPinOne;
  // Masked tokens and NaN weights handled in a rare branch (consume_tile), where the loop gets
  // shorter without new spills (SASS).
  static constexpr bool kLateMask = RING && HALVES == 1 && late_mask_shape(D, KB, VB, ITEMS, MASKS);
  // The lookup tables' lane offsets (ilut) too: where that spilled less (two items, K2V4 and K4V2
  // spill less with the compiler rebuilding them from %tid; K4V3 did too until its V keys came
  // from the 3-bit stream (v3_key_words): since then unpinned it reloads 7 spilled registers per
  // pass, pinned none).
  static constexpr bool kPinLut =
      ITEMS == 4 || (kPinOne && D == 128 &&
                     ((KB == 2 && VB == 2) || (KB == 3 && VB == 2) || (KB == 3 && VB == 4) || (KB == 4 && VB == 4) ||
                      (KB == 4 && VB == 3) || (KB == 2 && VB == 3) || (KB == 3 && VB == 3)));
};

// K norms of masked tokens (n: the tile's valid count) become NaN, V norms 0.
template <int DW>
__device__ __forceinline__ void mask_norms(Tile<DW>& t, int n, int gid, float kn0, float kn1, float vn0, float vn1) {
  const float kNaN = __int_as_float(0x7fc00000);
  t.kn0 = gid < n ? kn0 : kNaN;
  t.kn1 = gid + 8 < n ? kn1 : kNaN;
  t.vn0 = gid < n ? vn0 : 0.f;
  t.vn1 = gid + 8 < n ? vn1 : 0.f;
}

// The same with a sliding window: tokens j outside [skip, n) masked (skip: the tile's tokens before
// the first visible one).
template <int DW>
__device__ __forceinline__ void mask_norms(Tile<DW>& t, int skip, int n, int gid, float kn0, float kn1, float vn0,
                                           float vn1) {
  const float kNaN = __int_as_float(0x7fc00000);
  const bool ok0 = gid < n && gid >= skip, ok1 = gid + 8 < n && gid + 8 >= skip;
  t.kn0 = ok0 ? kn0 : kNaN;
  t.kn1 = ok1 ? kn1 : kNaN;
  t.vn0 = ok0 ? vn0 : 0.f;
  t.vn1 = ok1 ? vn1 : 0.f;
}

// The tiles of one CTA's split of one (sequence, KV head): its tokens [tok0, tok_end) from
// seq_lens, ntt tiles of kTT tokens, and where a one-page tile's rows are. A sliding window (the
// MASKS kernels): the splits share the pages from the first visible token's on (tok0 stays at a
// page start), and the `skip` tokens from tok0 before the window are masked.
struct SplitTiles {
  int tok0 = 0, tok_end = 0, ntt = 0;
  int skip = 0;  // tokens of the split before the first visible one (<= 0: none)
  const int32_t* bt_seq = nullptr;  // the sequence's block-table row
  int kvh = 0;
  int kvh_rows = 0;        // rows before this KV head's within a page
  uint32_t page_rows = 0;  // rows per physical page

  // (after the register variant's set_range: computed before it, these values stay live through
  // the prologue, and its 128 registers spill)
  __device__ __forceinline__ void locate(const DecodeParams& p, int seq, int kvh_) {
    bt_seq = p.bt + static_cast<int64_t>(seq) * p.max_pages;
    kvh = kvh_;
    kvh_rows = kvh_ * p.page_size;
    page_rows = static_cast<uint32_t>(p.Hkv * p.page_size);
  }

  // The range of split `split` of a sequence of `len` tokens; none for the folded window's own CTA
  // (split >= num_splits).
  template <bool MASKS>
  __device__ __forceinline__ void set_range(const DecodeParams& p, int len, int split) {
    if (split >= p.num_splits) return;
    if constexpr (MASKS) {
      const VisibleSplit range =
          visible_split_range(len, p.max_pages, p.page_size, p.window, p.sliding_window, p.num_splits, split);
      tok0 = static_cast<int>(range.tok_begin);
      tok_end = static_cast<int>(range.tok_end);
      skip = static_cast<int>(range.first_visible) - tok0;
    } else {
      const SplitRange range = split_range(paged_len(p, len), p.max_pages, p.page_size, p.num_splits, split);
      tok0 = static_cast<int>(range.tok_begin);
      tok_end = static_cast<int>(range.tok_end);
    }
    const int ntok = tok_end > tok0 && p.P > 0 ? tok_end - tok0 : 0;  // P = 0: nothing to read
    ntt = (ntok + kTT - 1) / kTT;
  }

  // One-page tile ti's block-table entry (-1 past the end) and its first row inside the page,
  // from one division. EARLY: one of the kernel's first reads (ld_early).
  template <bool EARLY>
  __device__ __forceinline__ TilePage page(const DecodeParams& p, int ti) const {
    const uint32_t base = static_cast<uint32_t>(tok0 + ti * kTT);
    const uint32_t lp = p.pdiv.div(base);
    int phys = -1;
    if (ti < ntt) {
      if constexpr (EARLY) phys = ld_early(bt_seq + lp);
      else phys = __ldg(bt_seq + lp);
    }
    return {phys, kvh_rows + static_cast<int>(base - lp * p.page_size)};
  }

  // Split 0 starts at token 0 whatever the sequence's length (without a sliding window): its first
  // block-table entries are read before seq_lens (entries past the table's width as -1; those past
  // the sequence's tiles are never used).
  __device__ __forceinline__ TilePage first_page(const DecodeParams& p, int ti) const {
    const uint32_t base = static_cast<uint32_t>(ti * kTT);
    const uint32_t lp = p.pdiv.div(base);
    const int phys = lp < static_cast<uint32_t>(p.max_pages) ? ld_early(bt_seq + lp) : -1;
    return {phys, kvh_rows + static_cast<int>(base - lp * p.page_size)};
  }

  // First row of one-page tile ti (page 0 for an id outside [0, P)) and its valid token count n
  // (may exceed 16). (P < 2^31, so one unsigned compare rejects negative ids too; rows of 64 bits.)
  __device__ __forceinline__ uint64_t rows(const DecodeParams& p, int ti, TilePage tp, int& n) const {
    const bool page_ok = static_cast<uint32_t>(tp.phys) < static_cast<uint32_t>(p.P);
    n = page_ok ? tok_end - (tok0 + ti * kTT) : 0;
    const uint32_t page = page_ok ? static_cast<uint32_t>(tp.phys) : 0u;
    return static_cast<uint64_t>(page) * page_rows + static_cast<uint32_t>(tp.row_in_page);
  }
};

// The register variant's tile loads: every lane reads its codes (as table keys) and norms straight
// into a Tile. Per-lane byte offsets inside a 16-token tile's rows: K bytes (D/8)*t4.. of token
// gid (token gid + 8 at + 8 rows); V bytes (D/16)*gid.. of token v4_v_token(t4, 0) (row e at
// + v4_v_token(t4, e) - v4_v_token(t4, 0) rows).
template <class S>
struct RegisterTiles {
  int krow, vrow;      // code bytes per K / V row
  int k_lane, v_lane;  // the lane's offsets inside a tile's rows
  bool one_page;       // the tiles are whole 16-row blocks inside one page (no per-token path)

  __device__ __forceinline__ RegisterTiles(const DecodeParams& p, int gid, int t4, int half)
      : krow(S::D * (S::KB ? S::KB : p.k_bits) / 8),
        vrow(S::D * (S::VB ? S::VB : p.v_bits) / 8),
        k_lane(gid * krow + (S::HALVES == 1 ? (krow / 4) * t4 : half * S::RK + (S::RK / 4) * t4)),
        v_lane(v4_v_token(t4, 0) * vrow + (S::HALVES == 1 ? (vrow / 8) * gid : half * S::RV + (S::RV / 8) * gid)),
        one_page(S::RING || (p.page_size & (kTT - 1)) == 0) {}

  // Called with ntt > 0 only (so P > 0). A tile past the end (ti >= ntt, tp.phys = -1) reads page
  // 0 with every token masked.
  __device__ __forceinline__ void load(const DecodeParams& p, const SplitTiles& tiles, int ti, Tile<S::DW>& t,
                                       TilePage tp, int gid, int t4) const {
    const int base = tiles.tok0 + ti * kTT;
    if (one_page) {
      int n;
      const uint64_t row0 = tiles.rows(p, ti, tp, n);
      const uint8_t* kp = p.kc + row0 * krow + k_lane;
      const uint8_t* vp = p.vc + row0 * vrow + v_lane;
      ldg_codes<S::KB>(kp, p.k_bits, t.k0);
      ldg_codes<S::KB>(kp + 8 * krow, p.k_bits, t.k1);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        ldg_codes<S::VB>(vp + (v4_v_token(t4, e) - v4_v_token(t4, 0)) * vrow, p.v_bits, t.v[e]);
      const float* knp = p.kn + row0 + gid;
      const float* vnp = p.vn + row0 + gid;
      mask_norms(t, n, gid, __ldg(knp), __ldg(knp + 8), __ldg(vnp), __ldg(vnp + 8));
      return;
    }
    t = Tile<S::DW>{};
    t.kn0 = t.kn1 = __int_as_float(0x7fc00000);
    if (ti >= tiles.ntt) return;
    const int64_t r0 = token_row(p, tiles.bt_seq, base + gid, tiles.tok_end, tiles.kvh);
    const int64_t r1 = token_row(p, tiles.bt_seq, base + gid + 8, tiles.tok_end, tiles.kvh);
    if (r0 >= 0) {
      ldg_codes<S::KB>(p.kc + r0 * krow + (krow / 4) * t4, p.k_bits, t.k0);
      t.kn0 = __ldg(p.kn + r0);
      t.vn0 = __ldg(p.vn + r0);
    }
    if (r1 >= 0) {
      ldg_codes<S::KB>(p.kc + r1 * krow + (krow / 4) * t4, p.k_bits, t.k1);
      t.kn1 = __ldg(p.kn + r1);
      t.vn1 = __ldg(p.vn + r1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t rv = token_row(p, tiles.bt_seq, base + v4_v_token(t4, e), tiles.tok_end, tiles.kvh);
      if (rv >= 0) ldg_codes<S::VB>(p.vc + rv * vrow + (vrow / 8) * gid, p.v_bits, t.v[e]);
    }
  }
};

// The ring variant's copies: tile ti goes into stage st of the warp's ring by cp.async (every lane
// copies units lane, lane + 32, ... (those that exist) of the K and V code rows, lanes 0-7 one
// 16-byte quarter of the norms), and comes out of it as a Tile (read).
// Copy units of CU bytes: 16, or 8 where a (half) row is not whole 16-byte units (head_dim 80's
// 40-byte rows). The per-lane parts of the copies are loop-invariant: sources at byte CU * lane of a
// tile's rows (unit lane + 32 c at + 32 c CU), destinations at the units' stage offsets
// (shared-memory addresses, 32 bits). (Unpadded stage rows are in pool order, so their units may
// straddle rows.)
template <class S>
struct TileRing {
  static constexpr int CU = !S::PADDED || S::PACKED || (S::RKG % 16 == 0 && S::RVG % 16 == 0) ? 16 : 8;
  static_assert(!S::PADDED || S::PACKED || (S::RKG % CU == 0 && S::RVG % CU == 0),
                "padded rows: whole 8-byte copy units");
  static_assert(!S::PACKED || ((kTT * S::RKG) % 16 == 0 && (kTT * S::RVG) % 16 == 0),
                "packed rows: whole 16-byte units per block");
  static constexpr int NUK = kTT * S::RKG / CU, NUV = kTT * S::RVG / CU;  // units of a tile's 16 K / V rows
  static_assert(NUK <= 96 && NUV <= 96 && (S::HALVES == 1 || (CU == 16 && NUK <= 64 && NUV <= 64)),
                "ring: at most three copies per lane (two with warp pairs)");
  // The lanes' reads are as aligned as the row stride and the in-row offsets allow (packed rows at
  // head_dim 80: 2- to 8-byte; the blocks start on 16-byte boundaries).
  static constexpr int ALK = align_of(S::SK) < align_of(S::RK / 4) ? align_of(S::SK) : align_of(S::RK / 4);
  static constexpr int ALV = align_of(S::SV) < align_of(S::RV / 8) ? align_of(S::SV) : align_of(S::RV / 8);
  // 3-bit V chunks (V3; 6 bytes at (RV / 8) gid of a row): where the stages, the K block and the V
  // rows are whole 4-byte units apart, the 4 rows' chunks of a lane lie equally far above a 4-byte
  // boundary (that of (RV / 8) gid): one shift for all, and one base register (the compiler no
  // longer masks each row's address).
  static constexpr bool kV3LaneShift =
      S::V3 && S::SV % 4 == 0 && (kTT * S::SK) % 4 == 0 && S::kStage % 4 == 0 && kSmemBytes % 4 == 0;

  uint8_t* ring;  // the warp's stages
  const uint8_t* k_src;
  const uint8_t* v_src;
  int kK32, kV32;  // source of unit lane + 32 minus that of unit lane
  const float* n_src;
  uint32_t dst_k0, dst_k1, dst_k2, dst_v0, dst_v1, dst_v2, dst_n;

  // Pairs: unit u is 16-byte chunk u % UPR of row u / UPR's half (rows of HALVES * RG bytes); unit
  // lane + 32 lies a constant 32 / UPR rows after unit lane where UPR divides 32 (2- and 4-bit
  // codes), else (3-bit and padded rows: 3 units per half row) at a per-lane distance.
  static __device__ __forceinline__ int unit_src(int u, int RG, int half) {
    return S::HALVES == 1 ? CU * u : half * RG + (u / (RG / 16)) * (S::HALVES * RG) + (u % (RG / 16)) * 16;
  }
  static __device__ __forceinline__ int unit32_distance(int RG, int lane, int half) {
    if constexpr (S::HALVES == 1) return 32 * CU;
    else if (32 % (RG / 16) == 0) return (32 / (RG / 16)) * S::HALVES * RG;
    else return unit_src(lane + 32, RG, half) - unit_src(lane, RG, half);
  }
  // Stage offset of copied unit u: padded rows leave the end of every stage row uncopied. Packed
  // rows are copied like unpadded ones (16-byte units in pool order).
  static __device__ __forceinline__ int k_stage_unit(int u) {
    if constexpr (S::PADDED && !S::PACKED) return ring_offset<S::RK>(u / (S::RKG / CU), CU * (u % (S::RKG / CU)));
    else return ring_unit_offset<S::SK>(u);
  }
  static __device__ __forceinline__ int v_stage_unit(int u) {
    if constexpr (S::PADDED && !S::PACKED) return ring_offset<S::RV>(u / (S::RVG / CU), CU * (u % (S::RVG / CU)));
    else return ring_unit_offset<S::SV>(u);
  }

  __device__ __forceinline__ TileRing(const DecodeParams& p, uint8_t* smem, int slot, int lane, int half)
      : ring(smem + kSmemBytes + slot * (S::kStages * S::kStage)) {
    k_src = p.kc + unit_src(lane, S::RKG, half);
    v_src = p.vc + unit_src(lane, S::RVG, half);
    if constexpr (S::kPinned) asm("" : "+l"(k_src), "+l"(v_src));
    kK32 = unit32_distance(S::RKG, lane, half);
    kV32 = unit32_distance(S::RVG, lane, half);
    // Norms: each lane copies one float (lane < 16: the K norm of token t = lane & 15, else its V
    // norm) to slot 4 (t & 7) + 2 (K / V) + (t >> 3) of the stage's 32, so that lane (gid, t4)
    // reads its four (K gid, K gid + 8, V gid, V gid + 8) as one float4.
    const int n_tok = lane & 15;
    n_src = (lane < 16 ? p.kn : p.vn) + n_tok;
    if constexpr (S::kPinOne) asm("" : "+l"(n_src));  // (else rebuilt from the lane in every tile)
    const uint32_t ring_s = smem_addr(ring);
    dst_k0 = ring_s + k_stage_unit(lane);
    dst_k1 = ring_s + k_stage_unit(lane + 32);
    if constexpr (S::kPinned) asm("" : "+r"(dst_k0), "+r"(dst_k1));
    dst_k2 = ring_s + k_stage_unit(lane + 64);
    // V units at K's offsets + kTT * SK (two or four items: keeps the loop's registers down)
    constexpr bool kVLikeK = S::kPinned && S::RK == S::RV && S::RKG == S::RVG && S::SK == S::SV;
    dst_v0 = kVLikeK ? dst_k0 + kTT * S::SK : ring_s + kTT * S::SK + v_stage_unit(lane);
    dst_v1 = kVLikeK ? dst_k1 + kTT * S::SK : ring_s + kTT * S::SK + v_stage_unit(lane + 32);
    dst_v2 = ring_s + kTT * S::SK + v_stage_unit(lane + 64);
    dst_n = ring_s + kTT * (S::SK + S::SV) + 4 * (4 * (n_tok & 7) + 2 * (lane >> 4) + (n_tok >> 3));
    if constexpr (S::kPinned) asm("" : "+r"(dst_n));
  }

  // Copies tile ti (when < ntt) into stage st; one cp.async group per call, empty or not, so that
  // wait_group counts stay aligned. Returns the tile's valid token count.
  __device__ __forceinline__ int issue(const DecodeParams& p, const SplitTiles& tiles, int ti, int st, TilePage tp,
                                       int lane) const {
    int n = 0;
    if (ti < tiles.ntt) {
      const uint64_t row0 = tiles.rows(p, ti, tp, n);
      const uint8_t* ks = k_src + row0 * (S::HALVES * S::RKG);
      const uint8_t* vs = v_src + row0 * (S::HALVES * S::RVG);
      const uint32_t so = st * S::kStage;
      if (NUK >= 32 || lane < NUK) cp_async_s<CU>(dst_k0 + so, ks);
      if (NUK > 32 && (NUK >= 64 || lane + 32 < NUK)) cp_async_s<CU>(dst_k1 + so, ks + kK32);
      if (NUK > 64 && (NUK >= 96 || lane + 64 < NUK)) cp_async_s<CU>(dst_k2 + so, ks + 2 * kK32);
      if (NUV >= 32 || lane < NUV) cp_async_s<CU>(dst_v0 + so, vs);
      if (NUV > 32 && (NUV >= 64 || lane + 32 < NUV)) cp_async_s<CU>(dst_v1 + so, vs + kV32);
      if (NUV > 64 && (NUV >= 96 || lane + 64 < NUV)) cp_async_s<CU>(dst_v2 + so, vs + 2 * kV32);
      cp_async_s<4>(dst_n + so, n_src + row0);
    }
    cp_async_commit();
    return n;
  }

  // Stage st as a lane's Tile: K codes (DW/4) from code (DW/4)*t4 of tokens gid, gid + 8; V: (DW/8)
  // codes from code (DW/8)*gid of tokens v4_v_token(t4, e). Packed rows are SK / SV < RK / RV bytes
  // apart, so the lanes of the padding coordinates (K: t4 = 3, V: 16 gid >= DV) read the next row's
  // bytes (or, past the block's last row, the next block's): codes of finite centroids that meet
  // q's zero padding in the K MMAs and give output coordinates DV.. that the merge drops, as in
  // padded rows.
  // skip: the MASKS kernels' tokens before the sliding window (mask_norms). kLateMask: the norms
  // as stored, masked tokens' too (consume_tile masks them).
  __device__ __forceinline__ void read(int st, int n, Tile<S::DW>& t, int gid, int t4, int skip = 0) const {
    const uint8_t* src = ring + st * S::kStage;
    constexpr int KW = Dims<S::DW>::kKW, VW = Dims<S::DW>::kVW;
    load_k_codes<S::kb, KW, SharedMem, ALK, S::QUADK, S::K3>(src + ring_offset<S::SK>(gid, (S::RK / 4) * t4), t.k0);
    load_k_codes<S::kb, KW, SharedMem, ALK, S::QUADK, S::K3>(src + ring_offset<S::SK>(gid + 8, (S::RK / 4) * t4),
                                                             t.k1);
    if constexpr (kV3LaneShift) {
      static_assert(VW == 2 && (S::RV / 8) % 2 == 0, "3-bit V streams: 48 bits, 2-byte aligned");
      const uint32_t shift = (((S::RV / 8) * gid) & 3) * 8;  // 0 or 16
#pragma unroll
      for (int e = 0; e < 4; ++e)
        load_stream3_48_shifted<SharedMem>(src + kTT * S::SK + ring_offset<S::SV>(v4_v_token(t4, e), (S::RV / 8) * gid),
                                           shift, t.v[e][0], t.v[e][1]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        load_v_codes<S::vb, VW, SharedMem, ALV, S::V3>(
            src + kTT * S::SK + ring_offset<S::SV>(v4_v_token(t4, e), (S::RV / 8) * gid), t.v[e]);
    }
    const float* norms = reinterpret_cast<const float*>(src + kTT * (S::SK + S::SV));
    const float4 kv = *reinterpret_cast<const float4*>(norms + 4 * gid);
    if constexpr (S::kLateMask) t.kn0 = kv.x, t.kn1 = kv.y, t.vn0 = kv.z, t.vn1 = kv.w;
    else if constexpr (S::MASKS) mask_norms(t, skip, n, gid, kv.x, kv.y, kv.z, kv.w);
    else mask_norms(t, n, gid, kv.x, kv.y, kv.z, kv.w);
  }
};

// A warp's q fragments (K MMA B operands) and the exponents of its heads' q scales.
template <int KS>
struct QueryFragments {
  uint32_t qh[KS][2], ql[KS][2];
  float qx0, qx1;
};

// The online softmax of a warp's two heads per lane (rows 2t4, 2t4 + 1 of the head tile) and its
// output accumulators (V MMA C fragments).
template <int KS>
struct SoftmaxState {
  // The running max starts finite (-FLT_MAX), so no exp2 argument is -inf - (-inf): no "any valid
  // token yet" selects. A row with no valid token keeps l = 0 (its output is 0, its lse -inf).
  float m[2] = {-FLT_MAX, -FLT_MAX};
  float l[2] = {0.f, 0.f};
  float o[KS][4] = {};

  // One tile's scores s = u * qx (log2 units, tile_scores' layout: qx0 / qx1 the powers of two of
  // heads 2t4 / 2t4 + 1, or 1) with V norms vn0, vn1 of tokens gid, gid + 8: rescales o and l where
  // the running max moves, and gives the V weights p * v_norm as P^T's B fragments ph0 (tokens
  // 2t4, 2t4 + 1), ph1 (2t4 + 8, 2t4 + 9). RAW: u may be NaN (a masked token's NaN K norm, a NaN
  // product): no weight, as s = -inf (else the caller's s are already -inf there).
  // s - m is one FFMA: qx * u - m rounds once, as fl(s) - m did (s = fl(u * qx) = u * qx exactly:
  // qx is a power of two).
  template <bool RAW>
  __device__ __forceinline__ void weigh(const float (&u)[4], float qx0, float qx1, float vn0, float vn1,
                                        uint32_t& ph0, uint32_t& ph1) {
    const float qx[2] = {qx0, qx1};
    // p = exp2(s - m) (s = -inf -> 0) and the V weights p * v_norm of tokens gid (pa, wa), gid + 8
    // (pb, wb) for heads 2t4 + hh. |p * v_norm| = exp2(s + log2 |v_norm| - m): one multiply, no
    // exp2. (At |s| >= 2^28 the sum drops log2 |v_norm|; the f16 conversion then saturates, no inf.)
    // weights() leaves per head pab = pa + pb (l's increment), the weights as P^T's B fragments
    // ph0 / ph1 and big, the largest of pab and the |p * v_norm|: only these (and u) stay live
    // through the vote below.
    float pab[2], big;
    auto shifted = [&](int c) {  // s[c] - m (-inf: no weight)
      const float x = fmaf(qx[c & 1], u[c], -m[c & 1]);
      return RAW && !(x > -INFINITY) ? -INFINITY : x;
    };
    auto weights = [&]() {
      float wa[2], wb[2];  // V weights of tokens gid, gid + 8
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float pa = fast_exp2(shifted(hh));  // -inf -> 0
        const float pb = fast_exp2(shifted(2 + hh));
        pab[hh] = pa + pb;
        wa[hh] = pa * vn0;
        wb[hh] = pb * vn1;
      }
      big = fmaxf(fmaxf(fmaxf(pab[0], pab[1]), fmaxf(fabsf(wa[0]), fabsf(wb[0]))), fmaxf(fabsf(wa[1]), fabsf(wb[1])));
      // (wa, wb) are rows gid and gid + 8 of the 16 x 8 S^T tile; transposed, each lane holds head
      // gid of tokens 2t4, 2t4 + 1 and 2t4 + 8, 2t4 + 9: P^T's B fragments, no shared memory.
      ph0 = transpose8x8_b16(half2_satfinite(wa[0], wa[1]));
      ph1 = transpose8x8_b16(half2_satfinite(wb[0], wb[1]));
    };
    // Lazy rescaling: the running max m (of s and s + log2 |v_norm|) moves only when a tile's max
    // exceeds it by more than kLazyMax (log2 units), so weights up to 2^kLazyMax (f16: fine) and
    // the rescale is rare. Each lane tests its own weights: s + max(0, log2 |v_norm|) - m >
    // kLazyMax is max(p, |p * v_norm|) > 2^kLazyMax (with the p of the lane's two tokens summed,
    // as l needs them: that may also pass with both <= 2^kLazyMax; the reduction below then leaves
    // m), tested on the weights the tile computes anyway: no log2 and no max of s on every tile.
    // (A difference s - m, as before: at |m| >= 2^27, m + kLazyMax would round by up to 16; m =
    // -FLT_MAX: any finite score gives p = inf.) fmaxf drops a NaN weight (NaN v_norm, 0 * inf),
    // as the max of s + log2 |v_norm| did. Only when some lane's test passes (a warp vote) is the
    // tile max of each head reduced over its 8 lanes and m moved: the same m as testing the
    // reduced max (x - m > kLazyMax is monotonic in x, and fmaxf drops NaN in both), without the 6
    // shuffles of the reduction on every tile; the weights are then recomputed.
    weights();
    if (__any_sync(0xffffffffu, big > kLazyMaxWeight)) {
      const float lv0 = fast_log2(fabsf(vn0)), lv1 = fast_log2(fabsf(vn1));  // log2 0 = -inf
      float s[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[c] = u[c] * qx[c & 1];
        if (RAW && !(s[c] > -INFINITY)) s[c] = -INFINITY;
      }
      float alpha[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float tm = fmaxf(fmaxf(s[hh], s[2 + hh]), fmaxf(s[hh] + lv0, s[2 + hh] + lv1));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, off));
        alpha[hh] = 1.f;
        if (tm - m[hh] > kLazyMax) {  // the same for the 8 lanes of a head (tm is their max)
          alpha[hh] = fast_exp2(m[hh] - tm);  // the first tile: m = -FLT_MAX -> 0 (o, l are 0)
          m[hh] = tm;
        }
        l[hh] *= alpha[hh];
      }
      rescale_output(o, alpha);
      weights();
    }
    l[0] += pab[0];
    l[1] += pab[1];
  }

  // weigh<false> (no -inf for NaN) on the common path of a tile that has no masked token (full)
  // and, in every lane, no weight above 2^kLazyMax and no NaN weight (a NaN s - m makes the lane's
  // p, so pab and max_nan's max, NaN): weigh<RAW> would then find the same weights (no NaN to
  // replace) and leave m (its vote fails); returns true. Else (a warp vote, rare) it changes nothing
  // and returns false: the caller masks and calls weigh<RAW>.
  __device__ __forceinline__ bool weigh_common(const float (&u)[4], float qx0, float qx1, float vn0, float vn1,
                                               bool full, uint32_t& ph0, uint32_t& ph1) {
    const float qx[2] = {qx0, qx1};
    float pab[2], wa[2], wb[2];  // as weigh's
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float pa = fast_exp2(fmaf(qx[hh], u[hh], -m[hh]));
      const float pb = fast_exp2(fmaf(qx[hh], u[2 + hh], -m[hh]));
      pab[hh] = pa + pb;
      wa[hh] = pa * vn0;
      wb[hh] = pb * vn1;
    }
    ph0 = transpose8x8_b16(half2_satfinite(wa[0], wa[1]));
    ph1 = transpose8x8_b16(half2_satfinite(wb[0], wb[1]));
    const float big = max_nan(max_nan(max_nan(pab[0], pab[1]), max_nan(fabsf(wa[0]), fabsf(wb[0]))),
                              max_nan(fabsf(wa[1]), fabsf(wb[1])));
    if (__any_sync(0xffffffffu, !full || !(big <= kLazyMaxWeight))) return false;
    l[0] += pab[0];
    l[1] += pab[1];
    return true;
  }

 private:
  // The larger of a and b, NaN if either is (fmaxf drops a NaN).
  static __device__ __forceinline__ float max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
  }
};

// The rare path of consume_tile: the tile's tokens outside [skip, n) masked (K: score NaN, V: norm
// 0, as the register variant's load does), then weigh<RAW> (MASKS: on scores whose NaN is -inf).
template <class S>
__device__ __forceinline__ void weigh_masked(const float (&s)[4], const Tile<S::DW>& cur, int n, int skip, int gid,
                                             float qx0, float qx1, SoftmaxState<S::KS>& sm, uint32_t& ph0,
                                             uint32_t& ph1) {
  const bool ok0 = gid < n && gid >= skip, ok1 = gid + 8 < n && gid + 8 >= skip;
  float u[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    u[c] = (c < 2 ? ok0 : ok1) ? s[c] : __int_as_float(0x7fc00000);
    if (S::MASKS && !(u[c] > -INFINITY)) u[c] = -INFINITY;
  }
  sm.template weigh<!S::MASKS>(u, qx0, qx1, ok0 ? cur.vn0 : 0.f, ok1 ? cur.vn1 : 0.f, ph0, ph1);
}

// Scores, online softmax and V accumulation of one tile held in registers. kLateMask: its tokens
// outside [skip, n) are masked here (the ring's read leaves the norms as stored), and only a tile
// with masked tokens or a NaN or large weight (SoftmaxState::weigh_common) takes the masks and the
// NaN checks; else the tile's norms are masked already.
// Warp pairs: each warp has half of the dot products; they are exchanged through x_s (slot parity
// xb alternates, so one 64-thread barrier per tile suffices).
template <class S>
__device__ __forceinline__ void consume_tile(const DecodeParams& p, const Tile<S::DW>& cur, int xb, int n, int skip,
                                             const QueryFragments<S::KS>& q,
                                             const PairLut<false, S::QUADK, S::QUADV>& ilut, SoftmaxState<S::KS>& sm,
                                             float4* x_s,
                                             int warp, int stream, int lane) {
  float s[4];
  uint32_t ph0, ph1;
  // The weight is p * v_norm with the norm as stored (a NaN norm gives a NaN output row, as in the
  // reference and v1; masked tokens have norm 0); the max covers log2 |v_norm| (flushed to -inf
  // below 2^-126), so |weight| <= 2^kLazyMax.
  tile_dots<S::DW, false, S::QUADK, S::QUADV, S::K3>(cur, q.qh, q.ql, ilut, s);
  if constexpr (S::MASKS) {
    capped_scores<S::DW>(p, cur, q.qx0, q.qx1, s);
  } else {
    if constexpr (S::HALVES == 2) {
      x_s[(2 * warp + xb) * 32 + lane] = make_float4(s[0], s[1], s[2], s[3]);
      asm volatile("bar.sync %0, 64;" ::"r"(1 + stream) : "memory");  // the pair's two warps
      const float4 other = x_s[(2 * (warp ^ 1) + xb) * 32 + lane];
      s[0] += other.x;  // a + b in one warp, b + a in the other: the same float
      s[1] += other.y;
      s[2] += other.z;
      s[3] += other.w;
    }
    norm_scores<S::DW>(cur, s);
  }
  const float qx0 = S::MASKS ? 1.f : q.qx0, qx1 = S::MASKS ? 1.f : q.qx1;  // (MASKS: in s)
  if constexpr (S::kLateMask) {
    const bool full = n >= kTT && skip <= 0;
    if (!sm.weigh_common(s, qx0, qx1, cur.vn0, cur.vn1, full, ph0, ph1))
      weigh_masked<S>(s, cur, n, skip, lane >> 2, qx0, qx1, sm, ph0, ph1);
  } else if constexpr (S::MASKS) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (!(s[c] > -INFINITY)) s[c] = -INFINITY;
    sm.template weigh<false>(s, 1.f, 1.f, cur.vn0, cur.vn1, ph0, ph1);
  } else {
    sm.template weigh<true>(s, qx0, qx1, cur.vn0, cur.vn1, ph0, ph1);
  }
  tile_accumulate_v_b<S::DW, false, S::V2, S::QUADK, S::QUADV, S::V3, S::VB == 4>(cur.v, ph0, 0u, ph1, 0u, ilut,
                                                                                  sm.o);
}

// The folded window's tiles after the page tiles (in L2 by then: prefetched at the start),
// continuing their round robin: window tile wt on stream (ntt + wt) % NP, the streams with fewer
// page tiles.
template <class S>
__device__ __forceinline__ void fold_window_tiles(const DecodeParams& p, int seq, int kvh, int ntt, int stream,
                                                  int gid, int t4, const QueryFragments<S::KS>& q,
                                                  SoftmaxState<S::KS>& sm) {
  const WindowSpan ws = window_span<S::MASKS>(p, ld_early(p.window_ids + seq), kvh, ld_early(p.sl + seq));
#pragma unroll 1
  for (int wt = (stream - ntt % S::NP + S::NP) % S::NP; wt * kTT < ws.n; wt += S::NP) {
    float s[4];
    float kn0, kn1;
    window_scores<S::DW>(p, ws, wt * kTT, gid, t4, q.qh, s, kn0, kn1);
    s[0] *= q.qx0 * kn0;
    s[1] *= q.qx1 * kn0;
    s[2] *= q.qx0 * kn1;
    s[3] *= q.qx1 * kn1;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (S::MASKS && p.soft_cap_log2 > 0.f) s[c] = soft_capped_fast(s[c], p.soft_cap_log2, p.soft_cap_inv);
      if (!(s[c] > -INFINITY)) s[c] = -INFINITY;  // no such token (NaN), or a NaN product
    }
    uint32_t ph0, ph1;
    sm.template weigh<false>(s, 1.f, 1.f, kn0 == kn0 ? kWindowNorm : 0.f, kn1 == kn1 ? kWindowNorm : 0.f, ph0, ph1);
    window_accumulate_v<S::DW>(p, ws, wt * kTT, gid, t4, ph0, ph1, sm.o);
  }
}

// KB / VB: the K / V code width (2, 3 or 4), or 0 (register variant only): the runtime p.k_bits /
// p.v_bits.
// HALVES = 2 (head_dim 256, ring only): warp pairs. Both warps of a pair take the same tiles, each
// the codes of its half of the coordinates (DW = 128: the head_dim-128 tile loop and stage layout,
// from rows twice as long); after the K MMAs the two partial dot products are exchanged through
// shared memory (one 64-thread named barrier per tile), so both warps hold the same scores, running
// max, sums and weights, and each accumulates its half of the output.
// Padded rows (head_dim 80 and 96, and 192 as pairs; ring): a warp's DV = 80 or 96 coordinates run
// in the 128-coordinate tile loop. Where a row is whole 8-byte units (40 / 48 bytes for 4-bit
// codes, 24 for 2-bit at 96), the ring copies its bytes (8- or 16-byte units) to the start of a
// stage row of the 128-coordinate layout; the rest keeps whatever bytes it held (codes of finite
// centroids), which meet q's zero padding in the K MMAs (0 * c = 0) and give output coordinates
// DV..127 that the merge drops. Other rows (2- / 3-bit at 80, 3-bit at 96: packed_rows) stay at
// the pool's stride in the stage, and the lanes of the padding coordinates read the next row's
// codes to the same effect (TileRing::read).
// ITEMS = 2 (ring, head tiles of 4, no warp pairs): one CTA of 16 warps serves two work items,
// the query-head rows blockIdx.y * 2 and + 1 of the grid of one item per CTA: warps 0-7 the first,
// 8-15 the second, each set as one CTA of ITEMS = 1, with one pair of tables for both (each item's
// threads build one of them) and 4-stage rings. Two CTAs of one SM share its memory unevenly (the
// older one's warps are issued first, so the younger one ends ~10 us later at (32, 8192)); the
// warps of one CTA keep together. Its q rows are staged outside the tables, which are built first
// (one prologue barrier), and each warp merges and rotates back its head's row in the fused
// epilogue.
// ITEMS = 4 or 8: the same with 4 or 2 warps per item (each stages 2 or 4 of the tile's 8 q rows),
// so that a grid of more items than two per SM runs in one wave of CTAs (one prologue and epilogue
// per SM instead of one per wave); 3-stage rings at 8 items (their q rows take 32 KB).
// Phases: the first reads (centroids, q, Pi_v, the first tiles' block-table entries), the prologue
// (q staged and scaled, the pair tables built, the first tiles' copies), the tile loop (ring or
// registers, consume_tile), the folded window (fold_window_tiles), the merge (merge_tile_state).
// MASKS: the sliding window and logit soft cap (DecodeParams; ring, head_dim 64 / 128 only).
template <int D, int GT, bool RING, int KB = 4, int VB = 4, int HALVES = 1, int ITEMS = 1, bool MASKS = false>
__global__ void __launch_bounds__(v4_threads(ITEMS), v4_ctas_per_sm(ITEMS))
    decode_tc_f16_kernel(const DecodeParams p) {
  using S = F16Shape<D, GT, RING, KB, VB, HALVES, ITEMS, MASKS>;
  constexpr int NP = S::NP, kStages = S::kStages;
  pdl_launch_dependents();  // the combine kernel's CTAs may take the SMs' spare room now (they wait for this grid's end)

  // kSmemBytes: interleaved K / V tables; RING: then ring_bytes() of per-warp rings.
  // Per item (ITEMS > 1): qexp_s, bad_s, m_s, l_s, q_sep and o_s.
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float qexp_all[ITEMS][kNH];
  __shared__ int bad_all[ITEMS][kNH];  // heads whose q_rot row is not all finite (NaN output rows)
  __shared__ __align__(16) float w_s[v4_threads(ITEMS) / 32][kTT * kNH];  // per-warp scratch of the prologue and the merge
  __shared__ float m_all[ITEMS][NP][kNH];
  __shared__ float l_all[ITEMS][NP][kNH];
  __shared__ __align__(16) float4 x_s[HALVES == 2 ? kW4 * 2 * 32 : 1];  // pairs: [warp][tile parity][lane]
  __shared__ LaneWords<D / 32> rot_v_s[32];  // the fused epilogue's Pi_v spec words
  __shared__ __align__(16) float q_sep[S::kSeveral ? ITEMS * kNH * S::QROW : 1];
  const int item = ITEMS == 1 ? 0 : static_cast<int>(threadIdx.x) / (32 * S::IW);
  float* qexp_s = qexp_all[item];
  int* bad_s = bad_all[item];
  auto& m_s = m_all[item];
  auto& l_s = l_all[item];
  // (ITEMS = 2: the second item's in the rings; 4 and 8: all in the table space, no room after
  // them for merge_rotate_and_store's rows, which these items never reach: their fused epilogue
  // always has rot_v_s, so merge_tile_state takes merge_rotate_per_warp)
  constexpr int kOsItemBytes = ITEMS == 2 ? kSmemBytes : NP * kNH * D * 4;
  auto& o_s = *reinterpret_cast<float(*)[NP][kNH * D]>(smem + item * kOsItemBytes);  // after the main loop only
  // q rows: in the table space (one item), or outside the tables (several)
  float* q_s = S::kSeveral ? q_sep + item * kNH * S::QROW : reinterpret_cast<float*>(smem);

  const int tid = threadIdx.x - item * 32 * S::IW;  // in the item's threads
  const int slot = threadIdx.x >> 5;                // the warp's ring and scratch (w_s)
  // The fused rotation's scratch of the warp (D floats): w_s at head_dim 128; at 64 the tables' last
  // D floats per warp, free in the prologue (q_s: their first rows) and in the epilogue (o_s and the
  // merged rows before them), so that the head_dim 64 kernels keep their static shared memory.
  constexpr int kWarpsAll = v4_threads(ITEMS) / 32;
  static_assert(D != 64 || (ITEMS == 1 && (kNH * D + (NP * kNH + GT) * D + kWarpsAll * D) * 4 <= kSmemBytes),
                "head_dim 64: the rotation scratch after q_s and the epilogue's rows");
  float* rot_buf = D == 64 ? reinterpret_cast<float*>(smem + kSmemBytes) - (slot + 1) * D
                           : w_s[slot];
  const int warp = tid >> 5;
  const int stream = warp / HALVES;  // this warp's tiles: stream, stream + NP, ...
  const int half = warp % HALVES;    // pairs: coordinates half * DW ..
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int t4 = lane & 3;
  const int gs = p.grid_splits;  // num_splits, + 1 where a CTA of its own serves the folded window
  const int seq = blockIdx.x / gs;
  const int split = blockIdx.x - seq * gs;
  const int row = blockIdx.y * ITEMS + item;  // the item's query-head row (host: gridDim.y * ITEMS rows)
  const int kvh = row / p.ntiles;
  const int tile = row - kvh * p.ntiles;
  const unsigned trace_cta = blockIdx.x + gridDim.x * row;

  // The split's tokens and tiles, from seq_lens. The ring path sets them only after its other first
  // reads are issued (below): the first use of the seq_lens value stalls the warp until it lands,
  // and every read issued after that use would wait behind it.
  SplitTiles tiles;
  // (a call, not a value: nothing of it stays live through the tile loop)
  auto window_cta = [&]() { return S::FOLD && p.kwin != nullptr && split == p.window_split; };
  if constexpr (!RING) {
    tiles.set_range<S::MASKS>(p, p.sl[seq], split);
    if (window_cta()) prefetch_window_l2<D>(p, ld_early(p.window_ids + seq), kvh, tid, 32 * S::IW);
  }
  tiles.locate(p, seq, kvh);
  // RING is launched only for pages of a multiple of 16 tokens (use_ring in paged_decode.cu): its
  // tiles are whole 16-row blocks inside one page, with no per-token path.
  const RegisterTiles<S> registers(p, gid, t4, half);
  const TileRing<S> ring(p, smem, slot, lane, half);

  // ---- the first reads, all at once: the centroids, q, Pi_k's and Pi_v's spec words (the fused
  // epilogue's, staged in shared memory) and the first tiles' block-table entries; the tiles'
  // copies follow the q staging. (Issued after the copies, these reads waited a loaded memory
  // latency behind them, at the start and again in the fused epilogue.)
  static_assert(kT4 == 256, "one K and one V table entry per thread");
  trace_phase(p, trace_cta, warp, lane, 0);
  const LutSeed lut_seed = load_lut_seed<S::QUADK, S::QUADV>(p.kcent, p.vcent, p.k_bits, p.v_bits, S::KSHIFT, S::VSHIFT);
  QueryRows<S::QROW, S::HPW> qrows =
      load_query_rows<S::QROW, GT, S::HPW, S::DV, S::DW>(p, seq, kvh, tile, warp, lane);
  const bool fused_epilogue = fused_rotation_head_dim(D) && p.rot != nullptr && !writes_partials(p);
  LaneWords<D / 32> rot_v = {};
  if (fused_epilogue && slot == 0) rot_v = ld_early(reinterpret_cast<const LaneWords<D / 32>*>(p.rot + D) + lane);
  Tile<S::DW> cur, nxt;
  TilePage page_next = {-1, 0}, first[kStages];  // first: the pages of the warp's first tiles
#pragma unroll
  for (int st = 0; st < kStages; ++st) first[st] = {-1, 0};
  int n_st[kStages] = {};
  if constexpr (RING) {
    const bool from_zero = split == 0 && (!S::MASKS || p.sliding_window <= 0);  // its tiles start at token 0
    if (from_zero) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) first[st] = tiles.first_page(p, stream + st * NP);
      page_next = tiles.first_page(p, stream + kStages * NP);
    }
    // seq_lens is read after the reads above (the centroids, q, Pi_v, split 0's table entries) and
    // used right away: one wait for all of them.
    const int win_id = window_cta() ? ld_early(p.window_ids + seq) : -1;
    tiles.set_range<S::MASKS>(p, ld_early(p.sl + seq), split);
    if (window_cta()) prefetch_window_l2<D>(p, win_id, kvh, tid, 32 * S::IW);
    if (!from_zero) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) first[st] = tiles.page<true>(p, stream + st * NP);
      page_next = tiles.page<true>(p, stream + kStages * NP);
    }
  } else if (registers.one_page) {
    first[0] = tiles.page<true>(p, stream);
    page_next = tiles.page<true>(p, stream + NP);
  }
  __threadfence_block();  // keeps the compiler from sinking the reads above below the q staging
  trace_phase(p, trace_cta, warp, lane, 1);

  // ---- prologue: q of head `warp` (scaled, per-head power of two), the tables, the first copies.
  // One item per CTA: q in the table space, the first tiles' copies issued after it (the
  // block-table reads above have landed by then), so that the prologue's own loads are not queued
  // behind them. Several items: the copies first (right behind the small reads, so still served
  // first: -0.5 us at (32, 8192) against after the q staging), then each item's threads build one
  // table, q goes to q_sep, one barrier.
  auto first_copies = [&]() {
    if constexpr (RING) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) n_st[st] = ring.issue(p, tiles, stream + st * NP, st, first[st], lane);
    } else {
      if (stream < tiles.ntt) registers.load(p, tiles, stream, cur, first[0], gid, t4);
    }
  };
  if constexpr (S::kSeveral) first_copies();
  if constexpr (S::kSeveral) build_item_lut<false, S::QUADK, S::QUADV>(smem, lut_seed, threadIdx.x >> 8, threadIdx.x & 255);
  stage_queries<S::QROW, S::HPW, S::DV, S::DW>(p, qrows, q_s, qexp_s, bad_s, warp, lane, rot_buf);
  if (slot == 0) rot_v_s[lane] = rot_v;
  if constexpr (!S::kSeveral) first_copies();
  trace_phase(p, trace_cta, warp, lane, 2);
  __syncthreads();
  QueryFragments<S::KS> q;
  query_fragments<S::DW>(q_s + half * S::DW, gid, t4, q.qh, q.ql, S::QROW);
  q.qx0 = qexp_s[2 * t4];
  q.qx1 = qexp_s[2 * t4 + 1];
  if constexpr (!S::kSeveral) {
    __syncthreads();
    build_pair_luts<false, S::QUADK, S::QUADV>(smem, lut_seed);
    __syncthreads();
  }
  PairLut<false, S::QUADK, S::QUADV> ilut(smem, lane);
  // (Two items: left to the compiler, which then rebuilds them from %tid; pinned, one was spilled
  // and reloaded in every pass of the loop. Four: pinned spills less. F16Shape::kPinLut.)
  if constexpr (S::kPinLut) asm("" : "+r"(ilut.k_lane), "+r"(ilut.v_lane));
  trace_phase(p, trace_cta, warp, lane, 3);

  // ---- the tile loop ----
  SoftmaxState<S::KS> sm;
  auto consume = [&](const Tile<S::DW>& t, int xb, int n, int skip) {
    consume_tile<S>(p, t, xb, n, skip, q, ilut, sm, x_s, warp, stream, lane);
  };
  if constexpr (RING) {
    // Step of tile ti from stage ST: wait for its group (the newer ones may stay in flight), copy
    // it to registers, refill the stage with tile ti + kStages * NP, then the math.
    auto ring_step = [&](int ti, auto st_tag) {
      constexpr int ST = decltype(st_tag)::value;
      cp_async_wait<kStages - 1>();
      __syncwarp();  // every lane's copies of this stage are visible to the whole warp
      const int skip = S::MASKS ? tiles.skip - ti * kTT : 0;
      ring.read(ST, n_st[ST], cur, gid, t4, skip);
      __syncwarp();  // every lane has read the stage before it is overwritten
      const int n = n_st[ST];
      n_st[ST] = ring.issue(p, tiles, ti + kStages * NP, ST, page_next, lane);
      page_next = tiles.page<false>(p, ti + (kStages + 1) * NP);
      consume(cur, (ti / NP) & 1, n, skip);  // ti = stream + k * NP with stream < NP: k
    };
    // One pass over the ring from stage ST (tile ti), stopping after the last tile.
    auto ring_pass = [&](int ti, auto st_tag, auto& self) -> void {
      constexpr int ST = decltype(st_tag)::value;
      ring_step(ti, st_tag);
      if constexpr (ST + 1 < kStages) {
        if (ti + NP < tiles.ntt) self(ti + NP, std::integral_constant<int, ST + 1>{}, self);
      }
    };
#pragma unroll 1
    for (int ti = stream; ti < tiles.ntt; ti += kStages * NP) ring_pass(ti, std::integral_constant<int, 0>{}, ring_pass);
    cp_async_wait<0>();
  } else {
    // Prefetch tile ti + NP into `next`, then consume `cur`; called on alternating register sets
    // (no tile copy between iterations).
    auto step = [&](int ti, const Tile<S::DW>& cur, Tile<S::DW>& next) {
      registers.load(p, tiles, ti + NP, next, page_next, gid, t4);
      if (registers.one_page) page_next = tiles.page<false>(p, ti + 2 * NP);
      consume(cur, 0, kTT, 0);  // (masked by load)
    };
#pragma unroll 1
    for (int ti = stream; ti < tiles.ntt; ti += 2 * NP) {
      step(ti, cur, nxt);
      if (ti + NP >= tiles.ntt) break;
      step(ti + NP, nxt, cur);
    }
  }
  if constexpr (S::FOLD) {
    if (window_cta()) fold_window_tiles<S>(p, seq, kvh, tiles.ntt, stream, gid, t4, q, sm);
  }
  trace_phase(p, trace_cta, warp, lane, 4);
  merge_tile_state<D, GT, NP, S::DW, HALVES, (ITEMS >= 2)>(p, sm.o, sm.m, sm.l, o_s, m_s, l_s, bad_s, stream, gid, t4,
                                                         seq, split, kvh, tile, rot_buf, half,
                                                         fused_epilogue ? rot_v_s : nullptr, trace_cta);
  trace_phase(p, trace_cta, warp, lane, 9);
}

}  // namespace v3
}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_DECODE_TENSOR_CORE_CUH_
