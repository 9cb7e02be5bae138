// The MPI communicator between real ranks: run under mpirun (ctest runs it with 2 ranks; every
// case also holds for 3 or more: `mpirun -n 3 ... comm_mpi_test`). Each rank makes its data from
// (rank, index) alone, so every rank computes every other rank's data and the double-precision
// reference of each collective itself. Started without a launcher, every case skips.
//
// All ranks run the same cases in the same order; a case that fails on one rank may leave the
// others waiting in a collective: the watchdog (30 s) then ends the job with a line saying so.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "base/dtype.h"
#include "comm/communicator.h"
#include "gpu/device.h"
#include "tools/mpi_launch.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;

Communicator* g_world = nullptr;  // made by main() when launched by mpirun

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank r's element i: a sign, 24 random mantissa bits and an exponent in [-10, 10], so that the
// sum of two in double is exact (at most 24 + 21 + 1 bits) and fp32 rounding shows.
float Value(int rank, int64_t i, uint64_t salt = 0) {
  const uint64_t h = Mix(salt * 0x100000001b3ull + static_cast<uint64_t>(rank) * 1000003u +
                         static_cast<uint64_t>(i));
  const float mantissa = static_cast<float>(h >> 40) / static_cast<float>(1u << 24);  // [0, 1)
  const int exponent = static_cast<int>((h >> 8) % 21) - 10;
  return std::ldexp((h & 1) ? -mantissa : mantissa, exponent);
}

// The same for doubles of very different magnitudes, so that the order of a sum matters.
double DoubleValue(int rank, int64_t i) {
  const uint64_t h = Mix(0xabcdefull + static_cast<uint64_t>(rank) * 7919u + i);
  const double mantissa = static_cast<double>(h >> 11) / 9007199254740992.0;  // [0, 1)
  const int exponent = static_cast<int>((h >> 3) % 81) - 40;
  return std::ldexp((h & 1) ? -mantissa : mantissa, exponent);
}

// A stream that says it belongs to a CUDA device and does nothing: what the MPI backend must
// refuse.
class FakeCudaStream final : public gpu::Stream {
 public:
  std::string_view name() const override { return "fake-cuda"; }
  gpu::DeviceKind device_kind() const override { return gpu::DeviceKind::kCuda; }
  Status CopyH2D(gpu::DeviceSpan, gpu::PinnedSpan) override { return Unused(); }
  Status CopyD2H(gpu::PinnedSpan, gpu::DeviceSpan) override { return Unused(); }
  Status Convert(gpu::DeviceSpan, DType, gpu::DeviceSpan, DType, int64_t, float) override {
    return Unused();
  }
  Status LaunchHost(std::function<Status()>) override { return Unused(); }
  Status Record(gpu::Event&) override { return Unused(); }
  Status Wait(gpu::Event&) override { return Unused(); }
  Status Synchronize() override { return Status::Ok(); }

 private:
  static Status Unused() { return InternalError("the fake CUDA stream was used"); }
};

class MpiCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (g_world == nullptr) GTEST_SKIP() << "not started by an MPI launcher (mpirun)";
    comm_ = g_world;
    rank_ = comm_->rank();
    n_ = comm_->world_size();
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    device_ = std::move(*device);
    auto arena = device_->CreateArena(16 << 20);
    ASSERT_TRUE(arena.ok());
    arena_ = std::move(*arena);
  }
  std::unique_ptr<gpu::Stream> NewStream(const std::string& name) {
    auto stream = device_->CreateStream(name);
    STRATA_CHECK(stream.ok());
    return std::move(*stream);
  }
  gpu::DeviceSpan Carve(size_t size_bytes) { return *arena_->Carve(size_bytes, "test"); }

  // Enqueues reduce-scatter of Value(r, i, salt) over all ranks; checks it after a sync.
  void ExpectReduceScatter(Communicator& comm, gpu::Stream& stream, int64_t count, uint64_t salt) {
    gpu::DeviceSpan send = Carve(count * n_ * sizeof(float));
    gpu::DeviceSpan recv = Carve(count * sizeof(float));
    for (int64_t i = 0; i < count * n_; ++i) send.as<float>()[i] = Value(rank_, i, salt);
    ASSERT_TRUE(comm.ReduceScatter(send, recv, count, DType::kF32, stream).ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    for (int64_t i = 0; i < count; ++i) {
      const int64_t at = rank_ * count + i;  // this rank's part of every rank's send
      double exact = 0;
      double magnitude = 0;
      for (int r = 0; r < n_; ++r) {
        exact += Value(r, at, salt);
        magnitude += std::fabs(Value(r, at, salt));
      }
      const float got = recv.as<float>()[i];
      if (n_ == 2) {
        // One fp32 addition of two values whose double sum is exact: correctly rounded.
        ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(static_cast<float>(exact)))
            << "element " << i << " of " << count << ": " << got << " vs " << exact;
      } else {
        // n - 1 fp32 additions in an order MPI chooses: |error| <= (n - 1) u sum |x|, u = 2^-24.
        const double bound = (n_ - 1) * 1.0001 * std::ldexp(magnitude, -24);
        ASSERT_LE(std::fabs(got - exact), bound) << "element " << i << " of " << count;
      }
    }
  }

  // Enqueues an in-place all-gather; checks every rank's part after a sync.
  void ExpectAllGather(Communicator& comm, gpu::Stream& stream, int64_t count, uint64_t salt) {
    gpu::DeviceSpan buffer = Carve(count * n_ * sizeof(float));
    for (int64_t i = 0; i < count * n_; ++i) {
      buffer.as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
    }
    for (int64_t i = 0; i < count; ++i)
      buffer.as<float>()[rank_ * count + i] = Value(rank_, i, salt);
    ASSERT_TRUE(comm.AllGatherInPlace(buffer, count, DType::kF32, stream).ok());
    ASSERT_TRUE(stream.Synchronize().ok());
    for (int r = 0; r < n_; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(buffer.as<float>()[r * count + i]),
                  std::bit_cast<uint32_t>(Value(r, i, salt)))
            << "rank " << r << "'s element " << i << " of " << count;
      }
    }
  }

  Communicator* comm_ = nullptr;
  int rank_ = 0;
  int n_ = 1;
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<gpu::DeviceArena> arena_;
};

