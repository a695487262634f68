// Grouped GEMM for compute capability 8.0 and newer: CUTLASS 2.x `GemmGrouped` (tensor-core
// mma.sync, cp.async multistage mainloop), bf16 or fp16 in, fp32 accumulate, out in the input
// type. Shared by grouped_gemm_sm80_{fwd,dgrad,wgrad}.cu; the same contract as the Hopper kernels
// of grouped_gemm.cuh (ragged_dot semantics, group sizes read on the device).
//
// Each FFI call launches, on XLA's stream:
//   1. moe_gg80_prepare: scans group_sizes (clamped to [0, rows left]) and writes each group's
//      problem size, operand pointers and leading dimensions into the workspace; its other
//      blocks zero what CUTLASS will not write (rows past sum(group_sizes) for fwd/dgrad; the
//      [K, N] slice of each expert with no rows for wgrad, whose problem gets M = 0 so that it
//      has no tiles).
//   2. the CUTLASS GemmGrouped kernel in GroupScheduleMode::kDeviceOnly: its problem visitor
//      reads the problem sizes from device memory; problem count = E and the persistent grid
//      (threadblock count) comes from an upper bound of the tiles over all group sizes and the
//      kernel's occupancy, never from device data.
// No device-to-host copy and no synchronisation: the call is CUDA-graph safe.
//
// Workspace (an output buffer of the FFI call, sized by moe_praxis/ops/grouped_gemm_sm80.py):
//   kGroupArrayBytesPerGroup * E bytes of group arrays, rounded up to 256. GemmGrouped in
//   kDeviceOnly mode needs no workspace of its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include <cub/block/block_scan.cuh>

#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_grouped.h"
#include "cutlass/gemm/kernel/default_gemm_grouped.h"
#include "cutlass/half.h"
#include "grouped_gemm_common.h"
#include "xla/ffi/api/ffi.h"

// kernels/call_stats.cu: counts calls, and calls made during CUDA-graph capture (for tests).
extern "C" void moe_praxis_note_stream(cudaStream_t stream);

