// The overlapped engine computes exactly what the sequential one does: for every placement,
// precision and accumulation, with copies and events completing late at random, with eager
// updates, and with gradient buckets poisoned when they return to their pool.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <random>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::OverflowInjector;
using testing::RandomTokenVectors;
using testing::TrainOn;
using testing::TrainRun;

class OverlapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks of ~13k params: with 3 streaming slots most of them stream.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    swap_dir_ = std::filesystem::temp_directory_path() /
                ("strata_overlap_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override { std::filesystem::remove_all(swap_dir_); }

  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim, int accum) {
    return MixedPlacementOptions(*model_, precision, params, optim, accum, swap_dir_.string());
  }

  // Trains `steps` steps on a fixed token stream; the device delays every operation by up to
  // max_delay_us (0: no delay) and throttles copies when copy_bps > 0.
  TrainRun Train(const EngineOptions& o, int steps, int64_t max_delay_us = 0, double copy_bps = 0,
                 Model* model = nullptr) {
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = max_delay_us;
    d.random_delay_seed = 12345;
    d.copy_bytes_per_second = copy_bps;
    auto device = gpu::CreateHostDevice(d);
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, model ? *model : *model_, o, steps);
  }

  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path swap_dir_;
};

TEST_F(OverlapTest, EveryPlacementPrecisionAndAccumulationMatchesTheSequentialResidentRun) {
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int accum : {1, 2}) {
      auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, accum);
      ref_options.overlap = false;
      const TrainRun reference = Train(ref_options, 6);
      ASSERT_EQ(reference.plan.num_resident(), model_->num_blocks());
      // Training did something.
      ASSERT_NE(reference.results.front().loss, reference.results.back().loss);
      for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
        for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
          SCOPED_TRACE(fmt::format("{} accum {} params {} optimizer {}", DTypeName(precision),
                                   accum, ParamHomeName(params), OptimizerHomeName(optim)));
          const TrainRun run = Train(Options(precision, params, optim, accum), 6);
          if (params != ParamHome::kDevice) {
            EXPECT_GE(run.plan.num_resident(), 1);
            EXPECT_LT(run.plan.num_resident(), model_->num_blocks() - 2);
            EXPECT_EQ(run.plan.prefetch_depth, 2);
          }
          EXPECT_LE(run.counters.device_peak_bytes, run.plan.device_budget_bytes);
          ExpectBitIdentical(reference, run);
        }
      }
    }
  }
}

TEST_F(OverlapTest, LateCopiesAndEventsStillGiveBitIdenticalResults) {
  // Every copy, conversion and kernel starts up to 300 us late, at random, and copies run at a
  // PCIe-like pace for this size: work whose event wait is missing would run too early.
  for (DType precision : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, 2);
    ref_options.overlap = false;
    const TrainRun reference = Train(ref_options, 4);
    for (ParamHome params : {ParamHome::kHost, ParamHome::kNvme}) {
      auto o = Options(precision, params, OptimizerHome::kNvme, 2);
      o.test_hooks.poison_released_buckets = true;
      const TrainRun delayed = Train(o, 4, /*max_delay_us=*/300, /*copy_bps=*/2e8);
      ExpectBitIdentical(reference, delayed);
      for (const auto& r : delayed.results) EXPECT_FALSE(r.skipped);
    }
  }
}

