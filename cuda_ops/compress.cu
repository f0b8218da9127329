// CUDA XLA FFI handlers for the compress family (see docs/DESIGN.md):
//   jax_tq_compress, jax_tq_decompress, jax_tq_write_cache.
//
// All three are one tiled fp32 GEMM kernel (CUDA-core FMA, no tensor cores, so that codes match
// the float32 reference except at exact ties), with a fused prologue / epilogue:
//   compress:   prologue loads a tile of MV vectors (f32 / bf16 / f16), computes the fp32 norms
//               (fixed summation order), normalises (u = x * (1 / norm), 0 for a zero vector) into
//               shared memory [d][MV] (k-major); main loop y = u @ Pi^T with Pi^T streamed through
//               shared memory in k-tiles; epilogue bucketizes (binary search over the midpoints of
//               the centroids: code = #boundaries < y), packs (format.h bit layout) and writes the
//               codes + norms, either to rows [N] or, for write_cache, to the paged slots.
//   decompress: prologue decodes the codes to centroid values [d][MV]; main loop x = c @ Pi;
//               epilogue scales by the norm and writes f32 / bf16 / f16 rows (coalesced).
// Grid: ceil(N / MV) CTAs of 256 threads (16 x 16); a thread owns VPT vectors x d/16 outputs.
// (That v1 kernel now serves decompress to f32 and the fitted scale at d 192 / 256. The plain
// compress runs on tensor cores (tq_compress_mma_kernel, "v2" below), and so does the fitted scale
// at d <= 128 (tq_fit_mma_kernel: the same MMAs, whole rows per CTA, then the 17-candidate fit),
// except for write_cache's Hadamard codecs of head_dim 64 / 128 given their spec words
// (tq_hadamard_fit_kernel: one warp per vector, the fast transform, no matrix); the plain codec's
// write of Hadamard codecs runs on tq_hadamard_quad_kernel (a quad of lanes per vector).)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "jax_tq/cp_async.cuh"
#include "jax_tq/cuda_launch.h"
#include "jax_tq/dispatch.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "jax_tq/hadamard.cuh"
#include "jax_tq/wgmma.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

enum class FType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// f(std::integral_constant<int, XT>{}) for the FType XT equal to dtype (any other value: float32).
template <class F>
auto with_input_type(int dtype, F&& f) {
  using Types = IntList<static_cast<int>(FType::kF32), static_cast<int>(FType::kBF16), static_cast<int>(FType::kF16)>;
  return with_value(Types{}, dtype, f, [&] { return f(std::integral_constant<int, static_cast<int>(FType::kF32)>{}); });
}

template <int D>
struct GemmGeom {
  static constexpr int ON = D / 16;                 // outputs per thread
  static constexpr bool kVecOut = (D % 64) == 0;    // outputs as float4 chunks (c*64 + tx*4 + r)
  static constexpr int KT = (D % 32) == 0 ? 32 : 16;  // k-tile of Pi streamed through smem
  static constexpr int BST = D + 4;                 // B tile row stride (floats)
};

template <int D, int VPT>
struct GemmLayout {
  static constexpr int MV = 16 * VPT;      // vectors per CTA
  static constexpr int UST = MV + 4;       // U row stride (floats): 16-byte aligned rows
  static constexpr int u_off = 0;
  static constexpr int u_bytes = D * UST * 4;
  static constexpr int b_off = u_off + u_bytes;
  static constexpr int b_bytes = GemmGeom<D>::KT * GemmGeom<D>::BST * 4;
  static constexpr int ss_off = b_off + b_bytes;
  static constexpr int ss_bytes = (D / 8) * MV * 4;
  static constexpr int nrm_off = ss_off + ss_bytes;
  static constexpr int inv_off = nrm_off + MV * 4;
  static constexpr int total = inv_off + MV * 4;
  static_assert(MV * D <= u_bytes, "codes staging must fit in the U buffer");
};

struct GemmParams {
  // compress / write_cache
  const void* x;           // [N, D] input (compress) ; unused for decompress
  uint8_t* codes;          // compress: [N, pb] or pool [P, Hkv, page, pb]; decompress: input
  float* norms;            // compress: [N] or pool [P, Hkv, page]; decompress: input
  const float* rot;        // [D, D]
  const float* cent;       // [2**bits]
  const int32_t* slots;    // write_cache only (else nullptr)
  void* out;               // decompress output [N, D]
  int64_t N;
  int bits;
  int dtype;               // FType of x (compress) or out (decompress)
  bool vec_io;             // 16-byte vector access to x / out allowed (alignment)
  int Hkv, page_size;      // write_cache
  int64_t total_slots;     // write_cache: P * page_size
  // write_cache's recent-token window (format.h), or win == nullptr: none. Token t's rows go to
  // entry win_slots[t] % win_len of window win_slots[t] / win_len (skipped outside [0, win_entries)).
  uint16_t* win;           // bf16 [num_windows, Hkv, win_len, D]
  const int32_t* win_slots;  // [T]
  int64_t win_entries;     // num_windows * win_len
  int win_len;             // W
  const int32_t* rot_spec;  // [D] Hadamard spec words of rot (format.h), or nullptr: rot only
};

__device__ __forceinline__ float load_elem(const void* base, int dtype, int64_t i) {
  if (dtype == static_cast<int>(FType::kF32)) return static_cast<const float*>(base)[i];
  if (dtype == static_cast<int>(FType::kBF16))
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return __half2float(static_cast<const __half*>(base)[i]);
}

// Eight consecutive elements starting at element i (i a multiple of 8) as float.
__device__ __forceinline__ void load8(const void* base, int dtype, bool vec, int64_t i,
                                      float (&v)[8]) {
  if (vec) {
    if (dtype == static_cast<int>(FType::kF32)) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
      const float4 a = p[0], b = p[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
      return;
    }
    const uint4 r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (dtype == static_cast<int>(FType::kBF16)) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      } else {
        __half2 h;
        memcpy(&h, &w[k], 4);
        const float2 f = __half22float2(h);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = load_elem(base, dtype, i + k);
}

__device__ __forceinline__ void store_elem(void* base, int dtype, int64_t i, float v) {
  if (dtype == static_cast<int>(FType::kF32)) {
    static_cast<float*>(base)[i] = v;
  } else if (dtype == static_cast<int>(FType::kBF16)) {
    static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(v);
  }
}

// Four consecutive elements starting at element i (i a multiple of 4).
__device__ __forceinline__ void store4(void* base, int dtype, bool vec, int64_t i, float a, float b,
                                       float c, float d) {
  if (vec) {
    if (dtype == static_cast<int>(FType::kF32)) {
      *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = make_float4(a, b, c, d);
      return;
    }
    uint2 r;
    if (dtype == static_cast<int>(FType::kBF16)) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
      memcpy(&r.x, &lo, 4);
      memcpy(&r.y, &hi, 4);
    } else {
      const __half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
      memcpy(&r.x, &lo, 4);
      memcpy(&r.y, &hi, 4);
    }
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) = r;
    return;
  }
  store_elem(base, dtype, i, a);
  store_elem(base, dtype, i + 1, b);
  store_elem(base, dtype, i + 2, c);
  store_elem(base, dtype, i + 3, d);
}

// Output coordinate of the thread's j-th output.
template <int D>
__device__ __forceinline__ int out_coord(int tx, int j) {
  if constexpr (GemmGeom<D>::kVecOut) {
    return (j / 4) * 64 + tx * 4 + (j % 4);
  } else {
    return tx + 16 * j;
  }
}

// Byte offset of the packed row of vector n (compress / write_cache), or -1 to skip.
__device__ __forceinline__ int64_t dest_row(const GemmParams& p, int64_t n) {
  if (p.slots == nullptr) return n;
  const int64_t t = n / p.Hkv;
  const int64_t h = n - t * p.Hkv;
  const int64_t s = p.slots[t];
  if (s < 0 || s >= p.total_slots) return -1;
  const int64_t page = s / p.page_size;
  const int64_t off = s - page * p.page_size;
  return (page * p.Hkv + h) * p.page_size + off;  // row index into [P, Hkv, page]
}

// Row of vector n (token n / Hkv, KV head n % Hkv) in write_cache's window [num_windows, Hkv, W]:
// entry s % W of window s / W, s = win_slots[token] its token's window slot, or -1: not written.
__device__ __forceinline__ int64_t window_row_of_slot(const GemmParams& p, int64_t n, int64_t s) {
  if (s < 0 || s >= p.win_entries) return -1;
  const int64_t h = n - (n / p.Hkv) * p.Hkv;
  const int64_t w = s / p.win_len;
  return (w * p.Hkv + h) * p.win_len + (s - w * p.win_len);
}

// window_row_of_slot with the token's slot read from win_slots.
__device__ __forceinline__ int64_t window_row(const GemmParams& p, int64_t n) {
  return window_row_of_slot(p, n, p.win_slots[n / p.Hkv]);
}

// code = number of boundaries strictly less than y; bnd: 15 ascending midpoints padded with +inf
// (bnd[15] is never read); b7 = bnd[7].
__device__ __forceinline__ uint32_t bucketize16(float y, const float* bnd, float b7) {
  int pos = (b7 < y) ? 8 : 0;
  pos += (bnd[pos + 3] < y) ? 4 : 0;
  pos += (bnd[pos + 1] < y) ? 2 : 0;
  pos += (bnd[pos] < y) ? 1 : 0;
  return static_cast<uint32_t>(pos);
}

// ---------------------------------------------------------------------------------------------
// Norms without overflow or underflow. The kernels sum squares in f32, which overflows for
// |x| >~ 1e19 and loses the sum below ~1e-19; a row whose sum lies outside [kSafeSumSq, FLT_MAX]
// (or is NaN) takes this rare path: re-read the row, scale it by a power of two (exact) so that its
// largest element is ~1, sum the squares, scale back. kLanes lanes of consecutive ids share a row
// (each sums the elements k = lane_in_row mod kLanes); the others of those lanes must call too.
// Returns -1 when the row holds no finite nonzero element (the plain sum is right then).
// ---------------------------------------------------------------------------------------------
constexpr float kSafeSumSq = 0x1p-80f;

__device__ __forceinline__ bool needs_scaled_norm(float sum_sq) {
  return !(sum_sq >= kSafeSumSq && sum_sq <= FLT_MAX);
}

template <int D, int kLanes>
__device__ __noinline__ float scaled_row_norm(const void* x, int dtype, int64_t row, int lane_in_row) {
  const unsigned mask = kLanes == 32 ? 0xffffffffu
                        : kLanes == 1 ? 1u << (threadIdx.x & 31)
                                      : ((1u << kLanes) - 1u) << ((threadIdx.x & 31) & ~(kLanes - 1));
  float mx = 0.f;
  for (int k = lane_in_row; k < D; k += kLanes) mx = fmaxf(mx, fabsf(load_elem(x, dtype, row * D + k)));
  for (int o = 1; o < kLanes; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(mask, mx, o));
  if (!(mx > 0.f && mx <= FLT_MAX)) return -1.f;
  int e;
  frexpf(mx, &e);  // e in [-148, 128]: 2^-e and 2^e themselves may not be floats, so scale by ldexpf
  float s = 0.f;
  for (int k = lane_in_row; k < D; k += kLanes) {
    const float v = ldexpf(load_elem(x, dtype, row * D + k), -e);
    s = fmaf(v, v, s);
  }
  for (int o = 1; o < kLanes; o <<= 1) s += __shfl_xor_sync(mask, s, o);
  return ldexpf(sqrtf(s), e);
}

// The norms of rows r0, r1 (v0 / v1: the rows exist) from their whole sums of squares ss0, ss1, the
// same in a quad's 4 lanes (t = lane & 3): the scaled re-read where a sum left its safe range (the
// quad's 4 lanes all take it); stored_norm.
template <int D>
__device__ __forceinline__ float2 quad_norms_of_sums(float ss0, float ss1, bool v0, bool v1, const void* x, int dtype,
                                                     int64_t r0, int64_t r1, int t) {
  float n0 = sqrtf(ss0), n1 = sqrtf(ss1);
  if (v0 && needs_scaled_norm(ss0)) {
    const float scaled = scaled_row_norm<D, 4>(x, dtype, r0, t);
    if (scaled >= 0.f) n0 = scaled;
  }
  if (v1 && needs_scaled_norm(ss1)) {
    const float scaled = scaled_row_norm<D, 4>(x, dtype, r1, t);
    if (scaled >= 0.f) n1 = scaled;
  }
  return make_float2(stored_norm(n0), stored_norm(n1));
}

// quad_norms_of_sums of a quad's partial sums of squares ss0, ss1 after a quad butterfly (bitwise
// identical in its 4 lanes).
template <int D>
__device__ __forceinline__ float2 quad_row_norms(float ss0, float ss1, bool v0, bool v1, const void* x, int dtype,
                                                 int64_t r0, int64_t r1, int t) {
  ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, 1);
  ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, 2);
  ss1 += __shfl_xor_sync(0xFFFFFFFFu, ss1, 1);
  ss1 += __shfl_xor_sync(0xFFFFFFFFu, ss1, 2);
  return quad_norms_of_sums<D>(ss0, ss1, v0, v1, x, dtype, r0, r1, t);
}

// Packed group word w (8 codes, format.h) to its bits bytes at dst.
__device__ __forceinline__ void store_group(uint8_t* dst, uint32_t w, int bits) {
  if (bits == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w;
  } else if (bits == 2) {
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w);
  } else {
    dst[0] = static_cast<uint8_t>(w & 0xFFu);
    dst[1] = static_cast<uint8_t>((w >> 8) & 0xFFu);
    dst[2] = static_cast<uint8_t>((w >> 16) & 0xFFu);
  }
}

// bucketize16 with its first two levels from registers (b3, b7, b11 = tb[3], tb[7], tb[11]) and
// its last two from one 16-byte load of tb[pos .. pos + 3] (tb 16-byte aligned): the same
// comparisons, so the same code.
__device__ __forceinline__ uint32_t bucketize_fit(float y, const float* tb, float b3, float b7, float b11) {
  const bool hi = b7 < y;
  int pos = hi ? 8 : 0;
  pos += ((hi ? b11 : b3) < y) ? 4 : 0;
  const float4 q = *reinterpret_cast<const float4*>(tb + pos);
  const bool upper = q.y < y;  // tb[pos + 1] < y
  return static_cast<uint32_t>(pos + (upper ? 2 : 0) + (((upper ? q.z : q.x) < y) ? 1 : 0));
}

// fit_tab[16 k + i] = fl32(s_k * b_i) for the kFitCandidates pre-scalings, INFINITY past the last
// boundary (format.h fit_boundary), times `unit` (a power of two: exact), filled by the CTA's
// nthreads threads.
__device__ __forceinline__ void fill_fit_table(float* fit_tab, const float* cent, int ncent, int tid, int nthreads,
                                               float unit = 1.0f) {
  for (int e = tid; e < kFitCandidates * 16; e += nthreads) {
    const int k = e >> 4, i = e & 15;
    fit_tab[e] = i < ncent - 1 ? unit * fit_boundary(cent, k, i) : INFINITY;
  }
}

// FIT (compress only, DECOMP false): the fitted scale (format.h "Fitted scale"); fit_tab: shared
// [kFitCandidates][16] scaled boundaries (each padded with +inf), filled here. Otherwise nullptr.
template <int D, int VPT, bool DECOMP, bool FIT = false>
__device__ __forceinline__ void tq_gemm_body(const GemmParams& p, float* fit_tab = nullptr) {
  static_assert(!FIT || !DECOMP, "the fitted scale is a compress epilogue");
  using Geo = GemmGeom<D>;
  using L = GemmLayout<D, VPT>;
  constexpr int MV = L::MV, UST = L::UST, ON = Geo::ON, KT = Geo::KT, BST = Geo::BST;
  constexpr int GROUPS = D / 8;  // 8-coordinate packing groups per vector

  extern __shared__ __align__(16) uint8_t smem[];
  float* U = reinterpret_cast<float*>(smem + L::u_off);
  float* B = reinterpret_cast<float*>(smem + L::b_off);
  float* ss = reinterpret_cast<float*>(smem + L::ss_off);
  float* nrm = reinterpret_cast<float*>(smem + L::nrm_off);
  float* inv = reinterpret_cast<float*>(smem + L::inv_off);
  __shared__ float cent_s[16];
  __shared__ float bnd_s[16];

  const int tid = threadIdx.x;
  const int tx = tid & 15;
  const int ty = tid >> 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * MV;
  const int bits = p.bits;
  const int ncent = 1 << bits;
  if (tid < 16) {
    cent_s[tid] = tid < ncent ? p.cent[tid] : 0.f;
    // boundary_i = (c_i + c_{i+1}) / 2 in float32, as format.h / the reference.
    bnd_s[tid] = tid < ncent - 1 ? (p.cent[tid] + p.cent[tid + 1]) * 0.5f : INFINITY;
  }
  if constexpr (FIT) fill_fit_table(fit_tab, p.cent, ncent, tid, kThreads);

  // ---- prologue ------------------------------------------------------------------------------
  if constexpr (!DECOMP) {
    for (int e = tid; e < MV * GROUPS; e += kThreads) {
      const int v = e % MV;
      const int c8 = e / MV;
      const int64_t n = n0 + v;
      float xv[8];
      if (n < p.N) {
        load8(p.x, p.dtype, p.vec_io, n * D + c8 * 8, xv);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) xv[k] = 0.f;
      }
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        U[(c8 * 8 + k) * UST + v] = xv[k];
        s = fmaf(xv[k], xv[k], s);
      }
      ss[c8 * MV + v] = s;
    }
    __syncthreads();
    if (tid < MV) {
      float s = 0.f;
      for (int c = 0; c < GROUPS; ++c) s += ss[c * MV + tid];
      float norm = sqrtf(s);
      if (n0 + tid < p.N && needs_scaled_norm(s)) {
        const float scaled = scaled_row_norm<D, 1>(p.x, p.dtype, n0 + tid, 0);
        if (scaled >= 0.f) norm = scaled;
      }
      norm = stored_norm(norm);
      nrm[tid] = norm;
      inv[tid] = norm > 0.f ? 1.0f / norm : 0.f;
    }
    __syncthreads();
    for (int e = tid; e < D * MV; e += kThreads) {
      const int k = e / MV;
      const int v = e - k * MV;
      U[k * UST + v] *= inv[v];
    }
  } else {
    __syncthreads();  // cent_s
    for (int e = tid; e < MV * GROUPS; e += kThreads) {
      const int v = e % MV;
      const int grp = e / MV;
      const int64_t n = n0 + v;
      float cv[8];
      if (n < p.N) {
        const int pb = D * bits / 8;
        const uint8_t* row = p.codes + n * pb;
        uint32_t w;
        if (bits == 4) {
          const uint8_t* q = row + grp * 4;
          w = uint32_t(q[0]) | (uint32_t(q[1]) << 8) | (uint32_t(q[2]) << 16) |
              (uint32_t(q[3]) << 24);
        } else if (bits == 3) {
          w = load_word3(row + grp * 3);
        } else {
          const uint8_t* q = row + grp * 2;
          w = uint32_t(q[0]) | (uint32_t(q[1]) << 8);
        }
        const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
        for (int k = 0; k < 8; ++k) cv[k] = cent_s[(w >> (k * bits)) & mask];
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) cv[k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) U[(grp * 8 + k) * UST + v] = cv[k];
    }
    if (tid < MV) {
      const int64_t n = n0 + tid;
      nrm[tid] = n < p.N ? p.norms[n] : 0.f;
    }
  }

  // ---- main loop: acc[i][j] = sum_k U[k][v_i] * B[k][o_j] --------------------------------------
  float acc[VPT][ON];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < ON; ++j) acc[i][j] = 0.f;

  for (int k0 = 0; k0 < D; k0 += KT) {
    __syncthreads();  // prologue done / previous B tile consumed
    if constexpr (!DECOMP) {
      // B[kk][o] = Pi[o][k0 + kk]  (Pi^T tile)
      for (int e = tid; e < KT * D; e += kThreads) {
        const int o = e / KT;
        const int kk = e - o * KT;
        B[kk * BST + o] = __ldg(p.rot + static_cast<int64_t>(o) * D + k0 + kk);
      }
    } else {
      // B[kk][o] = Pi[k0 + kk][o]
      for (int e = tid; e < KT * D / 4; e += kThreads) {
        const int kk = e / (D / 4);
        const int o4 = e - kk * (D / 4);
        const float4 v = __ldg(reinterpret_cast<const float4*>(p.rot + (k0 + kk) * D) + o4);
        *reinterpret_cast<float4*>(B + kk * BST + o4 * 4) = v;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < KT; ++kk) {
      float a[VPT];
      const float* urow = U + (k0 + kk) * UST + ty * VPT;
      if constexpr (VPT == 4) {
        const float4 t = *reinterpret_cast<const float4*>(urow);
        a[0] = t.x; a[1] = t.y; a[2] = t.z; a[3] = t.w;
      } else {
#pragma unroll
        for (int i = 0; i < VPT; ++i) a[i] = urow[i];
      }
      float b[ON];
      const float* brow = B + kk * BST;
      if constexpr (Geo::kVecOut) {
#pragma unroll
        for (int c = 0; c < ON / 4; ++c) {
          const float4 t = *reinterpret_cast<const float4*>(brow + c * 64 + tx * 4);
          b[4 * c] = t.x; b[4 * c + 1] = t.y; b[4 * c + 2] = t.z; b[4 * c + 3] = t.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < ON; ++j) b[j] = brow[tx + 16 * j];
      }
#pragma unroll
      for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < ON; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }

  // ---- epilogue ------------------------------------------------------------------------------
  if constexpr (!DECOMP) {
    // FIT: acc[i][j] is y_j of vector ty * VPT + i (U was normalised); a vector's D coordinates are
    // spread over the 16 lanes tx of one half warp. For each candidate k in order: codes_k by
    // bucketize16 against its scaled boundaries, <y, c> and |c|^2 summed over the lane's
    // coordinates, then over the half warp (xor butterfly: the same sums in all 16 lanes); the
    // first k of the largest dot^2 / sq wins. The fitted norms go to inv[] (free after the
    // prologue), the window rows (write_cache) take ||x|| * y.
    int best_k[VPT];
    if constexpr (FIT) {
      float best_gain[VPT], best_dot[VPT], best_sq[VPT];
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        best_k[i] = 0;
        best_gain[i] = -1.f;
        best_dot[i] = 0.f;
        best_sq[i] = 1.f;
      }
#pragma unroll 1
      for (int k = 0; k < kFitCandidates; ++k) {
        const float* tb = fit_tab + 16 * k;
        const float b7 = tb[7];
        float dot[VPT], sq[VPT];
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          dot[i] = 0.f;
          sq[i] = 0.f;
#pragma unroll
          for (int j = 0; j < ON; ++j) {
            const float y = acc[i][j];
            const float c = cent_s[bucketize16(y, tb, b7)];
            dot[i] = fmaf(y, c, dot[i]);
            sq[i] = fmaf(c, c, sq[i]);
          }
        }
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) {
#pragma unroll
          for (int i = 0; i < VPT; ++i) {
            dot[i] += __shfl_xor_sync(0xFFFFFFFFu, dot[i], o);
            sq[i] += __shfl_xor_sync(0xFFFFFFFFu, sq[i], o);
          }
        }
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const float gain = dot[i] * dot[i] / sq[i];
          if (gain > best_gain[i]) {  // strictly: the first k keeps a tie (NaN never wins)
            best_gain[i] = gain;
            best_dot[i] = dot[i];
            best_sq[i] = sq[i];
            best_k[i] = k;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = ty * VPT + i;
        const int64_t n = n0 + v;
        if (p.win != nullptr && n < p.N) {
          const int64_t wr = window_row(p, n);
          if (wr >= 0) {
            __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.win) + wr * D;
#pragma unroll
            for (int j = 0; j < ON; ++j) dst[out_coord<D>(tx, j)] = __float2bfloat16_rn(nrm[v] * acc[i][j]);
          }
        }
        if (tx == 0) inv[v] = nrm[v] * (best_dot[i] / best_sq[i]);  // 0 for a zero vector
      }
    }
    __syncthreads();  // everyone is done reading U: reuse it for the codes
    uint8_t* codes_s = reinterpret_cast<uint8_t*>(U);  // [MV][D]
    const int half = 1 << (bits - 1);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = ty * VPT + i;
