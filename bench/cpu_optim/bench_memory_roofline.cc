// The host's memory roofline and the CPU AdamW step against it, per thread count, in one run.
//
//   BM_Triad/threads     STREAM triad a = b + s * c over fp32 arrays: 12 B per element
//   BM_InPlace/threads   the optimizer's pattern a += s * b in place: 12 B per element
//                        (a read and written, b read)
//   BM_AdamWUnbound/threads  the same in an arena whose threads are not bound to cores (as the
//                        engine's update stage runs): what binding is worth
//   BM_AdamW/threads     cpu_optim::AdamWUpdate (the best kernel), bf16 gradients and a bf16
//                        copy-out: 28 B per parameter (p32, m, v read and written, the gradient
//                        read, the copy-out written)
//
// threads = 1, 2, 4, ... and every core of the process's affinity mask. Each benchmark runs in a
// cpu_optim::WorkerArena bound to the first `threads` allowed cores, and its arrays are first
// touched inside that arena with the loop shape of the measured one, so each page is placed on
// the NUMA node of the thread that first wrote it (Linux's first-touch policy), as the engine's
// state is. Write-allocate traffic (the copy-out line read before it is written) is not counted,
// as STREAM does not count it.
//
// After the run a table gives, per thread count, each pattern's GB/s (median of the
// repetitions) and AdamW's ratio to the in-place pattern, the roofline the update can reach
// (issue 29 asks for >= 0.8). Usage:
//   bench_memory_roofline [--roofline_params=N] [--roofline_huge_pages=1]
//   [--benchmark_repetitions=5]
// --roofline_huge_pages=1 advises every array for transparent huge pages (MADV_HUGEPAGE) before its
// first touch.
// N: elements per array and AdamW parameters (default 100M: 400 MB per fp32 array, 2.8 GB of
// AdamW state and gradient), far larger than any last-level cache.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/mman.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/dtype.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/kernels.h"
#include "cpu_optim/threading.h"

namespace strata::cpu_optim {
namespace {

int64_t g_params = 100'000'000;
constexpr int64_t kTile = internal::kAdamWTileElems;

// The cores this process may run on, in id order.
std::vector<int> AllowedCores() {
  std::vector<int> cores;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cores.push_back(c);
    }
  }
  return cores;
}

// `threads` threads bound to the first `threads` allowed cores, or (bind false) not bound.
std::unique_ptr<WorkerArena> BoundArena(int threads, bool bind = true) {
  std::vector<int> cores = AllowedCores();
  if (static_cast<int>(cores.size()) < threads) return nullptr;
  cores.resize(bind ? static_cast<size_t>(threads) : 0);
  StatusOr<std::unique_ptr<WorkerArena>> arena =
      WorkerArena::Create({.num_threads = threads, .cores = cores});
  return arena.ok() ? std::move(arena).value() : nullptr;
}

// f(begin, end) over [0, n) in whole tiles, statically split over the arena's threads (the
// same split for the first touch and the measured loop).
template <typename F>
void ForTiles(int64_t n, const F& f) {
  const int64_t num_tiles = (n + kTile - 1) / kTile;
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, num_tiles),
      [&](const auto& r) { f(r.begin() * kTile, std::min(n, r.end() * kTile)); },
      tbb::static_partitioner());
}

bool g_huge_pages = false;

// Anonymous memory (AlignedBuffer maps buffers of 1 MiB and more), with --roofline_huge_pages=1
// advised for transparent huge pages before its first touch.
AlignedBuffer Allocate(int64_t bytes) {
  StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(static_cast<size_t>(bytes));
  if (!buf.ok()) return AlignedBuffer();
  if (g_huge_pages) madvise(buf->data(), buf->size_bytes(), MADV_HUGEPAGE);
  return std::move(buf).value();
}

void SetBytes(benchmark::State& state, int64_t n, int64_t bytes_per_elem) {
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * bytes_per_elem);
}

// kind 0: triad x = y + 3 z; kind 1: in place x += 3 y.
void RunStream(benchmark::State& state, int kind) {
  const int64_t n = g_params;
  const auto arena = BoundArena(static_cast<int>(state.range(0)));
  if (!arena) return state.SkipWithError("cannot bind that many threads");
  AlignedBuffer a = Allocate(n * 4), b = Allocate(n * 4), c = Allocate(n * 4);
  if (!a.data() || !b.data() || !c.data()) return state.SkipWithError("allocation failed");
  float* x = a.as<float>();
  float* y = b.as<float>();
  float* z = c.as<float>();
  arena->Execute([&] {
    ForTiles(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        x[i] = 1.0f;
        y[i] = 2.0f;
        z[i] = 0.5f;
      }
    });
  });
  for (auto _ : state) {
    arena->Execute([&] {
      ForTiles(n, [&](int64_t lo, int64_t hi) {
        if (kind == 0) {
          for (int64_t i = lo; i < hi; ++i) x[i] = y[i] + 3.0f * z[i];
        } else {
          for (int64_t i = lo; i < hi; ++i) x[i] += 3.0f * y[i];
        }
      });
    });
    benchmark::ClobberMemory();
  }
  SetBytes(state, n, 12);
}

