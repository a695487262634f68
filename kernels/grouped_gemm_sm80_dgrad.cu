// moe-praxis-gencode: sm_80, compute_80
// Grouped GEMM dgrad for compute capability 8.0+ (CUTLASS 2.x GemmGrouped, mma.sync):
//   dlhs[rows of group e] = dout[rows of group e] @ rhs[e]^T.
//   dout [M, N], rhs [E, K, N] (bf16 or fp16), group_sizes [E] int32 -> dlhs [M, K]; rows past
//   sum(group_sizes) are zero. CUTLASS problem per group: (m_e, K, N), A = dout row-major,
//   B = rhs[e] read as column-major [N, K] (leading dimension N): no transpose is materialised.
//   See grouped_gemm_sm80.cuh for the launch sequence.
#include "grouped_gemm_sm80.cuh"

namespace moe_gg80 {
namespace {

ffi::Error GroupedGemmSm80DgradImpl(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer rhs,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> dlhs,
                                    ffi::ResultBuffer<ffi::U8> workspace, int64_t tile) {
  auto od = dout.dimensions();
  auto rd = rhs.dimensions();
  auto dd = dlhs->dimensions();
  if (od.size() != 2 || rd.size() != 3 || od[1] != rd[2] ||
      group_sizes.element_count() != static_cast<size_t>(rd[0]) || dd.size() != 2 ||
      dd[0] != od[0] || dd[1] != rd[1]) {
    return moe_gg_common::shape_error(kWho, "dgrad",
                                      "dout [M,N], rhs [E,K,N], group_sizes [E], dlhs [M,K]");
  }
  const int64_t m = od[0], n = od[1], e = rd[0], k = rd[1];
  // the GEMM's contraction is N and its output width K; B's leading dimension is N
  PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, m, n, k, dout.untyped_data(),
                                        rhs.untyped_data(), dlhs->untyped_data(), n);
  return dispatch<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>(
      "dgrad", dout.element_type(), rhs.element_type(), dlhs->element_type(), tile, stream, p,
      reinterpret_cast<uint8_t*>(workspace->untyped_data()),
      static_cast<int64_t>(workspace->size_bytes()));
}

}  // namespace
}  // namespace moe_gg80

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmSm80Dgrad, moe_gg80::GroupedGemmSm80DgradImpl,
                              MOE_GG80_BIND,  // dout [M,N], rhs [E,K,N], group_sizes -> dlhs [M,K]
                              {xla::ffi::Traits::kCmdBufferCompatible});