#pragma unroll
      for (int j = 0; j < ON; ++j) {
        const float y = acc[i][j];
        if constexpr (FIT) {  // the winner's codes
          const float* tb = fit_tab + 16 * best_k[i];
          codes_s[v * D + out_coord<D>(tx, j)] = static_cast<uint8_t>(bucketize16(y, tb, tb[7]));
          continue;
        }
        // code = number of boundaries strictly less than y (boundaries ascending).
        int pos = 0;
        for (int s = half; s > 0; s >>= 1)
          if (bnd_s[pos + s - 1] < y) pos += s;
        codes_s[v * D + out_coord<D>(tx, j)] = static_cast<uint8_t>(pos);
      }
    }
    __syncthreads();
    const int pb = D * bits / 8;
    for (int e = tid; e < MV * GROUPS; e += kThreads) {
      const int v = e / GROUPS;
      const int grp = e - v * GROUPS;
      const int64_t n = n0 + v;
      if (n >= p.N) continue;
      const int64_t row = dest_row(p, n);
      if (row < 0) continue;
      const uint2 cw = *reinterpret_cast<const uint2*>(codes_s + v * D + grp * 8);
      uint32_t c[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        c[k] = (cw.x >> (8 * k)) & 0xFFu;
        c[k + 4] = (cw.y >> (8 * k)) & 0xFFu;
      }
      uint8_t* dst = p.codes + row * pb;
      if (bits == 4) {
        uint32_t w = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) w |= c[k] << (4 * k);
        *reinterpret_cast<uint32_t*>(dst + grp * 4) = w;
      } else if (bits == 2) {
        uint32_t w = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) w |= c[k] << (2 * k);
        *reinterpret_cast<uint16_t*>(dst + grp * 2) = static_cast<uint16_t>(w);
      } else {
        uint32_t w = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) w |= c[k] << (3 * k);
        dst[grp * 3 + 0] = static_cast<uint8_t>(w & 0xFFu);
        dst[grp * 3 + 1] = static_cast<uint8_t>((w >> 8) & 0xFFu);
        dst[grp * 3 + 2] = static_cast<uint8_t>((w >> 16) & 0xFFu);
      }
    }
    if (tid < MV) {
      const int64_t n = n0 + tid;
      if (n < p.N) {
        const int64_t row = dest_row(p, n);
        if (row >= 0) p.norms[row] = FIT ? inv[tid] : nrm[tid];
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = ty * VPT + i;
      const int64_t n = n0 + v;
      if (n >= p.N) continue;
      const float s = nrm[v];
      if constexpr (Geo::kVecOut) {
#pragma unroll
        for (int c = 0; c < ON / 4; ++c)
          store4(p.out, p.dtype, p.vec_io, n * D + c * 64 + tx * 4, s * acc[i][4 * c],
                 s * acc[i][4 * c + 1], s * acc[i][4 * c + 2], s * acc[i][4 * c + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < ON; ++j) store_elem(p.out, p.dtype, n * D + tx + 16 * j, s * acc[i][j]);
      }
    }
  }
}

template <int D, int VPT, bool DECOMP>
__global__ void __launch_bounds__(kThreads) tq_gemm_kernel(const GemmParams p) {
  tq_gemm_body<D, VPT, DECOMP>(p);
}

// Compress with the fitted scale (format.h "Fitted scale"): the v1 kernel, whose CTA holds whole
// vectors (the 17 candidates' sums need every coordinate of a vector; the tensor-core kernel's column
// blocks split them over CTAs). grid.z selects the problem: 0 -> p0, 1 -> p1 (write_cache: K and V
// in one launch).
template <int D, int VPT>
__global__ void __launch_bounds__(kThreads) tq_fit_kernel(const GemmParams p0, const GemmParams p1) {
  __shared__ __align__(16) float fit_tab[kFitCandidates * 16];
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  tq_gemm_body<D, VPT, false, true>(p, fit_tab);
}

// =============================================================================================
// v2: tensor-core kernels (mma.sync m16n8k16, fp32 accumulate; sm_80+).
//
// One warp owns a tile of 16 vectors (rows) x NC output coordinates; a CTA of WARPS warps holds
// Bt = the NC rows of the [d, d] operand it needs (Bt[o][k]) in shared memory, converted once per
// CTA, and loops over 16-row tiles (persistent grid: tile = blockIdx.x * WARPS + warp, stride
// gridDim.x * WARPS). blockIdx.y picks the block of NC output coordinates.
//
// k ordering: a dot product may visit k in any order as long as A and B agree. Thread (g, t) of
// the warp (g = lane / 4, t = lane % 4) takes, in 32-wide k chunk j, the 8 consecutive k
// 32j + 8t .. 32j + 8t + 7 of its rows g and g + 8: one 16-byte load of a row of x (A) and one
// 16-byte shared load of a row of Bt (B) give the fragments of two m16n8k16 steps:
//   step 0: a = {P0, Q0, P1, Q1}, b = {B0, B1};  step 1: a = {P2, Q2, P3, Q3}, b = {B2, B3}
// (P = row g, Q = row g + 8, word i = elements 2i, 2i + 1). d % 32 == 16 (d = 80) adds one k16
// step in which thread t takes k = 32 * KC + 4t .. + 3 (8-byte loads). The per-output MMA
// sequence is the same for every NC / WARPS, so the small- and large-batch configurations give
// bit-identical results.
//
// compress:   y = (x Pi^T) / ||x||  (linear: normalise after the product). Pi is split into
//             bf16 hi + lo (Pi_hi = bf16(Pi), Pi_lo = bf16(Pi - Pi_hi)); bf16 x is exact in bf16:
//             y = x Pi_hi^T + x Pi_lo^T (2 MMAs per k-step, ~2^-16 relative). f32 / f16 x are
//             split too (x_hi + x_lo): hi*hi + hi*lo + lo*hi (3 MMAs). Norms: fp32 sum of
//             squares in a fixed order (thread: chunk by chunk, then a quad butterfly).
//             Epilogue: y = acc * (1 / norm), binary search over the 15 (+inf padded) centroid
//             midpoints (code = #boundaries < y, as v1 / format.h), codes staged per warp in
//             shared memory, packed per 8-code group (format.h layout), written to rows or to
//             the paged slots.
// decompress: x_hat = norm * (c @ Pi) for bf16 / f16 outputs: one fp16 MMA per k-step (fp16 has
//             11 significant bits: ~3e-4 relative, under bf16 output rounding; centroids scaled
//             by a power of two into [-1, 1)). A fragments straight from the packed codes through
//             a pair table (two codes -> half2). f32 output keeps the v1 fp32-FMA kernel (1e-6).
// =============================================================================================

// Row stride (bytes) of Bt in shared memory: 2d rounded so that stride % 128 == 64 (the 8 lanes
// of a quarter-warp 16-byte load cover rows g, g + 1 x 64 bytes: conflict-free).
constexpr int bt_stride_bytes(int d) { return 2 * d + ((64 - (2 * d) % 128) + 128) % 128; }

template <int D, int NC, int WARPS>
struct MmaGeom {
  static constexpr int KC = D / 32;              // full 32-wide k chunks
  static constexpr bool KREM = (D % 32) != 0;    // one more k16 step (D % 32 == 16)
  static constexpr int NT = NC / 8;              // n8 tiles per warp
  static constexpr int NG = NC / 8;              // 8-code packing groups per row per CTA
  static constexpr int SB = bt_stride_bytes(D);  // Bt row stride, bytes
  static constexpr int SBE = SB / 2;             // ... in 16-bit elements
  static constexpr int CST = NC + 8;             // per-warp code staging row stride (bytes)
  static constexpr int bt_bytes = NC * SB;
  static constexpr int comp_smem = 2 * bt_bytes + WARPS * 16 * CST;  // Bt hi, Bt lo, codes
  static constexpr int decomp_smem = bt_bytes;                       // Bt (fp16)
  static_assert(D % 16 == 0 && NC % 8 == 0 && D % NC == 0, "tile shape");
  static_assert(SB % 16 == 0 && CST % 8 == 0, "alignment");
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

// (a, b) -> bf16x2 hi and lo words: hi = bf16(a, b), lo = bf16(a - hi_a, b - hi_b).
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float ha = __low2float(h), hb = __high2float(h);
  hi = bf2_bits(h);
  lo = bf2_bits(__floats2bfloat162_rn(a - ha, b - hb));
}

// Raw x words of one thread for one row: 8 elements (chunk) or 4 (the d = 80 remainder).
template <int XT, int E>
struct XRaw {
  static constexpr int W = XT == static_cast<int>(FType::kF32) ? E : E / 2;  // 32-bit words
  uint32_t w[W];
};

// Loads elements [i, i + E) (E = 8 or 4) of x; zeros when !valid. vec: x is 16-byte aligned.
template <int XT, int E>
__device__ __forceinline__ void load_raw(XRaw<XT, E>& r, const void* x, int64_t i, bool valid,
                                         bool vec) {
  constexpr int W = XRaw<XT, E>::W;
  if (!valid) {
#pragma unroll
    for (int k = 0; k < W; ++k) r.w[k] = 0u;
    return;
  }
  if constexpr (XT == static_cast<int>(FType::kF32)) {
    const float* f = static_cast<const float*>(x) + i;
    if (vec) {
#pragma unroll
      for (int k = 0; k < W / 4; ++k) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(f) + k);
        r.w[4 * k] = v.x; r.w[4 * k + 1] = v.y; r.w[4 * k + 2] = v.z; r.w[4 * k + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) r.w[k] = __float_as_uint(__ldg(f + k));
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(x) + i;
    if (vec) {
      if constexpr (W == 4) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(h));
        r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
      } else {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(h));
        r.w[0] = v.x; r.w[1] = v.y;
      }
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k)
        r.w[k] = uint32_t(__ldg(h + 2 * k)) | (uint32_t(__ldg(h + 2 * k + 1)) << 16);
    }
  }
}

// Raw words -> E/2 bf16x2 hi (and lo) words; ss += x_e^2 in element order.
template <int XT, int E>
__device__ __forceinline__ void convert_raw(const XRaw<XT, E>& r, uint32_t (&hi)[E / 2],
                                            uint32_t (&lo)[E / 2], float& ss) {
#pragma unroll
  for (int k = 0; k < E / 2; ++k) {
    float a, b;
    if constexpr (XT == static_cast<int>(FType::kF32)) {
      a = __uint_as_float(r.w[2 * k]);
      b = __uint_as_float(r.w[2 * k + 1]);
    } else if constexpr (XT == static_cast<int>(FType::kBF16)) {
      a = __uint_as_float(r.w[k] << 16);
      b = __uint_as_float(r.w[k] & 0xFFFF0000u);
    } else {
      __half2 h;
      memcpy(&h, &r.w[k], 4);
      const float2 f = __half22float2(h);
      a = f.x;
      b = f.y;
    }
    ss = fmaf(a, a, ss);
    ss = fmaf(b, b, ss);
    if constexpr (XT == static_cast<int>(FType::kBF16)) {
      hi[k] = r.w[k];  // exact
      lo[k] = 0u;
    } else {
      split2(a, b, hi[k], lo[k]);
    }
  }
}

// One k32 chunk (E = 8: 2 k16 steps) or the k16 remainder (E = 4: 1 step) for all n8 tiles.
// bofs: element offset of this thread's k range inside a Bt row.
template <int NT, int SBE, bool SPLIT, int E>
__device__ __forceinline__ void compress_mma_chunk(float (&acc)[NT][4], const uint32_t (&ph)[E / 2],
                                                   const uint32_t (&qh)[E / 2],
                                                   const uint32_t (&pl)[E / 2],
                                                   const uint32_t (&ql)[E / 2],
                                                   const uint16_t* bhi, const uint16_t* blo) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if constexpr (E == 8) {
      const uint4 bh = *reinterpret_cast<const uint4*>(bhi + nt * 8 * SBE);
      const uint4 bl = *reinterpret_cast<const uint4*>(blo + nt * 8 * SBE);
      mma_bf16(acc[nt], ph[0], qh[0], ph[1], qh[1], bh.x, bh.y);
      mma_bf16(acc[nt], ph[0], qh[0], ph[1], qh[1], bl.x, bl.y);
      if constexpr (SPLIT) mma_bf16(acc[nt], pl[0], ql[0], pl[1], ql[1], bh.x, bh.y);
      mma_bf16(acc[nt], ph[2], qh[2], ph[3], qh[3], bh.z, bh.w);
      mma_bf16(acc[nt], ph[2], qh[2], ph[3], qh[3], bl.z, bl.w);
      if constexpr (SPLIT) mma_bf16(acc[nt], pl[2], ql[2], pl[3], ql[3], bh.z, bh.w);
    } else {
      const uint2 bh = *reinterpret_cast<const uint2*>(bhi + nt * 8 * SBE);
      const uint2 bl = *reinterpret_cast<const uint2*>(blo + nt * 8 * SBE);
      mma_bf16(acc[nt], ph[0], qh[0], ph[1], qh[1], bh.x, bh.y);
      mma_bf16(acc[nt], ph[0], qh[0], ph[1], qh[1], bl.x, bl.y);
      if constexpr (SPLIT) mma_bf16(acc[nt], pl[0], ql[0], pl[1], ql[1], bh.x, bh.y);
    }
  }
}

// ---- tq_compress_mma_kernel's epilogue phases (a 16-row tile: lane (g, t) holds rows g and g + 8,
// columns nt * 8 + 2t, + 1 of each n8 tile nt) ----

// write_cache's window rows w0, w1 (-1: none): bf16(||x|| * y) of this CTA's columns.
template <int D, int NT>
__device__ __forceinline__ void store_window_rows(uint16_t* win, int64_t w0, int64_t w1, const float (&acc)[NT][4],
                                                  float n0, float inv0, float n1, float inv1, int col0, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = col0 + nt * 8 + 2 * t;
    if (w0 >= 0)
      *reinterpret_cast<uint32_t*>(win + w0 * D + col) =
          bf2_bits(__floats2bfloat162_rn(n0 * (acc[nt][0] * inv0), n0 * (acc[nt][1] * inv0)));
    if (w1 >= 0)
      *reinterpret_cast<uint32_t*>(win + w1 * D + col) =
          bf2_bits(__floats2bfloat162_rn(n1 * (acc[nt][2] * inv1), n1 * (acc[nt][3] * inv1)));
  }
}

// The tile's codes (one byte each) into the warp's staging rows cw [16][CST].
template <int NT, int CST>
__device__ __forceinline__ void bucketize_tile(const float (&acc)[NT][4], float inv0, float inv1, const float* bnd_s,
                                               float b7, uint8_t* cw, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint32_t c0 = bucketize16(acc[nt][0] * inv0, bnd_s, b7);
    const uint32_t c1 = bucketize16(acc[nt][1] * inv0, bnd_s, b7);
    const uint32_t c2 = bucketize16(acc[nt][2] * inv1, bnd_s, b7);
    const uint32_t c3 = bucketize16(acc[nt][3] * inv1, bnd_s, b7);
    *reinterpret_cast<uint16_t*>(cw + g * CST + nt * 8 + 2 * t) = static_cast<uint16_t>(c0 | (c1 << 8));
    *reinterpret_cast<uint16_t*>(cw + (g + 8) * CST + nt * 8 + 2 * t) = static_cast<uint16_t>(c2 | (c3 << 8));
  }
}

// Pack (format.h) and write staged codes (one byte each, rows of CST bytes): ROWS rows from input
// row n0, NG groups of 8 codes each, into groups group0.. of each row's destination (dest_row; rows
// past N or with no destination skipped); work item e = first, first + stride, ...
template <int D, int ROWS, int NG, int CST>
__device__ __forceinline__ void pack_and_store(const GemmParams& p, const uint8_t* codes_s, int64_t n0, int group0,
                                               int bits, int first, int stride) {
  const int pb = D * bits / 8;
  for (int e = first; e < ROWS * NG; e += stride) {
    const int r = e / NG;
    const int q = e - r * NG;
    const int64_t n = n0 + r;
    if (n >= p.N) continue;
    const int64_t row = dest_row(p, n);
    if (row < 0) continue;
    const uint2 cv = *reinterpret_cast<const uint2*>(codes_s + r * CST + 8 * q);
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w |= ((cv.x >> (8 * k)) & 0xFFu) << (bits * k);
      w |= ((cv.y >> (8 * k)) & 0xFFu) << (bits * (k + 4));
    }
    uint8_t* dst = p.codes + row * pb + (group0 + q) * bits;  // bits bytes per group
    store_group(dst, w, bits);
  }
}

// Register caps: bf16 x: 128 (2 CTAs of 8 warps per SM); f32 / f16 x (hi + lo fragments) may
// take up to ~160 on the large tile rather than spill (1-2 CTAs per SM).
// WIN: write_cache with a recent-token window (p.win): the epilogue also writes the window rows
// (a separate instantiation, so that the kernels without a window keep their registers).
template <int D, int NC, int WARPS, int XT, bool WIN = false>
__global__ void __launch_bounds__(WARPS * 32,
                                  (WARPS >= 8 ? (XT == static_cast<int>(FType::kBF16) ? 2 : 1) : 4))
    tq_compress_mma_kernel(const GemmParams p0, const GemmParams p1) {
  // grid.z selects the problem: 0 -> p0, 1 -> p1 (write_cache: K and V in one launch).
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  using G = MmaGeom<D, NC, WARPS>;
  constexpr int NT = G::NT, SBE = G::SBE, CST = G::CST, KC = G::KC;
  constexpr bool SPLIT = XT != static_cast<int>(FType::kBF16);
  constexpr int kThr = WARPS * 32;

  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* bt_hi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* bt_lo = reinterpret_cast<uint16_t*>(smem + G::bt_bytes);
  __shared__ float bnd_s[16];

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.y * NC;
  uint8_t* cw = smem + 2 * G::bt_bytes + warp * 16 * CST;  // this warp's [16][CST] codes

  const int bits = p.bits;
  const int ncent = 1 << bits;
  const int64_t ntiles = (p.N + 15) / 16;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * WARPS + warp;
  // x loads. Small-batch tiles (4 warps, few accumulators: a decode step's write, one tile per
  // warp, latency-bound): ALL of a tile's chunks are requested at once (ALL_AHEAD), the first
  // tile's before the Pi staging below, so that every load overlaps it. Otherwise bf16 x: chunk
  // j + 1 is loaded while chunk j runs (8 registers), the first tile's chunk 0 before the staging;
  // f32 / f16 x (hi + lo fragments, 3 MMAs): chunk j at the top of its iteration (registers).
  constexpr bool PREFETCH = !SPLIT;
  constexpr bool ALL_AHEAD = WARPS == 4 && KC > 0 && 2 * KC * XRaw<XT, 8>::W <= (SPLIT ? 32 : 64);
  XRaw<XT, 8> cur0, cur1;
  XRaw<XT, 8> all0[ALL_AHEAD ? KC : 1], all1[ALL_AHEAD ? KC : 1];
  auto load_all = [&](int64_t tile) {
    const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < (ALL_AHEAD ? KC : 1); ++j) {
      load_raw<XT, 8>(all0[j], p.x, r0 * D + 8 * t + 32 * j, r0 < p.N, p.vec_io);
      load_raw<XT, 8>(all1[j], p.x, r1 * D + 8 * t + 32 * j, r1 < p.N, p.vec_io);
    }
  };
  if constexpr (!ALL_AHEAD && PREFETCH && KC > 0) {
    const int64_t r0 = first_tile * 16 + g, r1 = r0 + 8;
    load_raw<XT, 8>(cur0, p.x, r0 * D + 8 * t, r0 < p.N, p.vec_io);
    load_raw<XT, 8>(cur1, p.x, r1 * D + 8 * t, r1 < p.N, p.vec_io);
  }
  if (tid < 16) {
    // boundary_i = (c_i + c_{i+1}) / 2 in float32, as format.h / the reference.
    bnd_s[tid] = tid < ncent - 1 ? (p.cent[tid] + p.cent[tid + 1]) * 0.5f : INFINITY;
  }
  // Bt[o][k] = Pi[col0 + o][k], split into bf16 hi / lo.
  auto stage_pi = [&](int e, const float4& v) {
    const int o = e / (D / 4);
    const int k4 = e - o * (D / 4);
    uint2 h, l;
    split2(v.x, v.y, h.x, l.x);
    split2(v.z, v.w, h.y, l.y);
    *reinterpret_cast<uint2*>(bt_hi + o * SBE + 4 * k4) = h;
    *reinterpret_cast<uint2*>(bt_lo + o * SBE + 4 * k4) = l;
  };
  auto pi_at = [&](int e) {
    const int o = e / (D / 4);
    return __ldg(reinterpret_cast<const float4*>(p.rot + static_cast<int64_t>(col0 + o) * D) +
                 (e - o * (D / 4)));
  };
  if constexpr (ALL_AHEAD) {  // small tiles: a thread's few Pi loads, then x, all in flight at once
    constexpr int kPiPer = (NC * (D / 4) + kThr - 1) / kThr;
    float4 pi[kPiPer];
#pragma unroll
    for (int i = 0; i < kPiPer; ++i)
      if (tid + i * kThr < NC * (D / 4)) pi[i] = pi_at(tid + i * kThr);
    load_all(first_tile);
#pragma unroll
    for (int i = 0; i < kPiPer; ++i)
      if (tid + i * kThr < NC * (D / 4)) stage_pi(tid + i * kThr, pi[i]);
  } else {
    for (int e = tid; e < NC * (D / 4); e += kThr) stage_pi(e, pi_at(e));
  }
  __syncthreads();
  const float b7 = bnd_s[7];

  // This thread's Bt rows (n = g of every n8 tile) at its k offset.
  const uint16_t* bhi0 = bt_hi + g * SBE + 8 * t;
  const uint16_t* blo0 = bt_lo + g * SBE + 8 * t;

  for (int64_t tile = first_tile; tile < ntiles; tile += static_cast<int64_t>(gridDim.x) * WARPS) {
    const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
    const bool v0 = r0 < p.N, v1 = r1 < p.N;
    const int64_t x0 = r0 * D + 8 * t, x1 = r1 * D + 8 * t;  // element offsets, chunk 0

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    float ss0 = 0.f, ss1 = 0.f;

    if constexpr (ALL_AHEAD) {
      if (tile != first_tile) load_all(tile);
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        uint32_t ph[4], pl[4], qh[4], ql[4];
        convert_raw<XT, 8>(all0[j], ph, pl, ss0);
        convert_raw<XT, 8>(all1[j], qh, ql, ss1);
        compress_mma_chunk<NT, SBE, SPLIT, 8>(acc, ph, qh, pl, ql, bhi0 + 32 * j, blo0 + 32 * j);
      }
    } else if constexpr (PREFETCH && KC > 0) {
      if (tile != first_tile) {
        load_raw<XT, 8>(cur0, p.x, x0, v0, p.vec_io);
        load_raw<XT, 8>(cur1, p.x, x1, v1, p.vec_io);
      }
    }
