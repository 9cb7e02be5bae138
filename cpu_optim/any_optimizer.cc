#include "cpu_optim/any_optimizer.h"

#include <string>

namespace strata::cpu_optim {

std::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "AdamW";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdagrad:
      return "Adagrad";
    case OptimizerKind::kLion:
      return "Lion";
    case OptimizerKind::kSgd:
      return "SGD";
  }
  return "unknown";
}

namespace {

bool ConfigMatchesKind(const AnyOptimizer& o) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
      return std::holds_alternative<AdamWConfig>(o.config) &&
             std::get<AdamWConfig>(o.config).decoupled_weight_decay;
    case OptimizerKind::kAdam:
      return std::holds_alternative<AdamWConfig>(o.config) &&
             !std::get<AdamWConfig>(o.config).decoupled_weight_decay;
    case OptimizerKind::kAdagrad:
      return std::holds_alternative<AdagradConfig>(o.config);
    case OptimizerKind::kLion:
      return std::holds_alternative<LionConfig>(o.config);
    case OptimizerKind::kSgd:
      return std::holds_alternative<SgdConfig>(o.config);
  }
  return false;
}

}  // namespace

Status Validate(const AnyOptimizer& o) {
  if (!ConfigMatchesKind(o)) {
    return InvalidArgumentError(
        std::string("optimizer config does not belong to its kind ") +
        std::string(OptimizerKindName(o.kind)) +
        " (AdamW and Adam take an AdamWConfig with decoupled_weight_decay true / false)");
  }
  // An empty update checks the hyper-parameters with the kind's own rules and touches nothing.
  return Update(o, OptimStep{}, {}, {}, GradView{nullptr, DType::kF32});
}

int NumState(const AnyOptimizer& o) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return std::get<AdamWConfig>(o.config).amsgrad ? 3 : 2;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kLion:
      return 1;
    case OptimizerKind::kSgd:
      return std::get<SgdConfig>(o.config).momentum != 0.0f ? 1 : 0;
  }
  return 0;
}

std::string_view StateName(const AnyOptimizer& o, int index) {
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return index == 0 ? "exp_avg" : index == 1 ? "exp_avg_sq" : "max_exp_avg_sq";
    case OptimizerKind::kAdagrad:
      return "sum";
    case OptimizerKind::kLion:
      return "exp_avg";
    case OptimizerKind::kSgd:
      return "momentum_buffer";
  }
  return "unknown";
}

float InitialStateValue(const AnyOptimizer& o, int index) {
  if (o.kind == OptimizerKind::kAdagrad) {
    return std::get<AdagradConfig>(o.config).initial_accumulator_value;
  }
  return 0.0f;
}

Status Update(const AnyOptimizer& o, const OptimStep& step, std::span<float> master,
              std::span<const std::span<float>> state, GradView grad, CopyOut copy_out) {
  if (!ConfigMatchesKind(o)) return Validate(o);
  const int want = NumState(o);
  // Validate() passes no state: every kind then checks its hyper-parameters on empty spans.
  const bool empty_check = master.empty() && state.empty();
  if (!empty_check && static_cast<int>(state.size()) != want) {
    return InvalidArgumentError(std::string(OptimizerKindName(o.kind)) + ": " +
                                std::to_string(state.size()) + " state buffers given, expected " +
                                std::to_string(want));
  }
  auto s = [&](int i) { return empty_check ? std::span<float>() : state[i]; };
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      const auto& c = std::get<AdamWConfig>(o.config);
      return AdamWUpdate(c, step, master, s(0), s(1), grad, copy_out,
                         c.amsgrad ? s(2) : std::span<float>());
    }
    case OptimizerKind::kAdagrad:
      return AdagradUpdate(std::get<AdagradConfig>(o.config), step, master, s(0), grad, copy_out);
    case OptimizerKind::kLion:
      return LionUpdate(std::get<LionConfig>(o.config), step, master, s(0), grad, copy_out);
    case OptimizerKind::kSgd:
      return SgdUpdate(std::get<SgdConfig>(o.config), step, master,
                       want ? s(0) : std::span<float>(), grad, copy_out);
  }
  return InvalidArgumentError("unknown optimizer kind " + std::to_string(static_cast<int>(o.kind)));
}

}  // namespace strata::cpu_optim
