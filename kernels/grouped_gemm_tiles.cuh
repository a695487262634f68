// The Hopper grouped GEMM's tile configurations and the CUTLASS kernel type of each
// (KernelFor, GemmDef, the adaptive pair). Part of kernels/grouped_gemm.cuh (which includes
// grouped_gemm_prepare.cuh, which includes this file).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_gemm_common.h"
#include "xla/ffi/api/ffi.h"

namespace moe_gg {

namespace ffi = xla::ffi;
using namespace cute;

using Element = cutlass::bfloat16_t;
using ElementAcc = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using UnderlyingShape = ProblemShape::UnderlyingProblemShape;

using moe_gg_common::group_array_bytes;
using moe_gg_common::kAlign;
using moe_gg_common::kGroupArrayBytesPerGroup;
using moe_gg_common::kPrepareThreads;
using moe_gg_common::OperandMap;
using moe_gg_common::zero_range;

// How these kernels name themselves in their errors (grouped_gemm_common.h).
constexpr const char* kWho = "moe_praxis grouped GEMM";

// Tile configurations (index = the FFI attribute `tile`; the rule that picks one lives in
// moe_praxis/ops/grouped_gemm.py, TILE_CONFIGS, and docs/grouped_gemm.md).
struct CoopLarge {  // tile 0: cooperative, 256x128x64, cluster 2x1
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using Tile = Shape<_256, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  static constexpr int kTilesInFlight = 1;  // output tiles a CTA works on at once
};
struct PingpongSmall {  // tile 1: ping-pong, 128x128x64, cluster 2x1 (small N, small groups)
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  static constexpr int kTilesInFlight = 2;  // one per consumer warpgroup
};
// The cluster shape (CM x CN CTAs): CUTLASS's group scheduler rounds each problem's tile grid up
// to whole clusters, so a group with an odd count of row tiles under a 2x1 cluster issues one
// tile of nothing but zeros (its CTA must run: it takes part in the cluster's TMA multicast of
// B). 1x2 clusters (A multicast) round the column tiles instead: none are wasted when the
// output width is an even count of tiles; 1x1 wastes none, without multicast.
template <int CM, int CN>
struct CoopWideC {  // cooperative, 128x256x64
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr int kTilesInFlight = 1;
};
template <int CM, int CN>
struct PingpongThinC {  // ping-pong, 64x256x64 (many small / ragged groups: 64-row tiles waste
                        // less at each group's ragged end)
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = Shape<_64, _256, _64>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr int kTilesInFlight = 2;
};
using CoopWide = CoopWideC<2, 1>;          // tile 2
using PingpongThin = PingpongThinC<2, 1>;  // tile 3
// tile 4: adaptive, chosen on the device at every call from the group sizes: the prepare kernel
// counts the output tiles each of First and Second would issue and keeps the cheaper one
// (cost = waves x work per wave; Second's cost x kFwdCostPct / 100 for the forwards, x
// kDgradCostPct / 100 for dgrad: its measured per-FLOP overhead when neither wastes a tile);
// both kernels are launched, the other one gets no tiles (an empty persistent launch: a few
// microseconds).
template <class A, class B, int kFwdCostPctV, int kDgradCostPctV>
struct Adaptive {
  using First = A;
  using Second = B;
  static constexpr int kFwdCostPct = kFwdCostPctV;
  static constexpr int kDgradCostPct = kDgradCostPctV;
};
// 64x256 ping-pong against 128x256 cooperative on balanced groups, where neither wastes a tile
// (wall clock, the benchmark's shapes, H200): ping-pong takes longer per FLOP, more so in the
// forwards than in dgrad. One factor for both ops mispicked on the benchmark's skewed sizes (a
// lower one took 64x256 for a forward where it was slower, a higher one would take 128x256 for
// a dgrad where that was slower), so each op has its own: 108 for the forwards (plain and
// fused), 105 for dgrad (above dgrad's balanced mean, which would take 64x256 for a skewed dgrad
// where it was slower). The wave count is the coarse part of the model. The measurements:
// benchmarks/results/kernels_history.md, "grouped_gemm.cuh: AdaptiveWideThin cost factors".
using AdaptiveWideThin = Adaptive<CoopWide, PingpongThin, 108, 105>;
// tiles 5-7: the same with 1x2 clusters; 8-10: with 1x1 clusters (kernels/grouped_gemm.cuh
// dispatch_tile; TILE_CONFIGS in moe_praxis/ops/grouped_gemm.py).
using AdaptiveWideThin12 = Adaptive<CoopWideC<1, 2>, PingpongThinC<1, 2>, 108, 105>;
using AdaptiveWideThin11 = Adaptive<CoopWideC<1, 1>, PingpongThinC<1, 1>, 108, 105>;
// tiles 11-12: ping-pong, 128x192x64 (narrow outputs: N = 768 is 4 column tiles; each consumer
// warpgroup holds a whole 128x192 accumulator, 192 registers per thread, and its epilogue
// overlaps the other warpgroup's mainloop, which the cooperative kernels' epilogue does not)
template <int CM, int CN>
struct PingpongMidC {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = Shape<_128, _192, _64>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  static constexpr int kTilesInFlight = 2;
};
constexpr int kNumTiles = 13;

// What a fused epilogue needs beyond the group arrays (kernels/grouped_gemm_swiglu.cu); the
// plain epilogue ignores it.
struct EpilogueExtra {
  const Element* row_base;    // d's base: a group's first row is (ptr_d[e] - row_base) / ld
  Element* up;                // [rows, ld] second output (up projection)
  Element* act;               // [rows, ld] third output (activation)
  const float* row_weights;   // [rows] routing weights multiplied into act, or nullptr
  int64_t ld;                 // row length of the three outputs
};

// CUTLASS's collective mainloop as the builder makes it (KernelFor's default Wrap).
template <class Mainloop>
using BuilderMainloop = Mainloop;

// The CUTLASS kernel of one tile configuration around a collective epilogue; Wrap<M> is the
// collective mainloop made from the builder's M (the gathered kernels wrap it).
template <class LayoutA, class LayoutB, class Config, class CollectiveEpilogueT,
          template <class> class Wrap = BuilderMainloop>
struct KernelFor {
  static constexpr int kAlignment = 8;  // 16 bytes of bf16
  using CollectiveEpilogue = CollectiveEpilogueT;
  using CollectiveMainloop = Wrap<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment, ElementAcc, typename Config::Tile,
      typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using TileConfig = Config;
  static constexpr bool kAdaptive = false;
};

// CUTLASS's TMA-store epilogue, D = accumulator (bf16, row-major, no C operand).
template <class Config>
using PlainEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
    typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
    ElementAcc, void, cutlass::layout::RowMajor*, 8, Element, cutlass::layout::RowMajor*, 8,
    typename Config::Epilogue,
    cutlass::epilogue::fusion::LinearCombination<Element, ElementAcc, void>>::CollectiveOp;

// The plain epilogue's arguments over the group arrays g: D = accumulator, no C.
template <class Kernel, class Arrays>
typename Kernel::EpilogueArguments plain_epilogue_args(const Arrays& g) {
  typename Kernel::EpilogueArguments a{};
  a.thread.alpha = 1.0f;
  a.thread.beta = 0.0f;
  a.thread.alpha_ptr = nullptr;
  a.thread.beta_ptr = nullptr;
  a.ptr_C = nullptr;
  a.dC = g.stride_d;
  a.ptr_D = g.ptr_d;
  a.dD = g.stride_d;
  return a;
}

template <class LayoutA, class LayoutB, class Config>
struct GemmDef : KernelFor<LayoutA, LayoutB, Config, PlainEpilogue<Config>> {
  using Kernel = typename KernelFor<LayoutA, LayoutB, Config, PlainEpilogue<Config>>::Kernel;

