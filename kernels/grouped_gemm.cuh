// Grouped GEMM for Hopper (sm_90a): CUTLASS pointer-array grouped GEMM, warp-specialized, TMA,
// bf16 in, fp32 accumulate, bf16 out. Shared by grouped_gemm_{fwd,dgrad,wgrad}.cu.
//
// Group sizes stay on the device. Each FFI call launches, on XLA's stream:
//   1. moe_gg_prepare: scans group_sizes (clamped to [0, rows left]) and writes per-problem
//      shapes, operand pointers and strides into the workspace (one problem per group, or, with
//      split_rows, one per split_rows-row piece of each group's ragged rows); its other blocks zero
//      what CUTLASS will not write (rows past sum(group_sizes) for fwd/dgrad; whole [K, N]
//      slices of experts with no rows for wgrad, whose K = 0 problem CUTLASS would otherwise
//      store as an uninitialised accumulator: we give such a group M = 0 so it has no tiles).
//   2. the CUTLASS kernel, reading those arrays (no host problem shapes: persistent grid of
//      one CTA per SM, groups with no tiles are skipped by the group tile scheduler).
// No device-to-host copy and no synchronisation: the call is CUDA-graph safe.
//
// Workspace (an output buffer of the FFI call, sized by moe_praxis/ops/grouped_gemm.py):
//   [kGroupArrayBytesPerGroup * P bytes of problem arrays, 256-aligned][CUTLASS workspace],
//   P = num_problems(E, rows, split_rows).
// The handler checks that the buffer is large enough and fails with a message otherwise.
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

// The CUTLASS kernel of one tile configuration around a collective epilogue.
template <class LayoutA, class LayoutB, class Config, class CollectiveEpilogueT>
struct KernelFor {
  static constexpr int kAlignment = 8;  // 16 bytes of bf16
  using CollectiveEpilogue = CollectiveEpilogueT;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment, ElementAcc, typename Config::Tile,
      typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
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

template <class LayoutA, class LayoutB, class Config>
struct GemmDef : KernelFor<LayoutA, LayoutB, Config, PlainEpilogue<Config>> {
  using Kernel = typename KernelFor<LayoutA, LayoutB, Config, PlainEpilogue<Config>>::Kernel;

