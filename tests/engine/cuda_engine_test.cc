// The whole engine on the CUDA backend (label gpu): the same training as on the host backend for
// every placement and precision, run to run bit-identical on the GPU, the overlapped and the
// sequential pipelines bit-identical, an fp16 overflow in any block skipping the update, and
// offloaded activations changing no bit. Skipped with the reason without a GPU or without the
// CUDA backend in this build.
//
// GPU and host kernels sum in different orders (gpt_cuda.h), so a GPU run is compared with the
// host run to fp32 rounding, not bit for bit: losses per step within a relative 1e-4 (fp32
// working params) or 2e-3 (16-bit, where a gradient that rounds to the other neighbour moves
// Adam's moments by one 16-bit ulp), and master weights element by element: at least 99.9%
// (fp32) or 99% (16-bit) of them within 1e-7 or 1e-6 of the host's, every one within 2 lr per
// step (Adam's largest move). A wrong kernel moves most weights by ~lr = 1e-2 and fails.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"
#include "tests/gpu/cuda_test_util.h"
#endif

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::OverflowInjector;
using testing::RandomTokenVectors;
using testing::TrainOn;
using testing::TrainRun;

// Empty when a CUDA GPU can be used, else why not.
std::string NoCudaReason() {
#ifdef STRATA_HAVE_CUDA
  return gpu::testing::NoCudaReason();
#else
  return "this build has no CUDA backend (no nvcc at configure time)";
#endif
}

class CudaEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NoCudaReason(); !why.empty()) GTEST_SKIP() << why;
    // 8 blocks of ~13k params: with 3 streaming slots most of them stream.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    swap_dir_ = std::filesystem::temp_directory_path() /
                ("strata_cuda_engine_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override {
    if (!swap_dir_.empty()) std::filesystem::remove_all(swap_dir_);
  }

  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim) {
    EngineOptions o =
        MixedPlacementOptions(*model_, precision, params, optim, /*accum=*/2, swap_dir_.string());
    EXPECT_EQ(o.adamw.lr, kLr);  // the bound of ExpectCloseToHost
    return o;
  }

  static std::unique_ptr<gpu::Device> MakeDevice(gpu::DeviceKind kind) {
    StatusOr<std::unique_ptr<gpu::Device>> device = std::unique_ptr<gpu::Device>();
    if (kind == gpu::DeviceKind::kHost) {
      device = gpu::CreateHostDevice({});
    } else {
#ifdef STRATA_HAVE_CUDA
      gpu::CudaDeviceOptions d;
      d.pinned_budget_bytes = size_t{1} << 30;
      device = gpu::CreateCudaDevice(d);
#endif
    }
    EXPECT_TRUE(device.ok()) << device.status().ToString();
    return device.ok() ? std::move(*device) : nullptr;
  }

  // Trains `steps` steps on a fixed token stream. With `injector`, arms block
  // `overflow_block` in step `overflow_step` (and disarms it afterwards).
  TrainRun Train(gpu::DeviceKind kind, const EngineOptions& o, int steps,
                 OverflowInjector* injector = nullptr, int overflow_step = -1,
                 int overflow_block = -1) {
    auto device = MakeDevice(kind);
    if (!device) return {};
    if (!injector) return TrainOn(*device, *model_, o, steps);
    TrainRun run = TrainOn(*device, *injector, o, steps,
                           [&](int s) { injector->Arm(s == overflow_step ? overflow_block : -1); });
    injector->Disarm();
    return run;
  }

  // The GPU run agrees with the host run to fp32 rounding (see the top of the file).
  static void ExpectCloseToHost(const TrainRun& host, const TrainRun& gpu, DType precision,
                                int steps) {
    const bool fp32 = precision == DType::kF32;
    ASSERT_EQ(host.results.size(), gpu.results.size());
    for (size_t s = 0; s < host.results.size(); ++s) {
      EXPECT_EQ(host.results[s].skipped, gpu.results[s].skipped) << "step " << s;
      EXPECT_NEAR(gpu.results[s].loss, host.results[s].loss,
                  (fp32 ? 1e-4 : 2e-3) * std::abs(host.results[s].loss))
          << "step " << s;
    }
    ASSERT_EQ(host.master.size(), gpu.master.size());
    const double close = fp32 ? 1e-7 : 1e-6;
    const double bound = 2.0 * kLr * steps;
    size_t n = 0, within = 0;
    for (size_t b = 0; b < host.master.size(); ++b) {
      ASSERT_EQ(host.master[b].size(), gpu.master[b].size());
      for (size_t i = 0; i < host.master[b].size(); ++i) {
        const double d = std::abs(double{gpu.master[b][i]} - double{host.master[b][i]});
        ASSERT_LE(d, bound) << "block " << b << " element " << i << ": gpu " << gpu.master[b][i]
                            << " host " << host.master[b][i];
        ++n;
        within += d <= close;
      }
    }
    EXPECT_GE(static_cast<double>(within), (fp32 ? 0.999 : 0.99) * static_cast<double>(n))
        << within << " of " << n << " master weights within " << close << " of the host's";
  }

  static constexpr float kLr = 1e-2f;
  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path swap_dir_;
};

