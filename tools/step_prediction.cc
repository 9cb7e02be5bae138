#include "tools/step_prediction.h"

#include <fmt/format.h>

#include <cmath>

#include "base/units.h"
#include "tools/train_setup.h"

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

namespace {

PlacementAlternative Alternative(const engine::Model& model, engine::EngineOptions o,
                                 const engine::CostInputs& inputs,
                                 const engine::MachineProfile& profile, double fraction) {
  PlacementAlternative alt;
  alt.name = fraction >= 1 ? "device" : "split";
  alt.device_fraction = fraction;
  engine::PlacementOptions& p = o.placement;
  if (profile.device) {
    p.device_budget_bytes =
        static_cast<uint64_t>(profile.device->memory_GiB * static_cast<double>(kGiB));
  }
  if (fraction >= 1) {
    p.param_home = engine::ParamHome::kDevice;
    p.optimizer_home = engine::OptimizerHome::kDevice;
  } else if (p.optimizer_home == engine::OptimizerHome::kDevice) {
    p.optimizer_home = engine::OptimizerHome::kHost;
  }
  p.optimizer_device_fraction = fraction;
  auto plan = MakeTrainPlan(model, o);
  if (!plan.ok()) {
    alt.why_not = plan.status().message();
    return alt;
  }
  auto pr = engine::PredictStep(*plan, inputs, profile);
  if (!pr.ok()) {
    alt.why_not = pr.status().message();
    return alt;
  }
  alt.prediction = *pr;
  return alt;
}

}  // namespace

std::vector<PlacementAlternative> OptimizerAlternatives(const engine::Model& model,
                                                        const engine::EngineOptions& options,
                                                        const engine::CostInputs& inputs,
                                                        const engine::MachineProfile& profile) {
  std::vector<PlacementAlternative> out;
  out.push_back(Alternative(model, options, inputs, profile, 1.0));
  PlacementAlternative best;
  best.name = "split";
  for (int i = 1; i < 20; ++i) {
    PlacementAlternative a = Alternative(model, options, inputs, profile, i / 20.0);
    if (!a.prediction) {
      if (!best.prediction && best.why_not.empty()) best.why_not = a.why_not;
      continue;
    }
    if (!best.prediction || a.prediction->step_s < best.prediction->step_s) best = a;
  }
  out.push_back(best);
  return out;
}

std::string DescribeStepPrediction(const engine::StepPrediction& pr,
                                   const std::vector<PlacementAlternative>& alternatives) {
  std::string s = fmt::format("predicted: {}\n", engine::DescribePrediction(pr));
  for (const std::string& note : pr.notes) s += fmt::format("  note: {}\n", note);
  for (const PlacementAlternative& a : alternatives) {
    const std::string label =
        a.name == "device" ? "optimizer on the device"
                           : (a.prediction ? fmt::format("best split ({:.0f} % of the params' "
                                                         "optimizer on the device)",
                                                         100 * a.device_fraction)
                                           : std::string("a GPU/CPU split"));
    if (a.prediction) {
      s += fmt::format("  {}: step {:.3g} s ({:.0f} tokens/s, {:.2f}x), bound by {}\n", label,
                       a.prediction->step_s, a.prediction->tokens_per_s,
                       pr.step_s / a.prediction->step_s, a.prediction->bound);
    } else {
      s += fmt::format("  {}: does not fit: {}\n", label, a.why_not);
    }
  }
  return s;
}

std::string DescribeSchedules(const std::vector<PlacementAlternative>& schedules,
                              std::string_view taken) {
  std::string s;
  for (const PlacementAlternative& a : schedules) {
    const std::string label =
        fmt::format("{} schedule{}", a.name, a.name == taken ? " (taken)" : "");
    if (a.prediction) {
      s += fmt::format("  {}: step {:.3g} s ({:.0f} tokens/s), bound by {}\n", label,
                       a.prediction->step_s, a.prediction->tokens_per_s, a.prediction->bound);
    } else {
      s +=
          fmt::format("  {}: does not fit: {}\n", label, a.why_not.substr(0, a.why_not.find('\n')));
    }
  }
  return s;
}

}  // namespace strata::tools
