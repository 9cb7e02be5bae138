#include "tools/train_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/file.h"
#include "base/trace.h"
#include "base/units.h"
#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/plan/cost_model.h"
#include "engine/plan/machine_profile.h"
#include "gpu/device.h"
#include "io/io_backend.h"
#include "tools/config.h"
#include "tools/lr_schedule.h"
#include "tools/metrics.h"
#include "tools/model_spec.h"
#include "tools/mpi_launch.h"
#include "tools/option_flags.h"
#include "tools/preference_training.h"
#include "tools/run_destinations.h"
#include "tools/step_prediction.h"
#include "tools/train_loop.h"
#include "tools/train_setup.h"

namespace strata::tools {

namespace {

// The config file, the data and the model.
void AddDataFlags(CLI::App& cmd, TrainFlags& f) {
  // Registered first: CLI11 runs option callbacks in registration order, so the file is applied
  // before every flag given explicitly, and those flags override it (tools/config.h).
  cmd.add_option_function<std::string>(
      "--config",
      [&f](const std::string& path) {
        f.config = path;
        const Status s = ApplyTrainConfigFile(path, &f);
        if (!s.ok()) throw CLI::ValidationError("--config", s.message());
      },
      "DeepSpeed-style JSON config (zero_optimization.offload_*, aio, optimizer, fp16/bf16, "
      "batch sizes, and a \"strata\" section); flags given on the command line override it");
  cmd.add_option("--data", f.data,
                 "Token files in llm.c's format (several, or globs: shards read in order), or "
                 "one text file: byte-level tokens, or tokenized with --tokenizer (cached beside "
                 "it); 90/10 train/val split unless --val-data. Token files with per-token flags "
                 "(`strata tokenize` of JSONL instruction data) train on whole examples, the "
                 "loss on the responses only")
      ->capture_default_str();
  cmd.add_flag("--pack", f.pack,
               "Instruction data: pack several examples into each row of --seq-len tokens "
               "(greedily, in file order; attention and positions stay within each example)");
  cmd.add_option("--long-examples", f.long_examples,
                 "Instruction or preference data: an example (a pair's side) longer than "
                 "--seq-len is truncated or skipped; auto: truncate instruction data, refuse "
                 "preference data")
      ->check(CLI::IsMember({"auto", "truncate", "skip"}))
      ->capture_default_str();
  cmd.add_option("--objective", f.objective,
                 "The loss: sft (next-token cross-entropy), or on preference data (`strata "
                 "tokenize` of TRL's prompt/chosen/rejected JSONL) dpo, ipo or simpo; the DPO/IPO "
                 "reference is the frozen base with --lora-rank, else the initial weights "
                 "(log-probabilities computed once before training)")
      ->check(CLI::IsMember({"sft", "dpo", "ipo", "simpo"}))
      ->capture_default_str();
  cmd.add_option("--beta", f.beta,
                 "DPO and SimPO: beta (the reward's scale); IPO: tau (the regularisation)")
      ->capture_default_str();
  cmd.add_option("--label-smoothing", f.label_smoothing,
                 "DPO and SimPO: the assumed fraction of mislabelled pairs, in [0, 0.5) "
                 "(conservative DPO)")
      ->capture_default_str();
  cmd.add_option("--simpo-gamma", f.simpo_gamma, "SimPO: the target reward margin gamma")
      ->capture_default_str();
  cmd.add_option(
         "--rpo-alpha", f.rpo_alpha,
         "DPO and IPO: add alpha times the policy's mean cross-entropy over the chosen "
         "completions' tokens to the loss (TRL's rpo_alpha: RPO, Pang et al. 2024); 0: none")
      ->capture_default_str();
  cmd.add_option("--cpo-alpha", f.cpo_alpha,
                 "SimPO: add alpha times the policy's mean cross-entropy over the chosen "
                 "completions' tokens (TRL CPOTrainer's cpo_alpha, CPO-SimPO; its default is 1, "
                 "SimPO's paper 0); 0: none")
      ->capture_default_str();
  cmd.add_option("--val-data", f.val_data, "Validation token files (or text with --tokenizer)");
  cmd.add_option("--tokenizer", f.tokenizer,
                 "tokenizer.model, tokenizer.json or a model directory for text data; default: the "
                 "--model-dir's (tokenizer.model first) when the model is not byte-level");
  cmd.add_option("--model", f.model, "Model preset (random initialisation): " + PresetNames())
      ->capture_default_str();
  cmd.add_option("--model-dir", f.model_dir,
                 "Fine-tune a Hugging Face model directory (config.json + safetensors; Llama, "
                 "Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, Gemma 3 text, GPT-2)");
}

// Steps and batch shape, over one rank and over all of them.
void AddBatchFlags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option("--steps", f.steps, "Optimizer steps")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--micro-batch-size", f.micro_batch_size, "Sequences per micro-batch")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--seq-len", f.seq_len, "Tokens per sequence (<= the model's context)")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--grad-accum-steps", f.grad_accum_steps,
                 "Micro-batches per optimizer step on each rank")
      ->capture_default_str()
      ->check(PositiveNumber())
      ->each([&f](const std::string&) { f.grad_accum_given = true; });
  cmd.add_option("--global-batch-size", f.global_batch_size,
                 "Sequences per optimizer step over all data-parallel ranks (mpirun -n N): sets "
                 "the accumulation steps to it / (micro-batch size x N), which must divide")
      ->check(NonNegativeNumber())
      ->each([&f](const std::string&) { f.global_batch_from_config = false; });
  cmd.add_option("--comm-timeout", f.comm_timeout,
                 "Seconds a collective waits for the other ranks before the job is aborted with "
                 "a line naming it (0 = no limit)")
      ->capture_default_str()
      ->check(NonNegativeNumber());
}

