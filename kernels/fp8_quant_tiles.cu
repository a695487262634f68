// FP8 quantization of grouped rows into L3's transposed 128 x 1 tiles, alone or with L1 in the
// same pass (fp8_quant.cuh: the recipe; moe_praxis/ops/fp8_quant.py: the layouts and the
// references these kernels equal bitwise; L2, the weights' blocks: fp8_quant_weight.cu):
//
//   moe_fp8_quantize_rows_grouped_t      L3: x [R, C], group_sizes [E] -> qt [C, Rp], s [Rp/128, C]
//   moe_fp8_quantize_rows_and_grouped_t  L1 and L3 of a bfloat16 x in one pass: -> q [R, C],
//                                        s_t [C/128, R], qt [C, Rp], s [Rp/128, C]
//
// One block per 128-row tile and 8 chunks of 64 columns, one scale per column of its tile, the
// chunk staged in shared memory both ways; it finds its tile's group with a block scan of
// group_sizes on the device (no host sync; CUDA-graph safe) and zero-fills padding.
#include <cub/block/block_scan.cuh>

#include "fp8_quant.cuh"

namespace moe {
namespace {

using namespace fp8q;

// ------------------------------------------------------------- L3 (and L1 with it)

// L3: the group of the block's padded tile [p0, p0 + 128): its first source row and how many
// of its 128 rows hold data (0: padding past the last group). Block-wide scans over the groups
// in chunks of kThreads, in int64 (raw sums of group sizes cannot overflow).
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct TileRows {
  int64_t src;  // L3: the tile's first source row and how many of its rows hold data
  int count;
  // L1 of the same pass (quantize_rows_and_grouped_t): the rows it quantizes from this tile's
  // loads: the group rows above, or for a padding tile a share of the rows past every group
  // (those L1 quantizes and L3 ignores), 128 per padding tile in order. Enough padding tiles
  // exist: Rp - sum(padded sizes) >= (R + 127 E) - (sum + 127 E) = R - sum.
  int64_t l1_src;
  int l1_count;
};

__device__ TileRows find_tile_rows(const int32_t* __restrict__ gs, int64_t e, int64_t rows,
                                   int64_t p0) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ TileRows found;
  __shared__ int done;
  if (threadIdx.x == 0) {
    found = TileRows{0, 0, 0, 0};
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
      const int count = static_cast<int>(min64(m - j, kTile));
      found = TileRows{start + j, count, start + j, count};
      done = 1;
    }
    __syncthreads();
    if (done) return found;
    raw_carry += total;
    pad_carry += ptotal;
  }
  // a padding tile (the same carries in every thread): rows [sum + 128 j, ...) for L1
  const int64_t l1_src = min64(raw_carry, rows) + (p0 - pad_carry);
  const int64_t left = rows - l1_src;
  return TileRows{0, 0, l1_src, static_cast<int>(left < 0 ? 0 : min64(left, kTile))};
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

// kRows (quantize_rows_and_grouped_t, bfloat16): L1 of the same rows in the same pass. The
// chunks of a 128-column block (2j, 2j + 1) go to two tile buffers (vector j of row r stored at
// j ^ (r % 8), so that the L1 step's row reads are free of bank conflicts; a padded row would
// not fit in the 48 KB of static shared memory); after the second, threads
// (half h, row r) take the row's 64 columns of buffer h: the row maximum of its 128 columns,
// its L1 scale and 64 e4m3 bytes of q. The tile buffers then hold the L1 rows of the tile
// (TileRows), and step 2 masks out rows past the group's (none of a padding tile's rows is L3's).
template <typename T, bool kRows>
__global__ void __launch_bounds__(kThreads)
    quantize_grouped_t_kernel(const T* __restrict__ x, const int32_t* __restrict__ gs,
                              uint8_t* __restrict__ qt, float* __restrict__ s,
                              uint8_t* __restrict__ q1, float* __restrict__ s1_t, int64_t rows,
                              int64_t cols, int64_t e, int64_t rp) {
  constexpr int VEC = 16 / sizeof(T);                 // values per 16-byte vector
  constexpr int ROW_THREADS = kL3Cols / VEC;          // threads per row in step 1
  constexpr int PASS_ROWS = kThreads / ROW_THREADS;   // rows per pass in step 1
  constexpr int BUFS = kRows ? 2 : 1;
  static_assert(!kRows || (kThreads == 2 * kTile && kL3Chunks % 2 == 0 && 2 * kL3Cols == kTile &&
                           ROW_THREADS == 8),
                "the L1 step: one thread per row and half of a 128-column block");
  auto swz = [](int row) { return kRows ? row % 8 : 0; };  // the vector swizzle of a row
  using V = Vec<T, VEC>;
  __shared__ V tile[BUFS][kTile][ROW_THREADS];
  __shared__ float col_max[kL3Quarters][kL3Cols];
  __shared__ __align__(16) uint8_t out[kL3Cols][kL3OutStride];
  const int64_t pt = blockIdx.x;
  const TileRows t = find_tile_rows(gs, e, rows, pt * kTile);
  const int64_t load_src = kRows ? t.l1_src : t.src;
  const int load_count = kRows ? t.l1_count : t.count;
  const int lv = threadIdx.x % ROW_THREADS, lr = threadIdx.x / ROW_THREADS;  // step 1
  const int c = threadIdx.x % kL3Cols, q = threadIdx.x / kL3Cols;            // step 2
  const int64_t chunks = cols / kL3Cols;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kL3Chunks;
  for (int64_t k = k0; k < k0 + kL3Chunks && k < chunks; ++k) {  // uniform over the block
    const int64_t c0 = k * kL3Cols;
    const int b = kRows ? static_cast<int>(k % 2) : 0;
#pragma unroll
    for (int pass = 0; pass < kTile / PASS_ROWS; ++pass) {
      const int r = pass * PASS_ROWS + lr;
      V v;
      if (r < load_count) {
        v = reinterpret_cast<const V*>(x + (load_src + r) * cols + c0)[lv];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = from_f32<T>(0.f);
      }
      tile[b][r][lv ^ swz(r)] = v;
    }
    __syncthreads();
    // column c of the chunk; rows past the group's are zero for L3
    auto at = [&](int row) {
      const T* p = reinterpret_cast<const T*>(&tile[b][row][0]);
      const float v = to_f32(p[((c / VEC) ^ swz(row)) * VEC + c % VEC]);
      return !kRows || row < t.count ? v : 0.f;
    };
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kL3Rows; ++i) amax = fmaxf(amax, fabsf(at(q * kL3Rows + i)));
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
      for (int i = 0; i < 16; ++i) o.v[i] = to_e4m3(at(q * kL3Rows + i0 + i), inv);
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
    if constexpr (kRows) {
      if (b == 1) {  // both halves of the 128-column block [c0 - 64, c0 + 64) are in
        const int h = threadIdx.x / kTile, r = threadIdx.x % kTile;
        float v[kL3Cols];
        float rmax = 0.f;
#pragma unroll
        for (int j = 0; j < ROW_THREADS; ++j) {
          const V p = tile[h][r][j ^ swz(r)];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            v[j * VEC + i] = to_f32(p.v[i]);
            rmax = fmaxf(rmax, fabsf(v[j * VEC + i]));
          }
        }
        float* row_max = &col_max[0][0];  // free since the barrier before the qt stores
        row_max[h * kTile + r] = rmax;
        __syncthreads();
        rmax = fmaxf(row_max[r], row_max[kTile + r]);
        if (r < t.l1_count) {
          const float rs = tile_scale(rmax), rinv = reciprocal(rs);
          const int64_t row = t.l1_src + r, cb = c0 - kL3Cols;
          uint8_t* dst = q1 + row * cols + cb + h * kL3Cols;
#pragma unroll
          for (int i0 = 0; i0 < kL3Cols; i0 += 16) {
            Vec<uint8_t, 16> o;
#pragma unroll
            for (int i = 0; i < 16; ++i) o.v[i] = to_e4m3(v[i0 + i], rinv);
            *reinterpret_cast<Vec<uint8_t, 16>*>(dst + i0) = o;
          }
          if (h == 0) s1_t[cb / kTile * rows + row] = rs;
        }
        __syncthreads();  // the next chunk loads into buffer 0, read above
      }
    }
    // otherwise the next chunk writes tile, col_max and out only after two more barriers
  }
}

