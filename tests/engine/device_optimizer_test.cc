// The device optimizer (engine/device_optimizer.h) on the host backend, where the emulated device
// runs cpu_optim itself on the stream's thread: every device kind and mode, every gradient and
// working dtype, a few steps over odd lengths, equal to cpu_optim::UpdateState bit for bit; the
// statistics record and its decoding (including the CUDA backend's per-leaf layout, built here
// from cpu_optim's own leaf sums) equal to ComputeGradStats bit for bit; accumulation equal to
// AccumulateGrad; and the refusals, which leave every buffer untouched.
#include "engine/device_optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/kernels.h"
#include "tests/engine/device_optimizer_cases.h"

namespace strata::engine {
namespace {

using testing::DeviceAccess;

class DeviceOptimizerHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = gpu::CreateHostDevice({});
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    device_ = std::move(*dev);
    auto stream = device_->CreateStream("optimizer");
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    stream_ = std::move(*stream);
    access_.stream = stream_.get();
    // Device memory in arenas of 16 MiB, a new one when the last is full (a large arena costs
    // its zero-filling up front).
    access_.carve = [this](size_t size_bytes) {
      if (arenas_.empty() || arenas_.back()->capacity_bytes() - arenas_.back()->used_bytes() <
                                 size_bytes + gpu::DeviceArena::kAlignment) {
        auto arena = device_->CreateArena(
            std::max(size_bytes + gpu::DeviceArena::kAlignment, size_t{16} << 20));
        STRATA_CHECK_MSG(arena.ok(), arena.status().ToString());
        arenas_.push_back(std::move(*arena));
      }
      auto s = arenas_.back()->Carve(size_bytes, "test");
      STRATA_CHECK_MSG(s.ok(), s.status().ToString());
      return *s;
    };
    // Host device memory is host memory: copy once the stream is idle.
    access_.upload = [this](gpu::DeviceSpan dst, std::span<const std::byte> src) {
      EXPECT_TRUE(stream_->Synchronize().ok());
      STRATA_CHECK(dst.size_bytes >= src.size());
      if (!src.empty()) std::memcpy(dst.data, src.data(), src.size());
    };
    access_.download = [this](gpu::DeviceSpan src, size_t size_bytes) {
      const Status s = stream_->Synchronize();
      EXPECT_TRUE(s.ok()) << s.ToString();
      return std::vector<std::byte>(src.data, src.data + size_bytes);
    };
  }

  std::unique_ptr<gpu::Device> device_;
  std::vector<std::unique_ptr<gpu::DeviceArena>> arenas_;
  std::unique_ptr<gpu::Stream> stream_;
  DeviceAccess access_;
};

constexpr DType kGradDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

TEST_F(DeviceOptimizerHostTest, EveryKindDTypeAndCopyOutEqualsCpuOptimBitForBit) {
  const std::optional<DType> workings[] = {DType::kBF16, DType::kF16, DType::kF32, std::nullopt};
  uint64_t seed = 1;
  for (const testing::OptimizerCase& c : testing::DeviceOptimizerCases()) {
    for (DType g : kGradDTypes) {
      for (const std::optional<DType>& w : workings) {
        SCOPED_TRACE(c.name + " grad " + std::string(DTypeName(g)) + " working " +
                     (w ? std::string(DTypeName(*w)) : "none"));
        EXPECT_TRUE(testing::RunUpdateComparison(access_, c, g, w, 3001, 3, seed++));
      }
    }
  }
}

TEST_F(DeviceOptimizerHostTest, LengthsAcrossTilesAndLeavesEqualCpuOptim) {
  const testing::OptimizerCase c = testing::DeviceOptimizerCases()[0];
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{16384}, int64_t{16385}, int64_t{65536 + 13}}) {
    SCOPED_TRACE("num_elems " + std::to_string(n));
    EXPECT_TRUE(testing::RunUpdateComparison(access_, c, DType::kBF16, DType::kBF16, n, 2, 7));
  }
}

TEST_F(DeviceOptimizerHostTest, ComparisonCatchesADifferentStep) {
  // The comparison itself can fail: the device runs step t + 1 against cpu_optim's step t.
  for (const testing::OptimizerCase& c : testing::DeviceOptimizerCases()) {
    if (c.optimizer.kind == cpu_optim::OptimizerKind::kLion) continue;  // Lion ignores the step
    if (c.name == "SgdPlain") continue;                                 // so does plain SGD
    if (c.name == "AdamWSmallBeta1NoBiasCorrection") continue;          // and no bias correction
    SCOPED_TRACE(c.name);
    EXPECT_FALSE(testing::RunUpdateComparison(access_, c, DType::kF32, DType::kBF16, 513, 2, 3,
                                              /*perturb=*/true));
  }
}