namespace moe_gg80 {

namespace ffi = xla::ffi;
using cutlass::gemm::GemmCoord;

using moe_gg_common::cdiv;
using moe_gg_common::group_array_bytes;
using moe_gg_common::kAlign;
using moe_gg_common::kGroupArrayBytesPerGroup;
using moe_gg_common::kPrepareThreads;
using moe_gg_common::OperandMap;
using moe_gg_common::zero_range;

// How these kernels name themselves in their errors (grouped_gemm_common.h).
constexpr const char* kWho = "moe_praxis grouped GEMM (sm_80)";
constexpr int kAlignment = 8;  // elements per 16-byte access of a 16-bit type

// Tile configurations (index = the FFI attribute `tile`; SM80_TILE_CONFIGS in
// moe_praxis/ops/grouped_gemm_sm80.py names them and holds the rule that picks one).
template <int TM, int TN, int TK, int WM, int WN, int WK, int S>
struct Tile {
  using Threadblock = cutlass::gemm::GemmShape<TM, TN, TK>;
  using Warp = cutlass::gemm::GemmShape<WM, WN, WK>;
  static constexpr int kStages = S;
  static constexpr int kM = TM;
  static constexpr int kN = TN;
};
// Shared memory of a tile: stages x (TM x TK + TK x TN) x 2 bytes (the epilogue reuses it);
// every tile below fits an A100's 163 KiB per block, all but the K = 64 8-warp ones the 99 KiB
// of sm_86 / sm_89. Eight-warp tiles are resident one per SM (their registers), the
// four-warp ones two per SM where their shared memory allows it.
using Tile128x256 = Tile<128, 256, 64, 64, 64, 64, 3>;     // 0: 8 warps, large outputs
using Tile128x128 = Tile<128, 128, 32, 64, 64, 32, 4>;     // 1: 4 warps, the general tile
using Tile64x128 = Tile<64, 128, 32, 32, 64, 32, 4>;       // 2: 4 warps, small groups
using Tile128x64 = Tile<128, 64, 32, 64, 32, 32, 4>;       // 3: 4 warps, narrow outputs
using Tile256x128 = Tile<256, 128, 64, 64, 64, 64, 3>;     // 4: 0 transposed (tall outputs)
using Tile256x128K32 = Tile<256, 128, 32, 64, 64, 32, 4>;  // 5: 8 warps, 96 KiB
using Tile128x256K32 = Tile<128, 256, 32, 64, 64, 32, 4>;  // 6: 8 warps, 96 KiB
using Tile128x128K64 = Tile<128, 128, 64, 64, 64, 64, 3>;  // 7: 4 warps, fewer barriers per FLOP
using Tile128x128S5 = Tile<128, 128, 32, 64, 64, 32, 5>;   // 8: 4 warps, a deeper pipeline
using Tile64x256 = Tile<64, 256, 32, 64, 64, 32, 4>;       // 9: 4 warps, small groups, wide
constexpr int kNumTiles = 10;

// The CUTLASS kernel of one (element type, operand layouts, tile). D = alpha * accumulator in
// the element type, row-major; OnlyAlphaScaling never reads a C operand.
template <class Element, class LayoutA, class LayoutB, class T>
struct GemmDef {
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
      Element, kAlignment, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlignment, Element, LayoutB,
      cutlass::ComplexTransform::kNone, kAlignment, Element, cutlass::layout::RowMajor, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, typename T::Threadblock,
      typename T::Warp, cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, T::kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<Kernel>;
};

// Group arrays in the workspace. Elements are 16-bit (bf16 or fp16): the prepare kernel works
// on uint16_t pointers, the CUTLASS kernel reads them as its element type.
struct GroupArrays {
  GemmCoord* shapes;
  uint16_t** ptr_a;
  uint16_t** ptr_b;
  uint16_t** ptr_d;
  int64_t* lda;
  int64_t* ldb;
  int64_t* ldd;
};

inline GroupArrays carve_group_arrays(uint8_t* ws, int e) {
  moe_gg_common::Carver c{ws};
  GroupArrays g;
  g.shapes = c.take<GemmCoord>(e);
  g.ptr_a = c.take<uint16_t*>(e);
  g.ptr_b = c.take<uint16_t*>(e);
  g.ptr_d = c.take<uint16_t*>(e);
  g.lda = c.take<int64_t>(e);
  g.ldb = c.take<int64_t>(e);
  g.ldd = c.take<int64_t>(e);
  return g;
}

struct PrepareParams {
  const int32_t* group_sizes;
  int num_groups;
  int64_t rows;   // M: rows of the ragged operand(s)
  bool ragged_k;  // wgrad: the group's rows are the GEMM's K (problem = (m_e ? dim_a : 0, dim_b, m_e))
  int dim_a;      // fwd/dgrad: problem (m_e, dim_a, dim_b)
  int dim_b;
  const uint16_t* a;
  const uint16_t* b;
  uint16_t* d;
  OperandMap map_a, map_b, map_d;
  int64_t lda, ldb, ldd;
  // Zeroing: tail mode zeroes d rows [sum, rows) of width zero_row; expert mode zeroes the
  // zero_expert elements of d[e] for each group e with no rows.
  bool zero_empty_experts;
  int64_t zero_row;
  int64_t zero_expert;
};

// static: this header is included by three translation units, each gets its own copy
static __global__ void __launch_bounds__(kPrepareThreads)
    moe_gg80_prepare(PrepareParams p, GroupArrays g) {
  using BlockScan = cub::BlockScan<int64_t, kPrepareThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int64_t carry;
  extern __shared__ int32_t rows_smem[];  // clamped rows per group (expert-zeroing mode)
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const bool writer = blockIdx.x == 0;
  for (int base = 0; base < p.num_groups; base += kPrepareThreads) {
    const int e = base + threadIdx.x;
    const int64_t size = e < p.num_groups ? max(p.group_sizes[e], 0) : 0;
    int64_t start, chunk_total;
    BlockScan(scan_storage).ExclusiveSum(size, start, chunk_total);
    start += carry;
    __syncthreads();  // everyone has read carry
    if (threadIdx.x == 0) carry += chunk_total;
    if (e < p.num_groups) {
      const int64_t lo = min(start, p.rows);
      const int m = static_cast<int>(min(start + size, p.rows) - lo);
      if (p.zero_empty_experts) rows_smem[e] = m;
      if (writer) {
        g.shapes[e] = p.ragged_k ? GemmCoord(m > 0 ? p.dim_a : 0, p.dim_b, m)
                                 : GemmCoord(m, p.dim_a, p.dim_b);
        g.ptr_a[e] = const_cast<uint16_t*>(p.a + e * p.map_a.per_expert + lo * p.map_a.per_row);
        g.ptr_b[e] = const_cast<uint16_t*>(p.b + e * p.map_b.per_expert + lo * p.map_b.per_row);
        g.ptr_d[e] = p.d + e * p.map_d.per_expert + lo * p.map_d.per_row;
        g.lda[e] = p.lda;
        g.ldb[e] = p.ldb;
        g.ldd[e] = p.ldd;
      }
    }
    __syncthreads();  // carry updated; scan storage reusable
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
  }
}

// Prepare parameters of a problem with ragged rows (fwd, dgrad): a [rows, k] (the group's
// rows, leading dimension lda), b [e] of k x n elements (leading dimension ldb), output rows of
// n elements starting at d (rows past the sum zeroed). dgrad passes k = N (its contraction)
// and n = K (its output width).
inline PrepareParams ragged_rows_prepare(const int32_t* group_sizes, int64_t e, int64_t rows,
                                         int64_t k, int64_t n, const void* a, const void* b,
                                         void* d, int64_t ldb) {
  PrepareParams p{};
  p.group_sizes = group_sizes;
  p.num_groups = static_cast<int>(e);
  p.rows = rows;
  p.ragged_k = false;
  p.dim_a = static_cast<int>(n);
  p.dim_b = static_cast<int>(k);
  p.a = static_cast<const uint16_t*>(a);
  p.b = static_cast<const uint16_t*>(b);
  p.d = static_cast<uint16_t*>(d);
  p.map_a = {0, k};
  p.map_b = {k * n, 0};
  p.map_d = {0, n};
  p.lda = k;
  p.ldb = ldb;
  p.ldd = n;
  p.zero_empty_experts = false;
  p.zero_row = n;
  p.zero_expert = 0;
  return p;
}

inline ffi::Error cuda_error(cudaError_t err, const char* what) {
  return moe_gg_common::cuda_error(kWho, err, what);
}

// An upper bound of the output tiles of all problems, from static shapes only. Ragged rows:
// sum_e ceil(m_e / TM) <= rows / TM + E row tiles, each with ceil(width / TN) column tiles.
// wgrad: at most min(E, rows) experts have rows, each with a whole [K, N] tile grid.
inline int64_t tile_bound(const PrepareParams& p, int tm, int tn) {
  if (p.ragged_k) {
    return std::min<int64_t>(p.num_groups, p.rows) * cdiv(p.dim_a, tm) * cdiv(p.dim_b, tn);
  }
  return (p.rows / tm + p.num_groups) * cdiv(p.dim_a, tn);
}

// Threadblocks the persistent kernel can keep resident on `device` (SMs x occupancy: what
// GemmGrouped::sufficient() returns without host problem sizes, which a launch that reads them
// on the device does not have), cached per kernel and device: the occupancy query (and the
// shared-memory attribute it sets) runs once, not in a captured launch. Returns 1 (*out set),
// 0 (the kernel cannot be resident), -1 (the SM count query failed), -2 (the occupancy query
// failed).
template <class Def>
int resident_blocks(int device, int* out) {
  static std::mutex mu;
  static int cached_device = -1;
  static int cached = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cached_device != device) {
    int sms = 0;
    cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return -1;
    const int per_sm = Def::Gemm::maximum_active_blocks();
    if (per_sm < 0) return -2;  // the occupancy query failed (CUTLASS cleared the CUDA error)
    if (per_sm == 0) return 0;
    cached = sms * per_sm;
    cached_device = device;
  }
  *out = cached;
  return 1;
}

