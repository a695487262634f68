// moe-praxis-gencode: sm_90a
// The down projection's dgrad grouped GEMM with the SwiGLU backward in its epilogue (dSwiGLU):
//   dout [M, N] bf16 (the down projection's output gradient), rhs [E, H, N] bf16 (wo),
//   group_sizes [E] int32, gate [M, H], up [M, H] bf16 (the forward's residuals),
//   row_weights [M] f32 (read only with has_weight) ->
//   dgate [M, H], dup [M, H] bf16 (MoeGroupedGemmDswiglu), or dgate_up [M, 2H] bf16 with column
//   2j = d gate j, 2j + 1 = d up j (MoeGroupedGemmDswigluInterleaved: the fused gate/up layout),
//   act [M, H] bf16 = silu(gate) * up (* w): the forward's activation recomputed (the down
//   projection's wgrad reads it, so the forward need not keep it), and
//   dw [M] f32 = sum_h dact * silu(gate) * up (has_weight; else a [1] placeholder, not written).
// With dact = dout @ rhs[e]^T rounded to bf16 (as the unfused dgrad stores it), the math is
// kernels/swiglu.cu's backward, expression for expression, so dgate, dup and act equal the
// unfused composition (grouped GEMM dgrad, then moe_swiglu_bwd) bitwise; dw sums in another
// order. Rows past sum(group_sizes) are zero in every output.
//
// One CUTLASS problem per group, (m_e, H, N), as kernels/grouped_gemm_dgrad.cu; the epilogue is
// ours (DswigluEpilogueArray, from registers, no shared memory), as in
// kernels/grouped_gemm_swiglu.cu. In the Hopper accumulator fragment a quad of lanes holds a
// row's columns 8j .. 8j + 7 as pairs (lane q: 8j + 2q, 8j + 2q + 1); a 4 x 4 transpose within
// the quad (shuffles of the bf16 pairs) gives lane q all 8 columns of block j = 4t + q, so gate
// and up are read, and the gradients written, 16 bytes at a time.
// dw: each tile writes, per row, the sum over its columns (the quad's lanes reduced by
// shuffles) to partial[row, column tile] (in the workspace); a second small kernel sums a
// row's partials in column order (deterministic, no atomics) and zeroes the rows past the sum.
#include <cub/block/block_reduce.cuh>

#include "grouped_gemm_register_epilogue.cuh"
#include "swiglu_math.cuh"

