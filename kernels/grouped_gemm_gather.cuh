// The gathered-operand mainloop of the Hopper grouped GEMM (kernels/grouped_gemm_gather.cu):
// CUTLASS's sm_90a pointer-array mainloop (MainloopSm90ArrayTmaGmmaWarpSpecialized) whose A
// operand is read by row index from x [T, K] instead of by TMA from a permuted copy of x.
//
//   Gather::kRowsM (forward): A(m, k) = x[index[r0 + m], k]: the group's rows are x's rows.
//   Gather::kRowsK (wgrad):   A(m, k) = x[index[r0 + k], m]: the group's rows are the
//                             contraction (A = rows^T, M-major in shared memory).
// r0 is the problem's first row in the expert-sorted order; an index out of [0, T) (a dropped
// or padded row: row_map holds T there) reads a zero row, as the permute writes one.
//
// How: the kernels already run a second producer warp (MainloopAux) for mainloops that declare
// an auxiliary load (CUTLASS's blockwise-scaled FP8 mainloop loads its scales there); our copy
// of the ping-pong kernel (kernels/grouped_gemm_gather_pingpong.cuh) runs a third in place of
// its idle Epilogue-load warp. The Mainloop warp and the MainloopAux warps (kParts: 3 with the
// ping-pong kernel, 2 with CUTLASS's cooperative one) load A with cp.async, a share of each
// tile's rows each, 16 bytes a lane, zero-filled past the problem's rows, past K and for
// out-of-range indices, and each lane arrives on the stage's full barrier when its copies land
// (cp.async.mbarrier.arrive.noinc: 32 kParts arrivals); one lane of the Mainloop warp also
// loads B by TMA (its expect-tx is B's bytes). So a stage's barrier completes on 1 + 32 kParts
// arrivals and B's bytes: NumProducerThreadEvents. (One warp alone, issuing each tile's 1024 copies with
// their index loads, ran the Qwen3-like forward at a fifth of the TMA kernels' speed on an
// H200.) Each warp loads the x rows of its share of a stage with one coalesced load per 32 rows
// (a lane per row) and hands them to the copying lanes by shuffles: the forward's once per tile
// (its rows are the tile's at every K-tile), the wgrad's a stage ahead. (Each lane loading its
// rows' indices one by one before their copies stalled both kernels on those loads: Nsight
// Compute, benchmarks/results/ncu_gather_two_warps.txt.) The consumer side (wgmma on the
// shared-memory tiles) is CUTLASS's, unchanged: A's tile has the same swizzled layout as if TMA
// had written it. The A descriptors that CUTLASS still builds per problem point at x and are
// never loaded from.
//
// The problem's r0 is read from an operand pointer array the prepare kernel fills: the output
// rows (forward, ptr_D) or the output gradient rows (wgrad, ptr_B) start at r0 * rows_ld.
#pragma once

#include "grouped_gemm.cuh"
#include "grouped_gemm_gather_pingpong.cuh"

#include "cute/arch/copy_sm80.hpp"
#include "cutlass/arch/barrier.h"

namespace moe_gg {

enum class Gather { kRowsM, kRowsK };

// The dispatch policy of the gathered mainloop: CUTLASS's members, tagged with an auxiliary load
// (the kernels then run MainloopAux warps: HasAuxiliaryLoad below). A ping-pong base schedule
// selects our copy of CUTLASS's ping-pong kernel (kernels/grouped_gemm_gather_pingpong.cuh),
// whose warps 0-2 copy A; a cooperative one CUTLASS's kernel, whose warps 0-1 copy A.
template <int Stages_, class ClusterShape_, class BaseSchedule>
struct GatherPolicy {
  static constexpr int Stages = Stages_;
  static constexpr int PipelineAsyncMmaStages = 1;
  using ClusterShape = ClusterShape_;
  using ArchTag = cutlass::arch::Sm90;
  static constexpr bool kPingpong =
      cute::is_base_of_v<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, BaseSchedule>;
  static_assert(kPingpong || cute::is_base_of_v<
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 BaseSchedule>,
                "the gathered kernels are the pointer-array ping-pong or cooperative ones");
  using Schedule = cute::conditional_t<kPingpong, KernelGatherPingpong, BaseSchedule>;
  static constexpr int kCopyWarps = kPingpong ? 3 : 2;
};

// What the gathered mainloop reads besides CUTLASS's arguments.
struct GatherArgs {
  const Element* x;              // [x_rows, ld_x]
  const int32_t* index;          // [rows]: x row of each expert-sorted row
  int64_t x_rows;                // T: indices outside [0, T) read zeros
  int64_t ld_x;                  // K (forward) or the wgrad's M
  const Element* const* ptr_rows;  // per problem: its first row's address in rows_base
  const Element* rows_base;
  int64_t rows_ld;
};

// What a gathered kernel's launch reads besides the group arrays: its epilogue's extra (the
// plain epilogue's is unused) and the gather arguments (ptr_rows filled by mainloop_args).
template <class EpiExtra>
struct GatherExtra {
  EpiExtra epi;
  GatherArgs gather;
};

// One problem's slice of the index and the bounds of its A operand.
struct GatherSlice {
  const int32_t* index;  // index + r0
  int m;                 // the problem's M and K
  int k;
};

}  // namespace moe_gg