#pragma unroll 1
    for (int j = 0; j < (ALL_AHEAD ? 0 : KC); ++j) {
      if constexpr (!PREFETCH) {
        load_raw<XT, 8>(cur0, p.x, x0 + 32 * j, v0, p.vec_io);
        load_raw<XT, 8>(cur1, p.x, x1 + 32 * j, v1, p.vec_io);
      }
      XRaw<XT, 8> nxt0, nxt1;
      if constexpr (PREFETCH) {
        if (j + 1 < KC) {
          load_raw<XT, 8>(nxt0, p.x, x0 + 32 * (j + 1), v0, p.vec_io);
          load_raw<XT, 8>(nxt1, p.x, x1 + 32 * (j + 1), v1, p.vec_io);
        }
      }
      uint32_t ph[4], pl[4], qh[4], ql[4];
      convert_raw<XT, 8>(cur0, ph, pl, ss0);
      convert_raw<XT, 8>(cur1, qh, ql, ss1);
      compress_mma_chunk<NT, SBE, SPLIT, 8>(acc, ph, qh, pl, ql, bhi0 + 32 * j, blo0 + 32 * j);
      if constexpr (PREFETCH) {
        if (j + 1 < KC) {
          cur0 = nxt0;
          cur1 = nxt1;
        }
      }
    }
    if constexpr (G::KREM) {
      XRaw<XT, 4> rr0, rr1;
      load_raw<XT, 4>(rr0, p.x, r0 * D + 32 * KC + 4 * t, v0, p.vec_io);
      load_raw<XT, 4>(rr1, p.x, r1 * D + 32 * KC + 4 * t, v1, p.vec_io);
      uint32_t ph[2], pl[2], qh[2], ql[2];
      convert_raw<XT, 4>(rr0, ph, pl, ss0);
      convert_raw<XT, 4>(rr1, qh, ql, ss1);
      const int kb = 32 * KC + 4 * t;
      compress_mma_chunk<NT, SBE, SPLIT, 4>(acc, ph, qh, pl, ql, bt_hi + g * SBE + kb,
                                            bt_lo + g * SBE + kb);
    }

    // ---- norms: quad butterfly (bitwise identical in the 4 lanes) ----
    const float2 nn = quad_row_norms<D>(ss0, ss1, v0, v1, p.x, p.dtype, r0, r1, t);
    const float n0 = nn.x, n1 = nn.y;
    const float inv0 = n0 > 0.f ? 1.0f / n0 : 0.f;
    const float inv1 = n1 > 0.f ? 1.0f / n1 : 0.f;

    if constexpr (WIN) {
      const int64_t w0 = v0 ? window_row(p, r0) : -1;
      const int64_t w1 = v1 ? window_row(p, r1) : -1;
      store_window_rows<D, NT>(p.win, w0, w1, acc, n0, inv0, n1, inv1, col0, t);
    }
    bucketize_tile<NT, CST>(acc, inv0, inv1, bnd_s, b7, cw, g, t);
    __syncwarp();
    pack_and_store<D, 16, G::NG, CST>(p, cw, tile * 16, col0 / 8, bits, lane, 32);
    if (blockIdx.y == 0 && t == 0) {
      if (v0) {
        const int64_t row = dest_row(p, r0);
        if (row >= 0) p.norms[row] = n0;
      }
      if (v1) {
        const int64_t row = dest_row(p, r1);
        if (row >= 0) p.norms[row] = n1;
      }
    }
    __syncwarp();  // staging rows reused by the next tile
  }
}

// =============================================================================================
// Fitted scale on tensor cores (format.h "Fitted scale"; d <= 128, the v1 tq_fit_kernel for 192 /
// 256, whose Pi hi + lo would not fit in one CTA's shared memory).
//
// The candidates' sums need every coordinate of a vector, so a CTA holds the whole [d, d] Bt (hi +
// lo, as tq_compress_mma_kernel's, staged once per CTA) and computes whole 16-row tiles: warp w takes
// the n8 tiles [w * NT, (w + 1) * NT) with the same per-output MMA sequence as
// tq_compress_mma_kernel (compress_mma_chunk), so y = acc * (1 / ||x||) and the norms are bitwise
// those of the plain codec. y goes to shared memory [16][YST] (f32) and the norms to nrm_s; then the
// CTA fits RF of the 16 rows (a "unit": tile * (16 / RF) + part, rows part * RF .. + RF - 1; RF < 16
// spreads a small batch over more SMs, the other rows' x are not loaded and give y = 0): TPR =
// threads / RF lanes per row, lane l holding coordinates l + TPR * j (conflict-free reads). For each
// candidate k: codes_k by the binary search of bucketize16 (levels 1-2 from registers), <y, c> and
// |c|^2 over the lane's coordinates, then an xor butterfly over the row's TPR lanes (the same sums
// in all of them); the first k of the largest dot^2 / sq wins (as v1). The winner's codes
// are staged [RF][CST] bytes and packed per 8-code group (format.h layout) to dest_row; the norm
// slot takes ||x|| * dot / sq, the window rows (write_cache) bf16(||x|| * y_j). grid.z selects
// p0 / p1 (write_cache: K and V in one launch). Persistent over units (grid <= units); the next
// unit's x is requested right after the MMAs, so that its loads overlap the fit.
// =============================================================================================
template <int D>
struct FitGeom {
  static constexpr int WARPS = ((D / 8) % 4) == 0 ? 4 : 2;  // d 80: 10 n8 tiles -> 2 warps
  static constexpr int kThr = WARPS * 32;
  static constexpr int NT = D / 8 / WARPS;  // n8 tiles per warp
  static constexpr int NC = NT * 8;         // columns per warp
  static constexpr int KC = D / 32;
  static constexpr bool KREM = (D % 32) != 0;
  static constexpr int SB = bt_stride_bytes(D);
  static constexpr int SBE = SB / 2;
  static constexpr int bt_bytes = D * SB;
  static_assert(NT * 8 * WARPS == D, "n8 tiles split over the warps");
};

// The fitted scale's candidate search of one row (docs/FORMAT.md "Fitted scale"): the candidate
// table entry k maximizing gain = dot^2 / sq over the row's coordinates (a lane holds CPT of them;
// TPR lanes per row), with its dot and sq; the first k keeps a tie, NaN never wins.
template <int CPT, int TPR>
__device__ __forceinline__ int best_fit_candidate(const float (&y)[CPT], const float* fit_tab, const float* cent_s,
                                                  float& best_dot, float& best_sq) {
  // The candidates in passes of KB (independent sums and butterflies: ILP for the latency-bound
  // small batches; the last pass skips the k past the last candidate, a block-uniform branch).
  // The argmax runs in k order.
  constexpr int KB = CPT <= 5 ? 9 : 6;
  float best_gain = -1.f;
  best_dot = 0.f;
  best_sq = 1.f;
  int best_k = 0;
#pragma unroll 1
  for (int k0 = 0; k0 < kFitCandidates; k0 += KB) {
    float dot[KB], sq[KB];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      dot[b] = 0.f;
      sq[b] = 0.f;
      if (k0 + b >= kFitCandidates) continue;
      const float* tb = fit_tab + 16 * (k0 + b);
      const float b3 = tb[3], b7 = tb[7], b11 = tb[11];
#pragma unroll
      for (int j = 0; j < CPT; ++j) {
        const float c = cent_s[bucketize_fit(y[j], tb, b3, b7, b11)];
        dot[b] = fmaf(y[j], c, dot[b]);
        sq[b] = fmaf(c, c, sq[b]);
      }
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) {
#pragma unroll
      for (int b = 0; b < KB; ++b) {
        dot[b] += __shfl_xor_sync(0xFFFFFFFFu, dot[b], o);
        sq[b] += __shfl_xor_sync(0xFFFFFFFFu, sq[b], o);
      }
    }
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const float gain = dot[b] * dot[b] / sq[b];
      if (k0 + b < kFitCandidates && gain > best_gain) {  // strictly: the first k keeps a tie
        best_gain = gain;                                  // (NaN never wins)
        best_dot = dot[b];
        best_sq = sq[b];
        best_k = k0 + b;
      }
    }
  }
  return best_k;
}

template <int D, int RF>
struct FitLayout {
  using G = FitGeom<D>;
  static constexpr int TPR = G::kThr / RF;  // lanes per fitted row
  static constexpr int CPT = D / TPR;       // coordinates per lane: l + TPR * j
  // y row stride (floats), = TPR (mod 32): lane (row r, l) reads bank (r * TPR + l) % 32 = its lane.
  static constexpr int YST = D + (((TPR % 32) - (D % 32)) + 32) % 32;
  static constexpr int CST = D + 8;  // codes staging row stride (bytes)
  static constexpr int y_off = 2 * G::bt_bytes;
  static constexpr int c_off = y_off + 16 * YST * 4;
  static constexpr int total = c_off + RF * CST;
  static_assert(16 % RF == 0 && TPR <= 32 && 32 % TPR == 0 && D % TPR == 0, "fit lanes");
  static_assert(YST % 2 == 0 && YST % 32 == TPR % 32 && CST % 8 == 0 && c_off % 16 == 0, "layout");
};

template <int D, int XT, int RF>
__global__ void __launch_bounds__(FitGeom<D>::kThr)
    tq_fit_mma_kernel(const GemmParams p0, const GemmParams p1) {
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  using G = FitGeom<D>;
  using L = FitLayout<D, RF>;
  constexpr int NT = G::NT, NC = G::NC, SBE = G::SBE, KC = G::KC, kThr = G::kThr;
  constexpr int TPR = L::TPR, CPT = L::CPT, YST = L::YST, CST = L::CST;
  constexpr int RSPLIT = 16 / RF;
  constexpr int GROUPS = D / 8;
  constexpr bool SPLIT = XT != static_cast<int>(FType::kBF16);

  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* bt_hi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* bt_lo = reinterpret_cast<uint16_t*>(smem + G::bt_bytes);
  float* y_s = reinterpret_cast<float*>(smem + L::y_off);
  uint8_t* codes_s = smem + L::c_off;
  __shared__ float cent_s[16];
  __shared__ __align__(16) float fit_tab[kFitCandidates * 16];
  __shared__ float nrm_s[16];

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int bits = p.bits;
  const int ncent = 1 << bits;
  const int64_t nunits = (p.N + 15) / 16 * RSPLIT;
  const int64_t ustride = gridDim.x;

  // x of a unit's tile (rows g and g + 8; only the unit's rows are loaded), all chunks at once.
  XRaw<XT, 8> all0[KC > 0 ? KC : 1], all1[KC > 0 ? KC : 1];
  XRaw<XT, 4> rem0, rem1;
  auto row_ok = [&](int64_t tile, int part, int r) {  // r: row of the tile
    return tile * 16 + r < p.N && r / RF == part;
  };
  auto load_unit = [&](int64_t u) {
    const int64_t tile = u / RSPLIT;
    const int part = static_cast<int>(u - tile * RSPLIT);
    const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
    const bool v0 = row_ok(tile, part, g), v1 = row_ok(tile, part, g + 8);
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      load_raw<XT, 8>(all0[j], p.x, r0 * D + 8 * t + 32 * j, v0, p.vec_io);
      load_raw<XT, 8>(all1[j], p.x, r1 * D + 8 * t + 32 * j, v1, p.vec_io);
    }
    if constexpr (G::KREM) {
      load_raw<XT, 4>(rem0, p.x, r0 * D + 32 * KC + 4 * t, v0, p.vec_io);
      load_raw<XT, 4>(rem1, p.x, r1 * D + 32 * KC + 4 * t, v1, p.vec_io);
    }
  };
  int64_t u = blockIdx.x;  // < nunits (grid <= units)
  load_unit(u);

  if (tid < 16) cent_s[tid] = tid < ncent ? p.cent[tid] : 0.f;
  fill_fit_table(fit_tab, p.cent, ncent, tid, kThr);
  // Bt[o][k] = Pi[o][k], all d rows, split into bf16 hi / lo; kBatch float4 loads in flight.
  {
    constexpr int kPi = D * (D / 4);
    constexpr int kBatch = 8;
    const float4* rot4 = reinterpret_cast<const float4*>(p.rot);
#pragma unroll 1
    for (int e0 = 0; e0 < kPi; e0 += kBatch * kThr) {
      float4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int e = e0 + b * kThr + tid;
        if (e < kPi) v[b] = __ldg(rot4 + e);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int e = e0 + b * kThr + tid;
        if (e < kPi) {
          const int o = e / (D / 4);
          const int k4 = e - o * (D / 4);
          uint2 h, l;
          split2(v[b].x, v[b].y, h.x, l.x);
          split2(v[b].z, v[b].w, h.y, l.y);
          *reinterpret_cast<uint2*>(bt_hi + o * SBE + 4 * k4) = h;
          *reinterpret_cast<uint2*>(bt_lo + o * SBE + 4 * k4) = l;
        }
      }
    }
  }
  __syncthreads();

  // This warp's Bt rows (n = g of each of its n8 tiles) at the thread's k offset.
  const uint16_t* bhi0 = bt_hi + (warp * NC + g) * SBE + 8 * t;
  const uint16_t* blo0 = bt_lo + (warp * NC + g) * SBE + 8 * t;
  // Fit lanes: row rl of the unit, lane l of the row.
  const int rl = tid / TPR;
  const int l = tid - rl * TPR;

  for (; u < nunits; u += ustride) {
    const int64_t tile = u / RSPLIT;
    const int part = static_cast<int>(u - tile * RSPLIT);
    const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
    const bool v0 = row_ok(tile, part, g), v1 = row_ok(tile, part, g + 8);

    // ---- y = x Pi^T (this warp's columns), as tq_compress_mma_kernel ----
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      uint32_t ph[4], pl[4], qh[4], ql[4];
      convert_raw<XT, 8>(all0[j], ph, pl, ss0);
      convert_raw<XT, 8>(all1[j], qh, ql, ss1);
      compress_mma_chunk<NT, SBE, SPLIT, 8>(acc, ph, qh, pl, ql, bhi0 + 32 * j, blo0 + 32 * j);
    }
    if constexpr (G::KREM) {
      uint32_t ph[2], pl[2], qh[2], ql[2];
      convert_raw<XT, 4>(rem0, ph, pl, ss0);
      convert_raw<XT, 4>(rem1, qh, ql, ss1);
      const int kb = 32 * KC + 4 * t;
      compress_mma_chunk<NT, SBE, SPLIT, 4>(acc, ph, qh, pl, ql, bt_hi + (warp * NC + g) * SBE + kb,
                                            bt_lo + (warp * NC + g) * SBE + kb);
    }
    // The next unit's x, in flight during the fit below.
    if (u + ustride < nunits) load_unit(u + ustride);

    // ---- norms: quad butterfly (bitwise identical in the 4 lanes, and in every warp) ----
    const float2 nn = quad_row_norms<D>(ss0, ss1, v0, v1, p.x, p.dtype, r0, r1, t);
    const float n0 = nn.x, n1 = nn.y;
    const float inv0 = n0 > 0.f ? 1.0f / n0 : 0.f;
    const float inv1 = n1 > 0.f ? 1.0f / n1 : 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = warp * NC + nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(y_s + g * YST + col) = make_float2(acc[nt][0] * inv0, acc[nt][1] * inv0);
      *reinterpret_cast<float2*>(y_s + (g + 8) * YST + col) =
          make_float2(acc[nt][2] * inv1, acc[nt][3] * inv1);
    }
    if (warp == 0 && t == 0) {
      nrm_s[g] = n0;
      nrm_s[g + 8] = n1;
    }
    __syncthreads();

    // ---- fit: row rt of the tile, coordinates l + TPR * j ----
    {
      const int rt = part * RF + rl;
      const int64_t n = tile * 16 + rt;
      const bool valid = n < p.N;
      float y[CPT];
#pragma unroll
      for (int j = 0; j < CPT; ++j) y[j] = y_s[rt * YST + l + TPR * j];
      const float nrm = nrm_s[rt];
      if (p.win != nullptr && valid) {  // write_cache's window row: bf16(||x|| * y)
        const int64_t wr = window_row(p, n);
        if (wr >= 0) {
          __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.win) + wr * D;
#pragma unroll
          for (int j = 0; j < CPT; ++j) dst[l + TPR * j] = __float2bfloat16_rn(nrm * y[j]);
        }
      }
      float best_dot, best_sq;
      const int best_k = best_fit_candidate<CPT, TPR>(y, fit_tab, cent_s, best_dot, best_sq);
      const float* tb = fit_tab + 16 * best_k;
      const float b3 = tb[3], b7 = tb[7], b11 = tb[11];
#pragma unroll
      for (int j = 0; j < CPT; ++j)
        codes_s[rl * CST + l + TPR * j] = static_cast<uint8_t>(bucketize_fit(y[j], tb, b3, b7, b11));
      if (l == 0 && valid) {
        const int64_t row = dest_row(p, n);
        if (row >= 0) p.norms[row] = nrm * (best_dot / best_sq);  // 0 for a zero vector
      }
    }
    __syncthreads();

    pack_and_store<D, RF, GROUPS, CST>(p, codes_s, tile * 16 + part * RF, 0, bits, tid, kThr);
    __syncthreads();  // y_s, nrm_s and codes_s are rewritten by the next unit
  }
}

// Packed group word (8 codes, LSB-first) of row `row`, codes [k0, k0 + 8) (k0 % 8 == 0).
__device__ __forceinline__ uint32_t load_group(const uint8_t* row, int k0, int bits) {
  if (bits == 4) return __ldg(reinterpret_cast<const uint32_t*>(row + k0 / 2));
  if (bits == 2) return __ldg(reinterpret_cast<const uint16_t*>(row + k0 / 4));
  const uint8_t* q = row + (k0 / 8) * 3;
  return uint32_t(__ldg(q)) | (uint32_t(__ldg(q + 1)) << 8) | (uint32_t(__ldg(q + 2)) << 16);
}

// Four codes [k0, k0 + 4) (k0 % 4 == 0), LSB-first in the low 4 * bits bits.
__device__ __forceinline__ uint32_t load_quad(const uint8_t* row, int k0, int bits) {
  const int bit = k0 * bits;
  const uint8_t* q = row + bit / 8;
  const int sh = bit % 8;
  uint32_t w = __ldg(q);
  if (sh + 4 * bits > 8) w |= uint32_t(__ldg(q + 1)) << 8;
  return (w >> sh) & ((1u << (4 * bits)) - 1u);
}

