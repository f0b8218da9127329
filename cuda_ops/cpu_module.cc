// pybind11 module jax_tq._cpu_ops: registrations() -> {target_name: capsule}.
// Operand / result / attribute binding (docs/DESIGN.md) is shared with the CUDA handlers:
// jax_tq/ffi_checks.h (Bind*).
#include <cstdint>

#include <pybind11/pybind11.h>

#include "jax_tq/ffi_checks.h"
#include "jax_tq/ffi_module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace py = pybind11;

// Implementations (compress.cc, paged_decode.cc, paged_prefill.cc, qjl.cc).
namespace jax_tq {
namespace cpu {
ffi::Error CompressImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                        ffi::Buffer<ffi::F32> centroids,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits,
                        int32_t fit_scale);
ffi::Error DecompressImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> norms,
                          ffi::Buffer<ffi::F32> rotation, ffi::Buffer<ffi::F32> centroids,
                          ffi::Result<ffi::AnyBuffer> x, int32_t bits);
ffi::Error WriteCacheImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::U8> k_codes_in,
                          ffi::Buffer<ffi::F32> k_norms_in, ffi::Buffer<ffi::U8> v_codes_in,
                          ffi::Buffer<ffi::F32> v_norms_in, ffi::Buffer<ffi::F32> k_rotation,
                          ffi::Buffer<ffi::F32> k_centroids, ffi::Buffer<ffi::F32> v_rotation,
                          ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> slot_mapping,
                          ffi::Buffer<ffi::BF16> k_window_in, ffi::Buffer<ffi::BF16> v_window_in,
                          ffi::Buffer<ffi::S32> window_slots, ffi::Buffer<ffi::S32> rotation_spec,
                          ffi::Result<ffi::Buffer<ffi::U8>> k_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> k_norms_out,
                          ffi::Result<ffi::Buffer<ffi::U8>> v_codes_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> v_norms_out,
                          ffi::Result<ffi::Buffer<ffi::BF16>> k_window_out,
                          ffi::Result<ffi::Buffer<ffi::BF16>> v_window_out, int32_t k_bits,
                          int32_t v_bits, int32_t k_fit_scale, int32_t v_fit_scale);
ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                           ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                           ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                           ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::BF16> k_window,
                           ffi::Buffer<ffi::BF16> v_window, ffi::Buffer<ffi::S32> window_ids,
                           ffi::Buffer<ffi::S32> rotation,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_rot,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t k_bits,
                           int32_t v_bits, int32_t num_splits, float scale,
                           int32_t f16_products, int32_t kernel);
ffi::Error QjlCompressImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                           ffi::Buffer<ffi::F32> centroids, ffi::Buffer<ffi::F32> sketch,
                           ffi::Result<ffi::Buffer<ffi::U8>> codes,
                           ffi::Result<ffi::Buffer<ffi::F32>> norms,
                           ffi::Result<ffi::Buffer<ffi::U8>> signs,
                           ffi::Result<ffi::Buffer<ffi::F32>> gamma, int32_t bits);
ffi::Error QjlScoresImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::F32> q_sketch,
                         ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> norms,
                         ffi::Buffer<ffi::U8> signs, ffi::Buffer<ffi::F32> gamma,
                         ffi::Buffer<ffi::F32> centroids, ffi::Result<ffi::Buffer<ffi::F32>> scores,
                         int32_t bits, float qjl_scale);
ffi::Error PagedPrefillImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                            ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                            ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                            ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::BF16> k_window,
                            ffi::Buffer<ffi::BF16> v_window, ffi::Buffer<ffi::S32> window_ids,
                            ffi::Buffer<ffi::S32> query_start_loc,
                            ffi::Result<ffi::Buffer<ffi::F32>> out_rot, int32_t k_bits, int32_t v_bits,
                            float scale);
}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressCpu, jax_tq::cpu::CompressImpl,
                              jax_tq::ffi_checks::BindCompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqDecompressCpu, jax_tq::cpu::DecompressImpl,
                              jax_tq::ffi_checks::BindDecompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqWriteCacheCpu, jax_tq::cpu::WriteCacheImpl,
                              jax_tq::ffi_checks::BindWriteCache(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedDecodeCpu, jax_tq::cpu::PagedDecodeImpl,
                              jax_tq::ffi_checks::BindPagedDecode(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlCompressCpu, jax_tq::cpu::QjlCompressImpl,
                              jax_tq::ffi_checks::BindQjlCompress(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqQjlScoresCpu, jax_tq::cpu::QjlScoresImpl,
                              jax_tq::ffi_checks::BindQjlScores(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedPrefillCpu, jax_tq::cpu::PagedPrefillImpl,
                              jax_tq::ffi_checks::BindPagedPrefill(ffi::Ffi::Bind()));

namespace {
// DeviceCaps of a GPU described by a dict (see plan_decode's doc below).
jax_tq::DeviceCaps DescribedGpu(const py::object& device) {
  const py::dict d = device.cast<py::dict>();
  jax_tq::DeviceCaps caps;
  caps.cuda = true;
  caps.sm_count = d["sm_count"].cast<int64_t>();
  caps.f32_ctas_per_sm = d["f32_ctas_per_sm"].cast<int64_t>();
  caps.f16_ctas_per_sm = d["f16_ctas_per_sm"].cast<int64_t>();
  const bool ring = d["ring_fits"].cast<bool>(), items = d["items_fit"].cast<bool>();
  caps.ring_fits = [ring, items](int, int, int, int, int, int n) { return n > 1 ? items : ring; };
  return caps;
}
}  // namespace

PYBIND11_MODULE(_cpu_ops, m) {
  m.doc() = "jax_tq CPU XLA FFI handlers";
  m.def("registrations", []() {
    return jax_tq::FfiRegistrations({JaxTqCompressCpu, JaxTqDecompressCpu, JaxTqWriteCacheCpu,
                                     JaxTqPagedDecodeCpu, JaxTqQjlCompressCpu, JaxTqQjlScoresCpu,
                                     JaxTqPagedPrefillCpu});
  });
  m.def("ffi_api_version", &jax_tq::FfiApiVersion,
        "(major, minor) of the XLA FFI API in the headers this module was compiled against.");
  jax_tq::DefPlanDecode(
      m,
      [](const jax_tq::DecodeProblem& problem, py::object device) {
        return jax_tq::plan_decode(problem, device.is_none() ? jax_tq::DeviceCaps{} : DescribedGpu(device));
      },
      "The decode plan of the CPU kernel (device=None), or of the CUDA kernels on a GPU described by `device`: "
      "{'sm_count', 'f32_ctas_per_sm', 'f16_ctas_per_sm', 'ring_fits', 'items_fit'} (the last two: bool, whether "
      "the float16 kernel's ring variants keep their residency), for tests of GPU plans on any machine.");
}
