// Permute token rows to expert-sorted rows and back (see moe_praxis/ops/permute.py):
//
//   permute:   y[r] = x[row_map[r]]            (zeros where row_map[r] is not in [0, T))
//   unpermute: x[t] = sum_{r: row_map[r] = t} y[r]   (summed in f32 in increasing r order,
//              rounded once; deterministic)
//   unpermute of two: x[t] = sum_{r: row_map[r] = t} (y[r] + y2[r])   (the same, adding y2[r]
//              after y[r]; moe_unpermute_indexed with two): the backward of rows read by two
//              consumers (permute_pair), whose two cotangents would otherwise be added into an
//              [R, M] array first
//
// x: [T, M], y: [R, M], f32 or bf16; row_map: [R] int32. Each is the other's backward.
// Both build the inverse map (CSR: per-token row lists) in an explicit int32 workspace output
// of 2 * T + 4 + R elements (XLA's scratch allocator is not used), or read it prebuilt: the
// index (moe_permute_index: the CSR with the sink slot and sorted token lists, which serves
// both) made once per dispatch for the permute, its backward, the combine's unpermute and its
// backward (moe_permute_indexed, moe_unpermute_indexed):
//   permute (rows of >= 512 bytes): one block per token reads x[t] ONCE and writes it to each of
//     its rows (the row-major gather read each token k times and measured far below copy
//     bandwidth on the H200: benchmarks/results/kernels_history.md, "permute.cu:
//     permute_tokens_kernel"); rows mapped outside [0, T) form one extra "sink" list that a few
//     blocks zero.
//     Narrower rows keep the row-major gather (no CSR).
//   unpermute: sorts each token's rows, then one thread per 16-byte output vector sums its
//     token's rows in increasing row order (deterministic).
#include <type_traits>

#include "moe_common.h"
#include "permute_csr.cuh"

namespace moe {
namespace {

using namespace permute_csr;


// Rows are copied / summed as 16-byte vectors (moe_common.h's Vec) when the row size allows.
constexpr int kFlatThreads = 256;
constexpr int kUnroll = 4;

// Flat copy over R * M / VEC vectors: vector i belongs to row r = i / nv, reads its token's
// row (zeros for rows mapped outside [0, T)). kUnroll independent vectors per thread.
template <typename T, int VEC>
__global__ void __launch_bounds__(kFlatThreads)
    permute_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_map,
                   T* __restrict__ y, int64_t rows, int64_t tokens, int64_t nv) {
  using V = Vec<T, VEC>;
  const int64_t total = rows * nv;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kFlatThreads * kUnroll + threadIdx.x;
  V v[kUnroll];
#pragma unroll
  for (int q = 0; q < kUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < total) {
      const int64_t r = i / nv, c = i - r * nv;
      const int64_t t = __ldg(row_map + r);
      if (t >= 0 && t < tokens) {
        v[q] = reinterpret_cast<const V*>(x)[t * nv + c];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[q].v[j] = from_f32<T>(0.f);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < kUnroll; ++q) {
    const int64_t i = base + q * kFlatThreads;
    if (i < total) reinterpret_cast<V*>(y)[i] = v[q];
  }
}

constexpr int kTokenThreads = 128;
constexpr int kSinkBlocks = 264;  // blocks that zero the rows mapped outside [0, T)

// Token-major permute: block b < T reads x[b] once (kUnroll 16-byte vectors per thread in
// flight) and stores it to each row of its list; blocks T .. T + kSinkBlocks - 1 share the sink
// list (rows mapped outside [0, T)) and write zeros there.
template <typename T, int VEC>
__global__ void __launch_bounds__(kTokenThreads)
    permute_tokens_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets,
                          const int32_t* __restrict__ lists, T* __restrict__ y, int64_t tokens,
                          int64_t nv) {
  using V = Vec<T, VEC>;
  const int64_t b = blockIdx.x;
  V* out = reinterpret_cast<V*>(y);
  if (b < tokens) {
    const int32_t lo = __ldg(offsets + b), hi = __ldg(offsets + b + 1);
    if (lo == hi) return;
    const V* src = reinterpret_cast<const V*>(x) + b * nv;
    for (int64_t c0 = threadIdx.x; c0 < nv; c0 += kTokenThreads * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + u * kTokenThreads;
        if (c < nv) v[u] = src[c];
      }
      for (int32_t q = lo; q < hi; ++q) {
        V* dst = out + static_cast<int64_t>(__ldg(lists + q)) * nv;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = c0 + u * kTokenThreads;
          if (c < nv) dst[c] = v[u];
        }
      }
    }
  } else {
    const int32_t lo = __ldg(offsets + tokens), hi = __ldg(offsets + tokens + 1);
    V z;
#pragma unroll
    for (int j = 0; j < VEC; ++j) z.v[j] = from_f32<T>(0.f);
    for (int32_t q = lo + static_cast<int32_t>(b - tokens); q < hi; q += kSinkBlocks) {
      V* dst = out + static_cast<int64_t>(__ldg(lists + q)) * nv;
      for (int64_t c = threadIdx.x; c < nv; c += kTokenThreads) dst[c] = z;
    }
  }
}