// The CPU optimizer and its schedule.
void AddOptimizerFlags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option("--optimizer", f.optimizer,
                 "CPU optimizer: adamw, adam, adamw8bit (8-bit block-wise m and v), adafactor "
                 "(factored second moment), lion, sgd or adagrad")
      ->capture_default_str()
      ->check(CLI::IsMember({"adamw", "adam", "adamw8bit", "adafactor", "lion", "sgd", "adagrad"}));
  cmd.add_option("--beta1", f.adam_beta1,
                 "First-moment decay (adamw, adam, adamw8bit: 0.9; lion 0.9; adafactor 0 = no "
                 "first moment)");
  cmd.add_option("--beta2", f.adam_beta2, "Second-moment decay (adam*: 0.999; lion 0.99)");
  cmd.add_option("--eps", f.adam_eps, "Denominator epsilon (adam*: 1e-8; adagrad 1e-10)");
  cmd.add_option("--momentum", f.momentum, "SGD momentum")->capture_default_str();
  cmd.add_option("--adafactor-decay-rate", f.adafactor_decay_rate,
                 "Adafactor's second-moment schedule beta2_t = 1 - t^rate")
      ->capture_default_str();
  cmd.add_option("--adafactor-clip-threshold", f.adafactor_clip_threshold,
                 "Adafactor's update clipping threshold (RMS of the update)")
      ->capture_default_str();
  cmd.add_option("--lr", f.lr,
                 "Peak learning rate (linear warmup, cosine decay to 10%); default by optimizer: "
                 "3e-3 adamw/adam/adamw8bit, 1.5e-3 adafactor, 3e-4 lion, 0.1 sgd, 1e-2 adagrad")
      ->check(PositiveNumber());
  cmd.add_option("--warmup-steps", f.warmup_steps, "Learning-rate warmup steps")
      ->capture_default_str();
  cmd.add_option("--lr-schedule", f.lr_schedule,
                 "cosine (linear warmup, cosine decay to 10%), constant, or DeepSpeed's warmup "
                 "(WarmupLR), warmup-decay (WarmupDecayLR), warmup-cosine (WarmupCosineLR)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cosine", "constant", "warmup", "warmup-decay", "warmup-cosine",
                             "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}));
  cmd.add_option("--warmup-type", f.warmup_type,
                 "Warmup curve of the DeepSpeed schedules: log or linear")
      ->capture_default_str()
      ->check(CLI::IsMember({"log", "linear"}));
  cmd.add_option("--weight-decay", f.weight_decay,
                 "Weight decay (decoupled for adamw, adamw8bit, lion, adafactor; L2 for adam, "
                 "sgd, adagrad), on every trained matrix; biases and norm weights take none, as "
                 "transformers' Trainer does")
      ->capture_default_str();
  cmd.add_flag("--decay-norms-and-biases", f.decay_norms_and_biases,
               "Apply --weight-decay to the biases and norm weights too (one parameter group, as "
               "a torch optimizer over model.parameters())");
  cmd.add_option("--grad-clip", f.grad_clip, "Clip the global gradient norm to this; 0 = off")
      ->capture_default_str();
}

// The seed, precision, the device, and where params, optimizer state and swap files live.
void AddPlacementFlags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option("--seed", f.seed, "Seed of initialisation, data order and sampling")
      ->capture_default_str();
  cmd.add_option("--precision", f.precision,
                 "Working params and gradients: bf16, fp16 (dynamic loss "
                 "scaling), fp32, or auto (a --model-dir's config.json torch_dtype, else bf16)")
      ->capture_default_str();
  cmd.add_option(
         "--device", f.device,
         "auto (cuda when this build has the CUDA backend and a GPU is visible, else host), "
         "host (CPU emulation of a device) or cuda (a clear error without a GPU)")
      ->capture_default_str();
  cmd.add_option(
         "--device-budget", f.device_budget,
         "Device memory for the whole arena, e.g. 64MiB, 2GiB, 1e9 (GB = 1e9 B, GiB = 2^30 B); "
         "auto = midway between the streaming minimum and the working params alone (with "
         "--offload-params device: what keeping every block resident takes)")
      ->capture_default_str();
  cmd.add_option(
         "--offload-params", f.offload_params,
         "Home of working params between uses: device (all resident), host (pinned), nvme, or "
         "auto (with --machine: the fastest plan that fits, by the cost model; else nvme)")
      ->capture_default_str();
  cmd.add_option("--offload-optimizer", f.offload_optimizer,
                 "Home of fp32 master weights and optimizer state: device (updated there by fused "
                 "kernels; gradients never leave it), host, nvme, or auto (with --machine: by "
                 "predicted time; else nvme)")
      ->capture_default_str();
  cmd.add_option("--optimizer-device-fraction", f.optimizer_device_fraction,
                 "GPU/CPU split: the fraction 0..1 of the parameters (whole blocks from the first) "
                 "whose optimizer runs on the device while the CPU updates the rest at the same "
                 "time, in --offload-optimizer's home; auto (with --machine: by predicted time; "
                 "else 0)")
      ->capture_default_str();
  cmd.add_option("--machine", f.machine,
                 "A machine profile (`strata doctor --machine-profile FILE` writes one): prints "
                 "the predicted step time, its parts and what bounds it with the plan");
  cmd.add_option("--nvme-path", f.nvme_paths,
                 "Directory for swap files (repeat for several drives; extents are striped); a "
                 "private 0700 subdirectory is made and removed at exit. Default: .");
  cmd.add_option("--io-backend", f.io_backend,
                 "NVMe I/O backend: auto (io_uring if allowed), uring or posix")
      ->capture_default_str();
  cmd.add_option("--io-queue-depth", f.io_queue_depth,
                 "NVMe I/O pieces kept in flight per request (1..4096; DeepSpeed aio.queue_depth)")
      ->capture_default_str();
  cmd.add_option("--io-block-size", f.io_block_size,
                 "NVMe I/O piece size: a multiple of 4 KiB up to 1 GiB, e.g. 1MiB, 131072 "
                 "(DeepSpeed aio.block_size)")
      ->capture_default_str();
  cmd.add_option("--io-threads", f.io_threads,
                 "Worker threads of the posix I/O backend (1..256; DeepSpeed aio.thread_count)")
      ->capture_default_str();
}