namespace moe_gg {
namespace {

constexpr const char* kWhoDswiglu = "moe_praxis grouped GEMM dgrad + dSwiGLU";

// What the dSwiGLU epilogue reads and writes beyond the group arrays.
struct DswigluExtra {
  const Element* row_base;   // act's base: a group's first row is (ptr_d[e] - row_base) / ld
  const Element* gate;       // [rows, ld]
  const Element* up;         // [rows, ld]
  Element* dgate;            // [rows, ld], or nullptr (interleaved)
  Element* dup;              // [rows, ld], or nullptr (interleaved)
  Element* dgate_up;         // [rows, 2 ld] interleaved, or nullptr
  const float* row_weights;  // [rows], or nullptr (no routing weight: w = 1, no dw)
  float* partial;            // [rows, num_col_tiles] per-tile row sums of dw (with row_weights)
  int64_t ld;                // H
  int64_t num_col_tiles;     // ceil(H / tile N)
};

__device__ __forceinline__ float lo_f32(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f32(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t bf16_bits(float v) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

template <class StrideD_>
class DswigluEpilogueArray : public RegisterEpilogueBase<StrideD_, DswigluExtra> {
 public:
  using Base = RegisterEpilogueBase<StrideD_, DswigluExtra>;
  using typename Base::Params;
  CUTLASS_HOST_DEVICE explicit DswigluEpilogueArray(Params const& p) : Base(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    // one MMA atom spans the tile's width: a row's columns are all in one quad of lanes
    static_assert(decltype(size<2>(accumulators))::value == 1, "tile N must be one MMA atom");
    const int m_size = get<0>(problem_shape_mnkl);
    const int n_size = get<1>(problem_shape_mnkl);  // H
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const DswigluExtra& x = this->params.extra;
    const int64_t row0 = (this->params.ptr_D[l_coord] - x.row_base) / x.ld;
    const int64_t off0 = row0 * x.ld;
    Element* act = const_cast<Element*>(x.row_base) + off0;
    const float* w = x.row_weights != nullptr ? x.row_weights + row0 : nullptr;

    Tensor coords = make_identity_tensor(make_shape(m_size, n_size));
    Tensor tile = local_tile(coords, take<0, 2>(blk_shape_MNK), make_coord(m_coord, n_coord));
    Tensor t_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile);
    CUTE_STATIC_ASSERT_V(size(t_coords) == size(accumulators));
    // Fragment ((2, 2, NJ), MMA_M, 1): value v0 + 2 v1 + 4 j holds row (lane / 4) + 8 v1,
    // column 8 j + 2 (lane % 4) + v0 of this thread's 64-row slab (grouped_gemm_swiglu.cu).
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
        const bool row_ok = m < m_size;
        const float wr = (w != nullptr && row_ok) ? w[m] : 1.f;
        float dw_sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kV / 16; ++t) {
          // dact of columns 8 (4 t + k) + 2 q + {0, 1}, rounded to bf16 as the unfused dgrad
          uint32_t d[4];
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < 4; ++k) {
            const int i = i0 + 4 * (4 * t + k);
            d[k] = bf16_bits(accumulators(i)) | (bf16_bits(accumulators(i + 1)) << 16);
          }
          // round s: lane q reads lane (q + s) & 3, which sends its pair of block 4 t + q
          uint32_t dt[4] = {0u, 0u, 0u, 0u};
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < 4; ++s) {
            const int want = (q - s) & 3;
            uint32_t send = d[0];
            CUTLASS_PRAGMA_UNROLL
            for (int k = 1; k < 4; ++k) send = want == k ? d[k] : send;
            const uint32_t got =
                __shfl_sync(0xffffffffu, send, quad0 | static_cast<unsigned>((q + s) & 3));
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < 4; ++k) dt[k] = k == ((q + s) & 3) ? got : dt[k];
          }
          // this lane: columns nb .. nb + 7 of row m (block 4 t + q: all valid or none, H % 8 == 0)
          const int nb = get<1>(t_coords(i0 + 16 * t)) - 2 * q + 8 * q;
          if (row_ok && nb < n_size) {
            const int64_t o = static_cast<int64_t>(m) * x.ld + nb;
            const uint4 gv = *reinterpret_cast<const uint4*>(x.gate + off0 + o);
            const uint4 uv = *reinterpret_cast<const uint4*>(x.up + off0 + o);
            const uint32_t g2[4] = {gv.x, gv.y, gv.z, gv.w};
            const uint32_t u2[4] = {uv.x, uv.y, uv.z, uv.w};
            uint32_t dg[4], du[4], ac[4];
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < 4; ++k) {
              uint32_t bits_g[2], bits_u[2], bits_a[2];
              CUTLASS_PRAGMA_UNROLL
              for (int h = 0; h < 2; ++h) {
                // kernels/swiglu.cu's backward with weights, and its forward's activation
                const float xg = h ? hi_f32(g2[k]) : lo_f32(g2[k]);
                const float y = h ? hi_f32(u2[k]) : lo_f32(u2[k]);
                const float dy = h ? hi_f32(dt[k]) : lo_f32(dt[k]);
                const float sg = moe::sigmoid_t<__nv_bfloat16>(xg), silu = xg * sg;
                dw_sum += dy * silu * y;
                const float dyw = dy * wr;
                bits_g[h] = bf16_bits(dyw * y * (sg * (1.f + xg * (1.f - sg))));
                bits_u[h] = bf16_bits(dyw * silu);
                bits_a[h] = bf16_bits(silu * y * wr);
              }
              dg[k] = bits_g[0] | (bits_g[1] << 16);
              du[k] = bits_u[0] | (bits_u[1] << 16);
              ac[k] = bits_a[0] | (bits_a[1] << 16);
            }
            *reinterpret_cast<uint4*>(act + o) = make_uint4(ac[0], ac[1], ac[2], ac[3]);
            if (x.dgate_up == nullptr) {
              *reinterpret_cast<uint4*>(x.dgate + off0 + o) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
              *reinterpret_cast<uint4*>(x.dup + off0 + o) = make_uint4(du[0], du[1], du[2], du[3]);
            } else {
              // column 2c: d gate c, 2c + 1: d up c (c = nb .. nb + 7)
              uint32_t p[8];
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < 4; ++k) {
                p[2 * k] = __byte_perm(dg[k], du[k], 0x5410);
                p[2 * k + 1] = __byte_perm(dg[k], du[k], 0x7632);
              }
              uint4* dst = reinterpret_cast<uint4*>(x.dgate_up + 2 * (off0 + o));
              dst[0] = make_uint4(p[0], p[1], p[2], p[3]);
              dst[1] = make_uint4(p[4], p[5], p[6], p[7]);
            }
          }
        }
        if (w != nullptr) {  // uniform over the warp: every lane shuffles
          dw_sum += __shfl_xor_sync(0xffffffffu, dw_sum, 1);
          dw_sum += __shfl_xor_sync(0xffffffffu, dw_sum, 2);
          if (q == 0 && row_ok) x.partial[(row0 + m) * x.num_col_tiles + n_coord] = dw_sum;
        }
      }
    }
  }
};