// Flat over T * M / VEC output vectors: vector (t, c) sums y[r, c] (then y2[r, c] with TWO)
// over t's rows in order.
template <typename T, int VEC, bool TWO>
__global__ void __launch_bounds__(kFlatThreads)
    unpermute_kernel(const T* __restrict__ y, const T* __restrict__ y2,
                     const int32_t* __restrict__ offsets, const int32_t* __restrict__ lists,
                     T* __restrict__ x, int64_t tokens, int64_t nv) {
  using V = Vec<T, VEC>;
  constexpr int kLoads = TWO ? kUnroll / 2 : kUnroll;  // rows per step: kUnroll loads in flight
  const int64_t total = tokens * nv;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t t = i / nv, c = i - t * nv;
  const int32_t lo = __ldg(offsets + t), hi = __ldg(offsets + t + 1);
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  auto add = [&](const V& v) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += to_f32(v.v[j]);
  };
  int32_t q = lo;
  for (; q + kLoads <= hi; q += kLoads) {
    V v[kLoads], v2[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t at = static_cast<int64_t>(__ldg(lists + q + u)) * nv + c;
      v[u] = reinterpret_cast<const V*>(y)[at];
      if constexpr (TWO) v2[u] = reinterpret_cast<const V*>(y2)[at];
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      add(v[u]);
      if constexpr (TWO) add(v2[u]);
    }
  }
  for (; q < hi; ++q) {
    const int64_t at = static_cast<int64_t>(__ldg(lists + q)) * nv + c;
    add(reinterpret_cast<const V*>(y)[at]);
    if constexpr (TWO) add(reinterpret_cast<const V*>(y2)[at]);
  }
  V o;
#pragma unroll
  for (int j = 0; j < VEC; ++j) o.v[j] = from_f32<T>(acc[j]);
  reinterpret_cast<V*>(x)[i] = o;
}

// ws: the workspace the CSR is built in, or (built = true) the prebuilt index, only read.
template <typename T>
ffi::Error launch_permute(cudaStream_t stream, const void* x, const int32_t* row_map, void* y,
                          int32_t* ws, int64_t rows, int64_t tokens, int64_t m,
                          bool built = false) {
  constexpr int kVec = 16 / sizeof(T);
  const int vec = m % kVec == 0 ? kVec : 1;
  const int64_t nv = m / vec;
  if (vec == kVec && nv >= 32 && tokens > 0) {  // rows of >= 512 bytes: token-major
    const Csr c = csr_view(ws, tokens);
    if (!built) {
      if (auto err = build_csr(stream, row_map, c, rows, tokens, /*sink=*/true, /*sorted=*/false);
          !err.success())
        return err;
    }
    permute_tokens_kernel<T, kVec>
        <<<static_cast<unsigned>(tokens + kSinkBlocks), kTokenThreads, 0, stream>>>(
            static_cast<const T*>(x), c.offsets, c.lists, static_cast<T*>(y), tokens, nv);
    MOE_LAUNCH_CHECK("permute");
    return ffi::Error::Success();
  }
  const auto grid = static_cast<unsigned>(ceil_div(rows * nv, kFlatThreads * kUnroll));
  if (vec == kVec) {
    permute_kernel<T, kVec><<<grid, kFlatThreads, 0, stream>>>(
        static_cast<const T*>(x), row_map, static_cast<T*>(y), rows, tokens, nv);
  } else {
    permute_kernel<T, 1><<<grid, kFlatThreads, 0, stream>>>(
        static_cast<const T*>(x), row_map, static_cast<T*>(y), rows, tokens, nv);
  }
  MOE_LAUNCH_CHECK("permute");
  return ffi::Error::Success();
}

