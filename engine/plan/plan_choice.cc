#include "engine/plan/plan_choice.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "base/units.h"
#include "engine/plan/placement_search.h"

namespace strata::engine {
namespace {

// The request's options as the choices resolve them, one after another.
struct Resolving {
  PlacementOptions placement;
  bool update_during_backward = false;
  bool auto_device_budget = false;
  PlacementSearch search{false, false, false, false};
  bool auto_update_during_backward = false;
  bool auto_schedule = false;
};

// The update during backward as resolved, and the placement that holds its backup area when the
// engine will run it (with overlap).
void SetUpdateDuringBackward(const PlanRequest& r, bool on, Resolving* s) {
  s->update_during_backward = on;
  s->placement.update_during_backward = on && r.overlap;
}

Resolving Start(const PlanRequest& r) {
  const PlanAuto& a = r.automatic;
  Resolving s;
  s.placement = r.placement;
  s.auto_device_budget = a.device_budget;
  if (a.device_budget) s.placement.device_budget_bytes = 0;
  s.search = {a.param_home, a.optimizer_home, a.device_fraction, false};
  // Never with data parallelism (a rank's update waits for the reduced gradient) or without
  // overlap (nothing runs beside the backward).
  s.auto_update_during_backward =
      a.update_during_backward && !r.placement.data_parallel && r.overlap;
  if (a.schedule) s.placement.schedule = Schedule::kMicroBatchMajor;  // until decided
  s.auto_schedule = a.schedule && r.grad_accum_steps > 1;
  SetUpdateDuringBackward(r, a.update_during_backward ? false : r.update_during_backward, &s);
  return s;
}

PlanOptimizer OptimizerOf(const PlanRequest& r) {
  return {r.optimizer, std::max(1, r.grad_accum_steps)};
}

StatusOr<Plan> PlanFor(const Model& model, const PlanRequest& r, const PlacementOptions& p) {
  return MakePlan(model, r.precision, r.micro_batch, p, OptimizerOf(r));
}

// 2. The placement by predicted time: sets s->placement and returns the lines that say why, or
// "" without a machine or with nothing to search.
StatusOr<std::string> ChoosePlacementFor(const Model& model, const PlanRequest& r,
                                         const MachineProfile* machine, Resolving* s) {
  PlacementSearch search = s->search;
  if (machine == nullptr ||
      !(search.param_home || search.optimizer_home || search.device_fraction)) {
    return std::string();
  }
  PlacementOptions base = s->placement;
  if (s->auto_device_budget) {
    if (machine->device) {
      base.device_budget_bytes = MachineDeviceBudgetBytes(*machine);
    } else {
      search.auto_device_budget = true;
    }
  }
  StatusOr<PlacementChoice> chosen = ChoosePlacement(
      model, r.precision, r.micro_batch, base, {r.optimizer, r.grad_accum_steps},
      // Without the update during backward's term: it moves the choice toward CPU placements by
      // a few percent at most, within the model's error (a split measured 2.4x slower than the
      // device optimizer on the H200 where the model said 1.3x), so it does not decide.
      CostInputsOf(r, false), *machine, search);
  if (!chosen.ok() && chosen.status().code() == StatusCode::kFailedPrecondition) {
    // The profile cannot predict any plan (no device section, say): the fixed default.
    return fmt::format(
        "placement: not chosen by predicted time ({}); the default: params and optimizer state "
        "on NVMe\n",
        chosen.status().message());
  }
  STRATA_RETURN_IF_ERROR(chosen.status());
  s->placement = chosen->best.placement;
  s->auto_device_budget = false;  // the chosen plan's budget
  return chosen->Describe();
}

// 3. An auto device budget the placement did not set.
void ResolveDeviceBudget(const Model& model, const PlanRequest& r, Resolving* s) {
  if (!s->auto_device_budget) return;
  s->placement.device_budget_bytes = AutoDeviceBudgetBytes(
      model, r.precision, r.micro_batch, s->placement, {r.optimizer, r.grad_accum_steps});
}

// A plan and the placement it was made with.
struct Planned {
  Plan plan;
  PlacementOptions placement;
};

// The plan the run would make with `schedule`, its placement and budget chosen for it as the run
// chooses them (for layer-major with an auto budget: the micro-batch-major plan's, when that one
// fits, so that layer-major never asks for more device memory).
StatusOr<Planned> SchedulePlan(const Model& model, const PlanRequest& r,
                               const MachineProfile* machine, Resolving s, Schedule schedule) {
  if (schedule == Schedule::kLayerMajor && s.auto_device_budget) {
    auto micro_batch_major = SchedulePlan(model, r, machine, s, Schedule::kMicroBatchMajor);
    if (micro_batch_major.ok()) {
      s.auto_device_budget = false;
      s.placement.device_budget_bytes = micro_batch_major->plan.device_budget_bytes;
    }
  }
  s.placement.schedule = schedule;
  STRATA_RETURN_IF_ERROR(ChoosePlacementFor(model, r, machine, &s).status());
  ResolveDeviceBudget(model, r, &s);
  STRATA_ASSIGN_OR_RETURN(Plan plan, PlanFor(model, r, s.placement));
  return Planned{std::move(plan), s.placement};
}

// The rule of step 4 for a plan made without the update during backward: on from a 10 % shorter
// predicted step, when the plan that holds its backup area still fits (the host budget).
struct UpdateDuringBackwardRule {
  bool on = false;
  StepPrediction prediction;   // with the update during backward as decided
  std::string why;             // the reason's words after "auto: "
  std::optional<Plan> backed;  // on: the plan that holds the backup area
};
StatusOr<UpdateDuringBackwardRule> ApplyUpdateDuringBackwardRule(const Model& model,
                                                                 const Planned& planned,
                                                                 const PlanRequest& r,
                                                                 const MachineProfile& machine) {
  STRATA_ASSIGN_OR_RETURN(StepPrediction off,
                          PredictStep(planned.plan, CostInputsOf(r, false), machine));
  STRATA_ASSIGN_OR_RETURN(StepPrediction on,
                          PredictStep(planned.plan, CostInputsOf(r, true), machine));
  UpdateDuringBackwardRule rule;
  const std::string predicted =
      fmt::format("predicted step {:.3g} s with it, {:.3g} s without", on.step_s, off.step_s);
  rule.prediction = off;
  if (!(on.step_s < 0.9 * off.step_s)) {
    rule.why = predicted + "; on from 10 % shorter";
    return rule;
  }
  PlacementOptions with = planned.placement;
  with.update_during_backward = true;
  StatusOr<Plan> backed = PlanFor(model, r, with);
  if (!backed.ok()) {
    const std::string why = backed.status().message();
    rule.why = fmt::format("{}, but its backup area does not fit: {}", predicted,
                           why.substr(0, why.find('\n')));
    return rule;
  }
  rule.on = true;
  rule.backed = std::move(*backed);
  rule.prediction = on;
  rule.why = predicted + "; on from 10 % shorter";
  return rule;
}

// `planned`'s prediction with the update during backward it would run with.
StatusOr<StepPrediction> PredictAsResolved(const Model& model, const Planned& planned,
                                           const PlanRequest& r, const Resolving& s,
                                           const MachineProfile& machine) {
  if (!s.auto_update_during_backward) {
    return PredictStep(planned.plan, CostInputsOf(r, s.update_during_backward), machine);
  }
  STRATA_ASSIGN_OR_RETURN(UpdateDuringBackwardRule rule,
                          ApplyUpdateDuringBackwardRule(model, planned, r, machine));
  return rule.prediction;
}

// 1. The schedule: sets s->placement.schedule (and, choosing layer-major without a machine, the
// budget it was planned in) and returns the line that says why, or "" when not auto.
std::string ChooseSchedule(const Model& model, const PlanRequest& r, const MachineProfile* machine,
                           Resolving* s) {
  if (!s->auto_schedule) return std::string();
  Schedule& schedule = s->placement.schedule;
  const int a = r.grad_accum_steps;
  auto micro_batch_major = SchedulePlan(model, r, machine, *s, Schedule::kMicroBatchMajor);
  auto layer_major = SchedulePlan(model, r, machine, *s, Schedule::kLayerMajor);
  if (!layer_major.ok()) {
    schedule = Schedule::kMicroBatchMajor;
    const std::string why = layer_major.status().message();
    return fmt::format(
        "schedule: micro-batch-major (auto: the layer-major plan, {} micro-batches on the device "
        "at once, does not fit: {})\n",
        a, why.substr(0, why.find('\n')));
  }
  schedule = Schedule::kLayerMajor;
  // An auto budget stays the one the chosen schedule's plan was made and predicted in
  // (ResolveDeviceBudget would give layer-major its own, larger one).
  const auto keep_budget = [s](const Plan& plan) {
    if (!s->auto_device_budget) return;
    s->auto_device_budget = false;
    s->placement.device_budget_bytes = plan.device_budget_bytes;
  };
  if (machine == nullptr) {
    keep_budget(layer_major->plan);
    return fmt::format(
        "schedule: layer-major (auto: its plan of {} micro-batches fits; `machine` compares the "
        "predicted steps)\n",
        a);
  }
  auto lm = PredictAsResolved(model, *layer_major, r, *s, *machine);
  StatusOr<StepPrediction> mb = micro_batch_major.ok()
                                    ? PredictAsResolved(model, *micro_batch_major, r, *s, *machine)
                                    : StatusOr<StepPrediction>(micro_batch_major.status());
  if (!lm.ok() || !mb.ok()) {
    keep_budget(layer_major->plan);
    return fmt::format("schedule: layer-major (auto: its plan fits; steps not predicted: {})\n",
                       (lm.ok() ? mb.status() : lm.status()).message());
  }
  if (lm->step_s > mb->step_s) schedule = Schedule::kMicroBatchMajor;
  keep_budget(schedule == Schedule::kLayerMajor ? layer_major->plan : micro_batch_major->plan);
  return fmt::format(
      "schedule: {} (auto: predicted step {:.3g} s layer-major, {:.3g} s micro-batch-major)\n",
      ScheduleName(schedule), lm->step_s, mb->step_s);
}

// 4. The update during backward: sets s->update_during_backward and returns the line that says
// why, or "" when not auto or without a machine. Deciding it makes the run's plan, which it
// leaves in *plan (untouched when nothing is decided).
StatusOr<std::string> ChooseUpdateDuringBackward(const Model& model, const PlanRequest& r,
                                                 const MachineProfile* machine, Resolving* s,
                                                 std::optional<Plan>* plan) {
  if (!s->auto_update_during_backward || machine == nullptr) return std::string();
  STRATA_ASSIGN_OR_RETURN(Plan off, PlanFor(model, r, s->placement));
  Planned planned{std::move(off), s->placement};
  auto rule = ApplyUpdateDuringBackwardRule(model, planned, r, *machine);
  if (!rule.ok()) {  // not predicted: off
    *plan = std::move(planned.plan);
    return std::string();
  }
  SetUpdateDuringBackward(r, rule->on, s);
  *plan = rule->on ? std::move(rule->backed) : std::move(planned.plan);
  return fmt::format("update during backward: {} (auto: {})\n", rule->on ? "on" : "off", rule->why);
}

// The optimizer with `fraction` of the parameters on the device (1: all, every block resident),
// in the profile's device memory.
PlanAlternative OptimizerAlternative(const Model& model, const PlanRequest& r, const Resolving& s,
                                     const MachineProfile& machine, double fraction) {
  PlanAlternative alt;
  alt.name = fraction >= 1 ? "device" : "split";
  alt.device_fraction = fraction;
  PlacementOptions p = s.placement;
  if (machine.device) p.device_budget_bytes = MachineDeviceBudgetBytes(machine);
  alt.device_budget_bytes = p.device_budget_bytes;
  if (fraction >= 1) {
    p.param_home = ParamHome::kDevice;
    p.optimizer_home = OptimizerHome::kDevice;
  } else if (p.optimizer_home == OptimizerHome::kDevice) {
    p.optimizer_home = OptimizerHome::kHost;
  }
  p.optimizer_device_fraction = fraction;
  auto plan = PlanFor(model, r, p);
  if (!plan.ok()) {
    alt.why_not = plan.status().message();
    return alt;
  }
  auto pr = PredictStep(*plan, CostInputsOf(r, s.update_during_backward), machine);
  if (!pr.ok()) {
    alt.why_not = pr.status().message();
    return alt;
  }
  alt.prediction = *pr;
  return alt;
}

std::vector<PlanAlternative> OptimizerAlternatives(const Model& model, const PlanRequest& r,
                                                   const Resolving& s,
                                                   const MachineProfile& machine) {
  std::vector<PlanAlternative> out;
  out.push_back(OptimizerAlternative(model, r, s, machine, 1.0));
  PlanAlternative best;
  best.name = "split";
  for (int i = 1; i < 20; ++i) {
    PlanAlternative a = OptimizerAlternative(model, r, s, machine, i / 20.0);
    if (!a.prediction) {
      if (!best.prediction && best.why_not.empty()) best.why_not = a.why_not;
      continue;
    }
    if (!best.prediction || a.prediction->step_s < best.prediction->step_s) best = a;
  }
  out.push_back(best);
  return out;
}

// Each schedule's plan as the run would make it from the request, predicted.
std::vector<PlanAlternative> ScheduleAlternatives(const Model& model, const PlanRequest& r,
                                                  const MachineProfile& machine) {
  std::vector<PlanAlternative> out;
  if (r.grad_accum_steps <= 1) return out;
  const Resolving start = Start(r);
  for (const Schedule schedule : {Schedule::kMicroBatchMajor, Schedule::kLayerMajor}) {
    PlanAlternative alt;
    alt.name = ScheduleName(schedule);
    auto planned = SchedulePlan(model, r, &machine, start, schedule);
    auto pr = planned.ok() ? PredictAsResolved(model, *planned, r, start, machine)
                           : StatusOr<StepPrediction>(planned.status());
    if (pr.ok()) {
      alt.prediction = *pr;
    } else {
      alt.why_not = pr.status().message();
    }
    out.push_back(std::move(alt));
  }
  return out;
}

// The same run on one rank: same device budget, the host, pinned and NVMe budgets unchecked
// (its needs are what is compared).
StatusOr<Plan> OneRankPlan(const Model& model, const PlanRequest& r, PlacementOptions p) {
  p.ranks = 1;
  p.data_parallel = false;
  p.host_budget_bytes = 0;
  p.nvme_capacity_bytes = 0;
  p.pinned_budget_bytes = std::numeric_limits<uint64_t>::max();
  return PlanFor(model, r, p);
}

// What every plan of the request shares, checked before any auto rule sizes something from it
// (AutoDeviceBudgetBytes asks the model for the activations of the micro-batch).
Status CheckRequest(const Model& model, const PlanRequest& r) {
  if (r.micro_batch.batch_size < 1 || r.micro_batch.seq_len < 1 ||
      r.micro_batch.seq_len > model.max_seq_len()) {
    return InvalidArgumentError(fmt::format(
        "`micro_batch` of {} sequences of {} tokens: both must be >= 1 and the sequence within "
        "the model's context of {}",
        r.micro_batch.batch_size, r.micro_batch.seq_len, model.max_seq_len()));
  }
  if (r.grad_accum_steps < 1) {
    return InvalidArgumentError(
        fmt::format("`grad_accum_steps` {} must be >= 1", r.grad_accum_steps));
  }
  return Status::Ok();
}

// The reason line of activation checkpointing `auto` (MakePlan keeps, last blocks first, as many
// blocks' stores as the budget left after every other region holds); "" when not auto or no
// block can keep.
std::string ActivationCheckpointingReason(const Plan& p) {
  const int keeping = p.num_keeping_activations(), recomputing = p.num_recomputing();
  if (p.activation_checkpointing != ActivationCheckpointing::kAuto || keeping + recomputing == 0) {
    return "";
  }
  uint64_t store = 0;
  for (const auto& b : p.blocks) store = std::max(store, b.activation_store_bytes);
  const uint64_t rest = p.device_total_bytes - p.kept_activation_bytes();
  const uint64_t left = p.device_budget_bytes > rest ? p.device_budget_bytes - rest : 0;
  return fmt::format(
      "activation checkpointing: {} of {} blocks keep their activations, {} recompute their "
      "forward (auto: {} of the device budget left after the rest of the plan; one block's "
      "store takes {}{})\n",
      keeping, keeping + recomputing, recomputing, FormatBytes(left), FormatBytes(store),
      p.held_micro_batches > 1 ? fmt::format(" per micro-batch, {} held", p.held_micro_batches)
                               : "");
}

StatusOr<PlanChoice> Choose(const Model& model, const PlanRequest& r,
                            const MachineProfile* machine) {
  STRATA_RETURN_IF_ERROR(CheckRequest(model, r));
  Resolving s = Start(r);
  PlanChoice c;
  c.schedule_reason = ChooseSchedule(model, r, machine, &s);
  STRATA_ASSIGN_OR_RETURN(c.placement_reason, ChoosePlacementFor(model, r, machine, &s));
  ResolveDeviceBudget(model, r, &s);
  std::optional<Plan> decided;
  STRATA_ASSIGN_OR_RETURN(c.update_during_backward_reason,
                          ChooseUpdateDuringBackward(model, r, machine, &s, &decided));
  if (decided) {
    c.plan = std::move(*decided);
  } else {
    STRATA_ASSIGN_OR_RETURN(c.plan, PlanFor(model, r, s.placement));
  }
  c.activation_checkpointing_reason = ActivationCheckpointingReason(c.plan);
  c.placement = s.placement;
  c.update_during_backward = s.update_during_backward;
  if (r.compare && s.placement.ranks > 1) {
    STRATA_ASSIGN_OR_RETURN(c.one_rank, OneRankPlan(model, r, s.placement));
  }
  if (machine == nullptr) return c;
  auto predicted = PredictStep(c.plan, CostInputsOf(r, s.update_during_backward), *machine);
  if (!predicted.ok()) {
    c.prediction_error = predicted.status().message();
    return c;
  }
  c.prediction = *predicted;
  if (r.compare) {
    c.optimizer_alternatives = OptimizerAlternatives(model, r, s, *machine);
    c.schedules = ScheduleAlternatives(model, r, *machine);
  }
  return c;
}

}  // namespace

uint64_t MachineDeviceBudgetBytes(const MachineProfile& machine) {
  if (!machine.device) return 0;
  return static_cast<uint64_t>(0.95 * machine.device->memory_GiB * static_cast<double>(kGiB));
}

CostInputs CostInputsOf(const PlanRequest& request, bool update_during_backward) {
  CostInputs in;
  in.num_layers = request.num_layers;
  in.channels = request.channels;
  in.grad_accum_steps = request.grad_accum_steps;
  in.update_during_backward = update_during_backward;
  return in;
}

StatusOr<PlanChoice> ChoosePlan(const Model& model, const PlanRequest& request,
                                const MachineProfile* machine) {
  const int64_t plans_before = internal::PlansBuiltOnThisThread();
  StatusOr<PlanChoice> choice = Choose(model, request, machine);
  const int64_t plans_built = internal::PlansBuiltOnThisThread() - plans_before;
  internal::CountChoice(plans_built);
  if (choice.ok()) choice->plans_built = static_cast<int>(plans_built);
  return choice;
}

StatusOr<OffloadHomeChoice> ChooseOffloadHome(const OffloadHomeRequest& request) {
  const double limit = 0.8 * static_cast<double>(request.host_available_bytes);
  OffloadHomeChoice c;
  if (request.host_available_bytes == 0 || static_cast<double>(request.state_bytes) <= limit) {
    c.home = OptimizerHome::kHost;
    c.reason = request.host_available_bytes == 0
                   ? fmt::format("offload: host (auto: {} of state; host memory unknown)",
                                 FormatBytes(request.state_bytes))
                   : fmt::format("offload: host (auto: {} of state fit 80 % of the {} available)",
                                 FormatBytes(request.state_bytes),
                                 FormatBytes(request.host_available_bytes));
    return c;
  }
  if (!request.nvme_paths_given) {
    return ResourceExhaustedError(fmt::format(
        "the optimizer state ({}) does not fit 80 % of the {} of host memory available: give "
        "`nvme_paths` for the NVMe swap store",
        FormatBytes(request.state_bytes), FormatBytes(request.host_available_bytes)));
  }
  c.home = OptimizerHome::kNvme;
  c.reason =
      fmt::format("offload: nvme (auto: {} of state exceed 80 % of the {} available)",
                  FormatBytes(request.state_bytes), FormatBytes(request.host_available_bytes));
  return c;
}

}  // namespace strata::engine
