// jax_tq storage format: THE single C++ definition, shared by the CPU (.cc) and
// CUDA (.cu) kernels. Mirrors jax_tq/format.py and docs/DESIGN.md.
//
// Packed codes: packed_bytes = head_dim * bits / 8. The bit stream is LSB-first:
// code i occupies bits [i*bits, (i+1)*bits) of the little-endian byte stream.
//   4-bit: byte j = c[2j] | c[2j+1] << 4
//   2-bit: byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6
//   3-bit: each group of 8 codes is one 24-bit little-endian word
//          w = sum_k c[8g+k] << (3k), stored as bytes w&255, (w>>8)&255, (w>>16)&255.
//
// Paged cache (one pool per K and per V):
//   codes uint8 [num_pages, num_kv_heads, page_size, packed_bytes]
//   norms f32   [num_pages, num_kv_heads, page_size]
#ifndef JAX_TQ_FORMAT_H_
#define JAX_TQ_FORMAT_H_

#include <cstdint>

#if defined(__CUDACC__)
#define JTQ_HD __host__ __device__ __forceinline__
#define JTQ_UNROLL _Pragma("unroll")
#else
#define JTQ_HD inline
#define JTQ_UNROLL
#endif

namespace jax_tq {

// ---------------------------------------------------------------------------
// Supported configurations.
// ---------------------------------------------------------------------------
// The tables (jax_tq/format.py's SUPPORTED_HEAD_DIMS and PACKED_BITS): a new head_dim or width is
// one entry here, its packing below and its kernels' specializations; kernels instantiate per entry
// through with_value (jax_tq/dispatch.h).
template <int... Vs>
struct IntList {
  static constexpr int kSize = sizeof...(Vs);
  static constexpr bool contains(int v) { return ((v == Vs) || ...); }
};
using SupportedHeadDims = IntList<64, 80, 96, 128, 192, 256>;
using PackedBits = IntList<2, 3, 4>;

constexpr int kMinBits = 2;
constexpr int kMaxBits = 4;
constexpr int kMaxCentroids = 1 << kMaxBits;  // 16
constexpr int kMaxHeadDim = 256;

JTQ_HD bool is_supported_head_dim(int head_dim) { return SupportedHeadDims::contains(head_dim); }

JTQ_HD bool is_supported_bits(int bits) { return PackedBits::contains(bits); }

// Number of bytes of one packed row. Every supported head_dim is a multiple of 16,
// so head_dim * bits is always a multiple of 8 (and head_dim a multiple of 8 for
// the 3-bit grouping).
JTQ_HD int packed_bytes(int head_dim, int bits) { return head_dim * bits / 8; }

// Codes per packing group and bytes per packing group:
//   4-bit: 2 codes / 1 byte, 2-bit: 4 codes / 1 byte, 3-bit: 8 codes / 3 bytes.
JTQ_HD int group_codes(int bits) { return bits == 3 ? 8 : 8 / bits; }
JTQ_HD int group_bytes(int bits) { return bits == 3 ? 3 : 1; }

// ---------------------------------------------------------------------------
// Single-code access.
// ---------------------------------------------------------------------------
JTQ_HD uint32_t load_word3(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16);
}

JTQ_HD uint32_t get_code(const uint8_t* row, int i, int bits) {
  if (bits == 4) return (uint32_t(row[i >> 1]) >> ((i & 1) * 4)) & 0xFu;
  if (bits == 2) return (uint32_t(row[i >> 2]) >> ((i & 3) * 2)) & 0x3u;
  // bits == 3
  const uint8_t* p = row + 3 * (i >> 3);
  return (load_word3(p) >> (3 * (i & 7))) & 0x7u;
}

JTQ_HD void set_code(uint8_t* row, int i, int bits, uint32_t code) {
  if (bits == 4) {
    const int sh = (i & 1) * 4;
    uint8_t& b = row[i >> 1];
    b = uint8_t((b & ~(0xFu << sh)) | ((code & 0xFu) << sh));
  } else if (bits == 2) {
    const int sh = (i & 3) * 2;
    uint8_t& b = row[i >> 2];
    b = uint8_t((b & ~(0x3u << sh)) | ((code & 0x3u) << sh));
  } else {  // bits == 3
    uint8_t* p = row + 3 * (i >> 3);
    const int sh = 3 * (i & 7);
    uint32_t w = load_word3(p);
    w = (w & ~(0x7u << sh)) | ((code & 0x7u) << sh);
    p[0] = uint8_t(w & 0xFFu);
    p[1] = uint8_t((w >> 8) & 0xFFu);
    p[2] = uint8_t((w >> 16) & 0xFFu);
  }
}

