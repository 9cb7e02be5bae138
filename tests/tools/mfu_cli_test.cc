// Runs the real `strata` binary: MFU in `strata train`'s progress lines and --summary-json with a
// --machine profile that has the device's peak (and none without one), and the device budget
// refused against the device's free memory before anything is made (issue 42, items 4 and 6).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>

#include "run_strata.h"

namespace {

using strata::cli_test::Result;
using strata::cli_test::RunStrata;

const std::string kH200 = std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json";
// The tiny GPT at T = 16: 6 x 15040 params + 12 x 2 layers x 16 x 16 (tests/engine/plan/
// model_flops_test.cc counts them by hand).
constexpr int64_t kTinyFlopsPerToken = 96384;

class TrainMfuCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("strata_mfu_cli_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The committed H200 profile with device.peak_bf16_TFLOPs set to `peak` (0: the key removed).
  std::string Profile(double peak) {
    std::ifstream in(kH200);
    nlohmann::json j = nlohmann::json::parse(in);
    j["device"].erase("peak_bf16_TFLOPs");
    if (peak > 0) j["device"]["peak_bf16_TFLOPs"] = peak;
    const std::string path = (dir_ / "machine.json").string();
    std::ofstream(path) << j.dump(2);
    return path;
  }

  std::string TrainArgs(const std::string& extra) const {
    return std::string("train --data ") + STRATA_DATA +
           " --model tiny --seq-len 16 --steps 3 --log-every 1 --eval-every 0 --sample-bytes 0"
           " --device host --offload-params device --offload-optimizer host --summary-json " +
           Summary() + " " + extra;
  }
  std::string Summary() const { return (dir_ / "summary.json").string(); }
  nlohmann::json ReadSummary() const {
    std::ifstream in(Summary());
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded());
    return j;
  }

  std::filesystem::path dir_;
};

// The plain progress lines ("step     1/3 | ... |   12345 tok/s[ | MFU 41.2%] | h2d ...").
std::vector<std::string> StepLines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("step ", 0) == 0) lines.push_back(line);
  }
  return lines;
}

TEST_F(TrainMfuCli, ProgressLineAndSummaryGiveMfuFromTheStepTime) {
  // A peak of 1 GFLOP/s (the smallest a profile takes), so the host's step shows a large MFU.
  const Result r = RunStrata(TrainArgs("--machine " + Profile(0.001)));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = StepLines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  const std::regex field(R"(\|\s+([0-9]+) tok/s \| MFU ([0-9.]+)% \|)");
  for (const std::string& line : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(line, m, field)) << line;
    const double tokens_per_s = std::stod(m[1]), mfu_percent = std::stod(m[2]);
    // From the printed rate (rounded to a token per second) and printed to 0.1 %.
    const double expected = 100.0 * kTinyFlopsPerToken * tokens_per_s / 1e9;
    EXPECT_NEAR(mfu_percent, expected, 100.0 * kTinyFlopsPerToken * 0.5 / 1e9 + 0.05 + 1e-9)
        << line;
    EXPECT_GT(mfu_percent, 0) << line;
  }
  const nlohmann::json j = ReadSummary();
  EXPECT_EQ(j["model_flops_per_token"], kTinyFlopsPerToken);
  ASSERT_TRUE(j["mfu"].is_number()) << j.dump();
  const double tokens_per_s = j["tokens_per_second"].get<double>();
  EXPECT_NEAR(j["mfu"].get<double>(), kTinyFlopsPerToken * tokens_per_s / 1e9,
              1e-12 * kTinyFlopsPerToken * tokens_per_s / 1e9);
}

TEST_F(TrainMfuCli, WithoutTheDevicePeakThereIsNoMfu) {
  for (const std::string& machine : {std::string(), "--machine " + Profile(0)}) {
    SCOPED_TRACE(machine.empty() ? "no --machine" : "a profile without peak_bf16_TFLOPs");
    const Result r = RunStrata(TrainArgs(machine));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const std::vector<std::string> lines = StepLines(r.out);
    ASSERT_EQ(lines.size(), 3u) << r.out;
    for (const std::string& line : lines) EXPECT_EQ(line.find("MFU"), std::string::npos) << line;
    const nlohmann::json j = ReadSummary();
    EXPECT_TRUE(j.contains("mfu") && j["mfu"].is_null()) << j.dump();
    EXPECT_EQ(j["model_flops_per_token"], kTinyFlopsPerToken);
  }
}

TEST_F(TrainMfuCli, DeviceBudgetAboveTheFreeDeviceMemoryIsRefusedNamingBoth) {
  // 1 PiB: more than any host device reports free (the host backend's is the host's memory).
  const Result r = RunStrata(TrainArgs("--device-budget 1048576GiB"));
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(strata::cli_test::Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("strata: error: --device-budget is 1048576.00 GiB of device memory, more "
                       "than the "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(" GiB free on the host device (of "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("give --device-budget "), std::string::npos) << r.err;
  // Refused before the run made anything.
  EXPECT_FALSE(std::filesystem::exists(Summary()));
}

}  // namespace
