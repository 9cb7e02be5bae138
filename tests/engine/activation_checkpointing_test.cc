// Activation checkpointing per block (PlacementOptions::activation_checkpointing,
// engine/plan/planner.h): a layer that keeps its forward's activations in its store and skips the
// recomputed forward in backward gives the same losses and master weights, bit for bit, as one
// that recomputes: every family (GPT untied and tied, Llama untied and tied), every precision,
// params resident or streamed, the optimizer on the host or the device, both schedules, LoRA
// with adapter dropout; `all` (every layer recomputes), `none` (none does) and `auto` keeping
// some of the layers. The backward really skips the recomputation where the plan keeps (a
// counting model sees BlockBuffers::forward_kept), and `none` that does not fit is refused.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "base/units.h"
#include "engine/engine.h"
#include "engine/plan/plan_choice.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_families.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::TrainOn;
using testing::TrainRun;

std::unique_ptr<Model> Gpt(bool tied) {
  models::GptShape s{256, 16, 5, 2, 32};
  s.tie_embeddings = tied;
  return std::unique_ptr<Model>(*models::GptModel::Create(s));
}
std::unique_ptr<Model> Llama(bool tied) {
  return std::unique_ptr<Model>(*models::LlamaModel::Create(testing::TinyLlama(tied)));
}

// Counts the backwards that were told their forward is kept, per block.
class CountingModel : public ForwardingModel {
 public:
  explicit CountingModel(Model* inner)
      : ForwardingModel(inner),
        kept_(inner->num_blocks(), 0),
        recomputed_(inner->num_blocks(), 0) {}
  Status Backward(int block, const BlockBuffers& b, gpu::Stream& stream) override {
    (b.forward_kept ? kept_ : recomputed_)[block]++;
    return ForwardingModel::Backward(block, b, stream);
  }
  std::vector<int> kept_, recomputed_;
};

class ActivationCheckpointingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("strata_activation_checkpointing_test_{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The overlap tests' options in `schedule` with `accum` micro-batches: params resident (64 MiB
  // budget) or streamed (the schedule's streaming minimum, one resident layer), the optimizer on
  // the host or the device.
  EngineOptions Options(const Model& model, DType precision, ParamHome params, OptimizerHome optim,
                        int accum, Schedule schedule, ActivationCheckpointing ac) {
    EngineOptions o =
        testing::MixedPlacementOptions(model, precision, params, optim, accum, dir_.string());
    o.placement.schedule = schedule;
    o.placement.activation_checkpointing = ac;
    const int held = schedule == Schedule::kLayerMajor ? accum : 1;
    if (params != ParamHome::kDevice) {
      o.placement.device_budget_bytes =
          StreamingMinimumBytes(model, precision, o.micro_batch, 3, false, 1, false, held) +
          model.block_num_params(1) * SizeOf(precision) + 1024;
    }
    return o;
  }
  // `o` (kAuto) with the smallest device budget, from what its plan with every layer recomputing
  // takes up, at which the plan keeps some layers' activations but not all. (With these tiny
  // models a layer's store is larger than its params, so auto, which keeps after residency,
  // keeps only once every chunk is resident: streamed params with kept activations are `none`'s
  // case.)
  EngineOptions PartlyKept(const Model& model, EngineOptions o) {
    auto all =
        MakePlan(model, o.precision, o.micro_batch, o.placement, {o.optimizer, o.grad_accum_steps});
    EXPECT_TRUE(all.ok()) << all.status().ToString();
    if (all.ok()) o.placement.device_budget_bytes = all->device_total_bytes;
    o.placement.activation_checkpointing = ActivationCheckpointing::kAuto;
    const uint64_t step = model.activation_store_bytes(1, o.micro_batch, o.precision) / 8 + 256;
    for (int i = 0; i < 2000; ++i, o.placement.device_budget_bytes += step) {
      auto plan = MakePlan(model, o.precision, o.micro_batch, o.placement,
                           {o.optimizer, o.grad_accum_steps});
      if (!plan.ok()) continue;
      const int keeping = plan->num_keeping_activations();
      if (keeping > 0 && plan->num_recomputing() > 0) return o;
    }
    ADD_FAILURE() << "no budget keeps some layers but not all";
    return o;
  }
  TrainRun Train(Model& model, const EngineOptions& o, int steps) {
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return TrainOn(**device, model, o, steps);
  }
  // all vs none vs auto keeping some: the same run bit for bit; the backwards told so skip the
  // recomputation of exactly the layers the plan keeps.
  void ExpectAllNoneAutoIdentical(Model& model, const EngineOptions& all_options) {
    const int layers = model.num_blocks() - 2;
    const TrainRun all = Train(model, all_options, 3);
    ASSERT_EQ(all.results.size(), 3u);
    EXPECT_EQ(all.plan.num_keeping_activations(), 0);
    EXPECT_EQ(all.plan.num_recomputing(), layers);
    EngineOptions none_options = all_options;
    none_options.placement.activation_checkpointing = ActivationCheckpointing::kNone;
    if (all_options.placement.param_home == ParamHome::kDevice) {
      none_options.placement.device_budget_bytes = 256 << 20;
    } else {
      const int held = all_options.placement.schedule == Schedule::kLayerMajor
                           ? all_options.grad_accum_steps
                           : 1;
      none_options.placement.device_budget_bytes +=
          layers * held *
          AlignUp(model.activation_store_bytes(1, all_options.micro_batch, all_options.precision),
                  gpu::DeviceArena::kAlignment);
    }
    CountingModel counting(&model);
    const TrainRun none = Train(counting, none_options, 3);
    EXPECT_EQ(none.plan.num_keeping_activations(), layers);
    EXPECT_EQ(none.plan.num_recomputing(), 0);
    EXPECT_LE(none.counters.device_peak_bytes, none.plan.device_budget_bytes);
    for (int b = 1; b <= layers; ++b) {
      EXPECT_GT(counting.kept_[b], 0) << "layer block " << b;
      EXPECT_EQ(counting.recomputed_[b], 0) << "layer block " << b;
    }
    ExpectBitIdentical(all, none);
    const EngineOptions auto_options = PartlyKept(model, all_options);
    CountingModel counting_auto(&model);
    const TrainRun some = Train(counting_auto, auto_options, 3);
    EXPECT_GT(some.plan.num_keeping_activations(), 0);
    EXPECT_GT(some.plan.num_recomputing(), 0);
    for (int b = 0; b < model.num_blocks(); ++b) {
      EXPECT_EQ(counting_auto.kept_[b] > 0, some.plan.blocks[b].keeps_activations) << b;
    }
    // The last layers keep first.
    EXPECT_TRUE(some.plan.blocks[layers].keeps_activations);
    EXPECT_FALSE(some.plan.blocks[1].keeps_activations);
    ExpectBitIdentical(all, some);
  }

  std::filesystem::path dir_;
};

