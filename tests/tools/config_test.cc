// tools/config: every accepted key lands in the right TrainFlags field; every kind of bad input
// is an error that names the file and the key.
#include "tools/config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "tools/optimizer_flags.h"

namespace strata::tools {
namespace {

Status Apply(const std::string& text, TrainFlags* f) {
  return ApplyTrainConfigText(text, "run.json", f);
}

// The error for `text`, which must not parse.
std::string ErrorOf(const std::string& text) {
  TrainFlags f;
  const Status s = Apply(text, &f);
  EXPECT_FALSE(s.ok()) << text;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(s.message().rfind("run.json: ", 0), 0u) << s.message();
  return s.message();
}

TEST(TrainConfig, EveryAcceptedKeyParsesToItsField) {
  const std::string text = R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 3,
    "train_batch_size": 12,
    "gradient_clipping": 0.5,
    "steps_per_print": 7,
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 200, "min_loss_scale": 0.25},
    "bf16": {"enabled": false},
    "optimizer": {"type": "Adam",
                  "params": {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                             "weight_decay": 0.1, "bias_correction": false,
                             "adam_w_mode": false}},
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "cpu", "nvme_path": ["/a", "/b"], "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": ["/a", "/b"], "pin_memory": false}},
    "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2},
    "strata": {"io_backend": "posix", "device": "host", "device_budget": "64MiB",
               "model": "tiny", "data": "/data/x.txt", "steps": 9, "seq_len": 32, "seed": 5,
               "warmup_steps": 2, "eval_every": 3, "eval_batches": 4, "sample_bytes": 0,
               "summary_json": "/tmp/s.json", "copy_bandwidth": 25e9, "pack": true,
               "long_examples": "skip"}
  })";
  TrainFlags f;
  const Status s = Apply(text, &f);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(f.micro_batch_size, 4);
  EXPECT_EQ(f.grad_accum_steps, 3);
  // train_batch_size is kept as the global batch, the accumulation derived again after the
  // flags (tools/train_setup.cc).
  EXPECT_EQ(f.global_batch_size, 12);
  EXPECT_TRUE(f.global_batch_from_config);
  EXPECT_DOUBLE_EQ(f.grad_clip, 0.5);
  EXPECT_EQ(f.log_every, 7);
  EXPECT_EQ(f.precision, "fp16");
  EXPECT_TRUE(f.fp16_dynamic_loss_scale);
  EXPECT_DOUBLE_EQ(f.fp16_initial_scale, 4096.0);
  EXPECT_EQ(f.fp16_scale_window, 200);
  EXPECT_DOUBLE_EQ(f.fp16_min_scale, 0.25);
  EXPECT_FALSE(f.adam_decoupled_weight_decay);
  EXPECT_EQ(f.optimizer, "adam");
  EXPECT_DOUBLE_EQ(f.lr, 2e-4);
  EXPECT_DOUBLE_EQ(f.adam_beta1.value_or(-1), 0.8);
  EXPECT_DOUBLE_EQ(f.adam_beta2.value_or(-1), 0.95);
  EXPECT_DOUBLE_EQ(f.adam_eps.value_or(-1), 1e-6);
  EXPECT_DOUBLE_EQ(f.weight_decay, 0.1);
  EXPECT_FALSE(f.adam_bias_correction);
  EXPECT_EQ(f.offload_optimizer, "host");
  EXPECT_EQ(f.offload_params, "nvme");
  EXPECT_EQ(f.nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(f.io_block_size, "262144");
  EXPECT_EQ(f.io_queue_depth, 32);  // DeepSpeed: queue depth 16 on each of 2 threads
  EXPECT_EQ(f.io_threads, 2);
  EXPECT_EQ(f.io_backend, "posix");
  EXPECT_EQ(f.device, "host");
  EXPECT_EQ(f.device_budget, std::to_string(64ull << 20));
  EXPECT_EQ(f.model, "tiny");
  EXPECT_EQ(f.data, std::vector<std::string>{"/data/x.txt"});
  EXPECT_EQ(f.steps, 9);
  EXPECT_EQ(f.seq_len, 32);
  EXPECT_EQ(f.seed, 5u);
  EXPECT_EQ(f.warmup_steps, 2);
  EXPECT_EQ(f.eval_every, 3);
  EXPECT_EQ(f.eval_batches, 4);
  EXPECT_EQ(f.sample_bytes, 0);
  EXPECT_EQ(f.summary_json, "/tmp/s.json");
  EXPECT_DOUBLE_EQ(f.copy_bandwidth, 25e9);
  EXPECT_TRUE(f.pack);
  EXPECT_EQ(f.long_examples, "skip");
}

TEST(TrainConfig, KeysNotInTheFileKeepTheirValues) {
  TrainFlags f;
  f.steps = 77;
  f.nvme_paths = {"/keep"};
  ASSERT_TRUE(Apply(R"({"aio": {"queue_depth": 16}})", &f).ok());
  const TrainFlags defaults;
  EXPECT_EQ(f.io_queue_depth, 16);
  EXPECT_EQ(f.steps, 77);
  EXPECT_EQ(f.nvme_paths, std::vector<std::string>{"/keep"});
  EXPECT_EQ(f.micro_batch_size, defaults.micro_batch_size);
  EXPECT_EQ(f.lr_schedule, defaults.lr_schedule);  // no optimizer section: Strata's schedule
  // What a DeepSpeed file leaves out means what it means in DeepSpeed.
  EXPECT_EQ(f.precision, "fp32");
  EXPECT_EQ(f.io_block_size, "1048576");  // aio.block_size's default
  EXPECT_EQ(f.io_threads, 1);
  EXPECT_EQ(f.offload_params, "device");
  EXPECT_EQ(f.offload_optimizer, "device");  // no offload_optimizer: on the GPU, as DeepSpeed
}

