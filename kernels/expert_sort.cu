// Stable sort of the token copies by expert (see moe_praxis/ops/expert_sort.py):
//
//   keys [R] int32 (the expert of copy i = t * k + j; a key outside [0, E) is "not kept" and
//   counts as E, after every expert) ->
//     order [R]:        the copy at each sorted position (stable: a key's copies in copy order)
//     sorted_keys [R]:  its key (E for the copies not kept)
//     row_map [R]:      its token order[p] / k, or T = R / k for the copies not kept
//     group_sizes [E]:  the copies of each expert
//
// A counting sort in three kernels, no atomics on global memory, deterministic:
//   1. chunk_histogram_kernel: one block per chunk of kChunk keys writes the chunk's counts per
//      key, hist[chunk][E + 1] (workspace);
//   2. offsets_kernel (one block): turns each key's column into the exclusive prefix over the
//      chunks and adds the key's start (the exclusive scan of the totals): hist[c][e] is then
//      where chunk c's first copy of key e goes; writes group_sizes;
//   3. scatter_kernel: one block per chunk; each warp takes a slice of the chunk, counts its
//      keys, and after a prefix over the warps walks its slice 32 keys at a time: lanes with
//      equal keys (__match_any_sync) take consecutive positions in lane order.
// XLA's sort of the same keys (jnp.argsort: a cub radix sort; with the gathers and counts around
// it 18 kernels) left the GPU idle about 0.3 ms per step of the Qwen3-like layer with command
// buffers on (benchmarks/results/layer_breakdown_qwen3_gaps.json); these kernels are graph-safe.
#include <algorithm>

#include "moe_common.h"

namespace moe {
namespace {

constexpr int kSortThreads = 256;
constexpr int kSortWarps = kSortThreads / 32;
constexpr int kChunk = 4096;  // keys per block (16 per thread)
constexpr int kOffsetThreads = 1024;
// E + 1 counters per warp in shared memory: 8 * 1025 * 4 bytes = 32.8 KB at the most.
constexpr int64_t kMaxExperts = 1024;

__device__ __forceinline__ int32_t bin_of(int32_t key, int32_t experts) {
  return (key >= 0 && key < experts) ? key : experts;
}

__global__ void __launch_bounds__(kSortThreads)
    chunk_histogram_kernel(const int32_t* __restrict__ keys, int32_t* __restrict__ hist,
                           int64_t rows, int32_t experts) {
  extern __shared__ int32_t cnt[];  // [E + 1]
  const int32_t bins = experts + 1;
  for (int32_t b = threadIdx.x; b < bins; b += kSortThreads) cnt[b] = 0;
  __syncthreads();
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t hi = min(lo + kChunk, rows);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kSortThreads) {
    atomicAdd(cnt + bin_of(keys[i], experts), 1);
  }
  __syncthreads();
  int32_t* row = hist + static_cast<int64_t>(blockIdx.x) * bins;
  for (int32_t b = threadIdx.x; b < bins; b += kSortThreads) row[b] = cnt[b];
}

// One block. Bins are handled in tiles of kOffsetThreads (one per thread): each thread turns
// its bin's column into the exclusive prefix over the chunks (its total stays in a register),
// then the block scans the totals (a running carry links the tiles) and adds each bin's start.
__global__ void __launch_bounds__(kOffsetThreads)
    offsets_kernel(int32_t* __restrict__ hist, int32_t* __restrict__ group_sizes, int64_t chunks,
                   int32_t experts) {
  __shared__ int32_t warp_tot[kOffsetThreads / 32];
  const int32_t bins = experts + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t carry = 0;
  for (int32_t base = 0; base < bins; base += kOffsetThreads) {
    const int32_t b = base + threadIdx.x;
    int32_t tot = 0;
    if (b < bins) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t v = hist[c * bins + b];
        hist[c * bins + b] = tot;
        tot += v;
      }
      if (b < experts) group_sizes[b] = tot;
    }
    const int32_t x = warp_inclusive_scan(tot);  // the totals: warps, then the warp totals
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
      warp_tot[lane] = warp_inclusive_scan(warp_tot[lane]);
    }
    __syncthreads();
    const int32_t start = carry + (warp > 0 ? warp_tot[warp - 1] : 0) + (x - tot);
    if (b < bins) {
      for (int64_t c = 0; c < chunks; ++c) hist[c * bins + b] += start;
    }
    carry += warp_tot[31];
    __syncthreads();  // warp_tot is rewritten by the next tile
  }
}

