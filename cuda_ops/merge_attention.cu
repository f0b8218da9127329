// CUDA XLA FFI handler for jax_tq_merge_attention (docs/DESIGN.md; the CPU handler in
// merge_attention.cc states the semantics). A warp takes 8 rows, 4 lanes per row, 16-byte chunks: a
// warp whose rows all have weights (1, 0) and no check reads their 72 bytes and leaves, and a row
// that needs work has all of its loads in flight at once (head_dim 128, 16-bit: 4 chunks a lane).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "jax_tq/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tq {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kLanesPerRow = 4;
constexpr int kRowsPerWarp = 32 / kLanesPerRow;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kChunksInFlight = 4;  // per lane and operand
constexpr unsigned kAll = 0xffffffffu;

ffi_checks::Op cuda_op() { return ffi_checks::Op{"jax_tq_merge_attention", ffi_checks::kCudaTag}; }

__device__ float to_float(float x) { return x; }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return x;
}

// BYTES of a row's elements (16, or one pair of elements where a row is not a whole number of 16).
template <int BYTES> struct RawOf;
template <> struct RawOf<4> { using type = uint32_t; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<16> { using type = uint4; };

template <typename T, int BYTES>
struct Chunk {
  static constexpr int kElems = BYTES / int(sizeof(T));
  using Raw = typename RawOf<BYTES>::type;
  T e[kElems];
  __device__ static Chunk load(const T* p) {
    const Raw raw = *reinterpret_cast<const Raw*>(p);
    Chunk c;
    memcpy(c.e, &raw, BYTES);
    return c;
  }
  __device__ static Chunk zero() {
    Chunk c;
    for (int i = 0; i < kElems; ++i) c.e[i] = from_float<T>(0.0f);
    return c;
  }
  __device__ void store(T* p) const {
    Raw raw;
    memcpy(&raw, e, BYTES);
    *reinterpret_cast<Raw*>(p) = raw;
  }
};

// w x v, or exactly 0 for a zero weight (whatever v holds).
__device__ float term(float w, float v) { return w != 0.0f ? __fmul_rn(w, v) : 0.0f; }

// Whether every element of the lane's chunks of row `base` of q is finite.
template <typename T, int BYTES>
__device__ bool chunks_finite(const T* q, int64_t base, int sub, int chunks) {
  using C = Chunk<T, BYTES>;
  bool finite = true;
  for (int c = sub; c < chunks; c += kLanesPerRow) {
    const C x = C::load(q + base + int64_t(c) * C::kElems);
#pragma unroll
    for (int i = 0; i < C::kElems; ++i) finite = finite && isfinite(to_float(x.e[i]));
  }
  return finite;
}

// Rows of 8 per warp, 4 lanes per row (kLanesPerRow), BYTES-chunks c = sub, sub + 4, ... of a row
// to lane sub: NaN where `check` and the row's query is not finite, else unless the weights are
// (1, 0) w0 x out + w1 x other, each operand read only under a non-zero weight.
template <typename T, int BYTES>
__global__ void __launch_bounds__(32 * kWarps) merge_attention_kernel(T* __restrict__ out, const T* __restrict__ other,
                                                                     const float2* weights, const T* q,
                                                                     const bool* check, int64_t rows, int d) {
  using C = Chunk<T, BYTES>;
  const int lane = threadIdx.x % 32, sub = lane % kLanesPerRow;
  const int64_t row = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kRowsPerWarp + lane / kLanesPerRow;
  const bool inside = row < rows;
  const float2 w = inside ? weights[row] : float2{1.0f, 0.0f};
  const bool checked = inside && check[row];
  const bool work = checked || w.x != 1.0f || w.y != 0.0f;
  if (!__any_sync(kAll, work)) return;
  const int chunks = d / C::kElems;
  const int64_t base = row * d;
  bool poisoned = false;
  if (__any_sync(kAll, checked)) {
    bool finite = !checked || chunks_finite<T, BYTES>(q, base, sub, chunks);
#pragma unroll
    for (int m = 1; m < kLanesPerRow; m *= 2) finite = __shfl_xor_sync(kAll, finite, m) && finite;
    poisoned = !finite;
  }
  if (!work || (!poisoned && w.x == 1.0f && w.y == 0.0f)) return;
  const float nan = __int_as_float(0x7fc00000);
  for (int c0 = sub; c0 < chunks; c0 += kLanesPerRow * kChunksInFlight) {
    C a[kChunksInFlight], b[kChunksInFlight];
#pragma unroll
    for (int k = 0; k < kChunksInFlight; ++k) {
      const int c = c0 + k * kLanesPerRow;
      const bool read = c < chunks && !poisoned;
      const int64_t at = base + int64_t(c) * C::kElems;
      a[k] = read && w.x != 0.0f ? C::load(out + at) : C::zero();
      b[k] = read && w.y != 0.0f ? C::load(other + at) : C::zero();
    }
#pragma unroll
    for (int k = 0; k < kChunksInFlight; ++k) {
      const int c = c0 + k * kLanesPerRow;
      if (c >= chunks) break;
      C r;
#pragma unroll
      for (int i = 0; i < C::kElems; ++i) {
        const float v = __fadd_rn(term(w.x, to_float(a[k].e[i])), term(w.y, to_float(b[k].e[i])));
        r.e[i] = from_float<T>(poisoned ? nan : v);
      }
      r.store(out + base + int64_t(c) * C::kElems);
    }
  }
}

template <typename T, int BYTES>
cudaError_t launch_chunks(cudaStream_t stream, void* out, const void* other, const float* weights, const void* q,
                          const bool* check, int64_t rows, int d) {
  const unsigned blocks = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  merge_attention_kernel<T, BYTES><<<blocks, 32 * kWarps, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(other), reinterpret_cast<const float2*>(weights),
      static_cast<const T*>(q), check, rows, d);
  return cudaGetLastError();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte chunks where rows are whole numbers of them and the buffers 16-byte aligned, else pairs.
template <typename T>
cudaError_t launch(cudaStream_t stream, void* out, const void* other, const float* weights, const void* q,
                   const bool* check, int64_t rows, int d) {
  const bool wide = (int64_t(d) * sizeof(T)) % 16 == 0 && aligned16(out) && aligned16(other) && aligned16(q);
  return wide ? launch_chunks<T, 16>(stream, out, other, weights, q, check, rows, d)
              : launch_chunks<T, 2 * sizeof(T)>(stream, out, other, weights, q, check, rows, d);
}

}  // namespace