TEST(TrainConfig, TheIobenchSweepBlockIsAcceptedUnchanged) {
  TrainFlags f;
  const Status s = Apply(
      R"({"bf16": {"enabled": true},
          "zero_optimization": {"stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": ["/n0", "/n1"]},
            "offload_param": {"device": "nvme", "nvme_path": ["/n0", "/n1"]}},
          "strata": {"io_backend": "uring", "io_block_size": 1048576, "io_queue_depth": 32,
                     "io_threads": 4}})",
      &f);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(f.io_block_size, "1048576");
  EXPECT_EQ(f.io_queue_depth, 32);
  EXPECT_EQ(f.io_threads, 4);
  EXPECT_EQ(f.io_backend, "uring");
  EXPECT_EQ(f.update_during_backward, "auto");
  EXPECT_EQ(f.precision, "bf16");
  EXPECT_EQ(f.offload_params, "nvme");
  EXPECT_EQ(f.offload_optimizer, "nvme");
  EXPECT_EQ(f.nvme_paths, (std::vector<std::string>{"/n0", "/n1"}));
}

TEST(TrainConfig, TheUpdateDuringBackwardTakesOnOffAutoOrABoolean) {
  for (auto [text, want] :
       {std::pair{R"("on")", "on"}, std::pair{R"("off")", "off"}, std::pair{"true", "on"},
        std::pair{"false", "off"}, std::pair{R"("auto")", "auto"}}) {
    TrainFlags f;
    const Status s =
        Apply(fmt::format(R"({{"strata": {{"update_during_backward": {}}}}})", text), &f);
    ASSERT_TRUE(s.ok()) << text << ": " << s.ToString();
    EXPECT_EQ(f.update_during_backward, want) << text;
  }
  TrainFlags f;
  const Status bad = Apply(R"({"strata": {"update_during_backward": "sometimes"}})", &f);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("strata.update_during_backward"), std::string::npos)
      << bad.ToString();
}

TEST(TrainConfig, TheScheduleKeyTakesTheFlagsValuesAndNamesItselfWhenWrong) {
  for (const char* want : {"auto", "layer-major", "micro-batch-major"}) {
    TrainFlags f;
    const Status s = Apply(fmt::format(R"({{"strata": {{"schedule": "{}"}}}})", want), &f);
    ASSERT_TRUE(s.ok()) << want << ": " << s.ToString();
    EXPECT_EQ(f.schedule, want);
  }
  EXPECT_EQ(TrainFlags{}.schedule, "auto");
  for (const char* bad_value : {R"("layer")", "true"}) {
    TrainFlags f;
    const Status bad = Apply(fmt::format(R"({{"strata": {{"schedule": {}}}}})", bad_value), &f);
    ASSERT_FALSE(bad.ok()) << bad_value;
    EXPECT_NE(bad.message().find("'strata.schedule' must be one of \"auto\", \"layer-major\", "
                                 "\"micro-batch-major\""),
              std::string::npos)
        << bad.ToString();
    EXPECT_EQ(bad.message().find('\n'), std::string::npos) << bad.ToString();
  }
}

TEST(TrainConfig, PreferenceTrainingComesFromTheStrataSection) {
  TrainFlags f;
  const Status s = Apply(
      R"({"strata": {"objective": "simpo", "beta": 2.5, "label_smoothing": 0.1,
          "simpo_gamma": 1.25, "cpo_alpha": 1.0, "rpo_alpha": 0.5, "long_examples": "skip"}})",
      &f);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(f.cpo_alpha, 1.0);
  EXPECT_EQ(f.rpo_alpha, 0.5);
  EXPECT_EQ(f.objective, "simpo");
  EXPECT_EQ(f.beta, 2.5);
  EXPECT_EQ(f.label_smoothing, 0.1);
  EXPECT_EQ(f.simpo_gamma, 1.25);
  EXPECT_EQ(f.long_examples, "skip");
  for (const char* bad_json :
       {R"({"strata": {"objective": "orpo"}})", R"({"strata": {"beta": 0}})",
        R"({"strata": {"label_smoothing": 0.5}})", R"({"strata": {"cpo_alpha": -1}})"}) {
    TrainFlags g;
    const Status bad = Apply(bad_json, &g);
    EXPECT_FALSE(bad.ok()) << bad_json;
    EXPECT_NE(bad.message().find("'strata."), std::string::npos) << bad.ToString();
    EXPECT_EQ(bad.message().find('\n'), std::string::npos) << bad.ToString();
  }
}

