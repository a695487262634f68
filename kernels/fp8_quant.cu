// FP8 quantization into the row layout L1 (fp8_quant.cuh: the recipe; moe_praxis/ops/fp8/quant.py:
// the layouts and the references these kernels equal bitwise):
//
//   moe_fp8_quantize_rows           L1: x [R, C] -> q [R, C], s_t [C/128, R]   (1 x 128 tiles)
//   moe_swiglu_fwd_fp8              the SwiGLU forward writing act [R, H] and act as L1
//   moe_permute_fp8                 the row-major permute y[r] = x[row_map[r]] writing y and y as L1
//   moe_swiglu_bwd_fp8              the SwiGLU backward writing d gate and d up [R, H] and both as
//                                   L1 (the gate and up dgrads' FP8 operands), with the routing
//                                   weight's gradient as partial sums per 128-column tile
//
// One pass over the input each: a group of 128 / VEC lanes per tile (16 bf16 or 32 f32 lanes,
// one 16-byte load each), the amax by shuffles; tiles are numbered column tile major, row minor,
// so the scales a block writes are contiguous in s_t.
#include "fp8_quant.cuh"
#include "swiglu_math.cuh"

namespace moe {
namespace {

using namespace fp8q;

// ------------------------------------------------- L1 (and SwiGLU + L1, permute + L1)

// The tile an L1 pass's thread works on: tile t = ct * rows + r covers row r, columns
// [ct*128, ct*128 + 128); LANES = 128 / VEC lanes load one 16-byte vector each, vi being that
// vector's index in [R, C] / VEC. A dead tile (t past the last) has live = false; its lanes still
// take part in the shuffles, carrying 0.
template <typename T>
struct L1Tile {
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int LANES = kTile / VEC;
  static constexpr int TILES = kThreads / LANES;  // tiles per block
  using V = Vec<T, VEC>;
  using Q = Vec<uint8_t, VEC>;
  int64_t tile, ct = 0, r = 0, vi = 0;
  int lane;
  bool live;

  __device__ __forceinline__ L1Tile(int64_t rows, int64_t ctiles)
      : tile(static_cast<int64_t>(blockIdx.x) * TILES + threadIdx.x / LANES),
        lane(threadIdx.x % LANES),
        live(tile < rows * ctiles) {
    if (live) {
      ct = tile / rows;
      r = tile - ct * rows;
      vi = (r * ctiles + ct) * LANES + lane;
    }
  }
  // max / sum over the tile's LANES lanes (every lane must call these)
  __device__ __forceinline__ static float lane_max(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
  __device__ __forceinline__ static float lane_sum(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  }
  // writes the lane's VEC values of the tile as e4m3 under the tile's scale (from its amax) and,
  // from lane 0, the scale; returns the scale
  __device__ __forceinline__ float store(const float (&v)[VEC], float amax, uint8_t* q,
                                         float* s_t) const {
    const float s = tile_scale(amax), inv = reciprocal(s);
    Q qv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) qv.v[j] = to_e4m3(v[j], inv);
    reinterpret_cast<Q*>(q)[vi] = qv;
    if (lane == 0) s_t[tile] = s;
    return s;
  }
};

// Where the rows of an L1 pass come from: x itself; the SwiGLU of x (gate) and up, written to
// out in T and quantized as rounded; or the permuted rows x[row_map[r]] (zeros where row_map[r]
// is outside [0, tokens)), written to out and quantized.
enum class Src { kRows, kSwiglu, kPermute };

template <typename T>
struct RowsArgs {
  const T* x;
  const T* up;              // kSwiglu
  const float* w;           // kSwiglu: [R] or nullptr (no routing weights)
  const int32_t* row_map;   // kPermute: [R]
  int64_t tokens;           // kPermute: rows of x
  T* out;                   // kSwiglu, kPermute: [R, C]
  uint8_t* q;               // [R, C]
  float* s_t;               // [C/128, R]
  int64_t rows, ctiles;     // R, C / 128
};

// One L1Tile per LANES lanes.
template <typename T, Src SRC>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const RowsArgs<T> a) {
  using Tile = L1Tile<T>;
  constexpr int VEC = Tile::VEC;
  using V = typename Tile::V;
  const Tile t(a.rows, a.ctiles);
  float v[VEC];
  float amax = 0.f;
  if (t.live) {
    V xv;
    if constexpr (SRC == Src::kPermute) {
      const int64_t src = __ldg(a.row_map + t.r);
      if (src >= 0 && src < a.tokens) {
        xv = reinterpret_cast<const V*>(a.x)[(src * a.ctiles + t.ct) * Tile::LANES + t.lane];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xv.v[j] = from_f32<T>(0.f);
      }
      reinterpret_cast<V*>(a.out)[t.vi] = xv;
    } else {
      xv = reinterpret_cast<const V*>(a.x)[t.vi];
    }
    if constexpr (SRC == Src::kSwiglu) {
      const V uv = reinterpret_cast<const V*>(a.up)[t.vi];
      const float wr = a.w ? a.w[t.r] : 1.f;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        xv.v[j] = from_f32<T>(swiglu_act<T>(to_f32(xv.v[j]), to_f32(uv.v[j]), wr));
      }
      reinterpret_cast<V*>(a.out)[t.vi] = xv;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      v[j] = to_f32(xv.v[j]);
      amax = fmaxf(amax, fabsf(v[j]));
    }
  }
  amax = Tile::lane_max(amax);
  if (t.live) t.store(v, amax, a.q, a.s_t);
}

