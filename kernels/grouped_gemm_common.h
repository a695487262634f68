// What the two grouped GEMM families share: the Hopper kernels (grouped_gemm.cuh, CUTLASS 3,
// sm_90a) and the sm_80 kernels (grouped_gemm_sm80.cuh, CUTLASS 2.x GemmGrouped). Both take
// (a, b, group_sizes) -> (out, workspace), read the group sizes on the device in a prepare
// kernel that writes per-group arrays at the start of the workspace, and report bad arguments
// the same way. One place for the workspace layout constants (GROUP_ARRAY_BYTES_PER_GROUP in
// moe_praxis/ops/grouped_gemm_tiles.py mirrors kGroupArrayBytesPerGroup), the error strings of
// the FFI checks and the device helpers both prepare kernels use.
//
// Each family names itself in its errors (`who`: "moe_praxis grouped GEMM" or
// "moe_praxis grouped GEMM (sm_80)"), so a message says which kernel refused.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cutlass/cutlass.h"
#include "xla/ffi/api/ffi.h"

namespace moe_gg_common {

namespace ffi = xla::ffi;

// Bytes of group arrays per group: a problem shape (12) + 3 pointers (24) + 3 strides or
// leading dimensions (<= 72), rounded up; the arrays start at the workspace's first byte.
constexpr int64_t kGroupArrayBytesPerGroup = 128;
constexpr int64_t kAlign = 256;
constexpr int kPrepareThreads = 256;

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The group arrays of `e` problems, rounded up to kAlign bytes.
inline int64_t group_array_bytes(int64_t e) {
  return cdiv(kGroupArrayBytesPerGroup * e, kAlign) * kAlign;
}

// Where group e's operands start: base + e * per_expert + row_offset(e) * per_row (elements).
struct OperandMap {
  int64_t per_expert;
  int64_t per_row;
};

// Hands out consecutive 16-byte aligned slices of a workspace (the group arrays).
struct Carver {
  uint8_t* base;
  size_t offset = 0;
  template <class T>
  T* take(size_t count) {
    uint8_t* p = base + offset;
    offset += (sizeof(T) * count + 15) / 16 * 16;
    return reinterpret_cast<T*>(p);
  }
};

// Zeroes n elements of a 16-bit type at p, 16 bytes per access, grid-stride over the threads
// [tid, nthreads). n and p are multiples of 8 elements / 16 bytes (K, N % 8 == 0: checked in
// Python and by the handlers).
template <class T>
__device__ inline void zero_range(T* p, int64_t n, int64_t tid, int64_t nthreads) {
  static_assert(sizeof(T) == 2, "zero_range writes 16-bit elements 8 at a time");
  uint4* v = reinterpret_cast<uint4*>(p);
  const int64_t nv = n / 8;
  for (int64_t i = tid; i < nv; i += nthreads) v[i] = make_uint4(0, 0, 0, 0);
}

// ---------------------------------------------------------------------- the FFI checks' errors

// A CUDA runtime call that failed: "<who>: <what>: <CUDA's message>".
inline ffi::Error cuda_error(const char* who, cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string(who) + ": " + what + ": " + cudaGetErrorString(err));
}

// A CUTLASS call that failed: "<who>: <what> failed: <status>" (+ the last CUDA error, if any).
inline ffi::Error cutlass_error(const char* who, const char* what, cutlass::Status st,
                                bool with_cuda_error = false) {
  std::string msg = std::string(who) + ": " + what + " failed: " + cutlassGetStatusString(st);
  if (with_cuda_error) msg += std::string(" (") + cudaGetErrorString(cudaGetLastError()) + ")";
  return ffi::Error::Internal(msg);
}

// Operands of the wrong rank or shape: "<who> <op>: need <shapes>".
inline ffi::Error shape_error(const char* who, const char* op, const char* need) {
  return ffi::Error::InvalidArgument(std::string(who) + " " + op + ": need " + need);
}

// Any other bad argument of one op: "<who> <op>: <what>".
inline ffi::Error invalid(const char* who, const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(who) + " " + op + ": " + what);
}

// The `tile` attribute out of range.
inline ffi::Error invalid_tile(const char* who, int64_t tile, int num_tiles) {
  return ffi::Error::InvalidArgument(std::string(who) + ": tile=" + std::to_string(tile) +
                                     " is invalid; valid: 0.." + std::to_string(num_tiles - 1));
}

// The workspace output smaller than the call needs; `sized_by` names where Python sizes it.
inline ffi::Error workspace_too_small(const char* who, int64_t have, int64_t need,
                                      const char* sized_by) {
  return ffi::Error::InvalidArgument(std::string(who) + ": workspace of " + std::to_string(have) +
                                     " bytes is too small; it needs " + std::to_string(need) +
                                     " (" + sized_by + ")");
}

// K and N of a 16-bit GEMM must be multiples of 8 elements (16-byte accesses).
inline ffi::Error check_multiples_of_8(const char* who, const char* op, int64_t k, int64_t n) {
  if (k % 8 != 0 || n % 8 != 0) {
    return invalid(who, op,
                   "K and N must be multiples of 8, got " + std::to_string(k) + " and " +
                       std::to_string(n));
  }
  return ffi::Error::Success();
}

}  // namespace moe_gg_common
