// Launch helpers shared by the CUDA handlers (CUDA only; the CPU build never includes this).
#ifndef JAX_TQ_CUDA_LAUNCH_H_
#define JAX_TQ_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

namespace jax_tq {
namespace cuda {

// Raise `kernel`'s dynamic shared-memory limit to `smem` bytes on the current device. The limit is
// a per-device function attribute: it must be set on every device the kernel runs on, not once per
// process. `done` (one per kernel, static at the call site) remembers devices 0..63; on others the
// attribute is set at every launch.
template <typename Kernel>
cudaError_t allow_dynamic_smem(std::atomic<uint64_t>& done, Kernel kernel, int smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t(1) << dev : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

// Launch `kernel` on `stream`; with `pdl` as a programmatic dependent launch: the kernel may start
// while its predecessor on the stream still runs, and must execute griddep_wait() before it reads
// anything the predecessor may write (or writes anything the predecessor reads).
template <typename Kernel, typename... Args>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Programmatic dependent launches: on devices of compute capability >= 9 unless JAX_TQ_CUDA_PDL=0
// (read once, for A/B timing).
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("JAX_TQ_CUDA_PDL");
    if (env && std::string(env) == "0") return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 9;
  }();
  return on;
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CUDA_LAUNCH_H_