ffi::Error MergeAttentionCudaImpl(cudaStream_t stream, ffi::AnyBuffer out, ffi::AnyBuffer other,
                                  ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer q, ffi::Buffer<ffi::PRED> check,
                                  ffi::Result<ffi::AnyBuffer> result) {
  ffi_checks::MergeDims dims;
  JTQ_RETURN_IF_ERROR(ffi_checks::validate_merge_attention(cuda_op(), out, other, weights, q, check, *result, &dims));
  if (dims.rows == 0) return ffi::Error::Success();
  if ((dims.rows + kRowsPerBlock - 1) / kRowsPerBlock > 2147483647) return cuda_op().invalid("too many rows x heads");
  void* dst = result->untyped_data();
  if (dst != out.untyped_data()) {  // XLA honours the alias; a copy keeps this correct anyway
    if (cudaError_t e = cudaMemcpyAsync(dst, out.untyped_data(), result->size_bytes(), cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return cuda_op().internal(std::string("copy: ") + cudaGetErrorString(e));
  }
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    return launch<T>(stream, dst, other.untyped_data(), weights.typed_data(), q.untyped_data(), check.typed_data(),
                     dims.rows, int(dims.d));
  };
  const ffi::DataType t = out.element_type();
  const cudaError_t e = t == ffi::DataType::F32    ? run(float{})
                        : t == ffi::DataType::BF16 ? run(__nv_bfloat16{})
                                                   : run(__half{});
  if (e != cudaSuccess) return cuda_op().internal(std::string("kernel launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqMergeAttentionCuda, jax_tq::cuda::MergeAttentionCudaImpl,
                              jax_tq::ffi_checks::BindMergeAttention(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