TEST_F(DeviceOptimizerHostTest, ZeroElementsEnqueueNothing) {
  DeviceUpdateBuffers b;  // StateLayout leaves out sections of 0 elements: none
  b.state = {};
  const Status s =
      EnqueueDeviceUpdate(*stream_, testing::DeviceOptimizerCases()[0].optimizer, {}, b);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(stream_->Synchronize().ok());
}

TEST_F(DeviceOptimizerHostTest, GradStatsEqualComputeGradStats) {
  std::mt19937_64 rng(11);
  const int64_t lengths[] = {0, 1, 4095, 4096, 4097, 65536, 65536 + 9, 3 * 65536 + 100, 5 * 65536};
  for (DType dtype : kGradDTypes) {
    for (int64_t n : lengths) {
      for (float scale : {1.0f, 1.0f / 1024.0f}) {
        const std::vector<std::byte> grad = testing::RandomGrad(dtype, n, rng, 3.0f);
        testing::ExpectStatsMatchCpu(access_, dtype, grad, n, scale,
                                     std::string(DTypeName(dtype)) + " n " + std::to_string(n));
      }
    }
  }
}

TEST_F(DeviceOptimizerHostTest, GradStatsDetectInfAndNaN) {
  std::mt19937_64 rng(5);
  for (DType dtype : kGradDTypes) {
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      const int64_t n = 2 * 65536 + 77;
      std::vector<std::byte> grad = testing::RandomGrad(dtype, n, rng);
      const int64_t at = 65536 + 5;
      if (dtype == DType::kF32) {
        std::memcpy(grad.data() + at * 4, &bad, 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? FloatToHalf(bad) : FloatToBf16(bad);
        std::memcpy(grad.data() + at * 2, &h, 2);
      }
      testing::ExpectStatsMatchCpu(access_, dtype, grad, n, 1.0f, "nonfinite");
      gpu::DeviceSpan g = access_.carve(grad.size());
      access_.upload(g, grad);
      gpu::DeviceSpan rec = access_.carve(DeviceGradStatsBytes(n));
      ASSERT_TRUE(EnqueueDeviceGradStats(*stream_, g, dtype, n, 1.0f, rec).ok());
      auto stats = DecodeDeviceGradStats(access_.download(rec, DeviceGradStatsBytes(n)));
      ASSERT_TRUE(stats.ok());
      EXPECT_TRUE(stats->nonfinite) << DTypeName(dtype) << " " << bad;
    }
  }
}

// The CUDA backend's record holds one sum per leaf; decoding adds them pairwise as cpu_optim does.
// Built here from cpu_optim's own leaf sums, the decoded total equals ComputeGradStats bit for bit.
TEST(DeviceGradStatsRecord, PerLeafSumsDecodeToComputeGradStats) {
  namespace ci = cpu_optim::internal;
  std::mt19937_64 rng(3);
  for (int64_t n : {int64_t{1}, int64_t{65536}, int64_t{2 * 65536 + 1}, int64_t{7 * 65536 + 3},
                    int64_t{13 * 65536}}) {
    const std::vector<std::byte> grad = testing::RandomGrad(DType::kBF16, n, rng, 5.0f);
    const int64_t leaves = (n + ci::kStatsLeafElems - 1) / ci::kStatsLeafElems;
    std::vector<std::byte> record(DeviceGradStatsBytes(n));
    ASSERT_EQ(record.size(), 16 + 8 * static_cast<size_t>(leaves));
    const int64_t header[2] = {n, leaves};
    std::memcpy(record.data(), header, sizeof(header));
    for (int64_t l = 0; l < leaves; ++l) {
      const double leaf = ci::BestKernelTable().sum_squares(
          grad.data(), DType::kBF16, 0.25, l * ci::kStatsLeafElems,
          std::min(n, (l + 1) * ci::kStatsLeafElems));
      std::memcpy(record.data() + 16 + 8 * l, &leaf, 8);
    }
    auto got = DecodeDeviceGradStats(record);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    auto want = cpu_optim::ComputeGradStats({grad.data(), DType::kBF16}, n, 0.25f);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(std::bit_cast<uint64_t>(got->sum_squares), std::bit_cast<uint64_t>(want->sum_squares))
        << "n " << n;
    EXPECT_EQ(got->num_elems, n);
    EXPECT_FALSE(got->nonfinite);
  }
}

