// pybind11 module jax_tq._cpu_ops: registrations() -> {target_name: capsule}.
// Operand / result / attribute binding follows docs/DESIGN.md exactly.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace py = pybind11;

// Implementations (compress.cc, paged_decode.cc).
namespace jax_tq {
namespace cpu {
ffi::Error CompressImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> rotation,
                        ffi::Buffer<ffi::F32> centroids,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::F32>> norms, int32_t bits);
ffi::Error DecompressImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> norms,
                          ffi::Buffer<ffi::F32> rotation, ffi::Buffer<ffi::F32> centroids,
                          ffi::Result<ffi::AnyBuffer> x, int32_t bits);
ffi::Error CompressWriteImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes_in,
                             ffi::Buffer<ffi::F32> norms_in, ffi::Buffer<ffi::F32> rotation,
                             ffi::Buffer<ffi::F32> centroids, ffi::Buffer<ffi::S32> slot_mapping,
                             ffi::Result<ffi::Buffer<ffi::U8>> codes_out,
                             ffi::Result<ffi::Buffer<ffi::F32>> norms_out, int32_t bits);
ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::U8> k_codes,
                           ffi::Buffer<ffi::F32> k_norms, ffi::Buffer<ffi::U8> v_codes,
                           ffi::Buffer<ffi::F32> v_norms, ffi::Buffer<ffi::F32> k_centroids,
                           ffi::Buffer<ffi::F32> v_centroids, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_rot,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t k_bits,
                           int32_t v_bits, int32_t num_splits, float scale);
}  // namespace cpu
}  // namespace jax_tq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressCpu, jax_tq::cpu::CompressImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // x [N, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Ret<ffi::Buffer<ffi::U8>>()     // codes [N, packed]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // norms [N]
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqDecompressCpu, jax_tq::cpu::DecompressImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()     // codes [N, packed]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norms [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Ret<ffi::AnyBuffer>()           // x [N, d]
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqCompressWriteCpu, jax_tq::cpu::CompressWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // x [T, Hkv, d]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // codes [P, Hkv, page, packed]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // norms [P, Hkv, page]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // rotation [d, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // centroids [2**bits]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_mapping [T]
                                  .Ret<ffi::Buffer<ffi::U8>>()     // codes (aliases operand 1)
                                  .Ret<ffi::Buffer<ffi::F32>>()    // norms (aliases operand 2)
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTqPagedDecodeCpu, jax_tq::cpu::PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q_rot [S, H, d]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // k_codes
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_norms
                                  .Arg<ffi::Buffer<ffi::U8>>()     // v_codes
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v_norms
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_centroids
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v_centroids
                                  .Arg<ffi::Buffer<ffi::S32>>()    // block_tables [S, max_pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // seq_lens [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out_rot [S, H, d]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // partial_out [S, H, ns, d]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // partial_lse [S, H, ns]
                                  .Attr<int32_t>("k_bits")
                                  .Attr<int32_t>("v_bits")
                                  .Attr<int32_t>("num_splits")
                                  .Attr<float>("scale"));

namespace {

template <typename T>
py::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

PYBIND11_MODULE(_cpu_ops, m) {
  m.doc() = "jax_tq CPU XLA FFI handlers";
  m.def("registrations", []() {
    py::dict d;
    d["jax_tq_compress"] = EncapsulateFfiHandler(JaxTqCompressCpu);
    d["jax_tq_decompress"] = EncapsulateFfiHandler(JaxTqDecompressCpu);
    d["jax_tq_compress_write"] = EncapsulateFfiHandler(JaxTqCompressWriteCpu);
    d["jax_tq_paged_decode"] = EncapsulateFfiHandler(JaxTqPagedDecodeCpu);
    return d;
  });
}
