// The flags of `strata train` as given (after --config), one field per flag or config key. Only
// tools/ sees them: TrainOptionsFromFlags (tools/train_setup.h) turns them into the typed option
// structs of the layers below and of the training loop, once; nothing past it reads a flag.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tools/checkpoint_commands.h"
#include "tools/model_spec.h"

namespace strata::tools {

struct TrainFlags {
  // Text (byte-level, or with --tokenizer) or token files in llm.c's format (several: shards).
  std::vector<std::string> data = {"data/tinyshakespeare.txt"};
  std::vector<std::string> val_data;  // empty: the last 10% of --data
  std::string tokenizer;              // a SentencePiece model for text data
  // Token files with per-token flags (instruction data from `strata tokenize`): several
  // examples packed into a row; an example longer than --seq-len truncated or skipped.
  bool pack = false;
  // truncate, skip, or auto: truncate for instruction data, refuse for preference data.
  std::string long_examples = "auto";
  // Preference training (tools/preference_training.h): the loss, sft (next-token cross-entropy)
  // or dpo, ipo, simpo on preference data, and their hyper-parameters (TRL's names and defaults).
  std::string objective = "sft";
  double beta = 0.1;
  double label_smoothing = 0;
  double simpo_gamma = 0.5;
  double rpo_alpha = 0;  // DPO, IPO: the NLL term's weight (TRL DPOConfig.rpo_alpha)
  double cpo_alpha = 0;  // SimPO: the NLL term's weight (TRL CPOConfig.cpo_alpha)
  std::string model = "small";
  std::string model_dir;  // a Hugging Face directory: fine-tune from its weights
  int64_t steps = 300;
  int micro_batch_size = 1;
  int seq_len = 64;
  int grad_accum_steps = 8;  // per rank
  // Sequences per optimizer step over every data-parallel rank; 0 = micro-batch x accumulation x
  // ranks. When given, the accumulation steps per rank are derived from it (it must divide).
  int global_batch_size = 0;
  // Where global_batch_size came from, for its errors: the --config file's train_batch_size
  // (DeepSpeed's) or --global-batch-size.
  bool global_batch_from_config = false;
  // Whether --grad-accum-steps was given on the command line: with a global batch it must agree
  // (it is derived otherwise).
  bool grad_accum_given = false;
  // Seconds a collective may wait for the other ranks before the job is aborted (0 = forever).
  double comm_timeout = 300;
  // The CPU optimizer: adamw, adam, adamw8bit, adafactor, lion, sgd or adagrad
  // (BuildOptimizer). Its betas and eps default to the optimizer's own (torch.optim's; Adafactor:
  // beta1 0, no first moment) unless given.
  std::string optimizer = "adamw";
  double lr = 0;  // peak learning rate; 0 = the optimizer's (DefaultLearningRate)
  int64_t warmup_steps = 20;
  // The schedule (tools/lr_schedule.h): cosine (Strata's), constant, or DeepSpeed's WarmupLR,
  // WarmupDecayLR, WarmupCosineLR (flag spellings warmup, warmup-decay, warmup-cosine).
  std::string lr_schedule = "cosine";
  std::string warmup_type = "log";  // DeepSpeed schedules: log or linear warmup
  double warmup_min_lr = 0;         // WarmupLR, WarmupDecayLR: the rate warmup starts from
  int64_t lr_total_steps = 0;       // WarmupDecayLR, WarmupCosineLR total_num_steps; 0 = --steps
  double warmup_min_ratio = 0;      // WarmupCosineLR
  double cos_min_ratio = 1e-4;      // WarmupCosineLR
  double weight_decay = 0.0;
  // --decay-norms-and-biases: weight decay on the biases and norm weights too (one parameter
  // group); off: they take none, as transformers' Trainer does.
  bool decay_norms_and_biases = false;
  double momentum = 0.9;                  // sgd
  double adafactor_decay_rate = -0.8;     // adafactor: beta2_t = 1 - t^decay_rate
  double adafactor_clip_threshold = 1.0;  // adafactor: update clipping (RMS)
  double grad_clip = 1.0;
  uint64_t seed = 1337;
  std::string precision = "bf16";
  std::string device = "auto";
  std::string device_budget = "auto";
  // The placement: "auto" is chosen with the plan (engine/plan/plan_choice.h): by predicted time
  // with --machine, else params and optimizer state on NVMe and nothing of the optimizer on the
  // device.
  std::string offload_params = "auto";
  std::string offload_optimizer = "auto";
  // The GPU/CPU split: the fraction (0..1) of the parameters whose optimizer runs on the device
  // (engine::PlacementOptions::optimizer_device_fraction), or auto.
  std::string optimizer_device_fraction = "auto";
  // A machine profile (engine/plan/machine_profile.h): the predicted step is printed with the plan.
  std::string machine;
  std::vector<std::string> nvme_paths;
  std::string io_backend = "auto";
  std::string summary_json;
  std::string trace;  // Chrome trace-event JSON path; empty = none
  // Per-step metrics (tools/metrics.h); empty = off. The directories are the final ones (a
  // DeepSpeed config's output_path/job_name is joined before it gets here).
  std::string tensorboard_dir;  // TensorBoard event file
  std::string metrics_jsonl;    // JSON lines
  std::string metrics_csv_dir;  // one CSV per tag, like DeepSpeed's csv_monitor
  int64_t eval_every = 100;
  int eval_batches = 16;
  int64_t sample_bytes = 200;
  int64_t log_every = 10;
  double copy_bandwidth = 0;
  // Overlap (engine/engine.h): off = the sequential pipeline, for comparison.
  bool no_overlap = false;
  // The CPU update during backward (engine/update_speculation.h): "on", "off" or "auto" (chosen
  // with the plan: by predicted time with --machine, one rank and overlap).
  std::string update_during_backward = "auto";
  // The step's order of blocks and micro-batches (engine::Schedule): "layer-major",
  // "micro-batch-major" or "auto" (chosen with the plan, by fit and predicted time).
  std::string schedule = "auto";
  bool eager_update = false;  // the removed --eager-update, refused with what replaced it
  bool offload_activations = false;
  // Which layers recompute their forward in backward (engine::ActivationCheckpointing): "all",
  // "none", or "auto" (the layers whose activations fit in the device budget the rest of the
  // plan leaves keep them; the rest recompute).
  std::string activation_checkpointing = "auto";
  bool tf32 = false;          // the GPT's matrix products on TF32 tensor cores (CUDA only)
  int prefetch_depth = 0;     // 0 = the planner decides
  int grad_buckets = 0;       // pinned gradient buckets; 0 = the planner decides
  int optimizer_buffers = 0;  // optimizer pipeline buffers; 0 = the planner decides

