// io_uring specifics: the probe, a forced "uring" backend, and its ring pool under many threads.
#include <gtest/gtest.h>

#include <cerrno>
#include <thread>
#include <vector>

#include "io/io_backend.h"
#include "io/swap_store.h"
#include "io/uring_backend.h"
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

TEST_F(UringTest, SwapStoreRegistersItsFilesAndItsArenaTakesTheFixedPath) {
  auto backend = CreateIoBackend(SmallOptions(BackendKind::kUring));
  ASSERT_TRUE(backend.ok());
  TempDir d0, d1;
  SwapStoreOptions options;
  options.dirs = {d0.path(), d1.path()};
  options.stripe_unit_bytes = kStripeBytes;
  const uint64_t size = 9 * kStripeBytes + 77;
  AlignedBuffer arena = ZeroAligned(2 * SwapStore::PaddedSize(size));
  std::span<std::byte> src = arena.span().subspan(0, SwapStore::PaddedSize(size));
  std::span<std::byte> dst = arena.span().subspan(SwapStore::PaddedSize(size));
  FillRandom(src, 77);
  for (int round = 0; round < 2; ++round) {  // a second store reuses fds and rings
    SCOPED_TRACE(::testing::Message() << "store " << round);
    auto store = SwapStore::Create(backend->get(), options);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    const std::span<std::byte> region = arena.span();
    ASSERT_TRUE((*store)->RegisterBuffers({&region, 1}).ok());
    (*backend)->ResetStats();
    ASSERT_TRUE((*store)->Allocate("block1.v", size).ok());
    ASSERT_TRUE((*store)->Write("block1.v", src).ok());
    std::fill(dst.begin(), dst.end(), std::byte{0});
    const Status s = (*store)->Read("block1.v", dst);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(SameBytes(dst.data(), src.data(), size));
    const IoStats stats = (*backend)->stats();
    EXPECT_GT(stats.submissions, 0u);
    EXPECT_EQ(stats.fixed_file_submissions, stats.submissions);
    EXPECT_EQ(stats.fixed_buffer_submissions, stats.submissions);
  }
}

TEST_F(UringTest, FixedBuffersWorkFromManyThreadsEachOnItsOwnRing) {
  auto backend = CreateIoBackend(SmallOptions(BackendKind::kUring));
  ASSERT_TRUE(backend.ok());
  constexpr int kThreads = 6;
  constexpr size_t kPerThread = 5 * kBlockBytes + 4096;
  AlignedBuffer arena = ZeroAligned(2 * kThreads * kPerThread);
  const std::span<std::byte> region = arena.span();
  ASSERT_TRUE((*backend)->RegisterBuffers({&region, 1}).ok());
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/true);
  std::vector<char> ok(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::span<std::byte> src = arena.span().subspan(2 * t * kPerThread, kPerThread);
      std::span<std::byte> dst = arena.span().subspan((2 * t + 1) * kPerThread, kPerThread);
      for (int round = 0; round < 5; ++round) {
        FillRandom(src, static_cast<uint64_t>(t * 10 + round));
        const uint64_t offset = static_cast<uint64_t>(t) * kPerThread;
        if (!(*backend)->Write(fd.get(), offset, src, "f").ok()) return;
        if (!(*backend)->Read(fd.get(), offset, dst, "f").ok()) return;
        if (!SameBytes(dst.data(), src.data(), kPerThread)) return;
      }
      ok[t] = 1;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(ok[t]) << "thread " << t;
  const IoStats stats = (*backend)->stats();
  EXPECT_EQ(stats.fixed_buffer_submissions, stats.submissions);
}

TEST_F(UringTest, SqpollRoundTripsOrIsRefusedNamingSqpoll) {
  IoBackendOptions options = SmallOptions(BackendKind::kUring);
  options.sqpoll = true;
  auto backend = CreateIoBackend(options);
  if (!backend.ok()) {
    EXPECT_NE(backend.status().message().find("SQPOLL"), std::string::npos)
        << backend.status().ToString();
    GTEST_SKIP() << "SQPOLL refused here: " << backend.status().ToString();
  }
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/true);
  AlignedBuffer data = RandomAligned(7 * kBlockBytes, 5);
  ASSERT_TRUE((*backend)->Write(fd.get(), 0, data.span(), "f").ok());
  AlignedBuffer back = ZeroAligned(7 * kBlockBytes);
  ASSERT_TRUE((*backend)->Read(fd.get(), 0, back.span(), "f").ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), data.size_bytes()));
}

// With SQPOLL, io_uring_submit returns the entries the kernel's polling thread has not consumed
// yet, which may be fewer than were just prepared (even 0) or more (entries of an earlier call).
// Counting fewer left entries uncounted whose completions then wrapped the in-flight counter (and
// the wait for the next completion blocked forever), or, at 0, ended the call with "io_uring_submit
// made no progress" while they were in flight.
TEST(UringSubmit, WithSqpollEveryPreparedEntryIsInFlightWhateverSubmitReturns) {
  for (int r : {0, 1, 2, 5}) {
    EXPECT_EQ(internal::EntriesTaken(r, 2, /*sqpoll=*/true), 2u) << "r = " << r;
  }
  EXPECT_EQ(internal::EntriesTaken(-EINTR, 2, /*sqpoll=*/true), 0u);
}

TEST(UringSubmit, WithoutSqpollTheEntriesTheKernelTookAreInFlight) {
  EXPECT_EQ(internal::EntriesTaken(0, 2, /*sqpoll=*/false), 0u);  // the rest stay queued
  EXPECT_EQ(internal::EntriesTaken(1, 2, /*sqpoll=*/false), 1u);
  EXPECT_EQ(internal::EntriesTaken(2, 2, /*sqpoll=*/false), 2u);
  EXPECT_EQ(internal::EntriesTaken(3, 2, /*sqpoll=*/false), 2u);
  EXPECT_EQ(internal::EntriesTaken(-EAGAIN, 2, /*sqpoll=*/false), 0u);
}

}  // namespace
}  // namespace strata::io::testing
