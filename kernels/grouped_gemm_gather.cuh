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
// How: the Mainloop warp loads A one row at a time by TMA. A tensor map over x with a box of one
// row of 64 elements (128 bytes) and the 128-byte swizzle writes each gathered row straight
// into its row of A's swizzled shared-memory tile: the swizzle XORs the 16-byte chunk index with
// bits [7, 10) of the destination address, which for a row r of a 1024-byte aligned atom are
// r % 8, as for a box of 8 rows (the layout CUTLASS's TMA of A writes). Each lane loads the x
// rows of 32 of a stage's rows with one coalesced load (a lane per row) and issues their boxes
// (the forward's rows once per tile, the wgrad's a stage ahead); a row outside the problem or
// an index outside [0, T) loads row T, outside the map: TMA fills it with zeros and still counts
// its bytes. The stage's barrier expects A's bytes and B's (one TMA for B), so the producer
// side is CUTLASS's with one arrival, and the MainloopAux warp does not run. (Copying A with
// cp.async instead, 16 bytes a lane, ran the gathered forward at 1.76x and the wgrad at 2.07x the
// TMA kernels' time on permuted rows with two warps copying: benchmarks/archive.md.)
// The consumer side (wgmma on the shared-memory tiles) is CUTLASS's, unchanged. The A
// descriptors that CUTLASS still builds per problem point at x and are never loaded from.
//
// The problem's r0 is read from an operand pointer array the prepare kernel fills: the output
// rows (forward, ptr_D) or the output gradient rows (wgrad, ptr_B) start at r0 * rows_ld.
#pragma once

#include "grouped_gemm.cuh"

#include "cute/arch/copy_sm80.hpp"
#include "cutlass/arch/barrier.h"

namespace moe_gg {

enum class Gather { kRowsM, kRowsK };

// What the gathered mainloop reads besides CUTLASS's arguments.
struct GatherArgs {
  const Element* x;              // [x_rows, ld_x]
  const int32_t* index;          // [rows]: x row of each expert-sorted row
  int64_t x_rows;                // T: indices outside [0, T) read zeros
  int64_t ld_x;                  // K (forward) or the wgrad's M
  const Element* const* ptr_rows;  // per problem: its first row's address in rows_base
  const Element* rows_base;
  int64_t rows_ld;
  CUtensorMap x_rows_map;  // x [x_rows, ld_x] in boxes of one row of 64 elements, 128-byte swizzle
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

namespace moe_gg {

template <class Base, Gather kMode>
struct GatherMainloop : Base {
  using typename Base::DispatchPolicy;
  using typename Base::GmemTiledCopyB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  static_assert(size<1>(typename DispatchPolicy::ClusterShape{}) == 1,
                "a gathered A cannot be multicast: clusters of 1 column only");

  // A's tile is G gathered x rows of C contiguous elements: (BLK_M, BLK_K) for kRowsM,
  // (BLK_K, BLK_M) for kRowsK, loaded as G x kBoxes boxes of one row of 64 elements.
  static constexpr bool kRowsM = kMode == Gather::kRowsM;
  static constexpr int kBlkM = size<0>(TileShape{});
  static constexpr int kBlkK = size<2>(TileShape{});
  static constexpr int kG = kRowsM ? kBlkM : kBlkK;  // gathered rows of a tile
  static constexpr int kC = kRowsM ? kBlkK : kBlkM;  // contiguous elements of each
  static constexpr int kBoxC = 64;                   // a box: 128 bytes, the swizzle's width
  static constexpr int kBoxes = kC / kBoxC;          // boxes per gathered row
  static constexpr int kSlots = kG / 32;             // gathered rows per lane
  static_assert(kC % kBoxC == 0 && kG % 32 == 0, "a tile is whole boxes and 32-row slots");
  using SwizzleAtomA = cute::conditional_t<kRowsM, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                           cute::GMMA::Layout_MN_SW128_Atom<Element>>;
  static_assert(cute::is_same_v<typename Base::SmemLayoutAtomA, SwizzleAtomA>,
                "A's shared-memory atom must be the 128-byte swizzle the row boxes write");

  // A's and B's bytes: every box counts its 128 bytes, zero-filled or not.
  static constexpr uint32_t TmaTransactionBytes = cutlass::bits_to_bytes(
      (size<0>(SmemLayoutA{}) * size<1>(SmemLayoutA{}) +
       size<0>(SmemLayoutB{}) * size<1>(SmemLayoutB{})) *
      static_cast<uint32_t>(sizeof_bits<Element>::value));

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

  // A lane's rows of a tile: rows lane + 32q of the tile's gathered rows, as x rows (x_rows,
  // outside the map, for rows past the problem's and indices outside [0, T)), loaded with one
  // coalesced load per slot.
  struct LaneRows {
    int32_t t[kSlots];
  };

