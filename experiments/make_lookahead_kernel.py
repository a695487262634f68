"""Writes kernels/gemm_array_lookahead.cuh from CUTLASS's cooperative pointer-array kernel.

`python -m experiments.make_lookahead_kernel [--check]`: reads CUTLASS's
include/cutlass/gemm/kernel/sm90_gemm_array_tma_warpspecialized_cooperative.hpp (from the
nvidia-cutlass package, as the kernel build does), renames the class, doubles the mainloop's
descriptor workspace and replaces the mainloop producer warp's loop with LOOP below (HEADER says
what changes and why; docs/grouped_gemm.md, "The lookahead producer"). `--check` fails when the
file in kernels/ differs from what this would write (tests/test_grouped_gemm.py runs it), so the
header is never edited by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_praxis.build_kernels import cutlass_include_dirs

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "kernels" / "gemm_array_lookahead.cuh"
SOURCE = "cutlass/gemm/kernel/sm90_gemm_array_tma_warpspecialized_cooperative.hpp"

CLASS_OLD = """template <
  class ProblemShape_,
  class CollectiveMainloop_,
  class CollectiveEpilogue_,
  class TileScheduler_
>
class GemmUniversal<
  ProblemShape_,
  CollectiveMainloop_,
  CollectiveEpilogue_,
  TileScheduler_,
  cute::enable_if_t<cute::is_base_of_v<KernelPtrArrayTmaWarpSpecializedCooperative, typename CollectiveMainloop_::DispatchPolicy::Schedule>>