// Runs prepare + the CUTLASS kernel of one configuration.
template <class Def, class Element>
ffi::Error run_grouped(cudaStream_t stream, const PrepareParams& p, uint8_t* workspace,
                       int64_t workspace_bytes) {
  using Gemm = typename Def::Gemm;
  using T = typename Def::Kernel::Mma::Shape;
  moe_praxis_note_stream(stream);
  const int e = p.num_groups;
  if (group_array_bytes(e) > workspace_bytes) {
    return moe_gg_common::workspace_too_small(kWho, workspace_bytes, group_array_bytes(e),
                                              "sm80_workspace_bytes in "
                                              "moe_praxis/ops/grouped_gemm_sm80.py");
  }
  GroupArrays g = carve_group_arrays(workspace, e);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_error(err, "cudaGetDevice");
  int resident = 0;
  const int ok = resident_blocks<Def>(device, &resident);
  if (ok == -1) return cuda_error(cudaGetLastError(), "cudaDeviceGetAttribute");
  if (ok == -2) {
    return ffi::Error::Internal(std::string(kWho) +
                                ": the occupancy query of the CUTLASS kernel failed "
                                "(cudaFuncSetAttribute / cudaOccupancyMaxActiveBlocksPerMultiprocessor)");
  }
  if (ok == 0) {
    return ffi::Error::Internal(
        std::string(kWho) + ": the CUTLASS kernel cannot be resident on this GPU (shared memory " +
        std::to_string(sizeof(typename Def::Kernel::SharedStorage)) +
        " bytes per block); choose a smaller tile");
  }

  // Prepare: block 0 writes the group arrays, all blocks zero what CUTLASS will not write.
  const int64_t zero_elems = p.zero_empty_experts ? p.zero_expert * e : p.rows * p.zero_row;
  const int blocks = static_cast<int>(std::min<int64_t>(
      std::max<int64_t>(zero_elems / (8 * kPrepareThreads * 4), 1), 2 * resident));
  const size_t smem = p.zero_empty_experts ? sizeof(int32_t) * e : 0;
  moe_gg80_prepare<<<blocks, kPrepareThreads, smem, stream>>>(p, g);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error(err, "prepare kernel launch");

  const int64_t bound = tile_bound(p, T::kM, T::kN);
  if (bound == 0) return ffi::Error::Success();  // no tiles whatever the group sizes
  const int threadblocks = static_cast<int>(std::min<int64_t>(bound, resident));
  typename Def::EpilogueOp::Params epilogue(1.0f, 0.0f);
  typename Gemm::Arguments args(g.shapes, e, threadblocks, epilogue,
                                reinterpret_cast<Element**>(g.ptr_a),
                                reinterpret_cast<Element**>(g.ptr_b),
                                reinterpret_cast<Element**>(g.ptr_d),
                                reinterpret_cast<Element**>(g.ptr_d), g.lda, g.ldb, g.ldd, g.ldd);
  Gemm gemm;
  cutlass::Status st = gemm.initialize(args, nullptr, stream);
  if (st != cutlass::Status::kSuccess) {
    return moe_gg_common::cutlass_error(kWho, "initialize", st);
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    return moe_gg_common::cutlass_error(kWho, "run", st, /*with_cuda_error=*/true);
  }
  return ffi::Error::Success();
}

