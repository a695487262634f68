// The FP8 wgrad handler body, shared by grouped_gemm_fp8_wgrad.cu (bf16 out) and
// grouped_gemm_fp8_wgrad_f32.cu (float32 out, for float32 master weights): two files, so that
// the two CUTLASS instantiations compile in parallel.
//   out[g] [C1, C2] = sum over group g's rows r of dq(x)[r, c1] * dq(dy)[r, c2]
//   xt [C1, Rp] e4m3, x_scales [Rp/128, C1] f32, dyt [C2, Rp] e4m3, dy_scales [Rp/128, C2] f32
//   (grouped, transposed 128 x 1 tiles: grouped_gemm_fp8.cuh), group_sizes [E] int32 -> out
//   [E, C1, C2]; rows of x / dy: R with Rp = round_up(R + 127 * E, 128), passed as `rows`.
#pragma once

#include "grouped_gemm_fp8.cuh"

namespace moe_fp8 {

template <class ElementD, class OutBuffer>
ffi::Error fp8_wgrad(cudaStream_t stream, ffi::AnyBuffer xt, ffi::Buffer<ffi::F32> x_scales,
                     ffi::AnyBuffer dyt, ffi::Buffer<ffi::F32> dy_scales,
                     ffi::Buffer<ffi::S32> group_sizes, OutBuffer out,
                     ffi::ResultBuffer<ffi::U8> workspace, int64_t rows, int64_t tile,
                     int64_t raster, int64_t swizzle) {
  auto xd = xt.dimensions();
  auto dd = dyt.dimensions();
  auto xsd = x_scales.dimensions();
  auto dsd = dy_scales.dimensions();
  auto od = out->dimensions();
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (xt.element_type() != ffi::F8E4M3FN || dyt.element_type() != ffi::F8E4M3FN) {
    return fp8_bad("wgrad: xt and dyt must be float8_e4m3fn");
  }
  if (xd.size() != 2 || dd.size() != 2 || xd[1] != dd[1]) {
    return fp8_bad("wgrad: need xt [C1, Rp], dyt [C2, Rp]");
  }
  const int64_t c1 = xd[0], c2 = dd[0], rp = xd[1];
  const int64_t want_rp = (rows + (kBlock - 1) * e + kBlock - 1) / kBlock * kBlock;
  if (rows < 0 || rp != want_rp) {
    return fp8_bad("wgrad: Rp=" + std::to_string(rp) + " must be round_up(rows + 127 * E, 128) = " +
                   std::to_string(want_rp) + " for rows=" + std::to_string(rows) +
                   ", E=" + std::to_string(e));
  }
  if (c1 % kBlock || c2 % kBlock) {
    return fp8_bad("wgrad: C1=" + std::to_string(c1) + " and C2=" + std::to_string(c2) +
                   " must be multiples of 128");
  }
  if (xsd.size() != 2 || xsd[0] != rp / kBlock || xsd[1] != c1 || dsd.size() != 2 ||
      dsd[0] != rp / kBlock || dsd[1] != c2 || od.size() != 3 || od[0] != e || od[1] != c1 ||
      od[2] != c2) {
    return fp8_bad("wgrad: need x_scales [Rp/128, C1], dy_scales [Rp/128, C2], out [E, C1, C2]");
  }
  Fp8Prepare p{};
  p.group_sizes = group_sizes.typed_data();
  p.num_groups = static_cast<int>(e);
  p.rows = rows;
  p.wgrad = true;
  p.dim_m = static_cast<int>(c1);
  p.dim_n = static_cast<int>(c2);
  p.dim_k = 0;
  p.rp = rp;
  p.a = reinterpret_cast<const ElementIn*>(xt.untyped_data());
  p.b = reinterpret_cast<const ElementIn*>(dyt.untyped_data());
  p.sa = x_scales.typed_data();
  p.sb = dy_scales.typed_data();
  p.d = out->untyped_data();
  return run_fp8_tile<ElementD, 1>(stream, p, reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                                static_cast<int64_t>(workspace->size_bytes()), tile, raster,
                                swizzle);
}

}  // namespace moe_fp8

#define MOE_FP8_WGRAD_BIND(OUT_TYPE)                                                      \
  xla::ffi::Ffi::Bind()                                                                   \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                      \
      .Arg<xla::ffi::AnyBuffer>()             /* xt [C1, Rp] e4m3 */                      \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* x_scales [Rp/128, C1] */                 \
      .Arg<xla::ffi::AnyBuffer>()             /* dyt [C2, Rp] e4m3 */                     \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* dy_scales [Rp/128, C2] */                \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* group_sizes [E] */                       \
      .Ret<xla::ffi::Buffer<OUT_TYPE>>()      /* out [E, C1, C2] */                       \
      .Ret<xla::ffi::Buffer<xla::ffi::U8>>()  /* workspace */                             \
      .Attr<int64_t>("rows")                                                              \
      .Attr<int64_t>("tile")                                                              \
      .Attr<int64_t>("raster")                                                            \
      .Attr<int64_t>("swizzle")
