// pybind11 module jax_tq._cuda_ops: registrations() -> {target_name: capsule} for the CUDA XLA FFI
// handlers (compress.cu, paged_decode.cu, paged_prefill.cu, qjl.cu), registered by jax_tq/_ffi.py with platform="CUDA".
// Target names, operands, results and attributes are those of the CPU module (docs/DESIGN.md).
// Also device_info() -> {"sm_count", "l2_bytes", "name", "cc_major", "cc_minor",
// "max_smem_per_block_optin"} for device 0 (used to choose the split-K count), and
// ring_fits(head_dim, k_bits, v_bits) (a diagnostic for the GPU tests).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include <pybind11/pybind11.h>

#include "jax_tq/ffi_module.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqCompressCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqDecompressCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqWriteCacheCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqPagedDecodeCuda);
// Kernels not yet run on a GPU (qjl.cu, paged_prefill.cu) are built and registered only with
// JAX_TQ_CUDA_UNVERIFIED=ON (CMake defines JTQ_CUDA_UNVERIFIED); CI builds them to keep them compiling.
#ifdef JTQ_CUDA_UNVERIFIED
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqQjlCompressCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqQjlScoresCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTqPagedPrefillCuda);
#define JTQ_UNVERIFIED_HANDLERS JaxTqQjlCompressCuda, JaxTqQjlScoresCuda, JaxTqPagedPrefillCuda
#else
#define JTQ_UNVERIFIED_HANDLERS nullptr, nullptr, nullptr
#endif

namespace jax_tq::cuda {
// paged_decode.cu: whether v4's ring kernel for (head_dim, K bits, V bits) keeps 2 CTAs per SM on
// the current device (head_dim 256: its warp pairs): 1 yes, 0 no (the handler then runs the
// register variant, or v1 at head_dim 256), -1 no such ring kernel.
int RingFitsOnDevice(int head_dim, int k_bits, int v_bits);
// Whether v4's kernel of `items` (2, 4 or 8) work items per CTA (head_dim 128, K4V4: one CTA of 16
// warps per SM) fits on the current device: 1 yes, 0 no (the handler runs the ring kernel of one
// item per CTA), -1 not built or no such kernel.
int ItemsFitOnDevice(int items);
bool ReadPhaseTrace(unsigned long long* dst);
int PhaseTraceWords();
}  // namespace jax_tq::cuda

PYBIND11_MODULE(_cuda_ops, m) {
  m.doc() = "jax_tq CUDA XLA FFI handlers";
  m.def("registrations", []() {
    return jax_tq::FfiRegistrations({JaxTqCompressCuda, JaxTqDecompressCuda, JaxTqWriteCacheCuda,
                                     JaxTqPagedDecodeCuda, JTQ_UNVERIFIED_HANDLERS});
  });
  m.def("ffi_api_version", &jax_tq::FfiApiVersion,
        "(major, minor) of the XLA FFI API in the headers this module was compiled against.");
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
  m.def("phase_trace", []() {
    std::string buf(static_cast<size_t>(jax_tq::cuda::PhaseTraceWords()) * 8, '\0');
    if (!jax_tq::cuda::ReadPhaseTrace(reinterpret_cast<unsigned long long*>(buf.data()))) {
      cudaGetLastError();
      throw std::runtime_error("jax_tq._cuda_ops.phase_trace: CUDA error");
    }
    return py::bytes(buf);
  }, "v4's phase trace (JAX_TQ_TRACE_PHASES=1): uint64 [2048 CTAs][8 warps][10 stamps][globaltimer ns, SM id], "
     "then zeroed (a diagnostic for benchmarks/phase_trace.py).");
  m.def("ring_fits", &jax_tq::cuda::RingFitsOnDevice, py::arg("head_dim"), py::arg("k_bits"), py::arg("v_bits"),
        "Whether v4's ring decode kernel for these widths keeps 2 CTAs per SM on the current device: 1 yes, "
        "0 no (the decode then runs a slower kernel), -1 no ring kernel for them.");
  m.def("items_fit", &jax_tq::cuda::ItemsFitOnDevice, py::arg("items") = 2,
        "Whether v4's kernel of `items` (2, 4 or 8) work items per CTA (head_dim 128, K4V4, 16 warps) fits on the "
        "current device: 1 yes, 0 no (the decode then runs one item per CTA), -1 not built or no such kernel.");
}
