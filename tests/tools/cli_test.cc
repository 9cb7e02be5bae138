// Runs the real `strata` binary as a user would.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "run_strata.h"

namespace {

using strata::cli_test::Lines;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("strata_cli_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Small() const {
    return std::string("train --data ") + STRATA_DATA +
           " --model tiny --seq-len 16 --eval-batches 2 "
           "--nvme-path " +
           dir_.string();
  }
  // `strata ARGS --json`'s plan; an empty object (and a failed expectation) when it fails.
  static nlohmann::json EstimateJson(const std::string& args) {
    const Result r = RunStrata(args + " --json");
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }
  std::filesystem::path dir_;
};

TEST_F(CliTest, TrainThreeStepsWritesASummaryWithEveryField) {
  const auto json_path = dir_ / "summary.json";
  const Result r = RunStrata(
      Small() + " --device host --steps 3 --eval-every 3 --sample-bytes 20 --summary-json " +
      json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("plan:"), std::string::npos);
  EXPECT_NE(r.out.find("sample:"), std::string::npos);
  std::ifstream in(json_path);
  ASSERT_TRUE(in.good());
  const auto j = nlohmann::json::parse(in);
  for (const char* key :
       {"steps", "tokens_per_second", "loss_first", "loss_last", "val_loss", "device", "io_backend",
        "precision", "tf32", "model_params", "model_state_bytes", "device_budget_bytes",
        "device_peak_bytes", "bytes_h2d", "bytes_d2h", "nvme_bytes_read", "nvme_bytes_written",
        "master_weights_xxh3"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["steps"], 3);
  EXPECT_EQ(j["device"], "host");
  EXPECT_EQ(j["precision"], "bf16");
  EXPECT_TRUE(j["io_backend"] == "uring" || j["io_backend"] == "posix");
  EXPECT_LE(j["device_peak_bytes"].get<uint64_t>(), j["device_budget_bytes"].get<uint64_t>());
  EXPECT_GT(j["nvme_bytes_written"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["master_weights_xxh3"].get<std::string>().size(), 16u);
  EXPECT_TRUE(j["val_loss"].is_number());
  // The swap directory is private and removed at exit.
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename(), "summary.json");
  }
}

// Micro-batch-major: --schedule auto takes layer-major here, whose auto budget holds all 8
// micro-batches' activations, more than this model's working params.
TEST_F(CliTest, DefaultModelStreamsUnderABudgetBelowItsWorkingParams) {
  const auto json_path = dir_ / "default.json";
  const Result r = RunStrata(std::string("train --data ") + STRATA_DATA +
                             " --schedule micro-batch-major --steps 1 --eval-every 0 "
                             "--sample-bytes 0 --nvme-path " +
                             dir_.string() + " --summary-json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream in(json_path);
  const auto j = nlohmann::json::parse(in);
  const auto budget = j["device_budget_bytes"].get<uint64_t>();
  EXPECT_LE(j["device_peak_bytes"].get<uint64_t>(), budget);
  EXPECT_LT(budget, 2 * j["model_params"].get<uint64_t>());
  EXPECT_LT(j["resident_blocks"].get<int>(), j["num_blocks"].get<int>());
  EXPECT_GT(j["nvme_bytes_written"].get<uint64_t>(), 0u);
  EXPECT_GT(j["bytes_h2d"].get<uint64_t>(), 0u);
  EXPECT_GT(j["bytes_d2h"].get<uint64_t>(), 0u);
}

TEST_F(CliTest, SameSeedTrainsTheSameModel) {
  const Result a =
      RunStrata(Small() + " --steps 2 --eval-every 0 --sample-bytes 0 --summary-json " +
                (dir_ / "a.json").string());
  const Result b = RunStrata(Small() +
                             " --steps 2 --eval-every 0 --sample-bytes 0 "
                             "--offload-params host --offload-optimizer host --summary-json " +
                             (dir_ / "b.json").string());
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  std::ifstream ia(dir_ / "a.json"), ib(dir_ / "b.json");
  const auto ja = nlohmann::json::parse(ia), jb = nlohmann::json::parse(ib);
  EXPECT_EQ(ja["master_weights_xxh3"], jb["master_weights_xxh3"]);
  EXPECT_TRUE(ja["val_loss"].is_null());
}

struct BadInput {
  const char* args;
  const char* names;  // a word the one-line error must contain
};

TEST_F(CliTest, BadInputExitsNonZeroWithOneLineNamingTheProblem) {
  const std::string file = (dir_ / "plain_file").string();
  std::ofstream(file) << "x";
  const BadInput cases[] = {
      {"train --data /nonexistent/strata.txt --steps 1", "/nonexistent/strata.txt"},
      {"train --no-such-flag", "--no-such-flag"},
      {"train --steps 1 --device-budget 0", "zero"},
      {"train --steps 1 --device-budget 12XB", "12XB"},
      {"train --steps 1 --device-budget lots", "lots"},
      {"train --steps 1 --device cuda --copy-bandwidth 1e9", "--copy-bandwidth"},
      {"train --steps 1 --device host --tf32", "--tf32"},
      {"train --steps 1 --schedule sideways",
       "--schedule 'sideways' is not one of auto, "
       "layer-major, micro-batch-major"},
  };
  for (const auto& c : cases) {
    const Result r = RunStrata(std::string(c.args) + " --nvme-path " + dir_.string());
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_EQ(Lines(r.err), 1) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.names), std::string::npos) << c.args << ": " << r.err;
  }
  // An NVMe path that cannot hold a directory (it is under a regular file).
  const Result r = RunStrata(Small() + " --steps 1 --nvme-path " + file + "/swap");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(file + "/swap"), std::string::npos) << r.err;
}