template <typename T, Src SRC>
ffi::Error launch_rows(cudaStream_t stream, RowsArgs<T> a) {
  const int64_t blocks = ceil_div(a.rows * a.ctiles, L1Tile<T>::TILES);
  if (blocks > INT32_MAX) {
    return MOE_INVALID("fp8 quantize rows: R=" + std::to_string(a.rows) + ", C=" +
                       std::to_string(a.ctiles * kTile) + " needs more than 2^31 - 1 blocks");
  }
  quantize_rows_kernel<T, SRC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  MOE_LAUNCH_CHECK("fp8_quantize_rows");
  return ffi::Error::Success();
}

// Runs launch_rows<T, SRC> for x's dtype (checked: f32 or bf16) on type-erased pointers.
template <Src SRC>
ffi::Error launch_rows_any(cudaStream_t stream, ffi::DataType dtype, const void* x,
                           const void* up, const float* w, const int32_t* row_map,
                           int64_t tokens, void* out, void* q, float* s_t, int64_t rows,
                           int64_t cols) {
  if (dtype == ffi::F32) {
    using T = float;
    return launch_rows<T, SRC>(
        stream, RowsArgs<T>{static_cast<const T*>(x), static_cast<const T*>(up), w, row_map,
                            tokens, static_cast<T*>(out), static_cast<uint8_t*>(q), s_t, rows,
                            cols / kTile});
  }
  using T = __nv_bfloat16;
  return launch_rows<T, SRC>(
      stream, RowsArgs<T>{static_cast<const T*>(x), static_cast<const T*>(up), w, row_map,
                          tokens, static_cast<T*>(out), static_cast<uint8_t*>(q), s_t, rows,
                          cols / kTile});
}

// ------------------------------------------------- SwiGLU backward + L1 of both gradients

// The backward of out = silu(gate) * up * w[r] (kernels/swiglu.cu's math, the same expressions:
// dgate = dout * w * up * silu'(gate), dup = dout * w * silu(gate)), each gradient written in T
// and quantized as rounded into L1; dw_part[ct, r] = sum over the tile's columns of
// dout * silu(gate) * up (the routing weight's gradient, summed over ct by the caller).
template <typename T>
struct SwigluBwdArgs {
  const T* gate;
  const T* up;
  const float* w;  // [R] or nullptr (no routing weights)
  const T* dout;
  T* dgate;
  T* dup;
  uint8_t* qg;
  float* sg_t;      // [C/128, R]
  uint8_t* qu;
  float* su_t;      // [C/128, R]
  float* dw_part;   // [C/128, R] with weights, else nullptr
  int64_t rows, ctiles;
};

// The same tiles as quantize_rows_kernel (L1Tile).
template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_fp8_kernel(const SwigluBwdArgs<T> a) {
  using Tile = L1Tile<T>;
  constexpr int VEC = Tile::VEC;
  using V = typename Tile::V;
  const Tile t(a.rows, a.ctiles);
  float vg[VEC], vu[VEC];
  float amax_g = 0.f, amax_u = 0.f, acc = 0.f;
  if (t.live) {
    const V gv = reinterpret_cast<const V*>(a.gate)[t.vi];
    const V uv = reinterpret_cast<const V*>(a.up)[t.vi];
    const V dv = reinterpret_cast<const V*>(a.dout)[t.vi];
    const float wr = a.w ? a.w[t.r] : 1.f;
    V dgv, duv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_f32(gv.v[j]), y = to_f32(uv.v[j]), dy = to_f32(dv.v[j]);
      const float s = sigmoid_t<T>(x), silu = x * s;
      acc += dy * silu * y;
      const float dyw = dy * wr;
      dgv.v[j] = from_f32<T>(dyw * y * (s * (1.f + x * (1.f - s))));
      duv.v[j] = from_f32<T>(dyw * silu);
      vg[j] = to_f32(dgv.v[j]);
      vu[j] = to_f32(duv.v[j]);
      amax_g = fmaxf(amax_g, fabsf(vg[j]));
      amax_u = fmaxf(amax_u, fabsf(vu[j]));
    }
    reinterpret_cast<V*>(a.dgate)[t.vi] = dgv;
    reinterpret_cast<V*>(a.dup)[t.vi] = duv;
  }
  amax_g = Tile::lane_max(amax_g);
  amax_u = Tile::lane_max(amax_u);
  acc = Tile::lane_sum(acc);
  if (!t.live) return;
  t.store(vg, amax_g, a.qg, a.sg_t);
  t.store(vu, amax_u, a.qu, a.su_t);
  if (t.lane == 0 && a.dw_part) a.dw_part[t.tile] = acc;
}