  template <class Arrays>
  static typename Kernel::EpilogueArguments epilogue_args(const Arrays& g, const EpilogueExtra&) {
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

// Row split (fwd, dgrad, fused fwd): a group's ragged rows are issued as problems of at most
// split_rows rows (0: one problem per group). CUTLASS's group scheduler hands out a problem's
// tiles column by column (along_m) over all of its rows, so one large group makes a wave of
// CTAs stream that whole group's rows for each column band: with pieces, a wave's rows and
// columns both stay L2-sized. split_rows is a multiple of 256 (whole tiles and clusters of every
// tile configuration), so the pieces issue exactly the tiles of the unsplit group.
// Problems: every group gets at least one (M = 0 when empty), and a group of m > 0 rows
// ceil(m / split_rows) <= 1 + (m - 1) / split_rows, so E + rows / split_rows bound the count.
inline int num_problems(int64_t e, int64_t rows, int64_t split_rows) {
  return static_cast<int>(e + (split_rows > 0 ? rows / split_rows : 0));
}

inline ffi::Error check_split_rows(int64_t split_rows) {
  if (split_rows < 0 || split_rows % 256 != 0) {
    return ffi::Error::InvalidArgument(std::string(kWho) + ": split_rows=" +
                                       std::to_string(split_rows) +
                                       " is invalid; valid: 0 (no split) or a multiple of 256");
  }
  return ffi::Error::Success();
}

struct PrepareParams {
  const int32_t* group_sizes;
  int num_groups;
  int num_problems;    // slots of the problem arrays (num_problems(); = num_groups unless split)
  int64_t split_rows;  // 0 or a multiple of 256 (never for ragged_k)
  int64_t rows;     // M: rows of the ragged operand(s)
  bool dgrad;       // the dgrad problem (the adaptive pair's dgrad cost factor)
  bool ragged_k;    // wgrad: the group's rows are the GEMM's K (problem = (K?, N, m_e))
  int dim_a;        // fwd/dgrad: problem (m_e, dim_a, dim_b); wgrad: (m_e ? dim_a : 0, dim_b, m_e)
  int dim_b;
  const Element* a;
  const Element* b;
  Element* d;
  OperandMap map_a, map_b, map_d;
  // Zeroing: tail mode zeroes d rows [sum, rows) of width zero_row; expert mode zeroes the
  // zero_expert elements of d[e] for each group e with no rows.
  bool zero_empty_experts;
  int64_t zero_row;
  int64_t zero_expert;
  // Tail mode: more outputs of d's row layout whose rows [sum, rows) are zeroed too (the fused
  // gate/up + SwiGLU forward's up and activation), or nullptr.
  Element* zero_also[2];
  // Adaptive tile (alt_shapes != nullptr): every shape is also written to alt_shapes (the second
  // kernel's); block 0 counts both configurations' output tiles and empties (M = 0) the shapes
  // of the costlier one. Per configuration c: tile_m, tile_n, its cluster (a problem's tile
  // grid is rounded up to whole clusters), the tiles in flight over the whole GPU (slots: CTAs x
  // tiles a CTA works on at once), cost_pct.
  UnderlyingShape* alt_shapes;
  int tile_m[2], tile_n[2], cluster_m[2], cluster_n[2];
  int64_t slots[2];
  int cost_pct[2];
  int32_t* chose_second;  // where block 0 records its choice (1: second), or nullptr
};

template <class StrideA, class StrideB, class StrideD>
struct GroupArrays {
  UnderlyingShape* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  Element** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
};

template <class StrideA, class StrideB, class StrideD>
inline GroupArrays<StrideA, StrideB, StrideD> carve_group_arrays(uint8_t* ws, int e) {
  moe_gg_common::Carver c{ws};
  GroupArrays<StrideA, StrideB, StrideD> g;
  g.shapes = c.take<UnderlyingShape>(e);
  g.ptr_a = c.take<const Element*>(e);
  g.ptr_b = c.take<const Element*>(e);
  g.ptr_d = c.take<Element*>(e);
  g.stride_a = c.take<StrideA>(e);
  g.stride_b = c.take<StrideB>(e);
  g.stride_d = c.take<StrideD>(e);
  return g;
}
// Adaptive tiles: the second kernel's shapes, then one 256-byte slot whose first int32 is the
// choice (1: second), read by tests.
inline int64_t adaptive_bytes(int e) {
  return (static_cast<int64_t>(sizeof(UnderlyingShape)) * e + kAlign - 1) / kAlign * kAlign +
         kAlign;
}

// One problem slot of the group arrays (and of the adaptive pair's second shapes).
template <class StrideA, class StrideB, class StrideD>
__device__ __forceinline__ void write_problem(const PrepareParams& p,
                                              const GroupArrays<StrideA, StrideB, StrideD>& g,
                                              int64_t slot, UnderlyingShape shape,
                                              const Element* a, const Element* b, Element* d,
                                              StrideA sa, StrideB sb, StrideD sd) {
  g.shapes[slot] = shape;
  if (p.alt_shapes != nullptr) p.alt_shapes[slot] = shape;
  g.ptr_a[slot] = a;
  g.ptr_b[slot] = b;
  g.ptr_d[slot] = d;
  g.stride_a[slot] = sa;
  g.stride_b[slot] = sb;
  g.stride_d[slot] = sd;
}

template <class StrideA, class StrideB, class StrideD>
__global__ void __launch_bounds__(kPrepareThreads)
    moe_gg_prepare(PrepareParams p, GroupArrays<StrideA, StrideB, StrideD> g, StrideA sa,
                   StrideB sb, StrideD sd) {
  using BlockScan = cub::BlockScan<int64_t, kPrepareThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int64_t carry, slot_carry;
  __shared__ int use_second;
  int64_t tiles[2] = {0, 0};  // this thread's groups' output tiles (adaptive)
  extern __shared__ int32_t rows_smem[];  // clamped rows per group (expert-zeroing mode)
  if (threadIdx.x == 0) carry = slot_carry = 0;
  __syncthreads();
  const bool writer = blockIdx.x == 0;
  for (int base = 0; base < p.num_groups; base += kPrepareThreads) {
    const int e = base + threadIdx.x;
    int64_t size = e < p.num_groups ? max(p.group_sizes[e], 0) : 0;
    int64_t start, chunk_total;
    BlockScan(scan_storage).ExclusiveSum(size, start, chunk_total);
    start += carry;
    __syncthreads();  // everyone has read carry
    if (threadIdx.x == 0) carry += chunk_total;
    const int64_t lo = min(start, p.rows);
    const int64_t m = e < p.num_groups ? min(start + size, p.rows) - lo : 0;
    // this group's problems (pieces of at most split_rows rows; one, maybe empty, if no split)
    const int64_t pieces =
        e >= p.num_groups ? 0 : (p.split_rows > 0 ? max<int64_t>(1, (m + p.split_rows - 1) / p.split_rows) : 1);
    int64_t slot, pieces_total;
    BlockScan(scan_storage).ExclusiveSum(pieces, slot, pieces_total);
    slot += slot_carry;
    __syncthreads();  // everyone has read slot_carry
    if (threadIdx.x == 0) slot_carry += pieces_total;
    if (e < p.num_groups && p.zero_empty_experts) rows_smem[e] = static_cast<int>(m);
    for (int64_t j = 0; j < pieces; ++j, ++slot) {
      const int64_t r0 = lo + j * p.split_rows;  // split_rows = 0: j = 0 only
      const int mj = static_cast<int>(p.split_rows > 0 ? min(p.split_rows, m - j * p.split_rows) : m);
      const UnderlyingShape shape = p.ragged_k ? UnderlyingShape(mj > 0 ? p.dim_a : 0, p.dim_b, mj)
                                               : UnderlyingShape(mj, p.dim_a, p.dim_b);
      if (p.alt_shapes != nullptr) {
        const int64_t out_rows = get<0>(shape), out_cols = get<1>(shape);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int64_t tm = (out_rows + p.tile_m[c] - 1) / p.tile_m[c];
          const int64_t tn = (out_cols + p.tile_n[c] - 1) / p.tile_n[c];
          tiles[c] += (tm + p.cluster_m[c] - 1) / p.cluster_m[c] * p.cluster_m[c] *
                      ((tn + p.cluster_n[c] - 1) / p.cluster_n[c] * p.cluster_n[c]);
        }
      }
      if (writer) {
        write_problem(p, g, slot, shape, p.a + e * p.map_a.per_expert + r0 * p.map_a.per_row,
                      p.b + e * p.map_b.per_expert + r0 * p.map_b.per_row,
                      p.d + e * p.map_d.per_expert + r0 * p.map_d.per_row, sa, sb, sd);
      }
    }
    __syncthreads();  // carry updated; scan storage reusable
  }
  if (writer) {  // problem slots past the last piece: no tiles
    for (int64_t q = slot_carry + threadIdx.x; q < p.num_problems; q += kPrepareThreads) {
      const UnderlyingShape shape = p.ragged_k ? UnderlyingShape(0, p.dim_b, 0)
                                               : UnderlyingShape(0, p.dim_a, p.dim_b);
      write_problem(p, g, q, shape, p.a, p.b, p.d, sa, sb, sd);
    }
  }
  if (writer && p.alt_shapes != nullptr) {
    int64_t total[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      int64_t excl;
      BlockScan(scan_storage).ExclusiveSum(tiles[c], excl, total[c]);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      // cost: waves x work of one wave slot (tile area x tiles in flight per CTA, which is
      // slots / SMs) x cost_pct; the shipped pair has equal work per slot
      double cost[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t waves = (total[c] + p.slots[c] - 1) / p.slots[c];
        cost[c] = static_cast<double>(waves) * p.tile_m[c] * p.tile_n[c] *
                  static_cast<double>(p.slots[c]) * p.cost_pct[c];
      }
      use_second = cost[1] < cost[0] ? 1 : 0;
      if (p.chose_second != nullptr) *p.chose_second = use_second;
    }
    __syncthreads();
    UnderlyingShape* empty = use_second ? g.shapes : p.alt_shapes;
    for (int e = threadIdx.x; e < p.num_problems; e += kPrepareThreads) {
      const UnderlyingShape s = empty[e];
      empty[e] = UnderlyingShape(0, get<1>(s), get<2>(s));
    }
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (p.zero_empty_experts) {
    for (int e = 0; e < p.num_groups; ++e) {
      if (rows_smem[e] == 0) zero_range(p.d + e * p.zero_expert, p.zero_expert, tid, nthreads);
    }
  } else {
    const int64_t total = min(carry, p.rows);
    zero_range(p.d + total * p.zero_row, (p.rows - total) * p.zero_row, tid, nthreads);
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      if (p.zero_also[o] != nullptr) {
        zero_range(p.zero_also[o] + total * p.zero_row, (p.rows - total) * p.zero_row, tid,
                   nthreads);
      }
    }
  }
}

// Prepare parameters of a problem with ragged rows (fwd, dgrad, the fused forward): a [rows, k]
// (the group's rows), b [e] of k x n elements, output rows of ld_d elements starting at d (rows
// past the sum zeroed). dgrad passes k = N (its contraction) and n = K (its output width).
inline PrepareParams ragged_rows_prepare(const int32_t* group_sizes, int64_t e, int64_t rows,
                                         int64_t k, int64_t n, const Element* a, const Element* b,
                                         Element* d, int64_t ld_d) {
  PrepareParams p{};
  p.group_sizes = group_sizes;
  p.num_groups = static_cast<int>(e);
  p.rows = rows;
  p.ragged_k = false;
  p.dim_a = static_cast<int>(n);
  p.dim_b = static_cast<int>(k);
  p.a = a;
  p.b = b;
  p.d = d;
  p.map_a = {0, k};
  p.map_b = {k * n, 0};
  p.map_d = {0, ld_d};
  p.zero_empty_experts = false;
  p.zero_row = ld_d;
  p.zero_expert = 0;
  return p;
}

// A packed stride with leading dimension `ld` (the one dynamic, non-batch mode of S).
template <class S>
S make_ld_stride(int64_t ld) {
  S s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

inline ffi::Error cuda_error(cudaError_t err, const char* what) {
  return moe_gg_common::cuda_error(kWho, err, what);
}

template <class Def>
cutlass::KernelHardwareInfo hardware_info(int device) {
  static std::mutex mu;
  static int cached_device = -1;
  static cutlass::KernelHardwareInfo info;
  std::lock_guard<std::mutex> lock(mu);
  if (cached_device != device) {
    info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Def::Kernel>(device);
    cached_device = device;
  }
  return info;
}

// Runs prepare + CUTLASS for one tile configuration. `sa`, `sb`, `sd` are the (constant)
// strides of A, B, D; group arrays go at the start of `workspace`.
// Scheduling knobs that need no extra instantiation (FFI attributes `raster`, `swizzle`,
// `split_rows`).
struct Schedule {
  int64_t raster;      // 0: along M (consecutive tiles share a B column), 1: along N
  int64_t swizzle;     // max swizzle size: 1, 2, 4 or 8
  int64_t split_rows;  // row split of ragged-row problems (0: none; ignored by wgrad)
};

inline ffi::Error check_schedule(Schedule s) {
  if ((s.raster != 0 && s.raster != 1) ||
      (s.swizzle != 1 && s.swizzle != 2 && s.swizzle != 4 && s.swizzle != 8)) {
    return ffi::Error::InvalidArgument(
        std::string(kWho) + ": raster=" + std::to_string(s.raster) + ", swizzle=" +
        std::to_string(s.swizzle) + " are invalid; valid: raster 0 or 1, swizzle 1, 2, 4, 8");
  }
  return check_split_rows(s.split_rows);
}

}  // namespace moe_gg

// kernels/call_stats.cu: counts calls, and calls made during CUDA-graph capture (for tests).
extern "C" void moe_praxis_note_stream(cudaStream_t stream);

namespace moe_gg {

// Launches one CUTLASS kernel over the group arrays `g` with the problem shapes `shapes`;
// `ws` / `ws_bytes`: room for CUTLASS's own workspace; *used: the bytes it took.
template <class Def, class Arrays>
ffi::Error launch_cutlass(cudaStream_t stream, int e, UnderlyingShape* shapes, const Arrays& g,
                          uint8_t* ws, int64_t ws_bytes, Schedule sched, int device,
                          int64_t* used, const EpilogueExtra& extra) {
  using Gemm = typename Def::Gemm;
  cutlass::KernelHardwareInfo hw = hardware_info<Def>(device);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {e, shapes, nullptr},
                                {g.ptr_a, g.stride_a, g.ptr_b, g.stride_b},
                                Def::epilogue_args(g, extra),
                                hw};
  using RasterOptions = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = sched.raster ? RasterOptions::AlongN : RasterOptions::AlongM;
  args.scheduler.max_swizzle_size = static_cast<int>(sched.swizzle);
  Gemm gemm;
  const int64_t need = static_cast<int64_t>(Gemm::get_workspace_size(args));
  *used = (need + kAlign - 1) / kAlign * kAlign;
  if (need > ws_bytes) {
    return ffi::Error::InvalidArgument(
        std::string(kWho) + ": CUTLASS needs " + std::to_string(need) + " workspace bytes, " +
        std::to_string(ws_bytes) +
        " are left (raise _CUTLASS_WORKSPACE_BYTES in moe_praxis/ops/grouped_gemm.py)");
  }
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return ffi::Error::InvalidArgument(std::string(kWho) +
                                       ": CUTLASS cannot implement this problem: " +
                                       cutlassGetStatusString(st));
  }
  st = gemm.initialize(args, ws, stream);
  if (st != cutlass::Status::kSuccess) return moe_gg_common::cutlass_error(kWho, "initialize", st);
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) return moe_gg_common::cutlass_error(kWho, "run", st);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error(err, "CUTLASS kernel launch");
  return ffi::Error::Success();
}