template <int D, int NC, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, (WARPS >= 8 ? 2 : 4))
    tq_decompress_mma_kernel(const GemmParams p) {
  using G = MmaGeom<D, NC, WARPS>;
  constexpr int NT = G::NT, SBE = G::SBE, KC = G::KC;
  constexpr int kThr = WARPS * 32;

  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* bt = reinterpret_cast<uint16_t*>(smem);
  __shared__ float cent_s[16];
  __shared__ uint32_t ptab[256];  // (c_a | c_b << bits) -> half2(c_a, c_b) * cscale

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.y * NC;
  const int bits = p.bits;
  const int ncent = 1 << bits;
  const uint32_t pmask = (1u << (2 * bits)) - 1u;
  if (tid < 16) cent_s[tid] = tid < ncent ? p.cent[tid] : 0.f;
  // Bt[o][k] = fp16(Pi[k][col0 + o])
  for (int e = tid; e < D * NC; e += kThr) {
    const int k = e / NC;
    const int o = e - k * NC;
    bt[o * SBE + k] = __half_as_ushort(__float2half_rn(__ldg(p.rot + k * D + col0 + o)));
  }
  __syncthreads();
  float cmax = 0.f;
  for (int i = 0; i < ncent; ++i) cmax = fmaxf(cmax, fabsf(cent_s[i]));
  int ex = 0;
  (void)frexpf(cmax, &ex);  // cmax = m * 2^ex, m in [0.5, 1)
  const float cscale = ldexpf(1.f, -ex);
  const float cunscale = ldexpf(1.f, ex);
  for (int i = tid; i < 256; i += kThr) {
    const float a = cent_s[i & (ncent - 1)] * cscale;
    const float b = cent_s[(i >> bits) & (ncent - 1)] * cscale;
    ptab[i] = h2_bits(__floats2half2_rn(a, b));
  }
  __syncthreads();

  const int64_t ntiles = (p.N + 15) / 16;
  const int pb = D * bits / 8;
  const bool bf16_out = p.dtype == static_cast<int>(FType::kBF16);
  const uint16_t* b0 = bt + g * SBE + 8 * t;

  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * WARPS + warp; tile < ntiles;
       tile += static_cast<int64_t>(gridDim.x) * WARPS) {
    const int64_t r0 = tile * 16 + g, r1 = r0 + 8;
    const bool v0 = r0 < p.N, v1 = r1 < p.N;
    const uint8_t* row0 = p.codes + r0 * pb;
    const uint8_t* row1 = p.codes + r1 * pb;
    uint32_t wr0 = 0, wr1 = 0;
    if constexpr (G::KREM) {
      wr0 = v0 ? load_quad(row0, 32 * KC + 4 * t, bits) : 0u;
      wr1 = v1 ? load_quad(row1, 32 * KC + 4 * t, bits) : 0u;
    }
    const float s0 = (v0 ? __ldg(p.norms + r0) : 0.f) * cunscale;
    const float s1 = (v1 ? __ldg(p.norms + r1) : 0.f) * cunscale;

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

    // chunk j's group words (8 codes of rows r0 / r1), one chunk prefetched ahead
    uint32_t cw0 = (KC > 0 && v0) ? load_group(row0, 8 * t, bits) : 0u;
    uint32_t cw1 = (KC > 0 && v1) ? load_group(row1, 8 * t, bits) : 0u;
#pragma unroll 1
    for (int j = 0; j < KC; ++j) {
      uint32_t nw0 = 0u, nw1 = 0u;
      if (j + 1 < KC) {
        nw0 = v0 ? load_group(row0, 32 * (j + 1) + 8 * t, bits) : 0u;
        nw1 = v1 ? load_group(row1, 32 * (j + 1) + 8 * t, bits) : 0u;
      }
      uint32_t a[4], c[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = ptab[(cw0 >> (2 * bits * i)) & pmask];
        c[i] = ptab[(cw1 >> (2 * bits * i)) & pmask];
      }
      const uint16_t* bj = b0 + 32 * j;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 b = *reinterpret_cast<const uint4*>(bj + nt * 8 * SBE);
        mma_f16(acc[nt], a[0], c[0], a[1], c[1], b.x, b.y);
        mma_f16(acc[nt], a[2], c[2], a[3], c[3], b.z, b.w);
      }
      cw0 = nw0;
      cw1 = nw1;
    }
    if constexpr (G::KREM) {
      const uint32_t a0 = ptab[wr0 & pmask], a1 = ptab[(wr0 >> (2 * bits)) & pmask];
      const uint32_t c0 = ptab[wr1 & pmask], c1 = ptab[(wr1 >> (2 * bits)) & pmask];
      const uint16_t* bb = bt + g * SBE + 32 * KC + 4 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 b = *reinterpret_cast<const uint2*>(bb + nt * 8 * SBE);
        mma_f16(acc[nt], a0, c0, a1, c1, b.x, b.y);
      }
    }

    // ---- epilogue: rows r0 (acc[.][0..1]) and r1 (acc[.][2..3]), 2 outputs per store ----
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = col0 + nt * 8 + 2 * t;
      uint32_t u0, u1;
      if (bf16_out) {
        u0 = bf2_bits(__floats2bfloat162_rn(acc[nt][0] * s0, acc[nt][1] * s0));
        u1 = bf2_bits(__floats2bfloat162_rn(acc[nt][2] * s1, acc[nt][3] * s1));
      } else {
        u0 = h2_bits(__floats2half2_rn(acc[nt][0] * s0, acc[nt][1] * s0));
        u1 = h2_bits(__floats2half2_rn(acc[nt][2] * s1, acc[nt][3] * s1));
      }
      if (v0) *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + r0 * D + col) = u0;
      if (v1) *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + r1 * D + col) = u1;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
// Messages: "<op> (CUDA): ..."; the operand checks are shared with the CPU handlers
// (jax_tq/ffi_checks.h).
ffi_checks::Op cuda_op(const char* op) { return ffi_checks::Op{op, ffi_checks::kCudaTag}; }

ffi::Error invalid(const char* op, const std::string& msg) { return cuda_op(op).invalid(msg); }

ffi::Error unsupported_head_dim(const char* op, int d) { return invalid(op, "unsupported head_dim " + std::to_string(d)); }

ffi::Error cuda_error(const char* op, const char* what, cudaError_t e) {
  return cuda_op(op).internal(std::string(what) + ": " + cudaGetErrorString(e));
}

int ftype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return static_cast<int>(FType::kF32);
    case ffi::DataType::BF16: return static_cast<int>(FType::kBF16);
    case ffi::DataType::F16: return static_cast<int>(FType::kF16);
    default: return -1;
  }
}

int sm_count() { return device_sm_count(132); }

// Occupancy (blocks per SM) of a kernel whose dynamic shared-memory limit is already raised; the
// call sites read it once per kernel instantiation, after allow_dynamic_smem (cuda_launch.h), which
// they call at every launch because that limit is a per-device attribute.
struct KernelCfg {
  cudaError_t err;
  int blocks_per_sm;
};

template <typename Kernel>
KernelCfg occupancy_cfg(Kernel kernel, int threads, int smem) {
  int occ = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem);
  return KernelCfg{e, occ > 0 ? occ : 1};
}

// v1 fp32-FMA kernel (decompress to f32, or unaligned buffers).
template <int D, int VPT, bool DECOMP>
ffi::Error launch_gemm_t(const char* op, cudaStream_t stream, const GemmParams& p) {
  using L = GemmLayout<D, VPT>;
  auto kernel = tq_gemm_kernel<D, VPT, DECOMP>;
  constexpr int smem = L::total;
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return cuda_error(op, "shared memory attribute", e);
  static const KernelCfg cfg = occupancy_cfg(kernel, kThreads, smem);
  if (cfg.err != cudaSuccess) return cuda_error(op, "kernel setup", cfg.err);
  const int64_t blocks = (p.N + L::MV - 1) / L::MV;
  if (blocks > 0x7FFFFFFF) return invalid(op, "too many vectors");
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

template <bool DECOMP>
ffi::Error launch_gemm(const char* op, cudaStream_t stream, int d, const GemmParams& p) {
  if (p.N == 0) return ffi::Error::Success();
  // Large batches: 64 vectors per CTA (more reuse of each Pi tile); small ones: 16 per CTA.
  const bool big = (p.N + 63) / 64 >= 2 * static_cast<int64_t>(sm_count());
  return with_value(SupportedHeadDims{}, d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return big ? launch_gemm_t<D, 4, DECOMP>(op, stream, p) : launch_gemm_t<D, 1, DECOMP>(op, stream, p);
  }, [&] { return unsupported_head_dim(op, d); });
}

// =============================================================================================
// Fitted scale for Hadamard codecs, head_dim 64 / 128 (p.rot_spec): one warp per vector, no matrix.
// Lane l holds coordinates (D/32) l .. + D/32 - 1: x, its norm (xor butterfly; the scaled re-read of
// scaled_row_norm where the f32 sum of squares leaves its safe range), y = (Pi x) / ||x|| with Pi
// applied as H D2 P H D1 (hadamard.cuh) instead of the dense product, the window row bf16(||x|| y),
// then the fit as tq_fit_mma_kernel's: all kFitCandidates candidates at once (codes_k by
// bucketize_fit, <y, c> and |c|^2 over the lane's coordinates, a reduce-scatter over the warp
// leaving one candidate's sums per lane), the first k of the largest dot^2 / sq (group_best_fit),
// its codes packed per 8-code group (format.h: LSB first, the group's lanes OR their shifted codes
// together) and the norm slot ||x|| * dot / sq. grid.z selects
// p0 / p1 (K and V). Persistent over rows.
// =============================================================================================
constexpr int kHadWarps = 4;

// Pairs per lane after reduce_scatter_pairs<N, M>: N halved (rounded up) at each mask M .. 1.
constexpr int scattered_pairs(int n, int m) { return m == 0 ? n : scattered_pairs((n + 1) / 2, m / 2); }

// Reduce-scatter of N (dot, sq) pairs over groups of 2M lanes: at mask M the lanes with bit M set
// keep pairs H .. N - 1 (H = ceil(N / 2); a missing pair is (0, 0)), the others 0 .. H - 1, each
// adding its partner's copy of the pairs it keeps. Ends with scattered_pairs(N, M) whole-group
// pairs per lane (dot, sq), pairs k .. (lanes holding a missing pair get (0, 0)): over a warp
// (M = 16), 40 shuffles for 17 pairs instead of a butterfly's 170.
template <int N, int M>
__device__ __forceinline__ void reduce_scatter_pairs(const float (&d)[N], const float (&s)[N], int lane,
                                                     float (&dot)[scattered_pairs(N, M)],
                                                     float (&sq)[scattered_pairs(N, M)], int& k) {
  if constexpr (M == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dot[i] = d[i];
      sq[i] = s[i];
    }
  } else {
    constexpr int H = (N + 1) / 2;
    const bool upper = (lane & M) != 0;
    float d2[H], s2[H];
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const int hi = i + H < N ? i + H : N - 1;
      const float dh = i + H < N ? d[hi] : 0.f, sh = i + H < N ? s[hi] : 0.f;
      d2[i] = (upper ? dh : d[i]) + __shfl_xor_sync(0xffffffffu, upper ? d[i] : dh, M);
      s2[i] = (upper ? sh : s[i]) + __shfl_xor_sync(0xffffffffu, upper ? s[i] : sh, M);
    }
    if (upper) k += H;
    reduce_scatter_pairs<H, M / 2>(d2, s2, lane, dot, sq, k);
  }
}

// The first k of the largest dot_k^2 / sq_k over a group of LANES lanes holding NF pairs each,
// k .. k + NF - 1 (a NaN gain, e.g. a missing pair's 0 / 0, never wins): every lane of the group
// gets k and dot_k / sq_k. (gain, k) is a total order, so the xor butterfly ends with the same
// winner in every lane.
template <int LANES, int NF>
__device__ __forceinline__ void group_best_fit(const float (&dot)[NF], const float (&sq)[NF], int& k, float& ratio) {
  float gain = dot[0] * dot[0] / sq[0];
  if (!(gain >= 0.f)) gain = -1.f;
  ratio = dot[0] / sq[0];
  const int k0 = k;
#pragma unroll
  for (int i = 1; i < NF; ++i) {
    const float gi = dot[i] * dot[i] / sq[i];
    if (gi > gain) {  // strictly: the first k keeps a tie; a NaN never passes
      gain = gi;
      k = k0 + i;
      ratio = dot[i] / sq[i];
    }
  }
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) {
    const float og = __shfl_xor_sync(0xffffffffu, gain, o);
    const int ok = __shfl_xor_sync(0xffffffffu, k, o);
    const float orat = __shfl_xor_sync(0xffffffffu, ratio, o);
    if (og > gain || (og == gain && ok < k)) {
      gain = og;
      k = ok;
      ratio = orat;
    }
  }
}

// Lane l's C coordinates C l .. C l + C - 1 of row n as floats: one 4- / 8- / 16-byte load where
// x is 16-byte aligned (p.vec_io), else element by element.
template <int C>
__device__ __forceinline__ void load_lane(const GemmParams& p, int64_t n, int lane, float (&x)[C]) {
  constexpr int D = 32 * C;
  const int64_t i = n * D + C * lane;
  if (p.vec_io && p.dtype == static_cast<int>(FType::kF32)) {
    const float* src = static_cast<const float*>(p.x) + i;
    if constexpr (C == 4) {
      const float4 a = *reinterpret_cast<const float4*>(src);
      x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    } else {
      const float2 a = *reinterpret_cast<const float2*>(src);
      x[0] = a.x; x[1] = a.y;
    }
    return;
  }
  if (p.vec_io && p.dtype == static_cast<int>(FType::kBF16)) {
    const uint16_t* src = static_cast<const uint16_t*>(p.x) + i;
    uint32_t w[C / 2];
    if constexpr (C == 4) {
      const uint2 a = *reinterpret_cast<const uint2*>(src);
      w[0] = a.x; w[1] = a.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(src);
    }
#pragma unroll
    for (int k = 0; k < C / 2; ++k) {
      x[2 * k] = __uint_as_float(w[k] << 16);
      x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < C; ++j) x[j] = load_elem(p.x, p.dtype, i + j);
}

// dest_row for the Hadamard kernels: 32-bit divisions (their launch requires N < 2^31; slots are int32),
// from vector n's slot s = slots[n / Hkv] (-1: not written).
__device__ __forceinline__ int64_t dest_row32_of_slot(const GemmParams& p, int64_t n, int32_t s) {
  if (s < 0 || s >= p.total_slots) return -1;
  const uint32_t h = static_cast<uint32_t>(n) % static_cast<uint32_t>(p.Hkv);
  const uint32_t page = static_cast<uint32_t>(s) / static_cast<uint32_t>(p.page_size);
  const uint32_t off = static_cast<uint32_t>(s) - page * static_cast<uint32_t>(p.page_size);
  return (static_cast<int64_t>(page) * p.Hkv + h) * p.page_size + off;  // row index into [P, Hkv, page]
}

// dest_row for the Hadamard kernels.
__device__ __forceinline__ int64_t dest_row32(const GemmParams& p, int64_t n) {
  if (p.slots == nullptr) return n;
  return dest_row32_of_slot(p, n, p.slots[static_cast<uint32_t>(n) / static_cast<uint32_t>(p.Hkv)]);
}

template <int D>
__global__ void __launch_bounds__(kHadWarps * 32, 8) tq_hadamard_fit_kernel(const GemmParams p0, const GemmParams p1) {
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  constexpr int C = D / 32;  // coordinates per lane
  constexpr int LPG = 8 / C;  // lanes per 8-code group
  __shared__ __align__(16) float fit_tab[kFitCandidates * 16];
  __shared__ float cent_s[16];
  __shared__ float buf_s[kHadWarps][D];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bits = p.bits;
  const int ncent = 1 << bits;
  if (tid < 16) cent_s[tid] = tid < ncent ? p.cent[tid] : 0.f;
  fill_fit_table(fit_tab, p.cent, ncent, tid, kHadWarps * 32);
  uint32_t w[C];
#pragma unroll
  for (int j = 0; j < C; ++j) w[j] = static_cast<uint32_t>(__ldg(p.rot_spec + C * lane + j));
  __syncthreads();
  const int pb = D * bits / 8;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kHadWarps + warp; n < p.N;
       n += static_cast<int64_t>(gridDim.x) * kHadWarps) {
    float x[C];
    load_lane<C>(p, n, lane, x);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < C; ++j) ss = fmaf(x[j], x[j], ss);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float nrm = sqrtf(ss);
    if (needs_scaled_norm(ss)) {  // the same ss in every lane: the whole warp takes it
      const float scaled = scaled_row_norm<D, 32>(p.x, p.dtype, n, lane);
      if (scaled >= 0.f) nrm = scaled;
    }
    nrm = stored_norm(nrm);
    const float inv = nrm > 0.f ? 1.0f / nrm : 0.f;
    warp_hadamard_rotate<D>(x, w, buf_s[warp], lane);
    float y[C];
#pragma unroll
    for (int j = 0; j < C; ++j) y[j] = x[j] * inv;
    if (p.win != nullptr) {  // write_cache's window row: bf16(||x|| * y)
      const int64_t wr = window_row(p, n);
      if (wr >= 0) {
        __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.win) + wr * D + C * lane;
#pragma unroll
        for (int j = 0; j < C; ++j) dst[j] = __float2bfloat16_rn(nrm * y[j]);
      }
    }
    float dot[kFitCandidates], sq[kFitCandidates];
#pragma unroll
    for (int k = 0; k < kFitCandidates; ++k) {
      const float* tb = fit_tab + 16 * k;
      const float b3 = tb[3], b7 = tb[7], b11 = tb[11];
      dot[k] = 0.f;
      sq[k] = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const float c = cent_s[bucketize_fit(y[j], tb, b3, b7, b11)];
        dot[k] = fmaf(y[j], c, dot[k]);
        sq[k] = fmaf(c, c, sq[k]);
      }
    }
    int best_k = 0;
    float pair_dot[1], pair_sq[1], ratio;
    reduce_scatter_pairs<kFitCandidates, 16>(dot, sq, lane, pair_dot, pair_sq, best_k);
    group_best_fit<32>(pair_dot, pair_sq, best_k, ratio);
    const float* tb = fit_tab + 16 * best_k;
    const float b3 = tb[3], b7 = tb[7], b11 = tb[11];
    uint32_t group = 0;  // this lane's codes at their places in its 8-code group word
#pragma unroll
    for (int j = 0; j < C; ++j)
      group |= bucketize_fit(y[j], tb, b3, b7, b11) << (bits * (C * (lane % LPG) + j));
#pragma unroll
    for (int o = 1; o < LPG; o <<= 1) group |= __shfl_xor_sync(0xffffffffu, group, o);
    const int64_t row = dest_row32(p, n);
    if (row >= 0) {
      if (lane % LPG == 0) {
        uint8_t* dst = p.codes + row * pb + (lane / LPG) * bits;  // bits bytes per group
        store_group(dst, group, bits);
      }
      if (lane == 0) p.norms[row] = nrm * ratio;  // 0 for a zero vector
    }
  }
}

// =============================================================================================
// The plain codec's write of Hadamard codecs (head_dim 64 / 128): a quad of lanes per vector
// (hadamard.cuh QuadLayout), 8 vectors per warp, persistent over groups of 8 rows. Per row: the
// norm; u = D1 x / ||x||; H u, the permutation P with D2 through the row's shared copy, H again
// (z = d Pi u: the two 1 / sqrt(d) go into the boundaries, d bnd_i, an exact scaling); codes of z
// against them, one 8-code group per lane and chunk; norm slot ||x||; the window row
// bf16(||x|| z / d). Against tq_hadamard_fit_kernel's one warp per vector: 16 warp shuffles per
// vector instead of 47 (two of the seven butterfly levels cross lanes instead of five), the
// per-row work (slot, norm, stores) shared by 8 rows per warp instruction, and a code from one
// table entry (fill_code_lut) instead of a 4-level search.
// =============================================================================================
constexpr int kQuadWarps = 4;

__device__ __forceinline__ float flip_sign(float x, uint32_t sign_bit31) {
  return __uint_as_float(__float_as_uint(x) ^ sign_bit31);
}

// Elements [i, i + 8) of x (dtype XT) as floats; zeros when !valid. vec: x is 16-byte aligned.
template <int XT>
__device__ __forceinline__ void load8_as_float(const void* x, int64_t i, bool valid, bool vec, float (&v)[8]) {
  XRaw<XT, 8> r;
  load_raw<XT, 8>(r, x, i, valid, vec);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (XT == static_cast<int>(FType::kF32)) {
      v[2 * k] = __uint_as_float(r.w[2 * k]);
      v[2 * k + 1] = __uint_as_float(r.w[2 * k + 1]);
    } else if constexpr (XT == static_cast<int>(FType::kBF16)) {
      v[2 * k] = __uint_as_float(r.w[k] << 16);
      v[2 * k + 1] = __uint_as_float(r.w[k] & 0xFFFF0000u);
    } else {
      __half2 h;
      memcpy(&h, &r.w[k], 4);
      const float2 f = __half22float2(h);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  }
}

// A code table over a uniform grid of the rotated coordinate y: cell c (c < kLutCells) holds the y
// that round to c - kLutCells / 2 on the scale kLutScale per unit, y in [-1.07, 1.06] (a unit
// vector's coordinates) in cells 1 .. kLutCells - 2; the last cell is a NaN's. Entry c: the number
// of boundaries below the cell and the one boundary inside it (+inf: none). Where the boundaries
// lie at least a cell apart (no cell holds two), code = count + (boundary < y): bucketize16's code
// except where y lies within float rounding of a cell edge and a boundary (a tie).
constexpr int kLutCells = 256;
constexpr float kLutScale = 119.0f;
constexpr float kLutRound = 12582912.0f + kLutCells / 2;  // 1.5 x 2^23: the FFMA rounds to an integer in the low bits
constexpr float kLutEdge = -0.5f;  // cell c holds y kLutScale in [c - kLutCells / 2 + edge, + 1)
// The 8x table of tq_hadamard_mma_kernel: the FFMA rounds 8 y kLutScale, whose low bits masked by
// 8 (kLutCells - 1) are cell c's byte offset, c = floor(round(8 y kLutScale) / 8) + kLutCells / 2.
constexpr float kLutRound8 = 12582912.0f + 8 * (kLutCells / 2);
constexpr float kLutEdge8 = -1.0f / 16;

// Fills lut (kLutCells entries) for the boundaries bnd (16, ascending, +inf padded) in units of
// `unit` per y; returns whether every two boundaries lie at least a cell apart (else the table is
// not exact and bucketize_fit must serve).
__device__ __forceinline__ bool fill_code_lut(uint2* lut, const float* bnd, float unit, int tid, int nthreads,
                                              float edge = kLutEdge, float cells_per_unit = kLutScale) {
  for (int c = tid; c < kLutCells; c += nthreads) {
    const float lo = unit * ((c - kLutCells / 2 + edge) / cells_per_unit);
    const float hi = unit * ((c - kLutCells / 2 + edge + 1.0f) / cells_per_unit);
    uint32_t below = 0;
    float inside = INFINITY;
    for (int i = 0; i < 15; ++i) {
      const float b = bnd[i];
      if (b < lo) ++below;
      else if (b < hi && inside == INFINITY) inside = b;
    }
    const bool nan_cell = c == kLutCells - 1;  // a NaN's cell: code 0, as the search gives
    lut[c] = make_uint2(nan_cell ? 0u : below, __float_as_uint(nan_cell ? INFINITY : inside));
  }
  bool apart = true;
  for (int i = 0; i + 1 < 15; ++i) apart &= !(bnd[i + 1] - bnd[i] < unit / cells_per_unit);
  return apart;
}

