// The device optimizer (engine/device_optimizer.h) on the CUDA backend: the fused kernels against
// cpu_optim on host copies of the same inputs, bit for bit — every device kind and mode, every
// gradient and working dtype, a few steps over odd lengths and lengths past one leaf; statistics
// equal to ComputeGradStats bit for bit (the kernel sums in cpu_optim's order) and the same bits
// run to run, inf and NaN detected; accumulation equal to AccumulateGrad; argument refusals.
// Label gpu: without a GPU every test skips with the reason (tests/gpu/cuda_test_util.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/device_optimizer.h"
#include "tests/engine/device_optimizer_cases.h"
#include "tests/gpu/cuda_test_util.h"

namespace strata::engine {
namespace {

using testing::DeviceAccess;

class DeviceOptimizerCudaTest : public gpu::testing::CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    access_.stream = stream_.get();
    // Beyond the fixture's 256 MiB arena, arenas of 256 MiB more as the comparisons need them.
    access_.carve = [this](size_t size_bytes) {
      const size_t need = size_bytes + gpu::DeviceArena::kAlignment;
      gpu::DeviceArena* last = more_.empty() ? arena_.get() : more_.back().get();
      if (last->capacity_bytes() - last->used_bytes() < need) {
        auto arena = device_->CreateArena(std::max(need, size_t{256} << 20));
        STRATA_CHECK_MSG(arena.ok(), arena.status().ToString());
        more_.push_back(std::move(*arena));
        last = more_.back().get();
      }
      auto span = last->Carve(size_bytes, "test");
      STRATA_CHECK_MSG(span.ok(), span.status().ToString());
      return *span;
    };
    access_.upload = [this](gpu::DeviceSpan dst, std::span<const std::byte> src) {
      Upload(dst, std::vector<std::byte>(src.begin(), src.end()));
    };
    access_.download = [this](gpu::DeviceSpan src, size_t size_bytes) {
      return Download<std::byte>(src, size_bytes);
    };
  }
  void TearDown() override {
    more_.clear();
    CudaTest::TearDown();
  }
  DeviceAccess access_;
  std::vector<std::unique_ptr<gpu::DeviceArena>> more_;
};

constexpr DType kGradDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

TEST_F(DeviceOptimizerCudaTest, EveryKindDTypeAndCopyOutEqualsCpuOptimBitForBit) {
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

TEST_F(DeviceOptimizerCudaTest, LengthsPastTheGridEqualCpuOptim) {
  // 4096 blocks of 256 threads cover 2^20 elements per grid stride: 2^20 + 3 takes a second lap.
  for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{(1 << 20) + 3}}) {
    for (const testing::OptimizerCase& c : testing::DeviceOptimizerCases()) {
      SCOPED_TRACE(c.name + " num_elems " + std::to_string(n));
      EXPECT_TRUE(testing::RunUpdateComparison(access_, c, DType::kBF16, DType::kBF16, n, 2, 9));
    }
  }
}

TEST_F(DeviceOptimizerCudaTest, MisalignedBuffersEqualCpuOptim) {
  // Every buffer 4 bytes past a 16-byte boundary: the kernels take their one-element path.
  DeviceAccess shifted = access_;
  shifted.carve = [this](size_t size_bytes) {
    return access_.carve(size_bytes + 16).subspan(4, size_bytes);
  };
  uint64_t seed = 40;
  for (const testing::OptimizerCase& c : testing::DeviceOptimizerCases()) {
    for (DType g : kGradDTypes) {
      SCOPED_TRACE(c.name + " grad " + std::string(DTypeName(g)));
      EXPECT_TRUE(testing::RunUpdateComparison(shifted, c, g, DType::kBF16, 1001, 2, seed++));
    }
  }
}

TEST_F(DeviceOptimizerCudaTest, ComparisonCatchesADifferentStep) {
  const testing::OptimizerCase c = testing::DeviceOptimizerCases()[0];  // AdamW: bias corrections
  EXPECT_FALSE(testing::RunUpdateComparison(access_, c, DType::kF32, DType::kBF16, 513, 2, 3,
                                            /*perturb=*/true));
}

