// One GPT transformer layer's forward + backward on the host (models/gpt_kernels.h) per storage
// type: the fp32 path against the 16-bit paths (issue 13), which round at the GPU's rounding
// points and widen 16-bit GEMM operands to fp32.
//
//   BM_LayerForwardBackward/<preset>/<dtype>
//
// <preset>: 0 = small (C = 128, H = 4, T = 64, B = 8), 1 = wide (C = 768, H = 12, T = 256,
// B = 2). <dtype>: 0 = fp32, 1 = fp16, 2 = bf16 (DType values). One iteration is GptLayerForward
// then GptLayerBackward (which recomputes the forward). GFLOP/s counts model FLOPs, 3x the
// forward: 3 (24 N C^2 + 2 B T^2 C) for N = B T tokens (dense products, causal attention), not
// the recomputation. Wall-clock time; the work runs on oneTBB workers.
//   bench_gpt_block_host --benchmark_min_time=0.5 --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true   (one command line)
#include <benchmark/benchmark.h>
#include <tbb/info.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gpu/host/host_gemm.h"
#include "models/gpt_kernels.h"

namespace strata::models {
namespace {

struct Preset {
  GptShape shape;
  int B, T;
};

Preset PresetOf(int64_t i) {
  if (i == 0) return {{256, 64, 1, 4, 128}, 8, 64};
  return {{256, 256, 1, 12, 768}, 2, 256};
}

template <typename S>
std::vector<S> RandomStorage(size_t n, double amplitude, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-amplitude, amplitude);
  std::vector<S> v(n);
  for (S& x : v) x = FromFloat<S>(u(gen));
  return v;
}

template <typename S>
void Run(benchmark::State& state, const Preset& p) {
  const GptShape& s = p.shape;
  const int64_t N = int64_t{p.B} * p.T, C = s.channels;
  // Weights at the scale of a trained layer (unit-variance outputs), activations O(1).
  const std::vector<S> params = RandomStorage<S>(LayerNumParams(s), 0.05, 1);
  const std::vector<S> x = RandomStorage<S>(N * C, 1.0, 2);
  const std::vector<S> dy = RandomStorage<S>(N * C, 1.0, 3);
  std::vector<S> y(N * C), dx(N * C), grads(params.size());
  std::vector<double> scratch((GptLayerScratchBytes<S>(s, p.B, p.T) + 7) / 8);
  for (auto _ : state) {
    GptLayerForward<S>(s, params.data(), x.data(), y.data(), p.B, p.T, scratch.data());
    GptLayerBackward<S>(s, params.data(), x.data(), dy.data(), dx.data(), grads.data(), p.B, p.T,
                        scratch.data());
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  const double flops = 3.0 * (24.0 * N * C * C + 2.0 * p.B * static_cast<double>(p.T) * p.T * C);
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(N * state.iterations()), benchmark::Counter::kIsRate);
}

void BM_LayerForwardBackward(benchmark::State& state) {
  const Preset p = PresetOf(state.range(0));
  DispatchDType(static_cast<DType>(state.range(1)), [&]<typename S>() { Run<S>(state, p); });
}

BENCHMARK(BM_LayerForwardBackward)
    ->ArgsProduct({{0, 1}, {0, 1, 2}})
    ->ArgNames({"preset", "dtype"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace strata::models

int main(int argc, char** argv) {
  benchmark::AddCustomContext("backend", "host");
  benchmark::AddCustomContext("gemm_isa",
                              strata::gpu::host::GemmIsaName(strata::gpu::host::BestGemmIsa()));
  benchmark::AddCustomContext("threads", std::to_string(tbb::info::default_concurrency()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
