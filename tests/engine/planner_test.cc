#include "engine/planner.h"

#include <gtest/gtest.h>

#include "models/gpt.h"

namespace strata::engine {
namespace {

TEST(Planner, BudgetBelowWorkingParamsStreamsSomeBlocksAndFits) {
  auto model = models::GptModel::Create(*models::GptPreset("small"));
  ASSERT_TRUE(model.ok());
  const MicroBatchShape mb{1, 64};
  PlacementOptions o;
  o.nvme_paths = {"/tmp"};
  const uint64_t minimum = StreamingMinimumBytes(**model, DType::kBF16, mb);
  const uint64_t working = (*model)->num_params() * 2;
  ASSERT_LT(minimum, working);
  o.device_budget_bytes = minimum + (working - minimum) / 2;
  ASSERT_LT(o.device_budget_bytes, 2 * static_cast<uint64_t>((*model)->num_params()));
  auto plan = MakePlan(**model, DType::kBF16, mb, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->device_total_bytes, o.device_budget_bytes);
  EXPECT_GT(plan->num_resident(), 0);
  EXPECT_LT(plan->num_resident(), (*model)->num_blocks());
  EXPECT_EQ(plan->streaming_slots, 2);
  EXPECT_NE(plan->Describe().find("streamed per use from nvme"), std::string::npos);
}

TEST(Planner, RejectsZeroBudgetAndMissingNvmePath) {
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  PlacementOptions o;
  o.device_budget_bytes = 0;
  o.nvme_paths = {"/tmp"};
  EXPECT_EQ(MakePlan(**model, DType::kBF16, {1, 8}, o).status().code(),
            StatusCode::kInvalidArgument);
  o.device_budget_bytes = 1 << 30;
  o.nvme_paths.clear();
  EXPECT_EQ(MakePlan(**model, DType::kBF16, {1, 8}, o).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Planner, DeviceHomeNeedsEveryBlockResident) {
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  PlacementOptions o;
  o.param_home = ParamHome::kDevice;
  o.optimizer_home = OptimizerHome::kHost;
  o.device_budget_bytes = StreamingMinimumBytes(**model, DType::kBF16, {1, 8});
  auto plan = MakePlan(**model, DType::kBF16, {1, 8}, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("--offload-params device"), std::string::npos);
}

}  // namespace
}  // namespace strata::engine
