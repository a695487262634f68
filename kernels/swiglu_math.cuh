// The SwiGLU kernels' sigmoid and forward activation, shared by kernels/swiglu.cu and the SwiGLU forward that writes
// FP8 (kernels/fp8_quant.cu), so both compute bitwise the same activation.
#pragma once

#include "moe_common.h"

namespace moe {

// sigmoid in f32. For bf16 inputs and outputs the fast intrinsics (ex2.approx, approximate
// division: ~2 ulp of f32) are used: their error is far below the one rounding of the output to
// bf16 (8 mantissa bits), and the accurate expf + IEEE division made the bf16 forward
// instruction-bound and slower than XLA on the H200 (benchmarks/results/kernels_history.md,
// "swiglu.cu: sigmoid_t<__nv_bfloat16>"). f32 keeps the accurate functions (its
// tests compare at 1e-6). Large |g|: __expf(-g) -> inf gives __fdividef(1, inf) = 0, as expected.
template <typename T>
__device__ __forceinline__ float sigmoid_t(float g) {
  return 1.f / (1.f + expf(-g));
}
template <>
__device__ __forceinline__ float sigmoid_t<__nv_bfloat16>(float g) {
  return __fdividef(1.f, 1.f + __expf(-g));
}

// The forward's activation before its one rounding: silu(x) * u * wr (wr = 1 without weights).
template <typename T>
__device__ __forceinline__ float swiglu_act(float x, float u, float wr) {
  return x * sigmoid_t<T>(x) * u * wr;
}

}  // namespace moe
