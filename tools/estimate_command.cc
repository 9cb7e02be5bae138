#include "tools/estimate_command.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "base/cpu_info.h"
#include "base/dtype.h"
#include "base/units.h"
#include "engine/plan/cost_model.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/optimizer_state.h"
#include "engine/plan/plan_choice.h"
#include "engine/plan/planner.h"
#include "tools/model_spec.h"
#include "tools/optimizer_flags.h"
#include "tools/option_flags.h"
#include "tools/run_destinations.h"
#include "tools/step_prediction.h"
#include "tools/train_setup.h"

namespace strata::tools {
namespace {

// Free bytes over the paths, each file system counted once.
StatusOr<uint64_t> NvmeFreeBytes(const std::vector<std::string>& paths) {
  std::set<dev_t> seen;
  uint64_t total = 0;
  for (const auto& path : paths) {
    struct stat st {};
    struct statvfs vfs {};
    if (::stat(path.c_str(), &st) != 0 || ::statvfs(path.c_str(), &vfs) != 0) {
      return ErrnoToStatus(errno, fmt::format("--nvme-path '{}'", path));
    }
    if (!S_ISDIR(st.st_mode)) {
      return InvalidArgumentError(fmt::format("--nvme-path '{}' is not a directory", path));
    }
    if (seen.insert(st.st_dev).second) {
      total += static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    }
  }
  return total;
}

// "1.2 GiB vs 2.4 GiB (0.50x)": a per-rank figure against one rank's.
std::string Versus(uint64_t per_rank, uint64_t one_rank) {
  return fmt::format("{} vs {}{}", FormatBytes(per_rank), FormatBytes(one_rank),
                     one_rank > 0 ? fmt::format(" ({:.2f}x)", static_cast<double>(per_rank) /
                                                                  static_cast<double>(one_rank))
                                  : "");
}

StatusOr<uint64_t> ParseBudget(const std::string& flag, const std::string& text) {
  STRATA_ASSIGN_OR_RETURN(uint64_t bytes, ParseSize(text));
  if (bytes == 0) {
    return InvalidArgumentError(
        fmt::format("{} '{}' is zero; give a size such as 24GiB", flag, text));
  }
  return bytes;
}

}  // namespace

void AddEstimateFlags(CLI::App& cmd, EstimateFlags& f) {
  cmd.add_option("--model,--preset", f.model, "Model preset: " + PresetNames())
      ->capture_default_str();
  cmd.add_option("--model-dir", f.model_dir,
                 "A Hugging Face model directory: the shapes of its config.json");
  cmd.add_option(
      "--device-budget", f.device_budget,
      "Device memory for the whole arena, e.g. 24GiB (GB = 1e9 B, GiB = 2^30 B), or auto "
      "as strata train's: midway between the streaming minimum and the working params "
      "(every block's needs with --offload-params device); default with --machine: 95 % of "
      "the profile's device memory (what an auto placement plans in)");
  cmd.add_option("--host-budget", f.host_budget,
                 "Host memory for pinned buffers, gradient accumulators and host-resident "
                 "optimizer state; auto = this machine's total memory")
      ->capture_default_str();
  cmd.add_option("--pinned-budget", f.pinned_budget,
                 "Pinned (page-locked) host memory; auto = the host budget")
      ->capture_default_str();
  cmd.add_option("--nvme-path", f.nvme_paths,
                 "Swap directories (repeatable); their free space is checked against the plan");
  cmd.add_option("--micro-batch-size", f.micro_batch_size, "Sequences per micro-batch")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--seq-len", f.seq_len, "Tokens per sequence; 0 = the model's context")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--precision", f.precision, "Working params and gradients: bf16, fp16 or fp32")
      ->capture_default_str();
  cmd.add_option("--optimizer-device-fraction", f.optimizer_device_fraction,
                 "GPU/CPU split: the fraction 0..1 of the parameters whose optimizer runs on the "
                 "device, or auto (with --machine: by predicted time; else 0)")
      ->capture_default_str();
  cmd.add_option("--offload-params", f.offload_params,
                 "device, host, nvme, or auto (with --machine: by predicted time; else nvme)")
      ->capture_default_str();
  cmd.add_option("--offload-optimizer", f.offload_optimizer,
                 "device, host, nvme, or auto (with --machine: by predicted time; else nvme)")
      ->capture_default_str();
  cmd.add_flag("--offload-activations", f.offload_activations,
               "Keep two block-boundary activations on the device, the rest in pinned memory");
  cmd.add_option("--activation-checkpointing", f.activation_checkpointing,
                 "Which layers recompute their forward in backward: all (every layer: the least "
                 "device memory), none (every layer keeps its forward's activations on the "
                 "device; refused if they do not fit), or auto (the last layers keep theirs while "
                 "the device budget left after the rest of the plan holds them)")
      ->check(CLI::IsMember({"auto", "all", "none"}))
      ->capture_default_str();
  AddLoraFlags(cmd, f.lora);
  cmd.add_option("--objective", f.objective,
                 "The training loss the plan is for: sft, or dpo, ipo, simpo (per-target losses "
                 "and weights; with --lora-rank and dpo or ipo, the reference forward's "
                 "activations)")
      ->check(CLI::IsMember({"sft", "dpo", "ipo", "simpo"}))
      ->capture_default_str();
  cmd.add_option("--prefetch-depth", f.prefetch_depth,
                 "Blocks loaded ahead of the one computing; 0 = the planner decides")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--grad-buckets", f.grad_buckets,
                 "Pinned gradient landing buckets (>= 2); 0 = the planner decides")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--optimizer-buffers", f.optimizer_buffers,
                 "Optimizer pipeline buffers; 0 = the planner decides")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--optimizer", f.optimizer,
                 "CPU optimizer, as strata train's: its state sets host or NVMe bytes")
      ->capture_default_str()
      ->check(CLI::IsMember({"adamw", "adam", "adamw8bit", "adafactor", "lion", "sgd", "adagrad"}));
  cmd.add_option("--grad-accum-steps", f.grad_accum_steps,
                 "Micro-batches per step; at 1 the host keeps 16-bit gradients, else fp32 "
                 "accumulators")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--schedule", f.schedule,
                 "As strata train's: layer-major, micro-batch-major, or auto (layer-major when its "
                 "plan fits micro-batch-major's budget and, with --machine, its predicted step is "
                 "not longer); with --machine "
                 "and more than one micro-batch both schedules' steps are shown")
      ->capture_default_str();
  cmd.add_option("--ranks", f.ranks,
                 "Data-parallel ranks (mpirun -n N): the plan of rank 0 of N, which keeps 1/N of "
                 "the master weights, optimizer state, host gradients and param homes, and a "
                 "comparison with one rank")
      ->capture_default_str();
  cmd.add_option("--ranks-per-machine", f.ranks_per_machine,
                 "Of --ranks, how many share one machine (mpirun -npernode; default: all of "
                 "them, one workstation): adds the machine's host and pinned memory, where a "
                 "LoRA/QLoRA frozen base is pinned once for all its ranks");
  cmd.add_flag("--json", f.json, "Print the plan as one JSON object");
  cmd.add_option("--machine", f.machine,
                 "A machine profile (JSON; `strata doctor --machine-profile FILE` writes one): "
                 "adds the predicted step time, its parts, what bounds it and tokens/s, and the "
                 "step with the optimizer on the device and with the best GPU/CPU split");
}

