#include "tools/estimate_command.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "base/cpu_info.h"
#include "base/dtype.h"
#include "base/units.h"
#include "engine/planner.h"
#include "tools/model_spec.h"
#include "tools/optimizer_flags.h"

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
  cmd.add_option("--device-budget", f.device_budget,
                 "Device memory for the whole arena, e.g. 24GiB (GB = 1e9 B, GiB = 2^30 B)")
      ->required();
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
      ->check(CLI::PositiveNumber);
  cmd.add_option("--seq-len", f.seq_len, "Tokens per sequence; 0 = the model's context")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--precision", f.precision, "Working params and gradients: bf16, fp16 or fp32")
      ->capture_default_str();
  cmd.add_option("--offload-params", f.offload_params, "device, host or nvme")
      ->capture_default_str();
  cmd.add_option("--offload-optimizer", f.offload_optimizer, "host or nvme")->capture_default_str();
  cmd.add_flag("--offload-activations", f.offload_activations,
               "Keep two block-boundary activations on the device, the rest in pinned memory");
  cmd.add_option("--prefetch-depth", f.prefetch_depth,
                 "Blocks loaded ahead of the one computing; 0 = the planner decides")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--grad-buckets", f.grad_buckets,
                 "Pinned gradient landing buckets (>= 2); 0 = the planner decides")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--optimizer-buffers", f.optimizer_buffers,
                 "Optimizer pipeline buffers; 0 = the planner decides")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--optimizer", f.optimizer,
                 "CPU optimizer, as strata train's: its state sets host or NVMe bytes")
      ->capture_default_str()
      ->check(CLI::IsMember({"adamw", "adam", "adamw8bit", "adafactor", "lion", "sgd", "adagrad"}));
  cmd.add_option("--grad-accum-steps", f.grad_accum_steps,
                 "Micro-batches per step; at 1 the host keeps 16-bit gradients, else fp32 "
                 "accumulators")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_flag("--json", f.json, "Print the plan as one JSON object");
}

Status RunEstimate(const EstimateFlags& f) {
  STRATA_ASSIGN_OR_RETURN(DType precision, ParseDType(f.precision));
  // Shapes only: a directory's config.json is enough (no weights are read).
  STRATA_ASSIGN_OR_RETURN(ModelSpec spec,
                          ResolveModelSpec(f.model, f.model_dir, /*config_only=*/true));
  STRATA_ASSIGN_OR_RETURN(auto model, BuildModel(spec, /*load_weights=*/false));
  const int seq_len = f.seq_len == 0 ? model->max_seq_len() : f.seq_len;
  if (seq_len > model->max_seq_len()) {
    return InvalidArgumentError(fmt::format("--seq-len {} exceeds the model's context of {}",
                                            seq_len, model->max_seq_len()));
  }
  engine::PlacementOptions o;
  STRATA_ASSIGN_OR_RETURN(o.param_home, engine::ParseParamHome(f.offload_params));
  STRATA_ASSIGN_OR_RETURN(o.optimizer_home, engine::ParseOptimizerHome(f.offload_optimizer));
  STRATA_ASSIGN_OR_RETURN(o.device_budget_bytes, ParseBudget("--device-budget", f.device_budget));
  o.offload_activations = f.offload_activations;
  o.streaming_slots = f.prefetch_depth > 0 ? f.prefetch_depth + 1 : 0;
  o.host_grad_buckets = f.grad_buckets;
  o.optimizer_buffers = f.optimizer_buffers;
  if (f.host_budget == "auto") {
    STRATA_ASSIGN_OR_RETURN(CpuInfo host, DetectCpuInfo());
    o.host_budget_bytes = host.mem_total_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(o.host_budget_bytes, ParseBudget("--host-budget", f.host_budget));
  }
  if (f.pinned_budget == "auto") {
    o.pinned_budget_bytes = o.host_budget_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(o.pinned_budget_bytes, ParseBudget("--pinned-budget", f.pinned_budget));
  }
  // Without a path the plan is still made (NVMe capacity unchecked), so that a user can size a
  // machine they do not have.
  o.nvme_paths = f.nvme_paths.empty() ? std::vector<std::string>{"(unchecked)"} : f.nvme_paths;
  if (!f.nvme_paths.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.nvme_capacity_bytes, NvmeFreeBytes(f.nvme_paths));
  }
  const engine::MicroBatchShape mb{f.micro_batch_size, seq_len};
  TrainFlags train;
  train.optimizer = f.optimizer;
  STRATA_ASSIGN_OR_RETURN(cpu_optim::AnyOptimizer optimizer, BuildOptimizer(train));
  STRATA_ASSIGN_OR_RETURN(engine::Plan plan,
                          engine::MakePlan(*model, precision, mb, o,
                                           engine::PlanOptimizer{optimizer, f.grad_accum_steps}));

  if (f.json) {
    const nlohmann::json j = {
        {"model", f.model_dir.empty() ? f.model : f.model_dir},
        {"model_params", plan.model_params},
        {"model_state_bytes", plan.model_state_bytes},
        {"feasible", true},
        {"precision", DTypeName(precision)},
        {"micro_batch_size", mb.batch_size},
        {"seq_len", mb.seq_len},
        {"num_blocks", plan.blocks.size()},
        {"resident_blocks", plan.num_resident()},
        {"streaming_slots", plan.streaming_slots},
        {"prefetch_depth", plan.prefetch_depth},
        {"device_grad_buckets", plan.device_grad_buckets},
        {"host_grad_buckets", plan.host_grad_buckets},
        {"optimizer_buffers", plan.optimizer_buffers},
        {"optimizer_buffer_bytes", plan.optimizer_buffer_bytes},
        {"offload_activations", plan.offload_activations},
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
    };
    std::printf("%s\n", j.dump(2).c_str());
    return Status::Ok();
  }
  std::printf("strata estimate: %s\n", model->description().c_str());
  std::printf("%s", plan.Describe().c_str());
  std::printf("verdict: feasible: device %s of %s, host %s of %s%s\n",
              FormatBytes(plan.device_total_bytes).c_str(),
              FormatBytes(plan.device_budget_bytes).c_str(),
              FormatBytes(plan.host_bytes + plan.pinned_bytes).c_str(),
              FormatBytes(o.host_budget_bytes).c_str(),
              f.nvme_paths.empty()
                  ? (plan.nvme_bytes > 0 ? ", NVMe free space unchecked (no --nvme-path)" : "")
                  : fmt::format(", NVMe {} of {} free", FormatBytes(plan.nvme_bytes),
                                FormatBytes(o.nvme_capacity_bytes))
                        .c_str());
  return Status::Ok();
}

}  // namespace strata::tools