TEST_F(CudaEngineTest, EveryPlacementAndPrecisionTrainsAsOnTheHostAndRepeatsBitForBit) {
  constexpr int kSteps = 4;
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    const TrainRun host =
        Train(gpu::DeviceKind::kHost, Options(precision, ParamHome::kDevice, OptimizerHome::kHost),
              kSteps);
    ASSERT_NE(host.results.front().loss, host.results.back().loss);  // training did something
    for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
      for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
        SCOPED_TRACE(fmt::format("{} params {} optimizer {}", DTypeName(precision),
                                 ParamHomeName(params), OptimizerHomeName(optim)));
        const EngineOptions o = Options(precision, params, optim);
        const TrainRun gpu = Train(gpu::DeviceKind::kCuda, o, kSteps);
        ASSERT_EQ(gpu.results.size(), static_cast<size_t>(kSteps));
        if (params != ParamHome::kDevice) {
          EXPECT_LT(gpu.plan.num_resident(), model_->num_blocks());
        }
        EXPECT_LE(gpu.counters.device_peak_bytes, gpu.plan.device_budget_bytes);
        ExpectCloseToHost(host, gpu, precision, kSteps);
        // Deterministic kernels and event-ordered streams: a second run is bit for bit the same
        // (a missing event wait on the GPU would show up here as a difference).
        ExpectBitIdentical(gpu, Train(gpu::DeviceKind::kCuda, o, kSteps));
      }
    }
  }
}

TEST_F(CudaEngineTest, OverlappedAndSequentialPipelinesAreBitIdentical) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    auto sequential = Options(precision, ParamHome::kNvme, OptimizerHome::kNvme);
    sequential.overlap = false;
    const TrainRun reference = Train(gpu::DeviceKind::kCuda, sequential, 4);
    auto overlapped = Options(precision, ParamHome::kNvme, OptimizerHome::kNvme);
    overlapped.poison_released_buckets = true;
    ExpectBitIdentical(reference, Train(gpu::DeviceKind::kCuda, overlapped, 4));
    auto offloaded = overlapped;
    offloaded.placement.offload_activations = true;
    offloaded.placement.device_budget_bytes =
        StreamingMinimumBytes(*model_, precision, offloaded.micro_batch, 3, /*offload=*/true) +
        1024;
    ExpectBitIdentical(reference, Train(gpu::DeviceKind::kCuda, offloaded, 4));
  }
}

TEST_F(CudaEngineTest, Fp16OverflowInAnyBlockSkipsTheWholeUpdate) {
  EngineOptions o = Options(DType::kF16, ParamHome::kNvme, OptimizerHome::kNvme);
  o.loss_scaler.initial_scale = 1024.0f;  // no overflow of its own
  const TrainRun clean = Train(gpu::DeviceKind::kCuda, o, 3);
  ASSERT_EQ(clean.results.size(), 3u);
  for (const StepResult& r : clean.results) ASSERT_FALSE(r.skipped);
  const TrainRun two_steps = Train(gpu::DeviceKind::kCuda, o, 2);
  for (int block : {0, model_->num_blocks() / 2, model_->num_blocks() - 1}) {
    SCOPED_TRACE(fmt::format("overflow in block {}", block));
    OverflowInjector injector(model_.get());
    const TrainRun run = Train(gpu::DeviceKind::kCuda, o, 3, &injector, /*overflow_step=*/2, block);
    ASSERT_EQ(run.results.size(), 3u);
    EXPECT_FALSE(run.results[1].skipped);
    EXPECT_TRUE(run.results[2].skipped);
    // The skipped step left every master weight as the first two steps made it.
    ASSERT_EQ(run.master.size(), two_steps.master.size());
    EXPECT_EQ(run.hash, two_steps.hash);
  }
}

}  // namespace
}  // namespace strata::engine