TEST_F(OverlapTest, OffloadedBoundaryActivationsGiveBitIdenticalResultsOnLessDeviceMemory) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    for (int accum : {2}) {
      SCOPED_TRACE(fmt::format("{} accum {}", DTypeName(precision), accum));
      auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, accum);
      ref_options.overlap = false;
      const TrainRun reference = Train(ref_options, 2);
      // Streamed params (loads of params and activations share the H2D stream) and resident
      // ones (in backward the activation loads are the only H2D traffic).
      for (ParamHome params : {ParamHome::kNvme, ParamHome::kDevice}) {
        auto o = Options(precision, params, OptimizerHome::kNvme, accum);
        o.placement.offload_activations = true;
        if (params != ParamHome::kDevice) {
          o.placement.device_budget_bytes =
              StreamingMinimumBytes(*model_, precision, o.micro_batch, 3, /*offload=*/true) + 1024;
        }
        // Slow copies (a 4 KiB activation takes 20 ms with resident params) and random delays:
        // a load back that is not waited for is read before it lands.
        const TrainRun offloaded = Train(o, 2, /*max_delay_us=*/1000,
                                         /*copy_bps=*/params == ParamHome::kDevice ? 2e5 : 2e7);
        EXPECT_TRUE(offloaded.plan.offload_activations);
        if (params != ParamHome::kDevice) {
          EXPECT_LT(offloaded.counters.device_peak_bytes,
                    StreamingMinimumBytes(*model_, precision, o.micro_batch, 3, false));
        }
        ExpectBitIdentical(reference, offloaded);
      }
    }
  }
}

TEST_F(OverlapTest, PoisonedBucketsAreNeverReadBeforeTheirCopyLands) {
  // Two buckets only, so each is reused at once; NaN poison on release would make any early
  // read or early reuse a non-finite gradient (a skipped step) and different weights.
  auto ref_options = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  ref_options.overlap = false;
  const TrainRun reference = Train(ref_options, 4);
  auto o = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  o.placement.host_grad_buckets = 2;
  o.test_hooks.poison_released_buckets = true;
  const TrainRun run = Train(o, 4, /*max_delay_us=*/200);
  // Every block's bucket of every micro-batch was poisoned after its fold.
  EXPECT_EQ(run.counters.buckets_poisoned, 4u * 2u * model_->num_blocks());
  for (const auto& r : run.results) EXPECT_FALSE(r.skipped);
  ExpectBitIdentical(reference, run);
}

TEST_F(OverlapTest, EagerUpdatesMatchTheExactStep) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    for (ParamHome params : {ParamHome::kHost, ParamHome::kNvme}) {
      SCOPED_TRACE(fmt::format("{} params {}", DTypeName(precision), ParamHomeName(params)));
      auto exact = Options(precision, params, OptimizerHome::kNvme, 2);
      exact.grad_clip_norm = 0;
      auto eager = exact;
      eager.eager_update = true;
      ExpectBitIdentical(Train(exact, 5), Train(eager, 5, /*max_delay_us=*/100));
    }
  }
}

TEST_F(OverlapTest, EagerModeIsRefusedWhereAnUpdateNeedsTheWholeGradient) {
  auto device = gpu::CreateHostDevice({});
  for (auto [precision, clip] : {std::pair{DType::kF16, 0.0f}, std::pair{DType::kBF16, 1.0f}}) {
    auto o = Options(precision, ParamHome::kNvme, OptimizerHome::kNvme, 1);
    o.grad_clip_norm = clip;
    o.eager_update = true;
    auto e = Engine::Create(model_.get(), device->get(), o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("eager"), std::string::npos);
  }
}

