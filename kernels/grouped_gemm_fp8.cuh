// FP8 (e4m3) grouped GEMM for Hopper (sm_90a) with blockwise scales (DeepSeek-V3's recipe):
// CUTLASS's pointer-array grouped GEMM with software blockwise scaling (MainloopSm90ArrayTma-
// GmmaWarpSpecializedBlockwise), float32 accumulation promoted per 128 of K, bf16 or float32 out.
// Shared by grouped_gemm_fp8_{nt,wgrad,wgrad_f32}.cu; the operand layouts are those of
// moe_praxis/ops/fp8/gemm.py (module doc):
//   nt:    out[rows of g, n] = sum_k dq(A)[r, k] dq(B[g])[n, k]; A [R, C] e4m3 with scales
//          [C/128, R] (1 x 128 tiles, MN-major), B [E, N, C] e4m3 with scales [E, C/128, N/128]
//          (128 x 128 blocks, MN-major). Rows past sum(group_sizes) are zero.
//   wgrad: out[g] [C1, C2] = sum over group g's rows of dq(x)[r, c1] dq(dy)[r, c2]; x and dy
//          transposed and grouped: [C, Rp] e4m3 (group g's rows at padded columns [P_g, P_g + m_g),
//          P_g = sum_{j<g} round_up(m_j, 128)), scales [Rp/128, C] (one per 128 rows and column:
//          scale granularity 1 along both M and N). Experts with no rows get zeros.
//
// As in grouped_gemm.cuh, group sizes stay on the device: a prepare kernel scans them (clamped to
// the rows left) and writes each problem's shape, pointers, strides and scale layouts into the
// workspace, zeroing what CUTLASS will not write; then the CUTLASS kernel runs. No host sync:
// CUDA-graph safe. Workspace: [kFp8GroupArrayBytesPerGroup * E, 256-aligned][CUTLASS workspace].
//
// The mainloop (grouped_gemm_fp8_mainloop.cuh) is CUTLASS's with per-group scale layouts and,
// for the tiles that ask for it, the scale promotion overlapped with the next K block's wgmmas.
#pragma once

#include "grouped_gemm.cuh"
#include "grouped_gemm_fp8_mainloop.cuh"

