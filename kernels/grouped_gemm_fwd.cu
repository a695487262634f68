// moe-praxis-gencode: sm_90a
// Grouped GEMM forward: out[rows of group e] = lhs[rows of group e] @ rhs[e].
//   lhs [M, K] bf16 row-major, rhs [E, K, N] bf16, group_sizes [E] int32 -> out [M, N] bf16;
//   rows past sum(group_sizes) are zero. CUTLASS problem per group: (m_e, N, K), A row-major
//   (K-major), B row-major (N-major). See grouped_gemm.cuh for the launch sequence.
#include "grouped_gemm.cuh"

namespace moe_gg {
namespace {

ffi::Error GroupedGemmFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs,
                              ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::BF16> out,
                              ffi::ResultBuffer<ffi::U8> workspace, int64_t tile,
                              int64_t raster, int64_t swizzle, int64_t split_rows) {
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || ld[1] != rd[1] ||
      group_sizes.element_count() != static_cast<size_t>(rd[0])) {
    return moe_gg_common::shape_error(kWho, "fwd", "lhs [M,K], rhs [E,K,N], group_sizes [E]");
  }
  const int64_t m = ld[0], k = ld[1], e = rd[0], n = rd[2];
  const Schedule sched{raster, swizzle, split_rows};
  return dispatch_tile(tile, sched, [&](auto cfg) {
    using Def = GemmDef<cutlass::layout::RowMajor, cutlass::layout::RowMajor, decltype(cfg)>;
    PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, m, k, n,
                                          as_elem(lhs.untyped_data()),
                                          as_elem(rhs.untyped_data()),
                                          as_elem(out->untyped_data()), n);
    return run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(k),
                            make_ld_stride<typename Def::StrideB>(n),
                            make_ld_stride<typename Def::StrideD>(n),
                            reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                            static_cast<int64_t>(workspace->size_bytes()), sched);
  });
}

}  // namespace
}  // namespace moe_gg

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmFwd, moe_gg::GroupedGemmFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // lhs [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rhs [E, K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out [M, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
