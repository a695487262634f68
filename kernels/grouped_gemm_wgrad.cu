// moe-praxis-gencode: sm_90a
// Grouped GEMM wgrad: drhs[e] = lhs[rows of group e]^T @ dout[rows of group e].
//   lhs [M, K] bf16, dout [M, N] bf16, group_sizes [E] int32 -> drhs [E, K, N] bf16; experts
//   with no rows get zeros (written by the prepare kernel; their CUTLASS problem has M = 0 and
//   so no tiles, instead of K = 0 whose epilogue would store an uninitialised accumulator).
//   CUTLASS problem per group: (K, N, m_e), A = lhs_e^T column-major (M-major), B = dout_e
//   row-major (N-major). See grouped_gemm.cuh for the launch sequence.
#include "grouped_gemm.cuh"

namespace moe_gg {
namespace {

ffi::Error GroupedGemmWgradImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs,
                                ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::ResultBuffer<ffi::BF16> drhs,
                                ffi::ResultBuffer<ffi::U8> workspace, int64_t tile,
                              int64_t raster, int64_t swizzle, int64_t split_rows) {
  auto ld = lhs.dimensions();
  auto od = dout.dimensions();
  auto wd = drhs->dimensions();
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (ld.size() != 2 || od.size() != 2 || ld[0] != od[0] || wd.size() != 3 || wd[0] != e ||
      wd[1] != ld[1] || wd[2] != od[1]) {
    return moe_gg_common::shape_error(kWho, "wgrad",
                                      "lhs [M,K], dout [M,N], group_sizes [E], drhs [E,K,N]");
  }
  const int64_t m = ld[0], k = ld[1], n = od[1];
  const Schedule sched{raster, swizzle, split_rows};
  return dispatch_tile(tile, sched, [&](auto cfg) {
    using Def = GemmDef<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, decltype(cfg)>;
    PrepareParams p = ragged_k_prepare(group_sizes.typed_data(), e, m, k, n,
                                       as_elem(lhs.untyped_data()), as_elem(dout.untyped_data()),
                                       as_elem(drhs->untyped_data()));
    return run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(k),
                            make_ld_stride<typename Def::StrideB>(n),
                            make_ld_stride<typename Def::StrideD>(n),
                            reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                            static_cast<int64_t>(workspace->size_bytes()), sched);
  });
}

}  // namespace
}  // namespace moe_gg

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmWgrad, moe_gg::GroupedGemmWgradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // lhs [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // dout [M, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // drhs [E, K, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
