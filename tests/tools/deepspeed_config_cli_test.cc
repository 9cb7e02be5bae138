// DeepSpeed configuration files as users have them (tests/data/deepspeed/, written for these tests
// in the shape of public ones), each run with `strata train --config FILE --steps 3`: what the run
// prints and records must be what DeepSpeed would do with the file. The learning rates are checked
// against DeepSpeed's schedulers re-derived here (deepspeed/runtime/lr_schedules.py: the scheduler
// starts at iteration -1 and steps after every optimizer step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

using strata::cli_test::Lines;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;

// DeepSpeed's rate for optimizer update k (0-based) under a warmup scheduler: iteration i = k - 1.
double DeepSpeedLr(const std::string& type, int k, double peak, double min_lr, int warmup,
                   int total, double warmup_min_ratio = 0, double cos_min_ratio = 0) {
  const int i = k - 1;
  const int w = std::max(2, warmup);
  const auto gamma = [&] { return static_cast<double>(i) / w; };  // linear warmup
  if (type == "WarmupCosineLR") {
    if (i < 0) return 0.0;
    if (i < w) return peak * (warmup_min_ratio + (1 - warmup_min_ratio) * gamma());
    const double p = std::min(1.0, static_cast<double>(i - w + 1) / std::max(1, total - w));
    return peak * std::max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + std::cos(M_PI * p)) / 2);
  }
  if (i < 0) return min_lr;
  double g = 1;
  if (i < w) {
    g = gamma();
  } else if (type == "WarmupDecayLR") {
    g = std::max(0.0, static_cast<double>(total - i) / std::max(1, total - w));
  }
  return min_lr + (peak - min_lr) * g;
}

class DeepSpeedConfigCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("strata_ds_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    // Relative monitor paths of a config land here.
    old_cwd_ = std::filesystem::current_path();
    std::filesystem::current_path(dir_);
  }
  void TearDown() override {
    std::filesystem::current_path(old_cwd_);
    std::filesystem::remove_all(dir_);
  }

  // `strata train --config FILE --steps 3`, its swap under the test's directory (the files name
  // /local_nvme, as the public ones do; a flag overrides a file).
  Result Run(const std::string& file, const std::string& extra_flags = "") {
    summary_ = nlohmann::json();
    const auto summary_path = dir_ / (file + ".summary.json");
    std::filesystem::remove(summary_path);
    const Result r = RunStrata("train --config " + std::string(STRATA_DS_CONFIGS) + "/" + file +
                               " --steps 3 --nvme-path " + dir_.string() + " --summary-json " +
                               summary_path.string() + " " + extra_flags);
    std::ifstream in(summary_path);
    if (in.good()) summary_ = nlohmann::json::parse(in);
    return r;
  }

  // The learning rate printed on each progress line, by step.
  static std::vector<std::pair<int, double>> PrintedRates(const std::string& out) {
    std::vector<std::pair<int, double>> rates;
    const std::regex line(R"(step +(\d+)/\d+ \| .*\| lr ([0-9.e+-]+) \|)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
         ++it) {
      rates.emplace_back(std::stoi((*it)[1]), std::stod((*it)[2]));
    }
    return rates;
  }

  void ExpectRates(const std::string& out, int expected_lines,
                   const std::function<double(int)>& expected) {
    const auto rates = PrintedRates(out);
    EXPECT_EQ(static_cast<int>(rates.size()), expected_lines) << out;
    for (const auto& [step, lr] : rates) {
      const double want = expected(step - 1);
      EXPECT_NEAR(lr, want, 0.006 * want + 1e-12) << "step " << step << "\n" << out;  // %.2e
    }
  }

  std::filesystem::path dir_, old_cwd_;
  nlohmann::json summary_;
};