TEST(TrainConfig, ActivationCheckpointingComesFromTheStrataSectionNotDeepSpeeds) {
  for (const char* want : {"auto", "all", "none"}) {
    TrainFlags f;
    const Status s =
        Apply(fmt::format(R"({{"strata": {{"activation_checkpointing": "{}"}}}})", want), &f);
    ASSERT_TRUE(s.ok()) << want << ": " << s.ToString();
    EXPECT_EQ(f.activation_checkpointing, want);
  }
  EXPECT_EQ(TrainFlags{}.activation_checkpointing, "auto");
  TrainFlags bad_flags;
  const Status bad = Apply(R"({"strata": {"activation_checkpointing": "some"}})", &bad_flags);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("'strata.activation_checkpointing' must be one of"),
            std::string::npos)
      << bad.ToString();
  // DeepSpeed's section configures where a model's checkpoints live, not which layers recompute.
  TrainFlags ds;
  ASSERT_TRUE(Apply(R"({"activation_checkpointing": {
                        "cpu_checkpointing": false, "number_checkpoints": 4}})",
                    &ds)
                  .ok());
  EXPECT_EQ(ds.activation_checkpointing, "auto");
  EXPECT_FALSE(ds.offload_activations);
}

TEST(TrainConfig, TheLoraSectionSetsTheLoraFlags) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"strata": {"lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "o_proj"],
                                            "dropout": 0.05, "init": "adapter"}}})",
                    &f)
                  .ok());
  EXPECT_EQ(f.lora.rank, 8);
  EXPECT_EQ(f.lora.alpha, 16);
  EXPECT_EQ(f.lora.targets, (std::vector<std::string>{"q_proj", "o_proj"}));
  EXPECT_EQ(f.lora.dropout, 0.05);
  EXPECT_EQ(f.lora.init, "adapter");
  TrainFlags one;
  ASSERT_TRUE(Apply(R"({"strata": {"lora": {"rank": 4, "targets": "c_attn"}}})", &one).ok());
  EXPECT_EQ(one.lora.targets, std::vector<std::string>{"c_attn"});
  for (const char* bad :
       {R"({"strata": {"lora": {"dropout": 1}}})", R"({"strata": {"lora": {"targets": [3]}}})",
        R"({"strata": {"lora": 8}})"}) {
    TrainFlags g;
    const Status s = Apply(bad, &g);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("strata.lora"), std::string::npos) << s.message();
  }
}

TEST(TrainConfig, PrecisionAndOptimizerFollowDeepSpeedSemantics) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"bf16": {"enabled": true}, "fp16": {"enabled": false}})", &f).ok());
  EXPECT_EQ(f.precision, "bf16");
  ASSERT_TRUE(Apply(R"({"bf16": {"enabled": false}, "fp16": {"enabled": false}})", &f).ok());
  EXPECT_EQ(f.precision, "fp32");
  TrainFlags g;
  ASSERT_TRUE(Apply(R"({"fp16": {"enabled": false}})", &g).ok());
  EXPECT_EQ(g.precision, "fp32");  // nothing enabled: fp32, as DeepSpeed
  // A static loss scale.
  ASSERT_TRUE(Apply(R"({"fp16": {"enabled": true, "loss_scale": 128}})", &g).ok());
  EXPECT_FALSE(g.fp16_dynamic_loss_scale);
  EXPECT_DOUBLE_EQ(g.fp16_initial_scale, 128.0);
  // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
  TrainFlags h;
  h.adam_decoupled_weight_decay = false;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "adam"}})", &h).ok());
  EXPECT_TRUE(h.adam_decoupled_weight_decay);
  // offload_param "none" keeps every block resident; "cpu" means pinned host memory.
  ASSERT_TRUE(Apply(R"({"zero_optimization": {"offload_param": {"device": "none"}}})", &h).ok());
  EXPECT_EQ(h.offload_params, "device");
  ASSERT_TRUE(Apply(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                        "nvme_path": "/one"}}})",
                    &h)
                  .ok());
  EXPECT_EQ(h.offload_params, "host");
  EXPECT_EQ(h.nvme_paths, std::vector<std::string>{"/one"});
  // Below stage 3 DeepSpeed ignores offload_param: every block stays on the device.
  TrainFlags k;
  ASSERT_TRUE(Apply(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                        "offload_optimizer": {"device": "cpu"}}})",
                    &k)
                  .ok());
  EXPECT_EQ(k.offload_params, "device");
  EXPECT_EQ(k.offload_optimizer, "host");
}

TEST(TrainConfig, OptimizerTypeNamesEveryStrataOptimizer) {
  for (const auto& [type, name] :
       std::vector<std::pair<std::string, std::string>>{{"AdamW", "adamw"},
                                                        {"Adam", "adamw"},
                                                        {"AdamW8bit", "adamw8bit"},
                                                        {"Adafactor", "adafactor"},
                                                        {"Lion", "lion"},
                                                        {"SGD", "sgd"},
                                                        {"Adagrad", "adagrad"}}) {
    TrainFlags f;
    const Status s = Apply(R"({"optimizer": {"type": ")" + type + R"("}})", &f);
    ASSERT_TRUE(s.ok()) << type << ": " << s.ToString();
    EXPECT_EQ(f.optimizer, name) << type;
    EXPECT_TRUE(BuildOptimizer(f).ok()) << type;
    // DeepSpeed's "Adafactor" is torch.optim.Adafactor; Strata's transformers' one: said.
    std::string notes;
    for (const std::string& n : f.config_notes) notes += n + "\n";
    EXPECT_EQ(notes.find("not the torch.optim.Adafactor DeepSpeed builds") != std::string::npos,
              name == "adafactor")
        << notes;
  }
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}})", &f).ok());
  EXPECT_DOUBLE_EQ(f.momentum, 0.5);
  const Status momentum =
      Apply(R"({"optimizer": {"type": "Lion", "params": {"momentum": 0.5}}})", &f);
  EXPECT_EQ(momentum.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(momentum.message().find("momentum"), std::string::npos) << momentum.ToString();
  const Status lamb = Apply(R"({"optimizer": {"type": "Lamb"}})", &f);
  EXPECT_NE(lamb.message().find("AdamW8bit"), std::string::npos) << lamb.ToString();
}