TEST_F(ActivationCheckpointingTest, EveryFamilyAndPrecisionMatchesRecomputationBitForBit) {
  struct Case {
    ParamHome params;
    OptimizerHome optim;
    int accum;
    Schedule schedule;
  };
  const Case cases[] = {
      {ParamHome::kDevice, OptimizerHome::kHost, 1, Schedule::kMicroBatchMajor},
      {ParamHome::kHost, OptimizerHome::kHost, 3, Schedule::kLayerMajor},
      {ParamHome::kHost, OptimizerHome::kHost, 2, Schedule::kMicroBatchMajor},
  };
  for (auto make : {+[] { return Gpt(false); }, +[] { return Gpt(true); },
                    +[] { return Llama(false); }, +[] { return Llama(true); }}) {
    const std::unique_ptr<Model> model = make();
    for (DType precision : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (const Case& c : cases) {
        SCOPED_TRACE(fmt::format("{} {} params {} accum {} {}", model->description(),
                                 DTypeName(precision), ParamHomeName(c.params), c.accum,
                                 ScheduleName(c.schedule)));
        ExpectAllNoneAutoIdentical(*model, Options(*model, precision, c.params, c.optim, c.accum,
                                                   c.schedule, ActivationCheckpointing::kAll));
      }
    }
  }
}

TEST_F(ActivationCheckpointingTest, OptimizerOnTheDeviceMatchesBitForBit) {
  for (Schedule schedule : {Schedule::kMicroBatchMajor, Schedule::kLayerMajor}) {
    const std::unique_ptr<Model> model = Gpt(false);
    SCOPED_TRACE(ScheduleName(schedule));
    ExpectAllNoneAutoIdentical(
        *model, Options(*model, DType::kBF16, ParamHome::kDevice, OptimizerHome::kDevice, 2,
                        schedule, ActivationCheckpointing::kAll));
  }
}

