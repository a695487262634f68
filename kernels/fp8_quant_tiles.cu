// FP8 quantization into the 128 x 128 tile layouts (fp8_quant.cuh: the recipe;
// moe_praxis/ops/fp8/quant.py: the layouts and the references these kernels equal bitwise):
//
//   moe_fp8_quantize_weight         L2: w [E, K, N] -> q [E, K, N], qt [E, N, K], s [E, K/128, N/128]
//   moe_fp8_quantize_rows_grouped_t L3: x [R, C], group_sizes [E] -> qt [C, Rp], s [Rp/128, C]
//
// One pass over the input each. L2: one block per 128 x 128 tile, threads holding two columns of
// 16 rows, q and qt each staged in shared memory and written in whole 128-byte rows. L3: one
// block per 128-row tile and 8 chunks of 64 columns, one scale per column of its tile, the chunk
// staged in shared memory both ways; it finds its tile's group with a block scan of group_sizes
// on the device (no host sync; CUDA-graph safe) and zero-fills padding.
#include <cub/block/block_scan.cuh>

#include "fp8_quant.cuh"

namespace moe {
namespace {

using namespace fp8q;

// ------------------------------------------------------- 128 x 128 tiles: L2 and L3

// L2's thread layout of a 128 x 128 tile: 512 threads, columns 2 * (tid % 64) and + 1, rows
// 16 * (tid / 64) .. + 15 (16 rows per thread rather than 32 halve the values a thread holds, so
// twice the warps stay resident and one block's reduction and stores overlap another's loads).
constexpr int kL2Threads = 512;
constexpr int kL2Rows = kTile / (kL2Threads / 64);
static_assert(kL2Rows == 16, "a thread's part of a column is one 16-byte store");

// Loads the thread's rows of the tile x[r0 + i, c0 : c0 + 128] into v[i][0..1] and returns
// the thread's amax of each of its two columns.
template <typename T>
__device__ __forceinline__ void load_columns(const T* __restrict__ x, int64_t ld, int64_t r0,
                                             int64_t c0, float (&v)[kL2Rows][2],
                                             float (&amax)[2]) {
  const int cp = threadIdx.x % 64, rg = threadIdx.x / 64;
  amax[0] = amax[1] = 0.f;
#pragma unroll
  for (int i = 0; i < kL2Rows; ++i) {
    const Vec<T, 2> p =
        *reinterpret_cast<const Vec<T, 2>*>(x + (r0 + rg * kL2Rows + i) * ld + c0 + 2 * cp);
    v[i][0] = to_f32(p.v[0]);
    v[i][1] = to_f32(p.v[1]);
    amax[0] = fmaxf(amax[0], fabsf(v[i][0]));
    amax[1] = fmaxf(amax[1], fabsf(v[i][1]));
  }
}

// Stores column j of the thread's tile rows, quantized with inv = reciprocal(scale), as 16
// contiguous bytes at dst (16-byte aligned).
__device__ __forceinline__ void store_column(uint8_t* __restrict__ dst,
                                             const float (&v)[kL2Rows][2], int j, float inv) {
  Vec<uint8_t, 16> out;
#pragma unroll
  for (int i = 0; i < kL2Rows; ++i) out.v[i] = to_e4m3(v[i][j], inv);
  *reinterpret_cast<Vec<uint8_t, 16>*>(dst) = out;
}

constexpr int kSmemStride = kTile + 16;  // bytes per row of the staged q tile (16-byte aligned)

// Copies the staged 128 x 128 byte tile to dst (row stride ld bytes), 16 bytes per thread.
__device__ __forceinline__ void store_staged(const uint8_t* __restrict__ staged,
                                             uint8_t* __restrict__ dst, int64_t ld) {
  constexpr int kChunks = kTile * kTile / 16;
#pragma unroll
  for (int c = threadIdx.x; c < kChunks; c += kL2Threads) {
    const int row = c / 8, col = (c % 8) * 16;
    *reinterpret_cast<Vec<uint8_t, 16>*>(dst + row * ld + col) =
        *reinterpret_cast<const Vec<uint8_t, 16>*>(staged + row * kSmemStride + col);
  }
}

// L2: block (b) = tile (e, kt, nt), b = (e * KT + kt) * NT + nt.
template <typename T>
__global__ void __launch_bounds__(kL2Threads)
    quantize_weight_kernel(const T* __restrict__ w, uint8_t* __restrict__ q,
                           uint8_t* __restrict__ qt, float* __restrict__ s, int64_t k,
                           int64_t n) {
  __shared__ float warp_max[kL2Threads / 32];
  __shared__ __align__(16) uint8_t staged[kTile * kSmemStride];
  const int64_t kt_count = k / kTile, nt_count = n / kTile;
  const int64_t b = blockIdx.x;
  const int64_t nt = b % nt_count, kt = (b / nt_count) % kt_count, e = b / (nt_count * kt_count);
  const int64_t k0 = kt * kTile, n0 = nt * kTile;
  const T* we = w + e * k * n;
  float v[kL2Rows][2], cm[2];
  load_columns(we, n, k0, n0, v, cm);
  float amax = fmaxf(cm[0], cm[1]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < kL2Threads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const float sc = tile_scale(amax), inv = reciprocal(sc);
  if (threadIdx.x == 0) s[b] = sc;
  const int cp = threadIdx.x % 64, rg = threadIdx.x / 64;
  // q[e, k0 + r, n0 ...] and then qt[e, n0 + c, k0 ...], each staged in shared memory so that
  // global memory sees whole 128-byte rows (8 threads a row, 16-byte stores); qt written
  // straight from registers (16 bytes per thread into 128 different rows) ran at 2.5-2.7 TB/s
#pragma unroll
  for (int i = 0; i < kL2Rows; ++i) {
    Vec<uint8_t, 2> pair;
    pair.v[0] = to_e4m3(v[i][0], inv);
    pair.v[1] = to_e4m3(v[i][1], inv);
    *reinterpret_cast<Vec<uint8_t, 2>*>(staged + (rg * kL2Rows + i) * kSmemStride + 2 * cp) =
        pair;
  }
  __syncthreads();
  store_staged(staged, q + e * k * n + k0 * n + n0, n);
  __syncthreads();  // staged is read; now the transposed tile: row c of staged = column c
  store_column(staged + (2 * cp) * kSmemStride + rg * kL2Rows, v, 0, inv);
  store_column(staged + (2 * cp + 1) * kSmemStride + rg * kL2Rows, v, 1, inv);
  __syncthreads();
  store_staged(staged, qt + e * n * k + n0 * k + k0, k);
}

// L3: the group of the block's padded tile [p0, p0 + 128): its first source row and how many
// of its 128 rows hold data (0: padding past the last group). Block-wide scans over the groups
// in chunks of kThreads, in int64 (raw sums of group sizes cannot overflow).
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct TileRows {
  int64_t src;
  int count;
};

__device__ TileRows find_tile_rows(const int32_t* __restrict__ gs, int64_t e, int64_t rows,
                                   int64_t p0) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ TileRows found;
  __shared__ int done;
  if (threadIdx.x == 0) {
    found = TileRows{0, 0};
    done = 0;
  }
  __syncthreads();
  int64_t raw_carry = 0, pad_carry = 0;
  for (int64_t base = 0; base < e; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t size = g < e && gs[g] > 0 ? gs[g] : 0;
    int64_t cum, total;
    Scan(temp).InclusiveSum(size, cum, total);
    __syncthreads();
    const int64_t end = min64(raw_carry + cum, rows), start = min64(raw_carry + cum - size, rows);
    const int64_t m = end - start, padded = (m + kTile - 1) / kTile * kTile;
    int64_t pcum, ptotal;
    Scan(temp).InclusiveSum(padded, pcum, ptotal);
    const int64_t pstart = pad_carry + pcum - padded;
    if (g < e && pstart <= p0 && p0 < pstart + padded) {
      const int64_t j = p0 - pstart;
      found = TileRows{start + j, static_cast<int>(min64(m - j, kTile))};
      done = 1;
    }
    __syncthreads();
    if (done) break;
    raw_carry += total;
    pad_carry += ptotal;
  }
  return found;
}

// L3: block (pt, cb) quantizes padded rows [128 pt, 128 pt + 128) x columns
// [kL3Cols * kL3Chunks * cb, ...), kL3Cols columns (one chunk) at a time, through shared memory
// both ways so that global memory is read and written in whole 128-byte lines:
//   1. the chunk's 128 rows are read as 16-byte vectors (a row's kL3Cols values by consecutive
//      threads) into `tile` (zeros past the group's rows);
//   2. thread (c, q) takes column c, rows [32 q, 32 q + 32): its column maximum, the block's
//      per column (col_max), the scale, then the 32 e4m3 bytes into `out[c]`;
//   3. out's rows, 128 bytes each (column c's 128 padded rows), go to qt[c] by 8 threads each.
// The block finds its rows (a block-wide scan over the group sizes) once for all its chunks.
// (The kernel before this one read and wrote 16-64 bytes per row and ran at 0.91-1.14 TB/s
// against a copy's 3.7-3.9: benchmarks/results/fp8_quant_bench*.json.)
constexpr int kL3Cols = 64;                        // columns per chunk
constexpr int kL3Quarters = kThreads / kL3Cols;    // row groups in step 2
constexpr int kL3Rows = kTile / kL3Quarters;       // rows per thread in step 2: 32
constexpr int kL3Chunks = 8;                       // chunks per block
constexpr int kL3OutStride = kTile + 16;           // bytes; the pad spreads rows over banks
static_assert(kTile % kL3Cols == 0 && kL3Rows % 16 == 0, "L3 tiling");

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_grouped_t_kernel(const T* __restrict__ x, const int32_t* __restrict__ gs,
                              uint8_t* __restrict__ qt, float* __restrict__ s, int64_t rows,
                              int64_t cols, int64_t e, int64_t rp) {
  constexpr int VEC = 16 / sizeof(T);                 // values per 16-byte vector
  constexpr int ROW_THREADS = kL3Cols / VEC;          // threads per row in step 1
  constexpr int PASS_ROWS = kThreads / ROW_THREADS;   // rows per pass in step 1
  using V = Vec<T, VEC>;
  __shared__ V tile[kTile][ROW_THREADS];
  __shared__ float col_max[kL3Quarters][kL3Cols];
  __shared__ __align__(16) uint8_t out[kL3Cols][kL3OutStride];
  const int64_t pt = blockIdx.x;
  const TileRows t = find_tile_rows(gs, e, rows, pt * kTile);
  const int lv = threadIdx.x % ROW_THREADS, lr = threadIdx.x / ROW_THREADS;  // step 1
  const int c = threadIdx.x % kL3Cols, q = threadIdx.x / kL3Cols;            // step 2
  const int64_t chunks = cols / kL3Cols;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kL3Chunks;
  for (int64_t k = k0; k < k0 + kL3Chunks && k < chunks; ++k) {  // uniform over the block
    const int64_t c0 = k * kL3Cols;
#pragma unroll
    for (int pass = 0; pass < kTile / PASS_ROWS; ++pass) {
      const int r = pass * PASS_ROWS + lr;
      V v;
      if (r < t.count) {
        v = reinterpret_cast<const V*>(x + (t.src + r) * cols + c0)[lv];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = from_f32<T>(0.f);
      }
      tile[r][lv] = v;
    }
    __syncthreads();
    const T* tcol = reinterpret_cast<const T*>(&tile[0][0]) + c;  // column c, row stride kL3Cols
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kL3Rows; ++i) {
      amax = fmaxf(amax, fabsf(to_f32(tcol[(q * kL3Rows + i) * kL3Cols])));
    }
    col_max[q][c] = amax;
    __syncthreads();
    amax = col_max[0][c];
#pragma unroll
    for (int g = 1; g < kL3Quarters; ++g) amax = fmaxf(amax, col_max[g][c]);
    const float sc = tile_scale(amax), inv = reciprocal(sc);
#pragma unroll
    for (int i0 = 0; i0 < kL3Rows; i0 += 16) {
      Vec<uint8_t, 16> o;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        o.v[i] = to_e4m3(to_f32(tcol[(q * kL3Rows + i0 + i) * kL3Cols]), inv);
      }
      *reinterpret_cast<Vec<uint8_t, 16>*>(&out[c][q * kL3Rows + i0]) = o;
    }
    if (q == 0) s[pt * cols + c0 + c] = sc;
    __syncthreads();
    constexpr int SEGS = kTile / 16;  // 16-byte segments of an out row
    static_assert(kL3Cols * SEGS % kThreads == 0, "whole passes over out");
#pragma unroll
    for (int j = 0; j < kL3Cols * SEGS / kThreads; ++j) {
      const int i = j * kThreads + threadIdx.x, oc = i / SEGS, seg = i % SEGS;
      *reinterpret_cast<Vec<uint8_t, 16>*>(qt + (c0 + oc) * rp + pt * kTile + seg * 16) =
          *reinterpret_cast<const Vec<uint8_t, 16>*>(&out[oc][seg * 16]);
    }
    // the next chunk writes tile, col_max and out only after two more barriers
  }
}

