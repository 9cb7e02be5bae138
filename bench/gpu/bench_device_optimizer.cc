// The device optimizer's kernels (engine/device_optimizer.h) on the CUDA backend, against a plain
// device-to-device cudaMemcpyAsync of the same bytes (the roofline: an update only streams its
// buffers once, so it cannot beat a copy of them).
//
//   BM_DeviceUpdate/<kind>/<n>   EnqueueDeviceUpdate, bf16 gradient, bf16 copy-out; kind 0 AdamW,
//                                1 Lion, 2 SGD with momentum, 3 Adagrad. Bytes per element: master
//                                and each fp32 state section read and written (8 each), gradient
//                                read (2), working params written (2): AdamW 28, the others 20.
//   BM_DeviceGradStats/<n>       EnqueueDeviceGradStats over a bf16 gradient (2 B/element).
//   BM_DeviceGradAccumulate/<n>  EnqueueDeviceGradAccumulate, bf16 into fp32 (10 B/element).
//   BM_DeviceCopy/<bytes>        cudaMemcpyAsync D2D of <bytes>/2 (reads + writes = <bytes>).
//
// Each iteration enqueues 10 calls on one stream and waits; time is wall-clock; bytes_per_second
// counts what the kernels read and write; items_per_second are parameters. Medians of 5 runs.
//   bench_device_optimizer --benchmark_out=devopt.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "bench/gpu/bench_common.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/device_optimizer.h"
#include "gpu/cuda/cuda_native.h"

