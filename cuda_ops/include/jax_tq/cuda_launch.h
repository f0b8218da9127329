// Launch helpers shared by the CUDA handlers (CUDA only; the CPU build never includes this).
#ifndef JAX_TQ_CUDA_LAUNCH_H_
#define JAX_TQ_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
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

// What `ask(device)` answers for the current device (a positive int; <= 0: no answer), asked once
// per device 0..63 and kept in `known` (one per question, static at its call site), or `fallback`
// where the device or the answer is unknown (not kept: asked again at the next call).
template <typename Ask>
int once_per_device(std::atomic<int> (&known)[64], int fallback, Ask ask) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return fallback;
  }
  int n = known[dev].load(std::memory_order_acquire);
  if (n > 0) return n;
  n = ask(dev);
  (void)cudaGetLastError();  // a refusal is an answer here, not an error for the next launch to find
  if (n <= 0) return fallback;
  known[dev].store(n, std::memory_order_release);
  return n;
}

// A device attribute of the current device (once per device), or `fallback`.
template <cudaDeviceAttr kAttribute>
int device_attribute(int fallback) {
  static std::atomic<int> known[64];
  return once_per_device(known, fallback, [](int dev) {
    int n = 0;
    return cudaDeviceGetAttribute(&n, kAttribute, dev) == cudaSuccess ? n : 0;
  });
}

// Streaming multiprocessors of the current device, or `fallback` where the runtime does not answer.
inline int device_sm_count(int fallback) { return device_attribute<cudaDevAttrMultiProcessorCount>(fallback); }

// The shared memory one CTA may opt in to on the current device (227 KB on sm_90, 163 KB on sm_80,
// 99 KB on sm_86 / sm_89), or 48 KB where the runtime does not answer.
inline int device_block_smem_optin() { return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024); }

// Whether `kernel`'s code on the current device was compiled for sm_90 or later (its PTX version: code
// JIT-compiled from compute_80 PTX, e.g. on a newer device than the build's SASS, has no
// griddepcontrol), asked once per device (`known`: one per kernel, static at the call site).
template <typename Kernel>
bool compiled_for_sm90(std::atomic<int> (&known)[64], Kernel kernel) {
  constexpr int kNo = 1, kYes = 2;
  return once_per_device(known, kNo, [kernel](int) {
    cudaFuncAttributes attributes = {};
    return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.ptxVersion >= 90 ? kYes : kNo;
  }) == kYes;
}

// Launch `kernel` as a programmatic dependent of the kernel before it on `stream` where `dependent`
// (the kernel runs griddepcontrol.wait: compiled_for_sm90, so the device is sm_90 or later): its
// CTAs may start once every CTA of the kernel before has run griddepcontrol.launch_dependents
// (pdl_launch_dependents), and wait (pdl_wait) before they read what that kernel writes. Else an
// ordinary launch.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_CUDA_LAUNCH_H_
