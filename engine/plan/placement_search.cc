#include "engine/plan/placement_search.h"

#include <fmt/format.h>

#include <vector>

namespace strata::engine {
namespace {

std::string CandidateName(const PlacementOptions& p) {
  std::string optimizer;
  if (p.optimizer_home == OptimizerHome::kDevice || p.optimizer_device_fraction >= 1) {
    optimizer = "optimizer on the device";
  } else if (p.optimizer_device_fraction > 0) {
    optimizer = fmt::format("optimizer {:.0f} % on the device, the rest {}",
                            100 * p.optimizer_device_fraction, OptimizerHomeName(p.optimizer_home));
  } else {
    optimizer = fmt::format("optimizer {}", OptimizerHomeName(p.optimizer_home));
  }
  return fmt::format("params {}, {}", ParamHomeName(p.param_home), optimizer);
}

// "the optimizer on the device", "... in host memory", "... on NVMe".
std::string WhollyIn(OptimizerHome h) {
  switch (h) {
    case OptimizerHome::kDevice:
      return "the optimizer on the device";
    case OptimizerHome::kHost:
      return "the optimizer in host memory";
    case OptimizerHome::kNvme:
      return "the optimizer on NVMe";
  }
  return "the optimizer";
}

std::string CandidateLine(const PlacementCandidate& c) {
  return fmt::format("{}: step {:.3g} s ({:.0f} tokens/s), bound by {}", c.name,
                     c.prediction.step_s, c.prediction.tokens_per_s, c.prediction.bound);
}

}  // namespace

std::string PlacementChoice::Describe() const {
  std::string s = fmt::format(
      "placement: chosen by predicted time, the fastest of {} plans that fit (of {} tried): {}\n",
      feasible, candidates, CandidateLine(best));
  if (runner_up) s += fmt::format("           runner-up: {}\n", CandidateLine(*runner_up));
  return s;
}

StatusOr<PlacementChoice> ChoosePlacement(const Model& model, DType precision,
                                          MicroBatchShape shape, const PlacementOptions& base,
                                          const PlanOptimizer& optimizer, const CostInputs& inputs,
                                          const MachineProfile& profile,
                                          const PlacementSearch& search) {
  std::vector<ParamHome> params = {base.param_home};
  if (search.param_home) {
    params = {ParamHome::kDevice, ParamHome::kHost};
    if (!base.nvme_paths.empty()) params.push_back(ParamHome::kNvme);
  }
  // (home, fraction) pairs.
  std::vector<std::pair<OptimizerHome, double>> optimizers = {
      {base.optimizer_home, base.optimizer_device_fraction}};
  if (search.optimizer_home || search.device_fraction) {
    std::vector<OptimizerHome> homes = {base.optimizer_home};
    if (search.optimizer_home) {
      homes = {OptimizerHome::kDevice, OptimizerHome::kHost};
      if (!base.nvme_paths.empty()) homes.push_back(OptimizerHome::kNvme);
    }
    optimizers.clear();
    for (OptimizerHome h : homes) {
      if (h == OptimizerHome::kDevice) {
        optimizers.push_back({h, 1.0});
        continue;
      }
      optimizers.push_back({h, search.device_fraction ? 0.0 : base.optimizer_device_fraction});
      if (!search.device_fraction) continue;
      for (int i = 1; i <= 9; ++i) optimizers.push_back({h, i / 10.0});
    }
  }
  PlacementChoice choice;
  std::vector<PlacementCandidate> fit;
  Status last = ResourceExhaustedError("no placement was tried");
  // When none fits, the reason the last candidate gives is a split's and says little (it asks
  // for the device memory of 90 % of the optimizer). The reasons of the optimizer wholly in
  // each home, with the params in the usual offload home (host when searched), say what is short.
  const ParamHome reason_params = search.param_home ? ParamHome::kHost : base.param_home;
  const double unsplit = search.device_fraction ? 0.0 : base.optimizer_device_fraction;
  std::vector<std::string> pure_reasons;
  bool any_planned = false;
  for (ParamHome ph : params) {
    for (const auto& [oh, fraction] : optimizers) {
      PlacementOptions p = base;
      p.param_home = ph;
      p.optimizer_home = oh;
      p.optimizer_device_fraction = oh == OptimizerHome::kDevice ? 0.0 : fraction;
      if (search.auto_device_budget) {
        p.device_budget_bytes = AutoDeviceBudgetBytes(model, precision, shape, p, optimizer);
      }
      ++choice.candidates;
      StatusOr<Plan> plan = MakePlan(model, precision, shape, p, optimizer);
      if (!plan.ok()) {
        last = plan.status();
        if (ph == reason_params && (oh == OptimizerHome::kDevice || fraction == unsplit)) {
          const std::string why(plan.status().message());
          pure_reasons.push_back(
              fmt::format("{}: {}", WhollyIn(oh), why.substr(0, why.find('\n'))));
        }
        continue;
      }
      any_planned = true;
      StatusOr<StepPrediction> pr = PredictStep(*plan, inputs, profile);
      if (!pr.ok()) {
        last = pr.status();
        continue;
      }
      const bool streamed = plan->num_resident() < static_cast<int>(plan->blocks.size());
      const std::string effect = fmt::format(
          "{} resident, {} params' optimizer on the device{}{}", plan->num_resident(),
          plan->device_optimizer_params,
          plan->has_cpu_optimizer() ? fmt::format(", the rest {}", OptimizerHomeName(oh)) : "",
          streamed ? fmt::format(", streamed from {}", ParamHomeName(ph)) : "");
      fit.push_back({p, *pr, CandidateName(p), effect});
    }
  }
  if (fit.empty()) {
    // A prediction's error (the profile lacks what the plans need) is the answer as it is.
    if (any_planned || choice.candidates == 1 || pure_reasons.empty()) return last;
    std::string why;
    for (const std::string& r : pure_reasons) why += (why.empty() ? "" : "; ") + r;
    return ResourceExhaustedError(
        fmt::format("none of the {} placements tried fits; with the params' home {}: {}",
                    choice.candidates, ParamHomeName(reason_params), why));
  }
  choice.feasible = static_cast<int>(fit.size());
  // The fastest; among equal predictions the first tried (device before host before nvme, the
  // whole optimizer on the device before splits).
  size_t best = 0;
  for (size_t i = 1; i < fit.size(); ++i) {
    if (fit[i].prediction.step_s < fit[best].prediction.step_s) best = i;
  }
  choice.best = fit[best];
  for (size_t i = 0; i < fit.size(); ++i) {
    if (i == best || fit[i].effect == fit[best].effect) continue;
    if (!choice.runner_up || fit[i].prediction.step_s < choice.runner_up->prediction.step_s) {
      choice.runner_up = fit[i];
    }
  }
  return choice;
}

}  // namespace strata::engine
