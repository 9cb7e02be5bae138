// Runs the real `strata` binary: `strata estimate --machine` (the cost model,
// engine/plan/cost_model.h, with the committed H200 profile) and `strata doctor --machine-profile`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

using strata::cli_test::Result;
using strata::cli_test::RunStrata;

const std::string kH200 = std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json";

nlohmann::json Json(const Result& r) {
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

void ExpectPrediction(const nlohmann::json& j) {
  for (const char* key : {"step_s", "tokens_per_s", "bound", "parts"}) {
    EXPECT_TRUE(j.contains(key)) << key << " in " << j.dump();
  }
  for (const char* part :
       {"compute", "h2d", "d2h", "cpu_optimizer", "device_optimizer", "nvme_read", "nvme_write"}) {
    EXPECT_TRUE(j["parts"].contains(part)) << part;
    EXPECT_GE(j["parts"][part].get<double>(), 0) << part;
  }
  EXPECT_GT(j["step_s"].get<double>(), 0);
  EXPECT_NEAR(j["tokens_per_s"].get<double>() * j["step_s"].get<double>(),
              j["micro_batch_size"].get<double>() * j["seq_len"].get<double>() *
                  j["grad_accum_steps"].get<double>(),
              1e-6 * j["tokens_per_s"].get<double>());
}

TEST(EstimateMachineCli, JsonHasTheStepItsPartsAndTheBound) {
  const Result r =
      RunStrata("estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --machine " +
                kH200 + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = Json(r);
  ExpectPrediction(j);
  // The default budget is 95 % of the profile's device memory, what an auto placement plans in.
  EXPECT_EQ(j["device_budget_bytes"].get<double>(),
            static_cast<double>(static_cast<uint64_t>(0.95 * 139.8 * (1ull << 30))));
  ASSERT_TRUE(j["alternatives"].is_array());
  ASSERT_EQ(j["alternatives"].size(), 2u);
  EXPECT_EQ(j["alternatives"][0]["optimizer"], "device");
  nlohmann::json device = j["alternatives"][0];
  device.update({{"micro_batch_size", 8}, {"seq_len", 1024}, {"grad_accum_steps", 1}});
  ExpectPrediction(device);
}

// Issue 28's resident rows as `strata estimate` flags: the step within 25 % of the measured one,
// and with the optimizer on the device several times faster.
TEST(EstimateMachineCli, ReproducesTheResidentRowsAndPredictsTheDeviceOptimizer) {
  struct Row {
    const char* flags;
    double measured_step_s;
  };
  for (const Row& row : {Row{"--model gpt2-1.5b --micro-batch-size 8 --seq-len 1024", 0.872},
                         Row{"--model gpt-7b --micro-batch-size 2 --seq-len 2048", 2.730}}) {
    const Result r = RunStrata(std::string("estimate ") + row.flags +
                               " --offload-params device --offload-optimizer host "
                               "--host-budget 125GiB --machine " +
                               kH200 + " --json");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const nlohmann::json j = Json(r);
    const double step = j["step_s"].get<double>();
    EXPECT_GT(step, 0.75 * row.measured_step_s) << row.flags;
    EXPECT_LT(step, 1.25 * row.measured_step_s) << row.flags;
    EXPECT_EQ(j["bound"], "cpu_optimizer");
    const nlohmann::json& device = j["alternatives"][0];
    ASSERT_TRUE(device.contains("step_s")) << device.dump();
    EXPECT_LT(device["step_s"].get<double>() * 3, step);
    EXPECT_EQ(device["parts"]["cpu_optimizer"].get<double>(), 0);
  }
}

// Placement left to the machine (the flags' default, auto): the fastest plan that fits, said
// with its runner-up; without a profile, today's fixed placement.
TEST(EstimateMachineCli, TheDefaultPlacementIsTheFastestPlanThatFits) {
  Result r = RunStrata("estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --machine " +
                       kH200 + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  nlohmann::json j = Json(r);
  EXPECT_EQ(j["optimizer_home"], "device");
  EXPECT_EQ(j["bound"], "compute");
  EXPECT_NE(j["placement_choice"].get<std::string>().find("runner-up"), std::string::npos)
      << j.dump(2);
  // 12 GiB: the params fit, the whole optimizer does not: a split.
  r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --device-budget "
      "12GiB --host-budget 125GiB --machine " +
      kH200 + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  j = Json(r);
  EXPECT_GT(j["optimizer_device_fraction"].get<double>(), 0);
  EXPECT_LT(j["optimizer_device_fraction"].get<double>(), 1);
  r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --device-budget "
      "12GiB --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  j = Json(r);
  EXPECT_EQ(j["param_home"], "nvme");
  EXPECT_EQ(j["optimizer_home"], "nvme");
  EXPECT_EQ(j["placement_choice"], "");
}

TEST(EstimateMachineCli, TextShowsThePredictionOrWhatAProfileAdds) {
  Result r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 "
      "--offload-params device --offload-optimizer host --machine " +
      kH200);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("predicted: step"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bound by cpu_optimizer"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("optimizer on the device: step"), std::string::npos) << r.out;
  // Below the profile's memory, the alternatives say they were planned in 95 % of it.
  r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --device-budget 12GiB "
      "--machine " +
      kH200);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(
      r.out.find("optimizer on the device, in 95 % of the device's memory (132.81 GiB): step"),
      std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find("optimizer on the device), in 95 % of the device's memory (132.81 GiB): step"),
      std::string::npos)
      << r.out;
  r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 8 --seq-len 1024 --device-budget 12GiB "
      "--json --machine " +
      kH200);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Json(r)["alternatives"][0]["device_budget_bytes"].get<double>(),
            static_cast<double>(static_cast<uint64_t>(0.95 * 139.8 * (1ull << 30))));
  r = RunStrata("estimate --model gpt2-1.5b --device-budget 8GiB");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("--machine FILE"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("predicted:"), std::string::npos) << r.out;
  // Without a profile the budget stays required.
  r = RunStrata("estimate --model gpt2-1.5b");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--device-budget is required"), std::string::npos) << r.err;
}