// dgrad's operand layouts (kernels/grouped_gemm_dgrad.cu): A = dout row-major, B =
// rhs[e] read as column-major [N, H].
template <class Config>
struct DswigluDef
    : RegisterEpilogueDef<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Config,
                          DswigluEpilogueArray> {};

template <class A, class B, int kF, int kD>
struct DswigluDef<Adaptive<A, B, kF, kD>> : AdaptivePair<DswigluDef<A>, DswigluDef<B>, kF, kD> {};

// The tile width of a configuration (the adaptive pair's two share it): the column tiles of dw's
// partials are H / tile width, rounded up.
template <class Config>
struct TileN {
  static constexpr int64_t value = cute::size<1>(typename Config::Tile{});
};
template <class A, class B, int kF, int kD>
struct TileN<Adaptive<A, B, kF, kD>> {
  static_assert(TileN<A>::value == TileN<B>::value, "an adaptive pair shares its tile width");
  static constexpr int64_t value = TileN<A>::value;
};

constexpr int kFinishThreads = 256;

// After the GEMM: dw[r] = sum of row r's partials in column-tile order (rows < sum of the group
// sizes; 0 past it), and the rows past the sum of the gradient outputs zeroed (the prepare
// kernel zeroes act's). Every block sums the (clamped) group sizes itself.
__global__ void __launch_bounds__(kFinishThreads)
    dswiglu_finish(const int32_t* group_sizes, int num_groups, int64_t rows, const float* partial,
                   int64_t num_col_tiles, float* dw, Element* tail0, Element* tail1,
                   int64_t tail_row) {
  using BlockReduce = cub::BlockReduce<int64_t, kFinishThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  __shared__ int64_t total_s;
  int64_t mine = 0;
  for (int e = threadIdx.x; e < num_groups; e += kFinishThreads) mine += max(group_sizes[e], 0);
  const int64_t sum = BlockReduce(storage).Sum(mine);
  if (threadIdx.x == 0) total_s = min(sum, rows);
  __syncthreads();
  const int64_t total = total_s;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (dw != nullptr) {
    for (int64_t r = tid; r < rows; r += nthreads) {
      float s = 0.f;
      if (r < total) {
        for (int64_t j = 0; j < num_col_tiles; ++j) s += partial[r * num_col_tiles + j];
      }
      dw[r] = s;
    }
  }
  Element* tails[2] = {tail0, tail1};
#pragma unroll
  for (int o = 0; o < 2; ++o) {
    if (tails[o] != nullptr) {
      zero_range(tails[o] + total * tail_row, (rows - total) * tail_row, tid, nthreads);
    }
  }
}

