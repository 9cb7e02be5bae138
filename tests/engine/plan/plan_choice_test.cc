// The one entry that chooses a plan (engine/plan/plan_choice.h): nothing auto is MakePlan of the
// request; each auto field is resolved as its rule says, once; the counters see every plan built.
#include "engine/plan/plan_choice.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "base/units.h"
#include "engine/plan/placement_search.h"
#include "models/gpt.h"
#include "tests/engine/plan/h200_profile.h"

namespace strata::engine {
namespace {

struct Gpt {
  std::unique_ptr<models::GptModel> model;
  PlanRequest request;
};

Gpt MakeGpt(const std::string& preset, MicroBatchShape mb) {
  auto shape = models::GptPreset(preset);
  EXPECT_TRUE(shape.ok());
  auto model = models::GptModel::Create(*shape);
  EXPECT_TRUE(model.ok());
  Gpt g{std::move(*model), {}};
  g.request.micro_batch = mb;
  g.request.num_layers = shape->num_layers;
  g.request.channels = shape->channels;
  g.request.placement.nvme_paths = {"/var/tmp"};
  return g;
}

TEST(ChoosePlan, NothingAutoIsTheRequestsPlanBuiltOnce) {
  Gpt g = MakeGpt("small", {1, 64});
  g.request.placement.device_budget_bytes = 4 * kMiB;
  g.request.grad_accum_steps = 8;
  const PlanningCounts before = PlanningCountsSoFar();
  auto choice = ChoosePlan(*g.model, g.request, nullptr);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  const PlanningCounts after = PlanningCountsSoFar();
  EXPECT_EQ(choice->plans_built, 1);
  EXPECT_EQ(after.choices - before.choices, 1);
  EXPECT_EQ(after.plans_built - before.plans_built, 1);
  EXPECT_EQ(after.plans_built_in_choices - before.plans_built_in_choices, 1);
  EXPECT_EQ(choice->Reasons(), "");
  auto plan =
      MakePlan(*g.model, DType::kBF16, {1, 64}, g.request.placement, {g.request.optimizer, 8});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(choice->plan.Describe(), plan->Describe());
  EXPECT_EQ(choice->placement.device_budget_bytes, 4 * kMiB);
  EXPECT_FALSE(choice->update_during_backward);
  EXPECT_FALSE(choice->prediction);  // no machine
  // A MakePlan outside a choice is counted as such.
  const PlanningCounts outside = PlanningCountsSoFar();
  EXPECT_EQ(outside.plans_built - outside.plans_built_in_choices,
            after.plans_built - after.plans_built_in_choices + 1);
}

TEST(ChoosePlan, AnAutoDeviceBudgetIsAutoDeviceBudgetBytesOfThePlacement) {
  Gpt g = MakeGpt("small", {1, 64});
  g.request.automatic.device_budget = true;
  g.request.placement.device_budget_bytes = 123;  // ignored when auto
  auto choice = ChoosePlan(*g.model, g.request, nullptr);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->placement.device_budget_bytes,
            AutoDeviceBudgetBytes(*g.model, DType::kBF16, {1, 64}, g.request.placement));
  EXPECT_EQ(choice->plan.device_budget_bytes, choice->placement.device_budget_bytes);
}

TEST(ChoosePlan, AnInfeasibleFixedBudgetIsMakePlansError) {
  Gpt g = MakeGpt("small", {1, 64});
  g.request.placement.device_budget_bytes = 4 * kKiB;
  auto choice = ChoosePlan(*g.model, g.request, nullptr);
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), StatusCode::kResourceExhausted);
}

