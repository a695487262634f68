// SwiGLU forward and backward, f32 and bf16, with the optional per-row routing weight fused:
//
//   out[r, h] = silu(gate[r, h]) * up[r, h] * w[r]                (w = 1 without weights)
//   dgate = dout * w * up * silu'(gate),  dup = dout * w * silu(gate),
//   dw[r] = sum_h dout[r, h] * silu(gate[r, h]) * up[r, h]
//
// Math in f32, outputs rounded once to the input dtype (as the reference). Flat elementwise
// passes (the backward with weights: one block per row, for the row sums of dw); 16-byte vector
// accesses in the forward and 8-byte ones in the backward when H is a multiple of the vector
// width.
#include <algorithm>

#include "moe_common.h"
#include "swiglu_math.cuh"

namespace moe {
namespace {

// Stores a vector of d gate and d up: to dg[i] and du[i], or (interleaved output, dgu !=
// nullptr: the fused gate/up path's [R, 2H] gradient, column 2j = gate unit j, 2j + 1 = up unit
// j) to vectors 2i and 2i + 1 of dgu.
template <typename T, int VEC>
__device__ __forceinline__ void put_grads(Vec<T, VEC>* dg, Vec<T, VEC>* du, Vec<T, VEC>* dgu,
                                          int64_t i, const Vec<T, VEC>& a, const Vec<T, VEC>& b) {
  if (dgu == nullptr) {
    dg[i] = a;
    du[i] = b;
    return;
  }
  Vec<T, VEC> pair[2];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    pair[(2 * j) / VEC].v[(2 * j) % VEC] = a.v[j];
    pair[(2 * j + 1) / VEC].v[(2 * j + 1) % VEC] = b.v[j];
  }
  dgu[2 * i] = pair[0];
  dgu[2 * i + 1] = pair[1];
}

constexpr int kFlatThreads = 256;
constexpr int kUnroll = 4;
// The unweighted backward: one 8-byte vector per thread (XLA's loop-fusion access width):
// measured faster than one or four 16-byte vectors per thread on the H200
// (benchmarks/swiglu_bwd_variants.cu; benchmarks/results/kernels_history.md, "swiglu.cu:
// kBwdVecBytes, kBwdUnroll").
constexpr int kBwdUnroll = 1;
constexpr int kBwdVecBytes = 8;

// Elementwise forward over R * H / VEC vectors, kUnroll independent vectors per thread (loads
// first, then math and stores) for memory-level parallelism. The routing weight of vector i is
// w[i / vec_per_row] (VEC divides H, so a vector never straddles two rows).
template <typename T, int VEC>
__global__ void __launch_bounds__(kFlatThreads)
    swiglu_fwd_flat(const T* __restrict__ gate, const T* __restrict__ up,
                    const float* __restrict__ w, T* __restrict__ out, int64_t nvec,
                    int64_t vec_per_row) {
  const auto* g = reinterpret_cast<const Vec<T, VEC>*>(gate);
  const auto* u = reinterpret_cast<const Vec<T, VEC>*>(up);
  auto* o = reinterpret_cast<Vec<T, VEC>*>(out);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kFlatThreads * kUnroll + threadIdx.x;
  Vec<T, VEC> gv[kUnroll], uv[kUnroll];
#pragma unroll
  for (int q = 0; q < kUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < nvec) {
      gv[q] = g[i];
      uv[q] = u[i];
    }
  }
#pragma unroll
  for (int q = 0; q < kUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < nvec) {
      const float wr = w ? w[i / vec_per_row] : 1.f;
      Vec<T, VEC> ov;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float x = to_f32(gv[q].v[j]);
        ov.v[j] = from_f32<T>(swiglu_act<T>(x, to_f32(uv[q].v[j]), wr));
      }
      o[i] = ov;
    }
  }
}

// Elementwise backward without routing weights (no row reduction needed), kBwdUnroll vectors
// per thread.
template <typename T, int VEC>
__global__ void __launch_bounds__(kFlatThreads)
    swiglu_bwd_flat(const T* __restrict__ gate, const T* __restrict__ up,
                    const T* __restrict__ dout, T* __restrict__ dgate, T* __restrict__ dup,
                    T* __restrict__ dgup, int64_t nvec) {
  const auto* g = reinterpret_cast<const Vec<T, VEC>*>(gate);
  const auto* u = reinterpret_cast<const Vec<T, VEC>*>(up);
  const auto* d = reinterpret_cast<const Vec<T, VEC>*>(dout);
  auto* dg = reinterpret_cast<Vec<T, VEC>*>(dgate);
  auto* du = reinterpret_cast<Vec<T, VEC>*>(dup);
  auto* dgu = reinterpret_cast<Vec<T, VEC>*>(dgup);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kFlatThreads * kBwdUnroll + threadIdx.x;
  Vec<T, VEC> gv[kBwdUnroll], uv[kBwdUnroll], dv[kBwdUnroll];
#pragma unroll
  for (int q = 0; q < kBwdUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < nvec) {
      gv[q] = g[i];
      uv[q] = u[i];
      dv[q] = d[i];
    }
  }