// Issue 32's case: gpt-7b at 24 GiB with 16 micro-batches of 2 x 2048 on the H200 profile. The
// estimate predicts both schedules (each with its own placement) and takes layer-major, which
// sends each gradient D2H once (fp32) instead of 16 times (bf16).
TEST(EstimateMachineCli, ShowsBothSchedulesAndTakesTheFasterLayerMajor) {
  const std::string args =
      "estimate --model gpt-7b --device-budget 24GiB --host-budget 125GiB --grad-accum-steps 16 "
      "--micro-batch-size 2 --seq-len 2048 --machine " +
      kH200;
  Result r = RunStrata(args + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  nlohmann::json j = Json(r);
  ExpectPrediction(j);
  EXPECT_EQ(j["schedule"], "layer-major");
  EXPECT_EQ(j["held_micro_batches"], 16);
  EXPECT_NE(j["schedule_choice"].get<std::string>().find("schedule: layer-major (auto: predicted"),
            std::string::npos)
      << j["schedule_choice"];
  const nlohmann::json& lm = j["schedules"]["layer-major"];
  const nlohmann::json& mb = j["schedules"]["micro-batch-major"];
  ASSERT_TRUE(lm.contains("step_s") && mb.contains("step_s")) << j["schedules"].dump(2);
  EXPECT_TRUE(lm["taken"].get<bool>());
  EXPECT_FALSE(mb["taken"].get<bool>());
  EXPECT_EQ(lm["step_s"], j["step_s"]);
  EXPECT_LT(lm["step_s"].get<double>(), mb["step_s"].get<double>());
  EXPECT_LT(lm["d2h_bytes"].get<double>() * 4, mb["d2h_bytes"].get<double>());

  r = RunStrata(args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("schedule: layer-major (auto: predicted step"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  micro-batch-major schedule: step"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  layer-major schedule (taken): step"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layer-major), bound by"), std::string::npos) << r.out;

  // Given: the other schedule is still shown, and this one taken.
  r = RunStrata(args + " --schedule micro-batch-major --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  j = Json(r);
  EXPECT_EQ(j["schedule"], "micro-batch-major");
  EXPECT_EQ(j["schedule_choice"], "");
  EXPECT_TRUE(j["schedules"]["micro-batch-major"]["taken"].get<bool>());
  EXPECT_TRUE(j["schedules"]["layer-major"].contains("step_s"));

  // One micro-batch: the schedules are the same; nothing to compare.
  r = RunStrata(
      "estimate --model gpt-7b --device-budget 24GiB --host-budget 125GiB --micro-batch-size 2 "
      "--seq-len 2048 --machine " +
      kH200 + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  j = Json(r);
  EXPECT_EQ(j["schedule"], "micro-batch-major");
  EXPECT_TRUE(j["schedules"].empty()) << j["schedules"].dump();
}

// Without a profile auto takes layer-major when its plan fits, and says what --machine adds; a
// bad value is one line naming the flag and the values it takes.
TEST(EstimateMachineCli, ScheduleWithoutAMachineAndABadValue) {
  Result r = RunStrata(
      "estimate --model gpt2-350m --device-budget 8GiB --grad-accum-steps 4 --seq-len 512 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = Json(r);
  EXPECT_EQ(j["schedule"], "layer-major");
  EXPECT_NE(j["schedule_choice"].get<std::string>().find("--machine FILE"), std::string::npos)
      << j["schedule_choice"];
  EXPECT_FALSE(j.contains("schedules"));
  r = RunStrata("estimate --model gpt2-350m --device-budget 8GiB --schedule sideways");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(strata::cli_test::Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--schedule 'sideways' is not one of auto, layer-major, micro-batch-major"),
            std::string::npos)
      << r.err;
}

TEST(EstimateMachineCli, ABadProfileIsOneLineNamingTheKey) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("strata_bad_profile_" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << R"({"pcie": {"h2d_GBps": "fast", "d2h_GBps": 40}})";
  const Result r =
      RunStrata("estimate --model gpt2-1.5b --device-budget 8GiB --machine " + path.string());
  std::filesystem::remove(path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("pcie.h2d_GBps"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("strata doctor --machine-profile"), std::string::npos) << r.err;
}

TEST(DoctorMachineProfileCli, WritesAProfileThatEstimateAccepts) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("strata_profile_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "machine.json").string();
  Result r = RunStrata("doctor --machine-profile " + file + " --profile-seconds 0.05 --path " +
                       dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("wrote " + file), std::string::npos) << r.out;
  std::ifstream in(file);
  const nlohmann::json profile = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(profile.is_discarded());
  for (const char* kind : {"adamw", "adam", "lion", "sgd", "adagrad"}) {
    EXPECT_GT(profile["host"]["optimizer_params_per_s"][kind].get<double>(), 0) << kind;
  }
  EXPECT_GT(profile["host"]["cores"].get<int>(), 0);
  // A machine without a GPU says so and writes no device section.
  EXPECT_EQ(profile.contains("device"), r.out.find("device         none") == std::string::npos)
      << r.out;
  EXPECT_EQ(profile.contains("device"), profile.contains("pcie"));

  r = RunStrata(
      "estimate --model gpt2-1.5b --micro-batch-size 2 --seq-len 256 --device-budget "
      "8GiB --offload-params device --offload-optimizer host --machine " +
      file + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = Json(r);
  if (profile.contains("device")) {
    ExpectPrediction(j);
  } else {
    // Compute runs on a device: a host-only profile plans but cannot predict, and says why.
    EXPECT_NE(j["prediction_error"].get<std::string>().find("\"device\""), std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

// A regular file in `dir` ("a-file"), for a --path that is not a directory.
std::string RegularFileIn(const std::filesystem::path& dir) {
  const std::string path = (dir / "a-file").string();
  std::ofstream(path) << "x";
  return path;
}

// A path the profile cannot be written to is refused before the measurements, not after them,
// and leaves no temporary file behind.
TEST(DoctorMachineProfileCli, AnUnwritablePathIsRefusedFirstAndLeavesNothing) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("strata_profile_bad_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a-directory");
  for (const std::string& target :
       {(dir / "a-directory").string(), (dir / "missing" / "machine.json").string()}) {
    const Result r = RunStrata("doctor --machine-profile " + target +
                               " --profile-seconds 0.05 --path " + dir.string());
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("--machine-profile"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("cpu optimizer"), std::string::npos) << "measured first:\n" << r.out;
  }
  // So is a --path to measure that is not a directory (it would leave out the NVMe section).
  for (const std::string& path : {(dir / "missing").string(), RegularFileIn(dir)}) {
    const Result r = RunStrata("doctor --machine-profile " + (dir / "m.json").string() +
                               " --profile-seconds 0.05 --path " + path);
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("--path '" + path + "'"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("cpu optimizer"), std::string::npos) << "measured first:\n" << r.out;
  }
  std::filesystem::remove(dir / "a-file");
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    left.push_back(e.path().filename().string());
  }
  EXPECT_EQ(left, std::vector<std::string>{"a-directory"});
  std::filesystem::remove_all(dir);
}

}  // namespace
