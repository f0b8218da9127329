// CUDA XLA FFI handler of the QJL scores (TurboQuant_prod, docs/DESIGN.md):
//   jax_tq_qjl_scores: a CTA of 128 threads takes 128 keys of one batch entry, a thread one key; the
//     queries (Pi q and S Pi q) pass through shared memory kQueries at a time and every thread
//     reads the same query element (a broadcast). CUDA-core fp32 FMA.
// jax_tq_qjl_compress has no CUDA kernel: on the H200 one (a warp per output coordinate, 8 vectors
// per CTA) took 12.0 ms for 1M x 128 bf16 vectors against 2.8 ms for XLA's code of the reference,
// which serves the op on the GPU (docs/performance.md).
// Operand checks are shared with the CPU handlers (jax_tq/ffi_checks.h).
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

constexpr int kScoreThreads = 128;  // keys per scores CTA
constexpr int kQueries = 8;        // queries per pass through shared memory

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

ffi::Error launched(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return cuda_op(op).internal(std::string("kernel launch: ") + cudaGetErrorString(e));
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

}  // namespace

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlScoresCuda, jax_tq::cuda::QjlScoresCudaImpl,
                              jax_tq::ffi_checks::BindQjlScores(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