// What a DeepSpeed file leaves out is what DeepSpeed makes of it (docs/deepspeed.md), not
// Strata's flag defaults.
TEST(TrainConfig, WhatAFileLeavesOutIsDeepSpeedsDefault) {
  // The optimizer's lr and betas: the defaults of the optimizer DeepSpeed builds for the type.
  for (const auto& [type, lr] :
       std::vector<std::pair<std::string, double>>{{"AdamW", 1e-3},
                                                   {"Adam", 1e-3},
                                                   {"AdamW8bit", 1e-3},
                                                   {"Lion", 1e-3},
                                                   {"SGD", 1e-3},
                                                   {"Adagrad", 1e-2},
                                                   {"Adafactor", 1.5e-3}}) {
    TrainFlags f;
    ASSERT_TRUE(Apply(R"({"optimizer": {"type": ")" + type + R"(", "params": {}}})", &f).ok())
        << type;
    EXPECT_DOUBLE_EQ(PeakLearningRate(f), lr) << type;
  }
  TrainFlags lion;
  ASSERT_TRUE(
      Apply(R"({"optimizer": {"type": "Lion", "params": {"weight_decay": 0.1}}})", &lion).ok());
  auto o = BuildOptimizer(lion);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(std::get<cpu_optim::LionConfig>(o->config).beta2, 0.999f);  // FusedLion's
  EXPECT_EQ(std::get<cpu_optim::LionConfig>(o->config).lr, 1e-3f);
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "Lion", "params": {"lr": 2e-4,
                        "betas": [0.95, 0.98]}}})",
                    &lion)
                  .ok());
  o = BuildOptimizer(lion);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(std::get<cpu_optim::LionConfig>(o->config).beta2, 0.98f);
  EXPECT_DOUBLE_EQ(PeakLearningRate(lion), 2e-4);
  // No gradient_clipping: no clipping (DeepSpeed's default 0), said in a note.
  TrainFlags clip;
  ASSERT_EQ(clip.grad_clip, 1.0);  // the flag's default
  ASSERT_TRUE(Apply(R"({"train_micro_batch_size_per_gpu": 2})", &clip).ok());
  EXPECT_EQ(clip.grad_clip, 0.0);
  std::string notes;
  for (const std::string& n : clip.config_notes) notes += n + "\n";
  EXPECT_NE(notes.find("no gradient_clipping: gradients are not clipped, as DeepSpeed"),
            std::string::npos)
      << notes;
  ASSERT_TRUE(Apply(R"({"gradient_clipping": 0.7})", &clip).ok());
  EXPECT_EQ(clip.grad_clip, 0.7);
  // warmup_num_steps 0 (a Hugging Face Trainer's without warmup): DeepSpeed warms up over
  // max(2, 0) steps, so every rate is the one of warmup_num_steps 2.
  TrainFlags zero, two;
  for (auto& [flags, steps] : {std::pair{&zero, 0}, std::pair{&two, 2}}) {
    ASSERT_TRUE(Apply(fmt::format(R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
                          "scheduler": {{"type": "WarmupDecayLR", "params": {{"total_num_steps": 20,
                          "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": {}}}}}}})",
                                  steps),
                      flags)
                    .ok())
        << steps;
  }
  EXPECT_EQ(zero.warmup_steps, 0);
  for (int step = 0; step < 20; ++step) {
    EXPECT_EQ(LearningRate(zero, step), LearningRate(two, step)) << step;
  }
  EXPECT_GT(LearningRate(zero, 2), 0.0f);
  // The bf16 section's old name, as DeepSpeed reads it; both names at once are refused.
  TrainFlags old_name;
  ASSERT_TRUE(Apply(R"({"bfloat16": {"enabled": true}})", &old_name).ok());
  EXPECT_EQ(old_name.precision, "bf16");
  notes.clear();
  for (const std::string& n : old_name.config_notes) notes += n + "\n";
  EXPECT_EQ(notes.find("bfloat16"), std::string::npos) << notes;  // not "ignored"
  EXPECT_NE(ErrorOf(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})")
                .find("'bf16' and its old name 'bfloat16' are both given"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"fp16": {"enabled": true}, "bfloat16": {"enabled": true}})")
                .find("'fp16.enabled' and 'bfloat16.enabled' are both true"),
            std::string::npos);
  // Type AdamW is AdamW whatever adam_w_mode says, as DeepSpeed runs it; noted.
  TrainFlags adamw;
  ASSERT_TRUE(
      Apply(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", &adamw).ok());
  EXPECT_EQ(adamw.optimizer, "adamw");
  EXPECT_TRUE(adamw.adam_decoupled_weight_decay);
  notes.clear();
  for (const std::string& n : adamw.config_notes) notes += n + "\n";
  EXPECT_NE(notes.find("adam_w_mode false is ignored for type \"AdamW\""), std::string::npos)
      << notes;
}

// Forms DeepSpeed still accepts: the boolean zero_optimization (stage 1 / 0) and the optimizer's
// legacy_fusion switch (a no-op here).
TEST(TrainConfig, DeepSpeedsDeprecatedFormsAreReadOrNamedAsNoOps) {
  for (const bool on : {true, false}) {
    TrainFlags f;
    const Status s = Apply(fmt::format(R"({{"zero_optimization": {}}})", on), &f);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::string notes;
    for (const std::string& n : f.config_notes) notes += n + "\n";
    EXPECT_NE(notes.find(fmt::format("zero_optimization {} is DeepSpeed's deprecated form of "
                                     "{{\"stage\": {}}}",
                                     on, on ? 1 : 0)),
              std::string::npos)
        << notes;
    EXPECT_EQ(f.offload_optimizer, "device");
  }
  EXPECT_NE(ErrorOf(R"({"zero_optimization": 3})").find("'zero_optimization'"), std::string::npos);
  TrainFlags f;
  ASSERT_TRUE(
      Apply(R"({"optimizer": {"type": "AdamW", "legacy_fusion": false, "params": {"lr": 1e-4}}})",
            &f)
          .ok());
  std::string notes;
  for (const std::string& n : f.config_notes) notes += n + "\n";
  EXPECT_NE(notes.find("optimizer.legacy_fusion"), std::string::npos) << notes;
}

TEST(TrainFlags, EachOptimizerHasItsDefaultLearningRateUnlessOneIsGiven) {
  TrainFlags f;
  EXPECT_DOUBLE_EQ(PeakLearningRate(f), 3e-3);
  f.optimizer = "adafactor";
  EXPECT_DOUBLE_EQ(PeakLearningRate(f), 1.5e-3);
  auto o = BuildOptimizer(f);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->kind, cpu_optim::OptimizerKind::kAdafactor);
  EXPECT_EQ(std::get<cpu_optim::AdafactorConfig>(o->config).beta1, 0.0f);  // no first moment
  f.optimizer = "lion";
  EXPECT_DOUBLE_EQ(PeakLearningRate(f), 3e-4);
  f.lr = 5e-4;
  EXPECT_DOUBLE_EQ(PeakLearningRate(f), 5e-4);
  f.optimizer = "adamw8bit";
  f.adam_beta2 = 0.95;
  o = BuildOptimizer(f);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->kind, cpu_optim::OptimizerKind::kAdamW8bit);
  EXPECT_EQ(o->adamw().beta2, 0.95f);
  // LearningRate(f, 0) is the warmup's first step of the peak.
  EXPECT_FLOAT_EQ(o->adamw().lr, static_cast<float>(5e-4 / f.warmup_steps));
}