void BM_Triad(benchmark::State& state) { RunStream(state, 0); }
void BM_InPlace(benchmark::State& state) { RunStream(state, 1); }

void RunAdamW(benchmark::State& state, bool bind) {
  const int64_t n = g_params;
  const auto arena = BoundArena(static_cast<int>(state.range(0)), bind);
  if (!arena) return state.SkipWithError("cannot bind that many threads");
  AlignedBuffer p = Allocate(n * 4), m = Allocate(n * 4), v = Allocate(n * 4),
                grad = Allocate(n * 2), out = Allocate(n * 2);
  if (!p.data() || !m.data() || !v.data() || !grad.data() || !out.data()) {
    return state.SkipWithError("allocation failed");
  }
  arena->Execute([&] {
    ForTiles(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        p.as<float>()[i] = 0.02f * static_cast<float>(static_cast<int>(i % 201) - 100) / 100.0f;
        m.as<float>()[i] = 0.0f;
        v.as<float>()[i] = 0.0f;
        grad.as<uint16_t>()[i] = FloatToBf16(1e-3f * static_cast<float>(i % 97 - 48) / 48.0f);
        out.as<uint16_t>()[i] = 0;
      }
    });
  });
  const auto span = [n](AlignedBuffer& buf) {
    return std::span<float>(buf.as<float>(), static_cast<size_t>(n));
  };
  const AdamWConfig config{.weight_decay = 0.01f};
  int64_t t = 0;
  for (auto _ : state) {
    Status s;
    arena->Execute([&] {
      s = AdamWUpdate(config, {.step = ++t, .grad_scale = 0.5f}, span(p), span(m), span(v),
                      GradView{grad.data(), DType::kBF16}, CopyOut{out.data(), DType::kBF16});
    });
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  SetBytes(state, n, 28);
}

void BM_AdamW(benchmark::State& state) { RunAdamW(state, true); }
void BM_AdamWUnbound(benchmark::State& state) { RunAdamW(state, false); }

// Console output as usual, and the medians kept for the closing table.
class RooflineReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      const bool single = run.run_type == Run::RT_Iteration && run.repetitions <= 1;
      if (!median && !single) continue;
      const std::string name = run.run_name.function_name;
      const int threads = std::atoi(run.run_name.args.c_str() + run.run_name.args.find(':') + 1);
      gbps_[threads][name] = run.counters.at("bytes_per_second") / 1e9;
    }
  }
  void PrintTable() const {
    fmt::print("\nroofline ({} elements, kernel {}): GB/s, medians\n", g_params,
               ActiveKernelName());
    fmt::print("{:>8} {:>10} {:>10} {:>10} {:>16} {:>14} {:>16}\n", "threads", "triad", "in-place",
               "AdamW", "AdamW/in-place", "AdamW param/s", "AdamW unbound");
    for (const auto& [threads, by_name] : gbps_) {
      const auto get = [&](std::string_view k) {
        const auto it = by_name.find(std::string(k));
        return it == by_name.end() ? 0.0 : it->second;
      };
      const double triad = get("BM_Triad"), inplace = get("BM_InPlace"), adamw = get("BM_AdamW");
      fmt::print("{:>8} {:>10.1f} {:>10.1f} {:>10.1f} {:>16.2f} {:>14.3g} {:>16.1f}\n", threads,
                 triad, inplace, adamw, inplace > 0 ? adamw / inplace : 0.0, adamw * 1e9 / 28,
                 get("BM_AdamWUnbound"));
    }
  }

 private:
  std::map<int, std::map<std::string, double>> gbps_;
};

std::vector<int64_t> ThreadCounts() {
  const int all = static_cast<int>(AllowedCores().size());
  std::vector<int64_t> t;
  for (int k = 1; k < all; k *= 2) t.push_back(k);
  t.push_back(std::max(all, 1));
  return t;
}

void Register() {
  for (auto [name, fn] :
       {std::pair{"BM_Triad", &BM_Triad}, std::pair{"BM_InPlace", &BM_InPlace},
        std::pair{"BM_AdamW", &BM_AdamW}, std::pair{"BM_AdamWUnbound", &BM_AdamWUnbound}}) {
    benchmark::RegisterBenchmark(name, fn)
        ->ArgName("threads")
        ->ArgsProduct({ThreadCounts()})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(0.5);
  }
}

}  // namespace
}  // namespace strata::cpu_optim

int main(int argc, char** argv) {
  // --roofline_params=N is ours; the rest is Google Benchmark's.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.starts_with("--roofline_huge_pages=")) {
      strata::cpu_optim::g_huge_pages = a.ends_with("=1");
    } else if (a.starts_with("--roofline_params=")) {
      strata::cpu_optim::g_params = std::atoll(argv[i] + a.find('=') + 1);
      if (strata::cpu_optim::g_params < 1'000'000) {
        fmt::print(stderr, "bench_memory_roofline: --roofline_params must be >= 1000000\n");
        return 2;
      }
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("cpu_optim_kernel",
                              std::string(strata::cpu_optim::ActiveKernelName()));
  strata::cpu_optim::Register();
  strata::cpu_optim::RooflineReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintTable();
  benchmark::Shutdown();
  return 0;
}
