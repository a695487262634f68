// The inverse of a row map as CSR (per-token row lists) for kernels/permute.cu: built in an
// int32 buffer of 2 * T + 4 + R elements (offsets [T + 2], cursor [T + 2], lists [R]), either a
// kernel's own workspace or the prebuilt index (moe_permute_index).
#pragma once

#include "moe_common.h"

namespace moe {
namespace permute_csr {

constexpr int kScanThreads = 1024;

// The CSR slot of row r: its token, or (with `sink`) slot T for rows mapped outside [0, T);
// -1: not listed.
__device__ __forceinline__ int64_t csr_slot(int32_t t, int64_t tokens, bool sink) {
  if (t >= 0 && t < tokens) return t;
  return sink ? tokens : -1;
}

__global__ void histogram_kernel(const int32_t* __restrict__ row_map, int32_t* __restrict__ cnt,
                                 int64_t rows, int64_t tokens, bool sink) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = csr_slot(row_map[r], tokens, sink);
    if (slot >= 0) atomicAdd(cnt + slot + 1, 1);
  }
}

// In-place inclusive scan of n ints by one block; also copies the result to `copy`. Tiles of
// 4 * kScanThreads ints: each thread scans 4 consecutive ints (coalesced across the block),
// warps scan the thread totals with shuffles, a running carry links the tiles. (A thread-per-
// chunk version made strided, latency-bound loads: benchmarks/results/kernels_history.md,
// "permute.cu: scan_kernel".)
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int32_t* __restrict__ a, int32_t* __restrict__ copy, int64_t n) {
  constexpr int kWarpsScan = kScanThreads / 32;
  __shared__ int32_t warp_tot[kWarpsScan];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t carry = 0;
  for (int64_t base = 0; base < n; base += 4 * kScanThreads) {
    const int64_t i0 = base + 4 * static_cast<int64_t>(threadIdx.x);
    int32_t v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i0 + j < n ? a[i0 + j] : 0;
    v[1] += v[0];
    v[2] += v[1];
    v[3] += v[2];
    const int32_t x = warp_inclusive_scan(v[3]);  // the thread totals within the warp
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
      const int32_t w = warp_inclusive_scan(lane < kWarpsScan ? warp_tot[lane] : 0);
      if (lane < kWarpsScan) warp_tot[lane] = w;
    }
    __syncthreads();
    const int32_t excl = carry + (warp > 0 ? warp_tot[warp - 1] : 0) + (x - v[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j < n) {
        a[i0 + j] = v[j] + excl;
        copy[i0 + j] = v[j] + excl;
      }
    }
    carry += warp_tot[kWarpsScan - 1];
    __syncthreads();  // warp_tot is rewritten by the next tile
  }
}

__global__ void fill_kernel(const int32_t* __restrict__ row_map, int32_t* __restrict__ cursor,
                            int32_t* __restrict__ lists, int64_t rows, int64_t tokens,
                            bool sink) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = csr_slot(row_map[r], tokens, sink);
    if (slot >= 0) lists[atomicAdd(cursor + slot, 1)] = static_cast<int32_t>(r);
  }
}

// Sorts each token's row list ascending (the fill order is racy; the sum order must not be).
__global__ void sort_lists_kernel(const int32_t* __restrict__ offsets, int32_t* __restrict__ lists,
                                  int64_t tokens) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t lo = offsets[t], hi = offsets[t + 1];
    for (int32_t i = lo + 1; i < hi; ++i) {
      const int32_t v = lists[i];
      int32_t j = i - 1;
      while (j >= lo && lists[j] > v) {
        lists[j + 1] = lists[j];
        --j;
      }
      lists[j + 1] = v;
    }
  }
}
// Workspace: offsets [T + 2] (offsets[s] = rows listed in slots < s; slot T is the sink),
// cursor [T + 2], lists [R].
inline int64_t workspace_size(int64_t tokens, int64_t rows) { return 2 * (tokens + 2) + rows; }

struct Csr {
  int32_t* offsets;
  int32_t* cursor;
  int32_t* lists;
};
inline Csr csr_view(int32_t* ws, int64_t tokens) {
  return Csr{ws, ws + tokens + 2, ws + 2 * (tokens + 2)};
}

// Builds the CSR inverse of row_map in `c`: slots 0..T-1 (tokens) and, with `sink`, slot T
// (rows mapped outside [0, T)); with `sorted`, each list in increasing row order.
inline ffi::Error build_csr(cudaStream_t stream, const int32_t* row_map, const Csr& c, int64_t rows,
                     int64_t tokens, bool sink, bool sorted) {
  const int64_t slots = tokens + 1;
  int32_t* offsets = c.offsets;
  int32_t* cursor = c.cursor;
  int32_t* lists = c.lists;
  MOE_CUDA_CHECK(cudaMemsetAsync(offsets, 0, (slots + 1) * sizeof(int32_t), stream));
  if (rows > 0) {
    histogram_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(row_map, offsets, rows, tokens,
                                                              sink);
    MOE_LAUNCH_CHECK("permute histogram");
  }
  // histogram counts slot s at offsets[s + 1]; its inclusive scan gives the offsets
  scan_kernel<<<1, kScanThreads, 0, stream>>>(offsets, cursor, slots + 1);
  MOE_LAUNCH_CHECK("permute scan");
  if (rows > 0) {
    fill_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(row_map, cursor, lists, rows, tokens,
                                                         sink);
    MOE_LAUNCH_CHECK("permute fill");
  }
  if (sorted) {
    sort_lists_kernel<<<grid_for(tokens, 256), 256, 0, stream>>>(offsets, lists, tokens);
    MOE_LAUNCH_CHECK("unpermute sort");
  }
  return ffi::Error::Success();
}

}  // namespace permute_csr
}  // namespace moe
