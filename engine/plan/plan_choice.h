// The one author of a plan (DESIGN.md, "Planner"): a request whose placement fields may each be
// `auto`, the model and an optional machine profile in; the chosen plan, the options it was made
// with and the reasons to print out. Every front end asks here (the CLI's train, estimate, eval
// and generate; the C++ package; the C API), and nothing downstream plans again:
// Engine::Create takes the chosen plan (engine/engine.h).
//
// The choices, in this order, each made once:
//   1. schedule (auto with more than one micro-batch): layer-major when its plan fits the budget
//      the micro-batch-major plan gets and, with a machine, its predicted step is not longer
//      (each schedule planned with its own placement where that is auto, and predicted with the
//      update during backward it would run with); else micro-batch-major.
//   2. placement (param home, optimizer home, device fraction; with a machine only): the fastest
//      plan that fits, among ChoosePlacement's candidates (engine/plan/placement_search.h); an
//      auto device budget is then the profile's device memory less 5 %, or each candidate's own
//      (AutoDeviceBudgetBytes) without a device section. Without a machine: the fixed default
//      (the request's values).
//   3. device budget (auto, when the placement did not set it): AutoDeviceBudgetBytes.
//   4. update during backward (auto, one rank, overlap, with a machine): on when the cost model
//      predicts the step at least 10 % shorter with it (the term is optimistic: it does not see
//      the backup copies and the gradient fold contending for the cores, which made gpt2-1.5b's
//      step 4 % longer on an H200); else off.
//   5. activation checkpointing (placement.activation_checkpointing kAuto): resolved by MakePlan
//      for the chosen plan (engine/plan/planner.h, ActivationCheckpointing): the blocks whose
//      activation stores fit in the budget the rest of the plan leaves keep their activations.
//
// Thread-safety: ChoosePlan is a pure function of its arguments (it reads no file and only adds
// to the planning counters, engine/plan/planner.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/plan/cost_model.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"

