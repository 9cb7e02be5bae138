// SwapStore Write/Read throughput per extent size, with and without xxh3 checksums, on a real
// file. The directory is $STRATA_BENCH_DIR (default /var/tmp; tmpfs would measure memory, not a
// drive). The backend is chosen as in training (kAuto: "uring" when usable), default options
// (1 MiB pieces, queue depth 32), the buffer registered as fixed buffers. Bytes processed are
// extent payload bytes, so the rate reads as GB/s (Google Benchmark prints it in binary units:
// "G/s" = GiB/s).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "base/aligned_buffer.h"
#include "base/logging.h"
#include "base/units.h"
#include "io/io_backend.h"
#include "io/swap_store.h"

namespace strata::io {
namespace {

std::string BenchDir() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/var/tmp";
}

enum class Op { kWrite, kRead };

// state.range(0): extent size in MiB; state.range(1): checksums on (1) or off (0).
void BM_SwapStore(benchmark::State& state, Op op) {
  const uint64_t size_bytes = static_cast<uint64_t>(state.range(0)) * kMiB;
  const bool checksums = state.range(1) != 0;
  auto backend = CreateIoBackend(IoBackendOptions{});
  if (!backend.ok()) {
    state.SkipWithError(backend.status().ToString().c_str());
    return;
  }
  SwapStoreOptions options;
  options.dirs = {BenchDir()};
  options.verify_checksums = checksums;
  auto store = SwapStore::Create(backend->get(), options);
  if (!store.ok()) {
    state.SkipWithError(store.status().ToString().c_str());
    return;
  }
  auto buf = AlignedBuffer::Allocate(SwapStore::PaddedSize(size_bytes));
  if (!buf.ok()) {
    state.SkipWithError(buf.status().ToString().c_str());
    return;
  }
  for (size_t i = 0; i < buf->size_bytes(); i += 4096) {
    buf->data()[i] = static_cast<std::byte>(i / 4096);  // touch every page, non-constant data
  }
  const std::span<std::byte> region = buf->span();
  const bool fixed = (*store)->RegisterBuffers({&region, 1}).ok();
  Status s = (*store)->Allocate("extent", size_bytes);
  if (s.ok()) s = (*store)->Write("extent", buf->span());  // lays the extent out
  if (!s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    s = op == Op::kWrite ? (*store)->Write("extent", buf->span())
                         : (*store)->Read("extent", buf->span());
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size_bytes));
  state.SetLabel(fmt::format("{} {}{}{}", (*store)->backend_name(),
                             (*store)->direct_io() ? "O_DIRECT" : "buffered",
                             fixed ? " fixed-buffers" : "", checksums ? " xxh3" : ""));
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t mib : {1, 16, 128}) {
    for (int64_t checksums : {1, 0}) b->Args({mib, checksums});
  }
  b->ArgNames({"extent_MiB", "xxh3"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK_CAPTURE(BM_SwapStore, Write, Op::kWrite)->Apply(Args);
BENCHMARK_CAPTURE(BM_SwapStore, Read, Op::kRead)->Apply(Args);

}  // namespace
}  // namespace strata::io

int main(int argc, char** argv) {
  strata::SetLogLevel(strata::LogLevel::kWarning);  // no backend-choice line per benchmark
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
