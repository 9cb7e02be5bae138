// The round-trip matrix of issue 3 for every backend: direct/buffered x registered (fixed)
// buffers on/off x queue depth 1/8/64 x sizes below, at and above the block size with odd
// remainders; and the counters of IoBackend::stats() under injected faults.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>

#include "base/units.h"
#include "io/fault_injection.h"
#include "io/io_backend.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

constexpr size_t kMatrixBlockBytes = 64 * 1024;

struct MatrixCase {
  bool direct;
  bool fixed;
  int queue_depth;
};

// Sizes (and offsets) for one case: O_DIRECT needs multiples of 4096; buffered takes any size.
std::vector<size_t> MatrixSizes(bool direct) {
  if (direct) {
    return {4096,
            kMatrixBlockBytes - 4096,
            kMatrixBlockBytes,
            kMatrixBlockBytes + 4096,
            7 * kMatrixBlockBytes + 3 * 4096,
            100 * kMatrixBlockBytes + 4096};
  }
  return {1,
          4095,
          kMatrixBlockBytes - 1,
          kMatrixBlockBytes,
          kMatrixBlockBytes + 1,
          7 * kMatrixBlockBytes + 13,
          100 * kMatrixBlockBytes + 4097};
}

void RunMatrixCase(BackendKind kind, const MatrixCase& c, const TempDir& dir) {
  IoBackendOptions options;
  options.kind = kind;
  options.queue_depth = c.queue_depth;
  options.block_size_bytes = kMatrixBlockBytes;
  options.posix_threads = 3;
  auto created = CreateIoBackend(options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  IoBackend& backend = **created;

  const std::vector<size_t> sizes = MatrixSizes(c.direct);
  const size_t largest = static_cast<size_t>(AlignUp(sizes.back(), 4096));
  // One arena holds the source and the destination; registered as fixed buffers or not.
  AlignedBuffer arena = ZeroAligned(2 * largest);
  if (c.fixed) {
    const std::span<std::byte> region = arena.span();
    const Status s = backend.RegisterBuffers({&region, 1});
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  std::span<std::byte> src = arena.span().subspan(0, largest);
  std::span<std::byte> dst = arena.span().subspan(largest, largest);
  UniqueFd fd = OpenFile(dir.File("matrix"), c.direct);
  ASSERT_TRUE(fd.valid()) << std::strerror(errno);

  uint64_t seed = static_cast<uint64_t>(c.queue_depth) * 4 + (c.direct ? 2 : 0) + (c.fixed ? 1 : 0);
  for (size_t size : sizes) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{3 * 4096}}) {
      SCOPED_TRACE(::testing::Message() << "size " << size << " offset " << offset);
      FillRandom(src.subspan(0, size), ++seed);
      std::fill(dst.begin(), dst.end(), std::byte{0});
      Status s = backend.Write(fd.get(), offset, src.subspan(0, size), "matrix file");
      ASSERT_TRUE(s.ok()) << s.ToString();
      s = backend.Read(fd.get(), offset, dst.subspan(0, size), "matrix file");
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(SameBytes(dst.data(), src.data(), size));
      // Nothing beyond the request was touched.
      if (size < largest) {
        ASSERT_EQ(dst[size], std::byte{0});
      }
    }
  }
  const IoStats stats = backend.stats();
  // Every submission completed in full (no faults here) and was counted once.
  ASSERT_NE(stats.latency, nullptr);
  EXPECT_EQ(stats.latency->count(), stats.submissions);
  if (kind == BackendKind::kUring && c.fixed) {
    EXPECT_GT(stats.submissions, 0u);
    EXPECT_EQ(stats.fixed_buffer_submissions, stats.submissions)
        << "every piece lies in the registered arena, so every piece must take the fixed path";
  } else {
    EXPECT_EQ(stats.fixed_buffer_submissions, 0u);
  }
}