// Runs strata with no GPU visible to it: CUDA_VISIBLE_DEVICES="" (the child inherits it).
Result RunStrataWithoutAGpu(const std::string& args) {
  const char* old = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = old ? old : "";
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  Result r = RunStrata(args);
  if (old) {
    ::setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  } else {
    ::unsetenv("CUDA_VISIBLE_DEVICES");
  }
  return r;
}

// `--device cuda` asks for a GPU; with none visible, or in a build without CUDA, it must fail
// with one line saying why, never fall back to the host silently.
TEST_F(CliTest, DeviceCudaWithoutAVisibleGpuFailsWithOneLine) {
  const Result r = RunStrataWithoutAGpu(Small() + " --steps 1 --device cuda");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--device cuda"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--device host"), std::string::npos) << r.err;  // what to do instead
}

// `--device auto` (the default) trains on the host backend when no GPU is visible (on a machine
// with one it picks CUDA: device_select_test checks the resolution there).
TEST_F(CliTest, DeviceAutoWithoutAVisibleGpuTrainsOnTheHost) {
  const auto json_path = dir_ / "auto.json";
  const Result r = RunStrataWithoutAGpu(Small() + " --steps 1 --eval-every 0 --sample-bytes 0 " +
                                        "--summary-json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream in(json_path);
  EXPECT_EQ(nlohmann::json::parse(in)["device"], "host");
}

TEST_F(CliTest, TraceWritesOneTrackPerStreamAndTheSummaryHasTheTimeBreakdown) {
  const auto json_path = dir_ / "summary.json";
  const auto trace_path = dir_ / "trace.json";
  const Result r = RunStrata(Small() + " --steps 2 --eval-every 0 --sample-bytes 0 --trace " +
                             trace_path.string() + " --summary-json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream sin(json_path);
  const auto summary = nlohmann::json::parse(sin);
  const auto& parts = summary.at("time_breakdown");
  double largest = 0;
  for (const char* part : {"compute", "h2d", "d2h", "cpu_optimizer", "nvme_read", "nvme_write"}) {
    ASSERT_TRUE(parts.contains(part)) << part;
    EXPECT_GE(parts.at(part).get<double>(), 0.0) << part;
    largest = std::max(largest, parts.at(part).get<double>());
  }
  EXPECT_GT(parts.at("compute").get<double>(), 0.0);
  EXPECT_GT(parts.at("nvme_read").get<double>(), 0.0);  // optimizer state lives on NVMe
  const double step = parts.at("step").get<double>();
  ASSERT_GT(step, 0.0);
  EXPECT_DOUBLE_EQ(summary.at("overlap_efficiency").get<double>(), largest / step);

  std::ifstream tin(trace_path);
  const auto trace = nlohmann::json::parse(tin);
  std::set<std::string> tracks, categories;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") tracks.insert(e["args"]["name"]);
    if (e.at("ph") == "X") {
      categories.insert(e.at("cat").get<std::string>());
      EXPECT_GE(e.at("dur").get<double>(), 0.0);
    }
  }
  for (const char* t :
       {"compute", "h2d", "d2h", "host: prefetch (nvme read)", "host: gradient fold",
        "host: optimizer state read", "host: cpu optimizer", "host: optimizer state write"}) {
    EXPECT_EQ(tracks.count(t), 1u) << t;
  }
  for (const char* c : {"compute", "h2d", "d2h", "cpu_optimizer", "nvme_read", "nvme_write"}) {
    EXPECT_EQ(categories.count(c), 1u) << c;
  }
}

TEST_F(CliTest, TraceToAnUnwritablePathIsAOneLineError) {
  const Result r = RunStrata(Small() + " --steps 1 --eval-every 0 --sample-bytes 0 --trace " +
                             (dir_ / "no-such-dir" / "t.json").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("no-such-dir"), std::string::npos) << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
}

TEST_F(CliTest, EstimatePrintsThePlanOrTheShortfallWithoutTraining) {
  const Result ok =
      RunStrata("estimate --preset gpt-7b --device-budget 24GiB --host-budget 128GiB");
  ASSERT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("plan:"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("verdict: feasible"), std::string::npos) << ok.out;

  const Result json = RunStrata(
      "estimate --model small --device-budget 1GiB --host-budget 4GiB "
      "--json --nvme-path " +
      dir_.string());
  ASSERT_EQ(json.exit_code, 0) << json.out << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_TRUE(j.at("feasible").get<bool>());
  EXPECT_EQ(j.at("num_blocks").get<int>(), 14);
  EXPECT_EQ(j.at("resident_blocks").get<int>(), 14);  // 1 GiB holds the small model
  EXPECT_GT(j.at("nvme_free_bytes").get<uint64_t>(), 0u);

  const Result short_device = RunStrata("estimate --preset gpt-7b --device-budget 64MiB");
  EXPECT_EQ(short_device.exit_code, 1);
  EXPECT_NE(short_device.err.find("short"), std::string::npos) << short_device.err;
  EXPECT_EQ(Lines(short_device.err), 1) << short_device.err;

  const Result short_host =
      RunStrata("estimate --preset gpt-13b --device-budget 24GiB --host-budget 16GiB");
  EXPECT_EQ(short_host.exit_code, 1);
  EXPECT_NE(short_host.err.find("host budget"), std::string::npos) << short_host.err;

  const Result missing = RunStrata("estimate --preset gpt-7b");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("--device-budget"), std::string::npos) << missing.err;
}