// y2: nullptr, or the second [R, M] input (the sum of two); ws as for launch_permute
// (a prebuilt index has the sink slot after the tokens' lists, which the sum does not read).
template <typename T>
ffi::Error launch_unpermute(cudaStream_t stream, const void* y, const void* y2,
                            const int32_t* row_map, void* x, int32_t* ws, int64_t rows,
                            int64_t tokens, int64_t m, bool built = false) {
  const Csr c = csr_view(ws, tokens);
  if (!built) {
    if (auto err = build_csr(stream, row_map, c, rows, tokens, /*sink=*/false, /*sorted=*/true);
        !err.success())
      return err;
  }
  constexpr int kVec = 16 / sizeof(T);
  const int vec = m % kVec == 0 ? kVec : 1;
  const int64_t nv = m / vec;
  const auto grid = static_cast<unsigned>(ceil_div(tokens * nv, kFlatThreads));
  auto run = [&](auto vec_c, auto two_c) {
    unpermute_kernel<T, decltype(vec_c)::value, decltype(two_c)::value>
        <<<grid, kFlatThreads, 0, stream>>>(static_cast<const T*>(y), static_cast<const T*>(y2),
                                            c.offsets, c.lists, static_cast<T*>(x), tokens, nv);
  };
  using One = std::integral_constant<int, 1>;
  using Full = std::integral_constant<int, kVec>;
  if (y2 != nullptr) {
    if (vec == kVec) run(Full{}, std::true_type{}); else run(One{}, std::true_type{});
  } else {
    if (vec == kVec) run(Full{}, std::false_type{}); else run(One{}, std::false_type{});
  }
  MOE_LAUNCH_CHECK(y2 != nullptr ? "unpermute of two" : "unpermute");
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------ handlers
//
// Each permute / unpermute handler either builds the inverse map in its workspace output
// (built = false) or reads the prebuilt index (built = true, moe_permute_index's); `ws` is that
// buffer, checked to hold 2 * T + 4 + R int32 elements.

ffi::Error check_ws(const std::string& op, const char* what, size_t count, int64_t tokens,
                    int64_t rows) {
  if (static_cast<int64_t>(count) != workspace_size(tokens, rows)) {
    return MOE_INVALID(op + ": " + what + " must have 2 * T + 4 + R = " +
                       std::to_string(workspace_size(tokens, rows)) + " int32 elements (T=" +
                       std::to_string(tokens) + ", R=" + std::to_string(rows) + "), got " +
                       std::to_string(count));
  }
  return ffi::Error::Success();
}

// The kernels only read a prebuilt index; the launchers take a mutable pointer for the build.
inline int32_t* read_only(const ffi::Buffer<ffi::S32>& index) {
  return const_cast<int32_t*>(index.typed_data());
}

ffi::Error permute_any(cudaStream_t stream, const std::string& op, const ffi::AnyBuffer& x,
                       const ffi::Buffer<ffi::S32>& row_map, ffi::AnyBuffer& y, int32_t* ws,
                       size_t ws_count, bool built) {
  if (x.dimensions().size() != 2) return MOE_INVALID(op + ": x must be [T, M]");
  const int64_t tokens = x.dimensions()[0], m = x.dimensions()[1];
  const int64_t rows = row_map.element_count();
  if (y.element_count() != static_cast<size_t>(rows * m) || y.element_type() != x.element_type()) {
    return MOE_INVALID(op + ": y must be [R, M] in x's dtype");
  }
  if (auto err = check_ws(op, built ? "index" : "workspace", ws_count, tokens, rows);
      !err.success())
    return err;
  if (rows == 0 || m == 0) return ffi::Error::Success();
  switch (x.element_type()) {
    case ffi::F32:
      return launch_permute<float>(stream, x.untyped_data(), row_map.typed_data(),
                                   y.untyped_data(), ws, rows, tokens, m, built);
    case ffi::BF16:
      return launch_permute<__nv_bfloat16>(stream, x.untyped_data(), row_map.typed_data(),
                                           y.untyped_data(), ws, rows, tokens, m, built);
    default:
      return MOE_INVALID(op + ": x must be float32 or bfloat16");
  }
}

// y2: nullptr, or the second [R, M] input (checked by the caller); row_map: needed to build
// (nullptr with a prebuilt index).
ffi::Error unpermute_any(cudaStream_t stream, const std::string& op, const ffi::AnyBuffer& y,
                         const void* y2, const int32_t* row_map, ffi::AnyBuffer& x, int32_t* ws,
                         size_t ws_count, bool built) {
  if (y.dimensions().size() != 2) return MOE_INVALID(op + ": y must be [R, M]");
  const int64_t rows = y.dimensions()[0], m = y.dimensions()[1];
  if (x.dimensions().size() != 2 || x.element_type() != y.element_type() ||
      x.dimensions()[1] != m) {
    return MOE_INVALID(op + ": x must be [T, M=" + std::to_string(m) + "] in y's dtype");
  }
  const int64_t tokens = x.dimensions()[0];
  if (auto err = check_ws(op, built ? "index" : "workspace", ws_count, tokens, rows);
      !err.success())
    return err;
  if (tokens == 0 || m == 0) return ffi::Error::Success();
  switch (y.element_type()) {
    case ffi::F32:
      return launch_unpermute<float>(stream, y.untyped_data(), y2, row_map, x.untyped_data(), ws,
                                     rows, tokens, m, built);
    case ffi::BF16:
      return launch_unpermute<__nv_bfloat16>(stream, y.untyped_data(), y2, row_map,
                                             x.untyped_data(), ws, rows, tokens, m, built);
    default:
      return MOE_INVALID(op + ": y must be float32 or bfloat16");
  }
}

ffi::Error PermuteImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_map,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> ws) {
  return permute_any(stream, "permute", x, row_map, *y, ws->typed_data(), ws->element_count(),
                     /*built=*/false);
}

