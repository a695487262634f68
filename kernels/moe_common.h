// Common helpers for the moe_praxis CUDA FFI kernels (shared by every kernels/*.cu file).
//
// Conventions (see moe_praxis/build_kernels.py for the build side):
//   * Handlers are small adapters from XLA FFI buffers to one kernel launch; each is defined
//     with XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeXxx, ...) and listed by name -> symbol in the ONE
//     table moe_praxis/ops/_library.py:KERNELS.
//   * Every CUDA call goes through MOE_CUDA_CHECK / MOE_LAUNCH_CHECK, which turn a CUDA error
//     into an ffi::Error that names the call, the file and the line (XLA raises it in Python).
//   * Shape checks return MOE_INVALID("...") errors naming the offending value.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace moe {

namespace ffi = xla::ffi;

inline ffi::Error CudaError(cudaError_t err, const char* what, const char* file, int line) {
  return ffi::Error::Internal(std::string("moe_praxis kernel: ") + what + " failed at " + file +
                              ":" + std::to_string(line) + ": " + cudaGetErrorString(err));
}

}  // namespace moe

// Returns an ffi::Error from the enclosing handler when a CUDA runtime call fails.
#define MOE_CUDA_CHECK(expr)                                               \
  do {                                                                     \
    cudaError_t moe_err_ = (expr);                                         \
    if (moe_err_ != cudaSuccess) {                                         \
      return ::moe::CudaError(moe_err_, #expr, __FILE__, __LINE__);        \
    }                                                                      \
  } while (0)

// Checks the last launch (call right after `kernel<<<...>>>(...)`).
#define MOE_LAUNCH_CHECK(name) MOE_CUDA_CHECK(cudaPeekAtLastError())

// An InvalidArgument error: MOE_INVALID("E=" + std::to_string(e) + " exceeds 512").
#define MOE_INVALID(msg)                                                   \
  ::xla::ffi::Error::InvalidArgument(std::string("moe_praxis kernel: ") + (msg))

namespace moe {

// Element access for the two float types the kernels take.
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC elements of T moved as one aligned access (16 bytes when sizeof(T) * VEC == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Inclusive scan of x over the 32 lanes of a warp (every lane must call it).
__device__ __forceinline__ int32_t warp_inclusive_scan(int32_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of blocks for a grid-stride loop over n items with `threads` threads a block.
inline int grid_for(int64_t n, int threads, int max_blocks = 132 * 16) {
  int64_t b = ceil_div(n, threads);
  if (b < 1) b = 1;
  return static_cast<int>(b < max_blocks ? b : max_blocks);
}

// Product of all dimensions but the last / the last one (2-D view of a row-major buffer).
template <typename Buf>
inline int64_t rows_of(const Buf& b) {
  auto d = b.dimensions();
  int64_t r = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) r *= d[i];
  return r;
}
template <typename Buf>
inline int64_t cols_of(const Buf& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d[d.size() - 1];
}

}  // namespace moe
