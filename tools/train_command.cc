#include "tools/train_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "base/dtype.h"
#include "base/trace.h"
#include "base/units.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "data/text_dataset.h"
#include "data/tokenizer.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "io/io_backend.h"
#include "tools/config.h"
#include "tools/device_select.h"
#include "tools/metrics.h"
#include "tools/model_spec.h"
#include "tools/mpi_launch.h"
#include "tools/optimizer_flags.h"
#include "tools/progress.h"

namespace strata::tools {

void AddTrainFlags(CLI::App& cmd, TrainFlags& f) {
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
                 "it); 90/10 train/val split unless --val-data")
      ->capture_default_str();
  cmd.add_option("--val-data", f.val_data, "Validation token files (or text with --tokenizer)");
  cmd.add_option("--tokenizer", f.tokenizer,
                 "SentencePiece model (tokenizer.model) for text data; default: the --model-dir's "
                 "tokenizer.model when the model is not byte-level");
  cmd.add_option("--model", f.model, "Model preset (random initialisation): " + PresetNames())
      ->capture_default_str();
  cmd.add_option("--model-dir", f.model_dir,
                 "Fine-tune a Hugging Face model directory (config.json + safetensors; Llama, "
                 "Mistral without sliding window, GPT-2)");
  cmd.add_option("--steps", f.steps, "Optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--micro-batch-size", f.micro_batch_size, "Sequences per micro-batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--seq-len", f.seq_len, "Tokens per sequence (<= the model's context)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--grad-accum-steps", f.grad_accum_steps,
                 "Micro-batches per optimizer step on each rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--global-batch-size", f.global_batch_size,
                 "Sequences per optimizer step over all data-parallel ranks (mpirun -n N): sets "
                 "the accumulation steps to it / (micro-batch size x N), which must divide")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--comm-timeout", f.comm_timeout,
                 "Seconds a collective waits for the other ranks before the job is aborted with "
                 "a line naming it (0 = no limit)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
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
      ->check(CLI::PositiveNumber);
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
                 "sgd, adagrad)")
      ->capture_default_str();
  cmd.add_option("--grad-clip", f.grad_clip, "Clip the global gradient norm to this; 0 = off")
      ->capture_default_str();
  cmd.add_option("--seed", f.seed, "Seed of initialisation, data order and sampling")
      ->capture_default_str();
  cmd.add_option("--precision", f.precision,
                 "Working params and gradients: bf16, fp16 (dynamic loss "
                 "scaling) or fp32")
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
         "Home of working params between uses: device (all resident), host (pinned) or nvme")
      ->capture_default_str();
  cmd.add_option("--offload-optimizer", f.offload_optimizer,
                 "Home of fp32 master weights and Adam m, v: host or nvme")
      ->capture_default_str();
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
  cmd.add_option("--summary-json", f.summary_json,
                 "Write the run's summary as one JSON object here");
  cmd.add_option("--eval-every", f.eval_every,
                 "Validation loss every N steps and at the end; 0 = off")
      ->capture_default_str();
  cmd.add_option("--eval-batches", f.eval_batches, "Micro-batches per validation pass")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--sample-bytes", f.sample_bytes, "Bytes of text to sample at the end; 0 = off")
      ->capture_default_str();
  cmd.add_option("--log-every", f.log_every, "Print a progress line every N steps")
      ->capture_default_str();
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
  cmd.add_option(
         "--copy-bandwidth", f.copy_bandwidth,
         "Host device only: throttle H2D/D2H copies to this many bytes/s (0 = memcpy speed)")
      ->capture_default_str();
  cmd.add_flag("--no-overlap", f.no_overlap,
               "Run the sequential pipeline: every load, kernel, copy, fold and block update "
               "finishes before the next starts (same numbers, for comparison)");
  cmd.add_flag("--eager-update", f.eager_update,
               "Update each block as soon as its gradients land, during backward (bf16/fp32 "
               "with --grad-clip 0 only)");
  cmd.add_flag("--tf32", f.tf32,
               "GPU only: the GPT's fp32 matrix products on TF32 tensor cores (10-bit mantissa "
               "inputs, fp32 accumulation; several times faster on Ampere/Hopper)");
  cmd.add_flag("--offload-activations", f.offload_activations,
               "Keep two block-boundary activations on the device and the rest in pinned host "
               "memory (D2H after forward, H2D one block ahead of backward)");
  cmd.add_option("--prefetch-depth", f.prefetch_depth,
                 "Blocks loaded ahead of the one computing (streaming slots - 1); 0 = the "
                 "planner decides (2 when the device budget holds the slots, else 1)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--grad-buckets", f.grad_buckets,
                 "Pinned gradient landing buckets (>= 2); 0 = the planner decides (3)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--optimizer-buffers", f.optimizer_buffers,
                 "Pinned buffers of the optimizer pipeline (read b+1, update b, write b-1); 0 = "
                 "the planner decides (3 with NVMe, else 1)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  AddCheckpointFlags(cmd, f.checkpoint);
}