TEST_F(OverlapTest, Fp16OverflowInAnyBlockSkipsEveryBlocksUpdate) {
  OverflowInjector model(model_.get());
  const int n = model.num_blocks();
  for (int block : {0, n / 2, n - 1}) {
    SCOPED_TRACE("overflow in block " + std::to_string(block));
    auto o = Options(DType::kF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
    o.loss_scaler.initial_scale = 1024.0f;
    auto device = gpu::CreateHostDevice({});
    auto engine = Engine::Create(&model, device->get(), o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto& e = **engine;
    const auto tokens = RandomTokenVectors(12, o.micro_batch.tokens(), 5);
    auto batch = [&](int s) {
      return std::vector<MicroBatch>{{tokens[4 * s], tokens[4 * s + 1]},
                                     {tokens[4 * s + 2], tokens[4 * s + 3]}};
    };
    model.Disarm();
    auto r0 = e.Step(batch(0));  // an applied step first: its update is in flight
    ASSERT_TRUE(r0.ok());
    ASSERT_FALSE(r0->skipped);
    std::vector<std::vector<float>> before;
    for (int b = 0; b < n; ++b) before.push_back(*e.MasterWeights(b));
    model.Arm(block);
    auto r1 = e.Step(batch(1));
    ASSERT_TRUE(r1.ok()) << r1.status().ToString();
    EXPECT_TRUE(r1->skipped);
    EXPECT_EQ(e.loss_scale(), 512.0f);
    for (int b = 0; b < n; ++b) {
      const auto after = *e.MasterWeights(b);
      for (size_t i = 0; i < after.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(after[i]), std::bit_cast<uint32_t>(before[b][i]))
            << "block " << b << " element " << i;
      }
    }
    model.Disarm();
    auto r2 = e.Step(batch(2));
    ASSERT_TRUE(r2.ok());
    EXPECT_FALSE(r2->skipped);
    EXPECT_NE((*e.MasterWeights(block))[0], before[block][0]);
  }
}

TEST_F(OverlapTest, KMicroBatchesOfBEqualOneBatchOfKTimesB) {
  // With eps = 1 AdamW's first update is ~ lr * g, linear in the gradient, so the weights
  // differ only by the rounding of the gradient sums.
  auto accumulated = Options(DType::kF32, ParamHome::kNvme, OptimizerHome::kNvme, 3);
  accumulated.micro_batch = {2, 16};
  accumulated.optimizer.adamw().eps = 1.0f;
  accumulated.grad_clip_norm = 0;
  auto whole = accumulated;
  whole.grad_accum_steps = 1;
  whole.micro_batch = {6, 16};
  whole.placement.device_budget_bytes =
      StreamingMinimumBytes(*model_, DType::kF32, whole.micro_batch, 3) + 1024;

  const auto tokens = RandomTokenVectors(6, accumulated.micro_batch.tokens(), 21);
  std::vector<int32_t> all_tokens, all_targets;
  for (int i = 0; i < 3; ++i) {
    all_tokens.insert(all_tokens.end(), tokens[2 * i].begin(), tokens[2 * i].end());
    all_targets.insert(all_targets.end(), tokens[2 * i + 1].begin(), tokens[2 * i + 1].end());
  }
  auto device = gpu::CreateHostDevice({});
  auto a = Engine::Create(model_.get(), device->get(), accumulated);
  auto w = Engine::Create(model_.get(), device->get(), whole);
  ASSERT_TRUE(a.ok() && w.ok());
  const std::vector<MicroBatch> three = {
      {tokens[0], tokens[1]}, {tokens[2], tokens[3]}, {tokens[4], tokens[5]}};
  const std::vector<MicroBatch> one = {{all_tokens, all_targets}};
  auto ra = (*a)->Step(three);
  auto rw = (*w)->Step(one);
  ASSERT_TRUE(ra.ok() && rw.ok());
  EXPECT_NEAR(ra->loss, rw->loss, 1e-5 * std::abs(rw->loss));
  EXPECT_NEAR(ra->grad_norm, rw->grad_norm, 1e-5 * rw->grad_norm);
  double max_update = 0;
  for (int b = 0; b < model_->num_blocks(); ++b) {
    std::vector<float> init(model_->block_num_params(b));
    ASSERT_TRUE(model_->InitParams(b, accumulated.seed, init).ok());
    const auto pa = *(*a)->MasterWeights(b);
    const auto pw = *(*w)->MasterWeights(b);
    for (size_t i = 0; i < pa.size(); ++i) {
      max_update = std::max(max_update, std::abs(double{pw[i]} - init[i]));
      // The update is ~1e-2 * g; rounding of the gradient sums moves it by far less than 1e-6.
      ASSERT_NEAR(pa[i], pw[i], 1e-6) << "block " << b << " element " << i;
    }
  }
  EXPECT_GT(max_update, 1e-5);  // the step really moved the weights
}

}  // namespace
}  // namespace strata::engine
