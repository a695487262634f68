// moe-praxis-gencode: sm_90a
// Gathered grouped GEMMs: the expert GEMMs that read token rows of x by the expert-sorted index
// instead of from a permuted copy (kernels/grouped_gemm_gather.cuh has the mainloop).
//
//   fwd:   x [T, K] bf16, row_map [R] int32, rhs [E, K, N] bf16, group_sizes [E] int32 ->
//          out [R, N] bf16, out[r] = x[row_map[r]] @ rhs[e(r)] (a zero row of x where
//          row_map[r] is outside [0, T)); rows past sum(group_sizes) are zero.
//          = grouped_gemm_fwd(permute(x, row_map), rhs, group_sizes).
//   wgrad: x [T, K], row_map [R], dout [R, N] bf16, group_sizes [E] -> drhs [E, K, N] bf16,
//          drhs[e] = sum over the group's rows r of x[row_map[r]]^T dout[r]; experts with no rows
//          get zeros. = grouped_gemm_wgrad(permute(x, row_map), dout, group_sizes).
// The problems, their prepare step and the launch are those of the plain kernels
// (grouped_gemm.cuh); A's per-problem pointer is x itself (its descriptor is not loaded from).
// Tiles: the ones the rule picks for these two GEMMs (moe_praxis/ops/grouped_gemm_tiles.py,
// GATHER_TILES): 1 (ping-pong 128x128, 2x1 cluster: B multicast), 10 (the 1x1 adaptive pair)
// and 11 (ping-pong 128x192, 1x1). A is never multicast (clusters of one column only).
#include "grouped_gemm.cuh"
#include "grouped_gemm_gather.cuh"

namespace moe_gg {
namespace {

// The gathered kernel of one tile configuration with the plain TMA-store epilogue.
template <class LayoutA, class Config, Gather kMode>
struct GatherDef : GatherKernelDef<LayoutA, Config, kMode, PlainEpilogue<Config>, PlainEpilogueArgs> {
};

// launch_cutlass must take this Def's own mainloop arguments: CUTLASS's four would also compile
// (brace elision into the base) and leave the gather arguments zero.
static_assert(OwnMainloopArgs<GatherDef<cutlass::layout::RowMajor, PingpongSmall,
                                        Gather::kRowsM>>::value,
              "the gathered kernels pass their own mainloop arguments");

template <class LayoutA, class A, class B, int kF, int kD, Gather kMode>
struct GatherDef<LayoutA, Adaptive<A, B, kF, kD>, kMode>
    : AdaptivePair<GatherDef<LayoutA, A, kMode>, GatherDef<LayoutA, B, kMode>, kF, kD> {};


ffi::Error GatherFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> row_map,
                         ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::U8> workspace,
                         int64_t tile, int64_t raster, int64_t swizzle, int64_t split_rows) {
  auto xd = x.dimensions();
  auto rd = rhs.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || rd.size() != 3 || xd[1] != rd[1] || od.size() != 2 ||
      od[1] != rd[2] || group_sizes.element_count() != static_cast<size_t>(rd[0])) {
    return moe_gg_common::shape_error(kWhoGather, "fwd",
                                      "x [T,K], rhs [E,K,N], group_sizes [E], out [R,N]");
  }
  const int64_t k = xd[1], e = rd[0], n = rd[2], rows = od[0];
  const Schedule sched{raster, swizzle, split_rows};
  return dispatch_gather("fwd", x, row_map, rows, tile, sched, [&](auto cfg) {
    using Def = GatherDef<cutlass::layout::RowMajor, decltype(cfg), Gather::kRowsM>;
    const Element* xs = as_elem(x.untyped_data());
    Element* o = as_elem(out->untyped_data());
    PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, rows, k, n, xs,
                                          as_elem(rhs.untyped_data()), o, n);
    p.map_a = {0, 0};  // every problem's A is x (read by index)
    GatherExtra<EpilogueExtra> extra{};
    ffi::Error bad = gather_args(x, row_map, o, n, &extra.gather);
    if (bad.failure()) return bad;
    return run_gather<Def>(stream, p, k, n, n, extra, workspace, sched);
  });
}

ffi::Error GatherWgradImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::S32> row_map, ffi::Buffer<ffi::BF16> dout,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::BF16> drhs,
                           ffi::ResultBuffer<ffi::U8> workspace, int64_t tile, int64_t raster,
                           int64_t swizzle, int64_t split_rows) {
  auto xd = x.dimensions();
  auto od = dout.dimensions();
  auto wd = drhs->dimensions();
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (xd.size() != 2 || od.size() != 2 || wd.size() != 3 || wd[0] != e || wd[1] != xd[1] ||
      wd[2] != od[1]) {
    return moe_gg_common::shape_error(kWhoGather, "wgrad",
                                      "x [T,K], dout [R,N], group_sizes [E], drhs [E,K,N]");
  }
  const int64_t k = xd[1], n = od[1], rows = od[0];
  const Schedule sched{raster, swizzle, split_rows};
  return dispatch_gather("wgrad", x, row_map, rows, tile, sched, [&](auto cfg) {
    using Def = GatherDef<cutlass::layout::ColumnMajor, decltype(cfg), Gather::kRowsK>;
    const Element* xs = as_elem(x.untyped_data());
    const Element* dy = as_elem(dout.untyped_data());
    PrepareParams p = ragged_k_prepare(group_sizes.typed_data(), e, rows, k, n, xs, dy,
                                       as_elem(drhs->untyped_data()));
    p.map_a = {0, 0};  // every problem's A is x (read by index)
    GatherExtra<EpilogueExtra> extra{};
    ffi::Error bad = gather_args(x, row_map, dy, n, &extra.gather);
    if (bad.failure()) return bad;
    return run_gather<Def>(stream, p, k, n, n, extra, workspace, sched);
  });
}

}  // namespace
}  // namespace moe_gg

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmGatherFwd, moe_gg::GatherFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // x [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_map [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rhs [E, K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out [R, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmGatherWgrad, moe_gg::GatherWgradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // x [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_map [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // dout [R, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // drhs [E, K, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
