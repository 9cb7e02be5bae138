#include "tools/step_prediction.h"

#include <fmt/format.h>

#include "base/units.h"
#include "engine/plan/model_flops.h"
#include "tools/option_flags.h"

namespace strata::tools {

engine::CostInputs CostInputsOf(const ModelSpec& spec, int grad_accum_steps,
                                bool update_during_backward) {
  engine::CostInputs in;
  in.grad_accum_steps = grad_accum_steps;
  in.update_during_backward = update_during_backward;
  if (spec.config.family == models::HfModelConfig::Family::kLlama) {
    const models::LlamaConfig& l = spec.config.llama;
    in.num_layers = l.num_layers;
    in.channels = l.num_heads * (l.head_dim > 0 ? l.head_dim : l.hidden_size / l.num_heads);
  } else {
    in.num_layers = spec.config.gpt2.num_layers;
    in.channels = spec.config.gpt2.channels;
  }
  return in;
}

std::optional<int64_t> ModelFlopsPerTokenOf(const ModelSpec& spec, const engine::Plan& plan) {
  const engine::CostInputs in = CostInputsOf(spec, 1);
  return engine::ModelFlopsPerToken({.trained_params = plan.model_params,
                                     .frozen_params = plan.frozen_params,
                                     .num_layers = in.num_layers,
                                     .attention_width = in.channels,
                                     .seq_len = plan.shape.seq_len});
}

std::string DescribeStepPrediction(const engine::StepPrediction& pr,
                                   const std::vector<engine::PlanAlternative>& alternatives,
                                   uint64_t plan_device_budget_bytes) {
  std::string s = fmt::format("predicted: {}\n", engine::DescribePrediction(pr));
  for (const std::string& note : pr.notes) s += fmt::format("  note: {}\n", note);
  for (const engine::PlanAlternative& a : alternatives) {
    const std::string label =
        (a.name == "device" ? "optimizer on the device"
                            : (a.prediction ? fmt::format("best split ({:.0f} % of the params' "
                                                          "optimizer on the device)",
                                                          100 * a.device_fraction)
                                            : std::string("a GPU/CPU split"))) +
        (a.device_budget_bytes > plan_device_budget_bytes
             ? fmt::format(", in 95 % of the device's memory ({})",
                           FormatBytes(a.device_budget_bytes))
             : std::string());
    if (a.prediction) {
      s += fmt::format("  {}: step {:.3g} s ({:.0f} tokens/s, {:.2f}x), bound by {}\n", label,
                       a.prediction->step_s, a.prediction->tokens_per_s,
                       pr.step_s / a.prediction->step_s, a.prediction->bound);
    } else {
      s += fmt::format("  {}: does not fit: {}\n", label, InFlagTerms(a.why_not));
    }
  }
  return s;
}

std::string DescribeSchedules(const std::vector<engine::PlanAlternative>& schedules,
                              std::string_view taken) {
  std::string s;
  for (const engine::PlanAlternative& a : schedules) {
    const std::string label =
        fmt::format("{} schedule{}", a.name, a.name == taken ? " (taken)" : "");
    if (a.prediction) {
      s += fmt::format("  {}: step {:.3g} s ({:.0f} tokens/s), bound by {}\n", label,
                       a.prediction->step_s, a.prediction->tokens_per_s, a.prediction->bound);
    } else {
      s += fmt::format("  {}: does not fit: {}\n", label,
                       InFlagTerms(a.why_not.substr(0, a.why_not.find('\n'))));
    }
  }
  return s;
}

nlohmann::json PlanningJson() {
  const engine::PlanningCounts c = engine::PlanningCountsSoFar();
  return {{"choices", c.choices},
          {"plans_built", c.plans_built},
          {"plans_built_outside_choices", c.plans_built - c.plans_built_in_choices}};
}

}  // namespace strata::tools
