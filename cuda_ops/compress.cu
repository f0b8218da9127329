// CUDA XLA FFI handlers for the compress family (see docs/DESIGN.md):
//   jax_tq_compress, jax_tq_decompress, jax_tq_compress_write.
//
// All three are one tiled fp32 GEMM kernel (CUDA-core FMA, no tensor cores, so that codes match
// the float32 reference except at exact ties), with a fused prologue / epilogue:
//   compress:   prologue loads a tile of MV vectors (f32 / bf16 / f16), computes the fp32 norms
//               (fixed summation order), normalises (u = x * (1 / norm), 0 for a zero vector) into
//               shared memory [d][MV] (k-major); main loop y = u @ Pi^T with Pi^T streamed through
//               shared memory in k-tiles; epilogue bucketizes (binary search over the midpoints of
//               the centroids: code = #boundaries < y), packs (format.h bit layout) and writes the
//               codes + norms, either to rows [N] or, for compress_write, to the paged slots.
//   decompress: prologue decodes the codes to centroid values [d][MV]; main loop x = c @ Pi;
//               epilogue scales by the norm and writes f32 / bf16 / f16 rows (coalesced).
// Grid: ceil(N / MV) CTAs of 256 threads (16 x 16); a thread owns VPT vectors x d/16 outputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kThreads = 256;

enum class FType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

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
  // compress / compress_write
  const void* x;           // [N, D] input (compress) ; unused for decompress
  uint8_t* codes;          // compress: [N, pb] or pool [P, Hkv, page, pb]; decompress: input
  float* norms;            // compress: [N] or pool [P, Hkv, page]; decompress: input
  const float* rot;        // [D, D]
  const float* cent;       // [2**bits]
  const int32_t* slots;    // compress_write only (else nullptr)
  void* out;               // decompress output [N, D]
  int64_t N;
  int bits;
  int dtype;               // FType of x (compress) or out (decompress)
  bool vec_io;             // 16-byte vector access to x / out allowed (alignment)
  int Hkv, page_size;      // compress_write
  int64_t total_slots;     // compress_write: P * page_size
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

// Byte offset of the packed row of vector n (compress / compress_write), or -1 to skip.
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

template <int D, int VPT, bool DECOMP>
__global__ void __launch_bounds__(kThreads) tq_gemm_kernel(const GemmParams p) {
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
      const float norm = sqrtf(s);
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
    __syncthreads();  // everyone is done reading U: reuse it for the codes
    uint8_t* codes_s = reinterpret_cast<uint8_t*>(U);  // [MV][D]
    const int half = 1 << (bits - 1);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = ty * VPT + i;
#pragma unroll
      for (int j = 0; j < ON; ++j) {
        const float y = acc[i][j];
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
        if (row >= 0) p.norms[row] = nrm[tid];
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

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::string check_dims(const char* op, const char* name, ffi::Span<const int64_t> dims,
                       std::initializer_list<int64_t> want) {
  bool ok = dims.size() == want.size();
  if (ok) {
    size_t i = 0;
    for (int64_t w : want) ok = ok && dims[i++] == w;
  }
  if (ok) return {};
  std::string ws = "[";
  size_t i = 0;
  for (int64_t w : want) {
    if (i++) ws += ", ";
    ws += std::to_string(w);
  }
  return std::string(op) + " (CUDA): " + name + " has shape " + dims_str(dims) + ", expected " +
         ws + "]";
}

#define JTQ_CHECK_DIMS(op, name, dims, ...)                                 \
  do {                                                                      \
    std::string _msg = check_dims(op, name, dims, __VA_ARGS__);             \
    if (!_msg.empty()) return ffi::Error::InvalidArgument(std::move(_msg)); \
  } while (0)

ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + " (CUDA): " + msg);
}

ffi::Error cuda_error(const char* op, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(op) + " (CUDA): " + what + ": " + cudaGetErrorString(e));
}

ffi::Error check_bits_dim(const char* op, int32_t bits, int64_t d) {
  if (!is_supported_bits(bits))
    return invalid(op, "bits must be 2, 3 or 4, got " + std::to_string(bits));
  if (!is_supported_head_dim(static_cast<int>(d)))
    return invalid(op, "head_dim must be one of 64, 80, 96, 128, 192, 256, got " + std::to_string(d));
  return ffi::Error::Success();
}