TEST(DeviceGradStatsRecord, ShortOrInconsistentRecordsAreDataLoss) {
  std::vector<std::byte> record(16 + 8);
  EXPECT_EQ(DecodeDeviceGradStats(std::span(record).first(8)).status().code(),
            StatusCode::kDataLoss);
  const int64_t too_many[2] = {10, 2};  // 10 elements are one leaf
  std::memcpy(record.data(), too_many, 16);
  EXPECT_EQ(DecodeDeviceGradStats(record).status().code(), StatusCode::kDataLoss);
  const int64_t cut[2] = {3 * 65536, 3};  // needs 16 + 24 bytes
  std::memcpy(record.data(), cut, 16);
  EXPECT_EQ(DecodeDeviceGradStats(record).status().code(), StatusCode::kDataLoss);
  const int64_t empty[2] = {0, 0};
  std::memcpy(record.data(), empty, 16);
  auto stats = DecodeDeviceGradStats(record);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sum_squares, 0.0);
  EXPECT_EQ(stats->num_elems, 0);
}

TEST_F(DeviceOptimizerHostTest, AccumulateEqualsAccumulateGrad) {
  uint64_t seed = 21;
  for (DType dtype : kGradDTypes) {
    for (bool overwrite : {false, true}) {
      for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{65536 + 3}}) {
        testing::ExpectAccumulateMatchesCpu(access_, dtype, n, overwrite, seed++);
      }
    }
  }
}

// ---- Refusals: kInvalidArgument naming the problem; nothing enqueued, nothing modified ----

class DeviceOptimizerRefusalTest : public DeviceOptimizerHostTest {
 protected:
  // An AdamW block of n elements with every buffer filled with 1.0f / 0x3c00 bits.
  DeviceUpdateBuffers Block(int64_t n) {
    DeviceUpdateBuffers b;
    b.num_elems = n;
    b.master = Filled(static_cast<size_t>(n) * 4);
    b.state = {Filled(static_cast<size_t>(n) * 4), Filled(static_cast<size_t>(n) * 4)};
    b.grad = Filled(static_cast<size_t>(n) * 2);
    b.grad_dtype = DType::kBF16;
    b.working = Filled(static_cast<size_t>(n) * 2);
    b.working_dtype = DType::kBF16;
    block_ = b;
    return b;
  }
  gpu::DeviceSpan Filled(size_t size_bytes) {
    gpu::DeviceSpan s = access_.carve(size_bytes);
    std::memset(s.data, 0x3c, size_bytes);
    return s;
  }
  static bool Untouched(gpu::DeviceSpan s) {
    return std::all_of(s.data, s.data + s.size_bytes,
                       [](std::byte x) { return x == std::byte{0x3c}; });
  }
  void ExpectRefused(const cpu_optim::AnyOptimizer& o, const DeviceUpdateBuffers& b,
                     const std::string& message_part) {
    const Status s = EnqueueDeviceUpdate(*stream_, o, {}, b);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(message_part), std::string::npos) << s.message();
    ASSERT_TRUE(stream_->Synchronize().ok());
    // The buffers as Block() made them (b may alias them with other sizes or pointers).
    EXPECT_TRUE(Untouched(block_.master));
    for (const gpu::DeviceSpan& st : block_.state) EXPECT_TRUE(Untouched(st));
    EXPECT_TRUE(Untouched(block_.grad));
    EXPECT_TRUE(Untouched(block_.working));
  }
  DeviceUpdateBuffers block_;
  cpu_optim::AnyOptimizer adamw_;
};

TEST_F(DeviceOptimizerRefusalTest, AdamW8bitAndAdafactorRunOnTheCpuOnly) {
  cpu_optim::AnyOptimizer q{cpu_optim::OptimizerKind::kAdamW8bit, cpu_optim::AdamWConfig{}};
  Status s = CheckDeviceOptimizer(q);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "adamw8bit runs on the CPU only: use `optimizer_home host` or `optimizer_home nvme`");
  cpu_optim::AnyOptimizer f{cpu_optim::OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{}};
  s = CheckDeviceOptimizer(f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("adafactor runs on the CPU only"), std::string::npos);
  for (const testing::OptimizerCase& c : testing::DeviceOptimizerCases()) {
    EXPECT_TRUE(CheckDeviceOptimizer(c.optimizer).ok()) << c.name;
  }
  DeviceUpdateBuffers b = Block(100);
  b.state.clear();
  ExpectRefused(q, b, "adamw8bit");
}