// LoRA keeps too: the adapters add into the layer's scratch, which is the store, and their
// backward recomputes its own intermediates (the dropout mask from the micro-batch's seed).
TEST_F(ActivationCheckpointingTest, LoraWithDropoutMatchesBitForBit) {
  auto llama = models::LlamaModel::Create(testing::TinyLlama(false));
  ASSERT_TRUE(llama.ok());
  ASSERT_TRUE((*llama)
                  ->EnableLora({.rank = 4,
                                .alpha = 8,
                                .targets = {"q_proj", "v_proj", "gate_proj", "down_proj"},
                                .dropout = 0.1})
                  .ok());
  models::GptShape s{256, 16, 5, 2, 32};
  auto gpt = models::GptModel::Create(s);
  ASSERT_TRUE(gpt.ok());
  ASSERT_TRUE(
      (*gpt)
          ->EnableLora(
              {.rank = 4, .alpha = 8, .targets = {"c_attn", "c_fc", "c_proj"}, .dropout = 0.1})
          .ok());
  for (Model* model : {static_cast<Model*>(llama->get()), static_cast<Model*>(gpt->get())}) {
    for (Schedule schedule : {Schedule::kMicroBatchMajor, Schedule::kLayerMajor}) {
      SCOPED_TRACE(fmt::format("{} {}", model->description(), ScheduleName(schedule)));
      ExpectAllNoneAutoIdentical(
          *model, Options(*model, DType::kBF16, ParamHome::kHost, OptimizerHome::kHost, 2, schedule,
                          ActivationCheckpointing::kAll));
    }
  }
}

TEST_F(ActivationCheckpointingTest, NoneThatDoesNotFitIsRefusedNamingTheOption) {
  const std::unique_ptr<Model> model = Gpt(false);
  for (ParamHome params : {ParamHome::kDevice, ParamHome::kHost}) {
    SCOPED_TRACE(ParamHomeName(params));
    EngineOptions o = Options(*model, DType::kBF16, params, OptimizerHome::kHost, 1,
                              Schedule::kMicroBatchMajor, ActivationCheckpointing::kAll);
    auto all = MakePlan(*model, o.precision, o.micro_batch, o.placement, {o.optimizer, 1});
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    o.placement.device_budget_bytes = all->device_total_bytes;
    o.placement.activation_checkpointing = ActivationCheckpointing::kNone;
    auto none = MakePlan(*model, o.precision, o.micro_batch, o.placement, {o.optimizer, 1});
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(none.status().message().find("activation_checkpointing none"), std::string::npos)
        << none.status().message();
    // auto at the same budget keeps nothing, and says so.
    o.placement.activation_checkpointing = ActivationCheckpointing::kAuto;
    PlanRequest request;
    request.precision = o.precision;
    request.micro_batch = o.micro_batch;
    request.optimizer = o.optimizer;
    request.placement = o.placement;
    auto choice = ChoosePlan(*model, request, nullptr);
    ASSERT_TRUE(choice.ok()) << choice.status().ToString();
    EXPECT_EQ(choice->plan.num_keeping_activations(), 0);
    EXPECT_NE(choice->Reasons().find("activation checkpointing: 0 of 5 blocks keep"),
              std::string::npos)
        << choice->Reasons();
  }
}

// The plan's accounting: a kept layer has one region of held micro-batches' stores, counted in
// the device total, within the budget; Describe says how many recompute; the auto device budget
// of `none` holds them all.
TEST_F(ActivationCheckpointingTest, PlanAccountsTheStoresPerHeldMicroBatch) {
  const std::unique_ptr<Model> model = Llama(false);
  const MicroBatchShape shape{2, 16};
  PlacementOptions o;
  o.param_home = ParamHome::kDevice;
  o.optimizer_home = OptimizerHome::kHost;
  o.schedule = Schedule::kLayerMajor;
  o.activation_checkpointing = ActivationCheckpointing::kNone;
  const PlanOptimizer optimizer{{}, 3};
  o.device_budget_bytes = AutoDeviceBudgetBytes(*model, DType::kBF16, shape, o, optimizer);
  auto plan = MakePlan(*model, DType::kBF16, shape, o, optimizer);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const uint64_t store = model->activation_store_bytes(1, shape, DType::kBF16);
  EXPECT_EQ(store, static_cast<uint64_t>(model->scratch_bytes(1, shape, DType::kBF16)));
  EXPECT_EQ(model->activation_store_bytes(0, shape, DType::kBF16), 0);
  EXPECT_EQ(plan->num_keeping_activations(), 4);
  EXPECT_EQ(plan->kept_activation_bytes(), 4 * 3 * AlignUp(store, gpu::DeviceArena::kAlignment));
  int regions = 0;
  for (const DeviceRegion& r : plan->device_regions) {
    if (r.label.rfind("kept activations", 0) == 0) {
      ++regions;
      EXPECT_EQ(r.size_bytes, 3 * AlignUp(store, gpu::DeviceArena::kAlignment)) << r.label;
    }
  }
  EXPECT_EQ(regions, 4);
  EXPECT_LE(plan->device_total_bytes, plan->device_budget_bytes);
  EXPECT_NE(plan->Describe().find("recompute 0 of 4 blocks recompute their forward in backward "
                                  "(activation checkpointing none); 4 keep"),
            std::string::npos)
      << plan->Describe();
}

}  // namespace
}  // namespace strata::engine