// Shared by both handlers: dgate / dup (separate) or dgate_up (interleaved) in `extra`.
ffi::Error dswiglu_impl(cudaStream_t stream, const ffi::Buffer<ffi::BF16>& dout,
                        const ffi::Buffer<ffi::BF16>& rhs,
                        const ffi::Buffer<ffi::S32>& group_sizes,
                        const ffi::Buffer<ffi::BF16>& gate, const ffi::Buffer<ffi::BF16>& up,
                        const ffi::Buffer<ffi::F32>& row_weights, DswigluExtra extra,
                        size_t grad_elems, ffi::ResultBuffer<ffi::BF16>& act,
                        ffi::ResultBuffer<ffi::F32>& dw, ffi::ResultBuffer<ffi::U8>& workspace,
                        int64_t tile, int64_t raster, int64_t swizzle, int64_t split_rows,
                        bool has_weight) {
  auto od = dout.dimensions();
  auto rd = rhs.dimensions();
  if (od.size() != 2 || rd.size() != 3 || od[1] != rd[2] || rd[1] % 8 != 0 ||
      rd[2] % 8 != 0 || group_sizes.element_count() != static_cast<size_t>(rd[0])) {
    return moe_gg_common::shape_error(
        kWhoDswiglu, "bwd", "dout [M,N], rhs [E,H,N] with H, N % 8 == 0, group_sizes [E]");
  }
  const int64_t m = od[0], n = od[1], e = rd[0], h = rd[1];
  const size_t mh = static_cast<size_t>(m * h);
  if (gate.element_count() != mh || up.element_count() != mh || act->element_count() != mh ||
      grad_elems != mh) {
    return moe_gg_common::invalid(kWhoDswiglu, "bwd",
                                  "gate, up, act, dgate, dup must be [M, H] and dgate_up "
                                  "[M, 2H] with M=" + std::to_string(m) + ", H=" +
                                  std::to_string(h));
  }
  if (has_weight && (row_weights.element_count() != static_cast<size_t>(m) ||
                     dw->element_count() != static_cast<size_t>(m))) {
    return moe_gg_common::invalid(kWhoDswiglu, "bwd",
                                  "row_weights and dw must be [M=" + std::to_string(m) + "]");
  }
  const Schedule sched{raster, swizzle, split_rows};
  auto run = [&](auto cfg) -> ffi::Error {
    using Def = DswigluDef<decltype(cfg)>;
    constexpr int64_t kTileN = TileN<decltype(cfg)>::value;
    const int64_t col_tiles = has_weight ? (h + kTileN - 1) / kTileN : 0;
    // the per-tile partials of dw take the end of the workspace
    const int64_t partial_bytes = (m * col_tiles * 4 + kAlign - 1) / kAlign * kAlign;
    const int64_t ws_bytes = static_cast<int64_t>(workspace->size_bytes());
    if (partial_bytes > ws_bytes) {
      return moe_gg_common::workspace_too_small(kWhoDswiglu, ws_bytes, partial_bytes,
                                                "moe_praxis/ops/dswiglu.py");
    }
    uint8_t* ws = reinterpret_cast<uint8_t*>(workspace->untyped_data());
    extra.row_base = as_elem(act->untyped_data());
    extra.gate = as_elem(gate.untyped_data());
    extra.up = as_elem(up.untyped_data());
    extra.row_weights = has_weight ? row_weights.typed_data() : nullptr;
    extra.partial = reinterpret_cast<float*>(ws + ws_bytes - partial_bytes);
    extra.ld = h;
    extra.num_col_tiles = col_tiles;
    // the GEMM's contraction is N and its output width H; ptr_d[e]: the group's first row of act
    PrepareParams p = ragged_rows_prepare(group_sizes.typed_data(), e, m, n, h,
                                          as_elem(dout.untyped_data()),
                                          as_elem(rhs.untyped_data()),
                                          as_elem(act->untyped_data()), h);
    p.dgrad = true;
    ffi::Error err = run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(n),
                                      make_ld_stride<typename Def::StrideB>(n),
                                      make_ld_stride<typename Def::StrideD>(h), ws,
                                      ws_bytes - partial_bytes, sched, extra);
    if (err.failure()) return err;
    const bool inter = extra.dgate_up != nullptr;
    const int blocks = static_cast<int>(std::min<int64_t>(
        std::max<int64_t>(moe_gg_common::cdiv(m, kFinishThreads), 1), 264));
    dswiglu_finish<<<blocks, kFinishThreads, 0, stream>>>(
        group_sizes.typed_data(), static_cast<int>(e), m, extra.partial, col_tiles,
        has_weight ? dw->typed_data() : nullptr, inter ? extra.dgate_up : extra.dgate,
        inter ? nullptr : extra.dup, inter ? 2 * h : h);
    cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) return moe_gg_common::cuda_error(kWhoDswiglu, launch, "finish");
    return ffi::Error::Success();
  };
  ffi::Error bad = check_schedule(sched);
  if (bad.failure()) return bad;
  switch (tile) {  // the tiles of the fused forward (moe_praxis/ops/gate_up.py, FUSED_TILES)
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
      return ffi::Error::InvalidArgument(std::string(kWhoDswiglu) + ": tile=" +
                                         std::to_string(tile) +
                                         " is not built; valid: 1, 2, 4, 8, 10, 11, 12");
  }
}