// What the run reports and writes: summary, validation, sample, progress, trace, metrics.
void AddOutputFlags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option("--summary-json", f.summary_json,
                 "Write the run's summary as one JSON object here");
  cmd.add_option("--eval-every", f.eval_every,
                 "Validation loss every N steps and at the end; 0 = off")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--eval-batches", f.eval_batches, "Micro-batches per validation pass")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--sample-bytes", f.sample_bytes, "Bytes of text to sample at the end; 0 = off")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--log-every", f.log_every, "Print a progress line every N steps")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--trace", f.trace,
                 "Write a Chrome trace-event JSON of the run here: one track per stream and "
                 "thread (open in https://ui.perfetto.dev or chrome://tracing)");
  cmd.add_option("--tensorboard-dir", f.tensorboard_dir,
                 "Write every step's metrics as a TensorBoard event file in this directory "
                 "(created if missing; view with `tensorboard --logdir DIR`)");
  cmd.add_option("--metrics-jsonl", f.metrics_jsonl,
                 "Append every step's metrics (and each validation loss) to this file as JSON "
                 "lines");
  cmd.add_option("--metrics-csv-dir", f.metrics_csv_dir,
                 "Append every step's metrics to one CSV file per metric in this directory "
                 "(DeepSpeed csv_monitor layout: train_loss.csv with header step,train/loss)");
}

// How the step's pipeline runs: copy throttling, overlap, the update during backward, TF32,
// buffers.
void AddPipelineFlags(CLI::App& cmd, TrainFlags& f) {
  cmd.add_option(
         "--copy-bandwidth", f.copy_bandwidth,
         "Host device only: throttle H2D/D2H copies to this many bytes/s (0 = memcpy speed)")
      ->capture_default_str();
  cmd.add_flag("--no-overlap", f.no_overlap,
               "Run the sequential pipeline: every load, kernel, copy, fold and block update "
               "finishes before the next starts (same numbers, for comparison)");
  cmd.add_option("--update-during-backward", f.update_during_backward,
                 "Start each block's CPU update as soon as its gradient is complete, during "
                 "backward, speculatively (no clip, no overflow), validated after backward and "
                 "rolled back when it must be: the same numbers as off. auto = on when --machine's "
                 "cost model predicts a 10 % shorter step (one rank)")
      ->check(CLI::IsMember({"on", "off", "auto"}))
      ->capture_default_str();
  cmd.add_option("--schedule", f.schedule,
                 "The order of a step's blocks and micro-batches: layer-major (every micro-batch "
                 "through a block before the next block: params loaded once per pass, gradients "
                 "sent D2H once per step), micro-batch-major, or auto (layer-major when its plan "
                 "fits the budget micro-batch-major gets and, with --machine, its predicted step "
                 "is not longer; one micro-batch: "
                 "micro-batch-major)")
      ->capture_default_str();
  cmd.add_flag("--eager-update", f.eager_update)->group("");  // hidden: refused, see train_setup
  cmd.add_flag("--tf32", f.tf32,
               "GPU only: the GPT's fp32 matrix products on TF32 tensor cores (10-bit mantissa "
               "inputs, fp32 accumulation; several times faster on Ampere/Hopper)");
  cmd.add_flag("--offload-activations", f.offload_activations,
               "Keep two block-boundary activations on the device and the rest in pinned host "
               "memory (D2H after forward, H2D one block ahead of backward)");
  cmd.add_option("--activation-checkpointing", f.activation_checkpointing,
                 "Which layers recompute their forward in backward: all (every layer: the least "
                 "device memory), none (every layer keeps its forward's activations on the "
                 "device; refused if they do not fit), or auto (the last layers keep theirs while "
                 "the device budget left after the rest of the plan holds them)")
      ->check(CLI::IsMember({"auto", "all", "none"}))
      ->capture_default_str();
  cmd.add_option("--prefetch-depth", f.prefetch_depth,
                 "Blocks loaded ahead of the one computing (streaming slots - 1); 0 = the "
                 "planner decides (2 when the device budget holds the slots, else 1)")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--grad-buckets", f.grad_buckets,
                 "Pinned gradient landing buckets (>= 2); 0 = the planner decides (3)")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--optimizer-buffers", f.optimizer_buffers,
                 "Pinned buffers of the optimizer pipeline (read b+1, update b, write b-1); 0 = "
                 "the planner decides (3 with NVMe, else 1)")
      ->capture_default_str()
      ->check(NonNegativeNumber());
}

}  // namespace