// ------------------------------------------------------------------------------ handlers

// The checks of L3's operands (and of L1's with rows_too) and the launch grid.
ffi::Error check_grouped(const char* op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& gs,
                         const ffi::AnyBuffer& qt, const ffi::Buffer<ffi::F32>& s, int64_t* rp,
                         dim3* grid) {
  if (x.dimensions().size() != 2) {
    return MOE_INVALID(std::string(op) + ": x must be [R, C], got " + dims_text(x));
  }
  if (!is_float(x)) return MOE_INVALID(std::string(op) + ": x must be float32 or bfloat16");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t e = static_cast<int64_t>(gs.element_count());
  if (cols % kTile) {
    return MOE_INVALID(std::string(op) + ": C=" + std::to_string(cols) +
                       " must be a multiple of 128");
  }
  if (e < 1) return MOE_INVALID(std::string(op) + ": group_sizes must be [E] with E >= 1");
  *rp = ceil_div(rows + (kTile - 1) * e, kTile) * kTile;
  const auto qd = qt.dimensions();
  if (qt.element_type() != ffi::F8E4M3FN || qd.size() != 2 || qd[0] != cols || qd[1] != *rp) {
    return MOE_INVALID(std::string(op) + ": qt must be float8_e4m3fn [C=" +
                       std::to_string(cols) + ", Rp=" + std::to_string(*rp) +
                       "], Rp = round_up(R + 127 E, 128)");
  }
  if (s.element_count() != static_cast<size_t>(*rp / kTile * cols)) {
    return MOE_INVALID(std::string(op) + ": s must be [Rp/128, C] float32");
  }
  const int64_t slice_blocks = ceil_div(cols / kL3Cols, kL3Chunks);
  if (*rp / kTile > INT32_MAX || slice_blocks > 65535) {
    return MOE_INVALID(std::string(op) + ": x " + dims_text(x) + " is too large for the grid");
  }
  *grid = dim3(static_cast<unsigned>(*rp / kTile), static_cast<unsigned>(slice_blocks));
  return ffi::Error::Success();
}

ffi::Error QuantizeRowsGroupedTImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> qt,
                                    ffi::Result<ffi::Buffer<ffi::F32>> s) {
  int64_t rp = 0;
  dim3 grid;
  ffi::Error bad = check_grouped("fp8 quantize rows grouped t", x, group_sizes, *qt, *s, &rp, &grid);
  if (bad.failure()) return bad;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (cols == 0) return ffi::Error::Success();
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  if (x.element_type() == ffi::F32) {
    quantize_grouped_t_kernel<float, false><<<grid, kThreads, 0, stream>>>(
        static_cast<const float*>(x.untyped_data()), group_sizes.typed_data(), qtp,
        s->typed_data(), nullptr, nullptr, rows, cols, e, rp);
  } else {
    quantize_grouped_t_kernel<__nv_bfloat16, false><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x.untyped_data()), group_sizes.typed_data(), qtp,
        s->typed_data(), nullptr, nullptr, rows, cols, e, rp);
  }
  MOE_LAUNCH_CHECK("fp8_quantize_rows_grouped_t");
  return ffi::Error::Success();
}

// L1 and L3 of one bfloat16 x in one pass: the backward's activation gradients, which the dgrad
// reads as L1 and the wgrad as L3 (float32 x: the two kernels, ops.fp8_quant decides).
ffi::Error QuantizeRowsAndGroupedTImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                       ffi::Buffer<ffi::S32> group_sizes,
                                       ffi::Result<ffi::AnyBuffer> q,
                                       ffi::Result<ffi::Buffer<ffi::F32>> s_t,
                                       ffi::Result<ffi::AnyBuffer> qt,
                                       ffi::Result<ffi::Buffer<ffi::F32>> s) {
  const char* op = "fp8 quantize rows and grouped t";
  int64_t rp = 0;
  dim3 grid;
  ffi::Error bad = check_grouped(op, x, group_sizes, *qt, *s, &rp, &grid);
  if (bad.failure()) return bad;
  if (x.element_type() != ffi::BF16) {
    return MOE_INVALID(std::string(op) + ": x must be bfloat16 (float32: quantize_rows and "
                       "quantize_rows_grouped_t)");
  }
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t e = static_cast<int64_t>(group_sizes.element_count());
  if (q->element_type() != ffi::F8E4M3FN || q->element_count() != x.element_count() ||
      s_t->element_count() != static_cast<size_t>(cols / kTile * rows)) {
    return MOE_INVALID(std::string(op) + ": q must be float8_e4m3fn [R, C], s_t [C/128, R]");
  }
  if (cols == 0) return ffi::Error::Success();
  quantize_grouped_t_kernel<__nv_bfloat16, true><<<grid, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x.untyped_data()), group_sizes.typed_data(),
      static_cast<uint8_t*>(qt->untyped_data()), s->typed_data(),
      static_cast<uint8_t*>(q->untyped_data()), s_t->typed_data(), rows, cols, e, rp);
  MOE_LAUNCH_CHECK("fp8_quantize_rows_and_grouped_t");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeFp8QuantizeRowsGroupedT, moe::QuantizeRowsGroupedTImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [R, C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()              // qt [C, Rp] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s [Rp/128, C]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeFp8QuantizeRowsAndGroupedT, moe::QuantizeRowsAndGroupedTImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [R, C] bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()              // q [R, C] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // s_t [C/128, R]
                                  .Ret<xla::ffi::AnyBuffer>()              // qt [C, Rp] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),  // s [Rp/128, C]
                              {xla::ffi::Traits::kCmdBufferCompatible});
