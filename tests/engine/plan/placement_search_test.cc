// Placement by predicted time (engine/plan/placement_search.h) on the committed H200 profile
// (bench/machines/h200.json): the choice is the fastest of the plans that fit, by the cost model,
// every fixed choice is kept, and a profile without what every plan needs is an error.
#include "engine/plan/placement_search.h"

#include <gtest/gtest.h>

#include <string>

#include "base/units.h"
#include "engine/plan/machine_profile.h"
#include "models/gpt.h"
#include "tests/engine/plan/h200_profile.h"

namespace strata::engine {
namespace {

MachineProfile H200() { return testing::H200Profile(); }

class PlacementSearchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto shape = models::GptPreset("gpt2-1.5b");
    ASSERT_TRUE(shape.ok());
    auto model = models::GptModel::Create(*shape);
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    inputs_ = {.num_layers = shape->num_layers, .channels = shape->channels};
    base_.nvme_paths = {"/var/tmp"};
  }
  StatusOr<PlacementChoice> Choose(uint64_t budget, PlacementSearch search = {}) {
    PlacementOptions p = base_;
    p.device_budget_bytes = budget;
    return ChoosePlacement(*model_, DType::kBF16, mb_, p, {}, inputs_, H200(), search);
  }
  // The prediction of one placement, or nullopt when it does not fit.
  std::optional<double> StepOf(uint64_t budget, ParamHome params, OptimizerHome optim,
                               double fraction) {
    PlacementOptions p = base_;
    p.device_budget_bytes = budget;
    p.param_home = params;
    p.optimizer_home = optim;
    p.optimizer_device_fraction = fraction;
    auto plan = MakePlan(*model_, DType::kBF16, mb_, p);
    if (!plan.ok()) return std::nullopt;
    auto pr = PredictStep(*plan, inputs_, H200());
    EXPECT_TRUE(pr.ok()) << pr.status().ToString();
    return pr.ok() ? std::optional<double>(pr->step_s) : std::nullopt;
  }

  std::unique_ptr<models::GptModel> model_;
  MicroBatchShape mb_{8, 1024};
  CostInputs inputs_;
  PlacementOptions base_;
};

TEST_F(PlacementSearchTest, AWholeGpuTakesTheOptimizerOnTheDeviceAndSaysTheRunnerUp) {
  const uint64_t budget = 100 * kGiB;
  auto c = Choose(budget);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->best.placement.optimizer_home, OptimizerHome::kDevice);
  EXPECT_EQ(c->best.prediction.bound, "compute");
  // Not slower than any placement a user could have fixed.
  for (ParamHome ph : {ParamHome::kDevice, ParamHome::kHost, ParamHome::kNvme}) {
    for (OptimizerHome oh : {OptimizerHome::kHost, OptimizerHome::kNvme}) {
      for (double f : {0.0, 0.5}) {
        const auto step = StepOf(budget, ph, oh, f);
        if (step) {
          EXPECT_LE(c->best.prediction.step_s, *step);
        }
      }
    }
  }
  ASSERT_TRUE(c->runner_up.has_value());
  EXPECT_NE(c->runner_up->effect, c->best.effect);
  EXPECT_GE(c->runner_up->prediction.step_s, c->best.prediction.step_s);
  EXPECT_GT(c->feasible, 1);
  const std::string d = c->Describe();
  EXPECT_NE(d.find("placement: chosen by predicted time"), std::string::npos) << d;
  EXPECT_NE(d.find("runner-up: "), std::string::npos) << d;
}

TEST_F(PlacementSearchTest, APartialBudgetSplitsTheOptimizerAndItsPlanFits) {
  // 12 GiB: the params (2.8 GiB) fit, the whole optimizer (16.5 GiB) does not.
  const uint64_t budget = 12 * kGiB;
  auto c = Choose(budget);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const PlacementOptions& p = c->best.placement;
  EXPECT_NE(p.optimizer_home, OptimizerHome::kDevice);
  EXPECT_GT(p.optimizer_device_fraction, 0);
  EXPECT_LT(p.optimizer_device_fraction, 1);
  auto plan = MakePlan(*model_, DType::kBF16, mb_, p);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->device_total_bytes, budget);
  // Faster than keeping the whole optimizer on the CPU.
  const auto cpu_only = StepOf(budget, p.param_home, OptimizerHome::kHost, 0);
  ASSERT_TRUE(cpu_only.has_value());
  EXPECT_LT(c->best.prediction.step_s, *cpu_only);
}

TEST_F(PlacementSearchTest, FixedChoicesAreKeptAndAProfileWithoutADeviceIsAnError) {
  PlacementSearch only_fraction{.param_home = false, .optimizer_home = false};
  base_.param_home = ParamHome::kNvme;
  base_.optimizer_home = OptimizerHome::kNvme;
  auto c = Choose(12 * kGiB, only_fraction);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->best.placement.param_home, ParamHome::kNvme);
  EXPECT_EQ(c->best.placement.optimizer_home, OptimizerHome::kNvme);
  MachineProfile host_only = H200();
  host_only.device.reset();
  PlacementOptions p = base_;
  p.device_budget_bytes = 12 * kGiB;
  auto none = ChoosePlacement(*model_, DType::kBF16, mb_, p, {}, inputs_, host_only, {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("device"), std::string::npos) << none.status().ToString();
}

// When nothing fits, the error says what each whole optimizer home is short of (not the last
// candidate's reason, a 90 % split's demand for device memory).
TEST_F(PlacementSearchTest, WhenNothingFitsEachOptimizerHomeSaysWhatIsShort) {
  base_.host_budget_bytes = 8 * kGiB;  // gpt2-1.5b's AdamW state is about 23 GiB
  base_.nvme_capacity_bytes = 4 * kGiB;
  auto none = Choose(6 * kGiB);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  const std::string m(none.status().message());
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(m.rfind("none of the 63 placements tried fits; with the params' home host: ", 0), 0u)
      << m;
  for (const char* part : {"the optimizer on the device: device budget 6.00 GiB",
                           "; the optimizer in host memory: host budget 8.00 GiB",
                           "; the optimizer on NVMe: NVMe paths have 4.00 GiB free"}) {
    EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
  }
  EXPECT_EQ(m.find("90"), std::string::npos) << m;

  // One candidate: its own reason, as before.
  PlacementSearch fixed{.param_home = false, .optimizer_home = false, .device_fraction = false};
  base_.param_home = ParamHome::kHost;
  base_.optimizer_home = OptimizerHome::kHost;
  auto one = Choose(6 * kGiB, fixed);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(std::string(one.status().message()).rfind("host budget 8.00 GiB", 0), 0u)
      << one.status().ToString();
}

}  // namespace
}  // namespace strata::engine
