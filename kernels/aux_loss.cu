// Switch load-balancing loss, forward and backward (see moe_praxis/ops/aux_loss.py).
//
//   L = coeff * E / (k * T^2) * sum_{t,e} p[t, e] * f[e]          (forward, one pass over p,
//                                                                   then one block: no atomics)
//   dL/dp[t, e] = g * coeff * E / (k * T^2) * f[e]                (backward, write-only)
//
// p: [T, E] f32 or bf16; f: [E] f32 or int32 (counts are read as they are: no convert kernel
// before the call); scale: rank-0 f32 buffer holding coeff * E / (k * T^2)
// (computed in JAX: T is traced and may be a global count); g: the rank-0 f32 cotangent buffer
// (never reshaped to [1]).
#include "moe_common.h"

namespace moe {
namespace {

// Forward, pass 1: block b writes its partial sum of p * f to partials[b] (no atomics, no
// memset); pass 2 (one block) adds the partials in a fixed order and scales: the loss is
// bitwise reproducible from call to call.
constexpr int kFwdThreads = 512;
constexpr int kMaxPartials = 512;  // the workspace output's length (AUX_PARTIALS, ops/aux_loss.py)
constexpr int kBwdThreads = 256;

// The column of element `idx` (a 32-bit modulo when the index fits;
// a 64-bit one is far slower).
__device__ __forceinline__ int column_of(int64_t idx, int e) {
  if (idx <= 0x7fffffff) {
    return static_cast<int>(static_cast<uint32_t>(idx) % static_cast<uint32_t>(e));
  }
  return static_cast<int>(idx % e);
}

template <int THREADS>
__device__ __forceinline__ float block_sum(float acc) {
  __shared__ float warp_sums[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  acc = 0.f;
  if (threadIdx.x < 32) {
    acc = threadIdx.x < (THREADS / 32) ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  }
  return acc;  // valid in thread 0
}

template <typename T, typename F, int VEC>
__global__ void __launch_bounds__(kFwdThreads)
    aux_loss_partials_kernel(const T* __restrict__ p, const F* __restrict__ f,
                             float* __restrict__ partials, int64_t n, int e) {
  using V = Vec<T, VEC>;
  float acc = 0.f;
  const int64_t nvec = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFwdThreads;
  // the column of a vector's first element, advanced by the stride mod E (no 64-bit modulo in
  // the loop)
  const int step = column_of(stride * VEC, e);
  int64_t i = blockIdx.x * static_cast<int64_t>(kFwdThreads) + threadIdx.x;
  int col0 = column_of(i * VEC, e);
  for (; i < nvec; i += stride) {
    V v = reinterpret_cast<const V*>(p)[i];
    int col = col0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc += to_f32(v.v[j]) * static_cast<float>(__ldg(f + col));
      col = (col + 1 == e) ? 0 : col + 1;
    }
    col0 += step;
    if (col0 >= e) col0 -= e;
  }
  // tail (n % VEC elements), handled by block 0
  if (blockIdx.x == 0) {
    for (int64_t t = nvec * VEC + threadIdx.x; t < n; t += kFwdThreads) {
      acc += to_f32(p[t]) * static_cast<float>(f[t % e]);
    }
  }
  acc = block_sum<kFwdThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kFwdThreads)
    aux_loss_finish_kernel(const float* __restrict__ partials, int num,
                           const float* __restrict__ scale, float* __restrict__ out) {
  float acc = threadIdx.x < num ? partials[threadIdx.x] : 0.f;
  acc = block_sum<kFwdThreads>(acc);
  if (threadIdx.x == 0) out[0] = acc * scale[0];
}

// Backward when E is a power of two (every E in practice): one thread per 16-byte vector, no
// loop, the column a mask. On the H200 this matched XLA's broadcast fusion, where the same
// kernel with a 32-bit modulo by the run-time E (the first thing each thread does) and the
// general kernel below were slower; 128 or 512 threads, or two vectors per thread, were no
// faster, and CUTLASS's FastDivmod in place of the modulo was slower again
// (benchmarks/results/kernels_history.md, "aux_loss.cu: aux_loss_bwd_pow2_kernel").
template <typename T, typename F, int VEC>
__global__ void __launch_bounds__(kBwdThreads)
    aux_loss_bwd_pow2_kernel(const float* __restrict__ g, const F* __restrict__ f,
                             const float* __restrict__ scale, T* __restrict__ dp, int nvec,
                             int e) {  // E % VEC == 0, so T * E has no tail
  using V = Vec<T, VEC>;
  const float s = g[0] * scale[0];
  const int i = blockIdx.x * kBwdThreads + threadIdx.x;
  if (i < nvec) {
    const Vec<F, VEC> fv = *reinterpret_cast<const Vec<F, VEC>*>(f + ((i * VEC) & (e - 1)));
    V v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) v.v[j] = from_f32<T>(s * static_cast<float>(fv.v[j]));
    reinterpret_cast<V*>(dp)[i] = v;
  }
}

// Backward (write-only): one thread per 16-byte vector (grid-stride beyond 2112 blocks).
// (A fixed grid of 512-thread blocks looping over the vectors measured slower on the H200:
// benchmarks/results/kernels_history.md, "aux_loss.cu: aux_loss_bwd_kernel launch shape".)
template <typename T, typename F, int VEC>
__global__ void __launch_bounds__(kBwdThreads)
    aux_loss_bwd_kernel(const float* __restrict__ g, const F* __restrict__ f,
                        const float* __restrict__ scale, T* __restrict__ dp, int64_t n, int e) {
  using V = Vec<T, VEC>;
  const float s = g[0] * scale[0];
  const int64_t nvec = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBwdThreads;
  const bool whole = e % VEC == 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kBwdThreads) + threadIdx.x; i < nvec;
       i += stride) {
    V v;
    int col = column_of(i * VEC, e);
    if (whole) {  // the vector's VEC columns are contiguous in f: one vector load
      const Vec<F, VEC> fv = *reinterpret_cast<const Vec<F, VEC>*>(f + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v.v[j] = from_f32<T>(s * static_cast<float>(fv.v[j]));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v.v[j] = from_f32<T>(s * static_cast<float>(__ldg(f + col)));
        col = (col + 1 == e) ? 0 : col + 1;
      }
    }
    reinterpret_cast<V*>(dp)[i] = v;
  }
  if (blockIdx.x == 0) {
    for (int64_t t = nvec * VEC + threadIdx.x; t < n; t += kBwdThreads) {
      dp[t] = from_f32<T>(s * static_cast<float>(f[column_of(t, e)]));
    }
  }
}