namespace strata::engine {

// The choices a request leaves to ChoosePlan; each false field is taken as the request gives it.
struct PlanAuto {
  bool schedule = false;  // placement.schedule; only decided with grad_accum_steps > 1
  bool param_home = false;
  bool optimizer_home = false;
  // The GPU/CPU split (placement.optimizer_device_fraction), when the optimizer home is host or
  // nvme.
  bool device_fraction = false;
  bool device_budget = false;  // placement.device_budget_bytes (ignored in the request)
  // Only decided with one rank (no data_parallel) and overlap, with a machine; off otherwise.
  bool update_during_backward = false;
};

struct PlanRequest {
  DType precision = DType::kBF16;
  MicroBatchShape micro_batch;
  int grad_accum_steps = 1;
  cpu_optim::AnyOptimizer optimizer;  // AdamW by default
  // Budgets, homes, NVMe paths, schedule, ranks: the values of the fields that are not auto
  // (and the starting point of those that are).
  PlacementOptions placement;
  bool update_during_backward = false;  // when not auto
  bool overlap = true;                  // EngineOptions::overlap
  PlanAuto automatic;
  // The model facts the cost model needs beyond the plan (layers and attention width); read only
  // with a machine profile.
  int num_layers = 0;
  int channels = 0;
  // Also compute what estimate prints beside the choice: with ranks > 1 the one-rank plan of the
  // same run; with a machine the optimizer alternatives and each schedule's predicted step.
  bool compare = false;
};

// A plan the choice compared against, and what it would take.
struct PlanAlternative {
  // "device", "split" (the optimizer alternatives), or a ScheduleName.
  std::string name;
  double device_fraction = 0;  // of the parameters whose optimizer runs on the device
  // The device budget it was planned in: the optimizer alternatives take the profile's whole
  // device memory, which may be more than the run's --device-budget.
  uint64_t device_budget_bytes = 0;
  std::optional<StepPrediction> prediction;  // absent when the plan is infeasible
  std::string why_not;  // the planner's or the cost model's reason, when absent
};

struct PlanChoice {
  Plan plan;
  // The options the plan was made with, every auto field resolved: what EngineOptions::placement
  // and EngineOptions::update_during_backward must hold for Engine::Create.
  PlacementOptions placement;
  bool update_during_backward = false;
  // Why, one line each (with "\n"), or "" where nothing was auto: "placement: chosen by
  // predicted time, ..." (two lines with the runner-up), "schedule: layer-major (auto: ...)",
  // "update during backward: off (auto: ...)".
  std::string placement_reason;
  std::string schedule_reason;
  std::string update_during_backward_reason;
  // "activation checkpointing: 2 of 4 blocks keep their activations, ... (auto: ...)" when the
  // request's placement.activation_checkpointing is kAuto (MakePlan resolves it: the plan's
  // blocks say which keep).
  std::string activation_checkpointing_reason;
  std::string Reasons() const {
    return placement_reason + schedule_reason + update_during_backward_reason +
           activation_checkpointing_reason;
  }
  // With a machine: the chosen plan's prediction with its update during backward, or why none.
  std::optional<StepPrediction> prediction;
  std::string prediction_error;
  // With PlanRequest::compare: the same run on one rank (ranks > 1: same device budget, the host,
  // pinned and NVMe budgets unchecked); with a machine, the optimizer on the device (every block
  // resident) and the best GPU/CPU split (the fraction among 0.05 ... 0.95 with the shortest
  // predicted step), each with the device budget MachineDeviceBudgetBytes; and with more
  // than one micro-batch each schedule's plan as the run would make it, predicted.
  std::optional<Plan> one_rank;
  std::vector<PlanAlternative> optimizer_alternatives;
  std::vector<PlanAlternative> schedules;
  int plans_built = 0;  // MakePlan calls this choice made
};

// The device budget an auto budget takes on `machine` when the choice plans against it (the
// placement search, the optimizer alternatives, `strata estimate --machine`'s default): 95 % of
// its device memory, the rest left to the CUDA context and the backend's own buffers; 0 when the
// profile has no device section. Pure; thread-safe.
uint64_t MachineDeviceBudgetBytes(const MachineProfile& machine);

// The cost model's inputs of a request: its model facts, accumulation and `udb`.
CostInputs CostInputsOf(const PlanRequest& request, bool update_during_backward);

// Errors: MakePlan's for the chosen plan (kInvalidArgument for bad options, kResourceExhausted
// for a budget that is short, saying what and by how much); ChoosePlacement's when no candidate
// fits. A machine that cannot predict (no device section, say) is not an error: the choices that
// need it fall back to the request's values and the reasons say why.
StatusOr<PlanChoice> ChoosePlan(const Model& model, const PlanRequest& request,
                                const MachineProfile* machine);

// The home of an OffloadOptimizer's master weights and optimizer state (offload/, the C API's
// strata_offload, strata.torch's offload="auto"): the state of a model the caller runs itself,
// with no engine Model to plan, so the one choice is its home. Host memory while the state takes
// at most 80 % of `host_available_bytes` (the rest is the caller's: its model, activations and
// data), else the NVMe swap store when paths are given.
struct OffloadHomeRequest {
  uint64_t state_bytes = 0;           // master weights and optimizer state, bytes
  uint64_t host_available_bytes = 0;  // host memory free now (MemAvailable); 0 = unknown: host
  bool nvme_paths_given = false;
};
struct OffloadHomeChoice {
  OptimizerHome home = OptimizerHome::kHost;  // kHost or kNvme
  std::string reason;                         // one line, no newline
};
// Errors: kResourceExhausted when the state does not fit host memory and no NVMe path is given
// (saying both sizes and to give `nvme_paths`). Pure; thread-safe.
StatusOr<OffloadHomeChoice> ChooseOffloadHome(const OffloadHomeRequest& request);

}  // namespace strata::engine
