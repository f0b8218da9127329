// pybind11 module jax_tq._cuda_ops: registrations() -> {target_name: capsule} for the CUDA XLA FFI
// handlers (compress.cu, paged_decode.cu), registered by jax_tq/_ffi.py with platform="CUDA".
// Target names, operands, results and attributes are those of the CPU module (docs/DESIGN.md).
// Also device_info() -> {"sm_count", "l2_bytes", "name", "cc_major", "cc_minor",
// "max_smem_per_block_optin"} for device 0 (used to choose the split-K count).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <pybind11/pybind11.h>

#include "jax_tq/ffi_module.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqCompressCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqDecompressCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqWriteCacheCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqPagedDecodeCuda);

PYBIND11_MODULE(_cuda_ops, m) {
  m.doc() = "jax_tq CUDA XLA FFI handlers";
  m.def("registrations", []() {
    return jax_tq::FfiRegistrations(JaxTqCompressCuda, JaxTqDecompressCuda, JaxTqWriteCacheCuda,
                                    JaxTqPagedDecodeCuda);
  });
  m.def(
      "device_info",
      [](int device) {
        py::dict d;
        cudaDeviceProp prop;
        cudaError_t e = cudaGetDeviceProperties(&prop, device);
        if (e != cudaSuccess) {
          cudaGetLastError();  // clear the sticky-free error state
          throw std::runtime_error(std::string("jax_tq._cuda_ops.device_info: ") +
                                   cudaGetErrorString(e));
        }
        d["name"] = std::string(prop.name);
        d["sm_count"] = prop.multiProcessorCount;
        d["l2_bytes"] = prop.l2CacheSize;
        d["cc_major"] = prop.major;
        d["cc_minor"] = prop.minor;
        d["max_smem_per_block_optin"] = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
        d["max_smem_per_sm"] = static_cast<int64_t>(prop.sharedMemPerMultiprocessor);
        return d;
      },
      py::arg("device") = 0);
}
