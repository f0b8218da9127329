// CUDA XLA FFI handlers for the QJL family (TurboQuant_prod, docs/DESIGN.md):
//   jax_tq_qjl_compress: a CTA of 8 warps takes kVecs vectors; warp w normalises vector w; for each
//     output coordinate a warp reads one row of Pi (then of S) coalesced and reduces the products
//     for all kVecs vectors at once (each row read serves kVecs vectors); codes, residuals and
//     sketched residuals stay in shared memory until the packing step.
//   jax_tq_qjl_scores: a CTA of 128 threads takes 128 keys of one batch entry, a thread one key; the
//     queries (Pi q and S Pi q) pass through shared memory kQueries at a time and every thread
//     reads the same query element (a broadcast). CUDA-core fp32 FMA.
// Operand checks are shared with the CPU handlers (jax_tq/ffi_checks.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jax_tq/cuda_warp.h"
#include "jax_tq/ffi_checks.h"
#include "jax_tq/format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kVecs = 8;           // vectors per compress CTA
constexpr int kCompressThreads = 256;
constexpr int kScoreThreads = 128;  // keys per scores CTA
constexpr int kQueries = 8;        // queries per pass through shared memory

enum class FType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float load_x(const void* x, int ft, int64_t i) {
  if (ft == int(FType::kF32)) return static_cast<const float*>(x)[i];
  if (ft == int(FType::kBF16)) return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
  return __half2float(static_cast<const __half*>(x)[i]);
}

// out[v][j] = sum_k m[j, k] * in[v][k] for every j of this warp (j = warp, warp + 8, ...): lanes
// read a row of m coalesced; every lane ends with the kVecs sums of output j.
template <typename Epilogue>
__device__ void warp_rows_matvec(const float* __restrict__ m, const float (*in)[kMaxHeadDim], int d,
                                 Epilogue epilogue) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int j = warp; j < d; j += kCompressThreads / 32) {
    float acc[kVecs] = {};
    for (int k = lane; k < d; k += 32) {
      const float mjk = __ldg(m + int64_t(j) * d + k);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) acc[v] = fmaf(mjk, in[v][k], acc[v]);
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) acc[v] = warp_sum(acc[v]);
    if (lane < kVecs) {
      float mine = acc[0];
#pragma unroll
      for (int v = 1; v < kVecs; ++v) mine = lane == v ? acc[v] : mine;
      epilogue(lane, j, mine);
    }
  }
}

__global__ void __launch_bounds__(kCompressThreads)
qjl_compress_kernel(const void* __restrict__ x, int ft, const float* __restrict__ rotation,
                    const float* __restrict__ centroids, const float* __restrict__ sketch, int64_t n,
                    int d, int bits, uint8_t* __restrict__ codes, float* __restrict__ norms,
                    uint8_t* __restrict__ signs, float* __restrict__ gamma) {
  __shared__ float unit[kVecs][kMaxHeadDim];
  __shared__ float residual[kVecs][kMaxHeadDim];
  __shared__ uint8_t code[kVecs][kMaxHeadDim];
  __shared__ uint8_t positive[kVecs][kMaxHeadDim];
  __shared__ float cent[kMaxCentroids], bound[kMaxCentroids];
  const int levels = 1 << bits;
  const int64_t first = int64_t(blockIdx.x) * kVecs;
  if (threadIdx.x < levels) cent[threadIdx.x] = centroids[threadIdx.x];
  if (threadIdx.x + 1 < levels) bound[threadIdx.x] = centroid_boundary(centroids, threadIdx.x);

  // Norm of vector w by warp w, on x / max|x| (no overflow or underflow of the squares).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp < kVecs) {
    const int64_t row = first + warp;
    const bool valid = row < n;
    float xs[kMaxHeadDim / 32];
    float largest = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) {
      const int k = lane + 32 * i;
      xs[i] = valid && k < d ? load_x(x, ft, row * d + k) : 0.f;
      largest = fmaxf(largest, fabsf(xs[i]));
    }
    largest = warp_max(largest);
    const float inv_largest = largest > 0.f ? 1.f / largest : 0.f;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) ss = fmaf(xs[i] * inv_largest, xs[i] * inv_largest, ss);
    ss = warp_sum(ss);
    const float root = sqrtf(ss);
    const float inv_root = root > 0.f ? 1.f / root : 0.f;
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) {
      const int k = lane + 32 * i;
      if (k < d) unit[warp][k] = xs[i] * inv_largest * inv_root;
    }
    if (valid && lane == 0) norms[row] = largest * root;
  }
  __syncthreads();

  warp_rows_matvec(rotation, unit, d, [&](int v, int j, float y) {
    const uint32_t c = bucketize(y, bound, levels - 1);
    code[v][j] = uint8_t(c);
    residual[v][j] = y - cent[c];
  });
  __syncthreads();

  if (warp < kVecs) {
    float rr = 0.f;
    for (int k = lane; k < d; k += 32) rr = fmaf(residual[warp][k], residual[warp][k], rr);
    rr = warp_sum(rr);
    if (lane == 0 && first + warp < n) gamma[first + warp] = sqrtf(rr);
  }
  warp_rows_matvec(sketch, residual, d, [&](int v, int j, float s) { positive[v][j] = s >= 0.f; });
  __syncthreads();

  // Pack: thread t takes group g of vector v (8 codes -> `bits` bytes, 8 signs -> 1 byte).
  const int groups = d / 8;
  for (int t = threadIdx.x; t < kVecs * groups; t += kCompressThreads) {
    const int v = t / groups, g = t % groups;
    const int64_t row = first + v;
    if (row >= n) continue;
    uint32_t word = 0, sign_byte = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      word |= uint32_t(code[v][8 * g + k]) << (bits * k);
      sign_byte |= uint32_t(positive[v][8 * g + k]) << k;
    }
    uint8_t* out = codes + row * packed_bytes(d, bits) + int64_t(g) * bits;
    for (int i = 0; i < bits; ++i) out[i] = uint8_t(word >> (8 * i));
    signs[row * sign_bytes(d) + g] = uint8_t(sign_byte);
  }
}

