// Standalone timing of the aux-loss kernels' variants and of size-matched memory floors
// (T = 16384, E = 64, f32 probs, int32 counts: the bench_kernels sizes). Not part of the
// library: the experiment behind the aux-loss launch shapes in kernels/aux_loss.cu and the
// latency floor in docs/kernels.md.
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/sov benchmarks/small_op_variants.cu && /tmp/sov
// Three timings per variant, each the median of 7 batches:
//   b2b   - 200 launches back to back between two events, per launch (launch-rate bound at
//           this size: an empty kernel measured 3.5 us);
//   graph - the same 200 launches captured in one CUDA graph, per launch (the gaps shrink:
//           closest to the kernel's duration);
//   one   - one launch between two events (includes the event overhead, ~2 us).
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int T = 16384, E = 64;
constexpr int64_t N = int64_t(T) * E;  // 1 Mi floats = 4 MiB

__device__ __forceinline__ int col_mod(int64_t i, int e) {
  return static_cast<int>(static_cast<uint32_t>(i) % static_cast<uint32_t>(e));
}

// ---- aux bwd variants: dp[t, e] = g * scale * f[e]
template <int THREADS, int PER, bool POW2, bool CONST_SCALE = false>
__global__ void __launch_bounds__(THREADS)
    bwd(const float* g, const int* f, const float* scale, float* dp, int64_t n, int e) {
  // CONST_SCALE: g * scale a compile-time constant, as XLA's reference has it under jax.grad
  // (the cotangent 1 and the scale folded into its broadcast fusion, which reads only f)
  const float s = CONST_SCALE ? 0.01f : g[0] * scale[0];
  const int64_t nvec = n / 4;
  const int64_t base = (int64_t)blockIdx.x * THREADS * PER + threadIdx.x;
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int64_t i = base + q * THREADS;
    if (i < nvec) {
      const int col = POW2 ? static_cast<int>((i * 4) & (e - 1)) : col_mod(i * 4, e);
      const int4 fv = *reinterpret_cast<const int4*>(f + col);
      reinterpret_cast<float4*>(dp)[i] = make_float4(s * fv.x, s * fv.y, s * fv.z, s * fv.w);
    }
  }
}
// floor: write a constant (no loads at all)
template <int THREADS>
__global__ void __launch_bounds__(THREADS) fill(float* dp, int64_t nvec) {
  const int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
  if (i < nvec) reinterpret_cast<float4*>(dp)[i] = make_float4(1.f, 2.f, 3.f, 4.f);
}
// floor: copy (read 4 MiB, write 4 MiB)
template <int THREADS>
__global__ void __launch_bounds__(THREADS) copy(const float* a, float* b, int64_t nvec) {
  const int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
  if (i < nvec) reinterpret_cast<float4*>(b)[i] = reinterpret_cast<const float4*>(a)[i];
}

