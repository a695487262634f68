// moe-praxis-gencode: sm_90a
// Fused gate/up grouped GEMM with SwiGLU in the epilogue (MoEConfig.fuse_gate_up):
//   lhs [M, K] bf16, rhs [E, K, 2H] bf16 whose columns interleave the two projections
//   (column 2j: gate unit j, column 2j + 1: up unit j), group_sizes [E] int32, row_weights [M]
//   f32 (read only with has_weight) ->
//   gate [M, H], up [M, H] (the projections, rounded to bf16: the backward's residuals) and
//   act [M, H] = silu(gate) * up (* row_weights[:, None]), computed from the rounded gate and up
//   exactly as kernels/swiglu.cu does, so the fused path equals grouped GEMM + SwiGLU bitwise.
//   Rows past sum(group_sizes) are zero in all three.
// One CUTLASS problem per group, (m_e, 2H, K), as the plain forward; the epilogue is ours
// (SwigluEpilogueArray): it stores from registers (no shared memory, no TMA store). In the
// Hopper accumulator fragment a thread holds columns n and n + 1 of a row as consecutive
// values, so each thread has whole (gate, up) pairs; a transpose within each quad of lanes
// turns them into 8-byte stores of gate, up (de-interleaved) and the activation.
#include "grouped_gemm.cuh"
#include "grouped_gemm_register_epilogue.cuh"

namespace moe_gg {
namespace {

// How this kernel names itself in its errors (grouped_gemm_common.h).
constexpr const char* kWhoSwiglu = "moe_praxis grouped GEMM + SwiGLU";

__device__ __forceinline__ float silu_mul(float g, float u) {
  // kernels/swiglu.cu's bf16 path: x * sigmoid(x) * u with the fast intrinsics
  return g * __fdividef(1.f, 1.f + __expf(-g)) * u;
}

template <class StrideD_>
class SwigluEpilogueArray : public RegisterEpilogueBase<StrideD_, EpilogueExtra> {
 public:
  using Base = RegisterEpilogueBase<StrideD_, EpilogueExtra>;
  using typename Base::Params;
  CUTLASS_HOST_DEVICE explicit SwigluEpilogueArray(Params const& p) : Base(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    const int m_size = get<0>(problem_shape_mnkl);
    const int n_size = get<1>(problem_shape_mnkl);  // 2H
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const EpilogueExtra& x = this->params.extra;
    const int64_t row0 = (this->params.ptr_D[l_coord] - x.row_base) / x.ld;
    Element* gate = const_cast<Element*>(x.row_base) + row0 * x.ld;
    Element* up = x.up + row0 * x.ld;
    Element* act = x.act + row0 * x.ld;
    const float* w = x.row_weights != nullptr ? x.row_weights + row0 : nullptr;

    Tensor coords = make_identity_tensor(make_shape(m_size, n_size));
    Tensor tile = local_tile(coords, take<0, 2>(blk_shape_MNK), make_coord(m_coord, n_coord));
    Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile);
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(accumulators));
    // Hopper accumulator fragment ((2, 2, NJ), MMA_M, MMA_N): value v0 + 2 v1 + 4 j holds row
    // (lane / 4) + 8 v1, column 8 j + 2 (lane % 4) + v0 of this thread's 64-row slab. So each
    // thread has whole (gate, up) pairs, output column 4 j + lane % 4. A 4 x 4 transpose
    // within each quad of lanes (shuffles) gives every lane 4 consecutive output columns
    // (8-byte stores; a quad writes 32 contiguous bytes of a row).
    constexpr int kV = decltype(size<0>(accumulators))::value;  // 4 * NJ
    constexpr int kRest = decltype(size(accumulators))::value / kV;
    static_assert(kV % 16 == 0, "NJ must be a multiple of 4");
    const int q = thread_idx & 3;
    const unsigned quad0 = static_cast<unsigned>(thread_idx & 31) & ~3u;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRest; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int i0 = 2 * v1 + kV * r;
        const int m = get<0>(t_coords(i0));
        const float wr = (w != nullptr && m < m_size) ? w[m] : 1.f;
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kV / 16; ++t) {
          uint32_t gu[4], ac[4];
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < 4; ++k) {  // j = 4 t + k
            const int i = i0 + 4 * (4 * t + k);
            const Element gb(accumulators(i)), ub(accumulators(i + 1));
            const Element ab(silu_mul(static_cast<float>(gb), static_cast<float>(ub)) * wr);
            gu[k] = static_cast<uint32_t>(gb.raw()) | (static_cast<uint32_t>(ub.raw()) << 16);
            ac[k] = ab.raw();
          }
          // round s: lane q reads lane (q + s) & 3, which sends its value for j = 4 t + q
          uint32_t gu_t[4], ac_t[4];
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < 4; ++s) {
            const int want = (q - s) & 3;  // the element the reading lane needs from me
            uint32_t send_gu = gu[0], send_ac = ac[0];
            CUTLASS_PRAGMA_UNROLL
            for (int k = 1; k < 4; ++k) {
              send_gu = want == k ? gu[k] : send_gu;
              send_ac = want == k ? ac[k] : send_ac;
            }
            const unsigned src = quad0 | static_cast<unsigned>((q + s) & 3);
            const uint32_t got_gu = __shfl_sync(0xffffffffu, send_gu, src);
            const uint32_t got_ac = __shfl_sync(0xffffffffu, send_ac, src);
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < 4; ++k) {
              if (k == ((q + s) & 3)) {
                gu_t[k] = got_gu;
                ac_t[k] = got_ac;
              }
            }
          }
          // this lane now holds output columns 4 (4 t + q) + 0..3 of row m (block j = 4 t + q
          // of 8 GEMM columns, all valid or none: N % 16 == 0)
          const int nb = get<1>(t_coords(i0 + 16 * t)) - 2 * q + 8 * q;
          if (m < m_size && nb < n_size) {
            const int64_t o = static_cast<int64_t>(m) * x.ld + (nb >> 1);
            *reinterpret_cast<uint2*>(gate + o) = make_uint2(__byte_perm(gu_t[0], gu_t[1], 0x5410),
                                                             __byte_perm(gu_t[2], gu_t[3], 0x5410));
            *reinterpret_cast<uint2*>(up + o) = make_uint2(__byte_perm(gu_t[0], gu_t[1], 0x7632),
                                                           __byte_perm(gu_t[2], gu_t[3], 0x7632));
            *reinterpret_cast<uint2*>(act + o) = make_uint2(ac_t[0] | (ac_t[1] << 16),
                                                            ac_t[2] | (ac_t[3] << 16));
          }
        }
      }
    }
  }
};

