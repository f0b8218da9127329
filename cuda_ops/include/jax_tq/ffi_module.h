// jax_tq pybind11 module plumbing shared by jax_tq._cpu_ops (cpu_module.cc) and
// jax_tq._cuda_ops (cuda_module.cc): registrations() -> {target_name: capsule}, ffi_api_version().
// Host only.
#ifndef JAX_TQ_FFI_MODULE_H_
#define JAX_TQ_FFI_MODULE_H_

#include <type_traits>
#include <utility>

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace jax_tq {

template <typename T>
pybind11::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}

// {target_name: capsule} for the FFI targets of one platform (docs/DESIGN.md).
struct FfiHandlers {
  XLA_FFI_Handler* compress;
  XLA_FFI_Handler* decompress;
  XLA_FFI_Handler* write_cache;
  XLA_FFI_Handler* paged_decode;
  XLA_FFI_Handler* qjl_compress;
  XLA_FFI_Handler* qjl_scores;
  XLA_FFI_Handler* paged_prefill;
};

// A null handler (a kernel the module was built without) is left out.
inline pybind11::dict FfiRegistrations(const FfiHandlers& h) {
  pybind11::dict d;
  const std::pair<const char*, XLA_FFI_Handler*> targets[] = {
      {"jax_tq_compress", h.compress},         {"jax_tq_decompress", h.decompress},
      {"jax_tq_write_cache", h.write_cache},   {"jax_tq_paged_decode", h.paged_decode},
      {"jax_tq_qjl_compress", h.qjl_compress}, {"jax_tq_qjl_scores", h.qjl_scores},
      {"jax_tq_paged_prefill", h.paged_prefill}};
  for (const auto& [name, handler] : targets)
    if (handler != nullptr) d[name] = EncapsulateFfiHandler(handler);
  return d;
}

// (major, minor) of the XLA FFI API in the headers this module was compiled against: jax_tq/_ffi.py
// compares it with the installed jaxlib's before registering (a handler built against newer headers
// fails XLA's registration, which takes JAX's whole backend down with it).
inline pybind11::tuple FfiApiVersion() { return pybind11::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); }

}  // namespace jax_tq

#endif  // JAX_TQ_FFI_MODULE_H_