// In this order: --help lists the flags as registered.
namespace {

// The sections of `strata train --help` (CLI11 option groups), in the order they print, and the
// flags of each. Every flag of train is in one (tests/tools/train_help_cli_test.cc checks).
struct HelpGroup {
  const char* name;
  std::vector<std::string_view> flags;
};
const std::vector<HelpGroup>& TrainHelpGroups() {
  static const std::vector<HelpGroup> groups = {
      {"Data", {"--data", "--val-data", "--tokenizer", "--pack", "--long-examples"}},
      {"Preference training",
       {"--objective", "--beta", "--label-smoothing", "--simpo-gamma", "--rpo-alpha",
        "--cpo-alpha"}},
      {"Model", {"--model", "--model-dir", "--precision", "--seed", "--tf32"}},
      {"Batch and steps",
       {"--steps", "--micro-batch-size", "--seq-len", "--grad-accum-steps", "--global-batch-size",
        "--comm-timeout"}},
      {"Optimizer",
       {"--optimizer", "--lr", "--lr-schedule", "--warmup-steps", "--warmup-type", "--weight-decay",
        "--decay-norms-and-biases", "--grad-clip", "--beta1", "--beta2", "--eps", "--momentum",
        "--adafactor-decay-rate", "--adafactor-clip-threshold"}},
      {"Placement and memory",
       {"--device", "--device-budget", "--offload-params", "--offload-optimizer",
        "--optimizer-device-fraction", "--machine", "--schedule", "--update-during-backward",
        "--offload-activations", "--activation-checkpointing", "--prefetch-depth", "--grad-buckets",
        "--optimizer-buffers", "--no-overlap", "--copy-bandwidth"}},
      {"I/O (NVMe)",
       {"--nvme-path", "--io-backend", "--io-queue-depth", "--io-block-size", "--io-threads"}},
      {"LoRA",
       {"--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--lora-init",
        "--base-quant", "--base-double-quant"}},
      {"Checkpoints",
       {"--save-dir", "--save-every", "--keep-last", "--resume", "--save-on-signal"}},
      {"Logging and outputs",
       {"--log-every", "--eval-every", "--eval-batches", "--sample-bytes", "--summary-json",
        "--trace", "--tensorboard-dir", "--metrics-jsonl", "--metrics-csv-dir"}},
  };
  return groups;
}

// Files every option of `cmd` under its section; --help and --config stay at the top, and an
// option hidden from the help (group "", the removed --eager-update) stays hidden.
void GroupTrainFlags(CLI::App& cmd) {
  for (CLI::Option* option : cmd.get_options()) {
    if (option->get_group().empty()) continue;  // hidden
    for (const HelpGroup& g : TrainHelpGroups()) {
      const auto& names = option->get_lnames();
      if (!names.empty() &&
          std::find(g.flags.begin(), g.flags.end(), "--" + names[0]) != g.flags.end()) {
        option->group(g.name);
      }
    }
  }
}

}  // namespace

void AddTrainFlags(CLI::App& cmd, TrainFlags& f) {
  AddDataFlags(cmd, f);
  AddBatchFlags(cmd, f);
  AddOptimizerFlags(cmd, f);
  AddPlacementFlags(cmd, f);
  AddLoraFlags(cmd, f.lora);
  AddOutputFlags(cmd, f);
  AddPipelineFlags(cmd, f);
  AddCheckpointFlags(cmd, f.checkpoint);
  GroupTrainFlags(cmd);
}