// The code of z (y in units of `unit`: scale = kLutScale / unit) from the table. A NaN (the
// FFMA's canonical 0x7FFFFFFF) reads the last cell, past any unit vector's coordinate, which holds
// code 0 (bucketize16's for a NaN).
__device__ __forceinline__ uint32_t lut_code(float z, const uint2* lut, float scale) {
  const uint2 e = lut[__float_as_uint(fmaf(z, scale, kLutRound)) & (kLutCells - 1)];
  return e.x + (__uint_as_float(e.y) < z ? 1u : 0u);
}

// Codes of a lane's chunk of 8 (x[8 ch ..]) packed as their 8-code group word (format.h: LSB first),
// the last code first: group = group * 2^bits + code (one IMAD per code).
template <bool LUT, int C>
__device__ __forceinline__ uint32_t chunk_group(const float (&x)[C], int ch, int bits, const uint2* lut, float scale,
                                                const float* bnd, float b3, float b7, float b11) {
  const uint32_t radix = 1u << bits;
  uint32_t group = 0;
#pragma unroll
  for (int e = 7; e >= 0; --e) {
    const float z = x[8 * ch + e];
    group = group * radix + (LUT ? lut_code(z, lut, scale) : bucketize_fit(z, bnd, b3, b7, b11));
  }
  return group;
}

// perm_s[i] = (D2 = -1 at bit 31) | perm[i], filled by the CTA; returns the lane's D1 signs: bit
// 8 ch + e for its coordinate (ch, e) (quad lane g).
template <int D>
__device__ __forceinline__ uint32_t load_quad_rotation(const GemmParams& p, uint32_t* perm_s, int tid, int g) {
  using Q = QuadLayout<D>;
  for (int i = tid; i < D; i += kQuadWarps * 32) {
    const uint32_t w = static_cast<uint32_t>(__ldg(p.rot_spec + i));
    perm_s[i] = (rot_neg2(w) ? 0x80000000u : 0u) | static_cast<uint32_t>(rot_perm(w) & (D - 1));
  }
  uint32_t neg1 = 0;
#pragma unroll
  for (int ch = 0; ch < Q::kChunks; ++ch)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (rot_neg1(static_cast<uint32_t>(__ldg(p.rot_spec + Q::coord(ch, g, e))))) neg1 |= 1u << (8 * ch + e);
  return neg1;
}

// Row n's z = d Pi x / ||x|| in the quad layout (lane g of its quad), returning ||x||: the norm
// (the scaled re-read where the sum of squares leaves its safe range); u = D1 x / ||x||; H u, the
// permutation P with D2 through the row's shared copy row_s (D + 4 floats), H again. The two
// 1 / sqrt(d) of Pi are left out: z is d times the unit rotated vector (an exact scaling). !valid:
// zeros in, zeros out.
template <int D, int XT>
__device__ __forceinline__ float quad_unit_rotated(const GemmParams& p, int64_t n, bool valid, int g, int lane,
                                                   uint32_t neg1, const uint32_t* perm_s, float* row_s,
                                                   float (&x)[D / 4]) {
  using Q = QuadLayout<D>;
  constexpr int C = Q::kCoords, CH = Q::kChunks;
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
    float c8[8];
    load8_as_float<XT>(p.x, n * D + Q::coord(ch, g, 0), valid, p.vec_io, c8);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[8 * ch + e] = c8[e];
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < C; ++j) ss = fmaf(x[j], x[j], ss);
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);  // the same sum in the quad's 4 lanes
  ss += __shfl_xor_sync(0xffffffffu, ss, 2);
  float nrm = sqrtf(ss);
  if (valid && needs_scaled_norm(ss)) {  // the quad takes it together
    const float scaled = scaled_row_norm<D, 4>(p.x, p.dtype, n, g);
    if (scaled >= 0.f) nrm = scaled;
  }
  nrm = stored_norm(nrm);
  const float inv = nrm > 0.f ? 1.0f / nrm : 0.f;
#pragma unroll
  for (int j = 0; j < C; ++j) x[j] = flip_sign(x[j], (neg1 << (31 - j)) & 0x80000000u) * inv;
  quad_fwht<D>(x, lane);
  __syncwarp();  // the previous rows' reads of row_s are done
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
    float4* dst = reinterpret_cast<float4*>(row_s + Q::coord(ch, g, 0));
    dst[0] = make_float4(x[8 * ch], x[8 * ch + 1], x[8 * ch + 2], x[8 * ch + 3]);
    dst[1] = make_float4(x[8 * ch + 4], x[8 * ch + 5], x[8 * ch + 6], x[8 * ch + 7]);
  }
  __syncwarp();
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 t = *reinterpret_cast<const uint4*>(perm_s + Q::coord(ch, g, 4 * h));
      const uint32_t tw[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) x[8 * ch + 4 * h + k] = flip_sign(row_s[tw[k] & (D - 1)], tw[k] & 0x80000000u);
    }
  }
  quad_fwht<D>(x, lane);
  return nrm;
}

// The quad's stores of row n: its code groups (lane g's chunks) at dest row `row` (>= 0), the norm
// slot, and write_cache's window row bf16(||x|| z / d).
template <int D>
__device__ __forceinline__ void store_quad_row(const GemmParams& p, int64_t n, bool valid, int64_t row, int g,
                                               const uint32_t (&groups)[D / 32], float slot, float nrm,
                                               const float (&x)[D / 4]) {
  using Q = QuadLayout<D>;
  constexpr int CH = Q::kChunks;
  const int bits = p.bits, pb = D * bits / 8;
  if (row >= 0) {
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) store_group(p.codes + row * pb + (4 * ch + g) * bits, groups[ch], bits);
  }
  if (row >= 0 && g == 0) p.norms[row] = slot;
  if (p.win != nullptr && valid) {
    const int64_t wr = window_row(p, n);
    if (wr >= 0) {
      const float s = nrm * (1.0f / D);
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.win + wr * D);
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(s * x[8 * ch + e], s * x[8 * ch + e + 1]);
          uint32_t word;
          memcpy(&word, &pair, 4);
          dst[Q::coord(ch, g, e) / 2] = word;
        }
    }
  }
}

// f(n, valid) for the rows n = n0 + lane / 4 (valid: n < p.N) of each group n0 of 8 rows the warp
// takes: the grid's warps stride over p.N rows (persistent).
template <class F>
__device__ __forceinline__ void for_each_quad_row(const GemmParams& p, int warp, int lane, F&& f) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kQuadWarps * 8;
  for (int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kQuadWarps + warp) * 8; n0 < p.N; n0 += step) {
    const int64_t n = n0 + (lane >> 2);
    f(n, n < p.N);
  }
}

template <int D, int XT>
__global__ void __launch_bounds__(kQuadWarps * 32) tq_hadamard_quad_kernel(const GemmParams p0, const GemmParams p1) {
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  using Q = QuadLayout<D>;
  constexpr int C = Q::kCoords, CH = Q::kChunks;
  constexpr int kRow = D + 4;  // a row's copy: the 8 rows' 16-byte pieces fall on distinct banks
  __shared__ __align__(16) float bnd_s[16];     // d x the centroids' midpoints, +inf padded
  __shared__ __align__(16) uint32_t perm_s[D];  // D2[i] = -1 at bit 31 | perm[i]
  __shared__ __align__(16) float rows_s[kQuadWarps * 8][kRow];
  __shared__ uint2 lut_s[kLutCells];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane & 3;
  const int bits = p.bits;
  if (tid < 16) bnd_s[tid] = tid < (1 << bits) - 1 ? static_cast<float>(D) * centroid_boundary(p.cent, tid) : INFINITY;
  const uint32_t neg1 = load_quad_rotation<D>(p, perm_s, tid, g);
  __syncthreads();
  const bool lut = fill_code_lut(lut_s, bnd_s, static_cast<float>(D), tid, kQuadWarps * 32);
  __syncthreads();
  const float b3 = bnd_s[3], b7 = bnd_s[7], b11 = bnd_s[11], lut_scale = kLutScale / D;
  float* row_s = rows_s[warp * 8 + (lane >> 2)];
  for_each_quad_row(p, warp, lane, [&](int64_t n, bool valid) {
    float x[C];
    const float nrm = quad_unit_rotated<D, XT>(p, n, valid, g, lane, neg1, perm_s, row_s, x);
    const int64_t row = valid ? dest_row32(p, n) : -1;
    uint32_t groups[CH];
    if (lut) {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) groups[ch] = chunk_group<true>(x, ch, bits, lut_s, lut_scale, bnd_s, b3, b7, b11);
    } else {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
        groups[ch] = chunk_group<false>(x, ch, bits, lut_s, lut_scale, bnd_s, b3, b7, b11);
    }
    store_quad_row<D>(p, n, valid, row, g, groups, nrm, nrm, x);  // norm slot ||x|| (0 for a zero vector)
  });
}

// =============================================================================================
// The plain codec's write of Hadamard codecs (head_dim 64 / 128) from bf16 / f16 x on tensor
// cores (tq_hadamard_mma_kernel): z = M x with M = d Pi, whose entries are integers of magnitude
// <= d (exact in bf16 and f16), one MMA per k16 step; a warp takes 16 rows at a time.
// =============================================================================================
constexpr int kMmaWriteWarps = 16;

// Row of M (an output coordinate) in m16 tile `mt` (< 4) of pass `pass` (coordinates 64 pass ..),
// fragment row m (< 16): lane g's rows m = g, g + 8 of the four tiles are 64 pass + 8 g .. + 7.
__device__ __forceinline__ int mma_write_coord(int pass, int mt, int m) {
  return 64 * pass + 8 * (m & 7) + 2 * mt + (m >> 3);
}

// M's A fragments in shared memory: fragment f = ((pass KC + j) 2 + s) 4 + mt (k16 step s of
// k chunk j), lane l's 16 bytes at (32 f + l) x 16: words {M[g][k0, k0 + 1], M[g + 8][k0, ..],
// M[g][k0 + 2, k0 + 3], M[g + 8][k0 + 2, ..]} of the tile's rows, k0 = 32 j + 8 t + 4 s (the
// fragment's logical columns 2 t, 2 t + 8 in the k order of the B loads). In XT's 16-bit type
// (exact).
template <int D, int XT, int THREADS>
__device__ __forceinline__ void stage_hadamard_fragments(const float* rot, uint4* frag, int tid) {
  constexpr int KC = D / 32, kFrags = (D / 64) * KC * 2 * 4 * 32, kPer = kFrags / THREADS;
  static_assert(kFrags % THREADS == 0, "staging split");
  float4 v[kPer][2];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid + i * THREADS, l = e & 31, f = e >> 5;
    const int mt = f & 3, s = (f >> 2) & 1, j = (f >> 3) % KC, pass = (f >> 3) / KC;
    const int g = l >> 2, t = l & 3, k0 = 32 * j + 8 * t + 4 * s;
    v[i][0] = __ldg(reinterpret_cast<const float4*>(rot + mma_write_coord(pass, mt, g) * D + k0));
    v[i][1] = __ldg(reinterpret_cast<const float4*>(rot + mma_write_coord(pass, mt, g + 8) * D + k0));
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const float4 a = v[i][0], b = v[i][1];
    auto pair = [](float x, float y) {
      if constexpr (XT == static_cast<int>(FType::kBF16)) return bf2_bits(__floats2bfloat162_rn(D * x, D * y));
      else return h2_bits(__floats2half2_rn(D * x, D * y));
    };
    frag[tid + i * THREADS] = make_uint4(pair(a.x, a.y), pair(b.x, b.y), pair(a.z, a.w), pair(b.z, b.w));
  }
}

// Sums of squares of lane (g, t)'s rows g of the tile's two halves, the same in the quad's 4 lanes: the
// diagonals of the Gram products X X^T (A = both halves' rows from the B fragments' own words: rows g
// and 8 + g; B = one half), one MMA per half and k16 step; the diagonal entry of row v of half h sits
// in lane (v, v / 2), element 2 h + v % 2, and a shuffle hands it to the quad.
template <int D, int XT>
__device__ __forceinline__ float2 tile_sums_of_squares(const XRaw<XT, 8> (&x)[2][D / 32], int g) {
  float gram[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t a0 = x[0][j].w[2 * s], a1 = x[1][j].w[2 * s], a2 = x[0][j].w[2 * s + 1], a3 = x[1][j].w[2 * s + 1];
        if constexpr (XT == static_cast<int>(FType::kBF16)) mma_bf16(gram[h], a0, a1, a2, a3, x[h][j].w[2 * s], x[h][j].w[2 * s + 1]);
        else mma_f16(gram[h], a0, a1, a2, a3, x[h][j].w[2 * s], x[h][j].w[2 * s + 1]);
      }
  const int diag = 4 * g + (g >> 1);
  const float d0 = (g & 1) ? gram[0][1] : gram[0][0], d1 = (g & 1) ? gram[1][3] : gram[1][2];
  return make_float2(__shfl_sync(0xFFFFFFFFu, d0, diag), __shfl_sync(0xFFFFFFFFu, d1, diag));
}

// x <- x 2^-32 (bf16 pairs; exact but for elements below 2^-94, which cannot matter next to a norm
// above 2^100).
template <int KC>
__device__ __forceinline__ void scale_down_bf16(XRaw<static_cast<int>(FType::kBF16), 8> (&x)[KC]) {
  const __nv_bfloat162 s = __floats2bfloat162_rn(0x1p-32f, 0x1p-32f);
#pragma unroll
  for (int j = 0; j < KC; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      __nv_bfloat162 h;
      memcpy(&h, &x[j].w[k], 4);
      x[j].w[k] = bf2_bits(__hmul2(h, s));
    }
}

// bf16(||x|| z / d) of an 8-coordinate group of z into window row wrow.
template <int D>
__device__ __forceinline__ void store_window_group(uint16_t* win, int64_t wrow, int group, float nrm,
                                                   const float (&z)[8]) {
  const float s = nrm * (1.0f / D);
  uint32_t* dst = reinterpret_cast<uint32_t*>(win + wrow * D + 8 * group);
#pragma unroll
  for (int e = 0; e < 8; e += 2) dst[e / 2] = bf2_bits(__floats2bfloat162_rn(s * z[e], s * z[e + 1]));
}
// Shared memory of tq_hadamard_mma_kernel: M's fragments, then per warp two 16-row tiles of x
// (double buffer), rows of 2 d bytes at a stride of bt_stride_bytes(d) (two rows' 64-byte quarter-warp
// loads fall on distinct banks).
template <int D>
struct MmaWriteSmem {
  static constexpr int kFrags = (D / 64) * (D / 32) * 2 * 4 * 32;  // uint4 each
  static constexpr int kRowStride = bt_stride_bytes(D);
  static constexpr int kTile = 16 * kRowStride;
  static constexpr int kBytes = kFrags * 16 + kMmaWriteWarps * 2 * kTile;
};

// The warp's copies of tile `tile` (rows 16 tile .. + 15 of x, zeros past N) into dst: lane l copies
// piece l % P (16 bytes) of rows l / P + (32 / P) i (P pieces per row), at immediate offsets.
template <int D>
__device__ __forceinline__ void copy_x_tile(const GemmParams& p, int64_t tile, uint8_t* dst, int lane) {
  constexpr int kPieces = 2 * D / 16, kStep = 32 / kPieces;
  const int row0 = lane / kPieces, piece = lane % kPieces;
  const int64_t first = tile * 16 + row0, left = p.N - first;
  const uint8_t* src = static_cast<const uint8_t*>(p.x) + 16 * piece;
  src += first < p.N ? first * 2 * D : 0;
  dst += row0 * MmaWriteSmem<D>::kRowStride + 16 * piece;
#pragma unroll
  for (int i = 0; i < 16 / kStep; ++i) {
    const bool valid = kStep * i < left;  // src stays inside x: the rows past N are not read
    cp_async16_zfill(dst + kStep * i * MmaWriteSmem<D>::kRowStride, valid ? src + kStep * i * 2 * D : src, valid ? 16 : 0);
  }
}

// Lane (g, t)'s B fragments of a tile's two 8-row halves h from shared memory: row 8 h + g at
// k = 32 j + 8 t .. + 7 (the k order of the staged A fragments).
template <int D, int XT>
__device__ __forceinline__ void load_b_fragments(const uint8_t* tile_s, int g, int t, XRaw<XT, 8> (&x)[2][D / 32]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const uint4 w = *reinterpret_cast<const uint4*>(tile_s + (8 * h + g) * MmaWriteSmem<D>::kRowStride +
                                                      2 * (32 * j + 8 * t));
      x[h][j].w[0] = w.x;
      x[h][j].w[1] = w.y;
      x[h][j].w[2] = w.z;
      x[h][j].w[3] = w.w;
    }
}

// The slot that lane v < 16 reads for row base + v (slots), lane 16 + v for its window (win_slots); -1
// where there is none to read. Loaded a tile ahead, it leaves its latency to the tile before.
__device__ __forceinline__ int32_t tile_row_slot(const GemmParams& p, int64_t base, int lane) {
  const int64_t mine = base + (lane & 15);
  if (mine >= p.N) return -1;
  if (lane < 16) return p.slots != nullptr ? p.slots[static_cast<uint32_t>(mine) / static_cast<uint32_t>(p.Hkv)] : 0;
  return p.win != nullptr ? p.win_slots[mine / p.Hkv] : -1;
}

// Lane v < 16's pool row of row base + v, lane 16 + v's window row of it (-1: none), from the slot
// that tile_row_slot gave the lane, for the tensor-core writes' 16-row tiles (shuffled to the lanes
// that code the row).
__device__ __forceinline__ int32_t tile_row_of_slot(const GemmParams& p, int64_t base, int lane, int32_t slot) {
  const int64_t mine = base + (lane & 15);
  if (mine >= p.N) return -1;
  if (lane < 16) return static_cast<int32_t>(p.slots != nullptr ? dest_row32_of_slot(p, mine, slot) : mine);
  return p.win != nullptr ? static_cast<int32_t>(window_row_of_slot(p, mine, slot)) : -1;
}

__device__ __forceinline__ int32_t tile_row_slots(const GemmParams& p, int64_t base, int lane) {
  return tile_row_of_slot(p, base, lane, tile_row_slot(p, base, lane));
}

// group + (boundary < z ? one : 0) as one predicated add (nvcc makes the plain expression an add and
// a select).
__device__ __forceinline__ uint32_t plus_if_below(uint32_t group, float boundary, float z, uint32_t one = 1u) {
  asm("{\n .reg .pred above;\n setp.lt.f32 above, %1, %2;\n @above add.u32 %0, %0, %3;\n}"
      : "+r"(group) : "f"(boundary), "f"(z), "r"(one));
  return group;
}

// The code word of 8 coordinates from the 8x code table (kLutEdge8 cells): the last code first,
// group = group radix + code (radix = 2^bits).
__device__ __forceinline__ uint32_t lut8_group(const float (&z)[8], const uint2* lut, float scale8, uint32_t radix) {
  uint32_t group = 0;
#pragma unroll
  for (int e = 7; e >= 0; --e) {
    const uint32_t off = __float_as_uint(fmaf(z[e], scale8, kLutRound8)) & ((kLutCells - 1) * 8);
    const uint2 c = *reinterpret_cast<const uint2*>(reinterpret_cast<const char*>(lut) + off);
    group = plus_if_below(group * radix + c.x, __uint_as_float(c.y), z[e]);
  }
  return group;
}

