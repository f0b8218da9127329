// Device code shared by the paged-decode kernels (paged_decode.cu's CUDA-core split, window and
// combine kernels; decode_tensor_core.cuh): launch constants, cp.async and math helpers, code
// look-ups, the kernel parameters (DecodeParams), the phase trace of JAX_TQ_TRACE_PHASES builds, the
// Hadamard rotation of a row on one warp, and the writes of a split's output or partial.
// Included by paged_decode.cu only (its definitions sit in an unnamed namespace).
#ifndef JAX_TQ_DECODE_DEVICE_CUH_
#define JAX_TQ_DECODE_DEVICE_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "jax_tq/attention_variants.cuh"
#include "jax_tq/cp_async.cuh"
#include "jax_tq/format.h"

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 64;   // tokens per pipeline stage
constexpr int kStages = 3;   // cp.async ring depth
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Small device helpers.
// ---------------------------------------------------------------------------------------------
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst_smem, const void* src_gmem) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async size");
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst_smem)),
                 "l"(src_gmem)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst_smem)),
                 "l"(src_gmem), "n"(BYTES)
                 : "memory");
  }
}

// 16 bytes, the destination given as a shared-memory address (no generic -> shared conversion).
__device__ __forceinline__ void cp_async16_s(uint32_t dst_smem, const void* src_gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_smem), "l"(src_gmem)
               : "memory");
}

// CU (16 or 8) bytes, the destination given as a shared-memory address (.cg takes 16 only).
template <int CU>
__device__ __forceinline__ void cp_async_s(uint32_t dst_smem, const void* src_gmem) {
  if constexpr (CU == 16) cp_async16_s(dst_smem, src_gmem);
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst_smem), "l"(src_gmem), "n"(CU) : "memory");
}

// A kernel's first few global reads (q, centroids, rotation words, block-table entries), issued
// before its first tiles' copies, whose megabytes would otherwise delay them by a loaded memory
// latency. Plain (coherent) loads: a following __threadfence_block() keeps the compiler from sinking
// them below it, which it does with read-only (.nc) loads.
__device__ __forceinline__ float ld_early(const float* src) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(src) : "memory");
  return v;
}
__device__ __forceinline__ int ld_early(const int* src) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];\n" : "=r"(v) : "l"(src) : "memory");
  return v;
}
__device__ __forceinline__ int2 ld_early(const int2* src) {
  int2 v;
  asm volatile("ld.global.v2.s32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(src) : "memory");
  return v;
}
__device__ __forceinline__ int4 ld_early(const int4* src) {
  int4 v;
  asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src)
               : "memory");
  return v;
}