// One batch entry's scores for this CTA's keys (see qjl_scores_kernel).
__device__ void qjl_scores_batch(const float* __restrict__ q_rot, const float* __restrict__ q_sketch,
                                 const uint8_t* __restrict__ codes, const float* __restrict__ norms,
                                 const uint8_t* __restrict__ signs, const float* __restrict__ gamma,
                                 const float* cent, float (*qr)[kMaxHeadDim], float (*qs)[kMaxHeadDim],
                                 int64_t b, int64_t key, bool valid, int64_t num_queries, int64_t num_keys,
                                 int d, int bits, float qjl_scale, float* __restrict__ scores) {
  const int64_t flat_key = b * num_keys + (valid ? key : 0);
  const uint8_t* key_codes = codes + flat_key * packed_bytes(d, bits);
  const uint8_t* key_signs = signs + flat_key * sign_bytes(d);
  const float norm = valid ? norms[flat_key] : 0.f;
  const float qjl_weight = valid ? qjl_scale * gamma[flat_key] : 0.f;

  for (int64_t q0 = 0; q0 < num_queries; q0 += kQueries) {
    __syncthreads();  // the previous pass (or batch entry) has read qr / qs, and cent is written
    for (int i = threadIdx.x; i < kQueries * d; i += kScoreThreads) {
      const int qi = i / d, j = i % d;
      const bool real = q0 + qi < num_queries;
      const int64_t at = (b * num_queries + q0 + qi) * d + j;
      qr[qi][j] = real ? q_rot[at] : 0.f;
      qs[qi][j] = real ? q_sketch[at] : 0.f;
    }
    __syncthreads();
    float mse[kQueries] = {}, qjl[kQueries] = {};
    for (int g = 0; valid && g < d / 8; ++g) {
      const uint32_t nibbles = group8_nibbles(key_codes, g, bits);
      const uint32_t sign_byte = key_signs[g];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float c = cent[(nibbles >> (4 * k)) & 0xFu];
        const bool plus = (sign_byte >> k) & 1u;
#pragma unroll
        for (int qi = 0; qi < kQueries; ++qi) {
          mse[qi] = fmaf(qr[qi][8 * g + k], c, mse[qi]);
          const float s = qs[qi][8 * g + k];
          qjl[qi] += plus ? s : -s;
        }
      }
    }
#pragma unroll
    for (int qi = 0; qi < kQueries; ++qi) {
      if (valid && q0 + qi < num_queries)
        scores[(b * num_queries + q0 + qi) * num_keys + key] = norm * (mse[qi] + qjl_weight * qjl[qi]);
    }
  }
}