int ftype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return static_cast<int>(FType::kF32);
    case ffi::DataType::BF16: return static_cast<int>(FType::kBF16);
    case ffi::DataType::F16: return static_cast<int>(FType::kF16);
    default: return -1;
  }
}

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
    return 132;
  return n;
}

template <int D, int VPT, bool DECOMP>
ffi::Error launch_gemm_t(const char* op, cudaStream_t stream, const GemmParams& p) {
  using L = GemmLayout<D, VPT>;
  auto kernel = tq_gemm_kernel<D, VPT, DECOMP>;
  constexpr int smem = L::total;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return cuda_error(op, "cudaFuncSetAttribute", e);
  }
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
  // Large batches: 64 vectors per CTA (more reuse of each Pi tile); small ones (a decode step's
  // write): 16 per CTA so that enough CTAs run.
  const bool big = (p.N + 63) / 64 >= 2 * static_cast<int64_t>(sm_count());
  switch (d) {
    case 64: return big ? launch_gemm_t<64, 4, DECOMP>(op, stream, p) : launch_gemm_t<64, 1, DECOMP>(op, stream, p);
    case 80: return big ? launch_gemm_t<80, 4, DECOMP>(op, stream, p) : launch_gemm_t<80, 1, DECOMP>(op, stream, p);
    case 96: return big ? launch_gemm_t<96, 4, DECOMP>(op, stream, p) : launch_gemm_t<96, 1, DECOMP>(op, stream, p);
    case 128: return big ? launch_gemm_t<128, 4, DECOMP>(op, stream, p) : launch_gemm_t<128, 1, DECOMP>(op, stream, p);
    case 192: return big ? launch_gemm_t<192, 4, DECOMP>(op, stream, p) : launch_gemm_t<192, 1, DECOMP>(op, stream, p);
    case 256: return big ? launch_gemm_t<256, 4, DECOMP>(op, stream, p) : launch_gemm_t<256, 1, DECOMP>(op, stream, p);
    default: return invalid(op, "unsupported head_dim " + std::to_string(d));
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }
bool aligned4(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 3u) == 0; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// jax_tq_compress: x [N, d] -> codes [N, packed], norms [N]
// ---------------------------------------------------------------------------------------------
ffi::Error CompressCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                            ffi::Buffer<ffi::F32> centroids,
                            ffi::Result<ffi::Buffer<ffi::U8>> codes,
                            ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits) {
  static const char* op = "jax_tq_compress";
  const int ft = ftype_of(x.element_type());
  if (ft < 0) return invalid(op, "x dtype must be float32, bfloat16 or float16");
  const auto xd = x.dimensions();
  if (xd.size() != 2) return invalid(op, "x must be rank 2 [N, d], got " + dims_str(xd));
  const int64_t n = xd[0], d = xd[1];
  if (auto e = check_bits_dim(op, bits, d); e.failure()) return e;
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  JTQ_CHECK_DIMS(op, "rotation", rotation.dimensions(), {d, d});
  JTQ_CHECK_DIMS(op, "centroids", centroids.dimensions(), {int64_t(1) << bits});
  JTQ_CHECK_DIMS(op, "codes (result)", codes->dimensions(), {n, pb});
  JTQ_CHECK_DIMS(op, "norms (result)", norms->dimensions(), {n});
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
  return launch_gemm<false>(op, stream, static_cast<int>(d), p);
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
  const auto xd = x->dimensions();
  if (xd.size() != 2) return invalid(op, "result x must be rank 2 [N, d], got " + dims_str(xd));
  const int64_t n = xd[0], d = xd[1];
  if (auto e = check_bits_dim(op, bits, d); e.failure()) return e;
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  JTQ_CHECK_DIMS(op, "codes", codes.dimensions(), {n, pb});
  JTQ_CHECK_DIMS(op, "norms", norms.dimensions(), {n});
  JTQ_CHECK_DIMS(op, "rotation", rotation.dimensions(), {d, d});
  JTQ_CHECK_DIMS(op, "centroids", centroids.dimensions(), {int64_t(1) << bits});

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
  return launch_gemm<true>(op, stream, static_cast<int>(d), p);
}