namespace moe_fp8 {

namespace ffi = xla::ffi;
using namespace cute;
using moe_gg::kAlign;
using moe_gg::kPrepareThreads;
using moe_gg::ProblemShape;
using moe_gg::UnderlyingShape;

using ElementIn = cutlass::float_e4m3_t;
using ElementAcc = float;
constexpr int kBlock = 128;  // scale granularity along K (and N for weights)
constexpr int kAlignmentIn = 16;  // 16 bytes of e4m3

// Bytes of group arrays per group (shape, 5 pointers, 3 strides, 2 scale layouts), with room.
constexpr int64_t kFp8GroupArrayBytesPerGroup = 384;

// Tile configurations (the FFI attribute `tile`; TILE_CONFIGS in moe_praxis/ops/fp8/gemm.py).
template <int CM, int CN, bool Overlap = false>
struct Coop128 {  // cooperative 128x128x128: example 68's tile; 128 = one scale block of N and K
  static constexpr bool kOverlap = Overlap;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
};
// ping-pong 64x128x128: each consumer warpgroup owns a 64x128 tile, so one warpgroup's scale
// promotion and epilogue overlap the other's tensor-core work
template <int CM, int CN>
struct Pingpong64 {
  static constexpr bool kOverlap = false;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
};
constexpr int kNumFp8Tiles = 6;

// One kernel: A (M x K) and B (N x K) both K-major (FP8 wgmma needs it), D row-major ElementD.
// Scales: A one per row and 128 of K (granularity (1, 128)); B one per GranN columns and 128 of
// K: GranN = 128 for a weight's 128 x 128 blocks (nt), 1 for wgrad's dy, whose L3 tiles are
// 128 rows by one column.
template <class ElementDT, class Config, int GranN>
struct Fp8GemmDef {
  using ElementD = ElementDT;
  static constexpr int kGranN = GranN;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranN, kBlock>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc,
      ElementAcc, void, cutlass::layout::RowMajor*, kAlignmentD, ElementD,
      cutlass::layout::RowMajor*, kAlignmentD, typename Config::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, void>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignmentIn, ElementIn,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignmentIn, ElementAcc,
      typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using CollectiveMainloop = StridedScales<BuiltMainloop, Config::kOverlap>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

template <class Def>
struct Fp8Arrays {
  using ElementD = typename Def::ElementD;
  using StrideA = typename Def::StrideA;
  using StrideB = typename Def::StrideB;
  using StrideD = typename Def::StrideD;
  using LayoutSFA = typename Def::LayoutSFA;
  using LayoutSFB = typename Def::LayoutSFB;
  UnderlyingShape* shapes;
  const ElementIn** ptr_a;
  const ElementIn** ptr_b;
  const float** ptr_sfa;
  const float** ptr_sfb;
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

template <class Def>
inline Fp8Arrays<Def> carve_fp8_arrays(uint8_t* ws, int e, int64_t* bytes) {
  using G = Fp8Arrays<Def>;
  using ElementD = typename G::ElementD;
  using StrideA = typename G::StrideA;
  using StrideB = typename G::StrideB;
  using StrideD = typename G::StrideD;
  using LayoutSFA = typename G::LayoutSFA;
  using LayoutSFB = typename G::LayoutSFB;
  G g;
  size_t off = 0;
  auto take = [&](size_t each) {
    uint8_t* p = ws + off;
    off += (each * e + 15) / 16 * 16;
    return p;
  };
  g.shapes = reinterpret_cast<UnderlyingShape*>(take(sizeof(UnderlyingShape)));
  g.ptr_a = reinterpret_cast<const ElementIn**>(take(sizeof(void*)));
  g.ptr_b = reinterpret_cast<const ElementIn**>(take(sizeof(void*)));
  g.ptr_sfa = reinterpret_cast<const float**>(take(sizeof(void*)));
  g.ptr_sfb = reinterpret_cast<const float**>(take(sizeof(void*)));
  g.ptr_d = reinterpret_cast<ElementD**>(take(sizeof(void*)));
  g.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA)));
  g.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB)));
  g.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD)));
  g.layout_sfa = reinterpret_cast<LayoutSFA*>(take(sizeof(LayoutSFA)));
  g.layout_sfb = reinterpret_cast<LayoutSFB*>(take(sizeof(LayoutSFB)));
  *bytes = static_cast<int64_t>(off);
  return g;
}

inline int64_t fp8_group_array_bytes(int e) {
  return (kFp8GroupArrayBytesPerGroup * e + kAlign - 1) / kAlign * kAlign;
}

// An MN-major scale layout of an (mn x k) operand with granularity G along MN (1 or 128) and
// 128 along K, whose K blocks are `k_stride` floats apart.
template <class Layout, int G>
__device__ __forceinline__ Layout scale_layout(int mn, int k, int k_stride) {
  return Layout(make_shape(make_shape(Int<G>{}, (mn + G - 1) / G),
                           make_shape(Int<kBlock>{}, (k + kBlock - 1) / kBlock), 1),
                make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, k_stride), 0));
}

struct Fp8Prepare {
  const int32_t* group_sizes;
  int num_groups;
  int64_t rows;  // R: rows of the ragged operand (nt), or of the x / dy before padding (wgrad)
  bool wgrad;
  // nt: problem (m_g, n, k); A at a + o_g * k (row stride k), scales sa + o_g (K stride rows);
  //     B at b + g * n * k, scales sb + g * (k/128) * (n/128) (K stride n/128); D at d + o_g * n.
  // wgrad: problem (c1, c2, round_up(m_g, 128)) (M = 0 for an empty group); A at a + P_g (row
  //     stride rp), scales sa + (P_g/128) * c1 (K stride c1); B at b + P_g, scales
  //     sb + (P_g/128) * c2; D at d + g * c1 * c2, zeroed for empty groups.
  int dim_m;   // wgrad: c1
  int dim_n;   // nt: n; wgrad: c2
  int dim_k;   // nt: k (the contraction C)
  int64_t rp;  // wgrad: the padded row count of the transposed operands
  const ElementIn* a;
  const ElementIn* b;
  const float* sa;
  const float* sb;
  void* d;
  int64_t d_elem_bytes;
};