#pragma unroll
  for (int q = 0; q < kBwdUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < nvec) {
      Vec<T, VEC> dgv, duv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float x = to_f32(gv[q].v[j]), y = to_f32(uv[q].v[j]), dy = to_f32(dv[q].v[j]);
        const float sg = sigmoid_t<T>(x);
        dgv.v[j] = from_f32<T>(dy * y * (sg * (1.f + x * (1.f - sg))));
        duv.v[j] = from_f32<T>(dy * (x * sg));
      }
      put_grads(dg, du, dgu, i, dgv, duv);
    }
  }
}

// Backward with routing weights: one block of THREADS threads per row, one vector per thread at
// a time, then a block reduction of the row's dw. On the H200 (benchmarks/swiglu_bwd_variants.cu)
// one 8-byte vector per thread with 512 threads per row measured faster than the kernel before
// (one warp per row with several 16-byte vectors per lane in flight). It needs full occupancy
// (32 registers at 512 threads), measured in JAX: a grid-stride loop over rows with the output
// layout chosen at run time (more registers) and one block per row with the layout a template
// parameter (more than 32 registers) were much slower than the same held to 32 registers by the
// launch bound below (a few spilled bytes), which is on par with XLA's fusion
// (benchmarks/results/kernels_history.md, "swiglu.cu: swiglu_bwd_kernel"). Rows <= INT32_MAX
// (checked).
template <typename T, int VEC, int THREADS, bool INTERLEAVED>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS)
    swiglu_bwd_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                      const float* __restrict__ w, const T* __restrict__ dout,
                      T* __restrict__ dgate, T* __restrict__ dup, T* __restrict__ dgup,
                      float* __restrict__ dw, int64_t h) {
  __shared__ float warp_sums[THREADS / 32];
  const int64_t r = blockIdx.x;
  const int nv = static_cast<int>(h / VEC);
  const int64_t base = r * nv;  // the row's first vector (indexing from the parameters keeps
                                // the row's pointers out of registers)
  const float wr = w[r];
  const auto* g = reinterpret_cast<const Vec<T, VEC>*>(gate);
  const auto* u = reinterpret_cast<const Vec<T, VEC>*>(up);
  const auto* d = reinterpret_cast<const Vec<T, VEC>*>(dout);
  auto* dg = INTERLEAVED ? nullptr : reinterpret_cast<Vec<T, VEC>*>(dgate);
  auto* du = INTERLEAVED ? nullptr : reinterpret_cast<Vec<T, VEC>*>(dup);
  auto* dgu = INTERLEAVED ? reinterpret_cast<Vec<T, VEC>*>(dgup) : nullptr;
  float acc = 0.f;
  for (int i = threadIdx.x; i < nv; i += THREADS) {
    const Vec<T, VEC> gv = g[base + i], uv = u[base + i], dv = d[base + i];
    Vec<T, VEC> dgv, duv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_f32(gv.v[j]), y = to_f32(uv.v[j]), dy = to_f32(dv.v[j]);
      const float s = sigmoid_t<T>(x), silu = x * s;
      acc += dy * silu * y;
      const float dyw = dy * wr;
      dgv.v[j] = from_f32<T>(dyw * y * (s * (1.f + x * (1.f - s))));
      duv.v[j] = from_f32<T>(dyw * silu);
    }
    put_grads(dg, du, dgu, base + i, dgv, duv);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < THREADS / 32 ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) dw[r] = acc;
  }
}

template <typename T, int VEC, int THREADS>
void launch_bwd_rows_t(cudaStream_t stream, const T* g, const T* u, const float* w, const T* d,
                       T* dg, T* du, T* dgu, float* dw, int64_t rows, int64_t h) {
  const auto grid = static_cast<unsigned>(rows);
  if (dgu != nullptr) {
    swiglu_bwd_kernel<T, VEC, THREADS, true>
        <<<grid, THREADS, 0, stream>>>(g, u, w, d, dg, du, dgu, dw, h);
  } else {
    swiglu_bwd_kernel<T, VEC, THREADS, false>
        <<<grid, THREADS, 0, stream>>>(g, u, w, d, dg, du, dgu, dw, h);
  }
}