namespace cutlass::gemm::kernel::detail {
template <int Stages, class ClusterShape, class KernelSchedule>
struct HasAuxiliaryLoad<moe_gg::GatherPolicy<Stages, ClusterShape, KernelSchedule>>
    : cute::true_type {};
}  // namespace cutlass::gemm::kernel::detail

namespace moe_gg {

template <class Base, Gather kMode>
struct GatherMainloop : Base {
  using BasePolicy = typename Base::DispatchPolicy;
  using DispatchPolicy = GatherPolicy<BasePolicy::Stages, typename BasePolicy::ClusterShape,
                                      typename BasePolicy::Schedule>;
  using typename Base::GmemTiledCopyB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  static constexpr int kParts = DispatchPolicy::kCopyWarps;  // warps copying A
  static constexpr int NumProducerThreadEvents = 1 + 32 * kParts;  // B's TMA + the copying lanes
  static_assert(cutlass::gemm::kernel::detail::HasAuxiliaryLoad_v<DispatchPolicy>,
                "the kernels must run the MainloopAux warp that loads A");
  static_assert(size<1>(typename BasePolicy::ClusterShape{}) == 1,
                "a gathered A cannot be multicast: clusters of 1 column only");

  static constexpr uint32_t TmaTransactionBytes = cutlass::bits_to_bytes(
      size<0>(SmemLayoutB{}) * size<1>(SmemLayoutB{}) *
      static_cast<uint32_t>(sizeof_bits<typename Base::ElementB>::value));

  struct Arguments : Base::Arguments {
    GatherArgs gather;
  };
  struct Params : Base::Params {
    GatherArgs gather;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.tma_transaction_bytes = TmaTransactionBytes;
    p.gather = args.gather;
    return p;
  }

  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& problem_shape_mnkl,
                                Params const& params) const {
    auto t = Base::load_init(problem_shape_mnkl, params);
    return cute::make_tuple(get<0>(t), get<1>(t), GatherSlice{params.gather.index, 0, 0});
  }

  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE auto tensors_perform_update(InputTensors const& in, Params const& params,
                                             ProblemShapeMNKL problem_shape_mnkl,
                                             int32_t next_batch) {
    const GatherArgs& g = params.gather;
    const int64_t r0 = (g.ptr_rows[next_batch] - g.rows_base) / g.rows_ld;
    GatherSlice s{g.index + r0, static_cast<int>(get<0>(problem_shape_mnkl)),
                  static_cast<int>(get<2>(problem_shape_mnkl))};
    return cute::make_tuple(get<0>(in), get<1>(in), s);
  }

