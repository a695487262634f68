// Shared by the FP8 quantization kernels (fp8_quant.cu: L1, SwiGLU + L1, permute + L1;
// fp8_quant_tiles.cu: L2 and L3), which write the layouts the FP8 grouped GEMMs read
// (moe_praxis/ops/fp8/quant.py states them and holds the pure-JAX references these kernels equal
// bitwise):
//
//   scale = amax(tile) * f32(1/448)   (1 for an all-zero tile)
//   q     = e4m3(x * (1 / scale))     (one IEEE float32 reciprocal per tile, a float32 product
//                                      per element, round to nearest even, satfinite)
//
// The inputs are finite: a NaN or inf input is not a case the recipe defines.
#pragma once

#include <cuda_fp8.h>

#include <string>

#include "moe_common.h"

namespace moe {
namespace fp8q {

constexpr int kTile = 128;
constexpr int kThreads = 256;
// f32(1/448), the reference's np.float32(1 / 448): the scale is a product with it, so every
// implementation rounds it the same way
constexpr float kInvMax = 0x1.24924ap-9f;

__device__ __forceinline__ float tile_scale(float amax) {
  return amax > 0.f ? amax * kInvMax : 1.f;
}

// The reference's reciprocal of a scale: IEEE float32 division (round to nearest), whatever the
// compiler flags.
__device__ __forceinline__ float reciprocal(float s) { return __fdiv_rn(1.f, s); }

// e4m3 of v * inv (inv = reciprocal(scale)); __fmul_rn keeps the product a plain rounded
// multiply.
__device__ __forceinline__ uint8_t to_e4m3(float v, float inv) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, inv), __NV_SATFINITE, __NV_E4M3));
}

inline bool is_float(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
}

inline std::string dims_text(const ffi::AnyBuffer& x) {
  std::string out = "[";
  for (size_t i = 0; i < x.dimensions().size(); ++i) {
    out += (i ? ", " : "") + std::to_string(x.dimensions()[i]);
  }
  return out + "]";
}

}  // namespace fp8q
}  // namespace moe
