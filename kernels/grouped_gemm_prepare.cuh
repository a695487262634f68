// The Hopper grouped GEMM's prepare step (step 1 of kernels/grouped_gemm.cuh's header comment):
// the row split, the per-problem arrays in the workspace and the prepare kernel that fills them
// from the group sizes on the device.
#pragma once

#include "grouped_gemm_tiles.cuh"
#include "grouped_gemm_common.h"

#include <cub/block/block_scan.cuh>
#include <string>

namespace moe_gg {

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

// Prepare parameters of the wgrad problem (ragged contraction): a [rows, k] (the group's rows),
// b [rows, n] (the output gradient's), d [e] of k x n elements (zeroed for groups with no rows).
inline PrepareParams ragged_k_prepare(const int32_t* group_sizes, int64_t e, int64_t rows,
                                      int64_t k, int64_t n, const Element* a, const Element* b,
                                      Element* d) {
  PrepareParams p{};
  p.group_sizes = group_sizes;
  p.num_groups = static_cast<int>(e);
  p.rows = rows;
  p.ragged_k = true;
  p.dim_a = static_cast<int>(k);  // GEMM M (0 for empty groups)
  p.dim_b = static_cast<int>(n);  // GEMM N
  p.a = a;
  p.b = b;
  p.d = d;
  p.map_a = {0, k};
  p.map_b = {0, n};
  p.map_d = {k * n, 0};
  p.zero_empty_experts = true;
  p.zero_row = 0;
  p.zero_expert = k * n;
  return p;
}

}  // namespace moe_gg