// The plain write of Hadamard codecs (head_dim 64 / 128) from bf16 / f16 x on tensor cores.
// M = d Pi = H D2 P H D1 has integer entries of magnitude <= d, exact in bf16 and f16, so
// z = M x / ||x|| (tq_hadamard_quad_kernel's z: d times the unit rotated vector) takes ONE MMA per
// k16 step, with exact products and fp32 sums. A = M's fragments, staged once per CTA in fragment
// order (one 16-byte load per fragment); B = a warp's tile of 16 rows of x (cp.async, double
// buffered), lane (g, t) reading row g of each 8-row half at k = 32 j + 8 t .. + 7 (the k order of
// the staged A). M's rows are staged in an order that leaves lane (g, t), for rows 2 t and 2 t + 1
// of each half, the coordinates 8 g .. 8 g + 7 of each pass (64 coordinates): whole 8-code groups,
// coded from the 8x table (lut8_group) with no exchange. Norms: the sums of squares from Gram MMAs
// (tile_sums_of_squares), then quad_row_norms' rule (the scaled re-read where a sum leaves its safe
// range); a row whose norm exceeds 2^100 enters the product scaled by 2^-32 (exact) so that no
// fp32 sum overflows. Lane v < 16 finds tile row v's pool row, lane 16 + v its window row, and
// shuffles hand them out.
template <int D, int XT>
__global__ void __launch_bounds__(kMmaWriteWarps * 32, 1) tq_hadamard_mma_kernel(const GemmParams p0,
                                                                                   const GemmParams p1) {
  static_assert(XT != static_cast<int>(FType::kF32), "bf16 / f16 x: exact MMA operands");
  using S = MmaWriteSmem<D>;
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  constexpr int KC = D / 32, PASSES = D / 64, kThr = kMmaWriteWarps * 32;
  constexpr bool BF16 = XT == static_cast<int>(FType::kBF16);
  constexpr unsigned kAll = 0xFFFFFFFFu;
  extern __shared__ uint4 mma_write_smem[];
  uint4* frag_s = mma_write_smem;
  __shared__ __align__(16) float bnd_s[16];  // d x the centroids' midpoints, +inf padded
  __shared__ uint2 lut_s[kLutCells];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  uint8_t* x_s = reinterpret_cast<uint8_t*>(frag_s + S::kFrags) + warp * 2 * S::kTile;
  const int64_t ntiles = (p.N + 15) / 16, stride = static_cast<int64_t>(gridDim.x) * kMmaWriteWarps;
  int64_t tile = static_cast<int64_t>(blockIdx.x) * kMmaWriteWarps + warp;
  if (tile < ntiles) copy_x_tile<D>(p, tile, x_s, lane);  // in flight during the staging below
  cp_async_commit();
  const int bits = p.bits, pb = D * bits / 8;
  if (tid < 16) bnd_s[tid] = tid < (1 << bits) - 1 ? static_cast<float>(D) * centroid_boundary(p.cent, tid) : INFINITY;
  stage_hadamard_fragments<D, XT, kThr>(p.rot, frag_s, tid);
  __syncthreads();
  const bool lut = fill_code_lut(lut_s, bnd_s, static_cast<float>(D), tid, kThr, kLutEdge8);
  __syncthreads();
  const float b3 = bnd_s[3], b7 = bnd_s[7], b11 = bnd_s[11], lut_scale8 = 8.0f * kLutScale / D;
  uint32_t radix;
  asm("mov.u32 %0, %1;" : "=r"(radix) : "r"(1u << bits));  // group * radix + code: one IMAD
  for (int buf = 0; tile < ntiles; tile += stride, buf ^= 1) {
    if (tile + stride < ntiles) copy_x_tile<D>(p, tile + stride, x_s + (buf ^ 1) * S::kTile, lane);
    cp_async_commit();
    const int32_t where = tile_row_slots(p, tile * 16, lane);
    cp_async_wait<1>();
    __syncwarp();
    XRaw<XT, 8> x[2][KC];
    load_b_fragments<D, XT>(x_s + buf * S::kTile, g, t, x);
    __syncwarp();  // the buffer is refilled by the next iteration's copies
    const int64_t r[2] = {tile * 16 + g, tile * 16 + 8 + g};
    float2 ss = tile_sums_of_squares<D, XT>(x, g);
    const float2 nn = quad_norms_of_sums<D>(ss.x, ss.y, r[0] < p.N, r[1] < p.N, p.x, p.dtype, r[0], r[1], t);
    const bool big[2] = {BF16 && nn.x > 0x1p100f, BF16 && nn.y > 0x1p100f};  // x enters scaled by 2^-32
    const float inv[2] = {(nn.x > 0.f ? 1.0f / nn.x : 0.f) * (big[0] ? 0x1p32f : 1.f),
                          (nn.y > 0.f ? 1.0f / nn.y : 0.f) * (big[1] ? 0x1p32f : 1.f)};  // z = acc * inv
    if constexpr (BF16) {
      if (__any_sync(kAll, big[0] || big[1])) {  // rare
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (big[h]) scale_down_bf16<KC>(x[h]);
      }
    }
    // What lane (g, t) codes: row 2 t + i of half h, held (norm, scale) by lane 4 (2 t + i).
    int32_t dest[2][2], wrow[2][2];
    float nrm[2][2], scale[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int v = 2 * t + i, src = 4 * v;
        dest[h][i] = __shfl_sync(kAll, where, 8 * h + v);
        wrow[h][i] = __shfl_sync(kAll, where, 16 + 8 * h + v);
        nrm[h][i] = __shfl_sync(kAll, h == 0 ? nn.x : nn.y, src);
        scale[h][i] = __shfl_sync(kAll, inv[h], src);
      }
    float acc[2][4][4];
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) acc[h][mt][0] = acc[h][mt][1] = acc[h][mt][2] = acc[h][mt][3] = 0.f;
#pragma unroll
      for (int j = 0; j < KC; ++j)
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            const uint4 a = frag_s[((((pass * KC + j) * 2 + s) * 4 + mt) << 5) + lane];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if constexpr (BF16) mma_bf16(acc[h][mt], a.x, a.y, a.z, a.w, x[h][j].w[2 * s], x[h][j].w[2 * s + 1]);
              else mma_f16(acc[h][mt], a.x, a.y, a.z, a.w, x[h][j].w[2 * s], x[h][j].w[2 * s + 1]);
            }
          }
      auto code_rows = [&](auto table) {
        constexpr bool kLut = decltype(table)::value;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int i = 0; i < 2; ++i) {  // accumulator column 2 t + i: rows m = g (c[i]), g + 8 (c[2 + i])
            float z[8];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
              z[2 * mt] = acc[h][mt][i] * scale[h][i];
              z[2 * mt + 1] = acc[h][mt][2 + i] * scale[h][i];
            }
            const uint32_t word = kLut ? lut8_group(z, lut_s, lut_scale8, radix)
                                       : chunk_group<false, 8>(z, 0, bits, lut_s, 0.f, bnd_s, b3, b7, b11);
            if (dest[h][i] >= 0) store_group(p.codes + static_cast<int64_t>(dest[h][i]) * pb + (8 * pass + g) * bits, word, bits);
            if (wrow[h][i] >= 0) store_window_group<D>(p.win, wrow[h][i], 8 * pass + g, nrm[h][i], z);
          }
      };
      if (lut) code_rows(std::true_type{});
      else code_rows(std::false_type{});
    }
    if (g == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (dest[h][i] >= 0) p.norms[dest[h][i]] = nrm[h][i];  // 0 for a zero vector
    }
  }
  cp_async_wait<0>();
}

// =============================================================================================
// The same write on Hopper's warpgroup MMA (tq_hadamard_wgmma_kernel, sm_90a): a warpgroup takes 64
// rows at a time, and the tensor cores read both operands from shared memory (x's tile and M, in
// wgmma.cuh's 128-byte swizzle), so that no register holds an operand of the product and the
// product of one 64-coordinate chunk runs while the warp codes the one before.
// =============================================================================================
constexpr int kWgmmaWriteGroups = 4;  // warpgroups per CTA

// Output coordinate of M's staged row n: chunk c = n / 64 of 64 coordinates; within it, row
// 8 j + 2 t + i lands in accumulator d[j][i] (and d[j][2 + i]) of lane (g, t), and is the coordinate
// 8 (2 t + j / 4) + 2 (j % 4) + i: lane t holds whole 8-code groups 2 t and 2 t + 1 of the chunk.
__device__ __forceinline__ int wgmma_write_coord(int n) {
  const int c = n >> 6, j = (n >> 3) & 7, t = (n >> 1) & 3, i = n & 1;
  return 64 * c + 8 * (2 * t + (j >> 2)) + 2 * (j & 3) + i;
}

// Byte offset of 16-byte chunk `chunk` (k = 8 chunk ..) of row r in a K-major swizzled tile of
// `rows` rows (wgmma.cuh): blocks of 64 k, 128-byte rows, chunk c of a block at c ^ (r % 8).
__device__ __forceinline__ int sw128_offset(int rows, int r, int chunk) {
  return (chunk >> 3) * (rows * 128) + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
}

// Shared memory of tq_hadamard_wgmma_kernel: M (D rows of D k, K-major swizzled), then per
// warpgroup two 64-row tiles of x (double buffer); 1024 bytes of slack for the alignment.
template <int D>
struct WgmmaWriteSmem {
  static constexpr int kM = D * D * 2;
  static constexpr int kTile = 64 * D * 2;
  static constexpr int kBytes = 1024 + kM + kWgmmaWriteGroups * 2 * kTile;
};

// M = d Pi in XT's 16-bit type into m_s: row n = M's row wgmma_write_coord(n). A thread issues all
// its loads before its first conversion (one latency, not one per chunk).
template <int D, int XT, int THREADS>
__device__ __forceinline__ void stage_hadamard_b(const float* rot, uint8_t* m_s, int tid) {
  constexpr int kChunks = D * D / 8, kPer = kChunks / THREADS;
  static_assert(kChunks % THREADS == 0, "whole rounds of chunks");
  float4 a[kPer], b[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid + i * THREADS, n = e / (D / 8), chunk = e % (D / 8);
    const float* src = rot + wgmma_write_coord(n) * D + 8 * chunk;
    a[i] = __ldg(reinterpret_cast<const float4*>(src));
    b[i] = __ldg(reinterpret_cast<const float4*>(src + 4));
  }
  auto pair = [](float x, float y) {
    if constexpr (XT == static_cast<int>(FType::kBF16)) return bf2_bits(__floats2bfloat162_rn(D * x, D * y));
    else return h2_bits(__floats2half2_rn(D * x, D * y));
  };
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid + i * THREADS, n = e / (D / 8), chunk = e % (D / 8);
    *reinterpret_cast<uint4*>(m_s + sw128_offset(D, n, chunk)) =
        make_uint4(pair(a[i].x, a[i].y), pair(a[i].z, a[i].w), pair(b[i].x, b[i].y), pair(b[i].z, b[i].w));
  }
}

// Warp w's copies of its 16 rows (16 w ..) of 64-row tile `tile` of x into the swizzled tile x_s
// (zeros past N): lane l copies chunk l % (D / 8) of rows l / (D / 8) + (256 / D) i.
template <int D>
__device__ __forceinline__ void copy_x_rows(const GemmParams& p, int64_t tile, uint8_t* x_s, int warp, int lane) {
  constexpr int kChunks = D / 8, kStep = 32 / kChunks;
  const int chunk = lane % kChunks, r0 = 16 * warp + lane / kChunks;
  const int64_t first = tile * 64 + r0, left = p.N - first;
  const uint8_t* x = static_cast<const uint8_t*>(p.x) + 16 * chunk;
  if (tile * 64 + 16 * warp + 16 <= p.N) {  // all 16 rows exist (every tile but the last): immediate offsets
    // Row r0 + kStep i's chunk position is (chunk ^ r0 ^ kStep i) % 8 (r0 % 8 < kStep: no carry), an XOR
    // on address bits 4-6 of row r0's copy.
    const uint32_t row0 = smem_addr(x_s) + sw128_offset(64, r0, chunk);
#pragma unroll
    for (int i = 0; i < 16 / kStep; ++i)
      cp_async16_at((row0 ^ (((kStep * i) & 7) << 4)) + kStep * i * 128, x + (first + kStep * i) * 2 * D);
    return;
  }
  const uint8_t* src = x + (first < p.N ? first * 2 * D : 0);
#pragma unroll
  for (int i = 0; i < 16 / kStep; ++i) {
    const bool valid = kStep * i < left;
    cp_async16_zfill(x_s + sw128_offset(64, r0 + kStep * i, chunk), valid ? src + kStep * i * 2 * D : src,
                     valid ? 16 : 0);
  }
}

// Byte offset in the swizzled tile of lane (g, t)'s 16-byte piece j of row r = 16 w + 8 h + g for
// tile_sums_of_squares: chunk (4 j + t) ^ 4 (g % 2), so that a quarter warp's 8 loads fall on
// distinct banks (the sums do not care which lane holds which k).
__device__ __forceinline__ int gram_piece_offset(int r, int j, int g, int t) {
  return sw128_offset(64, r, (4 * j + t) ^ (4 * (g & 1)));
}

// The 4x table of tq_hadamard_wgmma_kernel: 4-byte entries, the cell's boundary (or FLT_MAX: none)
// with its count of boundaries below in the 4 low bits (which move the boundary by < 16 ulp, far
// inside a tie), and 56 cells per unit y, so that a unit vector's coordinates (sigma = d^-1/2) fall
// in some 35 cells around 0 at head_dim 128: a warp's 32 loads mostly meet 32 distinct banks. The
// FFMA rounds 4 y kLutScale4, whose low bits masked by 4 (kLutCells - 1) are cell c's byte offset,
// c = floor(round(4 y kLutScale4) / 4) + kLutCells / 2. The cells are narrower than the boundaries'
// gaps of every plain codebook at head_dim 64 / 128 (4 bits at 128: 0.0227; a cell 0.0179), which
// fill_code_lut checks.
constexpr float kLutScale4 = 56.0f;
constexpr float kLutRound4 = 12582912.0f + 4 * (kLutCells / 2);
constexpr float kLutEdge4 = -1.0f / 8;

// The 4-byte entries of the table lut (fill_code_lut's) into lut4.
__device__ __forceinline__ void pack_code_lut4(uint32_t* lut4, const uint2* lut, int tid, int nthreads) {
  for (int c = tid; c < kLutCells; c += nthreads) {
    const uint2 e = lut[c];
    // -0 as +0 (else the count in the low bits makes it a negative denormal, below a z of 0)
    const uint32_t b = __uint_as_float(e.y) == INFINITY ? __float_as_uint(FLT_MAX) : (e.y << 1) == 0 ? 0u : e.y;
    lut4[c] = (b & ~15u) | e.x;
  }
}

// The code word of 8 coordinates from the 4x table, codes of BITS bits: the first code first, each
// entry's count (its low bits) funnelled into the top of the word as the word moves down by BITS (one
// SHF), plus one there where the entry's boundary lies below z. A code never reaches 2^BITS (a cell
// with a boundary inside counts one boundary less), so no field carries into the next.
template <int BITS>
__device__ __forceinline__ uint32_t lut4_group(const float (&z)[8], const uint32_t* lut4, float scale4) {
  uint32_t group = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t off = __float_as_uint(fmaf(z[e], scale4, kLutRound4)) & ((kLutCells - 1) * 4);
    const uint32_t c = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut4) + off);
    group = plus_if_below(__funnelshift_r(group, c, BITS), __uint_as_float(c), z[e], 1u << (32 - BITS));
  }
  return group >> (32 - 8 * BITS);
}

// Lane t's two adjacent code groups w0, w1 of a row (groups 2 t, 2 t + 1 of a quad's 8: bytes
// 2 t bits .. at dst, in a row that starts 4-byte aligned) stored where `valid` (the quad's 4 lanes
// call together: at 3 bits they exchange bytes, so that every store is an aligned word).
__device__ __forceinline__ void store_group_pair(uint8_t* dst, uint32_t w0, uint32_t w1, int bits, int t, bool valid) {
  if (bits == 4) {
    if (valid) {
      reinterpret_cast<uint32_t*>(dst)[0] = w0;
      reinterpret_cast<uint32_t*>(dst)[1] = w1;
    }
  } else if (bits == 2) {
    if (valid) *reinterpret_cast<uint32_t*>(dst) = (w0 & 0xFFFFu) | (w1 << 16);
  } else {  // 6 bytes at 6 t; even t: bytes 6 t .. + 3, then + 4, + 5 and lane t + 1's first two; odd t: 6 t + 2 .. + 5
    const uint64_t v = static_cast<uint64_t>(w0 & 0xFFFFFFu) | (static_cast<uint64_t>(w1 & 0xFFFFFFu) << 24);
    const uint32_t next = __shfl_xor_sync(0xFFFFFFFFu, static_cast<uint32_t>(v), 1);
    const bool even = (t & 1) == 0;
    if (valid) *reinterpret_cast<uint32_t*>(dst + (even ? 0 : 2)) = static_cast<uint32_t>(even ? v : v >> 16);
    if (valid && even) *reinterpret_cast<uint32_t*>(dst + 4) = static_cast<uint32_t>(v >> 32) | (next << 16);
  }
}

// Codes of lane (g, t)'s two 8-coordinate groups (2 t, 2 t + 1) of chunk `chunk` for its rows g (rh 0)
// and g + 8 (rh 1) of the warp's 16, from accumulator acc (z = acc scale), stored with their
// window rows (window: the warp has some). LUT: from the 4x table (lut4_group, BITS-bit codes), else
// the search (chunk_group, BITS 0: p.bits).
template <int D, bool LUT, int BITS>
__device__ __forceinline__ void code_wgmma_chunk(const GemmParams& p, const float (&acc)[8][4], int chunk, int t,
                                                 const float (&scale)[2], const float (&nrm)[2],
                                                 const int32_t (&dest)[2], const int32_t (&wrow)[2], bool window,
                                                 const uint32_t* lut4, float scale4,
                                                 const float* bnd_s, float b3, float b7, float b11) {
  static_assert(!LUT || BITS >= 2, "the table's codes: a width known at compile time");
  const int bits = BITS > 0 ? BITS : p.bits, pb = D * bits / 8;
  auto z_of = [&](int rh, int q, float (&z)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) z[e] = acc[4 * q + (e >> 1)][2 * rh + (e & 1)] * scale[rh];
  };
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    uint32_t words[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      float z[8];
      z_of(rh, q, z);
      if constexpr (LUT) words[q] = lut4_group<BITS>(z, lut4, scale4);
      else words[q] = chunk_group<false, 8>(z, 0, bits, nullptr, 0.f, bnd_s, b3, b7, b11);
    }
    store_group_pair(p.codes + static_cast<int64_t>(dest[rh]) * pb + (8 * chunk + 2 * t) * bits, words[0], words[1],
                     bits, t, dest[rh] >= 0);
  }
  if (window) {  // z again (the same products), so that no register holds it across the coding
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int q = 0; q < 2; ++q)
        if (wrow[rh] >= 0) {
          int32_t row = wrow[rh];
          asm volatile("" : "+r"(row));  // its address math stays here, not in every tile's path
          float z[8];
          z_of(rh, q, z);
          store_window_group<D>(p.win, row, 8 * chunk + 2 * t + q, nrm[rh], z);
        }
  }
}

// The plain write of Hadamard codecs (head_dim 64 / 128) from bf16 / f16 x, as
// tq_hadamard_mma_kernel (its M, norms, 2^-32 pre-scaling and codes) with the product z = M x
// on wgmma: warpgroup wg takes 64-row tiles (cp.async, double buffered; each warp copies and
// norms its own 16 rows), and per tile issues the D / 64 chunks' products (m64n64k16, A = the x
// tile, B = M, both swizzled in shared memory) as one commit group each, then codes chunk c once
// its group is done.
template <int D, int XT>
__global__ void __launch_bounds__(kWgmmaWriteGroups * 128, 1) tq_hadamard_wgmma_kernel(const GemmParams p0,
                                                                                         const GemmParams p1) {
  static_assert(XT != static_cast<int>(FType::kF32), "bf16 / f16 x: exact MMA operands");
#if JTQ_WGMMA
  using S = WgmmaWriteSmem<D>;
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  constexpr int KC = D / 32, CHUNKS = D / 64, kThr = kWgmmaWriteGroups * 128;
  constexpr bool BF16 = XT == static_cast<int>(FType::kBF16);
  constexpr unsigned kAll = 0xFFFFFFFFu;
  extern __shared__ uint8_t wgmma_write_smem[];
  uint8_t* m_s = wgmma_write_smem + ((1024 - (smem_addr(wgmma_write_smem) & 1023)) & 1023);
  __shared__ __align__(16) float bnd_s[16];  // d x the centroids' midpoints, +inf padded
  __shared__ uint2 lut_s[kLutCells];
  __shared__ uint32_t lut4_s[kLutCells];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  uint8_t* x_s = m_s + S::kM + wg * 2 * S::kTile;
  const int64_t ntiles = (p.N + 63) / 64, stride = static_cast<int64_t>(gridDim.x) * kWgmmaWriteGroups;
  int64_t tile = static_cast<int64_t>(blockIdx.x) * kWgmmaWriteGroups + wg;
  if (tile < ntiles) copy_x_rows<D>(p, tile, x_s, wq, lane);  // in flight during the staging below
  cp_async_commit();
  int32_t slot = tile < ntiles ? tile_row_slot(p, tile * 64 + 16 * wq, lane) : -1;
  float cent[2] = {0.f, 0.f};  // centroids tid, tid + 1: their loads in flight with the staging's
  if (tid < (1 << p.bits) - 1) cent[0] = __ldg(p.cent + tid), cent[1] = __ldg(p.cent + tid + 1);
  stage_hadamard_b<D, XT, kThr>(p.rot, m_s, tid);
  if (tid < 16) bnd_s[tid] = tid < (1 << p.bits) - 1 ? static_cast<float>(D) * centroid_boundary(cent, 0) : INFINITY;
  fence_async_shared();
  __syncthreads();
  const bool lut = fill_code_lut(lut_s, bnd_s, static_cast<float>(D), tid, kThr, kLutEdge4, kLutScale4);
  __syncthreads();
  pack_code_lut4(lut4_s, lut_s, tid, kThr);
  __syncthreads();
  const float b3 = bnd_s[3], b7 = bnd_s[7], b11 = bnd_s[11], scale4 = 4.0f * kLutScale4 / D;
  const uint64_t m_desc = sw128_desc(smem_addr(m_s), 16, 1024), x_desc0 = sw128_desc(smem_addr(x_s), 16, 1024);
  for (int buf = 0; tile < ntiles; tile += stride, buf ^= 1) {
    uint8_t* cur = x_s + buf * S::kTile;
    const int64_t base = tile * 64 + 16 * wq;  // the warp's 16 rows
    const int32_t this_slot = slot;
    if (tile + stride < ntiles) slot = tile_row_slot(p, base + 64 * stride, lane);
    cp_async_wait<0>();
    __syncwarp();
    XRaw<XT, 8> x[2][KC];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        const uint4 w = *reinterpret_cast<const uint4*>(cur + gram_piece_offset(16 * wq + 8 * h + g, j, g, t));
        x[h][j].w[0] = w.x;
        x[h][j].w[1] = w.y;
        x[h][j].w[2] = w.z;
        x[h][j].w[3] = w.w;
      }
    const int64_t r[2] = {base + g, base + 8 + g};
    const float2 ss = tile_sums_of_squares<D, XT>(x, g);
    const float2 nn = quad_norms_of_sums<D>(ss.x, ss.y, r[0] < p.N, r[1] < p.N, p.x, p.dtype, r[0], r[1], t);
    const bool big[2] = {BF16 && nn.x > 0x1p100f, BF16 && nn.y > 0x1p100f};  // x enters scaled by 2^-32
    const float scale[2] = {(nn.x > 0.f ? 1.0f / nn.x : 0.f) * (big[0] ? 0x1p32f : 1.f),
                            (nn.y > 0.f ? 1.0f / nn.y : 0.f) * (big[1] ? 0x1p32f : 1.f)};  // z = acc scale
    if constexpr (BF16) {
      if (__any_sync(kAll, big[0] || big[1])) {  // rare: the rows' copies in the tile scaled in place
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (big[h]) {
            scale_down_bf16<KC>(x[h]);
#pragma unroll
            for (int j = 0; j < KC; ++j)
              *reinterpret_cast<uint4*>(cur + gram_piece_offset(16 * wq + 8 * h + g, j, g, t)) =
                  make_uint4(x[h][j].w[0], x[h][j].w[1], x[h][j].w[2], x[h][j].w[3]);
          }
      }
    }
    fence_async_shared();
    warpgroup_barrier(wg);  // the tile's 64 rows are in place; every warp is done with the previous tile's
    if (tile + stride < ntiles) copy_x_rows<D>(p, tile + stride, x_s + (buf ^ 1) * S::kTile, wq, lane);
    cp_async_commit();
    float acc[CHUNKS][8][4];
    const uint64_t x_desc = desc_advance(x_desc0, buf * S::kTile);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        wgmma_m64n64k16_ss<BF16>(acc[c], desc_advance(x_desc, (ks >> 2) * (64 * 128) + (ks & 3) * 32),
                                 desc_advance(m_desc, (ks >> 2) * (D * 128) + c * (64 * 128) + (ks & 3) * 32), ks > 0);
      wgmma_commit();
    }
    // Lane (g, t) codes rows g (rh 0) and g + 8 (rh 1) of the warp's 16, whose norms it holds.
    const float nrm[2] = {nn.x, nn.y};
    const int32_t where = tile_row_of_slot(p, base, lane, this_slot);
    const int32_t dest[2] = {__shfl_sync(kAll, where, g), __shfl_sync(kAll, where, 8 + g)};
    const int32_t wrow[2] = {__shfl_sync(kAll, where, 16 + g), __shfl_sync(kAll, where, 24 + g)};
    const bool window = __any_sync(kAll, where >= 0 && lane >= 16);
    auto code = [&](auto table, auto width) {
      constexpr bool kLut = decltype(table)::value;
      constexpr int kBits = decltype(width)::value;
      if constexpr (CHUNKS == 2) {
        wgmma_wait<1>();
        fence_operands(acc[0]);
        code_wgmma_chunk<D, kLut, kBits>(p, acc[0], 0, t, scale, nrm, dest, wrow, window, lut4_s, scale4, bnd_s, b3, b7, b11);
      }
      wgmma_wait<0>();
      fence_operands(acc[CHUNKS - 1]);
      code_wgmma_chunk<D, kLut, kBits>(p, acc[CHUNKS - 1], CHUNKS - 1, t, scale, nrm, dest, wrow, window, lut4_s,
                                       scale4, bnd_s, b3, b7, b11);
    };
    if (!lut) code(std::false_type{}, std::integral_constant<int, 0>{});
    else if (p.bits == 4) code(std::true_type{}, std::integral_constant<int, 4>{});
    else if (p.bits == 2) code(std::true_type{}, std::integral_constant<int, 2>{});
    else code(std::true_type{}, std::integral_constant<int, 3>{});
    if (t == 0) {
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
        if (dest[rh] >= 0) p.norms[dest[rh]] = nrm[rh];  // 0 for a zero vector
    }
  }
  cp_async_wait<0>();