  // A's tile is G gathered x rows of C contiguous elements: (BLK_M, BLK_K) for kRowsM,
  // (BLK_K, BLK_M) for kRowsK. kParts warps copy it (warp p of the producer warp group, each on
  // the producers' 40 registers): lane l copies chunk l % kChunks (8 elements, 16 bytes) of row
  // l / kChunks + j * kRowsPerPass for the passes j of its warp (j = p + kParts * i, j < kPasses),
  // so a warp instruction reads whole 16-byte runs of kRowsPerPass rows.
  static constexpr bool kRowsM = kMode == Gather::kRowsM;
  static constexpr int kBlkM = size<0>(TileShape{});
  static constexpr int kBlkK = size<2>(TileShape{});
  static constexpr int kG = kRowsM ? kBlkM : kBlkK;  // gathered rows of a tile
  static constexpr int kC = kRowsM ? kBlkK : kBlkM;  // contiguous elements of each
  static constexpr int kChunks = kC / 8;
  static_assert(kC % 8 == 0 && 32 % kChunks == 0, "a warp covers whole rows of a tile");
  static constexpr int kRowsPerPass = 32 / kChunks;
  static_assert(kG % kRowsPerPass == 0, "a tile is whole passes");
  static constexpr int kPasses = kG / kRowsPerPass;                     // of the tile
  static constexpr int kMaxPasses = (kPasses + kParts - 1) / kParts;  // of a warp
  // A lane's destinations repeat every 8 rows with one stride when A's atom is the 128-byte
  // swizzle (8 rows of 128 bytes, rows 8 apart in atoms 1024 bytes apart, which the swizzle's
  // bits [7, 10) do not see). A warp's passes are kParts * kRowsPerPass rows apart, so a lane's
  // destinations cycle through kOffsets swizzle phases: it keeps kOffsets offsets and a step.
  static constexpr int kPassRows = kParts * kRowsPerPass;
  static constexpr int kOffsets = kPassRows % 8 == 0 ? 1 : kPassRows % 4 == 0 ? 2
                                                        : kPassRows % 2 == 0 ? 4 : 8;
  using SwizzleAtomA = cute::conditional_t<kRowsM, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                           cute::GMMA::Layout_MN_SW128_Atom<Element>>;
  static_assert(cute::is_same_v<typename Base::SmemLayoutAtomA, SwizzleAtomA>,
                "A's shared-memory atom must be the 128-byte swizzle the gather's offsets assume");
  static_assert((kOffsets * kPassRows) % 8 == 0, "a lane's cycle spans whole swizzle atoms");
  static_assert((kOffsets + 1) * kPassRows <= kG, "a lane's offsets and step lie in the tile");

  // One lane's part of a tile's copies: where its rows' chunks land and which rows it reads.
  struct LaneCopies {
    uint32_t smem[kOffsets];  // stage 0's address of its pass i, for i % kOffsets
    uint32_t cycle_step;      // the address step of kOffsets passes (i -> i + kOffsets)
    uint32_t stage_step;      // the address step of a stage
    int sub;                  // its row within each pass
    int part;                 // its warp's passes: j = part + kParts * i
    int chunk;
  };

  // A warp's rows of a tile: up to kWarpRows, in pass order (warp row w is row w % kRowsPerPass
  // of the warp's pass w / kRowsPerPass). Lane l holds the x row of warp rows l + 32q,
  // q < kSlots, loaded with one coalesced load per slot, and the copying lanes take theirs by
  // shuffles.
  static constexpr int kWarpRows = kMaxPasses * kRowsPerPass;
  static constexpr int kSlots = (kWarpRows + 31) / 32;
  static_assert(32 % kRowsPerPass == 0, "no pass spans two slots");
  struct WarpRows {
    int32_t t[kSlots];  // x rows; -1 past the problem's rows
  };

  // The warp's part: warp p of the producer warp group (the Mainloop warp is 0, the MainloopAux
  // warps 1 and, in our ping-pong kernel, 2).
  CUTLASS_DEVICE static int warp_part() {
    return cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  }

