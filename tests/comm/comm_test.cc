// The one-rank communicator (every call, its bounds errors, Abort, CheckSameOnAllRanks) and the
// collective watchdog, in one process without a launcher. The MPI backend's tests are
// comm_mpi_test.cc (run under mpirun).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "gpu/device.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;

class LocalCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    device_ = std::move(*device);
    auto arena = device_->CreateArena(1 << 16);
    ASSERT_TRUE(arena.ok());
    arena_ = std::move(*arena);
    auto stream = device_->CreateStream("comm");
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
  }
  gpu::DeviceSpan Carve(size_t size_bytes) { return *arena_->Carve(size_bytes, "test"); }

  std::unique_ptr<Communicator> comm_ = CreateLocalCommunicator();
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<gpu::DeviceArena> arena_;
  std::unique_ptr<gpu::Stream> stream_;
};

TEST_F(LocalCommunicatorTest, IsAWorldOfOneRank) {
  EXPECT_EQ(comm_->backend(), "local");
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->world_size(), 1);
  EXPECT_EQ(comm_->local_rank(), 0);
  EXPECT_EQ(comm_->local_size(), 1);
}

TEST_F(LocalCommunicatorTest, ReduceScatterCopiesSendIntoRecvForEveryDtype) {
  constexpr int64_t kCount = 37;  // odd
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t bytes = kCount * SizeOf(dtype);
    gpu::DeviceSpan send = Carve(bytes);
    gpu::DeviceSpan recv = Carve(bytes);
    for (size_t i = 0; i < bytes; ++i) send.data[i] = static_cast<std::byte>(i * 7 + 3);
    std::memset(recv.data, 0xff, bytes);
    ASSERT_TRUE(comm_->ReduceScatter(send, recv, kCount, dtype, *stream_).ok());
    ASSERT_TRUE(stream_->Synchronize().ok());
    for (size_t i = 0; i < bytes; ++i) {
      ASSERT_EQ(recv.data[i], send.data[i]) << "byte " << i;
    }
  }
}

TEST_F(LocalCommunicatorTest, ReduceScatterInPlaceAndOfNothingLeaveTheBufferAlone) {
  gpu::DeviceSpan buffer = Carve(64);
  for (int i = 0; i < 64; ++i) buffer.data[i] = static_cast<std::byte>(i);
  ASSERT_TRUE(comm_->ReduceScatter(buffer, buffer, 16, DType::kF32, *stream_).ok());
  gpu::DeviceSpan other = Carve(64);
  ASSERT_TRUE(comm_->ReduceScatter(buffer, other, 0, DType::kF32, *stream_).ok());
  ASSERT_TRUE(stream_->Synchronize().ok());
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(buffer.data[i], static_cast<std::byte>(i));
    EXPECT_EQ(other.data[i], std::byte{0});  // the arena is zero-filled; nothing was copied
  }
}

