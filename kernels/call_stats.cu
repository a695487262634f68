// Call statistics for tests: how many grouped GEMM handler calls ran, and how many of them ran
// while their stream was being captured into a CUDA graph (XLA command buffers record FFI
// handlers that declare kCmdBufferCompatible by stream capture). Read through ctypes by
// moe_praxis.ops._library.call_stats(); a relaxed atomic add and cudaStreamIsCapturing per call.
#include <cuda_runtime.h>

#include <atomic>

namespace {
std::atomic<long long> g_calls{0};
std::atomic<long long> g_captured{0};
}  // namespace

extern "C" {

void moe_praxis_note_stream(cudaStream_t stream) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusActive) {
    g_captured.fetch_add(1, std::memory_order_relaxed);
  }
}

long long moe_praxis_stream_calls() { return g_calls.load(std::memory_order_relaxed); }

long long moe_praxis_captured_calls() { return g_captured.load(std::memory_order_relaxed); }

}  // extern "C"