TEST_F(DeviceOptimizerRefusalTest, WrongSizesSectionsDTypesAndOverlapsAreRefused) {
  DeviceUpdateBuffers b = Block(100);
  {
    DeviceUpdateBuffers c = b;
    c.master.size_bytes = 399;
    ExpectRefused(adamw_, c, "master holds 399 bytes");
  }
  {
    DeviceUpdateBuffers c = b;
    c.state.pop_back();
    ExpectRefused(adamw_, c, "takes 2 state sections (exp_avg, exp_avg_sq), got 1");
  }
  {
    cpu_optim::AnyOptimizer plain_sgd{cpu_optim::OptimizerKind::kSgd, cpu_optim::SgdConfig{}};
    DeviceUpdateBuffers c = b;
    c.state.pop_back();
    ExpectRefused(plain_sgd, c, "takes 0 state sections (none), got 1");
  }
  {
    DeviceUpdateBuffers c = b;
    c.state[1].size_bytes = 40;
    ExpectRefused(adamw_, c, "state section exp_avg_sq holds 40 bytes");
  }
  {
    DeviceUpdateBuffers c = b;
    c.grad.size_bytes = 100;  // bf16 needs 200
    ExpectRefused(adamw_, c, "grad holds 100 bytes");
  }
  {
    DeviceUpdateBuffers c = b;
    c.grad_dtype = static_cast<DType>(42);
    ExpectRefused(adamw_, c, "grad has unknown dtype 42");
  }
  {
    DeviceUpdateBuffers c = b;
    c.working = c.master.subspan(0, 200);  // copy-out over the master weights
    ExpectRefused(adamw_, c, "master and working overlap");
  }
  {
    DeviceUpdateBuffers c = b;
    c.master.data = nullptr;
    ExpectRefused(adamw_, c, "master is null");
  }
  {
    DeviceUpdateBuffers c = b;
    c.master = c.master.subspan(2, 396);
    c.num_elems = 99;
    c.master.size_bytes = 396;
    ExpectRefused(adamw_, c, "master is not 4-byte aligned");
  }
  {
    cpu_optim::AnyOptimizer bad = adamw_;
    bad.adamw().lr = -1.0f;
    ExpectRefused(bad, b, "lr");
  }
  const Status s = EnqueueDeviceUpdate(*stream_, adamw_, {.step = 0}, b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("step must be >= 1"), std::string::npos) << s.message();
}

TEST_F(DeviceOptimizerRefusalTest, StatsAndAccumulateCheckTheirBuffers) {
  gpu::DeviceSpan grad = Filled(2 * 65537);
  gpu::DeviceSpan small = Filled(DeviceGradStatsBytes(65536));  // one leaf: 24 bytes
  Status s = EnqueueDeviceGradStats(*stream_, grad, DType::kBF16, 65537, 1.0f, small);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("stats holds 24 bytes"), std::string::npos) << s.message();
  s = EnqueueDeviceGradStats(*stream_, grad, DType::kBF16, 65537, NAN, Filled(32));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  s = EnqueueDeviceGradStats(*stream_, grad, DType::kF32, 65537, 1.0f, Filled(32));
  EXPECT_NE(s.message().find("grad holds"), std::string::npos) << s.message();
  gpu::DeviceSpan acc = Filled(4 * 100);
  s = EnqueueDeviceGradAccumulate(*stream_, acc, acc.subspan(200, 200), DType::kBF16, 100, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("acc and grad overlap"), std::string::npos) << s.message();
  s = EnqueueDeviceGradAccumulate(*stream_, acc, grad, DType::kF32, 101, false);
  EXPECT_NE(s.message().find("acc holds 400 bytes"), std::string::npos) << s.message();
  ASSERT_TRUE(stream_->Synchronize().ok());
  EXPECT_TRUE(Untouched(small));
  EXPECT_TRUE(Untouched(acc));
}

}  // namespace
}  // namespace strata::engine
