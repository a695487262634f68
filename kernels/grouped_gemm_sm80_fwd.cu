// moe-praxis-gencode: sm_80, compute_80
// Grouped GEMM forward for compute capability 8.0+ (CUTLASS 2.x GemmGrouped, mma.sync):
//   out[rows of group e] = lhs[rows of group e] @ rhs[e].
//   lhs [M, K], rhs [E, K, N] (bf16 or fp16), group_sizes [E] int32 -> out [M, N] (lhs's type);
//   rows past sum(group_sizes) are zero. CUTLASS problem per group: (m_e, N, K), A row-major,
//   B row-major. See grouped_gemm_sm80.cuh for the launch sequence.
#include "grouped_gemm_sm80.cuh"

namespace moe_gg80 {
namespace {

ffi::Error GroupedGemmSm80FwdImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                  ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::ResultBuffer<ffi::U8> workspace, int64_t tile) {
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 3 || ld[1] != rd[1] ||
      group_sizes.element_count() != static_cast<size_t>(rd[0]) || od.size() != 2 ||
      od[0] != ld[0] || od[1] != rd[2]) {
    return moe_gg_common::shape_error(kWho, "fwd",
                                      "lhs [M,K], rhs [E,K,N], group_sizes [E], out [M,N]");
  }
  const int64_t m = ld[0], k = ld[1], e = rd[0], n = rd[2];
  PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, m, k, n, lhs.untyped_data(),
                                        rhs.untyped_data(), out->untyped_data(), n);
  return dispatch<cutlass::layout::RowMajor, cutlass::layout::RowMajor>(
      "fwd", lhs.element_type(), rhs.element_type(), out->element_type(), tile, stream, p,
      reinterpret_cast<uint8_t*>(workspace->untyped_data()),
      static_cast<int64_t>(workspace->size_bytes()));
}

}  // namespace
}  // namespace moe_gg80

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmSm80Fwd, moe_gg80::GroupedGemmSm80FwdImpl,
                              MOE_GG80_BIND,  // lhs [M,K], rhs [E,K,N], group_sizes [E] -> out [M,N]
                              {xla::ffi::Traits::kCmdBufferCompatible});