namespace {

// What every rank must agree on (CheckSameOnAllRanks): the flags that shape the model, the data,
// the batch, the optimizer and the schedule.
std::vector<std::pair<std::string, std::string>> RankConfiguration(const TrainFlags& f) {
  // Every flag that changes what a rank computes or the order of its collectives, by name, so
  // that a difference is named. Paths of the outputs are left out ({rank} may make them differ).
  const auto str = [](const auto& v) { return fmt::format("{}", v); };
  const auto opt = [](const std::optional<double>& v) {
    return v ? fmt::format("{}", *v) : std::string("default");
  };
  return {
      {"--model", f.model},
      {"--model-dir", f.model_dir},
      {"--data", fmt::format("{}", fmt::join(f.data, ","))},
      {"--val-data", fmt::format("{}", fmt::join(f.val_data, ","))},
      {"--tokenizer", f.tokenizer},
      {"--pack", str(f.pack)},
      {"--long-examples", f.long_examples},
      {"--objective", f.objective},
      {"--beta", str(f.beta)},
      {"--label-smoothing", str(f.label_smoothing)},
      {"--simpo-gamma", str(f.simpo_gamma)},
      {"--rpo-alpha", str(f.rpo_alpha)},
      {"--cpo-alpha", str(f.cpo_alpha)},
      {"--precision", f.precision},
      {"--micro-batch-size", str(f.micro_batch_size)},
      {"--seq-len", str(f.seq_len)},
      {"--grad-accum-steps", str(f.grad_accum_steps)},
      {"--global-batch-size", str(f.global_batch_size)},
      {"--optimizer", f.optimizer},
      {"--lr", str(f.lr)},
      {"--weight-decay", str(f.weight_decay)},
      {"--decay-norms-and-biases", str(f.decay_norms_and_biases)},
      {"--beta1", opt(f.adam_beta1)},
      {"--beta2", opt(f.adam_beta2)},
      {"--eps", opt(f.adam_eps)},
      {"--grad-clip", str(f.grad_clip)},
      {"--steps", str(f.steps)},
      {"--seed", str(f.seed)},
      {"--lr-schedule", f.lr_schedule},
      {"--warmup-steps", str(f.warmup_steps)},
      {"--device-budget", f.device_budget},
      {"--offload-params", f.offload_params},
      {"--offload-optimizer", f.offload_optimizer},
      {"--optimizer-device-fraction", f.optimizer_device_fraction},
      {"--update-during-backward", f.update_during_backward},
      {"--schedule", f.schedule},
      {"--activation-checkpointing", f.activation_checkpointing},
      {"--offload-activations", str(f.offload_activations)},
      {"--prefetch-depth", str(f.prefetch_depth)},
      {"--grad-buckets", str(f.grad_buckets)},
      {"--lora-rank", str(f.lora.rank)},
      {"--lora-alpha", str(f.lora.alpha)},
      {"--lora-targets", fmt::format("{}", fmt::join(f.lora.targets, ","))},
      {"--lora-dropout", str(f.lora.dropout)},
      {"--lora-init", f.lora.init},
      {"the fp16 loss scaling",
       fmt::format("{}/{}/{}/{}", f.fp16_initial_scale, f.fp16_scale_window, f.fp16_hysteresis,
                   f.fp16_min_scale)},
      {"--eval-every", str(f.eval_every)},
      {"--save-dir", f.checkpoint.save_dir},
      {"--resume", f.checkpoint.resume},
  };
}

// The plan's "decay" line: which trained parameters --weight-decay applies to.
std::string DescribeWeightDecay(const TrainFlags& f, const engine::Model& model) {
  int64_t trained = 0, exempt = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    trained += model.block_num_params(b);
    for (const cpu_optim::ElemRange& r : model.block_no_decay_ranges(b)) exempt += r.end - r.begin;
  }
  if (f.decay_norms_and_biases || exempt == 0) {
    return fmt::format("weight decay {:g} on every trained parameter ({}){}", f.weight_decay,
                       trained, f.decay_norms_and_biases ? ", biases and norm weights too" : "");
  }
  return fmt::format(
      "weight decay {:g} on {} parameters; none on the {} of biases and norm weights "
      "(--decay-norms-and-biases decays them too)",
      f.weight_decay, trained - exempt, exempt);
}

// The lines before the plan: the model, the config notes, the data and the device.
void PrintRunLines(const TrainOptions& o, const TrainInputs& in, const gpu::Device& device) {
  std::printf("strata train: %s\n", in.model->description().c_str());
  for (const auto& note : o.flags.config_notes) std::printf("config: %s\n", note.c_str());
  std::printf("%s; device: %s\n", in.data.dataset->Describe().c_str(),
              device.description().c_str());
}

// The plan, then the batch, the schedule and fp16's loss scaling: all known before the engine is
// created.
void PrintPlan(const TrainOptions& o, const engine::Plan& plan, const engine::Model& model) {
  const TrainFlags& f = o.flags;
  const int ranks = o.ranks.ranks;
  std::printf("%s", InFlagTerms(plan.Describe()).c_str());
  std::printf(
      "  batch    %d x %d tokens per micro-batch, %d micro-batch%s per step%s; gradient "
      "clipping %s\n",
      f.micro_batch_size, f.seq_len, f.grad_accum_steps, f.grad_accum_steps == 1 ? "" : "es",
      ranks > 1 ? fmt::format(" on each of {} ranks ({} sequences per step; {} over {})", ranks,
                              f.micro_batch_size * f.grad_accum_steps * ranks,
                              o.engine.comm->backend(), ranks)
                      .c_str()
                : "",
      f.grad_clip > 0 ? fmt::format("at norm {:g}", f.grad_clip).c_str() : "off");
  std::printf("  lr       %s\n", DescribeLrSchedule(o.schedule).c_str());
  if (f.weight_decay > 0) std::printf("  decay    %s\n", DescribeWeightDecay(f, model).c_str());
  if (o.engine.precision == DType::kF16) {
    std::printf(
        "  fp16     %s\n",
        f.fp16_dynamic_loss_scale
            ? fmt::format("dynamic loss scale from {:g}, x2 after {} clean steps, "
                          "hysteresis {}{}, min {:g}",
                          f.fp16_initial_scale, f.fp16_scale_window, f.fp16_hysteresis,
                          f.fp16_consecutive_hysteresis ? " (consecutive)" : "", f.fp16_min_scale)
                  .c_str()
            : fmt::format("static loss scale {:g}", f.fp16_initial_scale).c_str());
  }
  std::fflush(stdout);
}

// --machine: the cost model's prediction for the chosen plan and the optimizer's other
// placements (both from the plan choice; worded by tools/step_prediction.h), or why the profile
// cannot predict it.
void PrintPrediction(const engine::PlanChoice& choice) {
  if (!choice.prediction) {
    std::printf("  predicted step: none: %s\n", InFlagTerms(choice.prediction_error).c_str());
  } else {
    std::printf("  %s", DescribeStepPrediction(*choice.prediction, choice.optimizer_alternatives,
                                               choice.plan.device_budget_bytes)
                            .c_str());
  }
  std::fflush(stdout);
}

