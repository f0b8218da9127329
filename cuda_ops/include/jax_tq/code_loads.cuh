// Loads of packed codes of any width (2, 3 or 4 bits, docs/FORMAT.md) as nibble words, shared by
// the tensor-core kernels (decode_tensor_core.cuh, prefill_tensor_core.cuh).
#ifndef JAX_TQ_CODE_LOADS_CUH_
#define JAX_TQ_CODE_LOADS_CUH_

#include <cstdint>

#include "jax_tq/format.h"

namespace jax_tq {
namespace cuda {
namespace {

// ---- code loads of any width: a lane's 8N consecutive codes as N nibble words ------------------
// (8 codes each, code i in bits 4i..4i+3), so that everything after the load is the 4-bit code.
// 4-bit rows hold them as they are; 2- and 3-bit rows (docs/FORMAT.md) are spread to nibbles here.

struct GlobalMem {  // the read-only data path
  template <class T>
  static __device__ __forceinline__ T at(const uint8_t* p) { return __ldg(reinterpret_cast<const T*>(p)); }
};
struct SharedMem {
  template <class T>
  static __device__ __forceinline__ T at(const uint8_t* p) { return *reinterpret_cast<const T*>(p); }
};

// Largest power of two, at most 16, that divides x: the alignment of the loads at offsets that are
// multiples of x from a 16-byte aligned base.
constexpr int align_of(int x) { return x % 16 == 0 ? 16 : x % 8 == 0 ? 8 : x % 4 == 0 ? 4 : x % 2 == 0 ? 2 : 1; }

// N consecutive 32-bit words at src, AL-byte aligned (AL >= 4): one vector load where AL allows,
// else 8- or 4-byte loads.
template <int N, class Mem, int AL = 16>
__device__ __forceinline__ void load_words(const uint8_t* src, uint32_t (&w)[N]) {
  static_assert(N == 1 || N == 2 || N == 4, "1, 2 or 4 words");
  static_assert(AL >= 4, "words: 4-byte aligned");
  if constexpr (N == 4 && AL >= 16) {
    const uint4 v = Mem::template at<uint4>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (N >= 2 && AL >= 8) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const uint2 v = Mem::template at<uint2>(src + 4 * i);
      w[i] = v.x, w[i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = Mem::template at<uint32_t>(src + 4 * i);
  }
}

// The 96 bits (a lane's 32 3-bit codes) at src as three words: AL >= 4: three loads; AL = 2: the
// four words around them, shifted by 16 bits where src is not 4-byte aligned (load_groups3).
template <class Mem, int AL = 16>
__device__ __forceinline__ void load_stream3(const uint8_t* src, uint32_t& a, uint32_t& b, uint32_t& c) {
  if constexpr (AL < 4) {
    static_assert(AL == 2, "3-bit chunks of 12 bytes: 2-byte aligned");
    const uint32_t shift = (reinterpret_cast<uintptr_t>(src) & 2u) * 8u;  // 0 or 16
    const uint8_t* base = src - shift / 8;
    const uint32_t w0 = Mem::template at<uint32_t>(base), w1 = Mem::template at<uint32_t>(base + 4),
                   w2 = Mem::template at<uint32_t>(base + 8), w3 = Mem::template at<uint32_t>(base + 12);
    a = __funnelshift_r(w0, w1, shift);
    b = __funnelshift_r(w1, w2, shift);
    c = __funnelshift_r(w2, w3, shift);
  } else {
    a = Mem::template at<uint32_t>(src);
    b = Mem::template at<uint32_t>(src + 4);
    c = Mem::template at<uint32_t>(src + 8);
  }
}

// The 48 bits (a lane's 16 3-bit codes) at src, 2-byte aligned: lo = bits 0-31, hi = bits 32-47
// (AL = 2: bits 48-63 of hi are the next bytes' where src is 4-byte aligned). Two word loads at
// the 4-byte boundary below src and one funnel shift each (no per-lane select of the load widths).
// shift: 8 x (src's distance above the 4-byte boundary), 0 or 16, where the caller knows it.
template <class Mem>
__device__ __forceinline__ void load_stream3_48_shifted(const uint8_t* src, uint32_t shift, uint32_t& lo,
                                                        uint32_t& hi) {
  const uint8_t* base = src - shift / 8;
  const uint32_t w0 = Mem::template at<uint32_t>(base), w1 = Mem::template at<uint32_t>(base + 4);
  lo = __funnelshift_r(w0, w1, shift);
  hi = w1 >> shift;
}
template <class Mem, int AL = 16>
__device__ __forceinline__ void load_stream3_48(const uint8_t* src, uint32_t& lo, uint32_t& hi) {
  static_assert(AL >= 2, "3-bit chunks of 6 bytes: 2-byte aligned");
  if constexpr (AL < 4) {
    load_stream3_48_shifted<Mem>(src, (reinterpret_cast<uintptr_t>(src) & 2u) * 8u, lo, hi);
  } else {
    lo = Mem::template at<uint32_t>(src);
    hi = Mem::template at<unsigned short>(src + 4);
  }
}

// The N 3-bit groups (8 codes each, code i in bits 3i..3i+2; bits above 24 are not cleared) of a
// lane's 8N codes at src: N = 4, 12 bytes on an AL-byte boundary (AL >= 4: 3 words; AL = 2: the 4
// words around them, shifted by 16 bits where src is not 4-byte aligned); N = 2, 6 bytes on a 2-byte
// boundary (a word and a half); N = 1, 3 bytes.
template <int N, class Mem, int AL = 16>
__device__ __forceinline__ void load_groups3(const uint8_t* src, uint32_t (&g)[N]) {
  if constexpr (N == 4) {
    uint32_t a, b, c;
    load_stream3<Mem, AL>(src, a, b, c);
    g[0] = a;
    g[1] = __funnelshift_r(a, b, 24);
    g[2] = __funnelshift_r(b, c, 16);
    g[3] = c >> 8;
  } else if constexpr (N == 2) {
    const bool odd = (reinterpret_cast<uintptr_t>(src) & 2u) != 0;  // src + 2 is 4-byte aligned
    const uint32_t word = Mem::template at<uint32_t>(src + (odd ? 2 : 0));
    const uint32_t half = Mem::template at<unsigned short>(src + (odd ? 0 : 4));
    const uint32_t lo = odd ? (half | (word << 16)) : word;  // bits 0..31 of the 48
    const uint32_t hi = odd ? (word >> 16) : half;           // bits 32..47
    g[0] = lo;
    g[1] = __funnelshift_r(lo, hi, 24);
  } else {
    const uint32_t b0 = Mem::template at<uint8_t>(src), b1 = Mem::template at<uint8_t>(src + 1),
                   b2 = Mem::template at<uint8_t>(src + 2);
    g[0] = b0 | (b1 << 8) | (b2 << 16);
  }
}

// src: the first byte of a lane's 8N codes of width BITS, AL-byte aligned (AL: at most the chunk's
// own alignment; a 3-bit chunk of N = 4 needs 2, of N <= 2 may start on any 2-byte (N = 2) or byte
// (N = 1) boundary; other chunks need 4).
template <int BITS, int N, class Mem, int AL = 16>
__device__ __forceinline__ void load_nibbles(const uint8_t* src, uint32_t (&w)[N]) {
  static_assert(N == 1 || N == 2 || N == 4, "1, 2 or 4 groups of 8 codes");
  static_assert(BITS == 2 || BITS == 3 || BITS == 4, "2, 3 or 4 bits");
  if constexpr (BITS == 4) {
    load_words<N, Mem, AL>(src, w);
  } else if constexpr (BITS == 2) {
    if constexpr (N >= 2) {
      uint32_t raw[N / 2];
      load_words<N / 2, Mem, AL>(src, raw);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        w[2 * i] = nibbles_from_2bit(raw[i] & 0xFFFFu);
        w[2 * i + 1] = nibbles_from_2bit(raw[i] >> 16);
      }
    } else {
      w[0] = nibbles_from_2bit(Mem::template at<unsigned short>(src));
    }
  } else {
    load_groups3<N, Mem, AL>(src, w);
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = nibbles_from_3bit(w[i]);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CODE_LOADS_CUH_
