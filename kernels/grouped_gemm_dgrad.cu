// moe-praxis-gencode: sm_90a
// Grouped GEMM dgrad: dlhs[rows of group e] = dout[rows of group e] @ rhs[e]^T.
//   dout [M, N] bf16, rhs [E, K, N] bf16, group_sizes [E] int32 -> dlhs [M, K] bf16; rows past
//   sum(group_sizes) are zero. CUTLASS problem per group: (m_e, K, N), A = dout row-major
//   (contraction-major), B = rhs[e] read as column-major [N, K] (contraction-major): no
//   transpose is materialised. See grouped_gemm.cuh for the launch sequence.
#include "grouped_gemm.cuh"

namespace moe_gg {
namespace {

ffi::Error GroupedGemmDgradImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> dout,
                                ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::ResultBuffer<ffi::BF16> dlhs,
                                ffi::ResultBuffer<ffi::U8> workspace, int64_t tile,
                              int64_t raster, int64_t swizzle, int64_t split_rows) {
  auto od = dout.dimensions();
  auto rd = rhs.dimensions();
  if (od.size() != 2 || rd.size() != 3 || od[1] != rd[2] ||
      group_sizes.element_count() != static_cast<size_t>(rd[0])) {
    return moe_gg_common::shape_error(kWho, "dgrad", "dout [M,N], rhs [E,K,N], group_sizes [E]");
  }
  const int64_t m = od[0], n = od[1], e = rd[0], k = rd[1];
  const Schedule sched{raster, swizzle, split_rows};
  return dispatch_tile(tile, sched, [&](auto cfg) {
    using Def = GemmDef<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, decltype(cfg)>;
    // the GEMM's contraction is N and its output width K
    PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, m, n, k,
                                          as_elem(dout.untyped_data()),
                                          as_elem(rhs.untyped_data()),
                                          as_elem(dlhs->untyped_data()), k);
    p.dgrad = true;
    return run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(n),
                            make_ld_stride<typename Def::StrideB>(n),
                            make_ld_stride<typename Def::StrideD>(k),
                            reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                            static_cast<int64_t>(workspace->size_bytes()), sched);
  });
}

}  // namespace
}  // namespace moe_gg

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmDgrad, moe_gg::GroupedGemmDgradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // dout [M, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rhs [E, K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // dlhs [M, K]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