// The NVMe I/O line, once the engine has picked its backend.
void PrintIoLine(const TrainOptions& o, const engine::Engine& engine) {
  if (!engine.io_backend_name().empty()) {
    const io::IoBackendOptions& io = o.engine.io;
    const std::string_view backend = engine.io_backend_name();
    const std::string threads = backend == "posix" ? fmt::format(", {} thread{}", io.posix_threads,
                                                                 io.posix_threads == 1 ? "" : "s")
                                                   : "";
    std::printf("  io       %s backend (block %s, queue depth %d%s), swap under %s\n",
                std::string(backend).c_str(), FormatBytes(io.block_size_bytes).c_str(),
                io.queue_depth, threads.c_str(),
                fmt::format("{}", fmt::join(o.engine.placement.nvme_paths, ", ")).c_str());
  }
  if (engine.frozen_base_shared_by() > 1) {
    std::printf(
        "  frozen   one pinned copy (%s) shared by the %d ranks of this machine (/dev/shm)\n",
        FormatBytes(engine.frozen_base_shared_bytes()).c_str(), engine.frozen_base_shared_by());
  }
  std::fflush(stdout);
}

// One rank's bytes for the summary (collective: every rank's, gathered on each).
struct RankBytes {
  uint64_t nvme_read, nvme_written, host, host_grad, pinned, h2d, d2h, device_peak;
};

StatusOr<std::vector<RankBytes>> GatherRankBytes(const engine::Plan& plan,
                                                 const engine::EngineCounters& counters, int ranks,
                                                 comm::Communicator* world) {
  const RankBytes mine{counters.nvme_bytes_read, counters.nvme_bytes_written, plan.host_bytes,
                       plan.host_grad_bytes,     counters.pinned_bytes,       counters.bytes_h2d,
                       counters.bytes_d2h,       counters.device_peak_bytes};
  std::vector<RankBytes> per_rank(ranks);
  if (world) {
    STRATA_RETURN_IF_ERROR(world->AllGatherBytes(std::as_bytes(std::span(&mine, 1)),
                                                 std::as_writable_bytes(std::span(per_rank))));
  } else {
    per_rank[0] = mine;
  }
  return per_rank;
}

// Host figures per rank: host_bytes = host gradients + (optimizer home host) master weights and
// optimizer state; host_optimizer_bytes is the latter.
nlohmann::json RankListJson(const std::vector<RankBytes>& per_rank) {
  nlohmann::json rank_list = nlohmann::json::array();
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const RankBytes& b = per_rank[r];
    rank_list.push_back({{"rank", r},
                         {"nvme_bytes_read", b.nvme_read},
                         {"nvme_bytes_written", b.nvme_written},
                         {"host_bytes", b.host},
                         {"host_grad_bytes", b.host_grad},
                         {"host_optimizer_bytes", b.host - b.host_grad},
                         {"pinned_bytes", b.pinned},
                         {"bytes_h2d", b.h2d},
                         {"bytes_d2h", b.d2h},
                         {"device_peak_bytes", b.device_peak}});
  }
  return rank_list;
}

nlohmann::json TimeBreakdownJson(const trace::Breakdown& parts, double step_seconds) {
  nlohmann::json breakdown = nlohmann::json::object();
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    breakdown[std::string(trace::CategoryName(c))] = parts.seconds[i];
  }
  breakdown["step"] = step_seconds;
  return breakdown;
}

// Preference training's metrics under TRL's names (null for sft): the last step's and the
// final validation's.
nlohmann::json PreferenceJson(const TrainOutcome& r) {
  auto metrics = [](const std::optional<engine::PreferenceMetrics>& m) {
    return m ? PreferenceTraining::Json(*m) : nlohmann::json();
  };
  if (!r.train_preference && !r.val_preference) return nlohmann::json();
  return {{"train_last_step", metrics(r.train_preference)}, {"val", metrics(r.val_preference)}};
}

// What --summary-json gets from the run itself (the rest: SummaryJson).
nlohmann::json OutcomeJson(const TrainOutcome& r, double wall_seconds) {
  auto num_or_null = [](float v) {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
  };
  const auto& c = r.counters;
  return {
      {"tokens_per_second", r.tokens_per_second},
      {"train_seconds", r.train_seconds},
      {"wall_seconds", wall_seconds},
      {"loss_first", num_or_null(r.loss_first)},
      {"loss_last", num_or_null(r.loss_last)},
      {"val_loss", num_or_null(r.val_loss)},
      {"skipped_steps", r.skipped},
      {"tokens_in_loss", r.tokens_in_loss},
      {"update_during_backward_share", c.params_updated_on_cpu > 0
                                           ? static_cast<double>(c.params_updated_during_backward) /
                                                 static_cast<double>(c.params_updated_on_cpu)
                                           : 0.0},
      {"rollback_steps", c.rollback_steps},
      {"device_peak_bytes", c.device_peak_bytes},
      {"pinned_bytes", c.pinned_bytes},
      {"bytes_h2d", c.bytes_h2d},
      {"bytes_d2h", c.bytes_d2h},
      {"nvme_bytes_read", c.nvme_bytes_read},
      {"nvme_bytes_written", c.nvme_bytes_written},
      {"params_updated_on_cpu", c.params_updated_on_cpu},
      {"master_weights_xxh3", fmt::format("{:016x}", r.master_hash)},
      {"master_xxh3", fmt::format("{:016x}", r.master_hash)},
      {"start_step", r.start_step},
      {"checkpoint",
       r.last_checkpoint.empty() ? nlohmann::json() : nlohmann::json(r.last_checkpoint)},
      {"time_breakdown", TimeBreakdownJson(r.parts, r.step_seconds)},
      {"overlap_efficiency", OverlapEfficiency(r.parts, r.step_seconds)},
      {"mfu", r.mfu ? nlohmann::json(*r.mfu) : nlohmann::json()},
      {"preference", PreferenceJson(r)},
  };
}

