// FP8 quantization of weights into L2's 128 x 128 blocks (fp8_quant.cuh: the recipe;
// moe_praxis/ops/fp8_quant.py: the layouts and the reference this kernel equals bitwise):
//
//   moe_fp8_quantize_weight  L2: w [E, K, N] -> q [E, K, N], qt [E, N, K], s [E, K/128, N/128]
//
// One pass over the input: one block per 128 x 128 tile, threads holding two columns of 16
// rows, q and qt each staged in shared memory and written in whole 128-byte rows.
#include "fp8_quant.cuh"

namespace moe {
namespace {

using namespace fp8q;

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

// ------------------------------------------------------------------------------ handler

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