__device__ __forceinline__ float fast_exp2(float x) {
  // ex2.approx: exp2(-inf) = 0, relative error ~2^-22.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  // lg2.approx.ftz: log2(0) = -inf, subnormals flush to 0, relative error ~2^-22.
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Division by a runtime constant d (1 <= d < 2^31) for 0 <= x < 2^31:
// q = (umulhi(x, mul) + x) >> shift (round-up method, 33-bit intermediate fits since x < 2^31).
struct FastDiv {
  uint32_t mul;
  uint32_t shift;
  __device__ __forceinline__ uint32_t div(uint32_t x) const {
    return (__umulhi(x, mul) + x) >> shift;
  }
};

FastDiv make_fastdiv(uint32_t d) {
  uint32_t s = 0;
  while ((uint64_t(1) << s) < d) ++s;
  const uint64_t m = ((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1;
  return FastDiv{static_cast<uint32_t>(m), s};
}

// Load NB bytes starting at smem pointer p into little-endian words w[0..ceil(NB/4)).
// Bytes past NB in the last word are garbage (never used as codes). The unaligned path may read
// up to 7 bytes past the range; callers keep that inside the shared allocation.
template <int NB>
__device__ __forceinline__ void load_bytes(const uint8_t* p, uint32_t (&w)[(NB + 3) / 4]) {
  constexpr int NW = (NB + 3) / 4;
  if constexpr (NB % 16 == 0) {
#pragma unroll
    for (int i = 0; i < NB / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i + 0] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (NB % 8 == 0) {
#pragma unroll
    for (int i = 0; i < NB / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i + 0] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else if constexpr (NB % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
  } else {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t* q = reinterpret_cast<const uint32_t*>(a & ~uintptr_t(3));
    const uint32_t sh = uint32_t(a & 3) * 8u;
    uint32_t raw[NW + 1];
#pragma unroll
    for (int i = 0; i <= NW; ++i) raw[i] = q[i];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
  }
}

// Byte offset (code * 4) of code i (compile-time after unrolling) of an LSB-first bit stream held
// in little-endian words: ready to index a float table.
template <int BITS, int NW>
__device__ __forceinline__ uint32_t code_off4(const uint32_t (&w)[NW], int i) {
  constexpr uint32_t kMask4 = ((1u << BITS) - 1u) << 2;
  const int b = i * BITS;
  const int wi = b >> 5;
  const int sh = b & 31;
  if (sh + BITS <= 32) {
    if (sh >= 2) return (w[wi] >> (sh - 2)) & kMask4;
    return (w[wi] << (2 - sh)) & kMask4;
  }
  return __funnelshift_r(w[wi], w[wi + 1], sh - 2) & kMask4;
}

__device__ __forceinline__ float table_at(const float* table, uint32_t off4) {
  return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(table) + off4);
}

// ---------------------------------------------------------------------------------------------
// Kernel geometry.
// ---------------------------------------------------------------------------------------------
constexpr int round16(int x) { return (x + 15) / 16 * 16; }

template <int D>
struct KGeom {
  // Lanes per token in the K phase; each lane owns D / LPT contiguous coordinates (a multiple of
  // 8, so every lane starts on a 3-bit packing group).
  static constexpr int LPT = (D == 64 || D == 80) ? 2 : (D == 256 ? 8 : 4);
  static constexpr int DL = D / LPT;
  static_assert(DL % 8 == 0 && DL % 4 == 0, "lane slice must hold whole 8-code groups");
  static constexpr int TPW = 32 / LPT;               // tokens per warp per pass
  static constexpr int TPL = kChunk / (kWarps * TPW);  // tokens per lane per chunk
  static_assert(TPL * kWarps * TPW == kChunk, "chunk must be covered exactly");
  static constexpr int QROW = DL + 4;  // padded q slice (floats): conflict-free float4 reads
  // V phase: one lane per 8 coordinates.
  static constexpr int SPT = D / 8;
  static constexpr int TPWV = 32 / SPT;  // tokens per warp per V step (>= 1)
  static constexpr int VPASS = kWarps * TPWV;
  static constexpr bool kPow2Spt = (SPT & (SPT - 1)) == 0;
};

// Shared-memory carve-up. Code rows are sized for the widest (4-bit) codes so that one kernel
// serves every k_bits / v_bits (the bit widths are a uniform run-time switch inside the phases).
template <int D, int GT>
struct Layout {
  static constexpr int KROW = round16(D * kMaxBits / 8);
  static constexpr int VROW = KROW;
  using G = KGeom<D>;
  static constexpr int kc_off = 0;
  static constexpr int vc_off = kc_off + kStages * kChunk * KROW;
  static constexpr int kn_off = vc_off + kStages * kChunk * VROW;
  static constexpr int vn_off = kn_off + round16(kStages * kChunk * 4);
  static constexpr int valid_off = vn_off + round16(kStages * kChunk * 4);
  static constexpr int q_off = valid_off + round16(kStages * kChunk * 4);
  static constexpr int s_off = q_off + round16(GT * G::LPT * G::QROW * 4);
  static constexpr int w_off = s_off + round16(kChunk * GT * 4);
  static constexpr int alpha_off = w_off + round16(kChunk * GT * 4);
  static constexpr int ml_off = alpha_off + round16(GT * 4);
  static constexpr int o_off = ml_off + round16(2 * GT * 4);
  static constexpr int total = o_off + round16(GT * D * 4);
};

// How one pool's code rows are copied: row bytes, bytes per copy op (16 / 4 / 2), ops per row.
struct CopyPlan {
  int bytes, gran, segs;
  FastDiv segdiv;  // division by segs
};

struct DecodeParams {
  const float* q;       // [S, H, D]
  const uint8_t* kc;    // [P, Hkv, page, D * k_bits / 8]
  const float* kn;      // [P, Hkv, page]
  const uint8_t* vc;    // [P, Hkv, page, D * v_bits / 8]
  const float* vn;      // [P, Hkv, page]
  const float* kcent;   // [2**KB]
  const float* vcent;   // [2**VB]
  const int32_t* bt;    // [S, max_pages]
  const int32_t* sl;    // [S]
  float* out;           // [S, H, D]
  float* pout;          // [S, H, pstride, D]
  float* plse;          // [S, H, pstride]
  int S, H, Hkv, G, ntiles, P, page_size, max_pages, num_splits;
  FastDiv pdiv;         // division by page_size
  float qscale;         // scale * log2(e)
  CopyPlan kcopy, vcopy;
  int k_bits, v_bits;
  const int32_t* rot;   // [2][D] Hadamard spec words (K, V; format.h), or nullptr: q / out rotated outside
  unsigned long long* trace;  // v4's phase trace (PhaseTrace below), or nullptr (the default)
  int window;           // the recent-token window W (format.h), 0: none. W > 0: the split kernels stream
                        // the pages' tokens [0, paged_tokens) only; the window's tokens are either
                        // folded into v4's tile loop (kwin set) or the window-partial kernel's partial
                        // (slot num_splits, kwin nullptr: the split kernels always write partials).
  int pstride;          // partials per (sequence, head) in pout / plse: num_splits, + 1 with a window
  // The folded window (v4 only; kwin == nullptr: not folded): its CTA is split window_split, 0 with
  // one split and no sinks (pages and window in one CTA, whose output is final), else num_splits (a
  // CTA of its own, grid_splits = num_splits + 1, writing partial slot num_splits).
  const uint16_t* kwin;  // [num_windows, Hkv, W, D] bf16
  const uint16_t* vwin;  // [num_windows, Hkv, W, D] bf16
  const int32_t* window_ids;  // [S]
  int num_windows, window_split;
  int grid_splits;      // CTAs per sequence along grid.x: num_splits, + 1 for a folded window's own CTA
  // The attention variants (ffi_checks.h Variants; the CUDA-core kernel, the float16 tensor-core
  // kernel (v4), the window-partial and combine kernels): the query at position L - 1 sees positions
  // >= L - sliding_window (0: all), logits s (log2 units) become c tanh(s / c) with c = soft_cap *
  // log2(e) (0: none; soft_cap_inv = 1 / c), and sinks [H] (nullptr:
  // none) join each head's softmax denominator in the combine (so the split kernels then always
  // write partials).
  int sliding_window;
  float soft_cap_log2, soft_cap_inv;
  const float* sinks;
};

// The first position a sequence's query sees: max(0, L - sliding_window), L its clamped length.
__device__ __forceinline__ int visible_from(const DecodeParams& p, int seq_len) {
  if (p.sliding_window <= 0) return 0;
  const int capacity = p.max_pages * p.page_size;
  const int len = seq_len < 0 ? 0 : (seq_len > capacity ? capacity : seq_len);
  return len > p.sliding_window ? len - p.sliding_window : 0;
}

// The length whose tokens the split kernels stream from the pages: format.h's paged_tokens
// (max(clamp(seq_len, 0, capacity) - W, 0): the last W tokens come from the window) in 32 bits (the
// handler keeps capacity = max_pages * page_size below 2^31); W = 0: seq_len clamped, as the
// split range clamps it anyway.
__device__ __forceinline__ int paged_len(const DecodeParams& p, int seq_len) {
  const int capacity = p.max_pages * p.page_size;
  const int len = seq_len < 0 ? 0 : (seq_len > capacity ? capacity : seq_len);
  return len > p.window ? len - p.window : 0;
}

// Whether the split kernels write split partials (pout / plse for a combine kernel) rather than
// the output: several splits, or a window not folded into the split kernel (its partial is merged
// with the splits' by the combine).
__host__ __device__ __forceinline__ bool writes_partials(const DecodeParams& p) {
  return p.num_splits > 1 || (p.window > 0 && p.kwin == nullptr) || p.sinks != nullptr;
}

// A diagnostic, in builds with JAX_TQ_TRACE_PHASES=ON (CMake; the macro JTQ_TRACE_PHASES): the
// float16 tensor-core kernel records for each warp of its first
// kTraceCtas CTAs (blockIdx.x + gridDim.x * blockIdx.y) kTraceStamps pairs (%globaltimer ns, %smid):
// kernel start, first reads landed, q staged and first copies issued, tables built (the loop
// starts), end of the warp's tile loop, then in the epilogue: past its first barrier, o_s written
// and past the second, the row merged over the warps, rotated back (the fused per-warp epilogue;
// warps without a row stamp both at its end), kernel end; read back by _cuda_ops.phase_trace()
// (benchmarks/phase_trace.py). Other builds compile the stamps out.
#ifdef JTQ_TRACE_PHASES
constexpr int kTraceCtas = 2048;
constexpr int kTraceWarps = 8;
constexpr int kTraceStamps = 10;
constexpr int kTraceWords = kTraceCtas * kTraceWarps * kTraceStamps * 2;
__device__ unsigned long long g_phase_trace[kTraceWords];
#endif

// cta: blockIdx.x + gridDim.x * blockIdx.y of the grid of one work item per CTA (a CTA of two items
// records as two CTAs).
__device__ __forceinline__ void trace_phase(const DecodeParams& p, unsigned cta, int warp, int lane, int stamp) {
#ifdef JTQ_TRACE_PHASES
  if (p.trace == nullptr || lane != 0) return;
  if (cta >= kTraceCtas || warp >= kTraceWarps) return;
  unsigned long long ns;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* slot = p.trace + ((cta * kTraceWarps + warp) * kTraceStamps + stamp) * 2;
  slot[0] = ns;
  slot[1] = sm;
#else
  (void)p, (void)cta, (void)warp, (void)lane, (void)stamp;
#endif
}

// ---- Programmatic dependent launch (cuda_launch.h launch_dependent; sm_90 on, no-ops before) ----
// The kernel after this one on the stream may start its CTAs (once every CTA of this grid has run
// this); it still waits for this grid's end before it reads this grid's writes (pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Waits until the grids this one depends on have ended and their writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- The Hadamard rotation applied inside the kernels (rotation spec words: format.h) ---------
// A warp holds one row of D = 32 N coordinates (head_dim 64: N = 2, 128: N = 4), x[j] = coordinate
// N * lane + j; buf is D floats of the warp's own shared memory (the permutation goes through it).

// A lane's N spec words (or N coordinates of a row) as one vector.
template <int N>
using LaneWords = std::conditional_t<N == 2, int2, int4>;
template <int N>
using LaneFloats = std::conditional_t<N == 2, float2, float4>;

// x <- H_un x, the unnormalized Sylvester Hadamard transform (H_un[i][k] = (-1)^popcount(i & k)):
// the lane's own coordinates first, then one shuffle per lane bit.
template <int N>
__device__ __forceinline__ void warp_fwht(float (&x)[N], int lane) {
  static_assert(N == 2 || N == 4, "rows of 64 or 128 coordinates");
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; i += 2 * h) {
#pragma unroll
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float y = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = upper ? y - x[j] : x[j] + y;
    }
  }
}

__device__ __forceinline__ void rot_words_of(const int4& v, uint32_t (&w)[4]) {
  w[0] = static_cast<uint32_t>(v.x);
  w[1] = static_cast<uint32_t>(v.y);
  w[2] = static_cast<uint32_t>(v.z);
  w[3] = static_cast<uint32_t>(v.w);
}
__device__ __forceinline__ void rot_words_of(const int2& v, uint32_t (&w)[2]) {
  w[0] = static_cast<uint32_t>(v.x);
  w[1] = static_cast<uint32_t>(v.y);
}

// The lane's words N lane .. N lane + N - 1 of a spec row (one of the kernel's first reads).
template <int N>
__device__ __forceinline__ void load_rot_words(const int32_t* spec, int lane, uint32_t (&w)[N]) {
  rot_words_of(ld_early(reinterpret_cast<const LaneWords<N>*>(spec) + lane), w);
}

// Coordinates N lane .. N lane + N - 1 of a row (aligned to N floats) as one vector.
template <int N>
__device__ __forceinline__ void load_lane_coords(const float* row, int lane, float (&x)[N]) {
  const LaneFloats<N> v = reinterpret_cast<const LaneFloats<N>*>(row)[lane];
  x[0] = v.x;
  x[1] = v.y;
  if constexpr (N == 4) x[2] = v.z, x[3] = v.w;
}
template <int N>
__device__ __forceinline__ void store_lane_coords(float* row, int lane, const float (&x)[N]) {
  if constexpr (N == 4) reinterpret_cast<float4*>(row)[lane] = make_float4(x[0], x[1], x[2], x[3]);
  else reinterpret_cast<float2*>(row)[lane] = make_float2(x[0], x[1]);
}

// x <- Pi x with Pi = H D2 P H D1 (H normalized: the two 1 / sqrt(D) factors are the exact 1 / D
// applied first, so no intermediate grows past the normalized transform's values).
template <int N>
__device__ __forceinline__ void rotate_row_forward(float (&x)[N], const uint32_t (&w)[N], float* buf, int lane) {
  constexpr int D = 32 * N;
  constexpr float kNorm = 1.f / D;
#pragma unroll
  for (int j = 0; j < N; ++j) x[j] = (rot_neg1(w[j]) ? -x[j] : x[j]) * kNorm;
  warp_fwht(x, lane);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < N; ++j) buf[N * lane + j] = x[j];
  __syncwarp();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float z = buf[rot_perm(w[j]) & (D - 1)];  // (P v)_i = v_perm[i]
    x[j] = rot_neg2(w[j]) ? -z : z;
  }
  __syncwarp();  // buf may be reused at once
  warp_fwht(x, lane);
}

