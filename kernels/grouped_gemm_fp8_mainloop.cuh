// The mainloop of the FP8 grouped GEMM (grouped_gemm_fp8.cuh): CUTLASS's sm_90a blockwise-scaled
// pointer-array mainloop (MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise) with two changes.
//
// 1. Per-group scale layouts. CUTLASS's mainloop builds each group's scale tensors from the
//    problem shape alone (a packed [K/128, M] array per group). Our activation scales are one
//    [C/128, R] array over all groups (group g's at column o_g, row stride R), so the mainloop
//    here takes each group's scale layouts from the per-group layout arrays that the prepare
//    kernel fills (CUTLASS's Arguments carry them, its mainloop does not read them).
//
// 2. (kOverlap) The scale promotion overlapped with the next K block's tensor-core work.
//    CUTLASS's loop issues the wgmmas of one 128-deep K block into a temporary accumulator,
//    waits for them all (warpgroup_wait<0>), then adds temp * scales into the main accumulator
//    on the CUDA cores: the tensor cores idle during every promotion. Here two temporary
//    accumulators alternate: K block k+1's wgmmas are issued into one before K block k's
//    result (the other) is waited for (warpgroup_wait<1>) and promoted, so the FFMAs run while
//    the tensor cores work. Costs one more accumulator's registers (64 a thread at 64x128 per
//    warpgroup); the scales are read from shared memory at promotion time, before the stage is
//    released, so they take no registers across the wgmmas. Same arithmetic, same order:
//    bitwise equal to CUTLASS's loop (tests/test_fp8_gpu.py compares the tiles).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace moe_fp8 {

using namespace cute;

template <class Base, bool kOverlap>
struct StridedScales : Base {
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& problem_shape_mnkl,
                                typename Base::Params const& params,
                                typename Base::ElementBlockScale const* ptr_sfa = nullptr,
                                typename Base::ElementBlockScale const* ptr_sfb = nullptr) const {
    return Base::load_init(problem_shape_mnkl, params, ptr_sfa, ptr_sfb);
  }

  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE auto tensors_perform_update(InputTensors const&,
                                             typename Base::Params const& params,
                                             ProblemShapeMNKL problem_shape_mnkl,
                                             int32_t next_batch) {
    auto t = Base::load_init(problem_shape_mnkl, params, params.ptr_SFA[next_batch],
                             params.ptr_SFB[next_batch]);
    Tensor sfa = make_tensor(get<2>(t).data(), params.layout_SFA[next_batch]);
    Tensor sfb = make_tensor(get<3>(t).data(), params.layout_SFB[next_batch]);
    return cute::make_tuple(get<0>(t), get<1>(t), sfa, sfb);
  }

  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  using TensorStorage = typename Base::TensorStorage;
  using Params = typename Base::Params;
  using TileShape = typename Base::TileShape;
  using TiledMma = typename Base::TiledMma;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using SmemLayoutB = typename Base::SmemLayoutB;
  using SmemLayoutSFA = typename Base::SmemLayoutSFA;
  using SmemLayoutSFB = typename Base::SmemLayoutSFB;
  using ElementBlockScale = typename Base::ElementBlockScale;
  static constexpr int kScaleMs = Base::ScaleMsPerTile;
  static constexpr int kScaleNs = Base::ScaleNsPerTile;

  // The consumer's loop (kOverlap), or CUTLASS's.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& mainloop_params) {
    if constexpr (!kOverlap) {
      Base::mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors,
                mainloop_params);
    } else {
      // One promotion per K tile: the tile's K (128) is the scale granularity.
      static_assert(Base::ScalePromotionInterval == 4 && size<2>(TileShape{}) == 128,
                    "the overlapped FP8 mainloop promotes once per 128-deep K tile");
      static_assert(kScaleMs > 1, "the FP8 grouped GEMM scales A per row");
      overlapped_mma(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors);
    }
  }

 private:
  template <class FrgTensorC>
  CUTLASS_DEVICE void overlapped_mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                                     FrgTensorC& accum, int k_tile_count, int thread_idx,
                                     TensorStorage& shared_tensors) {
    // Shared-memory views as in CUTLASS's mma(): scales broadcast to (BLK_M, BLK_N, (K, PIPE)).
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout wg_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int wg = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(wg_layout(wg));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,M,N,(K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,M,K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor tCrSFB = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
    Tensor tmp0 = make_fragment_like(accum);
    Tensor tmp1 = make_fragment_like(accum);

    if (k_tile_count <= 0) {
      clear(accum);
      return;
    }
    PipelineState smem_pipe_release = smem_pipe_read;

    // Issue K tile `stage`'s wgmmas into `tmp` (zeroing it first).
    auto issue = [&](auto& tmp, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(tmp);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), tmp);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(tmp);
    };
    // accum (+)= tmp * scales of K tile `stage` (read from shared memory now).
    auto promote = [&](auto& tmp, int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      warpgroup_fence_operand(tmp);
      if constexpr (kScaleMs > 1 && kScaleNs == 1) {
        const ElementBlockScale sb = tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) {
          filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * sb;
        }
      }
      // CUTLASS's expressions, so the rounding is the same: (tmp * sa) * sb for two scales
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        if constexpr (kScaleNs == 1) {
          accum(i) += tmp(i) * tCrSFA(i);
        } else {
          accum(i) += tmp(i) * tCrSFA(i) * tCrSFB(i);
        }
      }
    };

    // K tile 0 into tmp0; then per pair of tiles: issue into one buffer, wait for the other's
    // wgmmas (warpgroup_wait<1>: all but the batch just committed), promote it, release its stage.
    clear(accum);
    warpgroup_fence_operand(accum);
    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, token);
    int prev_stage = smem_pipe_read.index();
    issue(tmp0, prev_stage);
    ++smem_pipe_read;
    int k = 1;
    auto step = [&](auto& cur, auto& prev) {
      auto tok = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, tok);
      const int stage = smem_pipe_read.index();
      issue(cur, stage);
      warpgroup_wait<1>();
      promote(prev, prev_stage);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      ++smem_pipe_read;
      prev_stage = stage;
    };
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      step(tmp1, tmp0);
      step(tmp0, tmp1);
    }
    // The last K tile sits in tmp0 (even count issued so far) or tmp1.
    if (k < k_tile_count) {
      step(tmp1, tmp0);
      warpgroup_wait<0>();
      promote(tmp1, prev_stage);
    } else {
      warpgroup_wait<0>();
      promote(tmp0, prev_stage);
    }
    // The last stage is released by mma_tail, as after CUTLASS's loop.
    warpgroup_fence_operand(accum);
  }
};

}  // namespace moe_fp8