// ---- aux fwd: partials + finish (current), and the floors
template <int THREADS>
__device__ __forceinline__ float block_sum(float acc) {
  __shared__ float ws[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = acc;
  __syncthreads();
  acc = 0.f;
  if (threadIdx.x < 32) {
    acc = threadIdx.x < THREADS / 32 ? ws[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  }
  return acc;
}
// this block's share of sum p[t, e] * f[e] (grid-stride over float4s), valid in thread 0
template <int THREADS>
__device__ float block_dot(const float* p, const int* f, int64_t n, int e) {
  float acc = 0.f;
  const int64_t nvec = n / 4, stride = (int64_t)gridDim.x * THREADS;
  for (int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x; i < nvec; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(p)[i];
    const int col = static_cast<int>((i * 4) & (e - 1));
    const int4 fv = *reinterpret_cast<const int4*>(f + col);
    acc += v.x * fv.x + v.y * fv.y + v.z * fv.z + v.w * fv.w;
  }
  acc = block_sum<THREADS>(acc);
  return acc;
}
template <int THREADS, bool PDL>
__global__ void __launch_bounds__(THREADS)
    partials(const float* p, const int* f, float* part, int64_t n, int e) {
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  const float acc = block_dot<THREADS>(p, f, n, e);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}
template <bool PDL>
__global__ void __launch_bounds__(512) finish(const float* part, int num, const float* scale,
                                               float* out) {
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  float acc = threadIdx.x < num ? part[threadIdx.x] : 0.f;
  acc = block_sum<512>(acc);
  if (threadIdx.x == 0) out[0] = acc * scale[0];
}
// one kernel: the last block to finish (a counter the last block resets) adds the partials
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    fused(const float* p, const int* f, float* part, unsigned* counter, const float* scale,
          float* out, int64_t n, int e) {
  const float acc = block_dot<THREADS>(p, f, n, e);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[blockIdx.x] = acc;
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float s = 0.f;
  for (int b = threadIdx.x; b < gridDim.x; b += THREADS) s += ((volatile float*)part)[b];
  s = block_sum<THREADS>(s);
  if (threadIdx.x == 0) {
    out[0] = s * scale[0];
    *counter = 0;
  }
}

cudaStream_t g_stream = 0;  // the stream the variants launch on (a capture stream while timing graphs)
#define S 0, g_stream

template <class F>
void timeit(const char* name, F fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> b2b, one, gr;
  for (int k = 0; k < 3; ++k) fn();
  cudaStream_t cs;
  cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking);
  cudaGraph_t graph;
  cudaGraphExec_t exec = nullptr;
  // capture on cs: fn launches on the legacy stream, so swap it in via a thread-local capture
  cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal);
  g_stream = cs;
  for (int k = 0; k < 200; ++k) fn();
  g_stream = 0;
  cudaStreamEndCapture(cs, &graph);
  if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) exec = nullptr;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(a);
    for (int k = 0; k < 200; ++k) fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    b2b.push_back(ms * 1000.f / 200);
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    one.push_back(ms * 1000.f);
    if (exec) {
      cudaGraphLaunch(exec, cs);
      cudaEventRecord(a, cs);
      cudaGraphLaunch(exec, cs);
      cudaEventRecord(b, cs);
      cudaEventSynchronize(b);
      cudaEventElapsedTime(&ms, a, b);
      gr.push_back(ms * 1000.f / 200);
    }
  }
  if (gr.empty()) gr.assign(7, -1.f);
  std::sort(gr.begin(), gr.end());
  std::sort(b2b.begin(), b2b.end());
  std::sort(one.begin(), one.end());
  const cudaError_t err = cudaGetLastError();
  printf("%-46s b2b %7.2f  graph %7.2f  one %7.2f us  %s\n", name, b2b[3], gr[3], one[3],
         err == cudaSuccess ? "" : cudaGetErrorString(err));
}

template <int THREADS, int PER, bool POW2, bool CONST_SCALE = false>
void time_bwd(const char* name, const float* g, const int* f, const float* scale, float* dp) {
  constexpr int64_t per_block = int64_t(THREADS) * PER;
  const auto grid = static_cast<unsigned>((N / 4 + per_block - 1) / per_block);
  timeit(name, [&] { bwd<THREADS, PER, POW2, CONST_SCALE><<<grid, THREADS, S>>>(g, f, scale, dp, N, E); });
}