template <class Config>
struct SwigluDef
    : RegisterEpilogueDef<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Config,
                          SwigluEpilogueArray> {};

// The adaptive pair (tile 4): both fused kernels, the device keeps the cheaper one per call
// (grouped_gemm_tiles.cuh, Adaptive; grouped_gemm_prepare.cuh, moe_gg_prepare).
template <class A, class B, int kF, int kD>
struct SwigluDef<Adaptive<A, B, kF, kD>> : AdaptivePair<SwigluDef<A>, SwigluDef<B>, kF, kD> {};

// The fused forward's checks: lhs (or x) [*, K], rhs [E, K, 2H] with H % 8 == 0, group_sizes
// [E], gate / up / act [rows, H], row_weights [rows] where read.
ffi::Error check_swiglu_fwd(const char* who, int64_t rows, const ffi::Buffer<ffi::BF16>& lhs,
                            const ffi::Buffer<ffi::BF16>& rhs,
                            const ffi::Buffer<ffi::S32>& group_sizes,
                            const ffi::Buffer<ffi::F32>& row_weights,
                            ffi::ResultBuffer<ffi::BF16>& gate, ffi::ResultBuffer<ffi::BF16>& up,
                            ffi::ResultBuffer<ffi::BF16>& act, bool has_weight) {
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || ld[1] != rd[1] || rd[2] % 16 != 0 ||
      group_sizes.element_count() != static_cast<size_t>(rd[0])) {
    return moe_gg_common::shape_error(who, "fwd",
                                      "lhs [M,K], rhs [E,K,2H] with H % 8 == 0, group_sizes [E]");
  }
  const size_t h = static_cast<size_t>(rd[2] / 2);
  const size_t count = static_cast<size_t>(rows) * h;
  if (gate->element_count() != count || up->element_count() != count ||
      act->element_count() != count) {
    return moe_gg_common::invalid(who, "fwd", "outputs must be [M, H]");
  }
  if (has_weight && row_weights.element_count() != static_cast<size_t>(rows)) {
    return moe_gg_common::invalid(who, "fwd",
                                  "row_weights must be [M=" + std::to_string(rows) + "]");
  }
  return ffi::Error::Success();
}