TEST_F(MpiCommunicatorTest, RanksAreDistinctAndAllOnThisMachine) {
  EXPECT_EQ(comm_->backend(), "mpi");
  EXPECT_GE(n_, 2);
  const int32_t mine[2] = {rank_, comm_->local_rank()};
  std::vector<int32_t> all(2 * n_);
  ASSERT_TRUE(
      comm_->AllGatherBytes(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
          .ok());
  for (int r = 0; r < n_; ++r) {
    EXPECT_EQ(all[2 * r], r);
    EXPECT_EQ(all[2 * r + 1], r);  // one machine: local ranks are the ranks
  }
  EXPECT_EQ(comm_->local_size(), n_);
}

TEST_F(MpiCommunicatorTest, ReduceScatterSumsFp32LikeADoubleReferenceForOddCounts) {
  auto stream = NewStream("comm");
  uint64_t salt = 1;
  for (int64_t count : {1, 2, 7, 1001, 65537}) {
    SCOPED_TRACE(count);
    ExpectReduceScatter(*comm_, *stream, count, salt++);
  }
}

TEST_F(MpiCommunicatorTest, AllGatherInPlaceDeliversEveryRanksPartForOddCounts) {
  auto stream = NewStream("comm");
  uint64_t salt = 100;
  for (int64_t count : {1, 3, 999, 65537}) {
    SCOPED_TRACE(count);
    ExpectAllGather(*comm_, *stream, count, salt++);
  }
}

TEST_F(MpiCommunicatorTest, StreamOrderedCollectivesOfNothingAreNoOps) {
  auto stream = NewStream("comm");
  gpu::DeviceSpan a = Carve(64);
  gpu::DeviceSpan b = Carve(64);
  EXPECT_TRUE(comm_->ReduceScatter(a, b, 0, DType::kF32, *stream).ok());
  EXPECT_TRUE(comm_->AllGatherInPlace(a, 0, DType::kF32, *stream).ok());
  EXPECT_TRUE(stream->Synchronize().ok());
}

TEST_F(MpiCommunicatorTest, StreamOrderedCollectivesRefuseCudaStreams16BitSumsAndBadBounds) {
  auto stream = NewStream("comm");
  FakeCudaStream cuda;
  const int64_t count = 5;
  gpu::DeviceSpan send = Carve(count * n_ * 4);
  gpu::DeviceSpan recv = Carve(count * 4);
  Status s = comm_->ReduceScatter(send, recv, count, DType::kF32, cuda);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("use NCCL for CUDA devices"));
  s = comm_->AllGatherInPlace(send, count, DType::kF32, cuda);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("use NCCL for CUDA devices"));
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    EXPECT_EQ(comm_->ReduceScatter(send, recv, count, dtype, *stream).code(),
              StatusCode::kInvalidArgument);
    // All-gather is a copy: 16-bit parts travel as bytes.
    EXPECT_TRUE(comm_->AllGatherInPlace(send, count, dtype, *stream).ok());
  }
  EXPECT_EQ(comm_->ReduceScatter(send, recv, count + 1, DType::kF32, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->ReduceScatter(send, recv, -1, DType::kF32, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      comm_->ReduceScatter(send, send.subspan(4, count * 4), count, DType::kF32, *stream).code(),
      StatusCode::kInvalidArgument);  // overlapping
  EXPECT_EQ(comm_->AllGatherInPlace(recv, count, DType::kF32, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(stream->Synchronize().ok());  // nothing was enqueued
}

TEST_F(MpiCommunicatorTest, AllReduceIsTheRankOrderResultWithTheSameBitsOnEveryRank) {
  constexpr int kValues = 257;
  std::vector<double> sum(kValues);
  std::vector<double> max(kValues);
  for (int i = 0; i < kValues; ++i) sum[i] = max[i] = DoubleValue(rank_, i);
  ASSERT_TRUE(comm_->AllReduce(sum, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm_->AllReduce(max, ReduceOp::kMax).ok());
  for (int i = 0; i < kValues; ++i) {
    double expected_sum = DoubleValue(0, i);
    double expected_max = DoubleValue(0, i);
    for (int r = 1; r < n_; ++r) {
      expected_sum += DoubleValue(r, i);
      expected_max = std::max(expected_max, DoubleValue(r, i));
    }
    ASSERT_EQ(std::bit_cast<uint64_t>(sum[i]), std::bit_cast<uint64_t>(expected_sum)) << i;
    ASSERT_EQ(std::bit_cast<uint64_t>(max[i]), std::bit_cast<uint64_t>(expected_max)) << i;
  }
  // The same bits everywhere: every rank's result, gathered, equals rank 0's.
  std::vector<double> all(kValues * n_);
  ASSERT_TRUE(
      comm_->AllGatherBytes(std::as_bytes(std::span(sum)), std::as_writable_bytes(std::span(all)))
          .ok());
  for (int r = 1; r < n_; ++r) {
    EXPECT_EQ(std::memcmp(&all[r * kValues], &all[0], kValues * sizeof(double)), 0) << r;
  }
}

TEST_F(MpiCommunicatorTest, AllReduceMaxOfANaNOnOneRankIsNaNOnEveryRank) {
  std::vector<double> values = {rank_ == n_ - 1 ? std::nan("") : 1.0 * rank_, -1.0};
  ASSERT_TRUE(comm_->AllReduce(values, ReduceOp::kMax).ok());
  EXPECT_TRUE(std::isnan(values[0]));
  EXPECT_EQ(values[1], -1.0);
}

TEST_F(MpiCommunicatorTest, BroadcastGivesEveryRankTheRootsBytes) {
  for (int root : {0, n_ - 1}) {
    SCOPED_TRACE(root);
    std::vector<std::byte> data(1001);
    for (size_t i = 0; i < data.size(); ++i) {
      data[i] = static_cast<std::byte>(Mix(rank_ * 100000 + i));
    }
    ASSERT_TRUE(comm_->Broadcast(data, root).ok());
    for (size_t i = 0; i < data.size(); ++i) {
      ASSERT_EQ(data[i], static_cast<std::byte>(Mix(root * 100000 + i))) << i;
    }
  }
  std::vector<std::byte> data(8);
  EXPECT_EQ(comm_->Broadcast(data, n_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->Broadcast(data, -1).code(), StatusCode::kInvalidArgument);
}

TEST_F(MpiCommunicatorTest, AllGatherBytesPutsEveryRanksBytesInRankOrder) {
  char mine[16] = {};
  std::snprintf(mine, sizeof(mine), "rank%04d", rank_);
  std::vector<char> all(16 * n_);
  ASSERT_TRUE(
      comm_->AllGatherBytes(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))
          .ok());
  for (int r = 0; r < n_; ++r) {
    char expected[16];
    std::snprintf(expected, sizeof(expected), "rank%04d", r);
    EXPECT_STREQ(&all[16 * r], expected);
  }
  std::vector<char> wrong(16 * n_ + 1);
  EXPECT_EQ(
      comm_
          ->AllGatherBytes(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(wrong)))
          .code(),
      StatusCode::kInvalidArgument);
}

TEST_F(MpiCommunicatorTest, BarrierReturnsOnlyAfterEveryRankArrived) {
  // The last rank arrives 300 ms late; every rank's barrier must last about that long. A first
  // barrier lines the ranks' clocks up, so a rank that reached the test late (a loaded machine)
  // does not count the others' head start; the 50 ms margin is for leaving that first barrier at
  // different times. A barrier that did not wait would return in well under 1 ms.
  ASSERT_TRUE(comm_->Barrier().ok());
  const auto start = std::chrono::steady_clock::now();
  if (rank_ == n_ - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_TRUE(comm_->Barrier().ok());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.25);
}

TEST_F(MpiCommunicatorTest, DuplicatesRunCollectivesFromTwoThreadsAtOnce) {
  auto a = comm_->Duplicate();
  auto b = comm_->Duplicate();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->rank(), rank_);
  EXPECT_EQ((*b)->world_size(), n_);
  // Each thread's collectives are ordered on its own communicator only; the two interleave
  // differently on every rank.
  auto run = [&](Communicator* comm, int offset, int* failures) {
    for (int k = 0; k < 200; ++k) {
      std::vector<double> v = {static_cast<double>(rank_ + offset + k)};
      if (!comm->AllReduce(v, ReduceOp::kSum).ok()) ++*failures;
      double expected = 0;
      for (int r = 0; r < n_; ++r) expected += r + offset + k;
      if (v[0] != expected) ++*failures;
    }
  };
  int failures_a = 0;
  int failures_b = 0;
  std::thread ta(run, a->get(), 0, &failures_a);
  std::thread tb(run, b->get(), 1000, &failures_b);
  ta.join();
  tb.join();
  EXPECT_EQ(failures_a, 0);
  EXPECT_EQ(failures_b, 0);
}

TEST_F(MpiCommunicatorTest, StreamOrderedCollectivesOnTwoStreamsWithTwoCommunicators) {
  auto a = comm_->Duplicate();
  auto b = comm_->Duplicate();
  ASSERT_TRUE(a.ok() && b.ok());
  auto s1 = NewStream("grads");
  auto s2 = NewStream("params");
  // Several collectives enqueued on each stream before any is waited for: each stream runs its
  // communicator's calls in the order they were enqueued, on every rank, while the other
  // stream's run beside them.
  constexpr int kRounds = 6;
  constexpr int64_t kCount = 333;
  std::vector<gpu::DeviceSpan> sends, recvs, gathers;
  for (int k = 0; k < kRounds; ++k) {
    sends.push_back(Carve(kCount * n_ * 4));
    recvs.push_back(Carve(kCount * 4));
    gathers.push_back(Carve(kCount * n_ * 4));
    for (int64_t i = 0; i < kCount * n_; ++i) sends[k].as<float>()[i] = Value(rank_, i, 500 + k);
    for (int64_t i = 0; i < kCount; ++i) {
      gathers[k].as<float>()[rank_ * kCount + i] = Value(rank_, i, 700 + k);
    }
    ASSERT_TRUE((*a)->ReduceScatter(sends[k], recvs[k], kCount, DType::kF32, *s1).ok());
    ASSERT_TRUE((*b)->AllGatherInPlace(gathers[k], kCount, DType::kF32, *s2).ok());
  }
  ASSERT_TRUE(s1->Synchronize().ok());
  ASSERT_TRUE(s2->Synchronize().ok());
  for (int k = 0; k < kRounds; ++k) {
    for (int64_t i = 0; i < kCount; ++i) {
      double exact = 0;
      double magnitude = 0;
      for (int r = 0; r < n_; ++r) {
        exact += Value(r, rank_ * kCount + i, 500 + k);
        magnitude += std::fabs(Value(r, rank_ * kCount + i, 500 + k));
      }
      ASSERT_LE(std::fabs(recvs[k].as<float>()[i] - exact),
                (n_ - 1) * 1.0001 * std::ldexp(magnitude, -24))
          << "round " << k << " element " << i;
    }
    for (int r = 0; r < n_; ++r) {
      for (int64_t i = 0; i < kCount; ++i) {
        ASSERT_EQ(gathers[k].as<float>()[r * kCount + i], Value(r, i, 700 + k))
            << "round " << k << " rank " << r << " element " << i;
      }
    }
  }
}

TEST_F(MpiCommunicatorTest, CheckSameOnAllRanksPassesForOneConfigAndNamesRankOneOtherwise) {
  EXPECT_TRUE(CheckSameOnAllRanks(*comm_, "model", "gpt small, seq 256, bf16").ok());
  const std::string text = rank_ == 1 ? "gpt small, seq 512, bf16" : "gpt small, seq 256, bf16";
  Status s = CheckSameOnAllRanks(*comm_, "model", text);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);  // on every rank, not only rank 1
  EXPECT_THAT(s.message(), HasSubstr("the configuration of rank 1 differs from rank 0's (model)"));
}

// Named items: the first that differs is named (what a user must fix), on every rank.
TEST_F(MpiCommunicatorTest, CheckSameOnAllRanksNamesTheFirstItemThatDiffers) {
  std::vector<std::pair<std::string, std::string>> items = {
      {"--model", "small"}, {"--lr", "0.001"}, {"--seq-len", "64"}};
  EXPECT_TRUE(CheckSameOnAllRanks(*comm_, "the flags", items).ok());
  if (rank_ == 1) items[1].second = "0.0003";
  if (rank_ == 1) items[2].second = "32";
  const Status s = CheckSameOnAllRanks(*comm_, "the flags", items);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("the configuration of rank 1 differs from rank 0's (the flags: --lr)"));
  // A value moved to another name is a difference too.
  std::vector<std::pair<std::string, std::string>> swapped = {{"--a", "1"}, {"--b", ""}};
  if (rank_ == 1) swapped = {{"--a", ""}, {"--b", "1"}};
  EXPECT_THAT(CheckSameOnAllRanks(*comm_, "x", swapped).message(), HasSubstr("(x: --a)"));
}

}  // namespace
}  // namespace strata::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<strata::comm::Communicator> world;
  if (strata::tools::LaunchedByMpi()) {
    strata::comm::CommOptions options;
    options.timeout_seconds = 30;  // a case that diverges between ranks ends the job, not hangs
    auto made = strata::comm::CreateMpiCommunicator(options);
    if (!made.ok()) {
      std::fprintf(stderr, "comm_mpi_test: %s\n", made.status().ToString().c_str());
      return 1;
    }
    world = std::move(*made);
    strata::comm::g_world = world.get();
  }
  const int result = RUN_ALL_TESTS();
  strata::comm::g_world = nullptr;
  world.reset();  // before MPI_Finalize (at exit)
  return result;
}