TEST(TrainConfig, TrainBatchSizeIsCheckedOrDerivedForOneProcess) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", &f).ok());
  EXPECT_EQ(f.grad_accum_steps, 8);
  ASSERT_TRUE(Apply(R"({"train_batch_size": 32, "gradient_accumulation_steps": 16})", &f).ok());
  EXPECT_EQ(f.micro_batch_size, 2);
  ASSERT_TRUE(Apply(R"({"train_batch_size": 6})", &f).ok());
  EXPECT_EQ(f.micro_batch_size, 6);
  EXPECT_EQ(f.grad_accum_steps, 1);
  EXPECT_NE(ErrorOf(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2})")
                .find("'train_batch_size' 10 != "),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})")
                .find("not a multiple"),
            std::string::npos);
}

// Under mpirun the world size counts, as in DeepSpeed: train_batch_size = micro x accum x world.
TEST(TrainConfig, TrainBatchSizeCountsTheProcessesOfTheLauncher) {
  ASSERT_EQ(::setenv("OMPI_COMM_WORLD_SIZE", "2", 1), 0);
  TrainFlags f;
  const Status s = Apply(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", &f);
  const int accum = f.grad_accum_steps;
  const std::string mismatch = ErrorOf(R"({"train_batch_size": 16,
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})");
  const Status whole = Apply(R"({"train_batch_size": 6})", &f);
  const int whole_micro = f.micro_batch_size;
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(accum, 4);
  EXPECT_NE(mismatch.find("* 2 processes"), std::string::npos) << mismatch;
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole_micro, 3);
  TrainFlags g;
  ASSERT_TRUE(Apply(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", &g).ok());
  EXPECT_EQ(g.grad_accum_steps, 8);  // one process again
}

TEST(TrainConfig, AnUnknownKeyIsQuotedWithItsControlCharactersEscaped) {
  // Found by train_config_fuzz: a key holding DEL or a tab was quoted raw into the message.
  EXPECT_EQ(ErrorOf("{\"zero_optimization\": {\"overlap_com\\u007f\": true}}"),
            "run.json: unknown key 'zero_optimization.overlap_com\\x7F' (did you mean "
            "'overlap_comm'?)");
  EXPECT_EQ(
      ErrorOf("{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bet\\tas\": 1}}}").find('\t'),
      std::string::npos);
}

TEST(TrainConfig, UnknownKeysAreRejectedByTheirJsonPathWithTheKnownOnes) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"offload_param": {"device": "cpu", "foo": 1}}})"),
            "run.json: unknown key 'zero_optimization.offload_param.foo'; the nearest in "
            "'zero_optimization.offload_param': device, nvme_path, pin_memory");
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"overlap_com": true}})"),
            "run.json: unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)");
  EXPECT_NE(ErrorOf(R"({"strata": {"stpes": 3}})").find("'strata.stpes' (did you mean 'steps'?)"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"betaz": [0.9, 0.9]}}})")
                .find("unknown key 'optimizer.params.betaz' for type \"AdamW\""),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"amsgrad": true}}})")
                .find("'optimizer.params.amsgrad' true is not supported"),
            std::string::npos);
}

