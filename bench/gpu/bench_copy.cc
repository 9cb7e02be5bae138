// Pinned host <-> GPU copy bandwidth through the Stream API of the CUDA backend, against a
// plain cudaMemcpyAsync loop on raw streams in the same program (the baseline: the
// difference is what the Stream layer costs).
//
//   BM_StreamCopy/<dir>/<bytes>  gpu::Stream::CopyH2D / CopyD2H
//   BM_RawCopy/<dir>/<bytes>     cudaMemcpyAsync on a cudaStreamNonBlocking stream
//
// <dir>: 0 = H2D, 1 = D2H, 2 = both at once (H2D and D2H on two streams; bytes_per_second
// counts both directions). Each iteration enqueues 8 copies of <bytes> per direction and
// waits for them; time is wall-clock. Host memory is pinned (cudaHostAlloc), device
// memory one arena. Reported as medians of 5 repetitions (mean, median, stddev, cv).
//   bench_copy --benchmark_out=copy.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/bench_common.h"
#include "gpu/cuda/cuda_native.h"

namespace strata::gpu::bench {
namespace {

constexpr int kCopiesPerIteration = 8;

void BM_StreamCopy(benchmark::State& state) {
  GpuContext& gpu = Gpu();
  if (!gpu.device) {
    state.SkipWithError(gpu.why_not.c_str());
    return;
  }
  Device& dev = *gpu.device;
  const int dir = static_cast<int>(state.range(0));
  const size_t bytes = static_cast<size_t>(state.range(1));
  auto arena = dev.CreateArena(2 * bytes);
  auto host_in = dev.AllocatePinned(bytes, "h2d source");
  auto host_out = dev.AllocatePinned(bytes, "d2h destination");
  auto h2d = dev.CreateStream("h2d");
  auto d2h = dev.CreateStream("d2h");
  if (!arena.ok() || !host_in.ok() || !host_out.ok() || !h2d.ok() || !d2h.ok()) {
    state.SkipWithError("could not set up buffers and streams");
    return;
  }
  DeviceSpan a = *(*arena)->Carve(bytes, "a");
  DeviceSpan b = *(*arena)->Carve(bytes, "b");
  std::memset(host_in->data(), 1, bytes);
  for (auto _ : state) {
    for (int i = 0; i < kCopiesPerIteration; ++i) {
      if (dir != 1 && !(*h2d)->CopyH2D(a, host_in->span()).ok()) state.SkipWithError("H2D failed");
      if (dir != 0 && !(*d2h)->CopyD2H(host_out->span(), b).ok()) state.SkipWithError("D2H failed");
    }
    if (!(*h2d)->Synchronize().ok() || !(*d2h)->Synchronize().ok()) {
      state.SkipWithError("synchronize failed");
    }
  }
  state.SetBytesProcessed(state.iterations() * kCopiesPerIteration * bytes * (dir == 2 ? 2 : 1));
}

void BM_RawCopy(benchmark::State& state) {
  GpuContext& gpu = Gpu();
  if (!gpu.device) {
    state.SkipWithError(gpu.why_not.c_str());
    return;
  }
  const int dir = static_cast<int>(state.range(0));
  const size_t bytes = static_cast<size_t>(state.range(1));
  void *host_in = nullptr, *host_out = nullptr, *a = nullptr, *b = nullptr;
  cudaStream_t h2d = nullptr, d2h = nullptr;
  bool ok = cudaSetDevice(0) == cudaSuccess &&
            cudaHostAlloc(&host_in, bytes, cudaHostAllocPortable) == cudaSuccess &&
            cudaHostAlloc(&host_out, bytes, cudaHostAllocPortable) == cudaSuccess &&
            cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
            cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking) == cudaSuccess &&
            cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking) == cudaSuccess;
  if (!ok) state.SkipWithError("could not set up raw CUDA buffers and streams");
  if (ok) std::memset(host_in, 1, bytes);
  for (auto _ : state) {
    for (int i = 0; i < kCopiesPerIteration; ++i) {
      if (dir != 1) cudaMemcpyAsync(a, host_in, bytes, cudaMemcpyHostToDevice, h2d);
      if (dir != 0) cudaMemcpyAsync(host_out, b, bytes, cudaMemcpyDeviceToHost, d2h);
    }
    if (cudaStreamSynchronize(h2d) != cudaSuccess || cudaStreamSynchronize(d2h) != cudaSuccess) {
      state.SkipWithError("a raw copy failed");
    }
  }
  state.SetBytesProcessed(state.iterations() * kCopiesPerIteration * bytes * (dir == 2 ? 2 : 1));
  if (h2d) cudaStreamDestroy(h2d);
  if (d2h) cudaStreamDestroy(d2h);
  cudaFree(a);
  cudaFree(b);
  cudaFreeHost(host_in);
  cudaFreeHost(host_out);
}

void CopyArgs(benchmark::internal::Benchmark* b) {
  for (int dir : {0, 1, 2}) {
    for (int64_t bytes : {int64_t{1} << 20, int64_t{16} << 20, int64_t{256} << 20}) {
      b->Args({dir, bytes});
    }
  }
  b->ArgNames({"dir", "bytes"})->UseRealTime()->Repetitions(5)->ReportAggregatesOnly(true);
}

BENCHMARK(BM_StreamCopy)->Apply(CopyArgs);
BENCHMARK(BM_RawCopy)->Apply(CopyArgs);

}  // namespace
}  // namespace strata::gpu::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  strata::gpu::bench::Gpu();  // context lines before the first result
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
