#include "tools/train_setup.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/exceptions.h"
#include "base/units.h"
#include "engine/checkpoint.h"
#include "io/io_backend.h"
#include "tools/optimizer_flags.h"
#include "tools/preference_training.h"
#include "tools/step_prediction.h"

namespace strata::tools {
namespace {

// `path` with {rank} and {local_rank} replaced.
std::string RankPath(std::string path, const RankInfo& ranks) {
  for (const auto& [key, value] : {std::pair<std::string, int>{"{rank}", ranks.rank},
                                   std::pair<std::string, int>{"{local_rank}", ranks.local_rank}}) {
    for (size_t at; (at = path.find(key)) != std::string::npos;) {
      path.replace(at, key.size(), std::to_string(value));
    }
  }
  return path;
}

// What the ranks change in the flags (TrainOptions::flags).
Status ApplyRanks(const RankInfo& ranks, TrainFlags* f) {
  if (f->global_batch_size > 0) {
    // Derived here, after the flags that override a config file and with the real ranks, so
    // that a file's train_batch_size holds with another --micro-batch-size (as DeepSpeed derives
    // the accumulation from train_batch_size and the micro-batch).
    const std::string global =
        f->global_batch_from_config
            ? fmt::format("the --config file's train_batch_size {}", f->global_batch_size)
            : fmt::format("--global-batch-size {}", f->global_batch_size);
    const int per_step = f->micro_batch_size * ranks.ranks;
    if (f->global_batch_size % per_step != 0) {
      return InvalidArgumentError(fmt::format(
          "{} is not a multiple of micro-batch size {} x {} rank{}: pick a multiple "
          "of {}",
          global, f->micro_batch_size, ranks.ranks, ranks.ranks == 1 ? "" : "s", per_step));
    }
    const int accum = f->global_batch_size / per_step;
    if (f->grad_accum_given && f->grad_accum_steps != accum) {
      return InvalidArgumentError(
          fmt::format("--grad-accum-steps {} contradicts {}: micro-batch size {} x {} rank{} x {} "
                      "accumulation steps is {}; give one of them",
                      f->grad_accum_steps, global, f->micro_batch_size, ranks.ranks,
                      ranks.ranks == 1 ? "" : "s", f->grad_accum_steps,
                      int64_t{per_step} * f->grad_accum_steps));
    }
    f->grad_accum_steps = accum;
  }
  if (ranks.rank != 0) {
    // Rank 0 alone writes the metrics.
    f->tensorboard_dir.clear();
    f->metrics_jsonl.clear();
    f->metrics_csv_dir.clear();
    f->summary_json.clear();
    f->trace.clear();
  }
  for (auto& p : f->nvme_paths) p = RankPath(p, ranks);
  return Status::Ok();
}

// Each I/O flag is checked on its own through io::ValidateIoBackendOptions (the other fields at
// their valid defaults), so that the error names the flag that gave the bad value.
Status ValidateIoFlags(const io::IoBackendOptions& io) {
  io::IoBackendOptions queue_depth, block_size, threads;
  queue_depth.queue_depth = io.queue_depth;
  block_size.block_size_bytes = io.block_size_bytes;
  threads.posix_threads = io.posix_threads;
  for (const auto& [flag, one] :
       {std::pair{"--io-queue-depth", queue_depth}, std::pair{"--io-block-size", block_size},
        std::pair{"--io-threads", threads}}) {
    const Status s = io::ValidateIoBackendOptions(one);
    if (!s.ok()) return s.WithContext(flag);
  }
  return io::ValidateIoBackendOptions(io);
}

StatusOr<io::IoBackendOptions> IoOptionsFromFlags(const TrainFlags& f) {
  io::IoBackendOptions io;
  STRATA_ASSIGN_OR_RETURN(io.kind, io::ParseBackendKind(f.io_backend));
  if (io.kind == io::BackendKind::kMemory) {
    return InvalidArgumentError("--io-backend memory is for tests; use auto, uring or posix");
  }
  io.queue_depth = f.io_queue_depth;
  io.posix_threads = f.io_threads;
  auto block_size = ParseSize(f.io_block_size);
  if (!block_size.ok()) return block_size.status().WithContext("--io-block-size");
  io.block_size_bytes = *block_size;
  STRATA_RETURN_IF_ERROR(ValidateIoFlags(io));
  return io;
}

// The flags that only one kind of device takes: --copy-bandwidth emulates a bus on the host
// backend, --tf32 selects a GPU's tensor cores. Checked against --device before a GPU is looked
// for (so the message is the same on machines with and without one), and against the device
// found for --device auto.
Status CheckFlagsForDevice(const TrainFlags& f, bool on_gpu, bool on_host) {
  if (on_gpu && f.copy_bandwidth > 0) {
    return InvalidArgumentError(
        "--copy-bandwidth throttles the host backend's emulated copies; a GPU copies at the speed "
        "of its bus. Drop the flag, or add --device host");
  }
  if (on_host && f.tf32) {
    return InvalidArgumentError(
        "--tf32 selects the GPU's TF32 tensor cores; the host backend computes in fp32. Drop the "
        "flag, or train on a GPU (--device cuda)");
  }
  return Status::Ok();
}

Status CheckDeviceFlags(const TrainFlags& f) {
  if (f.device != "auto" && f.device != "host" && f.device != "cuda") {
    return InvalidArgumentError(
        fmt::format("--device '{}' is not one of auto, host, cuda", f.device));
  }
  return CheckFlagsForDevice(f, f.device == "cuda", f.device == "host");
}

// --optimizer-device-fraction: a number in [0, 1].
StatusOr<double> ParseOptimizerDeviceFraction(const std::string& s) {
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || !(v >= 0 && v <= 1)) {
    return InvalidArgumentError(fmt::format(
        "--optimizer-device-fraction '{}' is not a number from 0 to 1 (the fraction of the "
        "parameters whose optimizer runs on the device)",
        s));
  }
  return v;
}

StatusOr<engine::PlacementOptions> PlacementFromFlags(const TrainFlags& f, const RankInfo& ranks) {
  engine::PlacementOptions p;
  // "auto": today's fixed choice unless the plan choice, with a machine profile, searches.
  p.param_home = engine::ParamHome::kNvme;
  // LoRA: the adapters are small and resident (engine/plan/planner.h), so their optimizer state and
  // update live on the device beside them, and nothing is written to NVMe in a step.
  p.optimizer_home =
      f.lora.rank > 0 ? engine::OptimizerHome::kDevice : engine::OptimizerHome::kNvme;
  if (f.offload_params != "auto") {
    STRATA_ASSIGN_OR_RETURN(p.param_home, engine::ParseParamHome(f.offload_params));
  }
  if (f.offload_optimizer != "auto") {
    STRATA_ASSIGN_OR_RETURN(p.optimizer_home, engine::ParseOptimizerHome(f.offload_optimizer));
  }
  if (f.optimizer_device_fraction != "auto") {
    STRATA_ASSIGN_OR_RETURN(p.optimizer_device_fraction,
                            ParseOptimizerDeviceFraction(f.optimizer_device_fraction));
  }
  if (p.optimizer_home == engine::OptimizerHome::kDevice && p.optimizer_device_fraction != 0 &&
      p.optimizer_device_fraction != 1) {
    return InvalidArgumentError(fmt::format(
        "--optimizer-device-fraction {} splits the optimizer between the device and a CPU home: "
        "give --offload-optimizer host or nvme for the CPU's share",
        f.optimizer_device_fraction));
  }
  p.streaming_slots = f.prefetch_depth > 0 ? f.prefetch_depth + 1 : 0;
  p.host_grad_buckets = f.grad_buckets;
  p.optimizer_buffers = f.optimizer_buffers;
  p.offload_activations = f.offload_activations;
  auto checkpointing = engine::ParseActivationCheckpointing(f.activation_checkpointing);
  if (!checkpointing.ok()) {
    return InvalidArgumentError(
        fmt::format("--activation-checkpointing '{}' is not one of auto, all, none",
                    f.activation_checkpointing));
  }
  p.activation_checkpointing = *checkpointing;
  p.nvme_paths = f.nvme_paths.empty() ? std::vector<std::string>{"."} : f.nvme_paths;
  p.ranks = ranks.ranks;
  p.rank = ranks.rank;
  p.data_parallel = ranks.data_parallel;
  return p;
}

// 0 for auto (the plan choice sets it once the model is known).
StatusOr<uint64_t> DeviceBudgetFromFlag(const std::string& flag) {
  if (flag == "auto") return uint64_t{0};
  STRATA_ASSIGN_OR_RETURN(uint64_t bytes, ParseSize(flag));
  if (bytes == 0) {
    return InvalidArgumentError(
        fmt::format("--device-budget '{}' is zero; give a size such as 64MiB", flag));
  }
  return bytes;
}

// --schedule: layer-major or micro-batch-major as given; auto: chosen with the plan.
Status ScheduleFromFlag(const TrainFlags& f, TrainOptions* o) {
  o->automatic.schedule = f.schedule == "auto";
  if (o->automatic.schedule) return Status::Ok();
  auto schedule = engine::ParseSchedule(f.schedule);
  if (!schedule.ok()) {
    return InvalidArgumentError(fmt::format(
        "--schedule '{}' is not one of auto, layer-major, micro-batch-major", f.schedule));
  }
  o->engine.placement.schedule = *schedule;
  return Status::Ok();
}

engine::LossScalerOptions LossScalerFromFlags(const TrainFlags& f) {
  engine::LossScalerOptions s;
  s.dynamic = f.fp16_dynamic_loss_scale;
  s.initial_scale = static_cast<float>(f.fp16_initial_scale);
  s.growth_interval = f.fp16_scale_window;
  s.min_scale = static_cast<float>(f.fp16_min_scale);
  s.hysteresis = f.fp16_hysteresis;
  s.consecutive_hysteresis = f.fp16_consecutive_hysteresis;
  return s;
}

// Everything but the I/O options, the placement, trace and comm.
StatusOr<engine::EngineOptions> EngineOptionsFromFlags(const TrainFlags& f) {
  engine::EngineOptions o;
  // auto: bf16 until OpenModelAndData knows the model (AutoPrecision).
  if (f.precision != "auto") {
    STRATA_ASSIGN_OR_RETURN(o.precision, ParseDType(f.precision));
  }
  o.micro_batch = {f.micro_batch_size, f.seq_len};
  o.grad_accum_steps = f.grad_accum_steps;
  o.loss_scaler = LossScalerFromFlags(f);
  o.grad_clip_norm = static_cast<float>(f.grad_clip);
  o.decay_norms_and_biases = f.decay_norms_and_biases;
  o.seed = f.seed;
  o.overlap = !f.no_overlap;
  // "auto": chosen with the plan (off until then).
  o.update_during_backward = f.update_during_backward == "on";
  return o;
}

TrainLoopOptions LoopFromFlags(const TrainFlags& f) {
  TrainLoopOptions l;
  l.steps = f.steps;
  l.micro_batch_size = f.micro_batch_size;
  l.seq_len = f.seq_len;
  l.grad_accum_steps = f.grad_accum_steps;
  l.seed = f.seed;
  l.log_every = f.log_every;
  l.eval_every = f.eval_every;
  l.eval_batches = f.eval_batches;
  l.sample_bytes = f.sample_bytes;
  l.wall_clock_breakdown = f.wall_clock_breakdown;
  l.trace_path = f.trace;
  l.checkpoint = f.checkpoint;
  return l;
}

MetricsOptions MetricsFromFlags(const TrainFlags& f) {
  MetricsOptions m;
  m.tensorboard_dir = f.tensorboard_dir;
  m.jsonl_path = f.metrics_jsonl;
  m.csv_dir = f.metrics_csv_dir;
  return m;
}

// The data options: --data resolved, and the model's tokenizer (ModelSpec::default_tokenizer) for
// text when the model is not byte-level and no --tokenizer is given.
data::TrainingDataOptions DataOptions(const TrainFlags& f, const ModelSpec& spec,
                                      const engine::Model& model) {
  data::TrainingDataOptions d;
  for (const auto& path : f.data) {
    std::error_code ec;
    // The default also works from outside the source tree.
    const bool from_source_dir = !std::filesystem::exists(path, ec) && path == TrainFlags{}.data[0];
    d.data.push_back(from_source_dir ? std::string(STRATA_SOURCE_DIR) + "/" + path : path);
  }
  d.val_data = f.val_data;
  d.tokenizer = f.tokenizer;
  if (d.tokenizer.empty() && !spec.byte_level()) d.tokenizer = spec.default_tokenizer();
  d.seq_len = f.seq_len;
  d.vocab_size = model.vocab_size();
  d.pack = f.pack;
  d.long_examples = f.long_examples == "skip"       ? data::LongExamples::kSkip
                    : f.long_examples == "truncate" ? data::LongExamples::kTruncate
                    : f.objective != "sft"          ? data::LongExamples::kRefuse
                                                    : data::LongExamples::kTruncate;
  d.micro_batch_size = f.micro_batch_size;
  return d;
}

}  // namespace