  // The rows of the tile whose gathered rows start at g0 (lim: the problem's rows from g0).
  CUTLASS_DEVICE static WarpRows warp_rows(const GatherSlice& s, int g0, int lim, int part,
                                           int lane) {
    WarpRows r;
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      const int w = lane + 32 * q;
      const int j = part + kParts * (w / kRowsPerPass);  // its pass
      const int row = w % kRowsPerPass + j * kRowsPerPass;
      r.t[q] = w < kWarpRows && j < kPasses && row < lim ? __ldg(s.index + g0 + row) : -1;
    }
    return r;
  }

  // The first gathered row of a stage's tile and the problem's rows from it.
  CUTLASS_DEVICE static int tile_g0(int m_coord, int k_tile) {
    return kRowsM ? m_coord * kBlkM : k_tile * kBlkK;
  }
  CUTLASS_DEVICE static int tile_lim(const GatherSlice& s, int g0) {
    return (kRowsM ? s.m : s.k) - g0;
  }

  CUTLASS_DEVICE static LaneCopies lane_copies(TensorStorage& shared_tensors, int part,
                                                int lane) {
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    LaneCopies lc;
    lc.chunk = lane % kChunks;
    lc.sub = lane / kChunks;
    lc.part = part;
    const int row = lc.sub + part * kRowsPerPass;
    const auto at = [&](int r, int stage) {
      return cute::cast_smem_ptr_to_uint(kRowsM ? &sA(r, lc.chunk * 8, stage)
                                                : &sA(lc.chunk * 8, r, stage));
    };
    CUTLASS_PRAGMA_UNROLL
    for (int o = 0; o < kOffsets; ++o) {
      lc.smem[o] = at(row + o * kPassRows, 0);
    }
    lc.cycle_step = at(row + kOffsets * kPassRows, 0) - lc.smem[0];
    lc.stage_step = at(row, 1) - lc.smem[0];
    return lc;
  }

  // One stage of one warp's copies: cp.async of 16 bytes a lane (zero-filled past the problem's
  // rows, past x's columns and for indices outside [0, T)), each lane's x row shuffled from the
  // lane holding it (rows: the warp's rows of this stage's tile), then the lane's arrival on the
  // stage's full barrier when its copies land (cp.async.mbarrier.arrive.noinc).
  CUTLASS_DEVICE static void copy_stage(const GatherArgs& g, const GatherSlice& s,
                                        const LaneCopies& lc, const WarpRows& rows, int m_coord,
                                        int k_tile, int stage) {
    const int col = (kRowsM ? k_tile * kBlkK : m_coord * kBlkM) + lc.chunk * 8;
    // x's columns are a multiple of 8 (the handler's check): a lane's 8 are all in or all out
    const bool col_ok = col + 8 <= (kRowsM ? s.k : s.m);
    const Element* x_col = g.x + col;
    const uint32_t x_rows = static_cast<uint32_t>(g.x_rows);
    const int ld_x = static_cast<int>(g.ld_x);  // < 2^31: the handler's check
    const uint32_t stage_off = stage * lc.stage_step;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kMaxPasses; ++i) {
      if (kPasses % kParts != 0 && i == kMaxPasses - 1 && lc.part + kParts * i >= kPasses) {
        break;  // this warp has one pass fewer (warp-uniform)
      }
      const int w0 = i * kRowsPerPass;  // the pass's first warp row
      const int32_t t = __shfl_sync(0xffffffffu, rows.t[w0 / 32], w0 % 32 + lc.sub);
      const bool ok = col_ok && static_cast<uint32_t>(t) < x_rows;
      const Element* src = x_col + static_cast<int64_t>(ok ? t : 0) * ld_x;
      const uint32_t dst = lc.smem[i % kOffsets] + (i / kOffsets) * lc.cycle_step + stage_off;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                   "r"(ok ? 16 : 0));
    }
  }

  // One warp's copies of A over a tile's K-tiles (its part of each stage's rows), each stage
  // acquired, per_stage(k_tile_iter, stage) run (the Mainloop warp's TMA of B), copied and
  // committed.
  template <class KTileIterator, class PerStage>
  CUTLASS_DEVICE static void copy_tile(Params const& params, MainloopPipeline& pipeline,
                                       PipelineState smem_pipe_write, const GatherSlice& s,
                                       TensorStorage& shared_tensors, int m,
                                       KTileIterator k_tile_iter, int k_tile_count, int part,
                                       int lane, PerStage&& per_stage) {
    const LaneCopies lc = lane_copies(shared_tensors, part, lane);
    const int g0 = tile_g0(m, static_cast<int>(*k_tile_iter));
    WarpRows rows = warp_rows(s, g0, tile_lim(s, g0), part, lane);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      const int k_tile = static_cast<int>(*k_tile_iter);
      const WarpRows cur = rows;
      if constexpr (!kRowsM) {  // the next K-tile's rows, a stage ahead
        const int g1 = tile_g0(m, k_tile + 1);
        rows = warp_rows(s, g1, k_tile_count > 1 ? tile_lim(s, g1) : 0, part, lane);
      }
      pipeline.producer_acquire(smem_pipe_write);
      per_stage(k_tile_iter, smem_pipe_write);
      copy_stage(params.gather, s, lc, cur, m, k_tile, smem_pipe_write.index());
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // Mainloop warp: B by TMA (one lane, CUTLASS's load without A) and its part (0) of A's rows.
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, GatherSlice> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    const bool tma_lane = cute::elect_one_sync();
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t cluster_shape_x = get<0>(typename DispatchPolicy::ClusterShape());
    const uint32_t cluster_x = block_rank_in_cluster % cluster_shape_x;
    const uint32_t cluster_y = block_rank_in_cluster / cluster_shape_x;
    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);  // (BLK_N, BLK_K, k)
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    uint16_t mcast_mask_b = 0;
    if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_y, Int<0>{}));
      }
    }
    copy_tile(params, pipeline, smem_pipe_write, get<2>(load_inputs), shared_tensors,
              static_cast<int>(m_coord), k_tile_iter, k_tile_count, 0, thread_idx % 32,
              [&](const KTileIterator& it, const PipelineState& stage) {
                if (tma_lane) {
                  auto* tma_barrier = pipeline.producer_get_barrier(stage);
                  copy(params.tma_load_b.with(get<1>(input_tensormaps), *tma_barrier,
                                              mcast_mask_b),
                       tBgB(_, _, _, *it), tBsB(_, _, _, stage.index()));
                }
              });
  }

  // MainloopAux warps: their parts (warp_part(): 1, and 2 in our ping-pong kernel) of A's rows.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline,
                                     PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, GatherSlice> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                                     int k_tile_count, int thread_idx,
                                     uint32_t /*block_rank_in_cluster*/,
                                     TensorStorage& shared_tensors) {
    copy_tile(params, pipeline, smem_pipe_write, get<2>(load_inputs), shared_tensors,
              static_cast<int>(get<0>(blk_coord)), k_tile_iter, k_tile_count, warp_part(),
              thread_idx % 32, [](const KTileIterator&, const PipelineState&) {});
  }
};