__device__ inline void zero_bytes(void* p, int64_t n, int64_t tid, int64_t nthreads) {
  // n and p are multiples of 16 bytes (output widths are multiples of 128 elements)
  uint4* v = reinterpret_cast<uint4*>(p);
  const int64_t nv = n / 16;
  for (int64_t i = tid; i < nv; i += nthreads) v[i] = make_uint4(0, 0, 0, 0);
}

// Every block scans the group sizes (block 0 writes the arrays); all blocks zero what CUTLASS
// will not write: rows past the sum (nt) or the outputs of empty experts (wgrad).
template <class Def>
__global__ void __launch_bounds__(kPrepareThreads)
    moe_fp8_prepare(Fp8Prepare p, Fp8Arrays<Def> g, typename Def::StrideA s_a,
                    typename Def::StrideB s_b, typename Def::StrideD s_d) {
  using ElementD = typename Def::ElementD;
  using LayoutSFA = typename Def::LayoutSFA;
  using LayoutSFB = typename Def::LayoutSFB;
  constexpr int kGranN = Def::kGranN;
  using BlockScan = cub::BlockScan<int64_t, kPrepareThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int64_t carry, pad_carry;
  extern __shared__ int32_t rows_smem[];  // wgrad: clamped rows per group
  if (threadIdx.x == 0) carry = pad_carry = 0;
  __syncthreads();
  const bool writer = blockIdx.x == 0;
  const int64_t kb = p.dim_k / kBlock, nb = p.dim_n / kBlock;
  for (int base = 0; base < p.num_groups; base += kPrepareThreads) {
    const int e = base + threadIdx.x;
    const int64_t size = e < p.num_groups ? max(p.group_sizes[e], 0) : 0;
    int64_t start, total;
    BlockScan(scan_storage).ExclusiveSum(size, start, total);
    start += carry;
    const int64_t lo = min(start, p.rows);
    const int64_t m = e < p.num_groups ? min(start + size, p.rows) - lo : 0;
    const int64_t padded = (m + kBlock - 1) / kBlock * kBlock;
    __syncthreads();
    int64_t pad_start, pad_total;
    BlockScan(scan_storage).ExclusiveSum(padded, pad_start, pad_total);
    pad_start += pad_carry;
    __syncthreads();  // everyone has read carry and pad_carry
    if (threadIdx.x == 0) {
      carry += total;
      pad_carry += pad_total;
    }
    if (e < p.num_groups) {
      if (p.wgrad) rows_smem[e] = static_cast<int>(m);
      if (writer) {
        const ElementIn *a, *b;
        const float *sa, *sb;
        ElementD* d = reinterpret_cast<ElementD*>(p.d);
        if (p.wgrad) {
          g.shapes[e] = UnderlyingShape(m > 0 ? p.dim_m : 0, p.dim_n, static_cast<int>(padded));
          a = p.a + pad_start;
          b = p.b + pad_start;
          sa = p.sa + pad_start / kBlock * p.dim_m;
          sb = p.sb + pad_start / kBlock * p.dim_n;
          d += static_cast<int64_t>(e) * p.dim_m * p.dim_n;
          g.layout_sfa[e] = scale_layout<LayoutSFA, 1>(p.dim_m, static_cast<int>(padded), p.dim_m);
          g.layout_sfb[e] =
              scale_layout<LayoutSFB, kGranN>(p.dim_n, static_cast<int>(padded), p.dim_n / kGranN);
        } else {
          g.shapes[e] = UnderlyingShape(static_cast<int>(m), p.dim_n, p.dim_k);
          a = p.a + lo * p.dim_k;
          b = p.b + static_cast<int64_t>(e) * p.dim_n * p.dim_k;
          sa = p.sa + lo;
          sb = p.sb + static_cast<int64_t>(e) * kb * nb;
          d += lo * p.dim_n;
          g.layout_sfa[e] =
              scale_layout<LayoutSFA, 1>(static_cast<int>(m), p.dim_k, static_cast<int>(p.rows));
          g.layout_sfb[e] = scale_layout<LayoutSFB, kGranN>(p.dim_n, p.dim_k, p.dim_n / kGranN);
        }
        g.ptr_a[e] = a;
        g.ptr_b[e] = b;
        g.ptr_sfa[e] = sa;
        g.ptr_sfb[e] = sb;
        g.ptr_d[e] = d;
        g.stride_a[e] = s_a;
        g.stride_b[e] = s_b;
        g.stride_d[e] = s_d;
      }
    }
    __syncthreads();  // carry updated; scan storage reusable
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint8_t* d = reinterpret_cast<uint8_t*>(p.d);
  if (p.wgrad) {
    const int64_t slice = static_cast<int64_t>(p.dim_m) * p.dim_n * p.d_elem_bytes;
    for (int e = 0; e < p.num_groups; ++e) {
      if (rows_smem[e] == 0) zero_bytes(d + e * slice, slice, tid, nthreads);
    }
  } else {
    const int64_t done = min(carry, p.rows);
    const int64_t row = static_cast<int64_t>(p.dim_n) * p.d_elem_bytes;
    zero_bytes(d + done * row, (p.rows - done) * row, tid, nthreads);
  }
}

// Prepare + the CUTLASS kernel of one configuration.
template <class Def>
ffi::Error run_fp8(cudaStream_t stream, Fp8Prepare p, uint8_t* workspace, int64_t workspace_bytes,
                   moe_gg::Schedule sched) {
  using Gemm = typename Def::Gemm;
  moe_praxis_note_stream(stream);
  const int e = p.num_groups;
  int64_t used = 0;
  using ElementD = typename Def::ElementD;
  auto g = carve_fp8_arrays<Def>(workspace, e, &used);
  const int64_t head = fp8_group_array_bytes(e);
  if (used > head || head > workspace_bytes) {
    return ffi::Error::InvalidArgument(
        "moe_praxis FP8 grouped GEMM: workspace of " + std::to_string(workspace_bytes) +
        " bytes is too small (the group arrays of " + std::to_string(e) + " groups take " +
        std::to_string(head) + ")");
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return moe_gg::cuda_error(err, "cudaGetDevice");
  cutlass::KernelHardwareInfo hw = moe_gg::hardware_info<Def>(device);
  p.d_elem_bytes = sizeof(ElementD);

  const int64_t zero_bytes_total =
      p.wgrad ? static_cast<int64_t>(p.dim_m) * p.dim_n * e * p.d_elem_bytes
              : p.rows * p.dim_n * p.d_elem_bytes;
  const int blocks = static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(zero_bytes_total / (16 * kPrepareThreads * 4), 1),
                        2 * static_cast<int64_t>(hw.sm_count)));
  const size_t smem = p.wgrad ? sizeof(int32_t) * e : 0;
  // A and B rows are K-major with leading dimension rp (wgrad) or k (nt); D rows are n wide
  const int64_t ld_in = p.wgrad ? p.rp : p.dim_k;
  moe_fp8_prepare<<<blocks, kPrepareThreads, smem, stream>>>(
      p, g, moe_gg::make_ld_stride<typename Def::StrideA>(ld_in),
      moe_gg::make_ld_stride<typename Def::StrideB>(ld_in),
      moe_gg::make_ld_stride<typename Def::StrideD>(p.dim_n));
  err = cudaGetLastError();
  if (err != cudaSuccess) return moe_gg::cuda_error(err, "FP8 prepare kernel launch");

  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {e, g.shapes, nullptr},
                                {g.ptr_a, g.stride_a, g.ptr_b, g.stride_b, g.ptr_sfa, g.layout_sfa,
                                 g.ptr_sfb, g.layout_sfb},
                                {},
                                hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.alpha_ptr = nullptr;
  args.epilogue.thread.beta_ptr = nullptr;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = g.stride_d;
  args.epilogue.ptr_D = g.ptr_d;
  args.epilogue.dD = g.stride_d;
  using RasterOptions = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = sched.raster ? RasterOptions::AlongN : RasterOptions::AlongM;
  args.scheduler.max_swizzle_size = static_cast<int>(sched.swizzle);
  Gemm gemm;
  const int64_t need = static_cast<int64_t>(Gemm::get_workspace_size(args));
  if (need > workspace_bytes - head) {
    return ffi::Error::InvalidArgument(
        "moe_praxis FP8 grouped GEMM: CUTLASS needs " + std::to_string(need) +
        " workspace bytes, " + std::to_string(workspace_bytes - head) +
        " are left (raise CUTLASS_WORKSPACE_BYTES in moe_praxis/ops/grouped_gemm_tiles.py)");
  }
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return ffi::Error::InvalidArgument(
        std::string("moe_praxis FP8 grouped GEMM: CUTLASS cannot implement this problem: ") +
        cutlassGetStatusString(st));
  }
  st = gemm.initialize(args, workspace + head, stream);
  if (st != cutlass::Status::kSuccess) {
    return ffi::Error::Internal(std::string("moe_praxis FP8 grouped GEMM: initialize failed: ") +
                                cutlassGetStatusString(st));
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    return ffi::Error::Internal(std::string("moe_praxis FP8 grouped GEMM: run failed: ") +
                                cutlassGetStatusString(st));
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return moe_gg::cuda_error(err, "FP8 CUTLASS kernel launch");
  return ffi::Error::Success();
}