ffi::Error UnpermuteImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> row_map,
                         ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::Buffer<ffi::S32>> ws) {
  if (y.dimensions().size() == 2 &&
      static_cast<int64_t>(row_map.element_count()) != y.dimensions()[0]) {
    return MOE_INVALID("unpermute: row_map must be [R=" + std::to_string(y.dimensions()[0]) +
                       "]");
  }
  return unpermute_any(stream, "unpermute", y, nullptr, row_map.typed_data(), *x,
                       ws->typed_data(), ws->element_count(), /*built=*/false);
}

ffi::Error PermuteIndexImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> row_map,
                            ffi::Result<ffi::Buffer<ffi::S32>> index, int64_t tokens) {
  const int64_t rows = row_map.element_count();
  if (tokens < 0) return MOE_INVALID("permute index: tokens must be >= 0");
  if (auto err = check_ws("permute index", "index", index->element_count(), tokens, rows);
      !err.success())
    return err;
  return build_csr(stream, row_map.typed_data(), csr_view(index->typed_data(), tokens), rows,
                   tokens, /*sink=*/true, /*sorted=*/true);
}

ffi::Error PermuteIndexedImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_map,
                              ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> y) {
  return permute_any(stream, "permute indexed", x, row_map, *y, read_only(index),
                     index.element_count(), /*built=*/true);
}

// two: x[t] = sum over t's rows of y[r] + y2[r]; else y2 is not read.
ffi::Error UnpermuteIndexedImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer y2,
                                ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> x,
                                bool two) {
  if (two && (y2.element_type() != y.element_type() || y2.dimensions().size() != 2 ||
              y.dimensions().size() != 2 || y2.dimensions()[0] != y.dimensions()[0] ||
              y2.dimensions()[1] != y.dimensions()[1])) {
    return MOE_INVALID("unpermute indexed: y2 must be [R, M] with y's shape and dtype");
  }
  return unpermute_any(stream, "unpermute indexed", y, two ? y2.untyped_data() : nullptr,
                       nullptr, *x, read_only(index), index.element_count(), /*built=*/true);
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermute, moe::PermuteImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [T, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [R]
                                  .Ret<xla::ffi::AnyBuffer>()              // y [R, M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermute, moe::UnpermuteImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // y [R, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [R]
                                  .Ret<xla::ffi::AnyBuffer>()              // x [T, M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteIndex, moe::PermuteIndexImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_map [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   // index [2T+4+R]
                                  .Attr<int64_t>("tokens"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteIndexed, moe::PermuteIndexedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x [T, M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_map [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // index
                                  .Ret<xla::ffi::AnyBuffer>(),              // y [R, M]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteIndexed, moe::UnpermuteIndexedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // y [R, M]
                                  .Arg<xla::ffi::AnyBuffer>()               // y2 [R, M] (two)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // index
                                  .Ret<xla::ffi::AnyBuffer>()               // x [T, M]
                                  .Attr<bool>("two"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
