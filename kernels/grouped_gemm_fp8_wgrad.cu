// moe-praxis-gencode: sm_90a
// FP8 grouped GEMM wgrad, bf16 output (grouped_gemm_fp8_wgrad.cuh).
#include "grouped_gemm_fp8_wgrad.cuh"

namespace {
xla::ffi::Error Fp8WgradImpl(cudaStream_t stream, xla::ffi::AnyBuffer xt,
                             xla::ffi::Buffer<xla::ffi::F32> xs, xla::ffi::AnyBuffer dyt,
                             xla::ffi::Buffer<xla::ffi::F32> dys,
                             xla::ffi::Buffer<xla::ffi::S32> gs,
                             xla::ffi::ResultBuffer<xla::ffi::BF16> out,
                             xla::ffi::ResultBuffer<xla::ffi::U8> ws, int64_t rows, int64_t tile,
                             int64_t raster, int64_t swizzle) {
  return moe_fp8::fp8_wgrad<cutlass::bfloat16_t>(stream, xt, xs, dyt, dys, gs, out, ws, rows,
                                                 tile, raster, swizzle);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmFp8Wgrad, Fp8WgradImpl,
                              MOE_FP8_WGRAD_BIND(xla::ffi::BF16),
                              {xla::ffi::Traits::kCmdBufferCompatible});