template <typename T>
ffi::Error launch_swiglu_bwd(cudaStream_t stream, SwigluBwdArgs<T> a) {
  const int64_t blocks = ceil_div(a.rows * a.ctiles, L1Tile<T>::TILES);
  if (blocks > INT32_MAX) {
    return MOE_INVALID("swiglu bwd fp8: R=" + std::to_string(a.rows) + ", H=" +
                       std::to_string(a.ctiles * kTile) + " needs more than 2^31 - 1 blocks");
  }
  swiglu_bwd_fp8_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  MOE_LAUNCH_CHECK("swiglu_bwd_fp8");
  return ffi::Error::Success();
}

template <typename T>
SwigluBwdArgs<T> swiglu_bwd_args(const void* g, const void* u, const float* w, const void* d,
                                 void* dg, void* du, void* qg, float* sg_t, void* qu, float* su_t,
                                 float* dw_part, int64_t rows, int64_t cols) {
  return SwigluBwdArgs<T>{static_cast<const T*>(g), static_cast<const T*>(u), w,
                          static_cast<const T*>(d), static_cast<T*>(dg), static_cast<T*>(du),
                          static_cast<uint8_t*>(qg), sg_t, static_cast<uint8_t*>(qu), su_t,
                          dw_part, rows, cols / kTile};
}

// ------------------------------------------------------------------------------ handlers

ffi::Error check_rows(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& q,
                      const ffi::Buffer<ffi::F32>& s_t) {
  if (x.dimensions().size() != 2) {
    return MOE_INVALID(std::string(op) + ": x must be [R, C], got " + dims_text(x));
  }
  if (!is_float(x)) return MOE_INVALID(std::string(op) + ": x must be float32 or bfloat16");
  if (x.dimensions()[1] % kTile) {
    return MOE_INVALID(std::string(op) + ": C=" + std::to_string(x.dimensions()[1]) +
                       " must be a multiple of 128");
  }
  if (q.element_type() != ffi::F8E4M3FN || q.element_count() != x.element_count()) {
    return MOE_INVALID(std::string(op) + ": q must be float8_e4m3fn with x's shape");
  }
  if (s_t.element_count() != x.element_count() / kTile) {
    return MOE_INVALID(std::string(op) + ": s_t must be [C/128, R] float32");
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::Buffer<ffi::F32>> s_t) {
  if (auto err = check_rows("fp8 quantize rows", x, *q, *s_t); !err.success()) return err;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return launch_rows_any<Src::kRows>(stream, x.element_type(), x.untyped_data(), nullptr,
                                     nullptr, nullptr, 0, nullptr, q->untyped_data(),
                                     s_t->typed_data(), rows, cols);
}

ffi::Error SwigluFwdFp8Impl(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                            ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> act,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> s_t,
                            bool has_weight) {
  if (auto err = check_rows("swiglu fwd fp8", gate, *q, *s_t); !err.success()) return err;
  if (up.element_type() != gate.element_type() || up.element_count() != gate.element_count() ||
      act->element_type() != gate.element_type() ||
      act->element_count() != gate.element_count()) {
    return MOE_INVALID("swiglu fwd fp8: up and act must have gate's shape and dtype");
  }
  const int64_t rows = gate.dimensions()[0], cols = gate.dimensions()[1];
  if (has_weight && w.element_count() != static_cast<size_t>(rows)) {
    return MOE_INVALID("swiglu fwd fp8: weights must be [R=" + std::to_string(rows) + "]");
  }
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return launch_rows_any<Src::kSwiglu>(stream, gate.element_type(), gate.untyped_data(),
                                       up.untyped_data(), has_weight ? w.typed_data() : nullptr,
                                       nullptr, 0, act->untyped_data(), q->untyped_data(),
                                       s_t->typed_data(), rows, cols);
}

ffi::Error PermuteFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_map,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> q,
                          ffi::Result<ffi::Buffer<ffi::F32>> s_t) {
  if (auto err = check_rows("permute fp8", *y, *q, *s_t); !err.success()) return err;
  const int64_t rows = y->dimensions()[0], cols = y->dimensions()[1];
  if (x.dimensions().size() != 2 || x.dimensions()[1] != cols ||
      x.element_type() != y->element_type()) {
    return MOE_INVALID("permute fp8: x must be [T, M=" + std::to_string(cols) +
                       "] in y's dtype, got " + dims_text(x));
  }
  if (row_map.element_count() != static_cast<size_t>(rows)) {
    return MOE_INVALID("permute fp8: row_map must be [R=" + std::to_string(rows) + "]");
  }
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return launch_rows_any<Src::kPermute>(stream, x.element_type(), x.untyped_data(), nullptr,
                                        nullptr, row_map.typed_data(), x.dimensions()[0],
                                        y->untyped_data(), q->untyped_data(), s_t->typed_data(),
                                        rows, cols);
}