// Checked before an auto budget sizes activations from the micro-batch (a sequence longer than
// the context reached the model's own check and ended the process).
TEST(ChoosePlan, AMicroBatchOutsideTheContextIsRefusedBeforeAnyAutoRule) {
  Gpt g = MakeGpt("small", {1, 65});  // the small preset's context is 64
  g.request.automatic.device_budget = true;
  g.request.automatic.schedule = true;
  g.request.grad_accum_steps = 2;
  auto choice = ChoosePlan(*g.model, g.request, nullptr);
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(choice.status().message().find("`micro_batch` of 1 sequences of 65 tokens"),
            std::string::npos)
      << choice.status().message();
  g.request.micro_batch = {0, 64};
  EXPECT_EQ(ChoosePlan(*g.model, g.request, nullptr).status().code(), StatusCode::kInvalidArgument);
  g.request.micro_batch = {1, 64};
  g.request.grad_accum_steps = 0;
  EXPECT_EQ(ChoosePlan(*g.model, g.request, nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST(ChoosePlan, TheAutoPlacementIsTheSearchsFastestPlanAndSaysWhy) {
  const MachineProfile h200 = testing::H200Profile();
  Gpt g = MakeGpt("gpt2-1.5b", {8, 1024});
  g.request.automatic = {
      .param_home = true, .optimizer_home = true, .device_fraction = true, .device_budget = true};
  auto choice = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  PlacementOptions base = g.request.placement;
  base.device_budget_bytes =
      static_cast<uint64_t>(0.95 * h200.device->memory_GiB * static_cast<double>(kGiB));
  auto search = ChoosePlacement(*g.model, DType::kBF16, {8, 1024}, base, {},
                                CostInputsOf(g.request, false), h200, {true, true, true, false});
  ASSERT_TRUE(search.ok()) << search.status().ToString();
  EXPECT_EQ(choice->placement_reason, search->Describe());
  EXPECT_EQ(choice->placement.param_home, search->best.placement.param_home);
  EXPECT_EQ(choice->placement.optimizer_home, search->best.placement.optimizer_home);
  EXPECT_EQ(choice->placement.optimizer_device_fraction,
            search->best.placement.optimizer_device_fraction);
  EXPECT_EQ(choice->placement.device_budget_bytes, base.device_budget_bytes);
  ASSERT_TRUE(choice->prediction);
  EXPECT_EQ(choice->prediction->step_s, search->best.prediction.step_s);
  EXPECT_GT(choice->plans_built, 1);
}

// The rule: on from a 10 % shorter predicted step; only with one rank and overlap.
TEST(ChoosePlan, TheAutoUpdateDuringBackwardFollowsThePredictionWithOneRankAndOverlapOnly) {
  const MachineProfile h200 = testing::H200Profile();
  for (const char* preset : {"gpt2-1.5b", "gpt-7b"}) {
    Gpt g = MakeGpt(preset, {8, 1024});
    g.request.placement.param_home = ParamHome::kDevice;
    g.request.placement.optimizer_home = OptimizerHome::kHost;
    g.request.placement.device_budget_bytes = 128 * kGiB;
    g.request.update_during_backward = true;  // ignored when auto
    g.request.automatic.update_during_backward = true;
    auto choice = ChoosePlan(*g.model, g.request, &h200);
    ASSERT_TRUE(choice.ok()) << choice.status().ToString();
    auto off = PredictStep(choice->plan, CostInputsOf(g.request, false), h200);
    auto on = PredictStep(choice->plan, CostInputsOf(g.request, true), h200);
    ASSERT_TRUE(off.ok() && on.ok());
    EXPECT_EQ(choice->update_during_backward, on->step_s < 0.9 * off->step_s) << preset;
    EXPECT_EQ(choice->update_during_backward_reason.rfind(
                  std::string("update during backward: ") +
                      (choice->update_during_backward ? "on" : "off") + " (auto: predicted step",
                  0),
              0u)
        << choice->update_during_backward_reason;
    EXPECT_EQ(choice->prediction->step_s, (choice->update_during_backward ? on : off)->step_s);
    // The plan holds the backup area of the update during backward it chose.
    EXPECT_EQ(choice->placement.update_during_backward, choice->update_during_backward);
    EXPECT_EQ(choice->plan.update_during_backward, choice->update_during_backward);
    EXPECT_EQ(choice->plan.speculation_backup_bytes > 0, choice->update_during_backward);
    // Deciding makes the plan without it and, when on, the one with its backup area: the run's
    // plan is the one decided on, not built a third time.
    EXPECT_EQ(choice->plans_built, choice->update_during_backward ? 2 : 1) << preset;
    auto same = MakePlan(*g.model, g.request.precision, {8, 1024}, choice->placement,
                         {g.request.optimizer, std::max(1, g.request.grad_accum_steps)});
    ASSERT_TRUE(same.ok()) << same.status().ToString();
    EXPECT_EQ(choice->plan.Describe(), same->Describe()) << preset;
    // Never without overlap, never with data parallelism, never without a machine.
    PlanRequest no_overlap = g.request;
    no_overlap.overlap = false;
    PlanRequest ranks = g.request;
    ranks.placement.ranks = 2;
    ranks.placement.data_parallel = true;
    using Case = std::pair<PlanRequest, const MachineProfile*>;
    for (const auto& [r, machine] :
         {Case{no_overlap, &h200}, Case{ranks, &h200}, Case{g.request, nullptr}}) {
      auto c = ChoosePlan(*g.model, r, machine);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_FALSE(c->update_during_backward) << preset;
      EXPECT_EQ(c->update_during_backward_reason, "");
    }
  }
}

// Its backup area is host memory: where the host budget holds the plan but not the area, the
// update during backward stays off and says why (a run that took it needed ~10 GiB past the
// estimate for gpt-7b).
TEST(ChoosePlan, TheAutoUpdateDuringBackwardStaysOffWhenItsBackupAreaDoesNotFitTheHostBudget) {
  const MachineProfile h200 = testing::H200Profile();
  // Issue 42's case: gpt-7b at 24 GiB, 16 micro-batches of 2 x 2048, layer-major.
  Gpt g = MakeGpt("gpt-7b", {2, 2048});
  g.request.placement.param_home = ParamHome::kHost;
  g.request.placement.optimizer_home = OptimizerHome::kHost;
  g.request.placement.device_budget_bytes = 24 * kGiB;
  g.request.placement.schedule = Schedule::kLayerMajor;
  g.request.grad_accum_steps = 16;
  g.request.automatic.update_during_backward = true;
  auto on = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  ASSERT_TRUE(on->update_during_backward) << on->update_during_backward_reason;
  const Plan& with = on->plan;
  ASSERT_GT(with.speculation_backup_bytes, 0u);
  const uint64_t without = with.host_bytes + with.pinned_bytes - with.speculation_backup_bytes;

  g.request.placement.host_budget_bytes = without + with.speculation_backup_bytes;  // just enough
  auto fits = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_TRUE(fits->update_during_backward);

  g.request.placement.host_budget_bytes = without + with.speculation_backup_bytes - 1;
  auto off = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_FALSE(off->update_during_backward);
  EXPECT_FALSE(off->placement.update_during_backward);
  EXPECT_EQ(off->plan.speculation_backup_bytes, 0u);
  EXPECT_EQ(off->plan.host_bytes + off->plan.pinned_bytes, without);
  EXPECT_NE(off->update_during_backward_reason.find("but its backup area does not fit: host "
                                                    "budget"),
            std::string::npos)
      << off->update_during_backward_reason;
  EXPECT_NE(off->update_during_backward_reason.find("1 B short"), std::string::npos)
      << off->update_during_backward_reason;

  // Asked for outright, the plan that does not hold it is refused naming it.
  g.request.automatic.update_during_backward = false;
  g.request.update_during_backward = true;
  auto asked = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_FALSE(asked.ok());
  EXPECT_EQ(asked.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(asked.status().message().find("of it the update during backward's backup"),
            std::string::npos)
      << asked.status().message();
  EXPECT_NE(asked.status().message().find("turn off `update_during_backward`"), std::string::npos)
      << asked.status().message();
}

// With a machine too, `--schedule auto` plans layer-major in the budget micro-batch-major gets
// (it took its own, larger auto budget, and was predicted in the smaller one).
TEST(ChoosePlan, TheAutoScheduleWithAMachineKeepsTheMicroBatchMajorAutoBudget) {
  const MachineProfile h200 = testing::H200Profile();
  Gpt g = MakeGpt("gpt2-1.5b", {1, 128});
  g.request.placement.param_home = ParamHome::kHost;
  g.request.placement.optimizer_home = OptimizerHome::kHost;
  g.request.grad_accum_steps = 4;
  g.request.automatic.schedule = true;
  g.request.automatic.device_budget = true;
  g.request.compare = true;
  auto choice = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  ASSERT_EQ(choice->placement.schedule, Schedule::kLayerMajor) << choice->schedule_reason;
  PlacementOptions micro_batch_major = g.request.placement;
  micro_batch_major.schedule = Schedule::kMicroBatchMajor;
  const uint64_t budget = AutoDeviceBudgetBytes(*g.model, DType::kBF16, {1, 128}, micro_batch_major,
                                                {g.request.optimizer, 4});
  PlacementOptions layer_major = micro_batch_major;
  layer_major.schedule = Schedule::kLayerMajor;
  ASSERT_LT(budget, AutoDeviceBudgetBytes(*g.model, DType::kBF16, {1, 128}, layer_major,
                                          {g.request.optimizer, 4}));
  EXPECT_EQ(choice->placement.device_budget_bytes, budget);
  EXPECT_EQ(choice->plan.device_budget_bytes, budget);
  // The step the reason and the schedules' table quote is the taken plan's.
  ASSERT_TRUE(choice->prediction);
  ASSERT_EQ(choice->schedules.size(), 2u);
  ASSERT_TRUE(choice->schedules[1].prediction);
  EXPECT_EQ(choice->schedules[1].prediction->step_s, choice->prediction->step_s);
  EXPECT_NE(
      choice->schedule_reason.find(fmt::format("{:.3g} s layer-major", choice->prediction->step_s)),
      std::string::npos)
      << choice->schedule_reason;
}

TEST(ChoosePlan, CompareAddsTheOneRankPlanTheOptimizerAlternativesAndBothSchedules) {
  const MachineProfile h200 = testing::H200Profile();
  Gpt g = MakeGpt("gpt2-1.5b", {8, 1024});
  g.request.placement.device_budget_bytes = 24 * kGiB;
  g.request.grad_accum_steps = 4;
  g.request.automatic.schedule = true;
  g.request.compare = true;
  auto choice = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_FALSE(choice->one_rank);  // one rank
  ASSERT_EQ(choice->optimizer_alternatives.size(), 2u);
  EXPECT_EQ(choice->optimizer_alternatives[0].name, "device");
  EXPECT_EQ(choice->optimizer_alternatives[1].name, "split");
  ASSERT_EQ(choice->schedules.size(), 2u);
  EXPECT_EQ(choice->schedules[0].name, "micro-batch-major");
  EXPECT_EQ(choice->schedules[1].name, "layer-major");
  EXPECT_NE(choice->schedule_reason.find("auto: predicted step"), std::string::npos)
      << choice->schedule_reason;
  // Without compare none of them is built.
  g.request.compare = false;
  auto plain = ChoosePlan(*g.model, g.request, &h200);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->optimizer_alternatives.empty());
  EXPECT_TRUE(plain->schedules.empty());
  EXPECT_LT(plain->plans_built, choice->plans_built);
  EXPECT_EQ(plain->plan.Describe(), choice->plan.Describe());
  // Two ranks: the one-rank plan of the same run.
  g.request.compare = true;
  g.request.placement.ranks = 2;
  g.request.placement.data_parallel = true;
  auto two = ChoosePlan(*g.model, g.request, nullptr);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  ASSERT_TRUE(two->one_rank);
  EXPECT_EQ(two->one_rank->ranks, 1);
  EXPECT_EQ(two->plan.ranks, 2);
}

// The offload optimizer's home (strata.torch's offload="auto"): host memory up to 80 % of what
// is available, then the drive when one is given.
TEST(ChooseOffloadHome, HostWhileTheStateFitsThenNvmeWhenAPathIsGiven) {
  OffloadHomeRequest r;
  r.host_available_bytes = 10 * kGiB;
  r.state_bytes = 8 * kGiB;  // exactly 80 %
  auto c = ChooseOffloadHome(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->home, OptimizerHome::kHost);
  EXPECT_NE(c->reason.find("offload: host (auto: "), std::string::npos) << c->reason;
  r.state_bytes = 8 * kGiB + 1;
  auto refused = ChooseOffloadHome(r);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("`nvme_paths`"), std::string::npos);
  r.nvme_paths_given = true;
  c = ChooseOffloadHome(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->home, OptimizerHome::kNvme);
  r.host_available_bytes = 0;  // unknown: host
  c = ChooseOffloadHome(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->home, OptimizerHome::kHost);
}

}  // namespace
}  // namespace strata::engine