template <class Config>
void set_adaptive_slot(PrepareParams& p, int c, int sm_count) {
  p.tile_m[c] = static_cast<int>(cute::size<0>(typename Config::Tile{}));
  p.tile_n[c] = static_cast<int>(cute::size<1>(typename Config::Tile{}));
  p.cluster_m[c] = static_cast<int>(cute::size<0>(typename Config::Cluster{}));
  p.cluster_n[c] = static_cast<int>(cute::size<1>(typename Config::Cluster{}));
  p.slots[c] = static_cast<int64_t>(sm_count) * Config::kTilesInFlight;
}

// Runs prepare + CUTLASS for one tile configuration (or, for an adaptive Def, prepare + both
// kernels of its pair, one of which finds no tiles). `sa`, `sb`, `sd` are the (constant)
// strides of A, B, D; group arrays go at the start of `workspace`, then (adaptive) the second
// kernel's shapes and the int32 choice, then CUTLASS's workspace(s).
template <class Def>
ffi::Error run_grouped(cudaStream_t stream, PrepareParams p, typename Def::StrideA sa,
                       typename Def::StrideB sb, typename Def::StrideD sd, uint8_t* workspace,
                       int64_t workspace_bytes, Schedule sched, const EpilogueExtra& extra = {}) {
  moe_praxis_note_stream(stream);
  p.split_rows = p.ragged_k ? 0 : sched.split_rows;  // wgrad's rows are its contraction
  const int e = num_problems(p.num_groups, p.rows, p.split_rows);  // CUTLASS's groups
  p.num_problems = e;
  auto g = carve_group_arrays<typename Def::StrideA, typename Def::StrideB, typename Def::StrideD>(
      workspace, e);
  int64_t head = group_array_bytes(e);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_error(err, "cudaGetDevice");
  cutlass::KernelHardwareInfo hw = hardware_info<Def>(device);
  p.alt_shapes = nullptr;
  p.chose_second = nullptr;
  if constexpr (Def::kAdaptive) {
    p.alt_shapes = reinterpret_cast<UnderlyingShape*>(workspace + head);
    p.chose_second = reinterpret_cast<int32_t*>(workspace + head + adaptive_bytes(e) - kAlign);
    head += adaptive_bytes(e);
    set_adaptive_slot<typename Def::First::TileConfig>(p, 0, hw.sm_count);
    set_adaptive_slot<typename Def::Second::TileConfig>(p, 1, hw.sm_count);
    p.cost_pct[0] = 100;
    p.cost_pct[1] = p.dgrad ? Def::kDgradCostPct : Def::kFwdCostPct;
  }
  if (head > workspace_bytes) {
    return moe_gg_common::workspace_too_small(kWho, workspace_bytes, head,
                                              "workspace_bytes in "
                                              "moe_praxis/ops/grouped_gemm_tiles.py");
  }

  // Prepare: block 0 writes the group arrays, all blocks zero what CUTLASS will not write.
  const int64_t zero_elems = p.zero_empty_experts ? p.zero_expert * e : p.rows * p.zero_row;
  int blocks = static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(zero_elems / (8 * kPrepareThreads * 4), 1),
                        2 * static_cast<int64_t>(hw.sm_count)));
  size_t smem = p.zero_empty_experts ? sizeof(int32_t) * e : 0;
  moe_gg_prepare<<<blocks, kPrepareThreads, smem, stream>>>(p, g, sa, sb, sd);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error(err, "prepare kernel launch");

  int64_t used = 0;
  if constexpr (Def::kAdaptive) {
    ffi::Error first = launch_cutlass<typename Def::First>(
        stream, e, g.shapes, g, workspace + head, workspace_bytes - head, sched, device, &used,
        extra);
    if (first.failure()) return first;
    head += used;
    return launch_cutlass<typename Def::Second>(stream, e, p.alt_shapes, g, workspace + head,
                                                workspace_bytes - head, sched, device, &used,
                                                extra);
  } else {
    return launch_cutlass<Def>(stream, e, g.shapes, g, workspace + head, workspace_bytes - head,
                               sched, device, &used, extra);
  }
}

