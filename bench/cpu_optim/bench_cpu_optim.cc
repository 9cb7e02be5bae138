// CPU optimizer step throughput against the memory traffic that bounds it.
//
//   BM_AdamW/params/grad/threads         AdamWUpdate, bf16 copy-out
//   BM_AdamWTraffic/params/grad/threads  the same bytes read and written, no arithmetic
//   BM_AdamWReference/params/grad        the scalar reference (one thread)
//   BM_AdamWVariant/<isa>/...            AdamW with each ISA variant this CPU runs
//   BM_Triad/params/threads              STREAM triad a = b + s * c over fp32 arrays
//
// grad: 0 = fp32, 2 = bf16 (DType values). Bytes per parameter (reported as
// bytes_per_second): reads p32, m, v (12 B) + the gradient (4 or 2 B), writes p32,
// m, v (12 B) + the bf16 copy-out (2 B): 28 B with bf16 gradients, 30 B with fp32.
// items_per_second is parameters per second. Times are wall-clock (the work runs
// on oneTBB workers), median and spread over repetitions.
//
// The 100M-parameter cases need ~2 GB and minutes; skip them with
//   --benchmark_filter='params:10000000/'
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <tbb/version.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {
namespace {

constexpr int64_t kTile = internal::kAdamWTileElems;

// The optimizer state of one benchmark, allocated 4 KiB-aligned and first touched
// in parallel (as the engine's pinned buffers would be).
struct Buffers {
  AlignedBuffer p, m, v, grad, out;
  int64_t n = 0;
  DType grad_dtype = DType::kBF16;

  static std::unique_ptr<Buffers> Make(int64_t n, DType grad_dtype) {
    auto b = std::make_unique<Buffers>();
    b->n = n;
    b->grad_dtype = grad_dtype;
    auto alloc = [](size_t bytes) {
      StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(bytes);
      return buf.ok() ? std::move(buf).value() : AlignedBuffer();
    };
    b->p = alloc(n * 4);
    b->m = alloc(n * 4);
    b->v = alloc(n * 4);
    b->grad = alloc(n * SizeOf(grad_dtype));
    b->out = alloc(n * 2);
    if (!b->p.data() || !b->m.data() || !b->v.data() || !b->grad.data() || !b->out.data()) {
      return nullptr;
    }
    float* p = b->p.as<float>();
    void* g = b->grad.data();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kTile), [&](const auto& r) {
      for (int64_t i = r.begin(); i < r.end(); ++i) {
        p[i] = 0.02f * static_cast<float>(static_cast<int>(i % 201) - 100) / 100.0f;
        const float gi = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48) / 48.0f + 1e-5f;
        if (grad_dtype == DType::kF32) {
          static_cast<float*>(g)[i] = gi;
        } else {
          static_cast<uint16_t*>(g)[i] = FloatToBf16(gi);
        }
      }
    });
    return b;
  }
  size_t bytes_per_param() const { return 12 + SizeOf(grad_dtype) + 12 + 2; }
};

void SetCounters(benchmark::State& state, const Buffers& b) {
  state.SetItemsProcessed(state.iterations() * b.n);
  state.SetBytesProcessed(state.iterations() * b.n * static_cast<int64_t>(b.bytes_per_param()));
  state.counters["bytes_per_param"] = static_cast<double>(b.bytes_per_param());
}

void RunAdamW(benchmark::State& state, const internal::KernelTable& kernels) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  AdamWConfig config;
  config.weight_decay = 0.01f;
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    arena.execute([&] {
      s = internal::AdamWUpdateWith(kernels, config, {.step = ++t, .grad_scale = 0.5f},
                                    {b->p.as<float>(), static_cast<size_t>(b->n)},
                                    {b->m.as<float>(), static_cast<size_t>(b->n)},
                                    {b->v.as<float>(), static_cast<size_t>(b->n)},
                                    GradView{b->grad.data(), b->grad_dtype},
                                    CopyOut{b->out.data(), DType::kBF16});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters(state, *b);
}

void BM_AdamW(benchmark::State& state) { RunAdamW(state, internal::BestKernelTable()); }

// The same bytes as BM_AdamW with bit moves only, compiled for the same ISA
// variant as the AdamW kernel (internal::KernelTable::adamw_traffic).
void BM_AdamWTraffic(benchmark::State& state) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  const internal::KernelTable& kernels = internal::BestKernelTable();
  const internal::AdamWBuffers bufs{.master = b->p.as<float>(),
                                    .m = b->m.as<float>(),
                                    .v = b->v.as<float>(),
                                    .grad = b->grad.data(),
                                    .grad_dtype = b->grad_dtype,
                                    .out = b->out.data(),
                                    .out_dtype = DType::kBF16};
  tbb::task_arena arena(static_cast<int>(state.range(2)));
  const int64_t num_tiles = (b->n + kTile - 1) / kTile;
  for (auto _ : state) {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles), [&](const auto& r) {
        kernels.adamw_traffic(bufs, r.begin() * kTile, std::min(b->n, r.end() * kTile));
      });
    });
    benchmark::ClobberMemory();
  }
  SetCounters(state, *b);
}

