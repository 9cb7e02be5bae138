// The optimizer on the device (OptimizerHome::kDevice) and the GPU/CPU split
// (PlacementOptions::optimizer_device_fraction) in the whole engine, on the host backend, where
// the device update is the emulated device stream running cpu_optim's own update
// (engine/device_optimizer.h).
//
// The bound: bit for bit. A device-optimized block's update reads the same gradient (the 16-bit
// gradient as the backward wrote it, or the fp32 sum of the micro-batches' gradients, one fp32
// addition per element in micro-batch order, as the host fold), the same master weights and state
// and the same step (t, clip / loss scale), and computes what cpu_optim computes; its statistics
// are ComputeGradStats over the same values, merged into the step's in the host folds' order. So
// every home and split gives the host-optimizer run's master weights exactly, clipping active
// (clip at 1) and in every precision. On a GPU the kernels are held to cpu_optim bit for bit in
// tests/engine/device_optimizer_cuda_test.cc, and the whole engine to the host run by
// cuda_engine_test.cc's measured bound.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "base/trace.h"
#include "engine/engine.h"
#include "engine/plan/optimizer_state.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
using cpu_optim::AnyOptimizer;
using cpu_optim::OptimizerKind;
using testing::ExpectBitIdentical;
using testing::TrainOn;
using testing::TrainRun;

// The kinds that run on the device.
std::vector<AnyOptimizer> DeviceOptimizers() { return testing::ElementwiseOptimizers(); }

// Where the optimizer lives: its CPU home and the fraction on the device.
struct Home {
  OptimizerHome home;
  double fraction;
  std::string name() const {
    return fmt::format("{} with {} on the device", OptimizerHomeName(home), fraction);
  }
};

class DeviceOptimizerHomeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks (embedding, 6 layers, head) of a tiny GPT.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    root_ = fs::temp_directory_path() /
            ("strata_device_optimizer_home_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(root_ / "swap");
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    device_ = std::move(*device);
  }
  void TearDown() override { fs::remove_all(root_); }

  // AdamW (or `optimizer`), clip at 1, micro-batches of 2 x 16 tokens, everything resident in a
  // 64 MiB budget (params_home kNvme with `streamed`: a budget of the streaming minimum plus what
  // the device-optimized blocks need, so the other blocks stream).
  EngineOptions Options(const AnyOptimizer& optimizer, Home h, int accum = 2,
                        DType precision = DType::kBF16, bool streamed = false) {
    EngineOptions o = testing::MixedPlacementOptions(
        *model_, precision, streamed ? ParamHome::kNvme : ParamHome::kDevice, h.home, accum,
        (root_ / "swap").string());
    o.optimizer = optimizer;
    o.placement.optimizer_device_fraction = h.fraction;
    if (streamed) {
      // What the device-optimized blocks take beside the streaming minimum: the planner's regions
      // of an all-resident plan, less what keeping every block resident takes without them.
      EngineOptions all = o;
      all.placement.device_budget_bytes = 64 << 20;
      auto p = MakePlan(*model_, precision, o.micro_batch, all.placement,
                        {o.optimizer, o.grad_accum_steps});
      EXPECT_TRUE(p.ok()) << p.status().ToString();
      uint64_t extra = 0;
      for (int b = 0; p.ok() && b < model_->num_blocks(); ++b) {
        if (!p->blocks[b].optimizer_on_device) continue;
        for (const DeviceRegion& r : p->device_regions) {
          const std::string& name = p->blocks[b].name;
          if (r.label == "optimizer state " + name || r.label == "gradient " + name ||
              r.label == "resident params " + name) {
            extra += (r.size_bytes + 255) / 256 * 256;
          }
        }
      }
      o.placement.device_budget_bytes =
          StreamingMinimumBytes(*model_, precision, o.micro_batch, 3) + extra;
    }
    return o;
  }
  // The host-optimizer reference: state in host memory, every block resident.
  TrainRun Reference(const AnyOptimizer& optimizer, int accum, DType precision, int steps) {
    EngineOptions o = Options(optimizer, {OptimizerHome::kHost, 0}, accum, precision);
    o.overlap = false;
    return TrainOn(*device_, *model_, o, steps);
  }

  std::unique_ptr<models::GptModel> model_;
  std::unique_ptr<gpu::Device> device_;
  fs::path root_;
};

const std::vector<Home> kHomes = {{OptimizerHome::kDevice, 1.0},
                                  {OptimizerHome::kHost, 0.25},
                                  {OptimizerHome::kHost, 0.5},
                                  {OptimizerHome::kNvme, 0.75},
                                  {OptimizerHome::kNvme, 0.5}};

