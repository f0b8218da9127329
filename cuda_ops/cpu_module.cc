// pybind11 module jax_tq._cpu_ops: registrations() -> {target_name: capsule} of the CPU handlers
// (the op table, jax_tq/ops.h; each handler is defined beside its implementation), ffi_api_version()
// and plan_decode().
#include <cstdint>
#include <string>

#include <pybind11/pybind11.h>

#include "jax_tq/decode_plan.h"
#include "jax_tq/ffi_module.h"
#include "jax_tq/ops.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;

#define JTQ_DECLARE_CPU(name, Stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTq##Stem##Cpu);
JAX_TQ_OPS(JTQ_DECLARE_CPU)
#undef JTQ_DECLARE_CPU

namespace {
// DeviceCaps of a GPU described by a dict (see plan_decode's doc below).
jax_tq::DeviceCaps DescribedGpu(const py::object& device) {
  if (!py::isinstance<py::dict>(device))
    throw py::type_error("plan_decode: device must be None or a dict {sm_count, f32_ctas_per_sm, f16_ctas_per_sm, "
                         "ring_fits, items_fit}");
  const py::dict d = device.cast<py::dict>();
  auto count = [&](const char* key, int64_t most) {
    if (!d.contains(key)) throw py::key_error(std::string("plan_decode: device has no '") + key + "'");
    const py::object v = d[key];
    if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
      throw py::type_error(std::string("plan_decode: device['") + key + "'] must be an int");
    const int64_t n = v.cast<int64_t>();
    if (n < 1 || n > most)
      throw py::value_error(std::string("plan_decode: device['") + key + "'] must be in [1, " + std::to_string(most) + "]");
    return n;
  };
  jax_tq::DeviceCaps caps;
  caps.cuda = true;
  caps.sm_count = count("sm_count", 1 << 16);
  caps.f32_ctas_per_sm = count("f32_ctas_per_sm", 64);
  caps.f16_ctas_per_sm = count("f16_ctas_per_sm", 64);
  const bool ring = d["ring_fits"].cast<bool>(), items = d["items_fit"].cast<bool>();
  caps.ring_fits = [ring, items](int, int, int, int, int, int n) { return n > 1 ? items : ring; };
  return caps;
}
}  // namespace

PYBIND11_MODULE(_cpu_ops, m) {
  m.doc() = "jax_tq CPU XLA FFI handlers";
  m.def("registrations", []() {
#define JTQ_CPU_TARGET(name, Stem) {"jax_tq_" #name, JaxTq##Stem##Cpu},
    return jax_tq::FfiRegistrations({JAX_TQ_OPS(JTQ_CPU_TARGET)});
#undef JTQ_CPU_TARGET
  });
  m.def("ffi_api_version", &jax_tq::FfiApiVersion,
        "(major, minor) of the XLA FFI API in the headers this module was compiled against.");
  m.attr("variant_targets") = py::make_tuple("jax_tq_paged_decode", "jax_tq_paged_prefill");  // every attention op
  jax_tq::DefPlanDecode(
      m,
      [](const jax_tq::DecodeProblem& problem, py::object device) {
        return jax_tq::plan_decode(problem, device.is_none() ? jax_tq::DeviceCaps{} : DescribedGpu(device));
      },
      "The decode plan of the CPU kernel (device=None), or of the CUDA kernels on a GPU described by `device`: "
      "{'sm_count', 'f32_ctas_per_sm', 'f16_ctas_per_sm', 'ring_fits', 'items_fit'} (the last two: bool, whether "
      "the float16 kernel's ring variants keep their residency), for tests of GPU plans on any machine.");
}