void BM_AdamWReference(benchmark::State& state) {
  const auto b = Buffers::Make(state.range(0), static_cast<DType>(state.range(1)));
  if (!b) return state.SkipWithError("allocation failed");
  AdamWConfig config;
  config.weight_decay = 0.01f;
  int64_t t = 0;
  for (auto _ : state) {
    const Status s = AdamWUpdateReference(
        config, {.step = ++t, .grad_scale = 0.5f}, {b->p.as<float>(), static_cast<size_t>(b->n)},
        {b->m.as<float>(), static_cast<size_t>(b->n)},
        {b->v.as<float>(), static_cast<size_t>(b->n)}, GradView{b->grad.data(), b->grad_dtype},
        CopyOut{b->out.data(), DType::kBF16});
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetCounters(state, *b);
}

// STREAM triad over three fp32 arrays of params elements: 12 B per element
// (write-allocate traffic not counted, as STREAM).
void BM_Triad(benchmark::State& state) {
  const int64_t n = state.range(0);
  StatusOr<AlignedBuffer> a = AlignedBuffer::Allocate(n * 4), bb = AlignedBuffer::Allocate(n * 4),
                          c = AlignedBuffer::Allocate(n * 4);
  if (!a.ok() || !bb.ok() || !c.ok()) return state.SkipWithError("allocation failed");
  float* x = a->as<float>();
  const float* y = bb->as<float>();
  const float* z = c->as<float>();
  tbb::task_arena arena(static_cast<int>(state.range(1)));
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  for (auto _ : state) {
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles), [&](const auto& r) {
        const int64_t end = std::min(n, r.end() * kTile);
        for (int64_t i = r.begin() * kTile; i < end; ++i) x[i] = y[i] + 3.0f * z[i];
      });
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 12);
}

std::vector<int64_t> ThreadCounts() {
  std::vector<int64_t> t = {1};
  const int all = tbb::info::default_concurrency();
  if (all >= 2) t.push_back(2);
  if (all > 2) t.push_back(all);
  return t;
}

void Register() {
  const std::vector<int64_t> params = {10'000'000, 100'000'000};
  const std::vector<int64_t> grads = {static_cast<int64_t>(DType::kF32),
                                      static_cast<int64_t>(DType::kBF16)};
  auto common = [](benchmark::internal::Benchmark* b) {
    b->UseRealTime()->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly(true);
  };
  common(benchmark::RegisterBenchmark("BM_AdamW", BM_AdamW)
             ->ArgNames({"params", "grad", "threads"})
             ->ArgsProduct({params, grads, ThreadCounts()}));
  common(benchmark::RegisterBenchmark("BM_AdamWTraffic", BM_AdamWTraffic)
             ->ArgNames({"params", "grad", "threads"})
             ->ArgsProduct({params, grads, ThreadCounts()}));
  common(benchmark::RegisterBenchmark("BM_AdamWReference", BM_AdamWReference)
             ->ArgNames({"params", "grad"})
             ->ArgsProduct({params, grads}));
  // Every ISA variant this CPU runs, on the engine's case (bf16 gradients, all threads).
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    common(benchmark::RegisterBenchmark(
               (std::string("BM_AdamWVariant/") + kernels->name).c_str(),
               [kernels](benchmark::State& state) { RunAdamW(state, *kernels); })
               ->ArgNames({"params", "grad", "threads"})
               ->Args({10'000'000, static_cast<int64_t>(DType::kBF16), ThreadCounts().back()}));
  }
  common(benchmark::RegisterBenchmark("BM_Triad", BM_Triad)
             ->ArgNames({"params", "threads"})
             ->ArgsProduct({params, ThreadCounts()}));
}

}  // namespace
}  // namespace strata::cpu_optim

int main(int argc, char** argv) {
  using strata::cpu_optim::ActiveKernelName;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::string variants;
  for (const auto* t : strata::cpu_optim::internal::SupportedKernelTables()) {
    variants += variants.empty() ? t->name : std::string(",") + t->name;
  }
  benchmark::AddCustomContext("cpu_optim_kernel", std::string(ActiveKernelName()));
  benchmark::AddCustomContext("cpu_optim_supported_kernels", variants);
  benchmark::AddCustomContext("tbb_version",
                              fmt::format("{}.{} (runtime interface {})", TBB_VERSION_MAJOR,
                                          TBB_VERSION_MINOR, TBB_runtime_interface_version()));
  benchmark::AddCustomContext("tbb_default_concurrency",
                              std::to_string(tbb::info::default_concurrency()));
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
#if defined(__VERSION__)
  benchmark::AddCustomContext("compiler", __VERSION__);
#endif
#if defined(NDEBUG)
  benchmark::AddCustomContext("assertions", "off (NDEBUG)");
#else
  benchmark::AddCustomContext("assertions", "on: not a release build");
#endif
  strata::cpu_optim::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