  template <class Arrays>
  static typename Kernel::EpilogueArguments epilogue_args(const Arrays& g, const EpilogueExtra&) {
    return plain_epilogue_args<Kernel>(g);
  }
};

// The adaptive pair of two kernel definitions sharing the operand arrays (the strides must
// agree); run_grouped launches both. Any Def family specialises Adaptive<A, B, kF, kD> as this.
template <class FirstDef, class SecondDef, int kFwdPct, int kDgradPct>
struct AdaptivePair {
  using First = FirstDef;
  using Second = SecondDef;
  using Kernel = typename First::Kernel;
  using StrideA = typename First::StrideA;
  using StrideB = typename First::StrideB;
  using StrideD = typename First::StrideD;
  static_assert(std::is_same_v<StrideA, typename Second::StrideA> &&
                    std::is_same_v<StrideB, typename Second::StrideB> &&
                    std::is_same_v<StrideD, typename Second::StrideD>,
                "an adaptive pair must share its operand strides");
  static constexpr bool kAdaptive = true;
  static constexpr int kFwdCostPct = kFwdPct;
  static constexpr int kDgradCostPct = kDgradPct;
};

template <class LayoutA, class LayoutB, class A, class B, int kF, int kD>
struct GemmDef<LayoutA, LayoutB, Adaptive<A, B, kF, kD>>
    : AdaptivePair<GemmDef<LayoutA, LayoutB, A>, GemmDef<LayoutA, LayoutB, B>, kF, kD> {};


}  // namespace moe_gg