TEST_F(LocalCommunicatorTest, ReduceScatterOutOfBoundsIsInvalidArgument) {
  gpu::DeviceSpan big = Carve(40);
  gpu::DeviceSpan small = Carve(36);
  EXPECT_EQ(comm_->ReduceScatter(small, big, 10, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->ReduceScatter(big, small, 10, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->ReduceScatter(big, small, -1, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm_->ReduceScatter(big, small, 18, DType::kBF16, *stream_).ok());
  EXPECT_TRUE(stream_->Synchronize().ok());
}

TEST_F(LocalCommunicatorTest, AllGatherInPlaceKeepsTheBufferAndChecksItsBounds) {
  gpu::DeviceSpan buffer = Carve(20);
  for (int i = 0; i < 20; ++i) buffer.data[i] = static_cast<std::byte>(100 + i);
  ASSERT_TRUE(comm_->AllGatherInPlace(buffer, 5, DType::kF32, *stream_).ok());
  ASSERT_TRUE(comm_->AllGatherInPlace(buffer, 10, DType::kF16, *stream_).ok());
  ASSERT_TRUE(stream_->Synchronize().ok());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(buffer.data[i], static_cast<std::byte>(100 + i));
  EXPECT_EQ(comm_->AllGatherInPlace(buffer, 6, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->AllGatherInPlace(buffer, -2, DType::kF32, *stream_).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(LocalCommunicatorTest, AllReduceOfOneRankKeepsTheValues) {
  std::vector<double> values = {1.5, -2.25, 1e300, 0.1};
  const std::vector<double> before = values;
  ASSERT_TRUE(comm_->AllReduce(values, ReduceOp::kSum).ok());
  EXPECT_EQ(values, before);
  ASSERT_TRUE(comm_->AllReduce(values, ReduceOp::kMax).ok());
  EXPECT_EQ(values, before);
}

TEST_F(LocalCommunicatorTest, BroadcastFromRankZeroOnlyAndKeepsTheData) {
  std::vector<std::byte> data = {std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_TRUE(comm_->Broadcast(data, 0).ok());
  EXPECT_EQ(data[2], std::byte{3});
  Status bad = comm_->Broadcast(data, 1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("rank 1"));
}

TEST_F(LocalCommunicatorTest, AllGatherBytesCopiesSendAndRejectsAnotherSize) {
  const std::string text = "rank zero";
  std::vector<std::byte> recv(text.size());
  ASSERT_TRUE(comm_->AllGatherBytes(std::as_bytes(std::span(text)), recv).ok());
  EXPECT_EQ(std::memcmp(recv.data(), text.data(), text.size()), 0);
  std::vector<std::byte> wrong(text.size() + 1);
  EXPECT_EQ(comm_->AllGatherBytes(std::as_bytes(std::span(text)), wrong).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm_->AllGatherBytes({}, {}).ok());
}

TEST_F(LocalCommunicatorTest, BarrierAndDuplicateSucceed) {
  EXPECT_TRUE(comm_->Barrier().ok());
  auto dup = comm_->Duplicate();
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ((*dup)->backend(), "local");
  EXPECT_EQ((*dup)->world_size(), 1);
}

TEST_F(LocalCommunicatorTest, CheckSameOnAllRanksOfOneRankIsOk) {
  EXPECT_TRUE(CheckSameOnAllRanks(*comm_, "model", "gpt small, seq 256").ok());
}

TEST(LocalCommunicatorDeathTest, AbortPrintsOneLineNamingTheRankAndExitsWithOne) {
  auto comm = CreateLocalCommunicator();
  EXPECT_EXIT(Abort(*comm, "the swap directory is full"), ::testing::ExitedWithCode(1),
              "strata: rank 0: the swap directory is full\n");
}

#if !defined(STRATA_HAVE_CUDA)
TEST(NcclCommunicator, ABuildWithoutCudaIsUnavailableAndSaysSo) {
  auto local = CreateLocalCommunicator();
  auto comm = CreateNcclCommunicator(*local);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(comm.status().message(), HasSubstr("this build has no CUDA"));
}
#endif

// Lines the watchdog reports, waited for with a bound.
class Lines {
 public:
  void Add(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.push_back(line);
    cv_.notify_all();
  }
  std::vector<std::string> WaitFor(size_t n, std::chrono::milliseconds bound) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, bound, [&] { return lines_.size() >= n; });
    return lines_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
};

TEST(Watchdog, ReportsACollectiveThatOutlivesItsTimeoutOnceWithItsNameAndRank) {
  Lines lines;
  internal::Watchdog watchdog(3, [&](const std::string& line) { lines.Add(line); });
  const auto start = std::chrono::steady_clock::now();
  const uint64_t id = watchdog.Begin("barrier", 1.0);
  std::vector<std::string> got = lines.WaitFor(1, std::chrono::seconds(10));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0],
            "strata: rank 3: barrier waited 1 s for the other ranks; a rank died or hangs: "
            "aborting the job");
  EXPECT_GE(waited, 1.0);
  EXPECT_LT(waited, 5.0);
  // Once only, however long the collective goes on.
  got = lines.WaitFor(2, std::chrono::milliseconds(300));
  EXPECT_EQ(got.size(), 1u);
  watchdog.End(id);
}

TEST(Watchdog, StaysQuietForCollectivesThatFinishInTime) {
  Lines lines;
  internal::Watchdog watchdog(0, [&](const std::string& line) { lines.Add(line); });
  for (int i = 0; i < 1000; ++i) {
    internal::Watchdog::Scope scope(&watchdog, "all-reduce", 0.2);
  }
  {
    internal::Watchdog::Scope scope(&watchdog, "reduce-scatter", 0.3);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(lines.WaitFor(1, std::chrono::milliseconds(600)).empty());
}

TEST(Watchdog, ReportsOnlyTheOverdueOneOfSeveral) {
  Lines lines;
  internal::Watchdog watchdog(1, [&](const std::string& line) { lines.Add(line); });
  const uint64_t quick = watchdog.Begin("broadcast", 0.3);
  const uint64_t slow = watchdog.Begin("all-gather", 0.3);
  const uint64_t patient = watchdog.Begin("barrier", 60);
  watchdog.End(quick);
  std::vector<std::string> got = lines.WaitFor(1, std::chrono::seconds(10));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_THAT(got[0], HasSubstr("rank 1: all-gather waited 0 s"));
  EXPECT_EQ(lines.WaitFor(2, std::chrono::milliseconds(300)).size(), 1u);
  watchdog.End(slow);
  watchdog.End(patient);
}

TEST(Watchdog, ScopeWithoutWatchdogOrTimeoutWatchesNothing) {
  Lines lines;
  internal::Watchdog watchdog(0, [&](const std::string& line) { lines.Add(line); });
  { internal::Watchdog::Scope none(nullptr, "barrier", 0.01); }
  {
    internal::Watchdog::Scope off(&watchdog, "barrier", 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(lines.WaitFor(1, std::chrono::milliseconds(200)).empty());
}

TEST(Watchdog, StopEndsTheThreadAndNothingFiresAfterIt) {
  Lines lines;
  internal::Watchdog watchdog(0, [&](const std::string& line) { lines.Add(line); });
  watchdog.Stop();
  watchdog.Begin("barrier", 0.05);
  EXPECT_TRUE(lines.WaitFor(1, std::chrono::milliseconds(300)).empty());
  watchdog.Stop();  // idempotent
}

}  // namespace
}  // namespace strata::comm