TEST_F(DeviceOptimizerCudaTest, GradStatsEqualComputeGradStatsBitForBit) {
  std::mt19937_64 rng(11);
  const int64_t lengths[] = {
      0, 1, 4095, 4096, 4097, 65536, 65536 + 9, 3 * 65536 + 100, 5 * 65536, 37 * 65536 + 4099};
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

TEST_F(DeviceOptimizerCudaTest, GradStatsAreTheSameBitsRunToRun) {
  std::mt19937_64 rng(2);
  const int64_t n = 19 * 65536 + 333;
  const std::vector<std::byte> grad = testing::RandomGrad(DType::kBF16, n, rng, 2.0f);
  gpu::DeviceSpan g = access_.carve(grad.size());
  Upload(g, grad);
  const size_t bytes = DeviceGradStatsBytes(n);
  gpu::DeviceSpan rec = access_.carve(bytes);
  std::vector<std::byte> first;
  for (int run = 0; run < 5; ++run) {
    ASSERT_TRUE(EnqueueDeviceGradStats(*stream_, g, DType::kBF16, n, 0.125f, rec).ok());
    const std::vector<std::byte> record = Download<std::byte>(rec, bytes);
    if (run == 0) {
      first = record;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), record.data(), bytes), 0) << "run " << run;
    }
  }
}

TEST_F(DeviceOptimizerCudaTest, GradStatsDetectInfAndNaN) {
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
      gpu::DeviceSpan g = access_.carve(grad.size());
      Upload(g, grad);
      gpu::DeviceSpan rec = access_.carve(DeviceGradStatsBytes(n));
      ASSERT_TRUE(EnqueueDeviceGradStats(*stream_, g, dtype, n, 1.0f, rec).ok());
      auto stats = DecodeDeviceGradStats(Download<std::byte>(rec, DeviceGradStatsBytes(n)));
      ASSERT_TRUE(stats.ok()) << stats.status().ToString();
      EXPECT_TRUE(stats->nonfinite) << DTypeName(dtype) << " " << bad;
      EXPECT_EQ(stats->num_elems, n);
    }
  }
}

TEST_F(DeviceOptimizerCudaTest, AccumulateEqualsAccumulateGrad) {
  uint64_t seed = 21;
  for (DType dtype : kGradDTypes) {
    for (bool overwrite : {false, true}) {
      for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{(1 << 20) + 5}}) {
        testing::ExpectAccumulateMatchesCpu(access_, dtype, n, overwrite, seed++);
      }
    }
  }
}

TEST_F(DeviceOptimizerCudaTest, RefusalsEnqueueNothing) {
  const int64_t n = 1000;
  DeviceUpdateBuffers b;
  b.num_elems = n;
  b.master = Carve(n * 4);
  b.state = {Carve(n * 4)};  // AdamW takes two sections
  b.grad = Carve(n * 2);
  b.grad_dtype = DType::kBF16;
  const std::vector<float> ones(n, 1.0f);
  Upload(b.master, ones);
  const Status s = EnqueueDeviceUpdate(*stream_, cpu_optim::AnyOptimizer{}, {}, b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("takes 2 state sections"), std::string::npos) << s.message();
  EXPECT_EQ(Download<float>(b.master, n), ones);
  cpu_optim::AnyOptimizer q{cpu_optim::OptimizerKind::kAdamW8bit, cpu_optim::AdamWConfig{}};
  b.state.clear();
  EXPECT_EQ(EnqueueDeviceUpdate(*stream_, q, {}, b).message(),
            "adamw8bit runs on the CPU only: use `optimizer_home host` or `optimizer_home nvme`");
  EXPECT_TRUE(stream_->Synchronize().ok());
}

}  // namespace
}  // namespace strata::engine