// Dispatches on the tile attribute: the element type and operand layouts are the caller's.
template <class Element, class LayoutA, class LayoutB>
ffi::Error dispatch_tile(int64_t tile, cudaStream_t stream, const PrepareParams& p,
                         uint8_t* workspace, int64_t workspace_bytes) {
  switch (tile) {
    case 0:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x256>, Element>(
          stream, p, workspace, workspace_bytes);
    case 1:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x128>, Element>(
          stream, p, workspace, workspace_bytes);
    case 2:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile64x128>, Element>(
          stream, p, workspace, workspace_bytes);
    case 3:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x64>, Element>(
          stream, p, workspace, workspace_bytes);
    case 4:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile256x128>, Element>(
          stream, p, workspace, workspace_bytes);
    case 5:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile256x128K32>, Element>(
          stream, p, workspace, workspace_bytes);
    case 6:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x256K32>, Element>(
          stream, p, workspace, workspace_bytes);
    case 7:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x128K64>, Element>(
          stream, p, workspace, workspace_bytes);
    case 8:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile128x128S5>, Element>(
          stream, p, workspace, workspace_bytes);
    case 9:
      return run_grouped<GemmDef<Element, LayoutA, LayoutB, Tile64x256>, Element>(
          stream, p, workspace, workspace_bytes);
    default:
      return moe_gg_common::invalid_tile(kWho, tile, kNumTiles);
  }
}

// Dispatches on the element type (bf16 or fp16; every operand the same type).
template <class LayoutA, class LayoutB>
ffi::Error dispatch(const char* op, ffi::DataType a, ffi::DataType b, ffi::DataType d,
                    int64_t tile, cudaStream_t stream, const PrepareParams& p, uint8_t* workspace,
                    int64_t workspace_bytes) {
  if (a != b || a != d || (a != ffi::DataType::BF16 && a != ffi::DataType::F16)) {
    return moe_gg_common::invalid(kWho, op, "operands and output must all be bf16 or all fp16");
  }
  ffi::Error aligned = moe_gg_common::check_multiples_of_8(kWho, op, p.dim_a, p.dim_b);
  if (aligned.failure()) return aligned;
  if (a == ffi::DataType::BF16) {
    return dispatch_tile<cutlass::bfloat16_t, LayoutA, LayoutB>(tile, stream, p, workspace,
                                                                workspace_bytes);
  }
  return dispatch_tile<cutlass::half_t, LayoutA, LayoutB>(tile, stream, p, workspace,
                                                          workspace_bytes);
}

}  // namespace moe_gg80

// The handler signature of the three sm_80 GEMMs: (a, b, group_sizes) -> (out, workspace),
// attribute `tile`; a and b bf16 or fp16.
#define MOE_GG80_BIND                                                                 \
  xla::ffi::Ffi::Bind()                                                               \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                  \
      .Arg<xla::ffi::AnyBuffer>()                                                     \
      .Arg<xla::ffi::AnyBuffer>()                                                     \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                                         \
      .Ret<xla::ffi::AnyBuffer>()                                                     \
      .Ret<xla::ffi::Buffer<xla::ffi::U8>>()                                          \
      .Attr<int64_t>("tile")