RankInfo RankInfoOf(const comm::Communicator* world) {
  if (!world) return {};
  return {world->world_size(), world->rank(), world->local_rank(), /*data_parallel=*/true};
}

StatusOr<TrainOptions> TrainOptionsFromFlags(const TrainFlags& flags, const RankInfo& ranks) {
  TrainOptions o;
  o.flags = flags;
  o.ranks = ranks;
  TrainFlags& f = o.flags;
  STRATA_RETURN_IF_ERROR(ApplyRanks(ranks, &f));
  STRATA_ASSIGN_OR_RETURN(o.engine, EngineOptionsFromFlags(f));
  STRATA_ASSIGN_OR_RETURN(o.engine.placement, PlacementFromFlags(f, ranks));
  STRATA_RETURN_IF_ERROR(ScheduleFromFlag(f, &o));
  if (f.eager_update) {
    return InvalidArgumentError(
        "--eager-update was replaced by --update-during-backward on (exact with clipping and fp16 "
        "too)");
  }
  if (f.update_during_backward == "on" && ranks.data_parallel) {
    return InvalidArgumentError(
        "--update-during-backward on needs one rank: with data parallelism a rank's update waits "
        "for the reduced gradient and the global norm (use off or auto)");
  }
  // auto: decided with the plan, by predicted time with a machine profile; never with data
  // parallelism or without overlap (engine/plan/plan_choice.h).
  o.automatic.update_during_backward = f.update_during_backward == "auto";
  STRATA_ASSIGN_OR_RETURN(o.engine.io, IoOptionsFromFlags(f));
  STRATA_ASSIGN_OR_RETURN(o.schedule, MakeLrSchedule(f));
  STRATA_RETURN_IF_ERROR(CheckDeviceFlags(f));
  if (f.checkpoint.resume == "latest" && f.checkpoint.save_dir.empty()) {
    return InvalidArgumentError("--resume latest needs --save-dir (the directory with 'latest')");
  }
  STRATA_ASSIGN_OR_RETURN(o.engine.optimizer, BuildOptimizer(f));
  STRATA_ASSIGN_OR_RETURN(o.engine.placement.device_budget_bytes,
                          DeviceBudgetFromFlag(f.device_budget));
  o.automatic.device_budget = f.device_budget == "auto";
  o.automatic.param_home = f.offload_params == "auto";
  o.automatic.optimizer_home = f.offload_optimizer == "auto";
  // An optimizer home given explicitly is the user's choice: no split unless one is given too.
  o.automatic.device_fraction =
      f.optimizer_device_fraction == "auto" && f.offload_optimizer == "auto";
  STRATA_ASSIGN_OR_RETURN(o.preference,
                          PreferenceOptionsFromFlags(f.objective, f.beta, f.label_smoothing,
                                                     f.simpo_gamma, f.rpo_alpha, f.cpo_alpha));
  if (o.preference) {
    o.engine.placement.objective.target_weights = true;
    o.engine.placement.objective.reference_forward =
        f.lora.rank > 0 && o.preference->uses_reference();
  }
  o.metrics = MetricsFromFlags(f);
  o.loop = LoopFromFlags(f);  // after ApplyRanks: accumulation steps and rank 0's outputs
  o.device.host.copy_bytes_per_second = f.copy_bandwidth;
  o.device.cuda_device_ordinal = ranks.local_rank;  // one process per GPU
  return o;
}