// A gathered kernel definition (for run_grouped): CUTLASS's mainloop for LayoutA (B row-major)
// wrapped by GatherMainloop, around the collective epilogue Epi; EpiArgs::make<Kernel>(g, epi)
// builds the epilogue's arguments from the group arrays and GatherExtra's epi.
template <Gather kMode>
struct GatherWrap {
  template <class Base>
  using type = GatherMainloop<Base, kMode>;
};

template <class LayoutA, class Config, Gather kMode, class Epi, class EpiArgs>
struct GatherKernelDef : KernelFor<LayoutA, cutlass::layout::RowMajor, Config, Epi,
                                   GatherWrap<kMode>::template type> {
  using Kernel = typename KernelFor<LayoutA, cutlass::layout::RowMajor, Config, Epi,
                                    GatherWrap<kMode>::template type>::Kernel;
  static constexpr bool kOwnMainloopArgs = true;

  // ptr_rows: the output's pointer array (kRowsM: a problem's first output row) or dout's
  // (kRowsK: its first row of the output gradient).
  template <class Arrays, class EpiExtra>
  static typename Kernel::MainloopArguments mainloop_args(const Arrays& g,
                                                          const GatherExtra<EpiExtra>& extra) {
    typename Kernel::MainloopArguments a{};
    a.ptr_A = g.ptr_a;
    a.dA = g.stride_a;
    a.ptr_B = g.ptr_b;
    a.dB = g.stride_b;
    a.gather = extra.gather;
    if constexpr (kMode == Gather::kRowsM) {
      a.gather.ptr_rows = g.ptr_d;
    } else {
      a.gather.ptr_rows = g.ptr_b;
    }
    return a;
  }

  template <class Arrays, class EpiExtra>
  static typename Kernel::EpilogueArguments epilogue_args(const Arrays& g,
                                                          const GatherExtra<EpiExtra>& extra) {
    return EpiArgs::template make<Kernel>(g, extra.epi);
  }
};