TEST_F(DeviceOptimizerHomeTest, EveryHomeAndSplitGivesTheHostOptimizersBits) {
  constexpr int kSteps = 3;
  for (const AnyOptimizer& optimizer : DeviceOptimizers()) {
    for (int accum : {1, 2}) {  // the 16-bit gradient in place; fp32 accumulators on the device
      SCOPED_TRACE(fmt::format("{}, {} micro-batches", OptimizerFlagName(optimizer), accum));
      const TrainRun reference = Reference(optimizer, accum, DType::kBF16, kSteps);
      ASSERT_EQ(reference.results.size(), static_cast<size_t>(kSteps));
      for (const Home& h : kHomes) {
        SCOPED_TRACE(h.name());
        const TrainRun run = TrainOn(*device_, *model_, Options(optimizer, h, accum), kSteps);
        ASSERT_EQ(run.results.size(), static_cast<size_t>(kSteps));
        EXPECT_GT(run.plan.device_optimizer_params, 0);
        EXPECT_EQ(run.plan.device_optimizer_params == run.plan.model_params, h.fraction == 1.0);
        // What the run pins beyond what the plan (and estimate) counts is no more than the host
        // optimizer's run pins beyond its plan (the token staging, a few KiB): the device
        // optimizer's state staging is counted.
        auto unplanned = [](const TrainRun& r) {
          return static_cast<int64_t>(r.counters.pinned_bytes) -
                 static_cast<int64_t>(r.plan.pinned_bytes);
        };
        EXPECT_LE(unplanned(run), unplanned(reference));
        ExpectBitIdentical(reference, run);
      }
    }
  }
}

TEST_F(DeviceOptimizerHomeTest, SplitsTakeWholeBlocksInForwardOrderAndStreamTheRest) {
  const AnyOptimizer adamw = DeviceOptimizers()[0];
  const TrainRun reference = Reference(adamw, 2, DType::kBF16, 3);
  for (double fraction : {0.25, 0.5, 0.75}) {
    SCOPED_TRACE(fraction);
    const TrainRun run =
        TrainOn(*device_, *model_,
                Options(adamw, {OptimizerHome::kNvme, fraction}, 2, DType::kBF16, true), 3);
    ASSERT_EQ(run.results.size(), 3u);
    const Plan& p = run.plan;
    // Whole blocks from block 0, within half a block of the fraction asked for.
    int64_t taken = 0;
    bool ended = false;
    for (const Plan::Block& b : p.blocks) {
      if (b.optimizer_on_device) {
        EXPECT_FALSE(ended) << b.name << " on the device after a block that is not";
        EXPECT_TRUE(b.resident) << b.name;
        taken += b.num_params;
      } else {
        ended = true;
      }
    }
    EXPECT_EQ(taken, p.device_optimizer_params);
    EXPECT_NEAR(p.optimizer_device_fraction(), fraction, 0.5 * p.max_block_params / p.model_params);
    // The rest stream, unless the streaming slots' bytes already hold them (0.75: two blocks
    // left, three slots), where the planner keeps everything resident.
    if (fraction <= 0.5) {
      EXPECT_LT(p.num_resident(), static_cast<int>(p.blocks.size()));
    }
    ExpectBitIdentical(reference, run);
  }
}

TEST_F(DeviceOptimizerHomeTest, OnTheDeviceNoGradientCrossesAndNoHostThreadUpdates) {
  const AnyOptimizer adamw = DeviceOptimizers()[0];
  for (const Home& h : {Home{OptimizerHome::kDevice, 1.0}, Home{OptimizerHome::kHost, 0.0},
                        Home{OptimizerHome::kHost, 0.5}}) {
    SCOPED_TRACE(h.name());
    trace::TraceRecorder recorder(/*keep_events=*/false);
    EngineOptions o = Options(adamw, h, 2);
    o.trace = &recorder;
    const TrainRun run = TrainOn(*device_, *model_, o, 2);
    ASSERT_EQ(run.results.size(), 2u);
    const double cpu_optimizer_s = recorder.breakdown()[trace::Category::kCpuOptimizer];
    if (h.fraction == 1.0) {
      EXPECT_EQ(run.counters.grad_bytes_d2h, 0u);
      EXPECT_EQ(cpu_optimizer_s, 0.0);  // no fold, no CPU update
    } else {
      // The host-optimized blocks' gradients, 2 micro-batches of 2 steps, and their updates.
      int64_t host_params = 0;
      for (const Plan::Block& b : run.plan.blocks) {
        if (!b.optimizer_on_device) host_params += b.num_params;
      }
      EXPECT_EQ(run.counters.grad_bytes_d2h, static_cast<uint64_t>(host_params) * 2 * 2 * 2);
      EXPECT_GT(cpu_optimizer_s, 0.0);
    }
  }
}

