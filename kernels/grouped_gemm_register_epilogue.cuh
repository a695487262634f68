// What the Hopper grouped GEMM's fused epilogues share (kernels/grouped_gemm_swiglu.cu, the
// SwiGLU forward; kernels/grouped_gemm_dswiglu.cu, dSwiGLU in the dgrad): an epilogue that
// stores from registers (no shared memory, no TMA store), plugged into CUTLASS's ptr-array
// kernels through Sm90TmaWarpSpecializedAdapter. RegisterEpilogueBase holds the types and the
// host-side hooks CUTLASS reads; a fused epilogue derives from it and defines operator() (the
// epilogue itself), reading `params.extra` (its Extra struct, whose `ld` must be a multiple of
// 8) and `params.ptr_D` (per group: the primary output's first row of the group).
#pragma once

#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "grouped_gemm.cuh"

namespace moe_gg {

template <class StrideD_, class Extra>
class RegisterEpilogueBase {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = Element;
  using ElementAccumulator = ElementAcc;
  using ElementCompute = ElementAcc;
  using ElementScalar = ElementAcc;
  using ElementC = void;
  using StrideC = StrideD_;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using ElementD = Element;
  using StrideD = StrideD_;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;
  using GmemElementC = Element;
  // Not applied (the derived operator() is the epilogue); GemmUniversalAdapter reads its types.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 1, ElementAcc,
                                                                        ElementAcc>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    Element** ptr_D = nullptr;  // per group: the primary output's first row of the group
    StrideD dD{};
    Extra extra{};
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.extra.ld % 8 == 0;
  }

  CUTLASS_HOST_DEVICE explicit RegisterEpilogueBase(Params const& params) : params(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

 protected:
  Params params;
};

// The collective epilogue of a register epilogue Op<StrideD> (row-major D).
template <template <class> class Op>
using RegisterEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
    Op<cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor*>>>;

// A register epilogue's arguments: the group arrays' D pointers and strides and the fused
// kernel's Extra.
struct RegisterEpilogueArgs {
  template <class Kernel, class Arrays, class Extra>
  static typename Kernel::EpilogueArguments make(const Arrays& g, const Extra& extra) {
    typename Kernel::EpilogueArguments a{};
    a.ptr_D = g.ptr_d;
    a.dD = g.stride_d;
    a.extra = extra;
    return a;
  }
};

// A kernel definition (KernelFor) around a register epilogue Op.
template <class LayoutA, class LayoutB, class Config, template <class> class Op>
struct RegisterEpilogueDef : KernelFor<LayoutA, LayoutB, Config, RegisterEpilogue<Op>> {
  using Kernel = typename KernelFor<LayoutA, LayoutB, Config, RegisterEpilogue<Op>>::Kernel;

  template <class Arrays, class Extra>
  static typename Kernel::EpilogueArguments epilogue_args(const Arrays& g, const Extra& extra) {
    return RegisterEpilogueArgs::make<Kernel>(g, extra);
  }
};

}  // namespace moe_gg