StatusOr<TrainInputs> OpenModelAndData(const TrainOptions& options) {
  const TrainFlags& f = options.flags;
  TrainInputs in;
  STRATA_ASSIGN_OR_RETURN(in.spec, ResolveModelSpec(f.model, f.model_dir));
  STRATA_RETURN_IF_ERROR(ApplyLoraFlags(f.lora, &in.spec));
  if (!f.checkpoint.resume.empty() && in.spec.lora.enabled()) {
    // A LoRA checkpoint holds adapters only: refused before anything is built when it was trained
    // over another base (its errors of reading are --resume's own, reported when it loads).
    const std::string path =
        f.checkpoint.resume == "latest" ? f.checkpoint.save_dir : f.checkpoint.resume;
    if (auto dir = engine::ResolveCheckpointDir(path); dir.ok()) {
      if (auto m = engine::ReadManifest(*dir); m.ok()) {
        STRATA_RETURN_IF_ERROR(CheckResumeBase(in.spec, m->trainer.model_json, *dir));
      }
    }
  }
  if (f.precision == "auto") in.precision_auto = AutoPrecision(in.spec, &in.precision_why);
  STRATA_ASSIGN_OR_RETURN(in.model, BuildModel(in.spec, /*load_weights=*/true, f.tf32));
  if (f.seq_len > in.model->max_seq_len()) {
    return InvalidArgumentError(fmt::format("--seq-len {} exceeds the model's context of {}",
                                            f.seq_len, in.model->max_seq_len()));
  }
  const data::TrainingDataOptions data_options = DataOptions(f, in.spec, *in.model);
  if (!f.tokenizer.empty()) STRATA_RETURN_IF_ERROR(UseTokenizer(f.tokenizer, &in.spec));
  STRATA_ASSIGN_OR_RETURN(in.data, data::OpenTrainingData(data_options));
  if (options.preference && !in.data.preference) {
    return InvalidArgumentError(fmt::format(
        "--objective {} needs preference data (`strata tokenize` of JSONL with \"prompt\", "
        "\"chosen\" and \"rejected\"); --data holds none",
        f.objective));
  }
  if (!options.preference && in.data.preference) {
    return InvalidArgumentError(
        "--data holds preference pairs: train them with --objective dpo, ipo or simpo");
  }
  return in;
}