// ---------------------------------------------------------------------------
// Group helpers (what a GPU thread wants: a few bytes -> several codes).
// ---------------------------------------------------------------------------
JTQ_HD void unpack8_3bit(uint8_t b0, uint8_t b1, uint8_t b2, uint8_t out[8]) {
  const uint32_t w = uint32_t(b0) | (uint32_t(b1) << 8) | (uint32_t(b2) << 16);
JTQ_UNROLL
  for (int k = 0; k < 8; ++k) out[k] = uint8_t((w >> (3 * k)) & 0x7u);
}

JTQ_HD void unpack2_4bit(uint8_t b, uint8_t out[2]) {
  out[0] = uint8_t(b & 0xFu);
  out[1] = uint8_t(b >> 4);
}

JTQ_HD void unpack4_2bit(uint8_t b, uint8_t out[4]) {
  out[0] = uint8_t(b & 0x3u);
  out[1] = uint8_t((b >> 2) & 0x3u);
  out[2] = uint8_t((b >> 4) & 0x3u);
  out[3] = uint8_t(b >> 6);
}

JTQ_HD uint32_t pack8_3bit(const uint8_t c[8]) {
  uint32_t w = 0;
JTQ_UNROLL
  for (int k = 0; k < 8; ++k) w |= uint32_t(c[k] & 0x7u) << (3 * k);
  return w;  // store as bytes w&255, (w>>8)&255, (w>>16)&255
}

// A group's 8 codes as nibbles (code k in bits 4k..4k+3 of the result) from its packed bits:
// 2-bit, 16 bits (code k in bits 2k..2k+1; the upper 16 bits must be 0); 3-bit, 24 bits (code k
// in bits 3k..3k+2; bits 24..31 are ignored). The GPU decode kernels spread 2- and 3-bit codes to
// nibbles so that one 4-bit path serves every width.
JTQ_HD uint32_t nibbles_from_2bit(uint32_t x) {
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  return (x | (x << 2)) & 0x33333333u;
}

JTQ_HD uint32_t nibbles_from_3bit(uint32_t x) {
  x = (x & 0x00000FFFu) | ((x & 0x00FFF000u) << 4);
  x = (x & 0x003F003Fu) | ((x & 0x0FC00FC0u) << 2);
  return (x & 0x07070707u) | ((x & 0x38383838u) << 1);
}

// ---------------------------------------------------------------------------
// Whole-row pack / unpack. codes: one uint8 per coordinate, head_dim of them.
// row: packed_bytes(head_dim, bits) bytes.
// ---------------------------------------------------------------------------
JTQ_HD void pack_row(const uint8_t* codes, int head_dim, int bits, uint8_t* row) {
  if (bits == 4) {
    for (int j = 0; j < head_dim / 2; ++j)
      row[j] = uint8_t((codes[2 * j] & 0xFu) | ((codes[2 * j + 1] & 0xFu) << 4));
  } else if (bits == 2) {
    for (int j = 0; j < head_dim / 4; ++j)
      row[j] = uint8_t((codes[4 * j] & 0x3u) | ((codes[4 * j + 1] & 0x3u) << 2) |
                       ((codes[4 * j + 2] & 0x3u) << 4) | ((codes[4 * j + 3] & 0x3u) << 6));
  } else {  // bits == 3
    for (int g = 0; g < head_dim / 8; ++g) {
      const uint32_t w = pack8_3bit(codes + 8 * g);
      row[3 * g + 0] = uint8_t(w & 0xFFu);
      row[3 * g + 1] = uint8_t((w >> 8) & 0xFFu);
      row[3 * g + 2] = uint8_t((w >> 16) & 0xFFu);
    }
  }
}