ffi::Error SwigluBwdFp8Impl(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                            ffi::Buffer<ffi::F32> w, ffi::AnyBuffer dout,
                            ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                            ffi::Result<ffi::AnyBuffer> qg, ffi::Result<ffi::Buffer<ffi::F32>> sg_t,
                            ffi::Result<ffi::AnyBuffer> qu, ffi::Result<ffi::Buffer<ffi::F32>> su_t,
                            ffi::Result<ffi::Buffer<ffi::F32>> dw_part, bool has_weight) {
  if (auto err = check_rows("swiglu bwd fp8", gate, *qg, *sg_t); !err.success()) return err;
  if (auto err = check_rows("swiglu bwd fp8", gate, *qu, *su_t); !err.success()) return err;
  const auto dt = gate.element_type();
  const size_t n = gate.element_count();
  for (const ffi::AnyBuffer* b : {&up, &dout, &*dgate, &*dup}) {
    if (b->element_type() != dt || b->element_count() != n) {
      return MOE_INVALID("swiglu bwd fp8: up, dout, dgate and dup must have gate's shape and "
                         "dtype " + dims_text(gate));
    }
  }
  const int64_t rows = gate.dimensions()[0], cols = gate.dimensions()[1];
  if (has_weight && (w.element_count() != static_cast<size_t>(rows) ||
                     dw_part->element_count() != n / kTile)) {
    return MOE_INVALID("swiglu bwd fp8: weights must be [R=" + std::to_string(rows) +
                       "] and dw_part [H/128, R]");
  }
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const float* wp = has_weight ? w.typed_data() : nullptr;
  float* dwp = has_weight ? dw_part->typed_data() : nullptr;
  if (dt == ffi::F32) {
    return launch_swiglu_bwd(stream, swiglu_bwd_args<float>(
        gate.untyped_data(), up.untyped_data(), wp, dout.untyped_data(), dgate->untyped_data(),
        dup->untyped_data(), qg->untyped_data(), sg_t->typed_data(), qu->untyped_data(),
        su_t->typed_data(), dwp, rows, cols));
  }
  return launch_swiglu_bwd(stream, swiglu_bwd_args<__nv_bfloat16>(
      gate.untyped_data(), up.untyped_data(), wp, dout.untyped_data(), dgate->untyped_data(),
      dup->untyped_data(), qg->untyped_data(), sg_t->typed_data(), qu->untyped_data(),
      su_t->typed_data(), dwp, rows, cols));
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeFp8QuantizeRows, moe::QuantizeRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [R, C]
                                  .Ret<xla::ffi::AnyBuffer>()              // q [R, C] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s_t [C/128, R]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeSwigluFwdFp8, moe::SwigluFwdFp8Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // up [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [R] or [1]
                                  .Ret<xla::ffi::AnyBuffer>()              // act [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // q [R, H] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // s_t [H/128, R]
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteFp8, moe::PermuteFp8Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [T, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [R]
                                  .Ret<xla::ffi::AnyBuffer>()              // y [R, M]
                                  .Ret<xla::ffi::AnyBuffer>()              // q [R, M] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s_t [M/128, R]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeSwigluBwdFp8, moe::SwigluBwdFp8Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // up [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [R] or [1]
                                  .Arg<xla::ffi::AnyBuffer>()              // dout [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dgate [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dup [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // qg [R, H] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // sg_t [H/128, R]
                                  .Ret<xla::ffi::AnyBuffer>()              // qu [R, H] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // su_t [H/128, R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dw_part [H/128, R] or [1]
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