// Launches swiglu_bwd_kernel<T, VEC, THREADS, ...> with the fewest threads (128, 256 or 512) that
// cover a row's vectors in one pass (512 for longer rows, which loop).
template <typename T, int VEC>
void launch_bwd_rows(cudaStream_t stream, const T* g, const T* u, const float* w, const T* d,
                     T* dg, T* du, T* dgu, float* dw, int64_t rows, int64_t h) {
  const int64_t nv = h / VEC;
  if (nv <= 128) {
    launch_bwd_rows_t<T, VEC, 128>(stream, g, u, w, d, dg, du, dgu, dw, rows, h);
  } else if (nv <= 256) {
    launch_bwd_rows_t<T, VEC, 256>(stream, g, u, w, d, dg, du, dgu, dw, rows, h);
  } else {
    launch_bwd_rows_t<T, VEC, 512>(stream, g, u, w, d, dg, du, dgu, dw, rows, h);
  }
}

template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const void* g, const void* u, const float* w,
                      void* o, int64_t rows, int64_t h) {
  constexpr int kVec = 16 / sizeof(T);
  const int vec = h % kVec == 0 ? kVec : 1;
  const int64_t nvec = rows * h / vec;
  const auto grid = static_cast<unsigned>(ceil_div(nvec, kFlatThreads * kUnroll));
  if (vec == kVec) {
    swiglu_fwd_flat<T, kVec><<<grid, kFlatThreads, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(u), w, static_cast<T*>(o), nvec,
        h / kVec);
  } else {
    swiglu_fwd_flat<T, 1><<<grid, kFlatThreads, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(u), w, static_cast<T*>(o), nvec, h);
  }
  MOE_LAUNCH_CHECK("swiglu_fwd");
  return ffi::Error::Success();
}

template <typename T>
ffi::Error launch_bwd(cudaStream_t stream, const void* g, const void* u, const float* w,
                      const void* d, void* dg, void* du, void* dgu, float* dw, int64_t rows,
                      int64_t h) {
  if (dw == nullptr) {  // no routing weight: a flat elementwise pass
    constexpr int kFlatVec = kBwdVecBytes / sizeof(T);
    const int vec = h % kFlatVec == 0 ? kFlatVec : 1;
    const int64_t nvec = rows * h / vec;
    const auto fgrid = static_cast<unsigned>(ceil_div(nvec, kFlatThreads * kBwdUnroll));
    if (vec == kFlatVec) {
      swiglu_bwd_flat<T, kFlatVec><<<fgrid, kFlatThreads, 0, stream>>>(
          static_cast<const T*>(g), static_cast<const T*>(u), static_cast<const T*>(d),
          static_cast<T*>(dg), static_cast<T*>(du), static_cast<T*>(dgu), nvec);
    } else {
      swiglu_bwd_flat<T, 1><<<fgrid, kFlatThreads, 0, stream>>>(
          static_cast<const T*>(g), static_cast<const T*>(u), static_cast<const T*>(d),
          static_cast<T*>(dg), static_cast<T*>(du), static_cast<T*>(dgu), nvec);
    }
    MOE_LAUNCH_CHECK("swiglu_bwd");
    return ffi::Error::Success();
  }
  // one block per row; a row's vectors are counted in int
  if (rows > INT32_MAX || h > INT32_MAX) {
    return MOE_INVALID("swiglu bwd with weights: rows=" + std::to_string(rows) + ", H=" +
                       std::to_string(h) + "; both must be at most " + std::to_string(INT32_MAX));
  }
  constexpr int kRowVec = kBwdVecBytes / sizeof(T);
  if (h % kRowVec == 0) {
    launch_bwd_rows<T, kRowVec>(stream, static_cast<const T*>(g), static_cast<const T*>(u), w,
                                static_cast<const T*>(d), static_cast<T*>(dg),
                                static_cast<T*>(du), static_cast<T*>(dgu), dw, rows, h);
  } else {
    launch_bwd_rows<T, 1>(stream, static_cast<const T*>(g), static_cast<const T*>(u), w,
                          static_cast<const T*>(d), static_cast<T*>(dg), static_cast<T*>(du),
                          static_cast<T*>(dgu), dw, rows, h);
  }
  MOE_LAUNCH_CHECK("swiglu_bwd");
  return ffi::Error::Success();
}