TEST_F(DeepSpeedConfigCli, ZeroThreeWithCpuOffloadKeepsParamsAndStateInPinnedHostMemory) {
  const Result r = Run("zero3_cpu_offload.json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["precision"], "bf16");
  EXPECT_EQ(summary_["param_home"], "host");
  EXPECT_EQ(summary_["optimizer_home"], "host");
  EXPECT_EQ(summary_["optimizer"], "adamw");
  EXPECT_EQ(summary_["micro_batch_size"], 4);
  EXPECT_EQ(summary_["grad_accum_steps"], 2);
  EXPECT_EQ(summary_["grad_clip"], 1.0);
  EXPECT_EQ(summary_["nvme_bytes_written"], 0);  // nothing on NVMe
  EXPECT_EQ(summary_["lr_schedule"]["kind"], "WarmupLR");
  EXPECT_NE(r.out.find("  lr       WarmupLR: 0 -> 0.0003 over 2 steps (linear), then constant\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("streamed per use from host"), std::string::npos) << r.out;
  ExpectRates(r.out, 3, [](int k) { return DeepSpeedLr("WarmupLR", k, 3e-4, 0, 2, 0); });
  // The communication and partitioning tunables are named, not refused.
  EXPECT_NE(r.out.find("config: ignored (communication between GPUs; one device has none): "
                       "zero_optimization.overlap_comm, zero_optimization.reduce_bucket_size"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("zero_optimization.stage3_max_live_parameters"), std::string::npos);
}

TEST_F(DeepSpeedConfigCli, ZeroInfinitySwapsToNvmeWithItsBuffersAioAndFp16Scaling) {
  const Result r = Run("zero_infinity_nvme.json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["precision"], "fp16");
  EXPECT_EQ(summary_["param_home"], "nvme");
  EXPECT_EQ(summary_["optimizer_home"], "nvme");
  EXPECT_EQ(summary_["optimizer"], "adamw");  // "Adam" with adam_w_mode
  EXPECT_EQ(summary_["micro_batch_size"], 2);
  EXPECT_EQ(summary_["grad_accum_steps"], 4);  // train_batch_size 8 / micro-batch 2
  EXPECT_EQ(summary_["loss_scale_hysteresis"], 2);
  EXPECT_GT(summary_["nvme_bytes_written"].get<uint64_t>(), 0u);
  EXPECT_NE(r.out.find("  fp16     dynamic loss scale from 4096, x2 after 1000 clean steps, "
                       "hysteresis 2, min 1\n"),
            std::string::npos)
      << r.out;
  // offload_param.buffer_count 3: three blocks in flight (prefetch 2 ahead); offload_optimizer
  // buffer_count 4: four pipeline buffers; aio queue depth 8 on one thread.
  EXPECT_NE(r.out.find("prefetch 2 blocks ahead"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("through 4 buffers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(block 1.0 MiB, queue depth 8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  lr       WarmupDecayLR: 1e-05 -> 0.001 over 2 steps (linear), then "
                       "linear decay to 1e-05 at step 3\n"),
            std::string::npos)
      << r.out;
  ExpectRates(r.out, 3, [](int k) { return DeepSpeedLr("WarmupDecayLR", k, 1e-3, 1e-5, 1, 3); });
  // wall_clock_breakdown: a time line per printed step.
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') > 0 &&
                r.out.find("time  step     3 | compute") != std::string::npos,
            true)
      << r.out;
}

TEST_F(DeepSpeedConfigCli, HuggingFaceZeroTwoKeepsParamsOnTheDeviceAndStateOnTheHost) {
  const Result r = Run("hf_trainer_zero2.json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["precision"], "bf16");  // fp16 disabled, bf16 enabled
  EXPECT_EQ(summary_["param_home"], "device");
  EXPECT_EQ(summary_["optimizer_home"], "host");
  EXPECT_EQ(summary_["resident_blocks"], summary_["num_blocks"]);
  EXPECT_EQ(summary_["micro_batch_size"], 4);
  EXPECT_EQ(summary_["grad_accum_steps"], 2);
  EXPECT_EQ(summary_["nvme_bytes_written"], 0);
  EXPECT_EQ(summary_["lr_schedule"]["kind"], "WarmupDecayLR");
  EXPECT_EQ(summary_["lr_schedule"]["total_steps"], 100);
  EXPECT_NE(r.out.find("  lr       WarmupDecayLR: 0 -> 5e-05 over 10 steps (log), then linear "
                       "decay to 0 at step 100\n"),
            std::string::npos)
      << r.out;
  // steps_per_print 2000: the first and the last step print.
  const auto rates = PrintedRates(r.out);
  ASSERT_EQ(rates.size(), 2u) << r.out;
  EXPECT_EQ(rates[0].second, 0.0);  // log warmup from 0: iteration -1
  // Iteration 1 of a log warmup over 10 steps: ln 2 / ln 10 of the peak.
  EXPECT_NEAR(rates[1].second, 5e-5 * std::log(2.0) / std::log(10.0), 0.006 * 1.5e-5);
}

// train_batch_size is the global batch, as in DeepSpeed: a flag that overrides the file's
// micro-batch keeps it, one that contradicts it is refused.
TEST_F(DeepSpeedConfigCli, TheFilesTrainBatchSizeHoldsWhenAFlagChangesTheMicroBatch) {
  Result r = Run("hf_trainer_zero2.json", "--micro-batch-size 2");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["micro_batch_size"], 2);
  EXPECT_EQ(summary_["grad_accum_steps"], 4);  // 8 = 2 x 4
  r = Run("hf_trainer_zero2.json", "--grad-accum-steps 3");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("--grad-accum-steps 3 contradicts the --config file's train_batch_size 8"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
}

TEST_F(DeepSpeedConfigCli, FineTuningRecipeCheckpointsActivationsToTheHostAndWritesItsMonitors) {
  const Result r = Run("finetune_recipe.json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["precision"], "bf16");
  EXPECT_EQ(summary_["param_home"], "device");      // stage 1, no offload
  EXPECT_EQ(summary_["optimizer_home"], "device");  // no offload_optimizer: on the GPU
  EXPECT_EQ(summary_["grad_clip"], 0.5);
  EXPECT_NE(r.out.find("config: no offload_optimizer: DeepSpeed keeps optimizer state on the GPU, "
                       "and so does Strata"),
            std::string::npos)
      << r.out;
  // activation_checkpointing.cpu_checkpointing: block-boundary activations in pinned host memory,
  // two per micro-batch the device holds at once (all of the step's with layer-major) on the
  // device.
  const int held =
      summary_["schedule"] == "layer-major" ? summary_["grad_accum_steps"].get<int>() : 1;
  EXPECT_NE(r.out.find("in pinned host memory, " + std::to_string(2 * held) + " on the device"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  lr       WarmupCosineLR: 2e-05 -> 0.0002 over 2 steps (linear), then "
                       "cosine decay to 2e-05 at step 3\n"),
            std::string::npos)
      << r.out;
  ExpectRates(r.out, 3, [](int k) {
    return DeepSpeedLr("WarmupCosineLR", k, 2e-4, 0, 1, 3, /*warmup_min_ratio=*/0.1,
                       /*cos_min_ratio=*/0.1);
  });
  // tensorboard and csv_monitor: output_path/job_name, relative to where the run started.
  bool event_file = false;
  for (const auto& e : std::filesystem::directory_iterator(dir_ / "runs" / "finetune")) {
    event_file = event_file || e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  EXPECT_TRUE(event_file);
  std::ifstream csv(dir_ / "csv" / "finetune" / "train_loss.csv");
  ASSERT_TRUE(csv.good());
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "step,train/loss");
  EXPECT_EQ(std::count(std::istreambuf_iterator<char>(csv), std::istreambuf_iterator<char>(), '\n'),
            3);
}

TEST_F(DeepSpeedConfigCli, AFileWithEveryDocumentedKeyRuns) {
  const Result r = Run("every_key.json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(summary_["precision"], "bf16");
  EXPECT_EQ(summary_["param_home"], "host");      // offload_param cpu
  EXPECT_EQ(summary_["optimizer_home"], "nvme");  // offload_optimizer nvme at stage 3
  EXPECT_EQ(summary_["micro_batch_size"], 4);
  EXPECT_EQ(summary_["grad_accum_steps"], 4);
  EXPECT_EQ(summary_["lr_schedule"]["kind"], "WarmupDecayLR");
  ExpectRates(r.out, 3, [](int k) { return DeepSpeedLr("WarmupDecayLR", k, 1e-3, 0, 2, 10); });
  // Every no-op is named in a note: one line per reason.
  int notes = 0;
  for (size_t at = r.out.find("config: ignored ("); at != std::string::npos;
       at = r.out.find("config: ignored (", at + 1)) {
    ++notes;
  }
  EXPECT_GE(notes, 7) << r.out;
  for (const char* key : {"zero_optimization.sub_group_size", "sparse_attention", "wandb",
                          "zero_optimization.offload_optimizer.pipeline_read", "aio.single_submit",
                          "flops_profiler", "comms_logger", "tensor_parallel"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key;
  }
}

TEST_F(DeepSpeedConfigCli, AFileWithTyposGetsOneErrorListingEveryUnknownKeyByPath) {
  const Result r = Run("typos.json");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(r.out.find("step "), std::string::npos) << r.out;  // nothing trained
  EXPECT_NE(r.err.find("typos.json: 3 problems:"), std::string::npos) << r.err;
  for (const char* line :
       {"  unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)",
        "  unknown key 'zero_optimization.offload_optimizer.pin_memroy' (did you mean "
        "'pin_memory'?)",
        "  unknown key 'scheduler.params.warmup_max_lrr' for type \"WarmupLR\" (did you mean "
        "'warmup_max_lr'?)"}) {
    EXPECT_NE(r.err.find(line), std::string::npos) << line << "\n" << r.err;
  }
  EXPECT_EQ(Lines(r.err), 4) << r.err;  // the heading and one line per key
  // The top-level typo is ignored, as DeepSpeed ignores it (said on a config: note when the
  // file is otherwise valid).
  EXPECT_EQ(r.err.find("gradient_acumulation_steps"), std::string::npos) << r.err;
}

}  // namespace