// x <- Pi^T x = D1 H P^T D2 H x.
template <int N>
__device__ __forceinline__ void rotate_row_inverse(float (&x)[N], const uint32_t (&w)[N], float* buf, int lane) {
  constexpr int D = 32 * N;
  constexpr float kNorm = 1.f / D;
#pragma unroll
  for (int j = 0; j < N; ++j) x[j] *= kNorm;
  warp_fwht(x, lane);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < N; ++j) buf[rot_perm(w[j]) & (D - 1)] = rot_neg2(w[j]) ? -x[j] : x[j];  // (P^T v)_perm[i] = v_i
  __syncwarp();
#pragma unroll
  for (int j = 0; j < N; ++j) x[j] = buf[N * lane + j];
  __syncwarp();
  warp_fwht(x, lane);
#pragma unroll
  for (int j = 0; j < N; ++j) x[j] = rot_neg1(w[j]) ? -x[j] : x[j];
}

// The inverse with the spec words read from global memory here.
template <int N>
__device__ __forceinline__ void rotate_row_inverse(float (&x)[N], const int32_t* spec, float* buf, int lane) {
  uint32_t w[N];
  load_rot_words(spec, lane, w);
  rotate_row_inverse(x, w, buf, lane);
}

// Row index ((phys * Hkv + kvh) * page + off) of logical token `tok`, or -1 when the token is
// past the split end or its page id is outside [0, P).
__device__ __forceinline__ int64_t token_row(const DecodeParams& p, const int32_t* bt_seq,
                                             int tok, int tok_end, int kvh) {
  if (tok >= tok_end) return -1;
  const uint32_t lp = p.pdiv.div(static_cast<uint32_t>(tok));
  const int off = tok - static_cast<int>(lp) * p.page_size;
  const int phys = __ldg(bt_seq + lp);
  if (phys < 0 || phys >= p.P) return -1;
  return (static_cast<int64_t>(phys) * p.Hkv + kvh) * p.page_size + off;
}