// ------------------------------------------------------------------------------ handlers

ffi::Error QuantizeWeightImpl(cudaStream_t stream, ffi::AnyBuffer w,
                              ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                              ffi::Result<ffi::Buffer<ffi::F32>> s) {
  if (w.dimensions().size() != 3) {
    return MOE_INVALID("fp8 quantize weight: w must be [E, K, N], got " + dims_text(w));
  }
  if (!is_float(w)) return MOE_INVALID("fp8 quantize weight: w must be float32 or bfloat16");
  const int64_t e = w.dimensions()[0], k = w.dimensions()[1], n = w.dimensions()[2];
  if (k % kTile || n % kTile) {
    return MOE_INVALID("fp8 quantize weight: w is " + dims_text(w) +
                       "; K and N must be multiples of 128");
  }
  if (q->element_type() != ffi::F8E4M3FN || qt->element_type() != ffi::F8E4M3FN ||
      q->element_count() != w.element_count() || qt->element_count() != w.element_count()) {
    return MOE_INVALID("fp8 quantize weight: q [E, K, N] and qt [E, N, K] must be float8_e4m3fn");
  }
  const int64_t blocks = e * (k / kTile) * (n / kTile);
  if (s->element_count() != static_cast<size_t>(blocks)) {
    return MOE_INVALID("fp8 quantize weight: s must be [E, K/128, N/128] float32");
  }
  if (blocks == 0) return ffi::Error::Success();
  if (blocks > INT32_MAX) {
    return MOE_INVALID("fp8 quantize weight: " + dims_text(w) + " has more than 2^31 - 1 blocks");
  }
  const auto grid = static_cast<unsigned>(blocks);
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  if (w.element_type() == ffi::F32) {
    quantize_weight_kernel<float><<<grid, kL2Threads, 0, stream>>>(
        static_cast<const float*>(w.untyped_data()), qp, qtp, s->typed_data(), k, n);
  } else {
    quantize_weight_kernel<__nv_bfloat16><<<grid, kL2Threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(w.untyped_data()), qp, qtp, s->typed_data(), k, n);
  }
  MOE_LAUNCH_CHECK("fp8_quantize_weight");
  return ffi::Error::Success();
}

ffi::Error QuantizeRowsGroupedTImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> qt,
                                    ffi::Result<ffi::Buffer<ffi::F32>> s) {
  const char* op = "fp8 quantize rows grouped t";
  if (x.dimensions().size() != 2) {
    return MOE_INVALID(std::string(op) + ": x must be [R, C], got " + dims_text(x));
  }
  if (!is_float(x)) return MOE_INVALID(std::string(op) + ": x must be float32 or bfloat16");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (cols % kTile) {
    return MOE_INVALID(std::string(op) + ": C=" + std::to_string(cols) +
                       " must be a multiple of 128");
  }
  if (e < 1) return MOE_INVALID(std::string(op) + ": group_sizes must be [E] with E >= 1");
  const int64_t rp = ceil_div(rows + (kTile - 1) * e, kTile) * kTile;
  const auto qd = qt->dimensions();
  if (qt->element_type() != ffi::F8E4M3FN || qd.size() != 2 || qd[0] != cols || qd[1] != rp) {
    return MOE_INVALID(std::string(op) + ": qt must be float8_e4m3fn [C=" +
                       std::to_string(cols) + ", Rp=" + std::to_string(rp) +
                       "], Rp = round_up(R + 127 E, 128)");
  }
  if (s->element_count() != static_cast<size_t>(rp / kTile * cols)) {
    return MOE_INVALID(std::string(op) + ": s must be [Rp/128, C] float32");
  }
  if (cols == 0) return ffi::Error::Success();
  const int64_t slice_blocks = ceil_div(cols / kL3Cols, kL3Chunks);
  if (rp / kTile > INT32_MAX || slice_blocks > 65535) {
    return MOE_INVALID(std::string(op) + ": x " + dims_text(x) + " is too large for the grid");
  }
  const dim3 grid(static_cast<unsigned>(rp / kTile), static_cast<unsigned>(slice_blocks));
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  if (x.element_type() == ffi::F32) {
    quantize_grouped_t_kernel<float><<<grid, kThreads, 0, stream>>>(
        static_cast<const float*>(x.untyped_data()), group_sizes.typed_data(), qtp,
        s->typed_data(), rows, cols, e, rp);
  } else {
    quantize_grouped_t_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x.untyped_data()), group_sizes.typed_data(), qtp,
        s->typed_data(), rows, cols, e, rp);
  }
  MOE_LAUNCH_CHECK("fp8_quantize_rows_grouped_t");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeFp8QuantizeWeight, moe::QuantizeWeightImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // w [E, K, N]
                                  .Ret<xla::ffi::AnyBuffer>()              // q [E, K, N] e4m3
                                  .Ret<xla::ffi::AnyBuffer>()              // qt [E, N, K] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s [E, K/128, N/128]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeFp8QuantizeRowsGroupedT, moe::QuantizeRowsGroupedTImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [R, C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()              // qt [C, Rp] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s [Rp/128, C]
                              {xla::ffi::Traits::kCmdBufferCompatible});