  // The rows of the tile whose gathered rows start at g0 (lim: the problem's rows from g0).
  CUTLASS_DEVICE static LaneRows lane_rows(const GatherSlice& s, int g0, int lim, int lane,
                                           uint32_t x_rows) {
    LaneRows r;
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      const int row = lane + 32 * q;
      const int32_t t = row < lim ? __ldg(s.index + g0 + row) : -1;
      r.t[q] = static_cast<uint32_t>(t) < x_rows ? t : static_cast<int32_t>(x_rows);
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

  // Stage 0's shared-memory address of the lane's row of slot 0, box 0 (the row's first byte:
  // the swizzle moves chunks within the row), and the steps of a slot, a box and a stage.
  struct LaneDst {
    uint32_t base;
    uint32_t slot_step;
    uint32_t box_step;
    uint32_t stage_step;
  };

  CUTLASS_DEVICE static LaneDst lane_dst(TensorStorage& shared_tensors, int lane) {
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    const auto at = [&](int r, int c, int stage) {
      return cute::cast_smem_ptr_to_uint(kRowsM ? &sA(r, c, stage) : &sA(c, r, stage)) & ~127u;
    };
    const uint32_t a0 = at(lane, 0, 0);
    return LaneDst{a0, kSlots > 1 ? at(lane + 32, 0, 0) - a0 : 0u,
                   kBoxes > 1 ? at(lane, kBoxC, 0) - a0 : 0u, at(lane, 0, 1) - a0};
  }

  // One stage of a lane's boxes: its kSlots rows, kBoxes boxes each, on the stage's barrier.
  CUTLASS_DEVICE static void load_stage(const GatherArgs& g, const LaneDst& d,
                                        const LaneRows& rows, int col0, int stage,
                                        uint64_t* full_barrier) {
    const uint64_t map = reinterpret_cast<uint64_t>(&g.x_rows_map);
    const uint32_t bar = cute::cast_smem_ptr_to_uint(full_barrier);
    const uint32_t dst0 = d.base + stage * d.stage_step;
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBoxes; ++b) {
        const uint32_t dst = dst0 + q * d.slot_step + b * d.box_step;
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
            "l"(map), "r"(col0 + b * kBoxC), "r"(rows.t[q]), "r"(bar)
            : "memory");
      }
    }
  }

  // Mainloop warp: B by TMA (one lane, CUTLASS's load without A) and A's rows by TMA (every
  // lane, its 32-row slots).
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
    const GatherArgs& g = params.gather;
    const GatherSlice s = get<2>(load_inputs);
    const int lane = thread_idx % 32;
    const uint32_t x_rows = static_cast<uint32_t>(g.x_rows);  // < 2^31: the handler's check
    const LaneDst d = lane_dst(shared_tensors, lane);
    const int m = static_cast<int>(m_coord);
    const int g0 = tile_g0(m, static_cast<int>(*k_tile_iter));
    LaneRows rows = lane_rows(s, g0, tile_lim(s, g0), lane, x_rows);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      const int k_tile = static_cast<int>(*k_tile_iter);
      const LaneRows cur = rows;
      if constexpr (!kRowsM) {  // the next K-tile's rows, a stage ahead
        const int g1 = tile_g0(m, k_tile + 1);
        rows = lane_rows(s, g1, k_tile_count > 1 ? tile_lim(s, g1) : 0, lane, x_rows);
      }
      pipeline.producer_acquire(smem_pipe_write);
      auto* full_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      if (tma_lane) {
        copy(params.tma_load_b.with(get<1>(input_tensormaps), *full_barrier, mcast_mask_b),
             tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, smem_pipe_write.index()));
      }
      const int col0 = kRowsM ? k_tile * kBlkK : m * kBlkM;
      load_stage(g, d, cur, col0, smem_pipe_write.index(), full_barrier);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
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
  if (t == 0) {
    return ffi::Error::InvalidArgument(std::string(kWhoGather) + " " + op +
                                       ": x has no rows; valid: at least one (empty x: the "
                                       "permute path)");
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

// The gather arguments over x [T, K] by row_map (a problem's first row is read from the output
// or output gradient pointer array, whose rows start at rows_base with rows_ld elements), with
// the tensor map of x's rows (GatherArgs::x_rows_map); an error if the driver rejects it.
inline ffi::Error gather_args(const ffi::Buffer<ffi::BF16>& x, const ffi::Buffer<ffi::S32>& row_map,
                              const Element* rows_base, int64_t rows_ld, GatherArgs* g) {
  const int64_t t = x.dimensions()[0], k = x.dimensions()[1];
  *g = GatherArgs{as_elem(x.untyped_data()), row_map.typed_data(), t, k, nullptr, rows_base,
                  rows_ld, {}};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(t)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * sizeof(Element)};
  const cuuint32_t box[2] = {64, 1};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &g->x_rows_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<Element*>(g->x), dims,
      strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return ffi::Error::Internal(std::string(kWhoGather) + ": cuTensorMapEncodeTiled failed (" +
                                std::to_string(static_cast<int>(r)) + ") for x [" +
                                std::to_string(t) + ", " + std::to_string(k) + "]");
  }
  return ffi::Error::Success();
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
