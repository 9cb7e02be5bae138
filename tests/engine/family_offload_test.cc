// The offload-equivalence tests for the Hugging Face families: a Llama (grouped-query attention,
// untied and tied head) and a tied GPT-2 train to bit-identical master weights in every
// placement, precision and accumulation, with the tied embedding streamed, prefetched, folded
// from two contributions and swapped to NVMe like any other chunk.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_families.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::OverflowInjector;
using testing::TrainOn;
using testing::TrainRun;

std::vector<testing::Family> Families() { return testing::TinyFamilies(true); }

class FamilyOffloadTest : public ::testing::TestWithParam<testing::Family> {
 protected:
  void SetUp() override {
    model_ = GetParam().make();
    swap_dir_ = std::filesystem::temp_directory_path() /
                fmt::format("strata_family_test_{}_{}", GetParam().name, ::getpid());
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override { std::filesystem::remove_all(swap_dir_); }

  TrainRun Train(const EngineOptions& o, int steps, int64_t max_delay_us = 0,
                 Model* model = nullptr) {
    gpu::HostDeviceOptions d;
    d.max_random_delay_us = max_delay_us;
    d.random_delay_seed = 777;
    auto device = gpu::CreateHostDevice(d);
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, model ? *model : *model_, o, steps);
  }
  EngineOptions Options(DType precision, ParamHome params, OptimizerHome optim, int accum) {
    return MixedPlacementOptions(*model_, precision, params, optim, accum, swap_dir_.string());
  }

  std::unique_ptr<Model> model_;
  std::filesystem::path swap_dir_;
};

TEST_P(FamilyOffloadTest, EveryPlacementPrecisionAndAccumulationMatchesTheSequentialResidentRun) {
  for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int accum : {1, 2}) {
      auto ref_options = Options(precision, ParamHome::kDevice, OptimizerHome::kHost, accum);
      ref_options.overlap = false;
      const TrainRun reference = Train(ref_options, 4);
      ASSERT_FALSE(reference.results.empty());
      ASSERT_NE(reference.results.front().loss, reference.results.back().loss);
      for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
        for (OptimizerHome optim : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
          SCOPED_TRACE(fmt::format("{} accum {} params {} optimizer {}", DTypeName(precision),
                                   accum, ParamHomeName(params), OptimizerHomeName(optim)));
          const TrainRun run = Train(Options(precision, params, optim, accum), 4);
          if (params != ParamHome::kDevice) {
            EXPECT_LT(run.plan.num_resident(), model_->num_blocks() - 1);
          }
          EXPECT_LE(run.counters.device_peak_bytes, run.plan.device_budget_bytes);
          ExpectBitIdentical(reference, run);
        }
      }
    }
  }
}

TEST_P(FamilyOffloadTest, LateCopiesAndEventsStillGiveBitIdenticalResults) {
  auto ref_options = Options(DType::kBF16, ParamHome::kDevice, OptimizerHome::kHost, 2);
  ref_options.overlap = false;
  const TrainRun reference = Train(ref_options, 3);
  auto o = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  o.test_hooks.poison_released_buckets = true;
  const TrainRun delayed = Train(o, 3, /*max_delay_us=*/300);
  ExpectBitIdentical(reference, delayed);
  for (const auto& r : delayed.results) EXPECT_FALSE(r.skipped);
}

TEST_P(FamilyOffloadTest, Fp16OverflowInTheHeadSkipsEveryBlocksUpdateTiedChunkIncluded) {
  auto o = Options(DType::kF16, ParamHome::kNvme, OptimizerHome::kNvme, 1);
  OverflowInjector injected(model_.get());
  injected.Arm(model_->num_blocks() - 1);
  const TrainRun run = Train(o, 1, 0, &injected);
  ASSERT_EQ(run.results.size(), 1u);
  EXPECT_TRUE(run.results[0].skipped);
  for (int b = 0; b < model_->num_blocks(); ++b) {
    std::vector<float> init(model_->block_num_params(b));
    ASSERT_TRUE(model_->InitParams(b, o.seed, init).ok());
    ASSERT_EQ(run.master[b], init) << "block " << b;
  }
}

TEST_P(FamilyOffloadTest, CheckpointOnNvmeResumesBitIdentically) {
  // Params and optimizer state on NVMe, the tied chunk included: n steps, save, a fresh engine
  // loads and runs m more == n + m straight.
  const int n = 3, m = 3;
  const auto o = Options(DType::kBF16, ParamHome::kNvme, OptimizerHome::kNvme, 2);
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  const auto tokens = testing::RandomTokenVectors(4 * (n + m), o.micro_batch.tokens(), 5);
  auto run = [&](Engine& e, int from, int to) {
    for (int s = from; s < to; ++s) {
      const std::vector<MicroBatch> mbs = {{tokens[4 * s], tokens[4 * s + 1]},
                                           {tokens[4 * s + 2], tokens[4 * s + 3]}};
      auto r = e.Step(mbs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  };
  uint64_t straight = 0;
  {
    auto e = Engine::Create(model_.get(), device->get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    run(**e, 0, n + m);
    straight = *(*e)->MasterWeightsXxh3();
  }
  const std::string save_dir = (swap_dir_ / "ckpt").string();
  {
    auto e = Engine::Create(model_.get(), device->get(), o);
    ASSERT_TRUE(e.ok());
    run(**e, 0, n);
    TrainerState state;
    state.step = n;
    ASSERT_TRUE((*e)->SaveCheckpoint(save_dir, state).ok());
  }
  auto e = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(e.ok());
  TrainerState state;
  ASSERT_TRUE((*e)->LoadCheckpoint(save_dir, &state).ok());
  EXPECT_EQ(state.step, n);
  run(**e, n, n + m);
  EXPECT_EQ(*(*e)->MasterWeightsXxh3(), straight);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyOffloadTest, ::testing::ValuesIn(Families()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace strata::engine