JTQ_HD void unpack_row(const uint8_t* row, int head_dim, int bits, uint8_t* codes) {
  if (bits == 4) {
    for (int j = 0; j < head_dim / 2; ++j) unpack2_4bit(row[j], codes + 2 * j);
  } else if (bits == 2) {
    for (int j = 0; j < head_dim / 4; ++j) unpack4_2bit(row[j], codes + 4 * j);
  } else {  // bits == 3
    for (int g = 0; g < head_dim / 8; ++g)
      unpack8_3bit(row[3 * g], row[3 * g + 1], row[3 * g + 2], codes + 8 * g);
  }
}

// A group of 8 codes (group g of a packed row: bits bytes at offset g * bits) as nibbles, code k
// in bits 4k..4k+3 of the result, for every packed width.
JTQ_HD uint32_t group8_nibbles(const uint8_t* row, int g, int bits) {
  const uint8_t* p = row + g * bits;
  uint32_t w = 0;
  for (int i = 0; i < bits; ++i) w |= uint32_t(p[i]) << (8 * i);
  return bits == 4 ? w : (bits == 3 ? nibbles_from_3bit(w) : nibbles_from_2bit(w));
}

// ---------------------------------------------------------------------------
// QJL sign bits (TurboQuant_prod, docs/FORMAT.md): sign_bytes = head_dim / 8; coordinate j is bit
// j % 8 of byte j / 8 (the 1-bit case of the codes' LSB-first stream); a set bit is +1 (the
// sketched residual was >= 0), a clear bit -1. Mirrors jax_tq.format.pack_signs.
// ---------------------------------------------------------------------------
JTQ_HD int sign_bytes(int head_dim) { return head_dim / 8; }

JTQ_HD float sign_value(const uint8_t* row, int j) {
  return ((row[j >> 3] >> (j & 7)) & 1u) ? 1.0f : -1.0f;
}

// Sign bits of s[0 .. head_dim): bit set where s[j] >= 0 (NaN counts as negative).
JTQ_HD void pack_sign_bits(const float* s, int head_dim, uint8_t* row) {
  for (int b = 0; b < head_dim / 8; ++b) {
    uint32_t byte = 0;
    for (int k = 0; k < 8; ++k) byte |= (s[8 * b + k] >= 0.0f ? 1u : 0u) << k;
    row[b] = uint8_t(byte);
  }
}

// ---------------------------------------------------------------------------
// A norm below 2^-64 is stored as the zero vector: norm 0, the codes of y = 0 (docs/FORMAT.md;
// format.py MIN_NORM). A margin: from a norm of about 2^-100 down, the kernels' float32 products of
// x with the rotation (and the low halves of their bfloat16 splits) fall under 2^-126 and lose
// precision. Compared in float32 (the double overload rounds first, as the other backends store
// float32 norms); NaN stays NaN.
// ---------------------------------------------------------------------------
constexpr float kMinNorm = 0x1p-64f;

JTQ_HD float stored_norm(float norm) { return norm < kMinNorm ? 0.f : norm; }
JTQ_HD double stored_norm(double norm) { return static_cast<float>(norm) < kMinNorm ? 0.0 : norm; }

// ---------------------------------------------------------------------------
// Quantizer: code = number of boundaries strictly less than y, where
// boundary_i = (c_i + c_{i+1}) / 2 (computed in float32), nb = 2**bits - 1.
// y exactly on a boundary goes to the lower centroid.
// ---------------------------------------------------------------------------
JTQ_HD float centroid_boundary(const float* centroids, int i) {
  return (centroids[i] + centroids[i + 1]) * 0.5f;
}

JTQ_HD uint32_t bucketize(float y, const float* boundaries, int nb) {
  uint32_t n = 0;
  for (int i = 0; i < nb; ++i) n += (boundaries[i] < y) ? 1u : 0u;
  return n;
}

// ---------------------------------------------------------------------------
// Fitted scale (codecs with scale="fit", docs/FORMAT.md "Fitted scale"). The unit rotated vector
// y is quantized against the boundaries scaled by each of kFitCandidates pre-scalings
// s_k = fit_grid(k) = (45 + 3k) / 64 (exact in float32), codes_k[j] = #{i : fl32(s_k * b_i) < y_j};
// the candidate that keeps the most energy, fit_gain = <y, c[codes_k]>^2 / |c[codes_k]|^2, wins (the
// first such k on ties), and the stored "norm" is the least-squares scale
// ||x|| * <y, c[codes]> / |c[codes]|^2 (0 for a zero vector), so that decoding stays
// x_hat = norm * Pi^T c[codes] and the attention kernels read it unchanged. Mirrors
// jax_tq.format.FIT_GRID.
// ---------------------------------------------------------------------------
constexpr int kFitCandidates = 17;

