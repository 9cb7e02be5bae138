// The cost model (engine/cost_model.h) as `strata estimate --machine` and `strata train
// --machine` print it: the prediction of the plan being made, and what the step would take
// with the optimizer on the device and with the best GPU/CPU split, for comparison.
//
// Thread-safety: plain functions on values the caller owns.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/cost_model.h"
#include "engine/engine.h"
#include "engine/machine_profile.h"
#include "engine/model.h"
#include "tools/model_spec.h"

namespace strata::tools {

// The model facts the cost model needs beyond the plan: layers and attention width of the
// spec's family (GPT-2: num_layers, channels; Llama: num_layers, num_heads x head_dim).
engine::CostInputs CostInputsOf(const ModelSpec& spec, int grad_accum_steps,
                                bool update_during_backward = false);

// One alternative placement of the optimizer and what it would take.
struct PlacementAlternative {
  std::string name;            // "device" or "split"
  double device_fraction = 0;  // of the parameters whose optimizer runs on the device
  std::optional<engine::StepPrediction> prediction;  // absent when the plan is infeasible
  std::string why_not;  // the planner's or the cost model's reason, when absent
};

// The optimizer on the device (every block resident, fraction 1), and the best split (the
// fraction among 0.05, 0.10, ..., 0.95 with the shortest predicted step whose plan fits), each
// planned with `options` but the optimizer placement and, when the profile has a device, the
// device budget set to the profile's device memory. Plans that do not fit are reported with
// the planner's reason.
std::vector<PlacementAlternative> OptimizerAlternatives(const engine::Model& model,
                                                        const engine::EngineOptions& options,
                                                        const engine::CostInputs& inputs,
                                                        const engine::MachineProfile& profile);

// Lines for the text output: "predicted: step ...", each part, the notes and the alternatives.
std::string DescribeStepPrediction(const engine::StepPrediction& prediction,
                                   const std::vector<PlacementAlternative>& alternatives);

// Lines for each schedule's predicted step (PlacementAlternative::name: "micro-batch-major",
// "layer-major"), `taken` marked: "  layer-major schedule (taken): step 7.12 s (9202 tokens/s),
// bound by compute"; "" for none.
std::string DescribeSchedules(const std::vector<PlacementAlternative>& schedules,
                              std::string_view taken);

}  // namespace strata::tools