#else
  __trap();  // launch_hadamard_write takes this kernel only where it was built for sm_90a
#endif
}

// =============================================================================================
// The fitted scale's write of Hadamard codecs (head_dim 64 / 128) in the quad layout: z as the
// plain write's (quad_unit_rotated), then the fit (format.h "Fitted scale") against the
// boundaries d fl32(s_k b_i), walked across the candidates: as s_k grows, the code of z >= 0 can
// only fall and that of z < 0 only rise, by at most one per step wherever
// T_{k,i} <= T_{k-1,i+1} and T_{k-1,i} <= T_{k,i+1} (every codebook served: a CPU test; the CTA
// checks it and otherwise searches every candidate, bucketize_fit). A coordinate's code under
// candidate 0 comes from the code table (fill_code_lut), each next one from one 8-byte entry of
// walk_s (the threshold that moves the code one step, and the centroid it moves to) and one
// comparison, against bucketize_fit's ~16 instructions per candidate. The rotated rows wait in
// the warp's rows_s, one float per lane and coordinate (conflict-free), so that the coordinate
// loop need not be unrolled; the quad's 17 (<z, c>, |c|^2) reduce-scatter over its 4 lanes and
// the first best gain wins (group_best_fit); its codes by bucketize_fit, the norm slot
// ||x|| <z, c> / (d |c|^2).
// =============================================================================================

// walk_s[32 k + 2 q + up]: at candidate k, a code q moves to q - 1 (z >= 0, up = 0) where
// nextup(T_{k,q-1}) > |z| (T_{k,q-1} >= z), to q + 1 (z < 0, up = 1) where -T_{k,q} > |z|
// (T_{k,q} < z); .y the centroid it moves to. No such boundary: -inf (never moves). fit_tab: the
// d T_{k,i} of fill_fit_table. Returns, for the whole CTA, whether every step moves a code by one
// at most (else the walk is not exact).
__device__ __forceinline__ bool fill_fit_walk(float2* walk_s, const float* fit_tab, const float* cent, int ncent,
                                              int tid, int nthreads) {
  const int nb = ncent - 1;
  for (int e = tid; e < kFitCandidates * 32; e += nthreads) {
    const int k = e >> 5, q = (e >> 1) & 15;
    const bool up = (e & 1) != 0;
    float2 v = make_float2(-INFINITY, 0.f);
    if (!up && q >= 1 && q <= nb) v = make_float2(nextafterf(fit_tab[16 * k + q - 1], INFINITY), cent[q - 1]);
    if (up && q < nb) v = make_float2(-fit_tab[16 * k + q], cent[q + 1]);
    walk_s[e] = v;
  }
  bool one_step = true;
  for (int e = tid; e < kFitCandidates * 16; e += nthreads) {
    const int k = e >> 4, i = e & 15;
    if (k == 0 || i + 1 >= nb) continue;
    const float* now = fit_tab + 16 * k;
    const float* before = now - 16;
    one_step &= now[i] <= before[i + 1] && before[i] <= now[i + 1];
  }
  return __syncthreads_and(one_step) != 0;
}

// f(std::integral_constant<int, I>{}) for I = 0, 1, ... in order (a loop whose index is a constant).
template <int... I, class F>
__device__ __forceinline__ void for_each_index(std::integer_sequence<int, I...>, F&& f) {
  (f(std::integral_constant<int, I>{}), ...);
}

// The float2 at shared address addr + OFF bytes (one LDS.64 with its offset in the instruction).
template <int OFF>
__device__ __forceinline__ float2 load_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2 + %3];" : "=f"(v.x), "=f"(v.y) : "r"(addr), "n"(OFF));
  return v;
}

// e.x > w: at += step, c = e.y (two predicated instructions; the compiler's select and add are three).
__device__ __forceinline__ void step_if_greater(float2 e, float w, int step, uint32_t& at, float& c) {
  asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %2, %3;\n\t@p add.s32 %0, %0, %4;\n\t@p mov.f32 %1, %5;\n\t}"
      : "+r"(at), "+f"(c)
      : "f"(e.x), "f"(w), "r"(step), "f"(e.y));
}

// dot[k] += z c_k, sq[k] += c_k^2 with c_k the centroid of z's code under every candidate k, q0
// its code under candidate 0 (fill_fit_walk), for NZ coordinates (one loop iteration). A step's
// entry address hangs on the last step's comparison: ~6 instructions per step behind one shared
// load's latency (ptxas lays the NZ walks one after the other; the CTA's other warps hide it).
template <int NZ>
__device__ __forceinline__ void add_fit_sums_walk(const float (&z)[NZ], const uint32_t (&q0)[NZ], const float* cent_s,
                                                  const float2* walk_s, float (&dot)[kFitCandidates],
                                                  float (&sq)[kFitCandidates]) {
  float c[NZ], w[NZ];
  uint32_t at[NZ];  // shared address of the entry of candidate 0 that the walk sits at
  int step[NZ];     // bytes
#pragma unroll
  for (int i = 0; i < NZ; ++i) {
    c[i] = cent_s[q0[i]];
    dot[0] = fmaf(z[i], c[i], dot[0]);
    sq[0] = fmaf(c[i], c[i], sq[0]);
    const bool up = !(z[i] >= 0.f);  // a NaN walks up but never moves (no comparison holds)
    at[i] = static_cast<uint32_t>(__cvta_generic_to_shared(walk_s + 2 * q0[i] + (up ? 1 : 0)));
    step[i] = (up ? 2 : -2) * static_cast<int>(sizeof(float2));
    w[i] = fabsf(z[i]);
  }
  for_each_index(std::make_integer_sequence<int, kFitCandidates - 1>{}, [&](auto km1) {
    constexpr int k = decltype(km1)::value + 1;
#pragma unroll
    for (int i = 0; i < NZ; ++i) {
      const float2 e = load_shared_f2<32 * k * static_cast<int>(sizeof(float2))>(at[i]);
      step_if_greater(e, w[i], step[i], at[i], c[i]);
      dot[k] = fmaf(z[i], c[i], dot[k]);
      sq[k] = fmaf(c[i], c[i], sq[k]);
    }
  });
}

// The same sums by a search of every candidate's boundaries (fit_tab).
__device__ __forceinline__ void add_fit_sums_search(float z, const float* fit_tab, const float* cent_s,
                                                    float (&dot)[kFitCandidates], float (&sq)[kFitCandidates]) {
#pragma unroll
  for (int k = 0; k < kFitCandidates; ++k) {
    const float* tb = fit_tab + 16 * k;
    const float c = cent_s[bucketize_fit(z, tb, tb[3], tb[7], tb[11])];
    dot[k] = fmaf(z, c, dot[k]);
    sq[k] = fmaf(c, c, sq[k]);
  }
}

template <int D, int XT>
__global__ void __launch_bounds__(kQuadWarps * 32, 4) tq_hadamard_quad_fit_kernel(const GemmParams p0,
                                                                               const GemmParams p1) {
  const GemmParams p = blockIdx.z == 0 ? p0 : p1;
  using Q = QuadLayout<D>;
  constexpr int C = Q::kCoords, CH = Q::kChunks;
  constexpr int kRow = D + 4;
  constexpr int kWalks = 4;  // coordinates per iteration of the walk loop
  static_assert(8 * kRow >= 32 * C && C % kWalks == 0, "a warp's row copies hold its lanes' coordinates");
  __shared__ __align__(16) float fit_tab[kFitCandidates * 16];  // d fl32(s_k b_i), +inf padded
  __shared__ __align__(16) float2 walk_s[kFitCandidates * 32];
  __shared__ float cent_s[16];
  __shared__ __align__(16) uint32_t perm_s[D];
  __shared__ __align__(16) float rows_s[kQuadWarps * 8][kRow];
  __shared__ uint2 lut_s[kLutCells];  // candidate 0's codes
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane & 3;
  const int bits = p.bits, ncent = 1 << bits;
  if (tid < 16) cent_s[tid] = tid < ncent ? p.cent[tid] : 0.f;
  fill_fit_table(fit_tab, p.cent, ncent, tid, kQuadWarps * 32, static_cast<float>(D));
  const uint32_t neg1 = load_quad_rotation<D>(p, perm_s, tid, g);
  __syncthreads();
  const bool lut = fill_code_lut(lut_s, fit_tab, static_cast<float>(D), tid, kQuadWarps * 32);
  const bool walk = fill_fit_walk(walk_s, fit_tab, cent_s, ncent, tid, kQuadWarps * 32);  // syncs the CTA
  const float lut_scale = kLutScale / D, b3 = fit_tab[3], b7 = fit_tab[7], b11 = fit_tab[11];
  float* row_s = rows_s[warp * 8 + (lane >> 2)];
  float* zs = rows_s[warp * 8] + lane;  // coordinate j of the lane at zs[32 j]
  for_each_quad_row(p, warp, lane, [&](int64_t n, bool valid) {
    float x[C];
    const float nrm = quad_unit_rotated<D, XT>(p, n, valid, g, lane, neg1, perm_s, row_s, x);
    __syncwarp();  // the quad's reads of its row copy are done
#pragma unroll
    for (int j = 0; j < C; ++j) zs[32 * j] = x[j];
    float dot[kFitCandidates], sq[kFitCandidates];
#pragma unroll
    for (int k = 0; k < kFitCandidates; ++k) dot[k] = sq[k] = 0.f;
    if (walk) {
#pragma unroll 1
      for (int j = 0; j < C; j += kWalks) {
        float z[kWalks];
        uint32_t q0[kWalks];
#pragma unroll
        for (int i = 0; i < kWalks; ++i) {
          z[i] = zs[32 * (j + i)];
          q0[i] = lut ? lut_code(z[i], lut_s, lut_scale) : bucketize_fit(z[i], fit_tab, b3, b7, b11);
        }
        add_fit_sums_walk(z, q0, cent_s, walk_s, dot, sq);
      }
    } else {
#pragma unroll 1
      for (int j = 0; j < C; ++j) add_fit_sums_search(zs[32 * j], fit_tab, cent_s, dot, sq);
    }
    __syncwarp();  // x again from zs: not kept in registers across the loop
#pragma unroll
    for (int j = 0; j < C; ++j) x[j] = zs[32 * j];
    int best_k = 0;
    float pair_dot[scattered_pairs(kFitCandidates, 2)], pair_sq[scattered_pairs(kFitCandidates, 2)], ratio;
    reduce_scatter_pairs<kFitCandidates, 2>(dot, sq, lane, pair_dot, pair_sq, best_k);
    group_best_fit<4>(pair_dot, pair_sq, best_k, ratio);
    const float* tb = fit_tab + 16 * best_k;
    const float t3 = tb[3], t7 = tb[7], t11 = tb[11];
    uint32_t groups[CH];
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) groups[ch] = chunk_group<false>(x, ch, bits, lut_s, lut_scale, tb, t3, t7, t11);
    const int64_t row = valid ? dest_row32(p, n) : -1;
    store_quad_row<D>(p, n, valid, row, g, groups, nrm * (ratio * (1.0f / D)), nrm, x);  // 0 for a zero vector
  });
}

