// The combine as one gather-and-sum (see moe_praxis/ops/combine.py), deterministic, no atomics:
//
//   forward:  y[t] = sum_{j < k} w[t, j] * out[pos[t, j]]     (f32 sums in increasing j, rounded
//             once; copies with pos outside [0, R) are skipped)
//   backward: d_out[r] = w[c] * dy[c / k]  with c = copy[r]   (zeros where c is outside [0, T*k))
//             dw[t, j] = <dy[t], out[pos[t, j]]>               (f32, one warp per copy, a fixed
//             shuffle-tree order; 0 where pos is outside [0, R))
//
// out: [R, M] f32 or bf16 (expert outputs, expert-sorted rows); y, dy: [T, M] in out's dtype or
// f32; pos: [T, k] int32 (row of each token copy); copy: [R] int32 (token copy of each row,
// t * k + j); w: [T, k] f32. Each thread handles one 16-byte vector of a row (or one element
// where M is not a multiple of the vector).
#include "moe_common.h"

namespace moe {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC>
using V = Vec<T, VEC>;

// This thread's place in a launch over n rows of nv vectors each: i = row * nv + vector.
struct RowVector {
  int64_t i, row, c;
  bool inside;  // false past the n * nv vectors
};
__device__ __forceinline__ RowVector row_vector(int64_t n, int64_t nv) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const int64_t row = i / nv;
  return {i, row, i - row * nv, i < n * nv};
}

template <typename TI, typename TO, int VEC>
__global__ void __launch_bounds__(kThreads)
    combine_fwd_kernel(const TI* __restrict__ out, const int32_t* __restrict__ pos,
                       const float* __restrict__ w, TO* __restrict__ y, int64_t tokens,
                       int64_t rows, int k, int64_t nv) {
  const auto [i, t, c, inside] = row_vector(tokens, nv);
  if (!inside) return;
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  for (int j = 0; j < k; ++j) {
    const int64_t r = __ldg(pos + t * k + j);
    if (r < 0 || r >= rows) continue;
    const float wj = __ldg(w + t * k + j);
    const V<TI, VEC> v = reinterpret_cast<const V<TI, VEC>*>(out)[r * nv + c];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += wj * to_f32(v.v[e]);
  }
  V<TO, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) o.v[e] = from_f32<TO>(acc[e]);
  reinterpret_cast<V<TO, VEC>*>(y)[i] = o;
}

template <typename TI, typename TO, int VEC>
__global__ void __launch_bounds__(kThreads)
    combine_dout_kernel(const TO* __restrict__ dy, const int32_t* __restrict__ copy,
                        const float* __restrict__ w, TI* __restrict__ dout, int64_t rows,
                        int64_t copies, int k, int64_t nv) {
  const auto [i, r, c, inside] = row_vector(rows, nv);
  if (!inside) return;
  const int64_t q = __ldg(copy + r);
  V<TI, VEC> o;
  if (q < 0 || q >= copies) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = from_f32<TI>(0.f);
  } else {
    const float wq = __ldg(w + q);
    const V<TO, VEC> g = reinterpret_cast<const V<TO, VEC>*>(dy)[(q / k) * nv + c];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = from_f32<TI>(wq * to_f32(g.v[e]));
  }
  reinterpret_cast<V<TI, VEC>*>(dout)[i] = o;
}

