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

#include "grouped_gemm_prepare.cuh"
#include "grouped_gemm_common.h"

#include <mutex>
#include <string>
#include <type_traits>

namespace moe_gg {


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

// The mainloop arguments of a kernel definition: CUTLASS's A and B pointer arrays.
template <class Def, class Arrays, class Extra>
typename Def::Kernel::MainloopArguments mainloop_args(const Arrays& g, const Extra&) {
  return {g.ptr_a, g.stride_a, g.ptr_b, g.stride_b};
}

// Launches one CUTLASS kernel over the group arrays `g` with the problem shapes `shapes`;
// `ws` / `ws_bytes`: room for CUTLASS's own workspace; *used: the bytes it took.
template <class Def, class Arrays, class Extra>
ffi::Error launch_cutlass(cudaStream_t stream, int e, UnderlyingShape* shapes, const Arrays& g,
                          uint8_t* ws, int64_t ws_bytes, Schedule sched, int device,
                          int64_t* used, const Extra& extra) {
  using Gemm = typename Def::Gemm;
  cutlass::KernelHardwareInfo hw = hardware_info<Def>(device);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {e, shapes, nullptr},
                                mainloop_args<Def>(g, extra),
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
// `extra`: what a fused epilogue reads beyond the group arrays (EpilogueExtra, or the fused
// kernel's own struct: Def::epilogue_args takes it).
template <class Def, class Extra = EpilogueExtra>
ffi::Error run_grouped(cudaStream_t stream, PrepareParams p, typename Def::StrideA sa,
                       typename Def::StrideB sb, typename Def::StrideD sd, uint8_t* workspace,
                       int64_t workspace_bytes, Schedule sched, const Extra& extra = {}) {
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