JTQ_HD float fit_grid(int k) { return float(45 + 3 * k) * (1.0f / 64.0f); }

// The scaled boundary i of candidate k, fl32(s_k * b_i), b_i = centroid_boundary(centroids, i).
JTQ_HD float fit_boundary(const float* centroids, int k, int i) {
  return fit_grid(k) * centroid_boundary(centroids, i);
}

// ---------------------------------------------------------------------------
// Recent-token window (docs/FORMAT.md "Window"): a cache may keep the last `window` tokens of each
// sequence exactly, as bfloat16 rows of the ROTATED vector (Pi_k k, Pi_v v) in a ring per window id:
//   k_window, v_window bf16 [num_windows, num_kv_heads, window, head_dim];
// the token at position p of a sequence whose window id is w sits in entry [w, head, p % window].
// A sequence of (clamped) length L reads its last min(L, window) tokens from the ring and the
// others, [0, paged_tokens), from the pages; a window id outside [0, num_windows) contributes no
// window token (never read out of bounds). window = 0: no window, every token from the pages.
// Rows hold bf16(fl32(||x|| * y_j)) (round to nearest even), y the unit rotated vector of the codes.
// ---------------------------------------------------------------------------
JTQ_HD int64_t clamp_len(int64_t len, int64_t capacity) { return len < 0 ? 0 : (len > capacity ? capacity : len); }

// Tokens of a sequence of length seq_len (clamped to [0, capacity]) read from the pages.
JTQ_HD int64_t paged_tokens(int64_t seq_len, int64_t capacity, int64_t window) {
  const int64_t len = clamp_len(seq_len, capacity);
  return len > window ? len - window : 0;
}

// Ring entry (within one window id and head) of the token at position p >= 0.
JTQ_HD int64_t window_entry(int64_t position, int64_t window) { return position % window; }

// ---------------------------------------------------------------------------
// Paged cache indexing (int64 arithmetic throughout).
// ---------------------------------------------------------------------------
// Element offset of the first byte of the packed row in
// codes[num_pages, num_kv_heads, page_size, packed].
JTQ_HD int64_t codes_offset(int64_t page, int64_t head, int64_t slot_in_page,
                            int64_t num_kv_heads, int64_t page_size, int64_t packed) {
  return ((page * num_kv_heads + head) * page_size + slot_in_page) * packed;
}

// Element offset in norms[num_pages, num_kv_heads, page_size].
JTQ_HD int64_t norms_offset(int64_t page, int64_t head, int64_t slot_in_page,
                            int64_t num_kv_heads, int64_t page_size) {
  return (page * num_kv_heads + head) * page_size + slot_in_page;
}

// Split-K partition of one sequence (docs/DESIGN.md): seq_len is clamped to
// [0, max_pages * page_size]; its ceil(seq_len / page_size) logical pages are cut into num_splits
// contiguous ranges of ceil(n_pages / num_splits) pages. Split `split` covers logical pages
// [page_begin, page_end) and tokens [tok_begin, tok_end); empty when they are equal.
struct SplitRange {
  int64_t seq_len, page_begin, page_end, tok_begin, tok_end;
};

JTQ_HD SplitRange split_range(int64_t seq_len, int64_t max_pages, int64_t page_size,
                              int64_t num_splits, int64_t split) {
  const int64_t max_tok = max_pages * page_size;
  seq_len = seq_len < 0 ? 0 : (seq_len > max_tok ? max_tok : seq_len);
  const int64_t n_pages = page_size > 0 ? (seq_len + page_size - 1) / page_size : 0;
  const int64_t pages_per_split = (n_pages + num_splits - 1) / num_splits;
  int64_t p0 = split * pages_per_split;
  if (p0 > n_pages) p0 = n_pages;
  int64_t p1 = p0 + pages_per_split;
  if (p1 > n_pages) p1 = n_pages;
  const int64_t t1 = p1 * page_size < seq_len ? p1 * page_size : seq_len;
  return SplitRange{seq_len, p0, p1, p0 * page_size, t1};
}