// ---------------------------------------------------------------------------------------------
// jax_tq_compress_write: x [T, Hkv, d] written into paged codes/norms at slot_mapping.
// ---------------------------------------------------------------------------------------------
ffi::Error CompressWriteCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::U8> codes_in, ffi::Buffer<ffi::F32> norms_in,
                                 ffi::Buffer<ffi::F32> rotation, ffi::Buffer<ffi::F32> centroids,
                                 ffi::Buffer<ffi::S32> slot_mapping,
                                 ffi::Result<ffi::Buffer<ffi::U8>> codes_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> norms_out, int32_t bits) {
  static const char* op = "jax_tq_compress_write";
  const int ft = ftype_of(x.element_type());
  if (ft < 0) return invalid(op, "x dtype must be float32, bfloat16 or float16");
  const auto xd = x.dimensions();
  if (xd.size() != 3) return invalid(op, "x must be rank 3 [T, Hkv, d], got " + dims_str(xd));
  const int64_t t_n = xd[0], hkv = xd[1], d = xd[2];
  if (auto e = check_bits_dim(op, bits, d); e.failure()) return e;
  const int64_t pb = packed_bytes(static_cast<int>(d), bits);
  const auto cd = codes_in.dimensions();
  if (cd.size() != 4)
    return invalid(op, "codes must be rank 4 [P, Hkv, page_size, packed], got " + dims_str(cd));
  const int64_t num_pages = cd[0], page_size = cd[2];
  JTQ_CHECK_DIMS(op, "codes", cd, {num_pages, hkv, page_size, pb});
  JTQ_CHECK_DIMS(op, "norms", norms_in.dimensions(), {num_pages, hkv, page_size});
  JTQ_CHECK_DIMS(op, "rotation", rotation.dimensions(), {d, d});
  JTQ_CHECK_DIMS(op, "centroids", centroids.dimensions(), {int64_t(1) << bits});
  JTQ_CHECK_DIMS(op, "slot_mapping", slot_mapping.dimensions(), {t_n});
  JTQ_CHECK_DIMS(op, "codes (result)", codes_out->dimensions(), {num_pages, hkv, page_size, pb});
  JTQ_CHECK_DIMS(op, "norms (result)", norms_out->dimensions(), {num_pages, hkv, page_size});

  uint8_t* cp = codes_out->typed_data();
  float* np_ = norms_out->typed_data();
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
  if (t_n == 0 || hkv == 0 || num_pages == 0 || page_size == 0) return ffi::Error::Success();

  GemmParams p{};
  p.x = x.untyped_data();
  p.codes = cp;
  p.norms = np_;
  p.rot = rotation.typed_data();
  p.cent = centroids.typed_data();
  p.slots = slot_mapping.typed_data();
  p.out = nullptr;
  p.N = t_n * hkv;
  p.bits = bits;
  p.dtype = ft;
  p.vec_io = aligned16(p.x);
  p.Hkv = static_cast<int>(hkv);
  p.page_size = static_cast<int>(page_size);
  p.total_slots = num_pages * page_size;
  if (!aligned16(p.rot)) return invalid(op, "rotation buffer is not 16-byte aligned");
  return launch_gemm<false>(op, stream, static_cast<int>(d), p);
}

}  // namespace cuda
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressCuda, jax_tq::cuda::CompressCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // x [N, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Ret<ffi::Buffer<ffi::U8>>()     // codes [N, packed]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // norms [N]
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqDecompressCuda, jax_tq::cuda::DecompressCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()     // codes [N, packed]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norms [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Ret<ffi::AnyBuffer>()           // x [N, d]
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressWriteCuda, jax_tq::cuda::CompressWriteCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // x [T, Hkv, d]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // codes [P, Hkv, page, packed]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norms [P, Hkv, page]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_mapping [T]
                                  .Ret<ffi::Buffer<ffi::U8>>()     // codes (aliases operand 1)
                                  .Ret<ffi::Buffer<ffi::F32>>()    // norms (aliases operand 2)
                                  .Attr<int32_t>("bits"));