// Dispatches on the tile attribute. F<Config>() returns the ffi::Error of one configuration.
template <class F>
ffi::Error dispatch_tile(int64_t tile, Schedule sched, F&& f) {
  ffi::Error bad = check_schedule(sched);
  if (bad.failure()) return bad;
  switch (tile) {
    case 0:
      return f(CoopLarge{});
    case 1:
      return f(PingpongSmall{});
    case 2:
      return f(CoopWide{});
    case 3:
      return f(PingpongThin{});
    case 4:
      return f(AdaptiveWideThin{});
    case 5:
      return f(CoopWideC<1, 2>{});
    case 6:
      return f(PingpongThinC<1, 2>{});
    case 7:
      return f(AdaptiveWideThin12{});
    case 8:
      return f(CoopWideC<1, 1>{});
    case 9:
      return f(PingpongThinC<1, 1>{});
    case 10:
      return f(AdaptiveWideThin11{});
    case 11:
      return f(PingpongMidC<1, 1>{});
    case 12:
      return f(PingpongMidC<2, 1>{});
    default:
      return moe_gg_common::invalid_tile(kWho, tile, kNumTiles);
  }
}

inline const Element* as_elem(const void* p) { return reinterpret_cast<const Element*>(p); }
inline Element* as_elem(void* p) { return reinterpret_cast<Element*>(p); }

}  // namespace moe_gg
