// `strata estimate`: the planner's verdict for a model shape and budgets, without training
// (docs/ARCHITECTURE.md, "Planner"): the same plan `strata train` prints, or the same error when a
// budget is short. With --ranks N the plan is rank 0's of N data-parallel ranks (what each rank
// of `mpirun -n N strata train` needs), followed by a comparison with one rank. With --machine
// FILE, the predicted step time of that plan on that machine (tools/step_prediction.h), and with
// more than one micro-batch that of both schedules (layer-major, micro-batch-major) and which it
// takes.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "tools/model_spec.h"

namespace strata::tools {

struct EstimateFlags {
  std::string model = "small";
  std::string model_dir;  // a Hugging Face directory (config.json) instead of a preset
  // A size, or auto as strata train's; required unless `machine` has a device section, whose
  // memory is then the default.
  std::string device_budget;
  std::string host_budget = "auto";     // auto: this machine's total memory
  std::string pinned_budget = "auto";   // auto: the host budget
  std::vector<std::string> nvme_paths;  // free space is checked when given
  int micro_batch_size = 1;
  int seq_len = 0;  // 0: the model's context
  std::string precision = "bf16";
  // As strata train's: "auto" is chosen by predicted time with --machine, else nvme and 0.
  std::string offload_params = "auto";
  std::string offload_optimizer = "auto";
  std::string optimizer_device_fraction = "auto";
  bool offload_activations = false;
  std::string activation_checkpointing = "auto";  // --activation-checkpointing, as train's
  int prefetch_depth = 0;                         // 0: the planner decides
  int grad_buckets = 0;                           // 0: the planner decides
  int optimizer_buffers = 0;                      // 0: the planner decides
  std::string optimizer = "adamw";                // as strata train --optimizer
  int grad_accum_steps = 1;                       // 1: host gradients stay 16-bit (planner.h)
  // As strata train's --schedule: layer-major, micro-batch-major or auto (chosen with the plan,
  // engine/plan/plan_choice.h). With --machine and more than one micro-batch both are predicted.
  std::string schedule = "auto";
  int ranks = 1;  // data-parallel ranks (>= 1); > 1 plans rank 0 of them
  // Of them, the ranks on one machine (1..ranks; 0: all, one workstation): the per-machine host
  // and pinned figures, the frozen base's pinned copy counted once (engine/shared_frozen_base.h).
  int ranks_per_machine = 0;
  bool json = false;
  // A machine profile (engine/plan/machine_profile.h): adds the predicted step, its parts, what
  // bounds it and tokens/s (engine/plan/cost_model.h), and the step with the optimizer on the
  // device and with the best GPU/CPU split.
  std::string machine;
  LoraFlags lora;  // --lora-*: the plan of a LoRA run (frozen base, adapters trained)
  // --objective: a preference objective's buffers in the plan (with LoRA, the reference forward).
  std::string objective = "sft";
};

void AddEstimateFlags(CLI::App& cmd, EstimateFlags& f);
// Prints the plan; a non-OK Status (bad flags, a budget that is short) is printed by main.
Status RunEstimate(const EstimateFlags& f);

}  // namespace strata::tools