// The fitted-scale compress (tq_fit_kernel); p1: a second problem of p's N, head_dim and x dtype,
// run by grid.z = 1 of the same launch (nullptr: none).
template <int D, int VPT>
ffi::Error launch_fit_t(const char* op, cudaStream_t stream, const GemmParams& p, const GemmParams* p1) {
  using L = GemmLayout<D, VPT>;
  auto kernel = tq_fit_kernel<D, VPT>;
  constexpr int smem = L::total;
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return cuda_error(op, "shared memory attribute", e);
  const int64_t blocks = (p.N + L::MV - 1) / L::MV;
  if (blocks > 0x7FFFFFFF) return invalid(op, "too many vectors");
  const unsigned nz = p1 != nullptr ? 2u : 1u;
  kernel<<<dim3(static_cast<unsigned>(blocks), 1, nz), kThreads, smem, stream>>>(p, p1 ? *p1 : p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

// The fitted scale on tensor cores (tq_fit_mma_kernel, d <= 128). RF = rows fitted per CTA and
// unit: a small batch takes the smallest RF whose units still fit one CTA per SM (the fit of 16 rows
// is a CTA's longest phase, and every CTA stages the whole Pi); otherwise RF = 16 and a persistent
// grid of the occupancy's CTAs. p1: a second problem of p's N, head_dim and x dtype (grid.z = 1).
template <int D, int XT, int RF>
ffi::Error launch_fit_mma_t(const char* op, cudaStream_t stream, const GemmParams& p,
                            const GemmParams* p1) {
  using G = FitGeom<D>;
  constexpr int smem = FitLayout<D, RF>::total;
  auto kernel = tq_fit_mma_kernel<D, XT, RF>;
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return cuda_error(op, "shared memory attribute", e);
  static const KernelCfg cfg = occupancy_cfg(kernel, G::kThr, smem);
  if (cfg.err != cudaSuccess) return cuda_error(op, "kernel setup", cfg.err);
  const unsigned nz = p1 != nullptr ? 2u : 1u;
  const int64_t units = (p.N + 15) / 16 * (16 / RF);
  const int64_t cap = std::max<int64_t>(
      1, static_cast<int64_t>(cfg.blocks_per_sm) * sm_count() / nz);  // persistent grid
  const int64_t gx = std::min(units, cap);
  kernel<<<dim3(static_cast<unsigned>(gx), 1, nz), G::kThr, smem, stream>>>(p, p1 ? *p1 : p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

template <int D, int XT>
ffi::Error launch_fit_mma_d(const char* op, cudaStream_t stream, const GemmParams& p,
                            const GemmParams* p1) {
  const int64_t ntiles = (p.N + 15) / 16;
  const int64_t ctas = ntiles * (p1 != nullptr ? 2 : 1);  // units of RF = 16
  const int64_t sms = sm_count();
  if (4 * ctas <= sms) return launch_fit_mma_t<D, XT, 4>(op, stream, p, p1);
  if (2 * ctas <= sms) return launch_fit_mma_t<D, XT, 8>(op, stream, p, p1);
  return launch_fit_mma_t<D, XT, 16>(op, stream, p, p1);
}

template <int XT>
ffi::Error launch_fit_mma_x(const char* op, cudaStream_t stream, int d, const GemmParams& p,
                            const GemmParams* p1) {
  return with_value(SupportedHeadDims{}, d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if constexpr (D <= 128) return launch_fit_mma_d<D, XT>(op, stream, p, p1);
    else return unsupported_head_dim(op, d);
  }, [&] { return unsupported_head_dim(op, d); });
}

// The fitted scale of Hadamard codecs of head_dim 64 / 128 (p.rot_spec, and p1's): one warp per
// vector, persistent.
template <int D>
ffi::Error launch_hadamard_fit_d(const char* op, cudaStream_t stream, const GemmParams& p, const GemmParams* p1) {
  const int64_t ctas = std::min<int64_t>((p.N + kHadWarps - 1) / kHadWarps, 16 * static_cast<int64_t>(sm_count()));
  const unsigned nz = p1 != nullptr ? 2u : 1u;
  tq_hadamard_fit_kernel<D><<<dim3(static_cast<unsigned>(ctas), 1, nz), kHadWarps * 32, 0, stream>>>(p, p1 ? *p1 : p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

// Whether the Hadamard warp kernel serves p (and p1): both carry their spec words, head_dim 64 /
// 128, fewer than 2^31 vectors (its 32-bit slot arithmetic).
bool hadamard_kernel_serves(int d, const GemmParams& p, const GemmParams* p1) {
  return p.rot_spec != nullptr && (p1 == nullptr || p1->rot_spec != nullptr) && (d == 64 || d == 128) &&
         p.N < (int64_t(1) << 31);
}

// The write of Hadamard codecs of head_dim 64 / 128 in the quad layout, plain
// (tq_hadamard_quad_kernel) or fitted (FIT, tq_hadamard_quad_fit_kernel): 8 rows per warp, a
// persistent grid of the occupancy's CTAs at most.
template <int D, int XT, bool FIT>
ffi::Error launch_hadamard_quad_t(const char* op, cudaStream_t stream, const GemmParams& p, const GemmParams* p1) {
  void (*kernel)(GemmParams, GemmParams) = tq_hadamard_quad_kernel<D, XT>;
  if constexpr (FIT) kernel = tq_hadamard_quad_fit_kernel<D, XT>;
  static const KernelCfg cfg = occupancy_cfg(kernel, kQuadWarps * 32, 0);
  if (cfg.err != cudaSuccess) return cuda_error(op, "kernel setup", cfg.err);
  const unsigned nz = p1 != nullptr ? 2u : 1u;
  const int64_t rows_per_cta = kQuadWarps * 8;
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(cfg.blocks_per_sm) * sm_count() / nz);
  const int64_t ctas = std::min<int64_t>((p.N + rows_per_cta - 1) / rows_per_cta, cap);
  kernel<<<dim3(static_cast<unsigned>(ctas), 1, nz), kQuadWarps * 32, 0, stream>>>(p, p1 ? *p1 : p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

template <bool FIT>
ffi::Error launch_hadamard_quad(const char* op, cudaStream_t stream, int d, const GemmParams& p, const GemmParams* p1) {
  return with_input_type(p.dtype, [&](auto xt) {
    constexpr int XT = decltype(xt)::value;
    return d == 64 ? launch_hadamard_quad_t<64, XT, FIT>(op, stream, p, p1)
                   : launch_hadamard_quad_t<128, XT, FIT>(op, stream, p, p1);
  });
}

// A tensor-core write kernel on a persistent grid of the occupancy's CTAs at most (threads each,
// smem bytes of dynamic shared memory, rows_per_cta rows per CTA and step); p1: grid.z = 2.
template <auto Kernel>
ffi::Error launch_persistent_write(const char* op, cudaStream_t stream, int threads, int smem, int64_t rows_per_cta,
                                   const GemmParams& p, const GemmParams* p1) {
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, Kernel, smem); e != cudaSuccess)
    return cuda_error(op, "shared memory attribute", e);
  static const KernelCfg cfg = occupancy_cfg(Kernel, threads, smem);
  if (cfg.err != cudaSuccess) return cuda_error(op, "kernel setup", cfg.err);
  const unsigned nz = p1 != nullptr ? 2u : 1u;
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(cfg.blocks_per_sm) * sm_count() / nz);
  const int64_t ctas = std::min<int64_t>((p.N + rows_per_cta - 1) / rows_per_cta, cap);
  Kernel<<<dim3(static_cast<unsigned>(ctas), 1, nz), threads, smem, stream>>>(p, p1 ? *p1 : p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

// The plain write of Hadamard codecs from bf16 / f16 x on tensor cores: mma.sync
// (tq_hadamard_mma_kernel, 16 rows per warp) or wgmma (tq_hadamard_wgmma_kernel, 64 per warpgroup).
template <int D, int XT>
ffi::Error launch_hadamard_mma_t(const char* op, cudaStream_t stream, const GemmParams& p, const GemmParams* p1) {
  return launch_persistent_write<tq_hadamard_mma_kernel<D, XT>>(op, stream, kMmaWriteWarps * 32, MmaWriteSmem<D>::kBytes,
                                                                 kMmaWriteWarps * 16, p, p1);
}

template <int D, int XT>
ffi::Error launch_hadamard_wgmma_t(const char* op, cudaStream_t stream, const GemmParams& p, const GemmParams* p1) {
  return launch_persistent_write<tq_hadamard_wgmma_kernel<D, XT>>(op, stream, kWgmmaWriteGroups * 128,
                                                                   WgmmaWriteSmem<D>::kBytes, kWgmmaWriteGroups * 64, p, p1);
}

// Whether the current device runs tq_hadamard_wgmma_kernel's sm_90a code (asked once per device
// 0..63). Its static shared arrays exist only there: the code the driver loads elsewhere (sm_80, a
// plain sm_90 build, PTX JIT-compiled for a later GPU) is the kernel's trap and has none.
bool wgmma_write_available() {
  static std::atomic<int> known[64];
  constexpr int kNo = 1, kYes = 2;
  return once_per_device(known, kNo, [](int) {
    cudaFuncAttributes attr{};
    const bool ok = cudaFuncGetAttributes(&attr, tq_hadamard_wgmma_kernel<128, static_cast<int>(FType::kBF16)>) ==
                    cudaSuccess;
    return ok && attr.sharedSizeBytes > 0 ? kYes : kNo;
  }) == kYes;
}

bool wgmma_write_fits(int d) {
  const int smem = (d == 64 ? WgmmaWriteSmem<64>::kBytes : WgmmaWriteSmem<128>::kBytes) + 16 * int(sizeof(float)) +
                   kLutCells * int(sizeof(uint2) + sizeof(uint32_t));  // + the kernel's static arrays
  return wgmma_write_available() && smem <= device_block_smem_optin();
}

// The plain write of Hadamard codecs (hadamard_kernel_serves): from kMmaWriteMinRows vectors of
// bf16 / f16 x on tensor cores (their elements and M = d Pi's are exact MMA operands; each CTA
// stages M first, which smaller writes do not repay): by wgmma on Hopper in sm_90a builds
// (tq_hadamard_wgmma_kernel: 1.45x the mma.sync kernel's rate at 8192 tokens on an H100), else by
// mma.sync where the device gives a CTA its shared memory (sm_90: yes; sm_80: head_dim 64 only;
// sm_86 / sm_89: neither); else, and for float32 x, the quad kernel.
constexpr int64_t kMmaWriteMinRows = 16384;

bool mma_write_fits(int d) {
  const int smem = (d == 64 ? MmaWriteSmem<64>::kBytes : MmaWriteSmem<128>::kBytes) + 16 * int(sizeof(float)) +
                   kLutCells * int(sizeof(uint2));  // + the kernel's static arrays
  return smem <= device_block_smem_optin();
}

ffi::Error launch_hadamard_write(const char* op, cudaStream_t stream, int d, const GemmParams& p,
                                 const GemmParams* p1) {
  auto rows_fit32 = [](const GemmParams& q) {  // the tensor-core kernel's 32-bit pool and window rows
    return q.vec_io && q.total_slots * q.Hkv < (int64_t(1) << 31) && q.win_entries * q.Hkv < (int64_t(1) << 31);
  };
  const bool tensor_cores = p.dtype != static_cast<int>(FType::kF32) && p.N >= kMmaWriteMinRows && rows_fit32(p) &&
                            (p1 == nullptr || rows_fit32(*p1));
  if (tensor_cores && wgmma_write_fits(d)) {
    if (p.dtype == static_cast<int>(FType::kBF16))
      return d == 64 ? launch_hadamard_wgmma_t<64, static_cast<int>(FType::kBF16)>(op, stream, p, p1)
                     : launch_hadamard_wgmma_t<128, static_cast<int>(FType::kBF16)>(op, stream, p, p1);
    return d == 64 ? launch_hadamard_wgmma_t<64, static_cast<int>(FType::kF16)>(op, stream, p, p1)
                   : launch_hadamard_wgmma_t<128, static_cast<int>(FType::kF16)>(op, stream, p, p1);
  }
  if (!tensor_cores || !mma_write_fits(d)) return launch_hadamard_quad<false>(op, stream, d, p, p1);
  if (p.dtype == static_cast<int>(FType::kBF16))
    return d == 64 ? launch_hadamard_mma_t<64, static_cast<int>(FType::kBF16)>(op, stream, p, p1)
                   : launch_hadamard_mma_t<128, static_cast<int>(FType::kBF16)>(op, stream, p, p1);
  return d == 64 ? launch_hadamard_mma_t<64, static_cast<int>(FType::kF16)>(op, stream, p, p1)
                 : launch_hadamard_mma_t<128, static_cast<int>(FType::kF16)>(op, stream, p, p1);
}

// The fitted-scale compress: Hadamard codecs of head_dim 64 / 128 with their spec words (p.rot_spec,
// and p1's) in the quad layout from kQuadFitMinRows rows, one warp per
// vector below; else tensor cores for d <= 128 (tq_fit_mma_kernel), the v1 fp32 kernel
// (tq_fit_kernel) for d 192 / 256.
ffi::Error launch_fit(const char* op, cudaStream_t stream, int d, const GemmParams& p,
                      const GemmParams* p1 = nullptr) {
  if (p.N == 0) return ffi::Error::Success();
  if (p.N > (int64_t(1) << 40)) return invalid(op, "too many vectors");
  if (hadamard_kernel_serves(d, p, p1)) {
    // From this many rows the quad kernel (8 rows per warp: fewer instructions per row) rather than
    // one warp per row (the shorter latency of a few rows).
    constexpr int64_t kQuadFitMinRows = 4096;
    if (p.N >= kQuadFitMinRows) return launch_hadamard_quad<true>(op, stream, d, p, p1);
    return d == 64 ? launch_hadamard_fit_d<64>(op, stream, p, p1) : launch_hadamard_fit_d<128>(op, stream, p, p1);
  }
  if (d <= 128)
    return with_input_type(p.dtype, [&](auto xt) {
      return launch_fit_mma_x<decltype(xt)::value>(op, stream, d, p, p1);
    });
  // Large batches: 64 vectors per CTA (more reuse of each Pi tile); small ones: 16 per CTA.
  const bool big = (p.N + 63) / 64 >= 2 * static_cast<int64_t>(sm_count());
  return with_value(SupportedHeadDims{}, d, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if constexpr (D > 128) return big ? launch_fit_t<D, 4>(op, stream, p, p1) : launch_fit_t<D, 1>(op, stream, p, p1);
    else return unsupported_head_dim(op, d);
  }, [&] { return unsupported_head_dim(op, d); });
}

// v2 tensor-core kernels. DECOMP: tq_decompress_mma_kernel (XT unused), else
// tq_compress_mma_kernel<..., XT, WIN>.
// p1: a second problem of the same shape and x dtype, run by grid.z = 1 of the same launch
// (compress only; nullptr: none).
template <int D, int NC, int WARPS, bool DECOMP, int XT, bool WIN = false>
ffi::Error launch_mma_t(const char* op, cudaStream_t stream, const GemmParams& p,
                        const GemmParams* p1) {
  using G = MmaGeom<D, NC, WARPS>;
  constexpr int threads = WARPS * 32;
  constexpr int smem = DECOMP ? G::decomp_smem : G::comp_smem;
  auto kernel = [] {
    if constexpr (DECOMP) return tq_decompress_mma_kernel<D, NC, WARPS>;
    else return tq_compress_mma_kernel<D, NC, WARPS, XT, WIN>;
  }();
  static std::atomic<uint64_t> smem_set{0};
  if (cudaError_t e = allow_dynamic_smem(smem_set, kernel, smem); e != cudaSuccess)
    return cuda_error(op, "shared memory attribute", e);
  static const KernelCfg cfg = occupancy_cfg(kernel, threads, smem);
  if (cfg.err != cudaSuccess) return cuda_error(op, "kernel setup", cfg.err);
  constexpr int ncb = D / NC;  // column blocks (grid.y)
  const int64_t ntiles = (p.N + 15) / 16;
  int64_t gx = (ntiles + WARPS - 1) / WARPS;
  const int64_t cap = std::max<int64_t>(
      1, static_cast<int64_t>(cfg.blocks_per_sm) * sm_count() / ncb);  // persistent grid
  gx = std::min(gx, cap);
  if constexpr (DECOMP) {
    kernel<<<dim3(static_cast<unsigned>(gx), ncb), threads, smem, stream>>>(p);
  } else {
    const unsigned nz = p1 != nullptr ? 2u : 1u;
    kernel<<<dim3(static_cast<unsigned>(gx), ncb, nz), threads, smem, stream>>>(p, p1 ? *p1 : p);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(op, "kernel launch", e);
  return ffi::Error::Success();
}

// Large batches: a warp tile is 16 rows x NC = min(d, 128 or d/2) outputs, 8 warps per CTA,
// persistent grid. Small batches (a decode step's write): 16 x 16 tiles, 4 warps per CTA,
// d/16 column blocks, so that enough CTAs run. Same per-output MMA sequence in both.
template <int D, bool DECOMP, int XT, bool WIN = false>
ffi::Error launch_mma_d(const char* op, cudaStream_t stream, const GemmParams& p,
                        const GemmParams* p1) {
  // f32 / f16 x (3 MMAs, hi + lo x fragments) and decompress: narrower tiles keep the
  // accumulators + prefetch within 128 registers (2 CTAs of 256 threads per SM).
  constexpr bool narrow = !DECOMP && XT != static_cast<int>(FType::kBF16);
  constexpr int NCB = narrow ? (D <= 128 ? D / 2 : D / 4)
                     : DECOMP ? (D <= 96 ? D : (D == 192 ? 96 : 64))
                              : (D <= 128 ? D : D / 2);
  const int64_t ntiles = (p.N + 15) / 16;
  if (ntiles >= 8 * static_cast<int64_t>(sm_count()))
    return launch_mma_t<D, NCB, 8, DECOMP, XT, WIN>(op, stream, p, p1);
  return launch_mma_t<D, 16, 4, DECOMP, XT, WIN>(op, stream, p, p1);
}

template <bool DECOMP, int XT, bool WIN = false>
ffi::Error launch_mma_x(const char* op, cudaStream_t stream, int d, const GemmParams& p,
                        const GemmParams* p1 = nullptr) {
  return with_value(SupportedHeadDims{}, d, [&](auto dim) {
    return launch_mma_d<decltype(dim)::value, DECOMP, XT, WIN>(op, stream, p, p1);
  }, [&] { return unsupported_head_dim(op, d); });
}

// p1 (optional): a second problem with p's N, head_dim and x dtype, run in the same launch (and
// a window where p has one).
template <bool WIN = false>
ffi::Error launch_compress(const char* op, cudaStream_t stream, int d, const GemmParams& p,
                           const GemmParams* p1 = nullptr) {
  if (p.N == 0) return ffi::Error::Success();
  if (p.N > (int64_t(1) << 40)) return invalid(op, "too many vectors");
  return with_input_type(p.dtype, [&](auto xt) {
    return launch_mma_x<false, decltype(xt)::value, WIN>(op, stream, d, p, p1);
  });
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }
bool aligned4(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 3u) == 0; }

ffi::Error launch_decompress(const char* op, cudaStream_t stream, int d, const GemmParams& p) {
  if (p.N == 0) return ffi::Error::Success();
  if (p.N > (int64_t(1) << 40)) return invalid(op, "too many vectors");
  // f32 output needs ~1e-6: the v1 fp32 kernel. bf16 / f16: one fp16 MMA per k-step.
  if (p.dtype == static_cast<int>(FType::kF32) || !aligned4(p.codes) || !aligned4(p.out))
    return launch_gemm<true>(op, stream, d, p);
  return launch_mma_x<true, 0>(op, stream, d, p);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// jax_tq_compress: x [N, d] -> codes [N, packed], norms [N]
// ---------------------------------------------------------------------------------------------
ffi::Error CompressCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                            ffi::Buffer<ffi::F32> centroids,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits,
                            int32_t fit_scale) {
  static const char* op = "jax_tq_compress";
  const int ft = ftype_of(x.element_type());
  if (ft < 0) return invalid(op, "x dtype must be float32, bfloat16 or float16");
  ffi_checks::CompressDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_compress(cuda_op(op), x, rotation, centroids, *codes,
                                                    *norms, bits, &dims));
  const int64_t n = dims.n, d = dims.d;
  if (!aligned4(codes->typed_data())) return invalid(op, "codes buffer is not 4-byte aligned");

  GemmParams p{};
  p.x = x.untyped_data();
  p.codes = codes->typed_data();
  p.norms = norms->typed_data();
  p.rot = rotation.typed_data();
  p.cent = centroids.typed_data();
  p.slots = nullptr;
  p.out = nullptr;
  p.N = n;
  p.bits = bits;
  p.dtype = ft;
  p.vec_io = aligned16(p.x);
  p.Hkv = 1;
  p.page_size = 1;
  p.total_slots = 0;
  if (!aligned16(p.rot)) return invalid(op, "rotation buffer is not 16-byte aligned");
  if (fit_scale != 0) return launch_fit(op, stream, static_cast<int>(d), p);
  return launch_compress(op, stream, static_cast<int>(d), p);
}

// ---------------------------------------------------------------------------------------------
// jax_tq_decompress: codes [N, packed], norms [N] -> x [N, d]
// ---------------------------------------------------------------------------------------------
ffi::Error DecompressCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                              ffi::Buffer<ffi::F32> norms, ffi::Buffer<ffi::F32> rotation,
                              ffi::Buffer<ffi::F32> centroids, ffi::Result<ffi::AnyBuffer> x,
                              int32_t bits) {
  static const char* op = "jax_tq_decompress";
  const int ft = ftype_of(x->element_type());
  if (ft < 0) return invalid(op, "result x dtype must be float32, bfloat16 or float16");
  ffi_checks::CompressDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_decompress(cuda_op(op), codes, norms, rotation,
                                                      centroids, *x, bits, &dims));
  const int64_t n = dims.n, d = dims.d;

  GemmParams p{};
  p.x = nullptr;
  p.codes = const_cast<uint8_t*>(codes.typed_data());
  p.norms = const_cast<float*>(norms.typed_data());
  p.rot = rotation.typed_data();
  p.cent = centroids.typed_data();
  p.slots = nullptr;
  p.out = x->untyped_data();
  p.N = n;
  p.bits = bits;
  p.dtype = ft;
  p.vec_io = aligned16(p.out);
  p.Hkv = 1;
  p.page_size = 1;
  p.total_slots = 0;
  if (!aligned16(p.rot)) return invalid(op, "rotation buffer is not 16-byte aligned");
  return launch_decompress(op, stream, static_cast<int>(d), p);
}

// ---------------------------------------------------------------------------------------------
// Cache writes: x [T, Hkv, d] written into paged codes/norms at slot_mapping.
// ---------------------------------------------------------------------------------------------
namespace {

// Validates one pool's operands, copies the pool when the results are not aliased to it (XLA
// without donation), and fills *p for the compress kernel. p->N == 0: nothing to write.
ffi::Error prepare_write(const char* op, const char* name, cudaStream_t stream,
                         const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U8>& codes_in,
                         const ffi::Buffer<ffi::F32>& norms_in,
                         const ffi::Buffer<ffi::F32>& rotation,
                         const ffi::Buffer<ffi::F32>& centroids,
                         const ffi::Buffer<ffi::S32>& slot_mapping, ffi::Buffer<ffi::U8>& codes_out,
                         ffi::Buffer<ffi::F32>& norms_out, int32_t bits, GemmParams* p) {
  const int ft = ftype_of(x.element_type());
  if (ft < 0) return invalid(op, std::string(name) + " dtype must be float32, bfloat16 or float16");
  ffi_checks::CompressWriteDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_write_cache(cuda_op(op), x, codes_in, norms_in,
                                                          rotation, centroids, slot_mapping,
                                                          codes_out, norms_out, bits, &dims));
  const int64_t t_n = dims.t_n, hkv = dims.hkv;
  const int64_t num_pages = dims.num_pages, page_size = dims.page_size;

  uint8_t* cp = codes_out.typed_data();
  float* np_ = norms_out.typed_data();
  if (!aligned4(cp)) return invalid(op, "codes buffer is not 4-byte aligned");
  if (static_cast<const void*>(cp) != codes_in.untyped_data() && codes_in.size_bytes() > 0) {
    cudaError_t e = cudaMemcpyAsync(cp, codes_in.untyped_data(), codes_in.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_error(op, "cudaMemcpyAsync(codes)", e);
  }
  if (static_cast<const void*>(np_) != norms_in.untyped_data() && norms_in.size_bytes() > 0) {
    cudaError_t e = cudaMemcpyAsync(np_, norms_in.untyped_data(), norms_in.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_error(op, "cudaMemcpyAsync(norms)", e);
  }
  *p = GemmParams{};
  p->x = x.untyped_data();
  p->codes = cp;
  p->norms = np_;
  p->rot = rotation.typed_data();
  p->cent = centroids.typed_data();
  p->slots = slot_mapping.typed_data();
  p->out = nullptr;
  p->N = (num_pages == 0 || page_size == 0) ? 0 : t_n * hkv;  // (the window may raise it: prepare_window)
  p->bits = bits;
  p->dtype = ft;
  p->vec_io = aligned16(p->x);
  p->Hkv = static_cast<int>(hkv);
  p->page_size = static_cast<int>(page_size);
  p->total_slots = num_pages * page_size;
  if (!aligned16(p->rot)) return invalid(op, "rotation buffer is not 16-byte aligned");
  return ffi::Error::Success();
}

// One window pool of a cache write: copies it when the result is not aliased to the operand, and
// points *p at it (win.on(): every token is then a vector of the launch, even with no pages).
ffi::Error prepare_window(const char* op, cudaStream_t stream, const ffi_checks::WindowDims& win,
                          const ffi::Buffer<ffi::BF16>& window_in, ffi::Buffer<ffi::BF16>& window_out,
                          const ffi::Buffer<ffi::S32>& window_slots, int64_t vectors, GemmParams* p) {
  void* out = window_out.untyped_data();
  if (out != window_in.untyped_data() && window_in.size_bytes() > 0) {
    cudaError_t e = cudaMemcpyAsync(out, window_in.untyped_data(), window_in.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_error(op, "cudaMemcpyAsync(window)", e);
  }
  if (!win.on()) return ffi::Error::Success();
  if (!aligned4(out)) return invalid(op, "window buffer is not 4-byte aligned");
  if (win.window >= (int64_t(1) << 31)) return invalid(op, "window too long");
  p->win = static_cast<uint16_t*>(out);
  p->win_slots = window_slots.typed_data();
  p->win_entries = win.num_windows * win.window;
  p->win_len = static_cast<int>(win.window);
  p->N = vectors;
  return ffi::Error::Success();
}

// The compress launch of one problem (p1: a second one in the same launch): the fitted scale's
// kernel or the tensor-core one.
ffi::Error launch_write(const char* op, cudaStream_t stream, int d, bool fit, const GemmParams& p,
                        const GemmParams* p1 = nullptr) {
  if (fit) return launch_fit(op, stream, d, p, p1);
  if (p.N == 0) return ffi::Error::Success();
  if (hadamard_kernel_serves(d, p, p1)) return launch_hadamard_write(op, stream, d, p, p1);
  return p.win != nullptr ? launch_compress<true>(op, stream, d, p, p1) : launch_compress(op, stream, d, p, p1);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// jax_tq_write_cache: k and v written at the same slots, in ONE kernel launch
// (grid.z = 2) when k and v share a dtype and the scale kind (the common case; else two launches).
// The window pools (k_window, v_window; window_slots) are written by the same kernels' epilogues.
// ---------------------------------------------------------------------------------------------
ffi::Error WriteCacheCudaImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::U8> k_codes_in, ffi::Buffer<ffi::F32> k_norms_in,
                              ffi::Buffer<ffi::U8> v_codes_in, ffi::Buffer<ffi::F32> v_norms_in,
                              ffi::Buffer<ffi::F32> k_rotation, ffi::Buffer<ffi::F32> k_centroids,
                              ffi::Buffer<ffi::F32> v_rotation, ffi::Buffer<ffi::F32> v_centroids,
                              ffi::Buffer<ffi::S32> slot_mapping,
                              ffi::Buffer<ffi::BF16> k_window_in, ffi::Buffer<ffi::BF16> v_window_in,
                              ffi::Buffer<ffi::S32> window_slots, ffi::Buffer<ffi::S32> rotation_spec,
                              ffi::Result<ffi::Buffer<ffi::U8>> k_codes_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> k_norms_out,
                              ffi::Result<ffi::Buffer<ffi::U8>> v_codes_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> v_norms_out,
                              ffi::Result<ffi::Buffer<ffi::BF16>> k_window_out,
                              ffi::Result<ffi::Buffer<ffi::BF16>> v_window_out, int32_t k_bits,
                              int32_t v_bits, int32_t k_fit_scale, int32_t v_fit_scale) {
  static const char* op = "jax_tq_write_cache";
  GemmParams pk, pv;
  JTQ_RETURN_IF_ERROR(prepare_write(op, "k", stream, k, k_codes_in, k_norms_in, k_rotation,
                                    k_centroids, slot_mapping, *k_codes_out, *k_norms_out, k_bits,
                                    &pk));
  JTQ_RETURN_IF_ERROR(prepare_write(op, "v", stream, v, v_codes_in, v_norms_in, v_rotation,
                                    v_centroids, slot_mapping, *v_codes_out, *v_norms_out, v_bits,
                                    &pv));
  const auto kd = k.dimensions();  // [T, Hkv, d], validated by prepare_write
  ffi_checks::WindowDims win;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_window_write(cuda_op(op), kd[0], kd[1], kd[2], k_window_in,
                                                        v_window_in, window_slots, *k_window_out,
                                                        *v_window_out, &win));
  JTQ_RETURN_IF_ERROR(prepare_window(op, stream, win, k_window_in, *k_window_out, window_slots,
                                     kd[0] * kd[1], &pk));
  JTQ_RETURN_IF_ERROR(prepare_window(op, stream, win, v_window_in, *v_window_out, window_slots,
                                     kd[0] * kd[1], &pv));
  const bool k_fit = k_fit_scale != 0, v_fit = v_fit_scale != 0;
  const int dk = static_cast<int>(kd[2]), dv = static_cast<int>(v.dimensions()[2]);
  bool spec_present;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_rotation_spec(cuda_op(op), rotation_spec, dk, dv, &spec_present));
  pk.rot_spec = spec_present ? rotation_spec.typed_data() : nullptr;
  pv.rot_spec = spec_present ? rotation_spec.typed_data() + dk : nullptr;
  if (pk.N == pv.N && dk == dv && pk.dtype == pv.dtype && pk.vec_io == pv.vec_io && k_fit == v_fit &&
      (pk.win == nullptr) == (pv.win == nullptr))
    return launch_write(op, stream, dk, k_fit, pk, &pv);
  JTQ_RETURN_IF_ERROR(launch_write(op, stream, dk, k_fit, pk));
  return launch_write(op, stream, dv, v_fit, pv);
}

}  // namespace cuda
}  // namespace jax_tq

// Compress and decompress are command-buffer compatible (as the decode handler): each only enqueues
// work on the given stream, and what it enqueues depends on shapes, attributes and buffer addresses
// only, so XLA may capture it into a CUDA graph with the surrounding ops. The cache write is not (below).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressCuda, jax_tq::cuda::CompressCudaImpl,
                              jax_tq::ffi_checks::BindCompress(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqDecompressCuda, jax_tq::cuda::DecompressCudaImpl,
                              jax_tq::ffi_checks::BindDecompress(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// Not command-buffer compatible: captured into XLA's CUDA graphs (XLA's default set), a model's
// 8192-token prompt through forward_compressed fails with CUDA_ERROR_LAUNCH_FAILED with a window
// (fitted or norm scale) and runs without one, or at 2048 tokens (H100, jax 0.11.2, one layer;
// serial command-buffer scheduling, ALWAYS_UPDATE, eager module loading do not change it). Captured,
// prompt_attention's chains gain ~1 us per call (XLA issues a chain's writes back to back).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqWriteCacheCuda, jax_tq::cuda::WriteCacheCudaImpl,
                              jax_tq::ffi_checks::BindWriteCache(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