int main() {
  float *p, *dp, *g, *scale, *out, *part, *big_a, *big_b;
  int* f;
  unsigned* counter;
  cudaMalloc(&p, N * 4);
  cudaMalloc(&dp, N * 4);
  cudaMalloc(&f, E * 4);
  cudaMalloc(&g, 4);
  cudaMalloc(&scale, 4);
  cudaMalloc(&out, 4);
  cudaMalloc(&part, 4096 * 4);
  cudaMalloc(&counter, 4);
  cudaMemset(counter, 0, 4);
  cudaMemset(p, 0, N * 4);
  cudaMemset(f, 0, E * 4);
  const size_t big = size_t(1) << 30;  // 1 GiB each: the large-size copy bandwidth
  cudaMalloc(&big_a, big);
  cudaMalloc(&big_b, big);
  const int64_t nvec = N / 4;
  printf("T=%d E=%d: probs %.2f MiB\n", T, E, N * 4 / 1048576.0);
  timeit("copy 1 GiB (large-size copy bandwidth)", [&] {
    copy<256><<<(big / 16 + 255) / 256, 256, S>>>(big_a, big_b, big / 16);
  });
  timeit("floor: cudaMemsetAsync 4 MiB", [&] { cudaMemsetAsync(dp, 0, N * 4, g_stream); });
  timeit("floor: fill 4 MiB (write only, 256 thr)", [&] {
    fill<256><<<(nvec + 255) / 256, 256, S>>>(dp, nvec);
  });
  timeit("floor: fill 4 MiB (write only, 512 thr)", [&] {
    fill<512><<<(nvec + 511) / 512, 512, S>>>(dp, nvec);
  });
  timeit("floor: copy 4 MiB -> 4 MiB", [&] { copy<256><<<(nvec + 255) / 256, 256, S>>>(p, dp, nvec); });
  timeit("floor: empty kernel", [&] { fill<32><<<1, 32, S>>>(dp, 0); });
  time_bwd<256, 1, false>("bwd: current (256 thr, 1 vec, modulo)", g, f, scale, dp);
  time_bwd<256, 1, true>("bwd: 256 thr, 1 vec, pow2 mask", g, f, scale, dp);
  time_bwd<512, 1, true>("bwd: 512 thr, 1 vec, pow2", g, f, scale, dp);
  time_bwd<128, 1, true>("bwd: 128 thr, 1 vec, pow2", g, f, scale, dp);
  time_bwd<1024, 1, true>("bwd: 1024 thr, 1 vec, pow2", g, f, scale, dp);
  time_bwd<256, 2, true>("bwd: 256 thr, 2 vec, pow2", g, f, scale, dp);
  time_bwd<256, 4, true>("bwd: 256 thr, 4 vec, pow2", g, f, scale, dp);
  time_bwd<256, 1, false, true>("bwd: current, g * scale a constant", g, f, scale, dp);
  time_bwd<128, 1, true, true>("bwd: XLA's shape (128 thr), constant", g, f, scale, dp);
  time_bwd<256, 1, false>("bwd: current, again", g, f, scale, dp);
  for (int grid : {132, 264, 512}) {
    char nm[80];
    snprintf(nm, sizeof nm, "fwd: partials %dx512 + finish (current: 264)", grid);
    timeit(nm, [&] {
      partials<512, false><<<grid, 512, S>>>(p, f, part, N, E);
      finish<false><<<1, 512, S>>>(part, grid, scale, out);
    });
    snprintf(nm, sizeof nm, "fwd: partials %dx512 only", grid);
    timeit(nm, [&] { partials<512, false><<<grid, 512, S>>>(p, f, part, N, E); });
    snprintf(nm, sizeof nm, "fwd: partials %dx512 + finish, PDL", grid);
    timeit(nm, [&] {
      partials<512, true><<<grid, 512, S>>>(p, f, part, N, E);
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = 1;
      cfg.blockDim = 512;
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = at;
      cfg.numAttrs = 1;
      cfg.stream = g_stream;
      cudaLaunchKernelEx(&cfg, finish<true>, (const float*)part, grid, (const float*)scale, out);
    });
    snprintf(nm, sizeof nm, "fwd: one kernel %dx512, last block adds", grid);
    timeit(nm, [&] { fused<512><<<grid, 512, S>>>(p, f, part, counter, scale, out, N, E); });
  }
  for (int grid : {512, 1024, 2048}) {
    char nm[80];
    snprintf(nm, sizeof nm, "fwd: one kernel %dx256, last block adds", grid);
    timeit(nm, [&] { fused<256><<<grid, 256, S>>>(p, f, part, counter, scale, out, N, E); });
  }
  const cudaError_t e = cudaDeviceSynchronize();
  printf("status %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