ffi::Error check(const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up,
                 const ffi::Buffer<ffi::F32>& w, bool has_weight) {
  if (gate.dimensions().size() != 2) return MOE_INVALID("swiglu: gate must be [R, H]");
  if (up.element_type() != gate.element_type() || up.element_count() != gate.element_count()) {
    return MOE_INVALID("swiglu: up must have gate's shape and dtype");
  }
  if (has_weight && w.element_count() != static_cast<size_t>(gate.dimensions()[0])) {
    return MOE_INVALID("swiglu: weights must be [R=" + std::to_string(gate.dimensions()[0]) + "]");
  }
  if (gate.element_type() != ffi::F32 && gate.element_type() != ffi::BF16) {
    return MOE_INVALID("swiglu: gate must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

ffi::Error SwigluFwdImpl(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                         ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> out,
                         bool has_weight) {
  if (auto err = check(gate, up, w, has_weight); !err.success()) return err;
  const int64_t rows = gate.dimensions()[0], h = gate.dimensions()[1];
  if (rows == 0 || h == 0) return ffi::Error::Success();
  const float* wp = has_weight ? w.typed_data() : nullptr;
  if (gate.element_type() == ffi::F32) {
    return launch_fwd<float>(stream, gate.untyped_data(), up.untyped_data(), wp,
                             out->untyped_data(), rows, h);
  }
  return launch_fwd<__nv_bfloat16>(stream, gate.untyped_data(), up.untyped_data(), wp,
                                   out->untyped_data(), rows, h);
}

// dgu == nullptr: d gate and d up to dgate, dup; else interleaved to dgu [R, 2H].
ffi::Error swiglu_bwd(cudaStream_t stream, const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up,
                      const ffi::Buffer<ffi::F32>& w, const ffi::AnyBuffer& dout, void* dgate,
                      void* dup, void* dgu, ffi::Result<ffi::Buffer<ffi::F32>>& dw,
                      bool has_weight) {
  if (auto err = check(gate, up, w, has_weight); !err.success()) return err;
  if (dout.element_type() != gate.element_type() ||
      dout.element_count() != gate.element_count()) {
    return MOE_INVALID("swiglu bwd: dout must have gate's shape and dtype");
  }
  const int64_t rows = gate.dimensions()[0], h = gate.dimensions()[1];
  if (has_weight && dw->element_count() != static_cast<size_t>(rows)) {
    return MOE_INVALID("swiglu bwd: dweights must be [R]");
  }
  if (rows == 0) return ffi::Error::Success();
  if (h == 0) {
    if (has_weight) MOE_CUDA_CHECK(cudaMemsetAsync(dw->typed_data(), 0, rows * 4, stream));
    return ffi::Error::Success();
  }
  const float* wp = has_weight ? w.typed_data() : nullptr;
  float* dwp = has_weight ? dw->typed_data() : nullptr;
  if (gate.element_type() == ffi::F32) {
    return launch_bwd<float>(stream, gate.untyped_data(), up.untyped_data(), wp,
                             dout.untyped_data(), dgate, dup, dgu, dwp, rows, h);
  }
  return launch_bwd<__nv_bfloat16>(stream, gate.untyped_data(), up.untyped_data(), wp,
                                   dout.untyped_data(), dgate, dup, dgu, dwp, rows, h);
}

ffi::Error SwigluBwdImpl(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                         ffi::Buffer<ffi::F32> w, ffi::AnyBuffer dout,
                         ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                         ffi::Result<ffi::Buffer<ffi::F32>> dw, bool has_weight) {
  return swiglu_bwd(stream, gate, up, w, dout, dgate->untyped_data(), dup->untyped_data(),
                    nullptr, dw, has_weight);
}

ffi::Error SwigluBwdInterleavedImpl(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                                    ffi::Buffer<ffi::F32> w, ffi::AnyBuffer dout,
                                    ffi::Result<ffi::AnyBuffer> dgu,
                                    ffi::Result<ffi::Buffer<ffi::F32>> dw, bool has_weight) {
  if (dgu->element_type() != gate.element_type() ||
      dgu->element_count() != 2 * gate.element_count()) {
    return MOE_INVALID("swiglu bwd interleaved: dgate_up must be [R, 2H] in gate's dtype");
  }
  return swiglu_bwd(stream, gate, up, w, dout, nullptr, nullptr, dgu->untyped_data(), dw,
                    has_weight);
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeSwigluFwd, moe::SwigluFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // up [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [R] or [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // out [R, H]
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeSwigluBwd, moe::SwigluBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // up [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [R] or [0]
                                  .Arg<xla::ffi::AnyBuffer>()              // dout [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dgate [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dup [R, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dw [R] or [0]
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeSwigluBwdInterleaved, moe::SwigluBwdInterleavedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // gate [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()              // up [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // w [R] or [1]
                                  .Arg<xla::ffi::AnyBuffer>()              // dout [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()              // dgate_up [R, 2H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dw [R] or [1]
                                  .Attr<bool>("has_weight"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