namespace {

std::string ResolveData(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) || path != TrainFlags{}.data[0]) return path;
  // The default also works from outside the source tree.
  return std::string(STRATA_SOURCE_DIR) + "/" + path;
}

StatusOr<float> Evaluate(engine::Engine& e, const data::Dataset& data, const TrainFlags& f) {
  std::vector<int32_t> tokens, targets;
  double sum = 0;
  for (int i = 0; i < f.eval_batches; ++i) {
    data.ValBatch(i, f.eval_batches, f.micro_batch_size, f.seq_len, &tokens, &targets);
    STRATA_ASSIGN_OR_RETURN(float loss,
                            e.EvaluateLoss({tokens, targets}, {f.micro_batch_size, f.seq_len}));
    sum += loss;
  }
  return static_cast<float>(sum / f.eval_batches);
}

// A text sample of about f.sample_bytes bytes: byte-level tokens, or decoded by the tokenizer.
StatusOr<std::string> Sample(engine::Engine& e, const TrainFlags& f, std::mt19937_64& rng,
                             const data::Tokenizer* tokenizer) {
  std::vector<int32_t> context = data::TextDataset::Encode("\n");
  if (tokenizer) {
    context.clear();
    if (tokenizer->bos_id() >= 0) {
      context.push_back(tokenizer->bos_id());
    } else {
      STRATA_ASSIGN_OR_RETURN(context, tokenizer->Encode("\n"));
    }
  }
  std::vector<int32_t> sampled;
  std::string out;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double temperature = 0.8;
  while (static_cast<int64_t>(out.size()) < f.sample_bytes) {
    const size_t keep = std::min<size_t>(context.size(), f.seq_len);
    STRATA_ASSIGN_OR_RETURN(auto logits, e.NextTokenLogits(std::span(context).last(keep)));
    double maxv = -INFINITY;
    for (float l : logits) maxv = std::max<double>(maxv, l);
    std::vector<double> p(logits.size());
    double z = 0;
    for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp((logits[i] - maxv) / temperature);
    double r = uniform(rng) * z;
    size_t tok = 0;
    while (tok + 1 < p.size() && r >= p[tok]) r -= p[tok++];
    context.push_back(static_cast<int32_t>(tok));
    if (tokenizer) {
      if (static_cast<int>(tok) == tokenizer->eos_id()) break;
      sampled.push_back(static_cast<int32_t>(tok));
      STRATA_ASSIGN_OR_RETURN(out, tokenizer->Decode(sampled));
    } else {
      out.push_back(static_cast<char>(tok));
    }
  }
  return out;
}

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? char(c) : '?';
  return out;
}

}  // namespace