>
{"""

CLASS_NEW = """template <
  class ProblemShape_,
  class CollectiveMainloop_,
  class CollectiveEpilogue_,
  class TileScheduler_ = void
>
class GemmArrayLookaheadCooperative
{
  static_assert(cute::is_base_of_v<KernelPtrArrayTmaWarpSpecializedCooperative,
                                   typename CollectiveMainloop_::DispatchPolicy::Schedule>,
                "the lookahead kernel takes CUTLASS's cooperative ptr-array mainloop");
  // moe_praxis: the producer keeps two pairs of A / B descriptors per SM (see the file comment)
  static constexpr size_t kMainloopDescriptorPairs = 2;
"""

WORKSPACE_OLD = "CollectiveMainloop::get_workspace_size("
WORKSPACE_NEW = "kMainloopDescriptorPairs * CollectiveMainloop::get_workspace_size("

LOOP_START = """        // Fetch a copy of tensormaps for the CTA
        auto input_tensormaps"""
LOOP_END = """        // Make sure all Consumer Warp Groups have been waited upon
        collective_mainloop.load_tail"""

HEADER = """// moe_praxis: kernels/gemm_array_lookahead.cuh is generated from CUTLASS 4.2.0's
// include/cutlass/gemm/kernel/sm90_gemm_array_tma_warpspecialized_cooperative.hpp (license
// above) by experiments/make_lookahead_kernel.py; do not edit by hand. The changes:
//   - the class is GemmArrayLookaheadCooperative, not a GemmUniversal specialization (the
//     collectives, the tile scheduler and the consumer / epilogue warps are CUTLASS's);
//   - the mainloop producer warp keeps two pairs of A / B TMA descriptors per SM (twice the
//     mainloop's descriptor workspace). CUTLASS's producer, when the next tile is in another
//     group, rewrites its one pair only after issuing all of the current tile's loads, on the
//     path to the next tile's first load (measured on an H200: doing that rewrite twice cost
//     2.5-5% at E = 128; docs/grouped_gemm.md, run 14). Here it issues the tile's first Stages
//     k-blocks, fetches the next tile, writes that tile's group's descriptors into the other
//     pair (while the rest of this tile's loads wait for free stages), then issues the rest,
//     and switches pairs at the tile boundary.

"""

LOOP = """        // Fetch a copy of tensormaps for the CTA: pair 0 (CUTLASS's), pair 1 after all SMs'
        // pairs 0 (kMainloopDescriptorPairs x the mainloop's workspace)
        auto tensormaps0 = collective_mainloop.tensormaps_init(params.mainloop, shared_storage.tensormaps.mainloop, sm_count, sm_idx);
        decltype(tensormaps0) tensormap_pairs[2] = {
          tensormaps0,
          cute::make_tuple(get<0>(tensormaps0) + 2 * sm_count, get<1>(tensormaps0) + 2 * sm_count)
        };
        int cur_pair = 0;

        // Update tensormap for the initial batch for the CTA
        collective_mainloop.tensormaps_perform_update(
          shared_storage.tensormaps.mainloop,
          params.mainloop,
          tensormap_pairs[0],
          problem_shape_MNKL,
          curr_batch
        );
        // Ensure warp is converged before issuing tensormap fence release
        __syncwarp();
        // Entire warp must do this (i.e. it's aligned)
        collective_mainloop.tensormaps_cp_fence_release(shared_storage.tensormaps.mainloop, tensormap_pairs[0]);

        // k-blocks of a tile issued before the next tile is fetched and, if it is in another
        // group, its descriptors are written (into the other pair) while this tile's remaining
        // loads wait for free stages
        constexpr int kLookaheadKBlocks = CollectiveMainloop::DispatchPolicy::Stages;

        bool do_load_order_arrive = true;
        bool did_batch_change = true;
        do {
          if (!TileScheduler::valid_warpgroup_in_work_tile(work_tile_info)) {
            auto [next_work_tile_info, increment_pipe] = scheduler.fetch_next_work(
                work_tile_info, tile_scheduler_pipeline, tile_scheduler_pipe_consumer_state);
            work_tile_info = next_work_tile_info;
            if (increment_pipe) {
              ++tile_scheduler_pipe_consumer_state;
            }
            continue;
          }

          // Compute m_coord, n_coord, l_coord with the post-tiled m-shape and n-shape
          auto m_coord = idx2crd(work_tile_info.M_idx, shape<2>(gA_mkl));
          auto n_coord = idx2crd(work_tile_info.N_idx, shape<2>(gB_nkl));
          auto blk_coord = make_coord(m_coord, n_coord, _, mock_l_coord);

          // Get the number of K tiles to compute for this work as well as the starting K tile offset of the work.
          auto work_k_tile_count = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
          auto work_k_tile_start = TileScheduler::get_work_k_tile_start(work_tile_info);
          auto k_tile_iter = cute::make_coord_iterator(idx2crd(work_k_tile_start, shape<3>(gA_mkl)), shape<3>(gA_mkl));

          if (did_batch_change) {
            load_inputs = collective_mainloop.tensors_perform_update(load_inputs, params.mainloop, problem_shape_MNKL, curr_batch);
            collective_mainloop.tensormaps_fence_acquire(tensormap_pairs[cur_pair]);
          }

          const int head = cute::min(static_cast<int>(work_k_tile_count), kLookaheadKBlocks);
          collective_mainloop.load(
            params.mainloop,
            mainloop_pipeline,
            mainloop_pipe_producer_state,
            load_inputs,
            tensormap_pairs[cur_pair],
            blk_coord,
            k_tile_iter, head,
            lane_idx,
            block_rank_in_cluster,
            shared_storage.tensors.mainloop
          );
          mainloop_pipe_producer_state.advance(head);

          // Signal for the epilogue load warp to begin
          if (do_load_order_arrive) {
            load_order_barrier.arrive();
            do_load_order_arrive = false;
          }

          // Get next work tile now, and write its group's descriptors into the other pair
          auto [next_work_tile_info, increment_pipe] = scheduler.fetch_next_work(work_tile_info, tile_scheduler_pipeline, tile_scheduler_pipe_consumer_state);
          if (increment_pipe) {
            ++tile_scheduler_pipe_consumer_state;
          }
          auto next_batch = idx2crd(next_work_tile_info.L_idx, shape<4>(gB_nkl)); // Usually just returns work_tile_info.L_idx
          const bool next_batch_change = next_batch != curr_batch;
          auto next_problem_shape_MNKL = problem_shape_MNKL;
          if (next_work_tile_info.is_valid() && next_batch_change) {
            if constexpr (IsGroupedGemmKernel) {
              next_problem_shape_MNKL = append<4>(params.problem_shape.get_problem_shape(next_batch), 1);
            }
            collective_mainloop.tensormaps_perform_update(
              shared_storage.tensormaps.mainloop,
              params.mainloop,
              tensormap_pairs[cur_pair ^ 1],
              next_problem_shape_MNKL,
              next_batch
            );
            // Ensure warp is converged before issuing tensor replace
            __syncwarp();
            // Entire warp must do this (i.e. it's aligned)
            collective_mainloop.tensormaps_cp_fence_release(shared_storage.tensormaps.mainloop, tensormap_pairs[cur_pair ^ 1]);
          }

          // the rest of this tile's k-blocks, with this tile's pair
          const int rest = static_cast<int>(work_k_tile_count) - head;
          if (rest > 0) {
            auto rest_iter = cute::make_coord_iterator(idx2crd(work_k_tile_start + head, shape<3>(gA_mkl)), shape<3>(gA_mkl));
            collective_mainloop.load(
              params.mainloop,
              mainloop_pipeline,
              mainloop_pipe_producer_state,
              load_inputs,
              tensormap_pairs[cur_pair],
              blk_coord,
              rest_iter, rest,
              lane_idx,
              block_rank_in_cluster,
              shared_storage.tensors.mainloop
            );
            mainloop_pipe_producer_state.advance(rest);
          }

          work_tile_info = next_work_tile_info;
          did_batch_change = next_batch_change;
          if (work_tile_info.is_valid() && did_batch_change) {
            curr_batch = next_batch;
            problem_shape_MNKL = next_problem_shape_MNKL;
            cur_pair ^= 1;
          }
        } while (work_tile_info.is_valid()); // Scheduler work fetch loop

"""


def source_path() -> Path:
    for d in cutlass_include_dirs():
        p = Path(d) / SOURCE
        if p.exists():
            return p
    raise FileNotFoundError(f"{SOURCE} not found under {cutlass_include_dirs()}")


def generate(src: str) -> str:
    """The lookahead kernel's header from the text of CUTLASS's SOURCE."""
    for old, count in ((CLASS_OLD, 1), (WORKSPACE_OLD, 3), (LOOP_START, 1), (LOOP_END, 1)):
        if src.count(old) != count:
            raise ValueError(f"CUTLASS's {SOURCE} changed: expected {count} of {old[:60]!r}, "
                             f"found {src.count(old)}")
    out = src.replace(CLASS_OLD, CLASS_NEW).replace(WORKSPACE_OLD, WORKSPACE_NEW)
    start, end = out.index(LOOP_START), out.index(LOOP_END)
    out = out[:start] + LOOP + out[end:]
    lic_end = out.index("#pragma once")  # CUTLASS's license block stays first
    out = out[:lic_end] + HEADER + out[lic_end:]
    return out.replace("#pragma once",
                       '#pragma once\n#include "cutlass/gemm/kernel/gemm_universal.hpp"', 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.make_lookahead_kernel")
    ap.add_argument("--check", action="store_true", help="fail if kernels/ differs")
    args = ap.parse_args(argv)
    out = generate(source_path().read_text())
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != out:
            print(f"{TARGET} differs from its generator's output; rerun without --check")
            return 1
        print(f"{TARGET} is up to date")
        return 0
    TARGET.write_text(out)
    print(f"wrote {TARGET} ({len(out.splitlines())} lines) from {source_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