// Copy the code rows of one chunk (c.bytes per token, c.gran bytes per op) into smem rows of ROW
// bytes. Run-time sizes keep a single (not unrolled) copy loop per pool: small code, fast builds.
template <int ROW>
__device__ __forceinline__ void copy_code_rows(uint8_t* dst, const uint8_t* pool,
                                               const CopyPlan& c, const DecodeParams& p,
                                               const int32_t* bt_seq, int ctok0, int tok_end,
                                               int kvh) {
  const int nops = kChunk * c.segs;
#pragma unroll 1
  for (int op = threadIdx.x; op < nops; op += kThreads) {
    const int t = static_cast<int>(c.segdiv.div(static_cast<uint32_t>(op)));
    const int sg = op - t * c.segs;
    const int64_t row = token_row(p, bt_seq, ctok0 + t, tok_end, kvh);
    if (row < 0) continue;
    const uint8_t* src = pool + row * c.bytes + sg * c.gran;
    uint8_t* d = dst + t * ROW + sg * c.gran;
    if (c.gran == 16) {
      cp_async<16>(d, src);
    } else if (c.gran == 4) {
      cp_async<4>(d, src);
    } else {
      *reinterpret_cast<uint16_t*>(d) = __ldg(reinterpret_cast<const unsigned short*>(src));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Split kernel.
// ---------------------------------------------------------------------------------------------
// Coordinate dd of query head h's result for one split, from its softmax state (m in log2 units,
// l, and the unnormalised output acc): the final output when there is a single split, else the
// split's partial output and (at dd == 0) its log-sum-exp for the combine kernel.
// A head whose q_rot row is not all finite (`bad`) gets a NaN output row: with one split directly;
// else a NaN partial with lse = +inf in every split, which the combine turns into a NaN row
// (its weights are exp(inf - inf) = NaN).
__device__ __forceinline__ float head_output_value(float l, float acc, bool bad) {
  return bad ? __int_as_float(0x7fc00000) : l > 0.f ? acc / l : 0.f;
}

template <int D>
__device__ __forceinline__ void store_head_output(const DecodeParams& p, int seq, int h, int split,
                                                  int dd, float m, float l, float acc, bool bad) {
  const float o = head_output_value(l, acc, bad);
  const int64_t sh = static_cast<int64_t>(seq) * p.H + h;
  if (!writes_partials(p)) {
    p.out[sh * D + dd] = o;
    return;
  }
  const int64_t li = sh * p.pstride + split;
  p.pout[li * D + dd] = o;
  if (dd == 0) p.plse[li] = bad ? INFINITY : l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// The tensor-core kernels end the same way: each warp staged its (m, l, o) per query
// head of the tile in shared memory; merge them with log-sum-exp and write the split's partial (or
// the output when there is a single split). NH is the row width of the staging arrays (>= GT).
// W: warps per work item (blockDim.x = 32 * W, or 64 * W for v4's two items per CTA).
// rows_s (the fused rotation, one split): the rows go to rows_s[g * D + dd] instead, still rotated.
// T: the threads of one work item, 32 W unless warps pair up (a CTA of two items: half of them).
// SWZ: o_s rows in o_swizzled order (the tensor-core kernels at head_dim 128).
// Coordinate dd of head h's o_s row of 128 floats: its 16-byte unit XORed with h >> 1, so that the
// tensor-core kernels' float4 stores (a quarter warp: heads 2 t4 + hh, units 4 gid + j, gid of one
// parity pair) hit 8 distinct bank quads; a row is still read conflict-free in any order of units.
__host__ __device__ constexpr int o_swizzled(int h, int dd) { return h * 128 + (dd ^ ((h >> 1) << 2)); }
template <int D, int GT, int NH, int W = kWarps, int T = 32 * W, bool SWZ = false>
__device__ __forceinline__ void merge_warps_and_store(const DecodeParams& p, const float (&m_s)[W][NH],
                                                      const float (&l_s)[W][NH],
                                                      const float (&o_s)[W][NH * D], const int* bad_s,
                                                      int seq, int split, int kvh, int tile,
                                                      float* rows_s = nullptr) {
  static_assert(!SWZ || D == 128, "o_swizzled rows are 128 floats");
  for (int idx = threadIdx.x % T; idx < GT * D; idx += T) {  // T divides the CTA (two v4 items: 2T threads)
    const int g = idx / D;
    const int dd = idx - g * D;
    const int at = SWZ ? o_swizzled(g, dd) : idx;
    const int hl = tile * GT + g;
    if (hl >= p.G) continue;
    float M = m_s[0][g];
#pragma unroll
    for (int w = 1; w < W; ++w) M = fmaxf(M, m_s[w][g]);
    float L = 0.f, O = 0.f;
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float f = fast_exp2(m_s[w][g] - M);  // m = -inf -> 0 (its l and o are 0)
        L = fmaf(l_s[w][g], f, L);
        O = fmaf(o_s[w][at], f, O);
      }
    }
    if (rows_s != nullptr) rows_s[idx] = head_output_value(L, O, bad_s[g] != 0);
    else store_head_output<D>(p, seq, kvh * p.G + hl, split, dd, M, L, O, bad_s[g] != 0);
  }
}

// The two bfloat16 values of a 32-bit pair (lower half: the even coordinate) as float.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_DECODE_DEVICE_CUH_