TEST_F(DeviceOptimizerHomeTest, RepeatsBitForBitAndSkipsAnFp16Overflow) {
  for (const AnyOptimizer& optimizer : DeviceOptimizers()) {
    SCOPED_TRACE(OptimizerFlagName(optimizer));
    const EngineOptions o = Options(optimizer, {OptimizerHome::kDevice, 1.0}, 2, DType::kF16);
    ExpectBitIdentical(TrainOn(*device_, *model_, o, 3), TrainOn(*device_, *model_, o, 3));
    // An overflow in block 3's gradient at step 1: the step is skipped on every block, as with
    // the host optimizer.
    auto overflow_run = [&](const EngineOptions& options) {
      testing::OverflowInjector injector(model_.get());
      return TrainOn(*device_, injector, options, 3, [&](int s) {
        if (s == 1) {
          injector.Arm(3);
        } else {
          injector.Disarm();
        }
      });
    };
    EngineOptions host = Options(optimizer, {OptimizerHome::kHost, 0}, 2, DType::kF16);
    const TrainRun on_host = overflow_run(host), on_device = overflow_run(o);
    ASSERT_EQ(on_device.results.size(), 3u);
    EXPECT_FALSE(on_device.results[0].skipped);
    EXPECT_TRUE(on_device.results[1].skipped);
    ExpectBitIdentical(on_host, on_device);
  }
}

TEST_F(DeviceOptimizerHomeTest, ACheckpointResumesAcrossHomes) {
  const AnyOptimizer adamw = DeviceOptimizers()[0];
  const TrainRun straight = Reference(adamw, 2, DType::kBF16, 6);
  const auto tokens = testing::RandomTokenVectors(6 * 2 * 2, 32, 99);
  auto step = [&](Engine& e, int s) {
    std::vector<MicroBatch> mbs = {{tokens[4 * s], tokens[4 * s + 1]},
                                   {tokens[4 * s + 2], tokens[4 * s + 3]}};
    auto r = e.Step(mbs);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  };
  const std::vector<std::pair<Home, Home>> pairs = {
      {{OptimizerHome::kDevice, 1.0}, {OptimizerHome::kNvme, 0}},
      {{OptimizerHome::kNvme, 0}, {OptimizerHome::kDevice, 1.0}},
      {{OptimizerHome::kHost, 0.5}, {OptimizerHome::kNvme, 0.25}}};
  for (const auto& [from, to] : pairs) {
    SCOPED_TRACE(from.name() + " -> " + to.name());
    const std::string save =
        (root_ / fmt::format("ckpt-{}-{}", OptimizerHomeName(from.home), from.fraction)).string();
    {
      auto e = Engine::Create(model_.get(), device_.get(), Options(adamw, from));
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      for (int s = 0; s < 3; ++s) step(**e, s);
      TrainerState t;
      t.step = 3;
      ASSERT_TRUE((*e)->SaveCheckpoint(save, t).ok());
    }
    auto e = Engine::Create(model_.get(), device_.get(), Options(adamw, to));
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    TrainerState t;
    const Status loaded = (*e)->LoadCheckpoint(save, &t);
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    for (int s = 3; s < 6; ++s) step(**e, s);
    auto hash = (*e)->MasterWeightsXxh3();
    ASSERT_TRUE(hash.ok());
    EXPECT_EQ(*hash, straight.hash);
  }
}

TEST_F(DeviceOptimizerHomeTest, KindsAndModesTheDeviceDoesNotRunAreRefusedByName) {
  EngineOptions o = Options(DeviceOptimizers()[0], {OptimizerHome::kDevice, 1.0});
  o.optimizer = {OptimizerKind::kAdamW8bit, cpu_optim::AdamWConfig{.lr = 1e-2f}};
  auto e = Engine::Create(model_.get(), device_.get(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("adamw8bit runs on the CPU only"), std::string::npos)
      << e.status().ToString();
  o.optimizer = {OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{.lr = 1e-2f}};
  o.placement.optimizer_home = OptimizerHome::kHost;
  o.placement.optimizer_device_fraction = 0.5;
  e = Engine::Create(model_.get(), device_.get(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("runs on the CPU only"), std::string::npos)
      << e.status().ToString();
  o = Options(DeviceOptimizers()[0], {OptimizerHome::kHost, 1.5});
  e = Engine::Create(model_.get(), device_.get(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("is not in [0, 1]"), std::string::npos)
      << e.status().ToString();
}

}  // namespace
}  // namespace strata::engine
