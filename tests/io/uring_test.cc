// io_uring specifics: the probe, a forced "uring" backend, and its ring pool under many threads.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "io/io_backend.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

class UringTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status probe = ProbeUring();
    if (!probe.ok()) GTEST_SKIP() << "io_uring is unusable here: " << probe.ToString();
  }
};

TEST_F(UringTest, ForcedUringBackendIsCreatedAndNamed) {
  IoBackendOptions options;
  options.kind = BackendKind::kUring;
  auto backend = CreateIoBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_EQ((*backend)->name(), "uring");
}

TEST_F(UringTest, QueueDepthOneStillCompletesLargeRequests) {
  IoBackendOptions options = SmallOptions(BackendKind::kUring);
  options.queue_depth = 1;
  auto backend = CreateIoBackend(options);
  ASSERT_TRUE(backend.ok());
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/true);
  AlignedBuffer data = RandomAligned(13 * kBlockBytes, 1);
  ASSERT_TRUE((*backend)->Write(fd.get(), 0, data.span(), "f").ok());
  AlignedBuffer back = ZeroAligned(13 * kBlockBytes);
  ASSERT_TRUE((*backend)->Read(fd.get(), 0, back.span(), "f").ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), data.size_bytes()));
}

TEST_F(UringTest, RingPoolServesMoreThreadsThanItHasRings) {
  auto backend = CreateIoBackend(SmallOptions(BackendKind::kUring));
  ASSERT_TRUE(backend.ok());
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/true);
  constexpr int kThreads = 12;
  std::vector<char> ok(kThreads, 0);  // not vector<bool>: written from several threads
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t offset = static_cast<uint64_t>(t) * 8 * kBlockBytes;
      AlignedBuffer back = ZeroAligned(6 * kBlockBytes);
      for (int round = 0; round < 10; ++round) {
        AlignedBuffer data = RandomAligned(6 * kBlockBytes, static_cast<uint64_t>(t * 50 + round));
        if (!(*backend)->Write(fd.get(), offset, data.span(), "f").ok()) return;
        if (!(*backend)->Read(fd.get(), offset, back.span(), "f").ok()) return;
        if (!SameBytes(back.data(), data.data(), data.size_bytes())) return;
      }
      ok[t] = 1;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(ok[t]) << "thread " << t;
}

}  // namespace
}  // namespace strata::io::testing
