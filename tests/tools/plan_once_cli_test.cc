// Runs the real `strata` binary: each command chooses its plan once, through engine::ChoosePlan,
// and nothing plans again after the choice (not the CLI, not Engine::Create, not the training
// loop). The planning counters (engine::PlanningCountsSoFar) come out in --summary-json and in
// estimate --json; a re-plan anywhere in the run shows as a plan built outside the choice.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_strata.h"

namespace {

using strata::cli_test::Result;
using strata::cli_test::RunStrata;

const std::string kH200 = std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json";

class PlanOnceCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("strata_plan_once_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // `strata train ARGS --summary-json F` in the scratch directory: the summary's "planning".
  nlohmann::json TrainPlanning(const std::string& args) {
    const std::string summary = (dir_ / "summary.json").string();
    const Result r =
        RunStrata("train " + args + " --nvme-path " + dir_.string() + " --summary-json " + summary);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream in(summary);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    return j.is_discarded() ? nlohmann::json() : j["planning"];
  }
  std::filesystem::path dir_;
};

void ExpectChosenOnce(const nlohmann::json& planning) {
  ASSERT_TRUE(planning.is_object()) << planning.dump();
  EXPECT_EQ(planning["choices"], 1) << planning.dump();
  EXPECT_EQ(planning["plans_built_outside_choices"], 0) << planning.dump();
  EXPECT_GE(planning["plans_built"].get<int>(), 1) << planning.dump();
}

TEST_F(PlanOnceCli, TheDefaultTrainChoosesItsPlanOnce) {
  ExpectChosenOnce(TrainPlanning("--steps 2 --log-every 1 --sample-bytes 0"));
}

TEST_F(PlanOnceCli, ATrainWithEveryPlacementOptionAutoAndAMachineChoosesItsPlanOnce) {
  const nlohmann::json planning = TrainPlanning(
      "--steps 2 --log-every 1 --sample-bytes 0 --machine " + kH200 +
      " --device-budget auto --offload-params auto --offload-optimizer auto"
      " --optimizer-device-fraction auto --schedule auto --update-during-backward auto");
  ExpectChosenOnce(planning);
  // The search and the comparisons built many plans, all inside the one choice.
  EXPECT_GT(planning["plans_built"].get<int>(), 10) << planning.dump();
}

TEST_F(PlanOnceCli, EstimateWithAMachineChoosesItsPlanOnce) {
  const Result r = RunStrata(
      "estimate --model gpt-7b --device-budget 24GiB --host-budget 125GiB --grad-accum-steps 16 "
      "--micro-batch-size 2 --seq-len 2048 --machine " +
      kH200 + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  ExpectChosenOnce(j["planning"]);
  EXPECT_EQ(j["schedule"], "layer-major");
}

}  // namespace