TEST(TrainConfig, UnknownTopLevelKeysAreIgnoredAsDeepSpeedIgnoresThemOnOneNote) {
  // LLaMA-Factory's ds_z3_offload_config.json has a monitor_config section; DeepSpeed reads its
  // top level key by key and ignores what it does not know, typos included (named with the key
  // they most likely meant).
  TrainFlags f;
  const Status s = Apply(R"({"train_micro_batch_size_per_gpu": 2,
                             "monitor_config": {"enabled": true, "tag": "x"},
                             "wall_clock_breakdwn": false})",
                         &f);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(f.micro_batch_size, 2);
  int notes = 0;
  for (const std::string& n : f.config_notes) {
    if (n.find("top-level keys DeepSpeed does not know") == std::string::npos) continue;
    ++notes;
    EXPECT_NE(n.find("monitor_config"), std::string::npos) << n;
    EXPECT_NE(n.find("wall_clock_breakdwn (did you mean 'wall_clock_breakdown'?)"),
              std::string::npos)
        << n;
  }
  EXPECT_EQ(notes, 1);
  // Inside a validated section an unknown key stays an error, naming at most three keys.
  const std::string e = ErrorOf(R"({"zero_optimization": {"qqqqqqqqqqqqqq": 1}})");
  EXPECT_NE(e.find("unknown key 'zero_optimization.qqqqqqqqqqqqqq'; the nearest in "
                   "'zero_optimization': "),
            std::string::npos)
      << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), ','), 2) << e;
}

TEST(TrainConfig, EveryProblemOfAFileIsReportedInOneErrorWithItsPath) {
  const std::string e = ErrorOf(R"({
    "train_micro_batch_size_per_gpu": 0,
    "zero_optimization": {"stage": 3, "overlap_com": true, "sub_group_sise": 1e9,
                          "offload_optimizer": {"device": "nvme", "bufer_count": 4}},
    "aio": {"queue_depth": 0},
    "wall_clock_breakdwn": false,
    "fp16": {"enabled": "auto"}
  })");
  EXPECT_EQ(e.rfind("run.json: 6 problems:\n", 0), 0u) << e;
  for (const char* expected :
       {"unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)",
        "unknown key 'zero_optimization.sub_group_sise' (did you mean 'sub_group_size'?)",
        "unknown key 'zero_optimization.offload_optimizer.bufer_count' (did you mean "
        "'buffer_count'?)",
        "'train_micro_batch_size_per_gpu' must be an integer in 1..2147483647, got 0",
        "'aio.queue_depth' must be an integer in 1..4096, got 0",
        "'fp16.enabled' must be true or false, got \"auto\""}) {
    EXPECT_NE(e.find(std::string("\n  ") + expected), std::string::npos) << expected << "\n" << e;
  }
}

TEST(TrainConfig, DocumentedNoOpKeysAreAcceptedAndNamedInOneNotePerReason) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"zero_optimization": {"stage": 3, "overlap_comm": true,
                          "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9,
                          "sub_group_size": 1e9},
                        "wandb": {"enabled": false, "project": "x"},
                        "sparse_attention": {"mode": "fixed", "block": 16},
                        "aio": {"single_submit": false, "overlap_events": true}})",
                    &f)
                  .ok());
  std::string notes;
  for (const auto& n : f.config_notes) notes += n + "\n";
  EXPECT_NE(notes.find("communication between GPUs; one device has none): "
                       "zero_optimization.overlap_comm, zero_optimization.reduce_bucket_size"),
            std::string::npos)
      << notes;
  EXPECT_NE(
      notes.find("zero_optimization.stage3_max_live_parameters, zero_optimization.sub_group_size"),
      std::string::npos)
      << notes;
  EXPECT_NE(notes.find(": wandb\n"), std::string::npos) << notes;  // the section, not its keys
  EXPECT_NE(notes.find("sparse_attention"), std::string::npos) << notes;
  EXPECT_NE(notes.find("aio.overlap_events, aio.single_submit"), std::string::npos) << notes;
}

