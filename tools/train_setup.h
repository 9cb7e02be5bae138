// `strata train` before anything is allocated: the flags (after --config) turned into option
// structs in one place, then the model's shapes and the data, the plan chosen once, and the
// device. The training loop (tools/train_loop.h) reads these and no flag parsing of its own.
//
// Order of a run (tools/train_command.cc): TrainOptionsFromFlags (flags only, no file read) ->
// MetricsWriter::Create -> OpenModelAndData -> ChooseTrainPlan (engine::ChoosePlan, once:
// every auto option resolved there; printed) -> CreateTrainDevice -> engine::Engine::Create with
// the chosen plan (allocates, pins and initialises; plans nothing). The plan is printed from the
// model's shapes alone, before the engine spends minutes initialising a large model.
//
// Thread-safety: plain functions on values the caller owns; call them from one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "base/status.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "engine/engine.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/plan_choice.h"
#include "engine/plan/planner.h"
#include "engine/preference_objective.h"
#include "gpu/device.h"
#include "tools/device_select.h"
#include "tools/lr_schedule.h"
#include "tools/metrics.h"
#include "tools/model_spec.h"
#include "tools/train_flags.h"

namespace strata::tools {

// Where this process stands in a data-parallel job; the defaults are a process of its own.
struct RankInfo {
  int ranks = 1;
  int rank = 0;
  int local_rank = 0;          // {local_rank} in --nvme-path; the CUDA device ordinal
  bool data_parallel = false;  // launched by mpirun: the engine gets a communicator
};
RankInfo RankInfoOf(const comm::Communicator* world);  // world may be null

// The training loop's options (tools/train_loop.h), typed: the loop reads these and no flag.
struct TrainLoopOptions {
  int64_t steps = 300;  // optimizer steps of the whole run (a resumed run continues to it)
  int micro_batch_size = 1;
  int seq_len = 64;
  int grad_accum_steps = 1;           // per rank
  uint64_t seed = 1337;               // the data sampler's seed (xor a constant)
  int64_t log_every = 10;             // a progress line every N steps
  int64_t eval_every = 100;           // a validation pass every N steps; 0 = only at the end
  int eval_batches = 16;              // micro-batches per validation pass
  int64_t sample_bytes = 200;         // text sampled at the end; 0 = none
  bool wall_clock_breakdown = false;  // a time line with each progress line
  std::string trace_path;             // Chrome trace-event JSON written at the end; empty = none
  CheckpointFlags checkpoint;         // save directory, interval, retention, resume, save on signal
};

// Every option struct of a run, from the flags.
struct TrainOptions {
  // The flags as given, except: grad_accum_steps derived from --global-batch-size when given;
  // {rank} and {local_rank} in --nvme-path replaced; on ranks other than 0 the output paths
  // (--summary-json, --trace, the metrics) cleared, since rank 0 alone writes them.
  TrainFlags flags;
  RankInfo ranks;
  TrainLoopOptions loop;
  LrSchedule schedule;
  MetricsOptions metrics;
  // Everything but trace and comm (set by the caller and CreateTrainDevice); placement.ranks,
  // rank and data_parallel as Engine::Create sets them from the communicator. The fields left
  // auto hold their starting values (placement.device_budget_bytes 0 for an auto budget, the
  // schedule micro-batch-major, the update during backward off) until ChooseTrainPlan.
  engine::EngineOptions engine;
  // The options given as auto (--device-budget, --offload-params, --offload-optimizer,
  // --optimizer-device-fraction, --schedule, --update-during-backward): engine::ChoosePlan
  // resolves them, by fit and, with --machine, by predicted time (engine/plan/plan_choice.h).
  // An optimizer home given explicitly is the user's choice: no split unless one is given too.
  engine::PlanAuto automatic;
  // --copy-bandwidth and the CUDA ordinal (local rank: one process per GPU); trace unset.
  DeviceSelectOptions device;
  // --objective dpo, ipo or simpo (and engine.placement.objective's buffers); nullopt for sft.
  std::optional<engine::PreferenceOptions> preference;
};

// Flags -> options; reads no file and allocates nothing. I/O options are checked by
// io::ValidateIoBackendOptions alone, its message prefixed by the flag that gave the value.
// Errors: kInvalidArgument with one line naming the flag (--global-batch-size that does not
// divide, --precision, --offload-*, --io-*, --lr-schedule, --device, --copy-bandwidth or --tf32
// against --device, --resume latest without --save-dir, --optimizer, --device-budget, --schedule).
StatusOr<TrainOptions> TrainOptionsFromFlags(const TrainFlags& flags, const RankInfo& ranks);

// The model (shapes; a --model-dir's weights are read at Engine::Create) and the training data.
struct TrainInputs {
  ModelSpec spec;  // with --tokenizer appended to its tokenizer files (for checkpoints)
  std::unique_ptr<engine::Model> model;
  data::TrainingData data;
  // --precision auto: the model's (AutoPrecision) and why, for the caller to set and print.
  std::optional<DType> precision_auto;
  std::string precision_why;
};
// Errors: the model spec's and the data's (files, tokenizer), and kInvalidArgument for a
// --seq-len beyond the model's context.
StatusOr<TrainInputs> OpenModelAndData(const TrainOptions& options);

// The plan request of the run: its engine options, the fields left auto and the model's cost
// facts (CostInputsOf). `compare`: also the comparisons estimate prints (PlanRequest::compare).
engine::PlanRequest PlanRequestOf(const TrainOptions& options, const ModelSpec& spec,
                                  bool compare = false);

// Chooses the run's plan, once (engine::ChoosePlan with `machine`, which may be null), and sets
// options->engine.placement and update_during_backward to the values it resolved, so that
// Engine::Create(model, device, options->engine, choice.plan) runs it. Errors: ChoosePlan's.
StatusOr<engine::PlanChoice> ChooseTrainPlan(const engine::Model& model, const ModelSpec& spec,
                                             const engine::MachineProfile* machine,
                                             TrainOptions* options, bool compare = false);

// The device and, on a GPU in a data-parallel job, the NCCL communicator bootstrapped over
// `world` (which options->engine.comm then points at; `world` itself on the host backend).
// Both must outlive the engine. trace: not owned, outlives the device; may be null.
struct TrainDevice {
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<comm::Communicator> nccl;
};
// Errors: CreateDeviceFromFlag's, NCCL's, and kInvalidArgument for --copy-bandwidth on a GPU or
// --tf32 on the host backend.
StatusOr<TrainDevice> CreateTrainDevice(comm::Communicator* world, trace::TraceRecorder* trace,
                                        TrainOptions* options);

// Before Engine::Create: the device budget against the device's free memory (gpu::Device::
// MemoryInfo: on a GPU what other processes hold is not free; on the host backend the host's
// available memory, or HostDeviceOptions::memory_bytes), less what the backend takes beside the
// arena (DeviceMemoryInfo::outside_arena_bytes: CUDA's cuBLAS workspace). A budget given as a
// size must not exceed that; an `auto` budget (`budget_auto`) must plan no more than it
// (plan.device_total_bytes).
// Errors: kResourceExhausted, one line naming --device-budget, the budget (or what auto planned)
// and the free memory in GiB; the memory query's error.
Status CheckDeviceBudgetFits(gpu::Device& device, const engine::Plan& plan, bool budget_auto);

// Before Engine::Create: the plan's host memory (host_bytes + pinned_bytes, and on the host
// backend, whose device memory is host memory, the device arena too) against the address space
// this process may map (RLIMIT_AS, `ulimit -v`; none: nothing to check). A run that could not
// even allocate its plan is refused here, before it prints its first step's allocations fail.
// Errors: kResourceExhausted, one line with both sizes.
Status CheckPlanFitsAddressSpace(gpu::DeviceKind kind, const engine::Plan& plan);

}  // namespace strata::tools