// Issue 16: 16-bit host gradients at one micro-batch halve the host gradient memory of gpt-7b,
// and the optimizer's state sets the NVMe footprint.
TEST_F(CliTest, EstimateShowsHalfTheHostGradientsAtOneMicroBatchAndEachOptimizersState) {
  auto plan = [](const std::string& extra) {
    return EstimateJson("estimate --preset gpt-7b --device-budget 24GiB --host-budget 512GiB " +
                        extra);
  };
  const auto one = plan("--grad-accum-steps 1"), eight = plan("--grad-accum-steps 8");
  const auto params = one.at("model_params").get<uint64_t>();
  EXPECT_EQ(one.at("host_grad_bytes").get<uint64_t>(), 2 * params);
  EXPECT_EQ(eight.at("host_grad_bytes").get<uint64_t>(), 4 * params);
  EXPECT_EQ(eight.at("host_bytes").get<uint64_t>() - one.at("host_bytes").get<uint64_t>(),
            2 * params);
  const auto adamw = plan(""), q8 = plan("--optimizer adamw8bit"),
             af = plan("--optimizer adafactor");
  EXPECT_EQ(adamw.at("optimizer"), "adamw");
  EXPECT_NEAR(adamw.at("optimizer_state_bytes").get<double>() / params, 8.0, 0.01);
  EXPECT_NEAR(q8.at("optimizer_state_bytes").get<double>() / params, 2.0, 0.02);
  EXPECT_LT(af.at("optimizer_state_bytes").get<double>() / params, 0.05);
  EXPECT_GT(adamw.at("nvme_bytes").get<uint64_t>() - q8.at("nvme_bytes").get<uint64_t>(),
            5 * params);
}