ffi::Error DswigluImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::BF16> rhs,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::BF16> gate,
                       ffi::Buffer<ffi::BF16> up, ffi::Buffer<ffi::F32> row_weights,
                       ffi::ResultBuffer<ffi::BF16> dgate, ffi::ResultBuffer<ffi::BF16> dup,
                       ffi::ResultBuffer<ffi::BF16> act, ffi::ResultBuffer<ffi::F32> dw,
                       ffi::ResultBuffer<ffi::U8> workspace, int64_t tile, int64_t raster,
                       int64_t swizzle, int64_t split_rows, bool has_weight) {
  DswigluExtra extra{};
  extra.dgate = as_elem(dgate->untyped_data());
  extra.dup = as_elem(dup->untyped_data());
  const size_t elems = dgate->element_count() == dup->element_count() ? dgate->element_count() : 0;
  return dswiglu_impl(stream, dout, rhs, group_sizes, gate, up, row_weights, extra, elems, act, dw,
                      workspace, tile, raster, swizzle, split_rows, has_weight);
}

ffi::Error DswigluInterleavedImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> dout,
                                  ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Buffer<ffi::BF16> gate, ffi::Buffer<ffi::BF16> up,
                                  ffi::Buffer<ffi::F32> row_weights,
                                  ffi::ResultBuffer<ffi::BF16> dgate_up,
                                  ffi::ResultBuffer<ffi::BF16> act, ffi::ResultBuffer<ffi::F32> dw,
                                  ffi::ResultBuffer<ffi::U8> workspace, int64_t tile,
                                  int64_t raster, int64_t swizzle, int64_t split_rows,
                                  bool has_weight) {
  DswigluExtra extra{};
  extra.dgate_up = as_elem(dgate_up->untyped_data());
  return dswiglu_impl(stream, dout, rhs, group_sizes, gate, up, row_weights, extra,
                      dgate_up->element_count() / 2, act, dw, workspace, tile, raster, swizzle,
                      split_rows, has_weight);
}

}  // namespace
}  // namespace moe_gg

#define MOE_DSWIGLU_ARGS                                                                   \
  xla::ffi::Ffi::Bind()                                                                    \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                       \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* dout [M, N] */                           \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* rhs [E, H, N] */                         \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* group_sizes [E] */                       \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* gate [M, H] */                           \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* up [M, H] */                             \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  /* row_weights [M] or [1] */

#define MOE_DSWIGLU_ATTRS                                                                  \
  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  /* act [M, H] */                               \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* dw [M] or [1] */                          \
      .Ret<xla::ffi::Buffer<xla::ffi::U8>>()  /* workspace */                              \
      .Attr<int64_t>("tile")                                                               \
      .Attr<int64_t>("raster")                                                             \
      .Attr<int64_t>("swizzle")                                                            \
      .Attr<int64_t>("split_rows")                                                         \
      .Attr<bool>("has_weight")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmDswiglu, moe_gg::DswigluImpl,
                              MOE_DSWIGLU_ARGS.Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // dgate
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // dup [M, H]
                                  MOE_DSWIGLU_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGroupedGemmDswigluInterleaved, moe_gg::DswigluInterleavedImpl,
                              MOE_DSWIGLU_ARGS.Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // [M, 2H]
                                  MOE_DSWIGLU_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
