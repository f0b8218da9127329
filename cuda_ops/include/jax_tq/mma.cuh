// mma.sync helpers shared by the tensor-core kernels (decode_tensor_core.cuh,
// prefill_tensor_core.cuh): the m16n8k16 f16 MMA with f32 accumulators, f16x2 packing.
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (.f16 A / B, .f32 C / D).
#ifndef JAX_TQ_MMA_CUH_
#define JAX_TQ_MMA_CUH_

#include <cuda_fp16.h>

#include <cstdint>

namespace jax_tq {
namespace cuda {
namespace {

// D += A * B: A 16 x 16 (row-major, four f16x2), B 16 x 8 ("col", two f16x2), D 16 x 8 f32.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  return *reinterpret_cast<const uint32_t*>(&h);
}

// f16x2(x0, x1), x0 in the lower half, rounded to nearest; out-of-range values saturate to +-65504
// (NaN stays NaN), so a weight never becomes an f16 infinity.
__device__ __forceinline__ uint32_t half2_satfinite(float x0, float x1) {
  uint32_t h;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}

// Four 8 x 8 b16 matrices from shared memory (lane i gives the address of row i % 8 of matrix
// i / 8): r[m] holds matrix m in the B fragment layout (lane: row lane / 4, elements 2 (lane % 4),
// +1); .trans: matrix m transposed (lane: column lane / 4, rows 2 (lane % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row_addr));
}

}  // namespace
}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_MMA_CUH_
