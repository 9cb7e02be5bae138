// Placement by predicted time (issue 28 item 4): among the plans that fit the budgets, the one
// the cost model (engine/plan/cost_model.h) predicts fastest on a machine profile. The candidates
// are every working-params home (device: all resident; host; nvme when NVMe paths are given)
// crossed with every optimizer placement (on the device; split with 10, 20, ..., 90 % of the
// parameters' optimizer on the device and the rest in host memory or on NVMe; host; nvme), each
// planned by MakePlan and predicted by PredictStep. What the caller fixed is not searched.
//
// Thread-safety: pure functions on values (MakePlan and PredictStep are).
#pragma once

#include <optional>
#include <string>

#include "base/status.h"
#include "engine/plan/cost_model.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"

namespace strata::engine {

// Which placement choices the search makes; the others are taken from the base options.
struct PlacementSearch {
  bool param_home = true;
  bool optimizer_home = true;   // device, host or nvme for the optimizer
  bool device_fraction = true;  // the split, when the optimizer home is host or nvme
  // Each candidate's device budget: AutoDeviceBudgetBytes of the candidate (true), or the base
  // options' device_budget_bytes (false).
  bool auto_device_budget = false;
};

// A candidate: its placement, its plan's prediction, and a name ("params device, optimizer on
// the device", "params nvme, optimizer 40 % on the device, the rest host").
struct PlacementCandidate {
  PlacementOptions placement;
  StepPrediction prediction;
  std::string name;
  // What the plan does, whatever the options said: resident blocks, the device's share of the
  // optimizer and the homes actually used (two candidates with the same are the same plan).
  std::string effect;
};

struct PlacementChoice {
  PlacementCandidate best;
  // The next fastest plan that differs in effect from the best, when there is one.
  std::optional<PlacementCandidate> runner_up;
  int candidates = 0;  // plans tried
  int feasible = 0;    // of which fit the budgets and were predicted
  // "placement: chosen by predicted time, the fastest of 12 plans that fit (of 40): ...;
  // runner-up: ..." (two lines).
  std::string Describe() const;
};

// Errors: kInvalidArgument for inputs PredictStep refuses; kResourceExhausted when no candidate
// fits: with more than one tried, "none of the N placements tried fits; with the params' home
// host: the optimizer on the device: <the planner's reason>; the optimizer in host memory: ...;
// the optimizer on NVMe: ..." (the optimizer wholly in each home searched, the params in host
// memory when their home is searched, else in theirs), else the planner's reason;
// kFailedPrecondition when the profile lacks what every candidate needs (PredictStep's message,
// e.g. no "device" section).
StatusOr<PlacementChoice> ChoosePlacement(const Model& model, DType precision,
                                          MicroBatchShape shape, const PlacementOptions& base,
                                          const PlanOptimizer& optimizer, const CostInputs& inputs,
                                          const MachineProfile& profile,
                                          const PlacementSearch& search);

}  // namespace strata::engine