TEST(TrainConfig, SchedulersMapToTheirScheduleWithDeepSpeedsDefaults) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
                        "scheduler": {"type": "WarmupDecayLR",
                                      "params": {"total_num_steps": 500, "warmup_num_steps": 50,
                                                 "warmup_max_lr": 3e-4, "warmup_type": "linear"}}})",
                    &f)
                  .ok());
  EXPECT_EQ(f.lr_schedule, "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(f.lr, 3e-4);  // warmup_max_lr is the peak
  EXPECT_EQ(f.warmup_steps, 50);
  EXPECT_EQ(f.lr_total_steps, 500);
  EXPECT_EQ(f.warmup_type, "linear");
  EXPECT_DOUBLE_EQ(f.warmup_min_lr, 0.0);
  TrainFlags g;
  ASSERT_TRUE(Apply(R"({"optimizer": {"params": {"lr": 1e-3}},
                        "scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": 100}}})",
                    &g)
                  .ok());
  EXPECT_EQ(g.lr_schedule, "WarmupCosineLR");
  EXPECT_DOUBLE_EQ(g.lr, 1e-3);     // the optimizer's lr is the peak
  EXPECT_EQ(g.warmup_steps, 1000);  // DeepSpeed's default warmup_num_steps
  EXPECT_EQ(g.warmup_type, "log");
  EXPECT_DOUBLE_EQ(g.cos_min_ratio, 1e-4);
  // WarmupLR without warmup_max_lr peaks at the optimizer's lr (DeepSpeed's WarmupLR takes
  // param_groups[0]['lr'] for None); WarmupDecayLR's default 0.001 is the peak whatever the
  // optimizer's lr, with a note.
  TrainFlags l;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
                        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})",
                    &l)
                  .ok());
  EXPECT_DOUBLE_EQ(l.lr, 2e-4);
  for (const std::string& n : l.config_notes) {
    EXPECT_EQ(n.find("warmup_max_lr"), std::string::npos) << n;
  }
  TrainFlags w;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
                        "scheduler": {"type": "WarmupDecayLR",
                                      "params": {"warmup_num_steps": 10, "total_num_steps": 50}}})",
                    &w)
                  .ok());
  EXPECT_DOUBLE_EQ(w.lr, 1e-3);
  std::string notes;
  for (const std::string& n : w.config_notes) notes += n + "\n";
  EXPECT_NE(notes.find("'scheduler.params.warmup_max_lr' is absent: the peak learning rate is "
                       "DeepSpeed's default 0.001, not optimizer.params.lr 0.0002"),
            std::string::npos)
      << notes;
  TrainFlags h;
  ASSERT_TRUE(Apply(R"({"optimizer": {"type": "AdamW", "params": {"lr": 5e-5}}})", &h).ok());
  EXPECT_EQ(h.lr_schedule, "constant");  // an optimizer and no scheduler: a constant rate
  EXPECT_NE(ErrorOf(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})")
                .find("'scheduler.params.total_num_steps' is required by WarmupDecayLR"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"scheduler": {"type": "OneCycle"}})").find("not supported"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lrr": 0}}})")
                .find("'scheduler.params.warmup_min_lrr'"),
            std::string::npos);
}

TEST(TrainConfig, Fp16SectionTakesDeepSpeedsDefaultsIncludingHysteresis) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"fp16": {"enabled": true}})", &f).ok());
  EXPECT_EQ(f.precision, "fp16");
  EXPECT_EQ(f.fp16_hysteresis, 2);
  EXPECT_DOUBLE_EQ(f.fp16_initial_scale, 65536.0);
  EXPECT_EQ(f.fp16_scale_window, 1000);
  ASSERT_TRUE(Apply(R"({"fp16": {"enabled": true, "hysteresis": 4,
                                 "consecutive_hysteresis": true}})",
                    &f)
                  .ok());
  EXPECT_EQ(f.fp16_hysteresis, 4);
  EXPECT_TRUE(f.fp16_consecutive_hysteresis);
}

TEST(TrainConfig, AioTakesOldAndNewThreadKeysAndDeepSpeedsDefaults) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"aio": {"intra_op_parallelism": 4}})", &f).ok());
  EXPECT_EQ(f.io_threads, 4);
  EXPECT_EQ(f.io_queue_depth, 32);  // DeepSpeed's queue depth 8 on each of 4 threads
  ASSERT_TRUE(Apply(R"({"aio": {"thread_count": 2, "queue_depth": 16}})", &f).ok());
  EXPECT_EQ(f.io_threads, 2);
  EXPECT_EQ(f.io_queue_depth, 32);
  EXPECT_NE(ErrorOf(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})").find("disagree"),
            std::string::npos);
}

TEST(TrainConfig, MonitorsWriteUnderOutputPathAndJobName) {
  TrainFlags f;
  ASSERT_TRUE(Apply(R"({"tensorboard": {"enabled": true, "output_path": "/tb", "job_name": "run1"},
                        "csv_monitor": {"enabled": true, "output_path": "/csv"},
                        "activation_checkpointing": {"cpu_checkpointing": true},
                        "wall_clock_breakdown": true, "steps_per_print": 5})",
                    &f)
                  .ok());
  EXPECT_EQ(f.tensorboard_dir, "/tb/run1");
  EXPECT_EQ(f.metrics_csv_dir, "/csv/DeepSpeedJobName");
  EXPECT_TRUE(f.offload_activations);
  EXPECT_TRUE(f.wall_clock_breakdown);
  EXPECT_EQ(f.log_every, 5);
  TrainFlags g;
  ASSERT_TRUE(Apply(R"({"tensorboard": {"enabled": false, "output_path": "/tb"}})", &g).ok());
  EXPECT_EQ(g.tensorboard_dir, "");
}

