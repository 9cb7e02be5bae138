// Throughput of one GPT transformer layer on the CUDA backend (models/cuda/gpt_cuda.h):
// forward, and backward (which recomputes the forward, as the engine runs it).
//
//   BM_GptCudaLayer/<preset>/<pass>/<T>/<dtype>
//
// <preset>: 0 = gpt2-124m (C = 768, 12 heads), 1 = gpt2-1.5b (C = 1600, 25 heads);
// <pass>: 0 = forward, 1 = backward; <T>: sequence length; B = 8192 / T sequences (8192
// tokens per micro-batch); <dtype>: 0 = fp32 (exact fp32 products), 1 = bf16. Parameters,
// activations and scratch are device memory of that storage type (the arena), filled with
// small values. Time between CUDA events around 5 calls (manual time); tokens/s and TFLOP/s
// (the matrix products only: 24 B T C^2 for the linear layers plus 2 B T^2 C for causal
// attention per forward; a backward is counted as three forwards: the recomputed forward and
// twice its products) as counters; medians of 5 repetitions. Without a GPU each case reports
// the reason (SkipWithError).
//   bench_gpt_cuda --benchmark_out=gpt_cuda.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "base/dtype.h"
#include "bench/gpu/bench_common.h"
#include "gpu/cuda/cuda_native.h"
#include "models/cuda/gpt_cuda.h"
#include "models/gpt.h"

namespace strata::models {
namespace {

constexpr int kCallsPerIteration = 5;
constexpr int64_t kTokens = 8192;

template <typename S>
void RunLayer(benchmark::State& state) {
  gpu::bench::GpuContext& ctx = gpu::bench::Gpu();
  if (!ctx.device) {
    state.SkipWithError(ctx.why_not.c_str());
    return;
  }
  auto shape_or = GptPreset(state.range(0) == 0 ? "gpt2-124m" : "gpt2-1.5b");
  const bool backward = state.range(1) == 1;
  const int T = static_cast<int>(state.range(2));
  const int B = static_cast<int>(kTokens / T);
  const GptShape s = *shape_or;
  const int64_t C = s.channels, N = int64_t{B} * T;
  const int64_t params = LayerNumParams(s), act = N * C;
  const int64_t e = sizeof(S), scratch_bytes = cuda::GptCudaLayerScratchBytes<S>(s, B, T);
  auto stream_or = ctx.device->CreateStream("bench");
  auto arena_or = ctx.device->CreateArena((2 * params + 4 * act) * e + scratch_bytes + 8 * 4096);
  if (!stream_or.ok() || !arena_or.ok()) {
    state.SkipWithError(!stream_or.ok() ? stream_or.status().ToString().c_str()
                                        : arena_or.status().ToString().c_str());
    return;
  }
  gpu::Stream& stream = **stream_or;
  gpu::DeviceArena& arena = **arena_or;
  auto carve = [&](int64_t elems) { return arena.Carve(elems * e, "bench")->as<S>(); };
  S* p = carve(params);
  S* g = carve(params);
  S* x = carve(act);
  S* y = carve(act);
  S* dy = carve(act);
  S* dx = carve(act);
  void* sc = arena.Carve(scratch_bytes, "bench")->as<void>();
  // Small finite values: 0x3c3c reads as ~0.0115 in bf16, 0x3c3c3c3c as ~0.0115 in fp32 (the
  // arena starts zeroed, which would make LayerNorm divide a zero variance by eps only).
  const cudaStream_t cs = gpu::NativeStream(stream);
  if (Status st = cuda::GptCudaPrepareStream(stream); !st.ok()) {
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  for (S* buf : {p, x, dy}) {
    const int64_t n = buf == p ? params : act;
    if (cudaMemsetAsync(buf, 0x3c, n * e, cs) != cudaSuccess) {
      state.SkipWithError("cudaMemsetAsync failed");
      return;
    }
  }
  auto run = [&]() -> Status {
    return backward ? cuda::GptCudaLayerBackward<S>(s, stream, p, x, dy, dx, g, B, T, sc)
                    : cuda::GptCudaLayerForward<S>(s, stream, p, x, y, B, T, sc);
  };
  if (Status st = run(); !st.ok() || !(st = stream.Synchronize()).ok()) {  // warm-up
    state.SkipWithError(st.ToString().c_str());
    return;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (auto _ : state) {
    cudaEventRecord(start, cs);
    for (int i = 0; i < kCallsPerIteration; ++i) {
      if (Status st = run(); !st.ok()) {
        state.SkipWithError(st.ToString().c_str());
        break;
      }
    }
    cudaEventRecord(stop, cs);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double fwd_flops = 24.0 * N * C * C + 2.0 * B * double(T) * T * C;
  const double flops = (backward ? 3.0 : 1.0) * fwd_flops * kCallsPerIteration;
  state.counters["tokens_per_s"] = benchmark::Counter(
      double(N) * kCallsPerIteration, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["TFLOP_per_s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(backward ? "backward" : "forward") + " " +
                 std::string(DTypeName(DTypeOf<S>())) + " B=" + std::to_string(B) +
                 " T=" + std::to_string(T));
}

void BM_GptCudaLayer(benchmark::State& state) {
  if (state.range(3) == 0) {
    RunLayer<float>(state);
  } else {
    RunLayer<Bf16>(state);
  }
}

BENCHMARK(BM_GptCudaLayer)
    ->ArgsProduct({{0, 1}, {0, 1}, {256, 1024}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
}  // namespace strata::models

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  strata::gpu::bench::Gpu();  // context lines before the first result
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
