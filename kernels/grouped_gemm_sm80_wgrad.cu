// moe-praxis-gencode: sm_80, compute_80
// Grouped GEMM wgrad for compute capability 8.0+ (CUTLASS 2.x GemmGrouped, mma.sync):
//   drhs[e] = lhs[rows of group e]^T @ dout[rows of group e].
//   lhs [M, K], dout [M, N] (bf16 or fp16), group_sizes [E] int32 -> drhs [E, K, N]; experts
//   with no rows get zeros (written by the prepare kernel; their CUTLASS problem has M = 0 and
//   so no tiles). CUTLASS problem per group: (K, N, m_e), A = lhs_e^T column-major (leading
//   dimension K), B = dout_e row-major. See grouped_gemm_sm80.cuh for the launch sequence.
#include "grouped_gemm_sm80.cuh"

namespace moe_gg80 {
namespace {

ffi::Error GroupedGemmSm80WgradImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer dout,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> drhs,
                                    ffi::ResultBuffer<ffi::U8> workspace, int64_t tile) {
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
  PrepareParams p{};
  p.group_sizes = group_sizes.typed_data();
  p.num_groups = static_cast<int>(e);
  p.rows = m;
  p.ragged_k = true;
  p.dim_a = static_cast<int>(k);  // GEMM M (0 for empty groups)
  p.dim_b = static_cast<int>(n);  // GEMM N
  p.a = static_cast<const uint16_t*>(lhs.untyped_data());
  p.b = static_cast<const uint16_t*>(dout.untyped_data());
  p.d = static_cast<uint16_t*>(drhs->untyped_data());
  p.map_a = {0, k};
  p.map_b = {0, n};
  p.map_d = {k * n, 0};
  p.lda = k;
  p.ldb = n;
  p.ldd = n;
  p.zero_empty_experts = true;
  p.zero_row = 0;
  p.zero_expert = k * n;
  return dispatch<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>(
      "wgrad", lhs.element_type(), dout.element_type(), drhs->element_type(), tile, stream, p,
      reinterpret_cast<uint8_t*>(workspace->untyped_data()),
      static_cast<int64_t>(workspace->size_bytes()));
}

}  // namespace
}  // namespace moe_gg80

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmSm80Wgrad, moe_gg80::GroupedGemmSm80WgradImpl,
                              MOE_GG80_BIND,  // lhs [M,K], dout [M,N], group_sizes -> drhs [E,K,N]
                              {xla::ffi::Traits::kCmdBufferCompatible});