namespace strata::gpu::bench {
namespace {

constexpr int kCallsPerIteration = 10;

cpu_optim::AnyOptimizer Kind(int64_t kind) {
  using cpu_optim::OptimizerKind;
  switch (kind) {
    case 1:
      return {OptimizerKind::kLion, cpu_optim::LionConfig{}};
    case 2:
      return {OptimizerKind::kSgd, cpu_optim::SgdConfig{.lr = 0.01f, .momentum = 0.9f}};
    case 3:
      return {OptimizerKind::kAdagrad, cpu_optim::AdagradConfig{}};
    default:
      return {OptimizerKind::kAdamW, cpu_optim::AdamWConfig{.weight_decay = 0.01f}};
  }
}

// An arena of `bytes` and a stream, zero-filled; false (and SkipWithError) when not possible.
struct Setup {
  std::unique_ptr<DeviceArena> arena;
  std::unique_ptr<Stream> stream;
  bool Make(benchmark::State& state, size_t bytes) {
    GpuContext& gpu = Gpu();
    if (!gpu.device) {
      state.SkipWithError(gpu.why_not.c_str());
      return false;
    }
    auto a = gpu.device->CreateArena(bytes);
    auto s = gpu.device->CreateStream("optimizer");
    if (!a.ok() || !s.ok()) {
      state.SkipWithError("could not set up the arena and the stream");
      return false;
    }
    arena = std::move(*a);
    stream = std::move(*s);
    return true;
  }
  // Device memory filled with random values (no zeros, whose special cases some instructions
  // take apart): fp32 in [0.01, 1) (weights and state: a second moment is never negative), or
  // bf16 in (-1, 1) for gradients.
  DeviceSpan Carve(size_t bytes, DType dtype = DType::kF32) {
    DeviceSpan d = *arena->Carve(bytes, "bench");
    auto pinned = Gpu().device->AllocatePinned(bytes, "bench fill");
    if (!pinned.ok()) return d;
    // 64Ki random values, repeated (drawing every value would take seconds at 2^26 elements).
    std::mt19937 rng(static_cast<uint32_t>(bytes));
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    constexpr size_t kPattern = size_t{1} << 16;
    if (dtype == DType::kF32) {
      float* f = pinned->as<float>();
      for (size_t i = 0; i < bytes / 4; ++i) f[i] = i < kPattern ? u(rng) : f[i % kPattern];
    } else {
      uint16_t* h = pinned->as<uint16_t>();
      for (size_t i = 0; i < bytes / 2; ++i) {
        h[i] = i < kPattern ? FloatToBf16(rng() % 2 ? u(rng) : -u(rng)) : h[i % kPattern];
      }
    }
    // Should the fill fail, the benchmark computes on whatever the memory held: same traffic.
    const bool filled = stream->CopyH2D(d, pinned->span()).ok() && stream->Synchronize().ok();
    static_cast<void>(filled);
    return d;
  }
};

void BM_DeviceUpdate(benchmark::State& state) {
  const cpu_optim::AnyOptimizer o = Kind(state.range(0));
  const int64_t n = state.range(1);
  const std::vector<int64_t> shape = {n};
  const size_t sections = cpu_optim::StateLayout(o, std::span(&shape, 1)).size();
  const size_t bytes_per_elem = 8 + 8 * sections + 2 + 2;
  Setup s;
  if (!s.Make(state, static_cast<size_t>(n) * (4 + 4 * sections + 2 + 2) + (8 << 10))) return;
  engine::DeviceUpdateBuffers b;
  b.num_elems = n;
  b.master = s.Carve(n * 4);
  for (size_t i = 0; i < sections; ++i) b.state.push_back(s.Carve(n * 4));
  b.grad = s.Carve(n * 2, DType::kBF16);
  b.grad_dtype = DType::kBF16;
  b.working = s.Carve(n * 2);
  b.working_dtype = DType::kBF16;
  int64_t step = 0;
  for (auto _ : state) {
    for (int i = 0; i < kCallsPerIteration; ++i) {
      if (!engine::EnqueueDeviceUpdate(*s.stream, o, {.step = ++step}, b).ok()) {
        state.SkipWithError("EnqueueDeviceUpdate failed");
      }
    }
    if (!s.stream->Synchronize().ok()) state.SkipWithError("the update failed");
  }
  state.SetLabel(std::string(cpu_optim::OptimizerKindName(o.kind)));
  state.SetBytesProcessed(state.iterations() * kCallsPerIteration * n * bytes_per_elem);
  state.SetItemsProcessed(state.iterations() * kCallsPerIteration * n);
}

void BM_DeviceGradStats(benchmark::State& state) {
  const int64_t n = state.range(0);
  Setup s;
  if (!s.Make(state, n * 2 + engine::DeviceGradStatsBytes(n) + (4 << 10))) return;
  DeviceSpan grad = s.Carve(n * 2, DType::kBF16);
  DeviceSpan rec = s.Carve(engine::DeviceGradStatsBytes(n));
  for (auto _ : state) {
    for (int i = 0; i < kCallsPerIteration; ++i) {
      if (!engine::EnqueueDeviceGradStats(*s.stream, grad, DType::kBF16, n, 1.0f, rec).ok()) {
        state.SkipWithError("EnqueueDeviceGradStats failed");
      }
    }
    if (!s.stream->Synchronize().ok()) state.SkipWithError("the statistics failed");
  }
  state.SetBytesProcessed(state.iterations() * kCallsPerIteration * n * 2);
  state.SetItemsProcessed(state.iterations() * kCallsPerIteration * n);
}

void BM_DeviceGradAccumulate(benchmark::State& state) {
  const int64_t n = state.range(0);
  Setup s;
  if (!s.Make(state, n * 6 + (4 << 10))) return;
  DeviceSpan acc = s.Carve(n * 4);
  DeviceSpan grad = s.Carve(n * 2, DType::kBF16);
  for (auto _ : state) {
    for (int i = 0; i < kCallsPerIteration; ++i) {
      if (!engine::EnqueueDeviceGradAccumulate(*s.stream, acc, grad, DType::kBF16, n, false).ok()) {
        state.SkipWithError("EnqueueDeviceGradAccumulate failed");
      }
    }
    if (!s.stream->Synchronize().ok()) state.SkipWithError("the accumulation failed");
  }
  state.SetBytesProcessed(state.iterations() * kCallsPerIteration * n * 10);
  state.SetItemsProcessed(state.iterations() * kCallsPerIteration * n);
}

void BM_DeviceCopy(benchmark::State& state) {
  const size_t half = static_cast<size_t>(state.range(0)) / 2;
  Setup s;
  if (!s.Make(state, 2 * half + (4 << 10))) return;
  DeviceSpan a = s.Carve(half);
  DeviceSpan b = s.Carve(half);
  const cudaStream_t cs = NativeStream(*s.stream);
  for (auto _ : state) {
    for (int i = 0; i < kCallsPerIteration; ++i) {
      cudaMemcpyAsync(b.data, a.data, half, cudaMemcpyDeviceToDevice, cs);
    }
    if (!s.stream->Synchronize().ok()) state.SkipWithError("the copy failed");
  }
  state.SetBytesProcessed(state.iterations() * kCallsPerIteration * 2 * half);
}

void Common(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Repetitions(5)->ReportAggregatesOnly(true);
}

BENCHMARK(BM_DeviceUpdate)
    ->ArgsProduct({{0, 1, 2, 3}, {int64_t{1} << 24, int64_t{1} << 26}})
    ->ArgNames({"kind", "n"})
    ->Apply(Common);
BENCHMARK(BM_DeviceGradStats)->Arg(int64_t{1} << 24)->Arg(int64_t{1} << 26)->Apply(Common);
BENCHMARK(BM_DeviceGradAccumulate)->Arg(int64_t{1} << 24)->Arg(int64_t{1} << 26)->Apply(Common);
BENCHMARK(BM_DeviceCopy)->Arg(int64_t{28} << 24)->Arg(int64_t{28} << 26)->Apply(Common);

}  // namespace
}  // namespace strata::gpu::bench

BENCHMARK_MAIN();