// One warp per token copy q = t * k + j: lanes stride over the row's vectors, then a shuffle
// tree (fixed order: deterministic).
template <typename TI, typename TO, int VEC>
__global__ void __launch_bounds__(kThreads)
    combine_dw_kernel(const TO* __restrict__ dy, const TI* __restrict__ out,
                      const int32_t* __restrict__ pos, float* __restrict__ dw, int64_t copies,
                      int64_t rows, int k, int64_t nv) {
  const int64_t q = (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (q >= copies) return;
  const int64_t r = __ldg(pos + q), t = q / k;
  float acc = 0.f;
  if (r >= 0 && r < rows) {
    const V<TO, VEC>* g = reinterpret_cast<const V<TO, VEC>*>(dy) + t * nv;
    const V<TI, VEC>* o = reinterpret_cast<const V<TI, VEC>*>(out) + r * nv;
    for (int64_t c = lane; c < nv; c += 32) {
      const V<TO, VEC> a = g[c];
      const V<TI, VEC> b = o[c];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc += to_f32(a.v[e]) * to_f32(b.v[e]);
    }
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) dw[q] = acc;
}

// The vector width both dtypes allow: 16 bytes of the narrower type's row where M divides.
template <typename TI, typename TO>
constexpr int kVecOf = 16 / (sizeof(TI) > sizeof(TO) ? sizeof(TI) : sizeof(TO));

template <typename TI, typename TO>
ffi::Error launch_fwd(cudaStream_t s, const void* out, const int32_t* pos, const float* w,
                      void* y, int64_t tokens, int64_t rows, int k, int64_t m) {
  constexpr int kV = kVecOf<TI, TO>;
  const bool vec = m % kV == 0;
  const int64_t nv = vec ? m / kV : m;
  const auto grid = static_cast<unsigned>(ceil_div(tokens * nv, kThreads));
  if (vec) {
    combine_fwd_kernel<TI, TO, kV><<<grid, kThreads, 0, s>>>(
        static_cast<const TI*>(out), pos, w, static_cast<TO*>(y), tokens, rows, k, nv);
  } else {
    combine_fwd_kernel<TI, TO, 1><<<grid, kThreads, 0, s>>>(
        static_cast<const TI*>(out), pos, w, static_cast<TO*>(y), tokens, rows, k, nv);
  }
  MOE_LAUNCH_CHECK("combine fwd");
  return ffi::Error::Success();
}

template <typename TI, typename TO>
ffi::Error launch_bwd(cudaStream_t s, const void* dy, const void* out, const int32_t* pos,
                      const int32_t* copy, const float* w, void* dout, float* dw, int64_t tokens,
                      int64_t rows, int k, int64_t m) {
  constexpr int kV = kVecOf<TI, TO>;
  const bool vec = m % kV == 0;
  const int64_t nv = vec ? m / kV : m;
  const int64_t copies = tokens * k;
  const auto g1 = static_cast<unsigned>(ceil_div(rows * nv, kThreads));
  const auto g2 = static_cast<unsigned>(ceil_div(copies * 32, kThreads));
  const TO* dyp = static_cast<const TO*>(dy);
  const TI* op = static_cast<const TI*>(out);
  TI* dp = static_cast<TI*>(dout);
  if (vec) {
    if (rows > 0) combine_dout_kernel<TI, TO, kV><<<g1, kThreads, 0, s>>>(dyp, copy, w, dp, rows,
                                                                           copies, k, nv);
    MOE_LAUNCH_CHECK("combine bwd d_out");
    if (copies > 0) combine_dw_kernel<TI, TO, kV><<<g2, kThreads, 0, s>>>(dyp, op, pos, dw,
                                                                          copies, rows, k, nv);
  } else {
    if (rows > 0) combine_dout_kernel<TI, TO, 1><<<g1, kThreads, 0, s>>>(dyp, copy, w, dp, rows,
                                                                          copies, k, nv);
    MOE_LAUNCH_CHECK("combine bwd d_out");
    if (copies > 0) combine_dw_kernel<TI, TO, 1><<<g2, kThreads, 0, s>>>(dyp, op, pos, dw,
                                                                         copies, rows, k, nv);
  }
  MOE_LAUNCH_CHECK("combine bwd dw");
  return ffi::Error::Success();
}

// Dispatch on (out dtype, y dtype): (bf16, bf16), (bf16, f32), (f32, f32).
template <typename F>
ffi::Error by_types(ffi::DataType ti, ffi::DataType to, const char* what, F&& f) {
  if (ti == ffi::BF16 && to == ffi::BF16) return f(__nv_bfloat16{}, __nv_bfloat16{});
  if (ti == ffi::BF16 && to == ffi::F32) return f(__nv_bfloat16{}, float{});
  if (ti == ffi::F32 && to == ffi::F32) return f(float{}, float{});
  return MOE_INVALID(std::string(what) +
                     ": (out, y) dtypes must be (bf16, bf16), (bf16, f32) or (f32, f32)");
}

ffi::Error check_index(const char* what, ffi::AnyBuffer out, ffi::Buffer<ffi::S32> pos,
                       ffi::Buffer<ffi::F32> w, int64_t tokens, int64_t m) {
  if (out.dimensions().size() != 2 || out.dimensions()[1] != m) {
    return MOE_INVALID(std::string(what) + ": out must be [R, M=" + std::to_string(m) + "]");
  }
  if (pos.dimensions().size() != 2 || pos.dimensions()[0] != tokens ||
      w.dimensions().size() != 2 || w.dimensions()[0] != tokens ||
      w.dimensions()[1] != pos.dimensions()[1]) {
    return MOE_INVALID(std::string(what) + ": pos and w must both be [T=" +
                       std::to_string(tokens) + ", k]");
  }
  return ffi::Error::Success();
}

ffi::Error CombineFwdImpl(cudaStream_t stream, ffi::AnyBuffer out, ffi::Buffer<ffi::S32> pos,
                          ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> y) {
  if (y->dimensions().size() != 2) return MOE_INVALID("combine: y must be [T, M]");
  const int64_t tokens = y->dimensions()[0], m = y->dimensions()[1];
  if (auto err = check_index("combine", out, pos, w, tokens, m); !err.success()) return err;
  const int64_t rows = out.dimensions()[0];
  const int k = static_cast<int>(pos.dimensions()[1]);
  if (tokens == 0 || m == 0) return ffi::Error::Success();
  return by_types(out.element_type(), y->element_type(), "combine", [&](auto ti, auto to) {
    return launch_fwd<decltype(ti), decltype(to)>(stream, out.untyped_data(), pos.typed_data(),
                                                  w.typed_data(), y->untyped_data(), tokens,
                                                  rows, k, m);
  });
}

ffi::Error CombineBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer out,
                          ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> copy,
                          ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> dout,
                          ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  if (dy.dimensions().size() != 2) return MOE_INVALID("combine bwd: dy must be [T, M]");
  const int64_t tokens = dy.dimensions()[0], m = dy.dimensions()[1];
  if (auto err = check_index("combine bwd", out, pos, w, tokens, m); !err.success()) return err;
  const int64_t rows = out.dimensions()[0];
  const int k = static_cast<int>(pos.dimensions()[1]);
  if (static_cast<int64_t>(copy.element_count()) != rows) {
    return MOE_INVALID("combine bwd: copy must be [R=" + std::to_string(rows) + "]");
  }
  if (dout->element_count() != out.element_count() || dout->element_type() != out.element_type() ||
      static_cast<int64_t>(dw->element_count()) != tokens * k) {
    return MOE_INVALID("combine bwd: d_out must be [R, M] in out's dtype, dw [T, k] f32");
  }
  if (m == 0) {
    if (tokens * k > 0) MOE_CUDA_CHECK(cudaMemsetAsync(dw->typed_data(), 0, tokens * k * 4, stream));
    return ffi::Error::Success();
  }
  return by_types(out.element_type(), dy.element_type(), "combine bwd", [&](auto ti, auto to) {
    return launch_bwd<decltype(ti), decltype(to)>(
        stream, dy.untyped_data(), out.untyped_data(), pos.typed_data(), copy.typed_data(),
        w.typed_data(), dout->untyped_data(), dw->typed_data(), tokens, rows, k, m);
  });
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeCombineFwd, moe::CombineFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // out [R, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pos [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [T, k]
                                  .Ret<xla::ffi::AnyBuffer>(),             // y [T, M]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeCombineBwd, moe::CombineBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // dy [T, M]
                                  .Arg<xla::ffi::AnyBuffer>()              // out [R, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // pos [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // copy [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [T, k]
                                  .Ret<xla::ffi::AnyBuffer>()              // d_out [R, M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // dw [T, k]
                              {xla::ffi::Traits::kCmdBufferCompatible});