// The summary: the run's outcome, the plan and the flags that shaped it.
nlohmann::json SummaryJson(const TrainOptions& o, const ModelSpec& spec, engine::Engine& engine,
                           const gpu::Device& device, const TrainOutcome& r, double wall_seconds) {
  const TrainFlags& f = o.flags;
  const engine::Plan& plan = engine.plan();
  nlohmann::json j = OutcomeJson(r, wall_seconds);
  j.update({
      {"steps", f.steps},
      {"loss_scale", engine.loss_scale()},
      {"device", std::string(gpu::DeviceKindName(device.kind()))},
      {"io_backend", engine.io_backend_name().empty() ? nlohmann::json()
                                                      : nlohmann::json(engine.io_backend_name())},
      {"frozen_base_shared_by", engine.frozen_base_shared_by()},
      {"precision", DTypeName(o.engine.precision)},
      {"update_during_backward", o.engine.update_during_backward ? "on" : "off"},
      {"schedule", std::string(engine::ScheduleName(plan.schedule))},
      {"trained_params", plan.model_params},
      {"frozen_params", plan.frozen_params},
      {"param_home", std::string(engine::ParamHomeName(plan.param_home))},
      {"optimizer_home", plan.device_optimizer_params == plan.model_params
                             ? std::string("device")
                             : std::string(engine::OptimizerHomeName(plan.optimizer_home))},
      {"optimizer_device_fraction", plan.optimizer_device_fraction()},
      {"optimizer", plan.optimizer_name},
      {"lr_schedule", nlohmann::json::parse(LrScheduleJson(o.schedule, f.steps))},
      {"grad_clip", f.grad_clip},
      {"loss_scale_hysteresis", f.fp16_hysteresis},
      {"tf32", f.tf32},
      {"model", spec.model_dir.empty() ? f.model : spec.model_dir},
      {"model_params", plan.model_params},
      {"model_state_bytes", plan.model_state_bytes},
      {"device_budget_bytes", plan.device_budget_bytes},
      {"resident_blocks", plan.num_resident()},
      {"num_blocks", plan.blocks.size()},
      {"activation_checkpointing",
       std::string(engine::ActivationCheckpointingName(plan.activation_checkpointing))},
      {"recomputing_blocks", plan.num_recomputing()},
      {"kept_activation_blocks", plan.num_keeping_activations()},
      {"kept_activation_bytes", plan.kept_activation_bytes()},
      {"micro_batch_size", f.micro_batch_size},
      {"seq_len", f.seq_len},
      {"grad_accum_steps", f.grad_accum_steps},
      {"seed", f.seed},
      {"global_batch_size", f.micro_batch_size * f.grad_accum_steps * o.ranks.ranks},
      {"comm_backend", o.engine.comm && o.ranks.data_parallel
                           ? nlohmann::json(std::string(o.engine.comm->backend()))
                           : nlohmann::json()},
      {"planning", PlanningJson()},
  });
  const std::optional<int64_t> flops = ModelFlopsPerTokenOf(spec, plan);
  j["model_flops_per_token"] = flops ? nlohmann::json(*flops) : nlohmann::json();
  return j;
}

Status WriteSummaryJson(const std::string& path, const nlohmann::json& j) {
  return WriteOutputFile(path, j.dump(2) + "\n", "--summary-json");
}

Status RunTrainRanks(const TrainFlags& flags, comm::Communicator* world);

}  // namespace

Status RunTrain(const TrainFlags& f) {
  // Launched by mpirun: one rank of a data-parallel job. An error on any rank ends the whole job
  // (every rank exits non-zero) with one line naming the rank and the cause.
  if (!LaunchedByMpi()) return RunTrainRanks(f, nullptr);
  comm::CommOptions options;
  options.timeout_seconds = f.comm_timeout;
  STRATA_ASSIGN_OR_RETURN(auto world, comm::CreateMpiCommunicator(options));
  if (world->rank() != 0) {
    // One report per job: rank 0 prints the plan, the progress and the summary.
    if (std::freopen("/dev/null", "w", stdout) == nullptr) {
      return ErrnoToStatus(errno, "silencing the standard output of a rank other than 0");
    }
  }
  const Status s = RunTrainRanks(f, world.get());
  // A stop every rank agreed on after a step (tools/checkpoint_commands.h) ends each rank alike,
  // with 130/143; anything else on one rank ends the job.
  const bool stopped_together = s.code() == StatusCode::kCancelled && StopSignalAgreed();
  if (!s.ok() && world->world_size() > 1 && !stopped_together) {
    std::fflush(stdout);
    // As one process reports it (tools/main.cc): the message in the user's flags, no status code.
    comm::Abort(*world, fmt::format("error: {}", InFlagTerms(s.message())));
  }
  return s;
}