TEST_P(BackendTest, RoundTripMatrixOfDirectFixedQueueDepthAndSize) {
  for (bool direct : {false, true}) {
    for (bool fixed : {false, true}) {
      for (int queue_depth : {1, 8, 64}) {
        if (GetParam() == BackendKind::kMemory && direct) continue;  // no files at all
        const MatrixCase c{direct, fixed, queue_depth};
        SCOPED_TRACE(::testing::Message() << (direct ? "O_DIRECT" : "buffered") << ", "
                                          << (fixed ? "fixed buffers" : "plain buffers")
                                          << ", queue depth " << queue_depth);
        TempDir dir;
        RunMatrixCase(GetParam(), c, dir);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_P(BackendTest, BuffersOutsideTheRegisteredRegionStillRoundTrip) {
  auto created = CreateIoBackend(SmallOptions(GetParam()));
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  IoBackend& backend = **created;
  AlignedBuffer registered = ZeroAligned(4 * kBlockBytes);
  const std::span<std::byte> region = registered.span();
  ASSERT_TRUE(backend.RegisterBuffers({&region, 1}).ok());
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/false);
  // 6 blocks: larger than the region, so it cannot be inside it.
  AlignedBuffer data = RandomAligned(6 * kBlockBytes, 3);
  ASSERT_TRUE(backend.Write(fd.get(), 0, data.span(), "f").ok());
  AlignedBuffer back = ZeroAligned(6 * kBlockBytes);
  ASSERT_TRUE(backend.Read(fd.get(), 0, back.span(), "f").ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), data.size_bytes()));
  EXPECT_EQ(backend.stats().fixed_buffer_submissions, 0u);
  // Unregistering everything is allowed.
  EXPECT_TRUE(backend.RegisterBuffers({}).ok());
}

TEST_P(BackendTest, OverlappingOrEmptyRegionsAreInvalidArgumentOnUring) {
  if (GetParam() != BackendKind::kUring) GTEST_SKIP() << "only \"uring\" registers buffers";
  auto created = CreateIoBackend(SmallOptions(GetParam()));
  ASSERT_TRUE(created.ok());
  AlignedBuffer b = ZeroAligned(8 * 4096);
  const std::span<std::byte> overlapping[] = {b.span().subspan(0, 5 * 4096),
                                              b.span().subspan(4 * 4096, 4 * 4096)};
  EXPECT_EQ((*created)->RegisterBuffers(overlapping).code(), StatusCode::kInvalidArgument);
  const std::span<std::byte> empty[] = {b.span().subspan(0, 0)};
  EXPECT_EQ((*created)->RegisterBuffers(empty).code(), StatusCode::kInvalidArgument);
}

std::unique_ptr<FaultInjectingBackend> MakeFaultyBackend(BackendKind kind) {
  auto backend = FaultInjectingBackend::Create(SmallOptions(kind));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

TEST_P(FaultInjectionTest, StatsCountShortTransferResubmitsAndEagainRetries) {
  auto backend = MakeFaultyBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("data"), /*direct=*/false);
  const std::vector<std::byte> data = RandomBytes(3 * kBlockBytes + 5, 11);
  backend->AddFault(Fault::ShortTransfer(IoOp::kWrite, 100, /*nth=*/1, /*times=*/3));
  backend->AddFault(Fault::Errno(IoOp::kRead, EAGAIN, /*nth=*/2, /*times=*/2));
  ASSERT_TRUE(backend->Write(fd.get(), 0, data, "data").ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(backend->Read(fd.get(), 0, back, "data").ok());
  EXPECT_TRUE(back == data);
  const IoStats stats = backend->stats();
  EXPECT_EQ(stats.short_transfer_resubmits, 3u);
  EXPECT_EQ(stats.eagain_retries, 2u);
  // 4 pieces each way, plus 3 resubmitted writes and 2 retried reads.
  EXPECT_EQ(stats.submissions, 4u + 3u + 4u + 2u);
  EXPECT_EQ(stats.latency->count(), stats.submissions);
  backend->ResetStats();
  EXPECT_EQ(backend->stats().submissions, 0u);
  EXPECT_EQ(backend->stats().latency->count(), 0u);
}

TEST_P(FaultInjectionTest, LatencyHistogramSeesInjectedLatency) {
  auto backend = MakeFaultyBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("data"), /*direct=*/false);
  const std::vector<std::byte> data = RandomBytes(2 * kBlockBytes, 12);
  ASSERT_TRUE(backend->Write(fd.get(), 0, data, "data").ok());
  backend->ResetStats();
  // A latency fault delays the completion as a slow drive would: it is part of the submission's
  // measured latency on every backend.
  backend->AddFault(Fault::Latency(IoOp::kRead, std::chrono::milliseconds(3)));
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(backend->Read(fd.get(), 0, back, "data").ok());
  const IoStats stats = backend->stats();
  ASSERT_EQ(stats.latency->count(), 2u);
  EXPECT_GE(stats.latency->QuantileNs(0.0), 3'000'000u);
  EXPECT_GE(stats.latency->MeanNs(), 3e6);
}

}  // namespace
}  // namespace strata::io::testing
