// moe-praxis-gencode: sm_90a
// FP8 grouped GEMM, A x B^T (the forward and dgrad of MoEConfig.fp8='blockwise'):
//   out[rows of group g, n] = sum_k dq(a)[r, k] * dq(b[g])[n, k]
//   a [R, C] e4m3, a_scales [C/128, R] f32 (1 x 128 tiles along C, transposed), b [E, N, C]
//   e4m3, b_scales [E, C/128, N/128] f32 (128 x 128 blocks), group_sizes [E] int32
//   -> out [R, N] bf16; rows past sum(group_sizes) are zero. The forward passes the weight's
//   transposed copy qt [E, N, K] with its scales s; dgrad the weight q [E, K, N] (its N is the
//   contraction) with s transposed to [E, N/128, K/128]. See grouped_gemm_fp8.cuh.
#include "grouped_gemm_fp8.cuh"

namespace moe_fp8 {
namespace {

ffi::Error Fp8NtImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_scales,
                     ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scales,
                     ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::BF16> out,
                     ffi::ResultBuffer<ffi::U8> workspace, int64_t tile, int64_t raster,
                     int64_t swizzle) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  auto asd = a_scales.dimensions();
  auto bsd = b_scales.dimensions();
  auto od = out->dimensions();
  if (a.element_type() != ffi::F8E4M3FN || b.element_type() != ffi::F8E4M3FN) {
    return fp8_bad("nt: a and b must be float8_e4m3fn");
  }
  if (ad.size() != 2 || bd.size() != 3 || ad[1] != bd[2] ||
      group_sizes.element_count() != static_cast<size_t>(bd[0])) {
    return fp8_bad("nt: need a [R, C], b [E, N, C], group_sizes [E]");
  }
  const int64_t r = ad[0], c = ad[1], e = bd[0], n = bd[1];
  if (c % kBlock || n % kBlock) {
    return fp8_bad("nt: C=" + std::to_string(c) + " and N=" + std::to_string(n) +
                   " must be multiples of 128");
  }
  if (asd.size() != 2 || asd[0] != c / kBlock || asd[1] != r || bsd.size() != 3 ||
      bsd[0] != e || bsd[1] != c / kBlock || bsd[2] != n / kBlock || od.size() != 2 ||
      od[0] != r || od[1] != n) {
    return fp8_bad("nt: need a_scales [C/128, R], b_scales [E, C/128, N/128], out [R, N]");
  }
  Fp8Prepare p{};
  p.group_sizes = group_sizes.typed_data();
  p.num_groups = static_cast<int>(e);
  p.rows = r;
  p.wgrad = false;
  p.dim_n = static_cast<int>(n);
  p.dim_k = static_cast<int>(c);
  p.a = reinterpret_cast<const ElementIn*>(a.untyped_data());
  p.b = reinterpret_cast<const ElementIn*>(b.untyped_data());
  p.sa = a_scales.typed_data();
  p.sb = b_scales.typed_data();
  p.d = out->untyped_data();
  return run_fp8_tile<cutlass::bfloat16_t, kBlock>(stream, p,
                                           reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                                           static_cast<int64_t>(workspace->size_bytes()), tile,
                                           raster, swizzle);
}

}  // namespace
}  // namespace moe_fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmFp8Nt, moe_fp8::Fp8NtImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // a [R, C] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // a_scales [C/128, R]
                                  .Arg<xla::ffi::AnyBuffer>()               // b [E, N, C] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // b_scales
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out [R, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