namespace {

// Models of at least this many parameters get progress lines while the engine initialises
// (allocates, pins, samples the weights, writes NVMe): a 7B model's first step is minutes away, and
// a silent wait reads as a hang.
constexpr int64_t kInitProgressMinParams = 100'000'000;

// EngineOptions::init_progress for strata train: a line at every tenth of the parameters and at
// the end, with the rate since the engine's creation began (now).
std::function<void(int, int, int64_t, int64_t)> InitProgressLines() {
  const auto t0 = std::chrono::steady_clock::now();
  auto next = std::make_shared<int64_t>(0);
  return [t0, next](int blocks_done, int num_blocks, int64_t done, int64_t total) {
    if (total < kInitProgressMinParams || (done < *next && blocks_done < num_blocks)) return;
    *next = done + total / 10;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "init     %d of %d blocks, %.3f of %.3f billion params in %.1f s (%.1f M params/s)\n",
        blocks_done, num_blocks, static_cast<double>(done) / 1e9, static_cast<double>(total) / 1e9,
        s, static_cast<double>(done) / 1e6 / std::max(s, 1e-9));
    std::fflush(stdout);
  };
}

// The setup (tools/train_setup.h), the plan printed before the engine allocates anything, the
// loop (tools/train_loop.h), and the summary.
Status RunTrainRanks(const TrainFlags& flags, comm::Communicator* world) {
  const auto t_start = std::chrono::steady_clock::now();
  if (world) {
    STRATA_RETURN_IF_ERROR(
        comm::CheckSameOnAllRanks(*world, "the flags of strata train", RankConfiguration(flags)));
  }
  STRATA_ASSIGN_OR_RETURN(TrainOptions o, TrainOptionsFromFlags(flags, RankInfoOf(world)));
  std::optional<engine::MachineProfile> machine;
  if (!flags.machine.empty()) {
    STRATA_ASSIGN_OR_RETURN(machine, engine::ReadMachineProfile(flags.machine));
  }
  // Opened before the model is built, so that a bad metrics path fails at once: the CSV files too
  // of the tags every step and every validation records.
  if (!o.metrics.csv_dir.empty()) {
    const auto add = [&](const std::vector<std::string>& tags) {
      o.metrics.csv_tags.insert(o.metrics.csv_tags.end(), tags.begin(), tags.end());
    };
    add(TrainMetrics::StepTags());
    if (o.preference) add(PreferenceTraining::Tags("train/", *o.preference));
    if (o.loop.eval_every > 0) {
      add({"val/loss"});
      if (o.preference) add(PreferenceTraining::Tags("val/", *o.preference));
    }
  }
  STRATA_ASSIGN_OR_RETURN(auto metrics_writer, MetricsWriter::Create(o.metrics));
  STRATA_ASSIGN_OR_RETURN(TrainInputs in, OpenModelAndData(o));
  if (in.precision_auto) {
    o.engine.precision = *in.precision_auto;
    std::printf("precision: %s, --precision auto\n", in.precision_why.c_str());
  }
  // Every option left auto is resolved here, once; nothing after this plans again.
  STRATA_ASSIGN_OR_RETURN(engine::PlanChoice choice,
                          ChooseTrainPlan(*in.model, in.spec, machine ? &*machine : nullptr, &o,
                                          /*compare=*/machine.has_value()));
  // Declared before the device and the engine, which record into it until they are destroyed.
  trace::TraceRecorder recorder(/*keep_events=*/!o.flags.trace.empty());
  o.engine.trace = &recorder;
  STRATA_ASSIGN_OR_RETURN(TrainDevice device, CreateTrainDevice(world, &recorder, &o));
  PrintRunLines(o, in, *device.device);
  PrintPlan(o, choice.plan, *in.model);
  std::printf("%s", InFlagTerms(choice.Reasons()).c_str());
  if (machine) PrintPrediction(choice);
  // The budget against the device's free memory, then the save directory, swap directories,
  // summary and trace: made or refused before the work.
  STRATA_RETURN_IF_ERROR(
      CheckDeviceBudgetFits(*device.device, choice.plan, o.automatic.device_budget));
  STRATA_RETURN_IF_ERROR(CheckPlanFitsAddressSpace(device.device->kind(), choice.plan));
  STRATA_RETURN_IF_ERROR(PrepareRunDestinations(o.flags, choice.plan));
  o.engine.init_progress = InitProgressLines();
  // From here a signal stops the run between blocks or steps (tools/checkpoint_commands.h): the
  // engine's destructor removes its swap files whenever it comes.
  InstallStopSignalHandlers();
  o.engine.cancel_requested = [] { return StopSignal() != 0; };
  StatusOr<std::unique_ptr<engine::Engine>> created =
      engine::Engine::Create(in.model.get(), device.device.get(), o.engine, std::move(choice.plan));
  STRATA_RETURN_IF_ERROR(StoppedBeforeTheFirstStep(created.status()));
  std::unique_ptr<engine::Engine> engine = std::move(*created);
  PrintIoLine(o, *engine);
  // MFU needs the device's peak: the --machine profile's, when it has one.
  const double peak_tflops = machine && machine->device ? machine->device->peak_bf16_TFLOPs : 0;
  STRATA_ASSIGN_OR_RETURN(
      TrainOutcome r,
      RunTrainLoop({&o, engine.get(), in.model.get(), &in.data, &in.spec, &recorder,
                    metrics_writer.get(), ModelFlopsPerTokenOf(in.spec, engine->plan()).value_or(0),
                    peak_tflops}));
  STRATA_ASSIGN_OR_RETURN(auto per_rank,
                          GatherRankBytes(engine->plan(), r.counters, o.ranks.ranks, world));
  if (o.flags.summary_json.empty()) return Status::Ok();
  const double wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  nlohmann::json j = SummaryJson(o, in.spec, *engine, *device.device, r, wall_seconds);
  j["ranks"] = RankListJson(per_rank);
  return WriteSummaryJson(o.flags.summary_json, j);
}

}  // namespace

}  // namespace strata::tools