// The plain TMA-store epilogue's arguments (EpiArgs of GatherKernelDef).
struct PlainEpilogueArgs {
  template <class Kernel, class Arrays, class EpiExtra>
  static typename Kernel::EpilogueArguments make(const Arrays& g, const EpiExtra&) {
    return plain_epilogue_args<Kernel>(g);
  }
};

constexpr const char* kWhoGather = "moe_praxis gathered grouped GEMM";

// The tiles the gathered kernels are built for (moe_praxis/ops/gathered_gemm.py, GATHER_TILES):
// F<Config>() for tile 1, 10 or 11, else an error.
template <class F>
ffi::Error dispatch_gather_tile(int64_t tile, Schedule sched, F&& f) {
  ffi::Error bad = check_schedule(sched);
  if (bad.failure()) return bad;
  switch (tile) {
    case 1:
      return f(PingpongSmall{});
    case 10:
      return f(AdaptiveWideThin11{});
    case 11:
      return f(PingpongMidC<1, 1>{});
    default:
      return ffi::Error::InvalidArgument(std::string(kWhoGather) + ": tile=" +
                                         std::to_string(tile) +
                                         " has no gathered kernel; valid: 1, 10, 11");
  }
}

// The handlers' check of the gather: row_map has one entry per output row and x's rows are whole
// 16-byte chunks.
inline ffi::Error check_gather(const char* op, int64_t t, int64_t k,
                               const ffi::Buffer<ffi::S32>& row_map, int64_t rows) {
  if (static_cast<int64_t>(row_map.element_count()) != rows) {
    return ffi::Error::InvalidArgument(std::string(kWhoGather) + " " + op + ": row_map has " +
                                       std::to_string(row_map.element_count()) +
                                       " entries; valid: one per output row (" +
                                       std::to_string(rows) + ")");
  }
  if (k % 8 != 0) {
    return ffi::Error::InvalidArgument(std::string(kWhoGather) + " " + op + ": x has " +
                                       std::to_string(k) +
                                       " columns; valid: a multiple of 8 (16-byte rows)");
  }
  if (t > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument(std::string(kWhoGather) + " " + op + ": x is [" +
                                       std::to_string(t) + ", " + std::to_string(k) +
                                       "]; valid: fewer than 2^31 rows and columns");
  }
  return ffi::Error::Success();
}

// The gathered handlers' common part: check the gather (row_map against the output rows, x's
// rows whole 16-byte chunks), then F<Config>() for the tile (dispatch_gather_tile).
template <class F>
ffi::Error dispatch_gather(const char* op, const ffi::Buffer<ffi::BF16>& x,
                           const ffi::Buffer<ffi::S32>& row_map, int64_t rows, int64_t tile,
                           Schedule sched, F&& f) {
  ffi::Error bad = check_gather(op, x.dimensions()[0], x.dimensions()[1], row_map, rows);
  if (bad.failure()) return bad;
  return dispatch_gather_tile(tile, sched, std::forward<F>(f));
}

// The gather arguments over x [T, K] by row_map; a problem's first row is read from the output
// (or output gradient) pointer array, whose rows start at rows_base with rows_ld elements.
inline GatherArgs gather_args(const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::S32>& row_map,
                              const Element* rows_base, int64_t rows_ld) {
  return GatherArgs{as_elem(x.untyped_data()), row_map.typed_data(), x.dimensions()[0],
                    x.dimensions()[1], nullptr, rows_base, rows_ld};
}

// prepare + the gathered kernel(s) of Def: A's strides are x's (leading dimension k), B's b_ld,
// D's d_ld.
template <class Def, class EpiExtra>
ffi::Error run_gather(cudaStream_t stream, const PrepareParams& p, int64_t k, int64_t b_ld,
                      int64_t d_ld, const GatherExtra<EpiExtra>& extra,
                      ffi::ResultBuffer<ffi::U8>& workspace, Schedule sched) {
  return run_grouped<Def>(stream, p, make_ld_stride<typename Def::StrideA>(k),
                          make_ld_stride<typename Def::StrideB>(b_ld),
                          make_ld_stride<typename Def::StrideD>(d_ld),
                          reinterpret_cast<uint8_t*>(workspace->untyped_data()),
                          static_cast<int64_t>(workspace->size_bytes()), sched, extra);
}

}  // namespace moe_gg