__global__ void __launch_bounds__(kSortThreads)
    scatter_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ hist,
                   int32_t* __restrict__ order, int32_t* __restrict__ sorted_keys,
                   int32_t* __restrict__ row_map, int64_t rows, int32_t experts, int64_t k) {
  extern __shared__ int32_t next[];  // [kSortWarps][E + 1]: each warp's next position per bin
  const int32_t bins = experts + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int32_t i = threadIdx.x; i < kSortWarps * bins; i += kSortThreads) next[i] = 0;
  __syncthreads();
  constexpr int kSlice = kChunk / kSortWarps;  // consecutive keys of one warp
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk + warp * kSlice;
  const int64_t hi = min(lo + kSlice, rows);
  int32_t* mine = next + warp * bins;
  for (int64_t i = lo + lane; i < hi; i += 32) atomicAdd(mine + bin_of(keys[i], experts), 1);
  __syncthreads();
  // per bin: the chunk's start, then the warps' counts turned into their starts
  const int32_t* start = hist + static_cast<int64_t>(blockIdx.x) * bins;
  for (int32_t b = threadIdx.x; b < bins; b += kSortThreads) {
    int32_t at = start[b];
    for (int w = 0; w < kSortWarps; ++w) {
      const int32_t c = next[w * bins + b];
      next[w * bins + b] = at;
      at += c;
    }
  }
  __syncthreads();
  const int64_t tokens = rows / k;
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t base = lo; base < hi; base += 32) {
    const int64_t i = base + lane;
    const bool live = i < hi;
    const unsigned active = __ballot_sync(0xffffffffu, live);
    const int32_t bin = live ? bin_of(keys[i], experts) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, bin) & active;
    if (live) {
      const int32_t p = mine[bin] + __popc(peers & lt);
      order[p] = static_cast<int32_t>(i);
      sorted_keys[p] = bin;
      row_map[p] = static_cast<int32_t>(bin < experts ? i / k : tokens);
    }
    __syncwarp();
    if (live && (peers & lt) == 0) mine[bin] += __popc(peers);  // the lowest lane of the key
    __syncwarp();
  }
}

ffi::Error ExpertSortImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> keys,
                          ffi::ResultBuffer<ffi::S32> order, ffi::ResultBuffer<ffi::S32> sorted,
                          ffi::ResultBuffer<ffi::S32> row_map,
                          ffi::ResultBuffer<ffi::S32> group_sizes,
                          ffi::ResultBuffer<ffi::S32> workspace, int64_t experts, int64_t k) {
  const int64_t rows = keys.element_count();
  if (experts < 1 || experts > kMaxExperts) {
    return MOE_INVALID("expert sort: experts=" + std::to_string(experts) +
                       " is invalid; valid: 1 to " + std::to_string(kMaxExperts));
  }
  if (k < 1 || rows % k != 0) {
    return MOE_INVALID("expert sort: k=" + std::to_string(k) + " does not divide the " +
                       std::to_string(rows) + " keys");
  }
  if (rows > INT32_MAX) {
    return MOE_INVALID("expert sort: " + std::to_string(rows) + " keys exceed int32 positions");
  }
  const int64_t chunks = ceil_div(rows, kChunk);
  const int64_t bins = experts + 1;
  if (order->element_count() != static_cast<size_t>(rows) ||
      sorted->element_count() != static_cast<size_t>(rows) ||
      row_map->element_count() != static_cast<size_t>(rows) ||
      group_sizes->element_count() != static_cast<size_t>(experts) ||
      workspace->element_count() < static_cast<size_t>(std::max<int64_t>(chunks, 1) * bins)) {
    return MOE_INVALID("expert sort: outputs must be order, sorted keys, row map [" +
                       std::to_string(rows) + "], group sizes [" + std::to_string(experts) +
                       "] and a workspace of >= " + std::to_string(chunks * bins) + " int32");
  }
  int32_t* hist = workspace->typed_data();
  const int32_t e = static_cast<int32_t>(experts);
  if (chunks > 0) {
    chunk_histogram_kernel<<<static_cast<int>(chunks), kSortThreads, bins * sizeof(int32_t),
                             stream>>>(keys.typed_data(), hist, rows, e);
    MOE_LAUNCH_CHECK("expert sort histogram");
  }
  offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(hist, group_sizes->typed_data(), chunks, e);
  MOE_LAUNCH_CHECK("expert sort offsets");
  if (chunks > 0) {
    scatter_kernel<<<static_cast<int>(chunks), kSortThreads,
                     kSortWarps * bins * sizeof(int32_t), stream>>>(
        keys.typed_data(), hist, order->typed_data(), sorted->typed_data(),
        row_map->typed_data(), rows, e, k);
    MOE_LAUNCH_CHECK("expert sort scatter");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeExpertSort, moe::ExpertSortImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // keys [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // order [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // sorted keys [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // row map [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // group sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // workspace
                                  .Attr<int64_t>("experts")
                                  .Attr<int64_t>("k"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