// Dispatches on the tile attribute (and checks the schedule knobs).
template <class ElementD, int GranN>
ffi::Error run_fp8_tile(cudaStream_t stream, Fp8Prepare p, uint8_t* workspace,
                        int64_t workspace_bytes, int64_t tile, int64_t raster, int64_t swizzle) {
  const moe_gg::Schedule sched{raster, swizzle, 0};
  ffi::Error bad = moe_gg::check_schedule(sched);
  if (bad.failure()) return bad;
  switch (tile) {
    case 0:
      return run_fp8<Fp8GemmDef<ElementD, Coop128<1, 2>, GranN>>(stream, p, workspace,
                                                                 workspace_bytes, sched);
    case 1:
      return run_fp8<Fp8GemmDef<ElementD, Coop128<1, 1>, GranN>>(stream, p, workspace,
                                                                 workspace_bytes, sched);
    case 2:  // 2x1: B multicast to the two row tiles (the group scheduler rounds row tiles to 2)
      return run_fp8<Fp8GemmDef<ElementD, Coop128<2, 1>, GranN>>(stream, p, workspace,
                                                                 workspace_bytes, sched);
    case 3:
      return run_fp8<Fp8GemmDef<ElementD, Pingpong64<1, 2>, GranN>>(stream, p, workspace,
                                                                    workspace_bytes, sched);
    case 4:  // tiles 2 and 0 with the promotion overlapped (grouped_gemm_fp8_mainloop.cuh)
      return run_fp8<Fp8GemmDef<ElementD, Coop128<2, 1, true>, GranN>>(stream, p, workspace,
                                                                       workspace_bytes, sched);
    case 5:
      return run_fp8<Fp8GemmDef<ElementD, Coop128<1, 2, true>, GranN>>(stream, p, workspace,
                                                                       workspace_bytes, sched);
    default:
      return ffi::Error::InvalidArgument("moe_praxis FP8 grouped GEMM: tile=" +
                                         std::to_string(tile) + " is invalid; valid: 0.." +
                                         std::to_string(kNumFp8Tiles - 1));
  }
}

// Operand checks shared by the handlers: dims must be whole 128-blocks where they are scaled.
inline ffi::Error fp8_bad(const std::string& what) {
  return ffi::Error::InvalidArgument("moe_praxis FP8 grouped GEMM: " + what);
}

}  // namespace moe_fp8