ffi::Error check_common(const ffi::AnyBuffer& probs, const ffi::AnyBuffer& tpe,
                        const ffi::Buffer<ffi::F32>& scale) {
  if (probs.dimensions().size() != 2) return MOE_INVALID("aux loss: probs must be [T, E]");
  if (tpe.element_count() != static_cast<size_t>(cols_of(probs))) {
    return MOE_INVALID("aux loss: tokens_per_expert must have E=" +
                       std::to_string(cols_of(probs)) + " elements");
  }
  if (tpe.element_type() != ffi::F32 && tpe.element_type() != ffi::S32) {
    return MOE_INVALID("aux loss: tokens_per_expert must be float32 or int32");
  }
  if (scale.dimensions().size() != 0) return MOE_INVALID("aux loss: scale must be rank 0");
  return ffi::Error::Success();
}

// Launches KERNEL<T, F, VEC> for probs dtype T (f32: VEC 4, bf16: VEC 8) and counts dtype F.
template <template <typename, typename, int> class Launch, typename... Args>
ffi::Error dispatch(const ffi::AnyBuffer& probs, const ffi::AnyBuffer& tpe, Args&&... args) {
  const bool f32_counts = tpe.element_type() == ffi::F32;
  switch (probs.element_type()) {
    case ffi::F32:
      return f32_counts ? Launch<float, float, 4>::run(probs, tpe, args...)
                        : Launch<float, int32_t, 4>::run(probs, tpe, args...);
    case ffi::BF16:
      return f32_counts ? Launch<__nv_bfloat16, float, 8>::run(probs, tpe, args...)
                        : Launch<__nv_bfloat16, int32_t, 8>::run(probs, tpe, args...);
    default:
      return MOE_INVALID("aux loss: probs must be float32 or bfloat16");
  }
}

