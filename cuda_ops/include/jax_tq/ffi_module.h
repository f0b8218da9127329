// jax_tq pybind11 module plumbing shared by jax_tq._cpu_ops (cpu_module.cc) and
// jax_tq._cuda_ops (cuda_module.cc): registrations() -> {target_name: capsule}, ffi_api_version(),
// plan_decode(). Host only.
#ifndef JAX_TQ_FFI_MODULE_H_
#define JAX_TQ_FFI_MODULE_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include <pybind11/pybind11.h>

#include "jax_tq/decode_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tq {

template <typename T>
pybind11::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}

// {target_name: capsule} for the FFI targets of one platform (jax_tq/ops.h, docs/DESIGN.md). A
// null handler (a kernel the module was built without) is left out.
inline pybind11::dict FfiRegistrations(std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> targets) {
  pybind11::dict d;
  for (const auto& [name, handler] : targets)
    if (handler != nullptr) d[name] = EncapsulateFfiHandler(handler);
  return d;
}

// (major, minor) of the XLA FFI API in the headers this module was compiled against: jax_tq/_ffi.py
// compares it with the installed jaxlib's before registering (a handler built against newer headers
// fails XLA's registration, which takes JAX's whole backend down with it).
inline pybind11::tuple FfiApiVersion() { return pybind11::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); }

// m.plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_pages, page_size, k_bits, v_bits,
// f16_products, window, hadamard, num_splits=0, kernel=0, device=None) -> dict of the DecodePlan
// (decode_plan.h), kernel as its name; planner(problem, device) makes the plan.
template <class Planner>
void DefPlanDecode(pybind11::module_& m, Planner planner, const char* doc) {
  namespace py = pybind11;
  m.def(
      "plan_decode",
      [planner](int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_pages,
             int64_t page_size, int k_bits, int v_bits, bool f16_products, bool window, bool hadamard,
             int64_t num_splits, int kernel, bool variants, py::object device) {
        if (kernel < 0 || kernel > static_cast<int>(DecodeKernel::kTensorCoreF16))
          throw py::value_error("plan_decode: kernel must be 0 (auto), 1, 2 or 3");
        DecodeProblem p;
        p.num_seqs = num_seqs, p.num_heads = num_heads, p.num_kv_heads = num_kv_heads, p.head_dim = head_dim;
        p.max_pages = max_pages, p.page_size = page_size, p.k_bits = k_bits, p.v_bits = v_bits;
        p.f16_products = f16_products, p.window = window, p.hadamard = hadamard, p.num_splits = num_splits;
        p.kernel = static_cast<DecodeKernel>(kernel);
        p.variants = variants;
        if (const std::string error = decode_problem_error(p); !error.empty()) throw py::value_error("plan_decode: " + error);
        const DecodePlan plan = planner(p, device);
        py::dict d;
        d["kernel"] = kDecodeKernelNames[static_cast<int>(plan.kernel)];
        d["head_tile"] = plan.head_tile;
        d["ring"] = plan.ring;
        d["halves"] = plan.halves;
        d["items"] = plan.items;
        d["folds_window"] = plan.folds_window;
        d["fused_rotation"] = plan.fused_rotation;
        d["f16_rounding"] = plan.f16_rounding;
        d["num_splits"] = plan.num_splits;
        return d;
      },
      py::arg("num_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("max_pages"),
      py::arg("page_size"), py::arg("k_bits"), py::arg("v_bits"), py::arg("f16_products"), py::arg("window"),
      py::arg("hadamard"), py::arg("num_splits") = 0, py::arg("kernel") = 0, py::arg("variants") = false,
      py::arg("device") = py::none(), doc);
}

}  // namespace jax_tq

#endif  // JAX_TQ_FFI_MODULE_H_
