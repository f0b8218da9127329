// The Hadamard rotation of format.h (Pi = H D2 P H D1, spec words rot_perm / rot_neg1 / rot_neg2)
// applied to one vector of head_dim D (64 or 128) held by a warp: lane l holds coordinates
// (D / 32) l .. (D / 32) l + D / 32 - 1, contiguous. O(d log d) shuffles and adds instead of a
// d x d product; the same Pi as the dense matrix (jax_tq.rotation.hadamard_rotation) up to float32
// rounding.
#ifndef JAX_TQ_HADAMARD_CUH_
#define JAX_TQ_HADAMARD_CUH_

#include <cstdint>

#include "jax_tq/format.h"

namespace jax_tq {
namespace cuda {

// x <- H x (unnormalized Sylvester Hadamard: (H x)_i = sum_k (-1)^popcount(i & k) x_k) of one vector
// held by a group of LANES consecutive lanes, C coordinates each: the index bits of a lane's
// coordinates in registers, the log2(LANES) bits of its place in the group across lanes.
template <int C, int LANES>
__device__ __forceinline__ void group_fwht(float (&x)[C], int lane) {
#pragma unroll
  for (int s = 1; s < C; s <<= 1) {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      if (j & s) continue;
      const float a = x[j], b = x[j | s];
      x[j] = a + b;
      x[j | s] = a - b;
    }
  }
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) {
    const float sign = (lane & m) != 0 ? -1.f : 1.f;  // upper lane: y - x, lower: x + y (one FFMA, exact)
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const float y = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = fmaf(x[j], sign, y);
    }
  }
}

// H x of a vector of head_dim D held by a warp: lane l holds coordinates (D / 32) l .. + D / 32 - 1.
template <int D>
__device__ __forceinline__ void warp_fwht(float (&x)[D / 32], int lane) {
  group_fwht<D / 32, 32>(x, lane);
}

// x <- Pi x. w: the spec words of the lane's coordinates; buf: D floats of the warp's own (shared
// memory) for the permutation. The two 1 / sqrt(D) factors are the exact 1 / D applied first.
template <int D>
__device__ __forceinline__ void warp_hadamard_rotate(float (&x)[D / 32], const uint32_t (&w)[D / 32], float* buf,
                                                     int lane) {
  static_assert(D == 64 || D == 128, "warp Hadamard rotation: head_dim 64 or 128");
  constexpr int C = D / 32;
  constexpr float kInvD = 1.0f / D;
#pragma unroll
  for (int j = 0; j < C; ++j) x[j] = (rot_neg1(w[j]) ? -x[j] : x[j]) * kInvD;
  warp_fwht<D>(x, lane);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < C; ++j) buf[C * lane + j] = x[j];
  __syncwarp();
#pragma unroll
  for (int j = 0; j < C; ++j) {
    const float z = buf[rot_perm(w[j]) & (D - 1)];  // (P v)_i = v_perm[i]
    x[j] = rot_neg2(w[j]) ? -z : z;
  }
  __syncwarp();  // buf may be reused at once
  warp_fwht<D>(x, lane);
}

// Quad layout: the 4 lanes 4v .. 4v + 3 of a warp hold vector v of 8, lane g = lane & 3 holding
// coordinates 32 ch + 8 g + e (ch < D / 32, e < 8) at x[8 ch + e]: 8 consecutive coordinates per
// chunk (one packing group of codes), the 4 lanes' chunk contiguous in memory.
template <int D>
struct QuadLayout {
  static constexpr int kChunks = D / 32;
  static constexpr int kCoords = D / 4;  // per lane
  static __device__ __forceinline__ int coord(int ch, int g, int e) { return 32 * ch + 8 * g + e; }
};

// H x in the quad layout: the index bits of e and ch in registers, the two of g across the quad.
template <int D>
__device__ __forceinline__ void quad_fwht(float (&x)[D / 4], int lane) {
  group_fwht<D / 4, 4>(x, lane);
}

}  // namespace cuda
}  // namespace jax_tq

#endif  // JAX_TQ_HADAMARD_CUH_