template <typename T, typename F, int VEC>
struct LaunchFwd {
  static ffi::Error run(const ffi::AnyBuffer& probs, const ffi::AnyBuffer& tpe,
                        cudaStream_t stream, const float* scale, float* out, float* partials,
                        int64_t n, int e) {
    // 2 blocks of 512 threads per SM on a 132-SM H200: one wave, every SM streaming
    const int grid = grid_for(n / VEC + 1, kFwdThreads, 264);
    aux_loss_partials_kernel<T, F, VEC><<<grid, kFwdThreads, 0, stream>>>(
        reinterpret_cast<const T*>(probs.untyped_data()),
        reinterpret_cast<const F*>(tpe.untyped_data()), partials, n, e);
    MOE_LAUNCH_CHECK("aux_loss_partials");
    aux_loss_finish_kernel<<<1, kFwdThreads, 0, stream>>>(partials, grid, scale, out);
    MOE_LAUNCH_CHECK("aux_loss_finish");
    return ffi::Error::Success();
  }
};

template <typename T, typename F, int VEC>
struct LaunchBwd {
  static ffi::Error run(const ffi::AnyBuffer& probs, const ffi::AnyBuffer& tpe,
                        cudaStream_t stream, const float* g, const float* scale, void* dp,
                        int64_t n, int e) {
    const int64_t nvec = n / VEC;
    if ((e & (e - 1)) == 0 && e % VEC == 0 && nvec * VEC < (int64_t{1} << 31)) {
      const int grid = static_cast<int>((nvec + kBwdThreads - 1) / kBwdThreads) + (nvec == 0);
      aux_loss_bwd_pow2_kernel<T, F, VEC><<<grid, kBwdThreads, 0, stream>>>(
          g, reinterpret_cast<const F*>(tpe.untyped_data()), scale, reinterpret_cast<T*>(dp),
          static_cast<int>(nvec), e);
      MOE_LAUNCH_CHECK("aux_loss_bwd");
      return ffi::Error::Success();
    }
    aux_loss_bwd_kernel<T, F, VEC><<<grid_for(n / VEC + 1, kBwdThreads), kBwdThreads, 0,
                                     stream>>>(
        g, reinterpret_cast<const F*>(tpe.untyped_data()), scale, reinterpret_cast<T*>(dp), n,
        e);
    MOE_LAUNCH_CHECK("aux_loss_bwd");
    return ffi::Error::Success();
  }
};

ffi::Error AuxLossFwdImpl(cudaStream_t stream, ffi::AnyBuffer probs, ffi::AnyBuffer tpe,
                          ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> partials) {
  if (auto err = check_common(probs, tpe, scale); !err.success()) return err;
  if (partials->element_count() != static_cast<size_t>(kMaxPartials)) {
    return MOE_INVALID("aux loss: the workspace must have " + std::to_string(kMaxPartials) +
                       " float32 elements, got " + std::to_string(partials->element_count()));
  }
  const int64_t n = probs.element_count();
  const int e = static_cast<int>(cols_of(probs));
  if (n == 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(out->typed_data(), 0, sizeof(float), stream));
    return ffi::Error::Success();
  }
  static_assert(264 <= kMaxPartials && kMaxPartials <= kFwdThreads, "partials fit one block");
  return dispatch<LaunchFwd>(probs, tpe, stream, scale.typed_data(), out->typed_data(),
                             partials->typed_data(), n, e);
}

ffi::Error AuxLossBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> g, ffi::AnyBuffer probs,
                          ffi::AnyBuffer tpe, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> dp) {
  if (g.dimensions().size() != 0) {
    return MOE_INVALID("aux loss bwd: the cotangent must be rank 0, got rank " +
                       std::to_string(g.dimensions().size()));
  }
  if (auto err = check_common(probs, tpe, scale); !err.success()) return err;
  const int64_t n = probs.element_count();
  const int e = static_cast<int>(cols_of(probs));
  if (dp->element_type() != probs.element_type()) {
    return MOE_INVALID("aux loss bwd: dprobs must have the dtype of probs");
  }
  if (n == 0) return ffi::Error::Success();
  return dispatch<LaunchBwd>(probs, tpe, stream, g.typed_data(), scale.typed_data(),
                             dp->untyped_data(), n, e);
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeAuxLossFwd, moe::AuxLossFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                  // probs [T, E]
                                  .Arg<xla::ffi::AnyBuffer>()                  // f [E] f32/s32
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // scale []
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()      // loss []
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),     // partials [512]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeAuxLossBwd, moe::AuxLossBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // g []
                                  .Arg<xla::ffi::AnyBuffer>()                  // probs [T, E]
                                  .Arg<xla::ffi::AnyBuffer>()                  // f [E] f32/s32
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // scale []
                                  .Ret<xla::ffi::AnyBuffer>(),                 // dprobs [T, E]
                              {xla::ffi::Traits::kCmdBufferCompatible});