// The paged tokens split `split` of a decode reads (the query at position L - 1, L = seq_len
// clamped to [0, max_pages * page_size]; the last `window` tokens come from the recent-token
// window, paged_tokens): with a sliding window it sees positions [first_visible, L),
// first_visible = max(L - sliding_window, 0), else all (first_visible 0). The splits share the
// pages from first_visible's page on (split_range of those), so no page before the window is read;
// [tok_begin, tok_end) starts at a page boundary and the reader skips its tokens before
// first_visible. Empty when tok_begin >= tok_end.
struct VisibleSplit {
  int64_t tok_begin, tok_end, first_visible;
};

JTQ_HD VisibleSplit visible_split_range(int64_t seq_len, int64_t max_pages, int64_t page_size, int64_t window,
                                        int64_t sliding_window, int64_t num_splits, int64_t split) {
  const int64_t capacity = max_pages * page_size;
  const int64_t len = clamp_len(seq_len, capacity);
  const int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
#ifdef __CUDA_ARCH__  // the CUDA handlers keep capacity < 2^31: a 32-bit division (fewer registers)
  const int64_t first_page = first > 0 ? int64_t(uint32_t(first) / uint32_t(page_size)) : 0;
#else
  const int64_t first_page = first > 0 && page_size > 0 ? first / page_size : 0;
#endif
  const int64_t base = first_page * page_size;
  const SplitRange r = split_range(paged_tokens(seq_len, capacity, window) - base, max_pages - first_page, page_size,
                                   num_splits, split);
  return VisibleSplit{base + r.tok_begin, base + r.tok_end, first};
}

// Paged prefill (docs/DESIGN.md): sequence s owns the query rows [begin, end), query_start_loc
// clamped to [0, T] with end >= begin; its seq_len is clamped to [0, max_pages * page_size]. Row i
// sits at position seq_len - (end - begin) + (i - begin) of its sequence and attends causally to
// tokens [0, that position]: causal_len tokens (0 for a row before the sequence's start).
struct PrefillRows {
  int64_t begin, end, seq_len;
  JTQ_HD int64_t causal_len(int64_t row) const {
    const int64_t len = seq_len - (end - begin) + (row - begin) + 1;
    return len < 0 ? 0 : (len > seq_len ? seq_len : len);
  }
};

JTQ_HD int64_t clamp_index(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

JTQ_HD PrefillRows prefill_rows(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t s,
                                int64_t num_rows, int64_t max_tokens) {
  const int64_t begin = clamp_index(query_start_loc[s], 0, num_rows);
  const int64_t end = clamp_index(query_start_loc[s + 1], begin, num_rows);
  return PrefillRows{begin, end, clamp_index(seq_lens[s], 0, max_tokens)};
}

// ---------------------------------------------------------------------------
// Hadamard rotation spec (codecs with rotation="hadamard", head_dim a power of two):
//   Pi = H D2 P H D1, H the normalized Sylvester Hadamard matrix (H[i][k] = (-1)^popcount(i & k)
//   / sqrt(d)), D1 / D2 diagonals of +-1, (P v)_i = v_{perm[i]}.
// One int32 word per coordinate i: bits 0-15 perm[i], bit 16 set where D1[i] = -1, bit 17 set
// where D2[i] = -1. paged_decode takes one such row per codec (K, then V) and applies q_rot = Pi_k q
// and out = Pi_v^T o_rot itself. Mirrors jax_tq.format.hadamard_spec.
// ---------------------------------------------------------------------------
constexpr uint32_t kRotPermMask = 0xFFFFu;
constexpr uint32_t kRotNeg1Bit = 1u << 16;
constexpr uint32_t kRotNeg2Bit = 1u << 17;

JTQ_HD int rot_perm(uint32_t word) { return static_cast<int>(word & kRotPermMask); }
JTQ_HD bool rot_neg1(uint32_t word) { return (word & kRotNeg1Bit) != 0; }
JTQ_HD bool rot_neg2(uint32_t word) { return (word & kRotNeg2Bit) != 0; }

// The head_dims whose rotations paged_decode's kernels apply themselves (a warp holds a row, 2 or 4
// coordinates per lane) where its plan (decode_plan.h) says fused_rotation.
JTQ_HD constexpr bool fused_rotation_head_dim(int64_t d) { return d == 64 || d == 128; }

}  // namespace jax_tq

#endif  // JAX_TQ_FORMAT_H_