  // --config FILE: a DeepSpeed-style JSON config applied before the other flags (tools/config.h).
  std::string config;
  // Settable from a config file only (optimizer.* and fp16.* of tools/config.h), except the
  // betas and eps (--beta1, --beta2, --eps).
  bool adam_decoupled_weight_decay = true;  // AdamW; false: Adam with L2 weight decay
  std::optional<double> adam_beta1;         // --beta1, optimizer.params.betas[0]
  std::optional<double> adam_beta2;         // --beta2
  std::optional<double> adam_eps;           // --eps
  bool adam_bias_correction = true;
  double sgd_dampening = 0;                // sgd (torch's dampening)
  bool sgd_nesterov = false;               // sgd
  double adagrad_lr_decay = 0;             // adagrad
  double adagrad_initial_accumulator = 0;  // adagrad initial_accumulator_value
  double adafactor_eps2 = 1e-3;            // adafactor: lower bound of RMS(p) (scale_parameter)
  bool adafactor_scale_parameter = false;  // adafactor: lr scaled by max(eps2, RMS(p))
  // DeepSpeed wall_clock_breakdown: a time line (seconds per part) with each progress line.
  bool wall_clock_breakdown = false;
  bool fp16_dynamic_loss_scale = true;
  double fp16_initial_scale = 65536.0;  // 2^16; the static scale when not dynamic
  int64_t fp16_scale_window = 1000;     // clean steps before the scale doubles
  double fp16_min_scale = 1.0;
  int fp16_hysteresis = 1;  // overflows before the scale is lowered (a DeepSpeed config: 2)
  bool fp16_consecutive_hysteresis = false;
  // What a config file mapped to no-ops or adjusted, one line each, printed by RunTrain.
  std::vector<std::string> config_notes;
  // NVMe I/O (io::IoBackendOptions): pieces in flight per call, piece size, posix threads.
  int io_queue_depth = 32;
  std::string io_block_size = "1MiB";
  int io_threads = 4;
  CheckpointFlags checkpoint;
  LoraFlags lora;  // --lora-* (tools/model_spec.h)
};

}  // namespace strata::tools