__global__ void __launch_bounds__(kScoreThreads)
qjl_scores_kernel(const float* __restrict__ q_rot, const float* __restrict__ q_sketch,
                  const uint8_t* __restrict__ codes, const float* __restrict__ norms,
                  const uint8_t* __restrict__ signs, const float* __restrict__ gamma,
                  const float* __restrict__ centroids, int64_t num_batches, int64_t num_queries,
                  int64_t num_keys, int d, int bits, float qjl_scale, float* __restrict__ scores) {
  __shared__ float qr[kQueries][kMaxHeadDim];
  __shared__ float qs[kQueries][kMaxHeadDim];
  __shared__ float cent[kMaxCentroids];
  if (threadIdx.x < (1 << bits)) cent[threadIdx.x] = centroids[threadIdx.x];
  const int64_t key = int64_t(blockIdx.x) * kScoreThreads + threadIdx.x;
  const bool valid = key < num_keys;
  for (int64_t b = blockIdx.y; b < num_batches; b += gridDim.y)  // grid.y is at most 65535
    qjl_scores_batch(q_rot, q_sketch, codes, norms, signs, gamma, cent, qr, qs, b, key, valid, num_queries,
                     num_keys, d, bits, qjl_scale, scores);
}

ffi_checks::Op cuda_op(const char* op) { return ffi_checks::Op{op, ffi_checks::kCudaTag}; }

int ftype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return int(FType::kF32);
    case ffi::DataType::BF16: return int(FType::kBF16);
    case ffi::DataType::F16: return int(FType::kF16);
    default: return -1;
  }
}

ffi::Error launched(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return cuda_op(op).internal(std::string("kernel launch: ") + cudaGetErrorString(e));
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

}  // namespace

ffi::Error QjlCompressCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                               ffi::Buffer<ffi::F32> centroids, ffi::Buffer<ffi::F32> sketch,
                               ffi::Result<ffi::Buffer<ffi::U8>> codes,
                               ffi::Result<ffi::Buffer<ffi::F32>> norms,
                               ffi::Result<ffi::Buffer<ffi::U8>> signs,
                               ffi::Result<ffi::Buffer<ffi::F32>> gamma, int32_t bits) {
  static const char* op = "jax_tq_qjl_compress";
  const int ft = ftype_of(x.element_type());
  if (ft < 0) return cuda_op(op).invalid("x dtype must be float32, bfloat16 or float16");
  ffi_checks::QjlCompressDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_qjl_compress(cuda_op(op), x, rotation, centroids, sketch,
                                                        *codes, *norms, *signs, *gamma, bits, &dims));
  if (dims.n == 0) return ffi::Error::Success();
  const int64_t blocks = (dims.n + kVecs - 1) / kVecs;
  if (blocks > kMaxGridX) return cuda_op(op).invalid("too many vectors: " + std::to_string(dims.n));
  qjl_compress_kernel<<<unsigned(blocks), kCompressThreads, 0, stream>>>(
      x.untyped_data(), ft, rotation.typed_data(), centroids.typed_data(), sketch.typed_data(), dims.n,
      int(dims.d), bits, codes->typed_data(), norms->typed_data(), signs->typed_data(), gamma->typed_data());
  return launched(op);
}

ffi::Error QjlScoresCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> q_rot,
                             ffi::Buffer<ffi::F32> q_sketch, ffi::Buffer<ffi::U8> codes,
                             ffi::Buffer<ffi::F32> norms, ffi::Buffer<ffi::U8> signs,
                             ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> centroids,
                             ffi::Result<ffi::Buffer<ffi::F32>> scores, int32_t bits, float qjl_scale) {
  static const char* op = "jax_tq_qjl_scores";
  ffi_checks::QjlScoresDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_qjl_scores(cuda_op(op), q_rot, q_sketch, codes, norms, signs,
                                                      gamma, centroids, *scores, bits, &dims));
  if (dims.b == 0 || dims.q == 0 || dims.s == 0) return ffi::Error::Success();
  const int64_t key_blocks = (dims.s + kScoreThreads - 1) / kScoreThreads;
  if (key_blocks > kMaxGridX) return cuda_op(op).invalid("too many keys: " + std::to_string(dims.s));
  const dim3 grid(unsigned(key_blocks), unsigned(dims.b < kMaxGridY ? dims.b : kMaxGridY));
  qjl_scores_kernel<<<grid, kScoreThreads, 0, stream>>>(
      q_rot.typed_data(), q_sketch.typed_data(), codes.typed_data(), norms.typed_data(), signs.typed_data(),
      gamma.typed_data(), centroids.typed_data(), dims.b, dims.q, dims.s, int(dims.d), bits, qjl_scale,
      scores->typed_data());
  return launched(op);
}

}  // namespace cuda
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlCompressCuda, jax_tq::cuda::QjlCompressCudaImpl,
                              jax_tq::ffi_checks::BindQjlCompress(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlScoresCuda, jax_tq::cuda::QjlScoresCudaImpl,
                              jax_tq::ffi_checks::BindQjlScores(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