TEST(TrainConfig, WrongTypesNameTheKeyTheExpectationAndWhatCame) {
  EXPECT_EQ(ErrorOf(R"({"train_micro_batch_size_per_gpu": "4"})"),
            "run.json: 'train_micro_batch_size_per_gpu' must be an integer in 1..2147483647, got "
            "\"4\" (a string)");
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"lr": "auto"}}})").find("Hugging Face"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"aio": {"queue_depth": 8.5}})").find("'aio.queue_depth'"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"fp16": {"enabled": 1}})").find("'fp16.enabled' must be true or false"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"zero_optimization": {"offload_optimizer": []}})")
                .find("'zero_optimization.offload_optimizer' must be an object"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"betas": [0.9]}}})")
                .find("'optimizer.params.betas' must be [beta1, beta2]"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"strata": {"model": 3}})").find("'strata.model' must be a string"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"([1, 2])").find("top level must be a JSON object"), std::string::npos);
}

TEST(TrainConfig, OutOfRangeValuesNameTheKeyAndTheRange) {
  EXPECT_EQ(ErrorOf(R"({"aio": {"queue_depth": 0}})"),
            "run.json: 'aio.queue_depth' must be an integer in 1..4096, got 0");
  EXPECT_NE(ErrorOf(R"({"aio": {"thread_count": 257}})").find("1..256"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"aio": {"block_size": 1000}})").find("multiple of 4096"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"aio": {"block_size": 2147483648}})").find("'aio.block_size'"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})")
                .find("'optimizer.params.betas[1]' must be a number in [0, 1)"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"lr": 0}}})").find("> 0"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"gradient_clipping": -1})").find("'gradient_clipping'"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"fp16": {"initial_scale_power": 40}})").find("0..24"), std::string::npos);
  const std::string stage =
      ErrorOf(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})");
  EXPECT_NE(stage.find("\"nvme\" needs stage 3"), std::string::npos) << stage;
  EXPECT_NE(ErrorOf(R"({"zero_optimization": {"stage": 4}})").find("0..3"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})")
                .find("one of \"none\", \"cpu\", \"nvme\""),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"optimizer": {"type": "Lamb"}})").find("\"Lamb\" is not supported"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"strata": {"device_budget": "12XB"}})").find("'strata.device_budget'"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"strata": {"steps": 0}})").find("'strata.steps'"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})").find("both true"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"zero_optimization": {"stage": 3,
                        "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                        "offload_param": {"device": "nvme", "nvme_path": "/b"}}})")
                .find("differs"),
            std::string::npos);
}

TEST(TrainConfig, MalformedJsonSaysWhere) {
  const std::string e = ErrorOf("{\n  \"aio\": {\"queue_depth\": 8,}\n}");
  EXPECT_NE(e.find("malformed JSON"), std::string::npos) << e;
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  EXPECT_NE(ErrorOf("").find("malformed JSON"), std::string::npos);
  // Found by tests/fuzz/train_config_fuzz: a number beyond double range threw past the parser.
  EXPECT_NE(ErrorOf("33E3733332").find("malformed JSON"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"aio": {"queue_depth": 1e999}})").find("malformed JSON"),
            std::string::npos);
}

// Issue 47: a value that is finite in the file but not in fp32, where the optimizer uses it,
// is refused as the file's key with the rule, not later as a flag the user never gave.
TEST(TrainConfig, AnEpsBeyondFp32IsTheFilesKeyWithTheRule) {
  const std::string e = ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"eps": 1e308}}})");
  EXPECT_NE(e.find("'optimizer.params.eps' must be a number >= 0 that fits fp32"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1e+308"), std::string::npos) << e;
  EXPECT_EQ(e.find("--optimizer"), std::string::npos) << e;
  EXPECT_NE(ErrorOf(R"({"optimizer": {"params": {"lr": 1e39}}})").find("'optimizer.params.lr'"),
            std::string::npos);
}

TEST(TrainConfig, DeepNestingIsRefusedSayingTheLimitAndWhere) {
  const std::string e = ErrorOf(R"({"optimizer": {"params": {"eps": )" + std::string(100000, '[') +
                                std::string(100000, ']') + "}}}");
  EXPECT_NE(e.find("nested deeper than 64 levels (the limit) under /optimizer/params/eps/"),
            std::string::npos)
      << e;
  EXPECT_LT(e.size(), 400u);
}

TEST(TrainConfig, AFifoAsTheConfigFileIsRefusedWithoutWaiting) {
  const auto path =
      std::filesystem::temp_directory_path() / ("strata_config_fifo_" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  TrainFlags f;
  const Status s = ApplyTrainConfigFile(path.string(), &f);
  std::filesystem::remove(path);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'" + path.string() + "' is a FIFO"), std::string::npos)
      << s.message();
}

TEST(TrainConfig, FilesAreReadAndAMissingFileIsNotFound) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("strata_config_test_" + std::to_string(::getpid()) + ".json");
  {
    std::ofstream out(path);
    out << R"({"strata": {"steps": 12}})";
  }
  TrainFlags f;
  const Status ok = ApplyTrainConfigFile(path.string(), &f);
  std::filesystem::remove(path);
  ASSERT_TRUE(ok.ok()) << ok.ToString();
  EXPECT_EQ(f.steps, 12);
  const Status missing = ApplyTrainConfigFile(path.string(), &f);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find(path.string()), std::string::npos) << missing.message();
}

}  // namespace
}  // namespace strata::tools
