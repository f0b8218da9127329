// pybind11 module jax_tq._cuda_ops: registrations() -> {target_name: capsule} for the CUDA XLA FFI
// handlers (compress.cu, paged_decode.cu, paged_prefill.cu, qjl.cu), registered by jax_tq/_ffi.py with platform="CUDA".
// Target names, operands, results and attributes are those of the CPU module (docs/DESIGN.md).
// Also device_info() -> {"sm_count", "l2_bytes", "name", "cc_major", "cc_minor",
// "max_smem_per_block_optin", "max_smem_per_sm"} for a device, plan_decode(...) (the decode plan on
// the current device) and, in builds with JAX_TQ_TRACE_PHASES=ON, phase_trace().
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include <pybind11/pybind11.h>

#include "jax_tq/ffi_module.h"
#include "jax_tq/ops.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

// The op table's CUDA handlers. qjl_compress has none (XLA's code of its reference is faster): its
// weak symbol is null, and registrations() leaves it out.
#define JTQ_DECLARE_CUDA(name, Stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTq##Stem##Cuda);
JAX_TQ_OPS(JTQ_DECLARE_CUDA)
#undef JTQ_DECLARE_CUDA
extern "C" __attribute__((weak)) XLA_FFI_Error* JaxTqQjlCompressCuda(XLA_FFI_CallFrame* call_frame);

namespace jax_tq::cuda {
DecodePlan PlanDecodeOnDevice(const DecodeProblem& problem);  // paged_decode.cu
#ifdef JTQ_TRACE_PHASES
bool ReadPhaseTrace(unsigned long long* dst);
int PhaseTraceWords();
#endif
}  // namespace jax_tq::cuda

PYBIND11_MODULE(_cuda_ops, m) {
  m.doc() = "jax_tq CUDA XLA FFI handlers";
  m.def("registrations", []() {
#define JTQ_CUDA_TARGET(name, Stem) {"jax_tq_" #name, JaxTq##Stem##Cuda},
    return jax_tq::FfiRegistrations({JAX_TQ_OPS(JTQ_CUDA_TARGET)});
#undef JTQ_CUDA_TARGET
  });
  m.def("ffi_api_version", &jax_tq::FfiApiVersion,
        "(major, minor) of the XLA FFI API in the headers this module was compiled against.");
  // The ops whose kernels serve sliding_window / soft_cap / sinks in this build (jax_tq/backend.py
  // kernel_lacks): paged_decode's and paged_prefill's kernels.
  m.attr("variant_targets") = py::make_tuple("jax_tq_paged_decode", "jax_tq_paged_prefill");
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
  jax_tq::DefPlanDecode(
      m,
      [](const jax_tq::DecodeProblem& problem, py::object device) {
        if (!device.is_none()) throw py::value_error("_cuda_ops.plan_decode plans for the current device: device=None");
        return jax_tq::cuda::PlanDecodeOnDevice(problem);
      },
      "The decode plan on the current device (jax_tq/decode_plan.h).");
#ifdef JTQ_TRACE_PHASES
  m.def("phase_trace", []() {
    std::string buf(static_cast<size_t>(jax_tq::cuda::PhaseTraceWords()) * 8, '\0');
    if (!jax_tq::cuda::ReadPhaseTrace(reinterpret_cast<unsigned long long*>(buf.data()))) {
      cudaGetLastError();
      throw std::runtime_error("jax_tq._cuda_ops.phase_trace: CUDA error");
    }
    return py::bytes(buf);
  }, "The float16 tensor-core kernel's phase trace (builds with JAX_TQ_TRACE_PHASES=ON): uint64 [2048 CTAs][8 "
     "warps][10 stamps][globaltimer ns, SM id], then zeroed (a diagnostic for benchmarks/phase_trace.py).");
#endif
}
