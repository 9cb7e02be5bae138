// `strata train` before anything is allocated: the flags (after --config) turned into option
// structs in one place, then the model's shapes and the data, the device budget, the device and
// the plan. The training loop (tools/train_loop.h) reads these and no flag parsing of its own.
//
// Order of a run (tools/train_command.cc): TrainOptionsFromFlags (flags only, no file read) ->
// MetricsWriter::Create -> OpenModelAndData -> ResolveSchedule -> ResolvePlacement ->
// ResolveDeviceBudget -> ResolveUpdateDuringBackward -> CreateTrainDevice -> MakeTrainPlan
// (printed) -> engine::Engine::Create (allocates, pins and initialises) ->
// CheckSamePlan. The plan is printed from the model's shapes alone, before the engine spends
// minutes initialising a large model.
//
// Thread-safety: plain functions on values the caller owns; call them from one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "base/status.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "engine/cost_model.h"
#include "engine/engine.h"
#include "engine/machine_profile.h"
#include "engine/placement_search.h"
#include "engine/planner.h"
#include "gpu/device.h"
#include "tools/device_select.h"
#include "tools/lr_schedule.h"
#include "tools/metrics.h"
#include "tools/model_spec.h"
#include "tools/train_command.h"

namespace strata::tools {

// Where this process stands in a data-parallel job; the defaults are a process of its own.
struct RankInfo {
  int ranks = 1;
  int rank = 0;
  int local_rank = 0;          // {local_rank} in --nvme-path; the CUDA device ordinal
  bool data_parallel = false;  // launched by mpirun: the engine gets a communicator
};
RankInfo RankInfoOf(const comm::Communicator* world);  // world may be null

// Every option struct of a run, from the flags.
struct TrainOptions {
  // The flags as given, except: grad_accum_steps derived from --global-batch-size when given;
  // {rank} and {local_rank} in --nvme-path replaced; on ranks other than 0 the output paths
  // (--summary-json, --trace, the metrics) cleared, since rank 0 alone writes them.
  TrainFlags flags;
  RankInfo ranks;
  LrSchedule schedule;
  MetricsOptions metrics;
  // Everything but trace and comm (set by the caller and CreateTrainDevice); placement.ranks,
  // rank and data_parallel as Engine::Create sets them from the communicator.
  // placement.device_budget_bytes is 0 until ResolveDeviceBudget when auto_device_budget.
  engine::EngineOptions engine;
  bool auto_device_budget = false;  // --device-budget auto
  // --offload-params, --offload-optimizer, --optimizer-device-fraction auto: chosen by predicted
  // time with --machine (ResolvePlacement); without a profile, today's fixed choice (params and
  // optimizer state on NVMe, nothing on the device). The engine options hold that until then.
  engine::PlacementSearch placement_search{false, false, false, false};
  // --update-during-backward auto with one rank and overlap: decided by predicted time with
  // --machine (ResolveUpdateDuringBackward); off until then, and without a profile.
  bool auto_update_during_backward = false;
  // --schedule auto (the step's order of blocks and micro-batches, not the learning rate's) with
  // more than one micro-batch: decided by fit and, with --machine, predicted time
  // (ResolveSchedule); micro-batch-major until then.
  bool auto_schedule = false;
  // --copy-bandwidth and the CUDA ordinal (local rank: one process per GPU); trace unset.
  DeviceSelectOptions device;
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

// --device-budget auto: engine::AutoDeviceBudgetBytes of the model and the placement; a no-op
// for a budget given in bytes.
void ResolveDeviceBudget(const engine::Model& model, TrainOptions* options);

// The placement choices left "auto" (TrainOptions::placement_search), made by predicted time on
// `machine` (engine::ChoosePlacement: the fastest plan that fits the budgets; an auto device
// budget is the profile's device memory less 5 %, or each candidate's AutoDeviceBudgetBytes
// without a device section); sets options->engine.placement and returns the lines that say why
// (the choice and the runner-up), or, without a machine or with nothing auto, "" and no change.
// Errors: ChoosePlacement's when no candidate fits.
StatusOr<std::string> ResolvePlacement(const engine::Model& model, const ModelSpec& spec,
                                       const engine::MachineProfile* machine,
                                       TrainOptions* options);

// --update-during-backward auto (TrainOptions::auto_update_during_backward) with `machine`: on
// when the cost model predicts the plan's step at least 10 % shorter with it (the term is
// optimistic: it does not see the backup copies and the gradient fold contending for the cores,
// which made gpt2-1.5b's step 4 % longer on the H200 machine); returns the line that says so, or
// "" and off without a machine or when not auto. Errors: MakeTrainPlan's.
StatusOr<std::string> ResolveUpdateDuringBackward(const engine::Model& model, const ModelSpec& spec,
                                                  const engine::MachineProfile* machine,
                                                  TrainOptions* options);

// --schedule auto (TrainOptions::auto_schedule): layer-major when its plan fits
// (MakeSchedulePlan succeeds: each schedule with its own placement where that is auto; with
// --device-budget auto in the micro-batch-major plan's budget, which the layer-major run then
// keeps) and, with `machine`, the cost model predicts its step no longer than micro-batch-major's
// (each with the update during backward it would run with); else micro-batch-major. Sets
// options->engine.placement.schedule and returns the line that says why, or "" when not auto.
// Call first, before ResolvePlacement (which then places for the chosen schedule).
// Errors: none of its own (a plan that does not fit, or a profile that cannot predict, decides).
StatusOr<std::string> ResolveSchedule(const engine::Model& model, const ModelSpec& spec,
                                      const engine::MachineProfile* machine, TrainOptions* options);

// The plan the run of `options` (as TrainOptionsFromFlags made them: nothing resolved yet) would
// make with `schedule`, its auto choices made for that schedule as the run makes them: the
// placement (ResolvePlacement with `machine`, which may be null) and the device budget
// (ResolveDeviceBudget; for layer-major, the micro-batch-major plan's when that one fits). Errors:
// ResolvePlacement's and MakeTrainPlan's.
StatusOr<engine::Plan> MakeSchedulePlan(const engine::Model& model, const ModelSpec& spec,
                                        const engine::MachineProfile* machine, TrainOptions options,
                                        engine::Schedule schedule);

// The prediction of `plan` with the update during backward `options` would run it with: as set,
// or with --update-during-backward auto (TrainOptions::auto_update_during_backward) as
// ResolveUpdateDuringBackward would decide it for this plan. Errors: engine::PredictStep's.
StatusOr<engine::StepPrediction> PredictAsResolved(const engine::Plan& plan, const ModelSpec& spec,
                                                   const TrainOptions& options,
                                                   const engine::MachineProfile& machine);

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

// The plan Engine::Create will make from the same options: engine::MakePlan with the placement
// (ranks set as Engine::Create sets them), the micro-batch, the optimizer and the accumulation
// steps. Shapes only; allocates nothing. Errors: MakePlan's.
StatusOr<engine::Plan> MakeTrainPlan(const engine::Model& model,
                                     const engine::EngineOptions& options);

// kInternal when the engine's plan is not the one printed (a broken invariant: same inputs).
Status CheckSamePlan(const engine::Plan& printed, const engine::Plan& engine_plan);

}  // namespace strata::tools