engine::PlanRequest PlanRequestOf(const TrainOptions& options, const ModelSpec& spec,
                                  bool compare) {
  const engine::EngineOptions& o = options.engine;
  engine::PlanRequest r;
  r.precision = o.precision;
  r.micro_batch = o.micro_batch;
  r.grad_accum_steps = o.grad_accum_steps;
  r.optimizer = o.optimizer;
  r.placement = o.placement;
  r.update_during_backward = o.update_during_backward;
  r.overlap = o.overlap;
  r.automatic = options.automatic;
  const engine::CostInputs cost = CostInputsOf(spec, o.grad_accum_steps);
  r.num_layers = cost.num_layers;
  r.channels = cost.channels;
  r.compare = compare;
  return r;
}

StatusOr<engine::PlanChoice> ChooseTrainPlan(const engine::Model& model, const ModelSpec& spec,
                                             const engine::MachineProfile* machine,
                                             TrainOptions* options, bool compare) {
  STRATA_ASSIGN_OR_RETURN(
      engine::PlanChoice choice,
      engine::ChoosePlan(model, PlanRequestOf(*options, spec, compare), machine));
  options->engine.placement = choice.placement;
  options->engine.update_during_backward = choice.update_during_backward;
  return choice;
}

Status CheckDeviceBudgetFits(gpu::Device& device, const engine::Plan& plan, bool budget_auto) {
  STRATA_ASSIGN_OR_RETURN(const gpu::DeviceMemoryInfo m, device.MemoryInfo());
  const uint64_t asked = budget_auto ? plan.device_total_bytes : plan.device_budget_bytes;
  // The arena and, beside it, what the backend takes for itself (CUDA: the cuBLAS workspace); the
  // message's "free" is what is left for the arena.
  const uint64_t usable = m.free_bytes - std::min(m.outside_arena_bytes, m.free_bytes);
  if (asked <= usable) return Status::Ok();
  const auto gib = [](uint64_t b) { return static_cast<double>(b) / static_cast<double>(kGiB); };
  const std::string beside =
      m.outside_arena_bytes == 0
          ? std::string()
          : fmt::format("; {} MiB more are kept for the backend's own buffers",
                        (m.outside_arena_bytes + (1 << 20) - 1) >> 20);
  return ResourceExhaustedError(fmt::format(
      "{} {:.2f} GiB of device memory, more than the {:.2f} GiB free on the {} device (of {:.2f} "
      "GiB; other processes may hold the rest{}): give --device-budget {:.2f}GiB or less, or free "
      "the device",
      budget_auto ? "--device-budget auto planned" : "--device-budget is", gib(asked), gib(usable),
      gpu::DeviceKindName(device.kind()), gib(m.total_bytes), beside,
      std::floor(gib(usable) * 100) / 100));
}

