// jax_tq CPU handlers' float conversions (host only): bf16 / f16 <-> f32 with round-to-nearest-even,
// and whole-row loads / stores of an untyped float32 / bfloat16 / float16 buffer. Shared by
// compress.cc and qjl.cc.
#ifndef JAX_TQ_CPU_FLOATS_H_
#define JAX_TQ_CPU_FLOATS_H_

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace jax_tq {
namespace cpu_floats {

namespace ffi = xla::ffi;

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    // Subnormal: value = mant * 2^-24.
    const float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520 -> inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero) in f16: units of 2^-24, RNE.
    if (a < 0x33000000u) return sign;  // < 2^-25 -> 0 (2^-25 exactly ties to even 0)
    const uint32_t e = a >> 23;                      // biased f32 exponent, 102..112
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;  // 24-bit significand
    const uint32_t shift = 126u - e;                 // value = m * 2^(e-150); /2^-24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  // Normal: rebias exponent (127 -> 15) and round 13 dropped mantissa bits.
  uint32_t r = a - 0x38000000u;  // exponent - 112 in place
  r = r + 0xFFFu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

enum class FloatKind { kF32, kBF16, kF16, kOther };

inline FloatKind kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return FloatKind::kF32;
    case ffi::DataType::BF16: return FloatKind::kBF16;
    case ffi::DataType::F16: return FloatKind::kF16;
    default: return FloatKind::kOther;
  }
}

// Load n elements starting at element index `start` of an untyped buffer into float.
inline void load_row(const void* base, FloatKind k, int64_t start, int n, float* out) {
  switch (k) {
    case FloatKind::kF32: {
      const float* p = static_cast<const float*>(base) + start;
      for (int i = 0; i < n; ++i) out[i] = p[i];
      break;
    }
    case FloatKind::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      break;
    }
    case FloatKind::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int i = 0; i < n; ++i) out[i] = f16_to_f32(p[i]);
      break;
    }
    default: break;
  }
}

inline void store_row(void* base, FloatKind k, int64_t start, int n, const float* in) {
  switch (k) {
    case FloatKind::kF32: {
      float* p = static_cast<float*>(base) + start;
      for (int i = 0; i < n; ++i) p[i] = in[i];
      break;
    }
    case FloatKind::kBF16: {
      uint16_t* p = static_cast<uint16_t*>(base) + start;
      for (int i = 0; i < n; ++i) p[i] = f32_to_bf16(in[i]);
      break;
    }
    case FloatKind::kF16: {
      uint16_t* p = static_cast<uint16_t*>(base) + start;
      for (int i = 0; i < n; ++i) p[i] = f32_to_f16(in[i]);
      break;
    }
    default: break;
  }
}

inline constexpr const char* kDtypeMsg = ": dtype must be float32, bfloat16 or float16";

}  // namespace cpu_floats
}  // namespace jax_tq

#endif  // JAX_TQ_CPU_FLOATS_H_
