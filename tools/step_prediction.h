// The cost model (engine/plan/cost_model.h) as `strata estimate --machine` and `strata train
// --machine` print it: the prediction of the chosen plan, and what the step would take with the
// optimizer on the device and with the best GPU/CPU split, for comparison (all of them computed
// by engine::ChoosePlan, engine/plan/plan_choice.h; this file only words them).
//
// Thread-safety: plain functions on values the caller owns.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/plan/cost_model.h"
#include "engine/plan/plan_choice.h"
#include "tools/model_spec.h"

namespace strata::tools {

// The model facts the cost model needs beyond the plan: layers and attention width of the
// spec's family (GPT-2: num_layers, channels; Llama: num_layers, num_heads x head_dim).
engine::CostInputs CostInputsOf(const ModelSpec& spec, int grad_accum_steps,
                                bool update_during_backward = false);

// engine::ModelFlopsPerToken of the spec's family at the plan's sequence length: its trained and
// frozen params (the plan's), layers and attention width (CostInputsOf). nullopt when it does not
// fit in 63 bits.
std::optional<int64_t> ModelFlopsPerTokenOf(const ModelSpec& spec, const engine::Plan& plan);

// Lines for the text output: "predicted: step ...", each part, the notes and the alternatives;
// an alternative planned in more device memory than the plan's budget (plan_device_budget_bytes)
// says so ("optimizer on the device, in 95 % of the device's memory (132.81 GiB): ...").
std::string DescribeStepPrediction(const engine::StepPrediction& prediction,
                                   const std::vector<engine::PlanAlternative>& alternatives,
                                   uint64_t plan_device_budget_bytes);

// Lines for each schedule's predicted step (engine::PlanAlternative::name: "micro-batch-major",
// "layer-major"), `taken` marked: "  layer-major schedule (taken): step 7.12 s (9202 tokens/s),
// bound by compute"; "" for none.
std::string DescribeSchedules(const std::vector<engine::PlanAlternative>& schedules,
                              std::string_view taken);

// The planning calls of this process so far (engine::PlanningCountsSoFar), for --summary-json and
// estimate --json: {"choices": 1, "plans_built": 3, "plans_built_outside_choices": 0}. A run
// that chooses its plan once and never re-plans has choices 1 and nothing built outside.
nlohmann::json PlanningJson();

}  // namespace strata::tools