// Issue 18: `strata estimate --ranks N` plans rank 0 of N data-parallel ranks, which keeps 1/N of
// the master weights, optimizer state and host gradients, and compares it with one rank.
TEST_F(CliTest, EstimateWithTwoRanksHalvesTheHostAndNvmeBytesOfOneRank) {
  // Two micro-batches: one rank then keeps fp32 host gradients, as every data-parallel rank does.
  const std::string base =
      "estimate --preset gpt-7b --device-budget 24GiB --host-budget 512GiB "
      "--grad-accum-steps 2 ";
  auto plan = [&](const std::string& extra) { return EstimateJson(base + extra); };
  // Each rank's share is rounded up to 64 elements per block and every state part to 4 KiB, so
  // rank 0 holds at least half and at most half plus that padding: 64 KiB per block covers it
  // (master, two Adam moments and the params home, 4 KiB each, for both runs).
  auto expect_half = [](const nlohmann::json& two, const nlohmann::json& one, const char* key) {
    const auto per_rank = two.at(key).get<uint64_t>(), whole = one.at(key).get<uint64_t>();
    const uint64_t slack = one.at("num_blocks").get<uint64_t>() * (64u << 10);
    EXPECT_GT(whole, 100 * slack) << key;  // the padding is small next to the figure
    EXPECT_GE(2 * per_rank, whole) << key;
    EXPECT_LE(2 * per_rank - whole, 2 * slack) << key;
  };
  for (const char* home : {"nvme", "host"}) {
    SCOPED_TRACE(home);
    const std::string where = std::string("--offload-optimizer ") + home;
    const auto one = plan(where + " --ranks 1"), two = plan(where + " --ranks 2");
    EXPECT_EQ(one.at("ranks").get<int>(), 1);
    EXPECT_TRUE(one.at("one_rank").is_null());
    EXPECT_FALSE(one.at("data_parallel").get<bool>());
    EXPECT_EQ(two.at("ranks").get<int>(), 2);
    EXPECT_EQ(two.at("rank").get<int>(), 0);
    EXPECT_TRUE(two.at("data_parallel").get<bool>());
    expect_half(two, one, "host_bytes");
    if (std::string(home) == "nvme") {
      expect_half(two, one, "nvme_bytes");
    } else {
      // Every block is resident in 24 GiB: no working params on NVMe either.
      EXPECT_EQ(one.at("nvme_bytes").get<uint64_t>(), 0u);
      EXPECT_EQ(two.at("nvme_bytes").get<uint64_t>(), 0u);
    }
    // The comparison is with the same run on one rank.
    EXPECT_EQ(two.at("one_rank").at("host_bytes"), one.at("host_bytes"));
    EXPECT_EQ(two.at("one_rank").at("nvme_bytes"), one.at("nvme_bytes"));
    EXPECT_EQ(two.at("one_rank").at("device_total_bytes"), one.at("device_total_bytes"));
  }

  const Result text = RunStrata(base + "--ranks 2");
  ASSERT_EQ(text.exit_code, 0) << text.out << text.err;
  EXPECT_NE(text.out.find("ranks    2 data-parallel ranks (ZeRO), figures for rank 0"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("per rank vs one rank: host "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("(0.50x), pinned"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("verdict: feasible on each of 2 ranks"), std::string::npos) << text.out;
  const Result single = RunStrata(base);
  ASSERT_EQ(single.exit_code, 0) << single.out << single.err;
  EXPECT_EQ(single.out.find("data-parallel"), std::string::npos) << single.out;
  EXPECT_EQ(single.out.find("per rank vs one rank"), std::string::npos) << single.out;
}

TEST_F(CliTest, EstimateAutoDeviceBudgetCoversTheDataParallelBuffers) {
  auto plan = [](const std::string& extra) {
    return EstimateJson("estimate --preset gpt-7b --device-budget auto --host-budget 512GiB " +
                        extra);
  };
  // Streaming: with 2 ranks the device also holds the fp32 reduce-scatter buffers (one block and
  // two partitions) and blocks padded to whole partitions, so the auto budget grows.
  const auto one = plan("--ranks 1"), two = plan("--ranks 2");
  EXPECT_GT(two.at("device_budget_bytes").get<uint64_t>(),
            one.at("device_budget_bytes").get<uint64_t>());
  EXPECT_LE(two.at("device_total_bytes").get<uint64_t>(),
            two.at("device_budget_bytes").get<uint64_t>());
  // Every block resident: exactly what two ranks need, which one rank's figure would fall short of.
  const auto resident = plan("--ranks 2 --offload-params device");
  EXPECT_EQ(resident.at("resident_blocks"), resident.at("num_blocks"));
  const auto resident_one = plan("--ranks 1 --offload-params device");
  EXPECT_GT(resident.at("device_budget_bytes").get<uint64_t>(),
            resident_one.at("device_budget_bytes").get<uint64_t>());
}

// The ranks of one machine pin a LoRA base once (engine/shared_frozen_base.h): the per-machine
// pinned figure is the base once plus each rank's own pinned buffers, host memory is per rank.
TEST_F(CliTest, EstimatePerMachineCountsAFrozenBaseOnce) {
  const std::string base =
      "estimate --preset llama-1b --lora-rank 8 --device-budget 1GiB --offload-params host "
      "--seq-len 256 --host-budget 64GiB --ranks 4 ";
  auto plan = [&](const std::string& extra) { return EstimateJson(base + extra); };
  for (int k : {0, 1, 2, 4}) {
    SCOPED_TRACE(k);
    const nlohmann::json j = plan(k == 0 ? "" : "--ranks-per-machine " + std::to_string(k));
    const int ranks = k == 0 ? 4 : k;
    const auto frozen = j.at("pinned_frozen_bytes").get<uint64_t>();
    const auto pinned = j.at("pinned_bytes").get<uint64_t>();
    EXPECT_GT(frozen, uint64_t{1} << 30);  // llama-1b's 16-bit base, about 2 GiB
    EXPECT_LT(frozen, pinned);
    const nlohmann::json& m = j.at("per_machine");
    EXPECT_EQ(m.at("ranks").get<int>(), ranks);
    EXPECT_EQ(m.at("pinned_bytes").get<uint64_t>(), frozen + ranks * (pinned - frozen));
    EXPECT_EQ(m.at("host_bytes").get<uint64_t>(), ranks * j.at("host_bytes").get<uint64_t>());
  }
  // Without frozen chunks nothing is shared.
  const Result full = RunStrata(
      "estimate --preset llama-1b --device-budget 4GiB --offload-params host --seq-len 256 "
      "--host-budget 64GiB --ranks 2 --json");
  ASSERT_EQ(full.exit_code, 0) << full.err;
  const nlohmann::json f = nlohmann::json::parse(full.out);
  EXPECT_EQ(f.at("pinned_frozen_bytes").get<uint64_t>(), 0u);
  EXPECT_EQ(f.at("per_machine").at("pinned_bytes").get<uint64_t>(),
            2 * f.at("pinned_bytes").get<uint64_t>());

  const Result text = RunStrata(base);
  ASSERT_EQ(text.exit_code, 0) << text.out << text.err;
  EXPECT_NE(text.out.find("per machine of 4 ranks: host "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(" once, shared by the machine's ranks)"), std::string::npos) << text.out;
  const Result bad = RunStrata(base + "--ranks-per-machine 5");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--ranks-per-machine 5 must be between 1 and --ranks (4)"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(Lines(bad.err), 1) << bad.err;
}

TEST_F(CliTest, EstimateRefusesZeroRanksAndUnpartitionableOptimizers) {
  const Result zero = RunStrata("estimate --preset gpt-7b --device-budget 24GiB --ranks 0");
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_NE(zero.err.find("--ranks 0 is not a number of ranks: give 1 or more"), std::string::npos)
      << zero.err;
  EXPECT_EQ(Lines(zero.err), 1) << zero.err;
  const Result negative = RunStrata("estimate --preset gpt-7b --device-budget 24GiB --ranks -3");
  EXPECT_NE(negative.exit_code, 0);
  EXPECT_NE(negative.err.find("--ranks"), std::string::npos) << negative.err;

  const Result factored =
      RunStrata("estimate --preset gpt-7b --device-budget 24GiB --ranks 2 --optimizer adafactor");
  EXPECT_EQ(factored.exit_code, 1);
  EXPECT_NE(factored.err.find("use adamw, adam, lion, sgd or adagrad"), std::string::npos)
      << factored.err;
  // One rank keeps any optimizer.
  const Result one = RunStrata(
      "estimate --preset gpt-7b --device-budget 24GiB --host-budget 512GiB --ranks 1 --optimizer "
      "adafactor");
  EXPECT_EQ(one.exit_code, 0) << one.err;
}

// Issue 3: the block `strata iobench --sweep` prints is a config `strata train --config` takes
// unchanged, and the settings reach the engine (the plan's io line shows them).
TEST_F(CliTest, IobenchSweepConfigRoundTripsThroughTrainConfig) {
  const auto config = dir_ / "best.json";
  const Result sweep = RunStrata("iobench --path " + dir_.string() +
                                 " --size 16MiB --sweep --config-out " + config.string());
  ASSERT_EQ(sweep.exit_code, 0) << sweep.out << sweep.err;
  std::ifstream in(config);
  ASSERT_TRUE(in.good());
  const auto block = nlohmann::json::parse(in);
  const auto block_size = block.at("strata").at("io_block_size").get<uint64_t>();
  const auto queue_depth = block.at("strata").at("io_queue_depth").get<int>();
  const auto backend = block.at("strata").at("io_backend").get<std::string>();
  // A complete config: the NVMe placement the sweep measured for, under the swept path.
  EXPECT_EQ(block.at("zero_optimization").at("offload_optimizer").at("device"), "nvme");
  EXPECT_EQ(block.at("zero_optimization").at("offload_param").at("nvme_path"),
            nlohmann::json::array({dir_.string()}));
  // Strata's default clipping, written out (a DeepSpeed file without the key does not clip).
  EXPECT_EQ(block.at("gradient_clipping"), 1.0);
  // The same block is the last thing on stdout.
  const auto brace = sweep.out.rfind("{\n  \"bf16\"");
  ASSERT_NE(brace, std::string::npos) << sweep.out;
  EXPECT_EQ(nlohmann::json::parse(sweep.out.substr(brace)), block);

  const auto summary = dir_ / "summary.json";
  const Result train = RunStrata(Small() + " --steps 2 --eval-every 0 --sample-bytes 0 --config " +
                                 config.string() + " --summary-json " + summary.string());
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  std::ifstream sin(summary);
  const nlohmann::json trained = nlohmann::json::parse(sin);
  EXPECT_EQ(trained.at("io_backend"), backend);
  EXPECT_EQ(trained.at("grad_clip"), 1.0);
  const auto io_line = train.out.find("  io ");
  ASSERT_NE(io_line, std::string::npos) << train.out;
  const std::string line = train.out.substr(io_line, train.out.find('\n', io_line) - io_line);
  EXPECT_NE(line.find(backend), std::string::npos) << line;
  EXPECT_NE(line.find("queue depth " + std::to_string(queue_depth)), std::string::npos) << line;
  // The sweep's block sizes are 128 KiB, 1 MiB and 4 MiB; the plan prints them as FormatBytes does.
  const std::string size_text = block_size % (1u << 20) == 0
                                    ? std::to_string(block_size >> 20) + ".0 MiB"
                                    : std::to_string(block_size >> 10) + ".0 KiB";
  EXPECT_NE(line.find("block " + size_text), std::string::npos) << line;
}

}  // namespace