Status CheckPlanFitsAddressSpace(gpu::DeviceKind kind, const engine::Plan& plan) {
  const uint64_t limit = AddressSpaceLimitBytes();
  if (limit == 0) return Status::Ok();
  const bool arena = kind == gpu::DeviceKind::kHost;
  const uint64_t needed =
      plan.host_bytes + plan.pinned_bytes + (arena ? plan.device_budget_bytes : 0);
  if (needed <= limit) return Status::Ok();
  return ResourceExhaustedError(fmt::format(
      "the plan needs {} of host memory ({} host, {} pinned{}), more than the {} this process's "
      "address space is limited to (ulimit -v): raise the limit or plan a smaller run",
      FormatBytes(needed), FormatBytes(plan.host_bytes), FormatBytes(plan.pinned_bytes),
      arena ? fmt::format(", {} device arena of the host backend",
                          FormatBytes(plan.device_budget_bytes))
            : std::string(),
      FormatBytes(limit)));
}

StatusOr<TrainDevice> CreateTrainDevice(comm::Communicator* world, trace::TraceRecorder* trace,
                                        TrainOptions* options) {
  const TrainFlags& f = options->flags;
  DeviceSelectOptions select = options->device;
  select.host.trace = trace;
  TrainDevice d;
  STRATA_ASSIGN_OR_RETURN(d.device, CreateDeviceFromFlag(f.device, select));
  // The collectives: MPI on the host backend, NCCL (bootstrapped over MPI) on a GPU.
  if (world) {
    options->engine.comm = world;
    if (d.device->kind() == gpu::DeviceKind::kCuda) {
      comm::CommOptions co;
      co.timeout_seconds = f.comm_timeout;
      co.cuda_device_ordinal = world->local_rank();
      STRATA_ASSIGN_OR_RETURN(d.nccl, comm::CreateNcclCommunicator(*world, co));
      options->engine.comm = d.nccl.get();
    }
  }
  // --device auto: the flags that only one kind of device takes, against the one found.
  const bool on_host = d.device->kind() == gpu::DeviceKind::kHost;
  STRATA_RETURN_IF_ERROR(CheckFlagsForDevice(f, !on_host, on_host));
  return d;
}

}  // namespace strata::tools