namespace {

// `path` with {rank} and {local_rank} replaced.
std::string RankPath(std::string path, const comm::Communicator* c) {
  for (const auto& [key, value] :
       {std::pair<std::string, int>{"{rank}", c ? c->rank() : 0},
        std::pair<std::string, int>{"{local_rank}", c ? c->local_rank() : 0}}) {
    for (size_t at; (at = path.find(key)) != std::string::npos;) {
      path.replace(at, key.size(), std::to_string(value));
    }
  }
  return path;
}

// What every rank must agree on (CheckSameOnAllRanks): the flags that shape the model, the data,
// the batch, the optimizer and the schedule.
std::string RankConfiguration(const TrainFlags& f) {
  return fmt::format(
      "model={} model_dir={} data={} val={} tokenizer={} precision={} mb={} seq={} accum={} "
      "global={} optimizer={} lr={} wd={} b1={} b2={} eps={} clip={} steps={} seed={} "
      "schedule={} warmup={} params={} optim_home={} fp16={}/{}/{}/{} eval={} save={} resume={}",
      f.model, f.model_dir, fmt::join(f.data, ","), fmt::join(f.val_data, ","), f.tokenizer,
      f.precision, f.micro_batch_size, f.seq_len, f.grad_accum_steps, f.global_batch_size,
      f.optimizer, f.lr, f.weight_decay, f.adam_beta1.value_or(-1), f.adam_beta2.value_or(-1),
      f.adam_eps.value_or(-1), f.grad_clip, f.steps, f.seed, f.lr_schedule, f.warmup_steps,
      f.offload_params, f.offload_optimizer, f.fp16_initial_scale, f.fp16_scale_window,
      f.fp16_hysteresis, f.fp16_min_scale, f.eval_every, f.checkpoint.save_dir,
      f.checkpoint.resume);
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
  if (!s.ok() && world->world_size() > 1) {
    std::fflush(stdout);
    comm::Abort(*world, fmt::format("error: {}", s.ToString()));
  }
  return s;
}

namespace {

Status RunTrainRanks(const TrainFlags& flags, comm::Communicator* world) {
  const auto t_start = std::chrono::steady_clock::now();
  const int ranks = world ? world->world_size() : 1;
  const int rank = world ? world->rank() : 0;
  TrainFlags f = flags;
  if (f.global_batch_size > 0) {
    const int per_step = f.micro_batch_size * ranks;
    if (f.global_batch_size % per_step != 0) {
      return InvalidArgumentError(fmt::format(
          "--global-batch-size {} is not a multiple of micro-batch size {} x {} rank{}: pick a "
          "multiple of {}",
          f.global_batch_size, f.micro_batch_size, ranks, ranks == 1 ? "" : "s", per_step));
    }
    f.grad_accum_steps = f.global_batch_size / per_step;
  }
  if (world) {
    STRATA_RETURN_IF_ERROR(
        comm::CheckSameOnAllRanks(*world, "the flags of strata train", RankConfiguration(flags)));
    if (rank != 0) {
      // Rank 0 alone writes the metrics.
      f.tensorboard_dir.clear();
      f.metrics_jsonl.clear();
      f.metrics_csv_dir.clear();
      f.summary_json.clear();
      f.trace.clear();
    }
  }
  // {rank} and {local_rank} are 0 in a process of its own.
  for (auto& p : f.nvme_paths) p = RankPath(p, world);
  STRATA_ASSIGN_OR_RETURN(DType precision, ParseDType(f.precision));
  STRATA_ASSIGN_OR_RETURN(auto param_home, engine::ParseParamHome(f.offload_params));
  STRATA_ASSIGN_OR_RETURN(auto optim_home, engine::ParseOptimizerHome(f.offload_optimizer));
  STRATA_ASSIGN_OR_RETURN(auto io_kind, io::ParseBackendKind(f.io_backend));
  STRATA_ASSIGN_OR_RETURN(const LrSchedule schedule, MakeLrSchedule(f));
  if (io_kind == io::BackendKind::kMemory) {
    return InvalidArgumentError("--io-backend memory is for tests; use auto, uring or posix");
  }
  if (f.device != "auto" && f.device != "host" && f.device != "cuda") {
    return InvalidArgumentError(
        fmt::format("--device '{}' is not one of auto, host, cuda", f.device));
  }
  if (f.checkpoint.resume == "latest" && f.checkpoint.save_dir.empty()) {
    return InvalidArgumentError("--resume latest needs --save-dir (the directory with 'latest')");
  }
  // Opened before the model is built, so that a bad metrics path fails at once.
  MetricsOptions metrics_options;
  metrics_options.tensorboard_dir = f.tensorboard_dir;
  metrics_options.jsonl_path = f.metrics_jsonl;
  metrics_options.csv_dir = f.metrics_csv_dir;
  STRATA_ASSIGN_OR_RETURN(auto metrics_writer, MetricsWriter::Create(metrics_options));
  STRATA_ASSIGN_OR_RETURN(ModelSpec spec, ResolveModelSpec(f.model, f.model_dir));
  STRATA_ASSIGN_OR_RETURN(auto model, BuildModel(spec, /*load_weights=*/true, f.tf32));
  if (f.seq_len > model->max_seq_len()) {
    return InvalidArgumentError(fmt::format("--seq-len {} exceeds the model's context of {}",
                                            f.seq_len, model->max_seq_len()));
  }
  data::TrainingDataOptions data_options;
  for (const auto& d : f.data) data_options.data.push_back(ResolveData(d));
  data_options.val_data = f.val_data;
  data_options.tokenizer = f.tokenizer;
  if (data_options.tokenizer.empty() && !spec.byte_level()) {
    for (const auto& file : spec.tokenizer_files) {
      if (std::filesystem::path(file).filename() == "tokenizer.model") {
        data_options.tokenizer = file;
      }
    }
  }
  if (!f.tokenizer.empty()) {
    spec.tokenizer_files.push_back(std::filesystem::absolute(f.tokenizer).string());
  }
  data_options.seq_len = f.seq_len;
  data_options.vocab_size = model->vocab_size();
  STRATA_ASSIGN_OR_RETURN(data::TrainingData training_data, data::OpenTrainingData(data_options));
  const data::Dataset& data = *training_data.dataset;
  const engine::MicroBatchShape mb{f.micro_batch_size, f.seq_len};

  engine::EngineOptions o;
  o.precision = precision;
  o.micro_batch = mb;
  o.grad_accum_steps = f.grad_accum_steps;
  STRATA_ASSIGN_OR_RETURN(o.optimizer, BuildOptimizer(f));
  o.loss_scaler.dynamic = f.fp16_dynamic_loss_scale;
  o.loss_scaler.initial_scale = static_cast<float>(f.fp16_initial_scale);
  o.loss_scaler.growth_interval = f.fp16_scale_window;
  o.loss_scaler.min_scale = static_cast<float>(f.fp16_min_scale);
  o.loss_scaler.hysteresis = f.fp16_hysteresis;
  o.loss_scaler.consecutive_hysteresis = f.fp16_consecutive_hysteresis;
  o.grad_clip_norm = static_cast<float>(f.grad_clip);
  o.seed = f.seed;
  o.io.kind = io_kind;
  o.io.queue_depth = f.io_queue_depth;
  o.io.posix_threads = f.io_threads;
  auto block_size = ParseSize(f.io_block_size);
  if (!block_size.ok()) return block_size.status().WithContext("--io-block-size");
  o.io.block_size_bytes = *block_size;
  if (f.io_queue_depth < 1 || f.io_queue_depth > 4096) {
    return InvalidArgumentError(
        fmt::format("--io-queue-depth {} is out of range: use 1..4096", f.io_queue_depth));
  }
  if (o.io.block_size_bytes == 0 || o.io.block_size_bytes % 4096 != 0 ||
      o.io.block_size_bytes > kGiB) {
    return InvalidArgumentError(
        fmt::format("--io-block-size '{}' must be a multiple of 4096 bytes between 4KiB and 1GiB",
                    f.io_block_size));
  }
  if (f.io_threads < 1 || f.io_threads > 256) {
    return InvalidArgumentError(
        fmt::format("--io-threads {} is out of range: use 1..256", f.io_threads));
  }
  o.placement.param_home = param_home;
  o.placement.optimizer_home = optim_home;
  o.placement.streaming_slots = f.prefetch_depth > 0 ? f.prefetch_depth + 1 : 0;
  o.placement.host_grad_buckets = f.grad_buckets;
  o.placement.optimizer_buffers = f.optimizer_buffers;
  o.overlap = !f.no_overlap;
  o.placement.offload_activations = f.offload_activations;
  o.eager_update = f.eager_update;
  o.placement.nvme_paths = f.nvme_paths.empty() ? std::vector<std::string>{"."} : f.nvme_paths;
  if (f.device_budget == "auto" && param_home == engine::ParamHome::kDevice) {
    // Every block resident: exactly what that takes.
    o.placement.device_budget_bytes = engine::AllResidentBytes(
        *model, precision, mb, f.offload_activations, ranks, world != nullptr);
  } else if (f.device_budget == "auto") {
    // Midway between the streaming minimum and the working params alone, so
    // some blocks stay resident and the rest really stream.
    const uint64_t minimum = engine::StreamingMinimumBytes(
        *model, precision, mb, f.prefetch_depth > 0 ? f.prefetch_depth + 1 : 2,
        f.offload_activations, ranks, world != nullptr);
    const uint64_t working = static_cast<uint64_t>(model->num_params()) * SizeOf(precision);
    o.placement.device_budget_bytes =
        working > minimum ? minimum + (working - minimum) / 2 : minimum;
  } else {
    STRATA_ASSIGN_OR_RETURN(o.placement.device_budget_bytes, ParseSize(f.device_budget));
    if (o.placement.device_budget_bytes == 0) {
      return InvalidArgumentError(
          fmt::format("--device-budget '{}' is zero; give a size such as 64MiB", f.device_budget));
    }
  }

  // Declared before the device and the engine, which record into it until they are destroyed.
  trace::TraceRecorder recorder(/*keep_events=*/!f.trace.empty());
  o.trace = &recorder;
  gpu::HostDeviceOptions dev_opts;
  dev_opts.copy_bytes_per_second = f.copy_bandwidth;
  dev_opts.trace = &recorder;
  // --copy-bandwidth emulates a bus on the host backend; checked before a GPU is looked for, so
  // the message is the same on machines with and without one.
  const Status throttle_on_gpu = InvalidArgumentError(
      "--copy-bandwidth throttles the host backend's emulated copies; a GPU copies at the speed "
      "of its bus. Drop the flag, or add --device host");
  if (f.device == "cuda" && f.copy_bandwidth > 0) return throttle_on_gpu;
  const Status tf32_on_host = InvalidArgumentError(
      "--tf32 selects the GPU's TF32 tensor cores; the host backend computes in fp32. Drop the "
      "flag, or train on a GPU (--device cuda)");
  if (f.device == "host" && f.tf32) return tf32_on_host;
  DeviceSelectOptions select;
  select.host = dev_opts;
  select.cuda_device_ordinal = world ? world->local_rank() : 0;  // one process per GPU
  STRATA_ASSIGN_OR_RETURN(auto device, CreateDeviceFromFlag(f.device, select));
  // The collectives: MPI on the host backend, NCCL (bootstrapped over MPI) on a GPU.
  std::unique_ptr<comm::Communicator> nccl;
  if (world) {
    o.comm = world;
    if (device->kind() == gpu::DeviceKind::kCuda) {
      comm::CommOptions co;
      co.timeout_seconds = f.comm_timeout;
      co.cuda_device_ordinal = world->local_rank();
      STRATA_ASSIGN_OR_RETURN(nccl, comm::CreateNcclCommunicator(*world, co));
      o.comm = nccl.get();
    }
  }
  if (device->kind() != gpu::DeviceKind::kHost && f.copy_bandwidth > 0) return throttle_on_gpu;
  if (device->kind() == gpu::DeviceKind::kHost && f.tf32) return tf32_on_host;
  std::printf("strata train: %s\n", model->description().c_str());
  for (const auto& note : f.config_notes) std::printf("config: %s\n", note.c_str());
  std::printf("%s; device: %s\n", data.Describe().c_str(), device->description().c_str());
  STRATA_ASSIGN_OR_RETURN(auto engine, engine::Engine::Create(model.get(), device.get(), o));
  std::printf("%s", engine->plan().Describe().c_str());
  std::printf(
      "  batch    %d x %d tokens per micro-batch, %d micro-batch%s per step%s; gradient "
      "clipping %s\n",
      f.micro_batch_size, f.seq_len, f.grad_accum_steps, f.grad_accum_steps == 1 ? "" : "es",
      ranks > 1
          ? fmt::format(" on each of {} ranks ({} sequences per step; {} over {})", ranks,
                        f.micro_batch_size * f.grad_accum_steps * ranks, o.comm->backend(), ranks)
                .c_str()
          : "",
      f.grad_clip > 0 ? fmt::format("at norm {:g}", f.grad_clip).c_str() : "off");
  std::printf("  lr       %s\n", DescribeLrSchedule(schedule).c_str());
  if (precision == DType::kF16) {
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
  if (!engine->io_backend_name().empty()) {
    const std::string_view backend = engine->io_backend_name();
    const std::string threads =
        backend == "posix"
            ? fmt::format(", {} thread{}", o.io.posix_threads, o.io.posix_threads == 1 ? "" : "s")
            : "";
    std::printf("  io       %s backend (block %s, queue depth %d%s), swap under %s\n",
                std::string(backend).c_str(), FormatBytes(o.io.block_size_bytes).c_str(),
                o.io.queue_depth, threads.c_str(),
                fmt::format("{}", fmt::join(o.placement.nvme_paths, ", ")).c_str());
  }
  std::fflush(stdout);

  std::mt19937_64 data_rng(f.seed ^ 0x5eedda7aull);
  const CheckpointFlags& ckpt = f.checkpoint;
  int64_t start_step = 0;
  if (!ckpt.resume.empty()) {
    STRATA_ASSIGN_OR_RETURN(start_step, ResumeTraining(*engine, ckpt, &data_rng));
  }
  std::string last_checkpoint;
  InstallStopSignalHandlers();
  std::vector<std::vector<int32_t>> toks(f.grad_accum_steps), tgts(f.grad_accum_steps);
  std::vector<engine::MicroBatch> batches(f.grad_accum_steps);
  std::vector<int32_t> skip_toks, skip_tgts;
  // Over every rank: the global batch.
  const int64_t tokens_per_step = mb.tokens() * f.grad_accum_steps * ranks;
  float loss_first = NAN, loss_last = NAN, val_loss = NAN;
  int64_t skipped = 0;
  const auto t_train = std::chrono::steady_clock::now();
  ProgressOptions progress_options;
  progress_options.mode = ProgressModeFor(::isatty(STDOUT_FILENO), ::isatty(STDERR_FILENO));
  progress_options.total_steps = f.steps;
  progress_options.log_every = f.log_every;
  progress_options.tokens_per_step = tokens_per_step;
  {
    const auto c = engine->counters();
    progress_options.start = {.bytes_h2d = c.bytes_h2d,
                              .bytes_d2h = c.bytes_d2h,
                              .nvme_bytes_read = c.nvme_bytes_read,
                              .nvme_bytes_written = c.nvme_bytes_written};
  }
  // Ends its live line with a newline on every way out of this function, errors included.
  ProgressLine progress(std::move(progress_options), stdout, stderr);
  double eval_seconds = 0;
  // Busy time per part over the training steps only (evaluation and sampling excluded).
  trace::Breakdown parts;
  trace::Breakdown parts_at_breakdown;  // --config wall_clock_breakdown: at the last time line
  double step_seconds_at_breakdown = 0;
  double step_seconds = 0;
  // Runs fn (a Step, or the Flush that ends the update a Step left running) as training time.
  auto timed = [&](auto&& fn) {
    const trace::Breakdown before = recorder.breakdown();
    const auto t0 = std::chrono::steady_clock::now();
    auto result = fn();
    step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const trace::Breakdown after = recorder.breakdown();
    for (int i = 0; i < trace::kNumCategories; ++i) {
      parts.seconds[i] += after.seconds[i] - before.seconds[i];
    }
    return result;
  };
  auto flush = [&] { return timed([&] { return engine->Flush(); }); };
  TrainMetrics metrics(metrics_writer.get(), {engine->counters(), parts, step_seconds});
  for (int64_t step = start_step; step < f.steps; ++step) {
    // The global batch is ranks x A micro-batches drawn in one order whatever the number of
    // ranks; rank r trains on micro-batches r*A .. r*A + A - 1 of it (a disjoint share), and
    // every rank's data_rng advances alike.
    for (int k = 0; k < ranks * f.grad_accum_steps; ++k) {
      const int i = k - rank * f.grad_accum_steps;
      if (i >= 0 && i < f.grad_accum_steps) {
        data.SampleTrainBatch(data_rng, mb.batch_size, mb.seq_len, &toks[i], &tgts[i]);
        batches[i] = {toks[i], tgts[i]};
      } else {
        data.SampleTrainBatch(data_rng, mb.batch_size, mb.seq_len, &skip_toks, &skip_tgts);
      }
    }
    // DeepSpeed's schedulers do not advance on a skipped (overflowed) step; Strata's cosine runs
    // by step number.
    const bool deepspeed_schedule =
        schedule.kind != LrScheduleKind::kCosine && schedule.kind != LrScheduleKind::kConstant;
    const float lr = static_cast<float>(
        LearningRateAt(schedule, deepspeed_schedule ? step - engine->skipped_steps() : step));
    engine->SetLearningRate(lr);
    STRATA_ASSIGN_OR_RETURN(auto r, timed([&] { return engine->Step(batches); }));
    if (step == start_step) loss_first = r.loss;
    loss_last = r.loss;
    skipped += r.skipped;
    STRATA_RETURN_IF_ERROR(metrics.RecordStep(step + 1, r, lr, tokens_per_step,
                                              {engine->counters(), parts, step_seconds}));
    {
      const auto c = engine->counters();
      progress.Update({.step = step + 1,
                       .loss = r.loss,
                       .grad_norm = r.grad_norm,
                       .lr = lr,
                       .skipped = r.skipped,
                       .bytes_h2d = c.bytes_h2d,
                       .bytes_d2h = c.bytes_d2h,
                       .nvme_bytes_read = c.nvme_bytes_read,
                       .nvme_bytes_written = c.nvme_bytes_written});
    }
    if (f.wall_clock_breakdown && f.log_every > 0 &&
        ((step + 1) % f.log_every == 0 || step + 1 == f.steps)) {
      // DeepSpeed's wall_clock_breakdown: busy seconds per part since the last such line.
      const auto pause = progress.Suspend();
      std::string line;
      for (int i = 0; i < trace::kNumCategories; ++i) {
        const auto cat = static_cast<trace::Category>(i);
        if (cat == trace::Category::kOther) continue;
        line += fmt::format("{}{} {:.3f}", line.empty() ? "" : ", ", trace::CategoryName(cat),
                            parts.seconds[i] - parts_at_breakdown.seconds[i]);
      }
      std::printf("time  step %5lld | %s s; step %.3f s\n", static_cast<long long>(step + 1),
                  line.c_str(), step_seconds - step_seconds_at_breakdown);
      std::fflush(stdout);
      parts_at_breakdown = parts;
      step_seconds_at_breakdown = step_seconds;
    }
    if (f.eval_every > 0 && (step + 1) % f.eval_every == 0 && step + 1 != f.steps) {
      const auto pause = progress.Suspend();
      STRATA_RETURN_IF_ERROR(flush());
      const auto t0 = std::chrono::steady_clock::now();
      STRATA_ASSIGN_OR_RETURN(float v, Evaluate(*engine, data, f));
      eval_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("step %5lld | val loss %.4f\n", static_cast<long long>(step + 1), v);
      STRATA_RETURN_IF_ERROR(metrics.RecordEvaluation(step + 1, v, engine->counters()));
    }
    const bool periodic = ckpt.save_every > 0 && (step + 1) % ckpt.save_every == 0;
    const bool stopping = StopSignal() != 0;
    if (!ckpt.save_dir.empty() &&
        (periodic || step + 1 == f.steps || (stopping && ckpt.save_on_signal))) {
      const auto pause = progress.Suspend();  // SaveTraining prints the checkpoint line
      STRATA_RETURN_IF_ERROR(flush());
      STRATA_ASSIGN_OR_RETURN(
          last_checkpoint, SaveTraining(*engine, ckpt,
                                        {step + 1, (step + 1) * tokens_per_step, &data_rng,
                                         LrScheduleJson(schedule, step + 1), ModelSpecJson(spec)}));
    }
    if (stopping) {
      return CancelledError(fmt::format(
          "stopped by signal {} after step {}; {}", StopSignal(), step + 1,
          !last_checkpoint.empty()
              ? "last checkpoint: " + last_checkpoint
              : std::string("no checkpoint saved (use --save-dir with --save-on-signal)")));
    }
  }
  progress.Finish();
  STRATA_RETURN_IF_ERROR(flush());  // the last step's update
  const double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_train).count() -
      eval_seconds;
  const auto counters = engine->counters();
  if (f.eval_every > 0) {
    STRATA_ASSIGN_OR_RETURN(val_loss, Evaluate(*engine, data, f));
    STRATA_RETURN_IF_ERROR(metrics.RecordEvaluation(f.steps, val_loss, engine->counters()));
    std::printf("validation loss %.4f nats/%s (uniform is %.2f)\n", val_loss,
                training_data.byte_level ? "byte" : "token",
                std::log(static_cast<double>(model->vocab_size())));
  }
  STRATA_ASSIGN_OR_RETURN(uint64_t master_hash, engine->MasterWeightsXxh3());
  if (f.sample_bytes > 0 && (training_data.byte_level || training_data.tokenizer)) {
    std::mt19937_64 sample_rng(f.seed ^ 0x5a3b1eull);
    STRATA_ASSIGN_OR_RETURN(std::string text,
                            Sample(*engine, f, sample_rng, training_data.tokenizer.get()));
    std::printf("sample:\n%s\n", Printable(text).c_str());
  }
  const double tps =
      static_cast<double>(tokens_per_step * (f.steps - start_step)) / std::max(train_seconds, 1e-9);
  // overlap_efficiency = the largest part / step time: 1.0 when everything else hides under it.
  nlohmann::json breakdown = nlohmann::json::object();
  double largest_part = 0;
  std::string parts_line;
  for (int i = 0; i < trace::kNumCategories; ++i) {
    const auto c = static_cast<trace::Category>(i);
    if (c == trace::Category::kOther) continue;
    breakdown[std::string(trace::CategoryName(c))] = parts.seconds[i];
    largest_part = std::max(largest_part, parts.seconds[i]);
    parts_line += fmt::format("{}{} {:.2f} s", parts_line.empty() ? "" : ", ",
                              trace::CategoryName(c), parts.seconds[i]);
  }
  breakdown["step"] = step_seconds;
  const double overlap_efficiency = step_seconds > 0 ? largest_part / step_seconds : 0.0;
  std::printf("time in steps %.2f s: %s; overlap efficiency %.2f (largest part / step time)\n",
              step_seconds, parts_line.c_str(), overlap_efficiency);
  if (!f.trace.empty()) {
    STRATA_RETURN_IF_ERROR(recorder.WriteChromeTrace(f.trace));
    std::printf("trace: %s (%zu events; open in https://ui.perfetto.dev or chrome://tracing)\n",
                f.trace.c_str(), recorder.num_events());
  }
  std::printf(
      "done: %lld steps in %.1f s, %.0f tokens/s, %lld skipped; device peak %s of %s; "
      "master weights xxh3 %016llx\n",
      static_cast<long long>(f.steps), train_seconds, tps, static_cast<long long>(skipped),
      FormatBytes(counters.device_peak_bytes).c_str(),
      FormatBytes(engine->plan().device_budget_bytes).c_str(),
      static_cast<unsigned long long>(master_hash));

  // Each rank's share (collective): rank 0 reports every rank's bytes.
  struct RankBytes {
    uint64_t nvme_read, nvme_written, host, host_grad, pinned, h2d, d2h, device_peak;
  };
  const auto& my_plan = engine->plan();
  const RankBytes mine{counters.nvme_bytes_read, counters.nvme_bytes_written, my_plan.host_bytes,
                       my_plan.host_grad_bytes,  counters.pinned_bytes,       counters.bytes_h2d,
                       counters.bytes_d2h,       counters.device_peak_bytes};
  std::vector<RankBytes> per_rank(ranks);
  if (world) {
    STRATA_RETURN_IF_ERROR(world->AllGatherBytes(std::as_bytes(std::span(&mine, 1)),
                                                 std::as_writable_bytes(std::span(per_rank))));
  } else {
    per_rank[0] = mine;
  }
  if (!f.summary_json.empty()) {
    auto num_or_null = [](float v) {
      return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
    };
    const auto& plan = engine->plan();
    nlohmann::json j = {
        {"steps", f.steps},
        {"tokens_per_second", tps},
        {"train_seconds", train_seconds},
        {"wall_seconds",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count()},
        {"loss_first", num_or_null(loss_first)},
        {"loss_last", num_or_null(loss_last)},
        {"val_loss", num_or_null(val_loss)},
        {"skipped_steps", skipped},
        {"loss_scale", engine->loss_scale()},
        {"device", std::string(gpu::DeviceKindName(device->kind()))},
        {"io_backend", engine->io_backend_name().empty()
                           ? nlohmann::json()
                           : nlohmann::json(engine->io_backend_name())},
        {"precision", DTypeName(precision)},
        {"param_home", std::string(engine::ParamHomeName(plan.param_home))},
        {"optimizer_home", plan.optimizer_home == engine::OptimizerHome::kHost ? "host" : "nvme"},
        {"optimizer", plan.optimizer_name},
        {"lr_schedule", nlohmann::json::parse(LrScheduleJson(schedule, f.steps))},
        {"grad_clip", f.grad_clip},
        {"loss_scale_hysteresis", f.fp16_hysteresis},
        {"tf32", f.tf32},
        {"model", spec.model_dir.empty() ? f.model : spec.model_dir},
        {"model_params", plan.model_params},
        {"model_state_bytes", plan.model_state_bytes},
        {"device_budget_bytes", plan.device_budget_bytes},
        {"device_peak_bytes", counters.device_peak_bytes},
        {"resident_blocks", plan.num_resident()},
        {"num_blocks", plan.blocks.size()},
        {"pinned_bytes", counters.pinned_bytes},
        {"bytes_h2d", counters.bytes_h2d},
        {"bytes_d2h", counters.bytes_d2h},
        {"nvme_bytes_read", counters.nvme_bytes_read},
        {"nvme_bytes_written", counters.nvme_bytes_written},
        {"master_weights_xxh3", fmt::format("{:016x}", master_hash)},
        {"master_xxh3", fmt::format("{:016x}", master_hash)},
        {"start_step", start_step},
        {"checkpoint",
         last_checkpoint.empty() ? nlohmann::json() : nlohmann::json(last_checkpoint)},
        {"micro_batch_size", f.micro_batch_size},
        {"seq_len", f.seq_len},
        {"grad_accum_steps", f.grad_accum_steps},
        {"seed", f.seed},
        {"time_breakdown", breakdown},
        {"overlap_efficiency", overlap_efficiency},
        {"global_batch_size", f.micro_batch_size * f.grad_accum_steps * ranks},
        {"comm_backend", world ? nlohmann::json(std::string(o.comm->backend())) : nlohmann::json()},
    };
    // Host figures per rank: host_bytes = host gradients + (optimizer home host) master weights
    // and optimizer state; host_optimizer_bytes is the latter.
    nlohmann::json rank_list = nlohmann::json::array();
    for (int r = 0; r < ranks; ++r) {
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
    j["ranks"] = rank_list;
    std::ofstream out(f.summary_json);
    out << j.dump(2) << "\n";
    out.close();
    if (!out) {
      return ErrnoToStatus(errno, fmt::format("writing --summary-json '{}'", f.summary_json));
    }
  }
  return Status::Ok();
}

}  // namespace

}  // namespace strata::tools