// The prepare parameters and the epilogue's extra of the fused forward over `rows` output rows
// (a [rows, k]).
PrepareParams swiglu_prepare(const ffi::Buffer<ffi::S32>& group_sizes, int64_t e, int64_t rows,
                             int64_t k, int64_t n, const Element* a,
                             const ffi::Buffer<ffi::BF16>& rhs,
                             ffi::ResultBuffer<ffi::BF16>& gate, ffi::ResultBuffer<ffi::BF16>& up,
                             ffi::ResultBuffer<ffi::BF16>& act) {
  // ptr_d[e]: the group's first row of gate (the epilogue's row offset)
  PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, rows, k, n, a,
                                        as_elem(rhs.untyped_data()),
                                        as_elem(gate->untyped_data()), n / 2);
  p.zero_also[0] = as_elem(up->untyped_data());
  p.zero_also[1] = as_elem(act->untyped_data());
  return p;
}

EpilogueExtra swiglu_extra(const PrepareParams& p, const ffi::Buffer<ffi::F32>& row_weights,
                           bool has_weight, int64_t h) {
  return EpilogueExtra{p.d, p.zero_also[0], p.zero_also[1],
                       has_weight ? row_weights.typed_data() : nullptr, h};
}

ffi::Error GroupedGemmSwigluFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs,
                                    ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Buffer<ffi::F32> row_weights,
                                    ffi::ResultBuffer<ffi::BF16> gate,
                                    ffi::ResultBuffer<ffi::BF16> up,
                                    ffi::ResultBuffer<ffi::BF16> act,
                                    ffi::ResultBuffer<ffi::U8> workspace, int64_t tile,
                                    int64_t raster, int64_t swizzle, int64_t split_rows, bool has_weight) {
  const int64_t m = lhs.dimensions()[0];
  ffi::Error bad = check_swiglu_fwd(kWhoSwiglu, m, lhs, rhs, group_sizes, row_weights, gate, up,
                                    act, has_weight);
  if (bad.failure()) return bad;
  const int64_t k = lhs.dimensions()[1], e = rhs.dimensions()[0], n = rhs.dimensions()[2];
  const int64_t h = n / 2;
  const Schedule sched{raster, swizzle, split_rows};
  auto run = [&](auto cfg) -> ffi::Error {
    using Def = SwigluDef<decltype(cfg)>;
    PrepareParams p = swiglu_prepare(group_sizes, e, m, k, n, as_elem(lhs.untyped_data()), rhs,
                                     gate, up, act);
    EpilogueExtra extra = swiglu_extra(p, row_weights, has_weight, h);
    return run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(k),
                            make_ld_stride<typename Def::StrideB>(n),
                            make_ld_stride<typename Def::StrideD>(h),
                            reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                            static_cast<int64_t>(workspace->size_bytes()), sched, extra);
  };
  bad = check_schedule(sched);
  if (bad.failure()) return bad;
  switch (tile) {  // the tiles of TILE_CONFIGS this fused kernel is built for
    case 1:
      return run(PingpongSmall{});
    case 2:
      return run(CoopWide{});
    case 4:
      return run(AdaptiveWideThin{});
    case 8:
      return run(CoopWideC<1, 1>{});
    case 10:
      return run(AdaptiveWideThin11{});
    case 11:
      return run(PingpongMidC<1, 1>{});
    case 12:
      return run(PingpongMidC<2, 1>{});
    default:
      return ffi::Error::InvalidArgument(std::string(kWhoSwiglu) + ": tile=" +
                                         std::to_string(tile) +
                                         " is not built; valid: 1, 2, 4, 8, 10, 11, 12");
  }
}

}  // namespace
}  // namespace moe_gg

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmSwigluFwd, moe_gg::GroupedGemmSwigluFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // lhs [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // rhs [E, K, 2H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes [E]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // row_weights [M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // gate [M, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // up [M, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // act [M, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()    // workspace
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("raster")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("split_rows")
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