namespace {

// The `strata train` flags this estimate stands for: the plan comes from the same setup
// (tools/train_setup.h), so that it is the plan train prints for the same flags.
TrainFlags AsTrainFlags(const EstimateFlags& f, int seq_len) {
  TrainFlags t;
  t.model = f.model;
  t.model_dir = f.model_dir;
  t.micro_batch_size = f.micro_batch_size;
  t.seq_len = seq_len;
  t.grad_accum_steps = f.grad_accum_steps;
  t.schedule = f.schedule;
  t.precision = f.precision;
  t.optimizer = f.optimizer;
  t.device_budget = f.device_budget;
  t.offload_params = f.offload_params;
  t.offload_optimizer = f.offload_optimizer;
  t.optimizer_device_fraction = f.optimizer_device_fraction;
  t.offload_activations = f.offload_activations;
  t.activation_checkpointing = f.activation_checkpointing;
  t.prefetch_depth = f.prefetch_depth;
  t.grad_buckets = f.grad_buckets;
  t.optimizer_buffers = f.optimizer_buffers;
  t.lora = f.lora;
  t.objective = f.objective;
  // Without a path the plan is still made (NVMe capacity unchecked), so that a user can size a
  // machine they do not have.
  t.nvme_paths = f.nvme_paths.empty() ? std::vector<std::string>{"(unchecked)"} : f.nvme_paths;
  return t;
}

// The host, pinned and NVMe budgets (train does not check them; the estimate does).
Status SetHostBudgets(const EstimateFlags& f, engine::PlacementOptions* o) {
  if (f.host_budget == "auto") {
    STRATA_ASSIGN_OR_RETURN(CpuInfo host, DetectCpuInfo());
    o->host_budget_bytes = host.mem_total_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(o->host_budget_bytes, ParseBudget("--host-budget", f.host_budget));
  }
  if (f.pinned_budget == "auto") {
    o->pinned_budget_bytes = o->host_budget_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(o->pinned_budget_bytes,
                            ParseBudget("--pinned-budget", f.pinned_budget));
  }
  if (!f.nvme_paths.empty()) {
    STRATA_ASSIGN_OR_RETURN(o->nvme_capacity_bytes, NvmeFreeBytes(o->nvme_paths));
  }
  return Status::Ok();
}

// The estimate's inputs: rank 0's options of an N-rank job (with equal model and flags every
// rank's plan is the same but for the last ranks' possibly smaller partitions, so rank 0's needs
// bound every rank's), the model's shapes, and the plan chosen for them (with the comparisons
// estimate prints: engine::PlanRequest::compare).
struct EstimateSetup {
  TrainOptions options;  // as the choice resolved them
  ModelSpec spec;
  std::unique_ptr<engine::Model> model;
  engine::PlanChoice choice;
};

StatusOr<EstimateSetup> MakeEstimateSetup(const EstimateFlags& f,
                                          const engine::MachineProfile* profile) {
  if (f.ranks < 1) {
    return InvalidArgumentError(
        fmt::format("--ranks {} is not a number of ranks: give 1 or more (the process count of "
                    "mpirun -n)",
                    f.ranks));
  }
  if (f.ranks_per_machine < 0 || f.ranks_per_machine > f.ranks) {
    return InvalidArgumentError(fmt::format(
        "--ranks-per-machine {} must be between 1 and --ranks ({})", f.ranks_per_machine, f.ranks));
  }
  EstimateSetup e;
  // Shapes only: a directory's config.json is enough (no weights are read).
  STRATA_ASSIGN_OR_RETURN(e.spec, ResolveModelSpec(f.model, f.model_dir, /*config_only=*/true));
  STRATA_RETURN_IF_ERROR(ApplyLoraFlags(f.lora, &e.spec));
  STRATA_ASSIGN_OR_RETURN(e.model, BuildModel(e.spec, /*load_weights=*/false));
  const int seq_len = f.seq_len == 0 ? e.model->max_seq_len() : f.seq_len;
  if (seq_len > e.model->max_seq_len()) {
    return InvalidArgumentError(fmt::format("--seq-len {} exceeds the model's context of {}",
                                            seq_len, e.model->max_seq_len()));
  }
  if (f.device_budget != "auto") {  // estimate's own message: its budgets are workstation-sized
    STRATA_RETURN_IF_ERROR(ParseBudget("--device-budget", f.device_budget).status());
  }
  const RankInfo rank0{.ranks = f.ranks, .rank = 0, .data_parallel = f.ranks > 1};
  STRATA_ASSIGN_OR_RETURN(e.options, TrainOptionsFromFlags(AsTrainFlags(f, seq_len), rank0));
  // The host and pinned budgets first: the placement search must plan within them too.
  STRATA_RETURN_IF_ERROR(SetHostBudgets(f, &e.options.engine.placement));
  if (f.ranks > 1 && !engine::PartitionableOptimizer(e.options.engine.optimizer)) {
    return InvalidArgumentError(fmt::format(
        "--optimizer {} keeps state that does not split into per-rank partitions (block-wise or "
        "factored statistics); with --ranks above 1 use adamw, adam, lion, sgd or adagrad",
        f.optimizer));
  }
  STRATA_ASSIGN_OR_RETURN(e.choice,
                          ChooseTrainPlan(*e.model, e.spec, profile, &e.options, /*compare=*/true));
  // The planner checks the paths' free space summed; the swap store stripes each extent over
  // them, so each path must hold its own share (as strata train checks before it allocates).
  STRATA_RETURN_IF_ERROR(CheckNvmePathsHoldThePlan(f.nvme_paths, e.choice.plan));
  return e;
}

// One machine's share of an N-rank job: K ranks' host and pinned memory, the frozen base's pinned
// homes once (the ranks of a machine share them: engine/shared_frozen_base.h).
struct MachineMemory {
  int ranks = 1;
  uint64_t host_bytes = 0;
  uint64_t pinned_bytes = 0;
};
MachineMemory MachineMemoryOf(const EstimateFlags& f, const engine::Plan& plan) {
  MachineMemory m;
  m.ranks = f.ranks_per_machine == 0 ? f.ranks : f.ranks_per_machine;
  m.host_bytes = m.ranks * plan.host_bytes;
  m.pinned_bytes =
      m.ranks * (plan.pinned_bytes - plan.pinned_frozen_bytes) + plan.pinned_frozen_bytes;
  return m;
}

// The cost model's figures: step_s, tokens_per_s, bound, parts (seconds), bytes and notes.
nlohmann::json PredictionJson(const engine::StepPrediction& pr) {
  nlohmann::json parts = nlohmann::json::object();
  for (const auto& [name, s] : engine::PartList(pr.parts)) parts[std::string(name)] = s;
  return {{"step_s", pr.step_s},
          {"tokens_per_s", pr.tokens_per_s},
          {"bound", pr.bound},
          {"parts", parts},
          {"model_flops", pr.model_flops},
          {"h2d_bytes", pr.h2d_bytes},
          {"d2h_bytes", pr.d2h_bytes},
          {"nvme_read_bytes", pr.nvme_read_bytes},
          {"nvme_write_bytes", pr.nvme_write_bytes},
          {"notes", pr.notes}};
}

// Each schedule's prediction by name, with whether the plan takes it.
nlohmann::json SchedulesJson(const std::vector<engine::PlanAlternative>& schedules,
                             std::string_view taken) {
  nlohmann::json out = nlohmann::json::object();
  for (const engine::PlanAlternative& a : schedules) {
    nlohmann::json one = a.prediction ? PredictionJson(*a.prediction)
                                      : nlohmann::json{{"feasible", false}, {"why_not", a.why_not}};
    one["taken"] = a.name == taken;
    out[a.name] = std::move(one);
  }
  return out;
}

nlohmann::json PerMachineJson(const EstimateFlags& f, const engine::Plan& plan) {
  const MachineMemory m = MachineMemoryOf(f, plan);
  return {{"ranks", m.ranks}, {"host_bytes", m.host_bytes}, {"pinned_bytes", m.pinned_bytes}};
}

nlohmann::json EstimateJson(const EstimateFlags& f, const EstimateSetup& e, bool with_machine) {
  const engine::PlacementOptions& o = e.options.engine.placement;
  const engine::PlanChoice& c = e.choice;
  const engine::Plan& plan = c.plan;
  const std::optional<engine::Plan>& one_rank = c.one_rank;
  nlohmann::json j = {
      {"model", f.model_dir.empty() ? f.model : f.model_dir},
      {"model_params", plan.model_params},
      {"model_state_bytes", plan.model_state_bytes},
      {"feasible", true},
      {"precision", DTypeName(plan.precision)},
      {"micro_batch_size", plan.shape.batch_size},
      {"seq_len", plan.shape.seq_len},
      {"num_blocks", plan.blocks.size()},
      {"resident_blocks", plan.num_resident()},
      {"streaming_slots", plan.streaming_slots},
      {"prefetch_depth", plan.prefetch_depth},
      {"param_home", std::string(engine::ParamHomeName(plan.param_home))},
      {"optimizer_home", plan.device_optimizer_params == plan.model_params
                             ? std::string("device")
                             : std::string(engine::OptimizerHomeName(plan.optimizer_home))},
      {"optimizer_device_fraction", plan.optimizer_device_fraction()},
      {"placement_choice", InFlagTerms(c.placement_reason)},
      {"update_during_backward", e.options.engine.update_during_backward},
      {"schedule", std::string(engine::ScheduleName(plan.schedule))},
      {"schedule_choice", InFlagTerms(c.schedule_reason)},
      {"held_micro_batches", plan.held_micro_batches},
      {"device_grad_buckets", plan.device_grad_buckets},
      {"host_grad_buckets", plan.host_grad_buckets},
      {"optimizer_buffers", plan.optimizer_buffers},
      {"optimizer_buffer_bytes", plan.optimizer_buffer_bytes},
      {"offload_activations", plan.offload_activations},
      {"activation_checkpointing",
       std::string(engine::ActivationCheckpointingName(plan.activation_checkpointing))},
      {"activation_checkpointing_choice", InFlagTerms(c.activation_checkpointing_reason)},
      {"recomputing_blocks", plan.num_recomputing()},
      {"kept_activation_blocks", plan.num_keeping_activations()},
      {"kept_activation_bytes", plan.kept_activation_bytes()},
      {"device_budget_bytes", plan.device_budget_bytes},
      {"device_total_bytes", plan.device_total_bytes},
      {"pinned_bytes", plan.pinned_bytes},
      {"host_bytes", plan.host_bytes},
      {"host_grad_bytes", plan.host_grad_bytes},
      {"grad_accum_steps", f.grad_accum_steps},
      {"optimizer", plan.optimizer_name},
      {"optimizer_state_bytes", plan.optimizer_state_bytes},
      {"host_budget_bytes", o.host_budget_bytes},
      {"nvme_bytes", plan.nvme_bytes},
      {"nvme_free_bytes",
       f.nvme_paths.empty() ? nlohmann::json() : nlohmann::json(o.nvme_capacity_bytes)},
      {"ranks", plan.ranks},
      {"rank", plan.rank},
      {"pinned_frozen_bytes", plan.pinned_frozen_bytes},
      {"per_machine", PerMachineJson(f, plan)},
      {"data_parallel", plan.data_parallel},
      {"one_rank", one_rank ? nlohmann::json{{"device_total_bytes", one_rank->device_total_bytes},
                                             {"pinned_bytes", one_rank->pinned_bytes},
                                             {"host_bytes", one_rank->host_bytes},
                                             {"host_grad_bytes", one_rank->host_grad_bytes},
                                             {"nvme_bytes", one_rank->nvme_bytes}}
                            : nlohmann::json()},
      {"planning", PlanningJson()},
  };
  if (with_machine && !c.prediction) {
    j["machine"] = f.machine;
    j["prediction_error"] = c.prediction_error;
  } else if (with_machine) {
    j["machine"] = f.machine;
    j.update(PredictionJson(*c.prediction));
    nlohmann::json alts = nlohmann::json::array();
    for (const engine::PlanAlternative& a : c.optimizer_alternatives) {
      nlohmann::json alt = {{"optimizer", a.name},
                            {"device_fraction", a.device_fraction},
                            {"device_budget_bytes", a.device_budget_bytes}};
      if (a.prediction) {
        alt.update(PredictionJson(*a.prediction));
      } else {
        alt["feasible"] = false;
        alt["why_not"] = a.why_not;
      }
      alts.push_back(std::move(alt));
    }
    j["alternatives"] = std::move(alts);
    j["schedules"] = SchedulesJson(c.schedules, engine::ScheduleName(plan.schedule));
  }
  return j;
}

void PrintEstimate(const EstimateFlags& f, const EstimateSetup& e, bool with_machine) {
  const engine::PlacementOptions& o = e.options.engine.placement;
  const engine::PlanChoice& c = e.choice;
  const engine::Plan& plan = c.plan;
  const std::optional<engine::Plan>& one_rank = c.one_rank;
  std::printf("strata estimate: %s\n", e.model->description().c_str());
  std::printf("%s", InFlagTerms(plan.Describe()).c_str());
  std::printf("%s", InFlagTerms(c.Reasons()).c_str());
  if (one_rank) {
    // Host gradients are fp32 on every rank of a data-parallel run, 16-bit on one rank at
    // --grad-accum-steps 1 (planner.h), so the host figure halves only from 2 micro-batches on.
    std::printf("per rank vs one rank: host %s, pinned %s, NVMe %s, device %s\n",
                Versus(plan.host_bytes, one_rank->host_bytes).c_str(),
                Versus(plan.pinned_bytes, one_rank->pinned_bytes).c_str(),
                Versus(plan.nvme_bytes, one_rank->nvme_bytes).c_str(),
                Versus(plan.device_total_bytes, one_rank->device_total_bytes).c_str());
  }
  if (f.ranks > 1) {
    const MachineMemory m = MachineMemoryOf(f, plan);
    std::printf("per machine of %d ranks: host %s, pinned %s%s\n", m.ranks,
                FormatBytes(m.host_bytes).c_str(), FormatBytes(m.pinned_bytes).c_str(),
                m.ranks > 1 && plan.pinned_frozen_bytes > 0
                    ? fmt::format(" (the frozen base's {} once, shared by the machine's ranks)",
                                  FormatBytes(plan.pinned_frozen_bytes))
                          .c_str()
                    : "");
  }
  std::printf("verdict: feasible%s: device %s of %s, host %s of %s%s\n",
              f.ranks > 1 ? fmt::format(" on each of {} ranks", f.ranks).c_str() : "",
              FormatBytes(plan.device_total_bytes).c_str(),
              FormatBytes(plan.device_budget_bytes).c_str(),
              FormatBytes(plan.host_bytes + plan.pinned_bytes).c_str(),
              FormatBytes(o.host_budget_bytes).c_str(),
              f.nvme_paths.empty()
                  ? (plan.nvme_bytes > 0 ? ", NVMe free space unchecked (no --nvme-path)" : "")
                  : fmt::format(", NVMe {} of {} free", FormatBytes(plan.nvme_bytes),
                                FormatBytes(o.nvme_capacity_bytes))
                        .c_str());
  if (with_machine && c.prediction) {
    std::printf("%s", DescribeStepPrediction(*c.prediction, c.optimizer_alternatives,
                                             plan.device_budget_bytes)
                          .c_str());
    std::printf("%s", DescribeSchedules(c.schedules, engine::ScheduleName(plan.schedule)).c_str());
  } else if (with_machine) {
    std::printf("step time: not predicted: %s\n", InFlagTerms(c.prediction_error).c_str());
  } else {
    std::printf(
        "step time: not predicted; --machine FILE (a machine profile, `strata doctor "
        "--machine-profile FILE` writes one) adds the predicted step, its parts, what bounds it "
        "and tokens/s\n");
  }
}

}  // namespace

Status RunEstimate(const EstimateFlags& flags) {
  EstimateFlags f = flags;
  std::optional<engine::MachineProfile> profile;
  if (!f.machine.empty()) {
    STRATA_ASSIGN_OR_RETURN(profile, engine::ReadMachineProfile(f.machine));
  }
  if (f.device_budget.empty()) {
    if (!profile || !profile->device) {
      return InvalidArgumentError(
          "--device-budget is required: give a size such as 24GiB or auto (with --machine FILE "
          "whose profile has a device, 95 % of its memory is the default)");
    }
    f.device_budget = fmt::format("{}", engine::MachineDeviceBudgetBytes(*profile));
  }
  STRATA_ASSIGN_OR_RETURN(EstimateSetup e, MakeEstimateSetup(f, profile ? &*profile : nullptr));
  if (f.json) {
    std::printf("%s\n", EstimateJson(f, e, profile.has_value()).dump(2).c_str());
  } else {
    PrintEstimate(f, e, profile.has_value());
  }
  return Status::Ok();
}

}  // namespace strata::tools
