#include "tools/optimizer_flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace strata::tools {

StatusOr<LrSchedule> MakeLrSchedule(const TrainFlags& f) {
  LrSchedule s;
  STRATA_ASSIGN_OR_RETURN(s.kind, ParseLrScheduleKind(f.lr_schedule));
  STRATA_ASSIGN_OR_RETURN(s.warmup_type, ParseWarmupType(f.warmup_type));
  s.peak_lr = PeakLearningRate(f);
  s.warmup_steps = f.warmup_steps;
  s.total_steps =
      s.kind == LrScheduleKind::kCosine || f.lr_total_steps <= 0 ? f.steps : f.lr_total_steps;
  s.warmup_min_lr = f.warmup_min_lr;
  s.warmup_min_ratio = f.warmup_min_ratio;
  s.cos_min_ratio = f.cos_min_ratio;
  return s;
}

float LearningRate(const TrainFlags& f, int64_t step) {  // step is 0-based
  auto s = MakeLrSchedule(f);
  return s.ok() ? static_cast<float>(LearningRateAt(*s, step)) : 0.0f;
}

double DefaultLearningRate(std::string_view optimizer) {
  if (optimizer == "adafactor") return 1.5e-3;
  if (optimizer == "lion") return 3e-4;
  if (optimizer == "sgd") return 0.1;
  if (optimizer == "adagrad") return 1e-2;
  return 3e-3;
}

double PeakLearningRate(const TrainFlags& f) {
  return f.lr > 0 ? f.lr : DefaultLearningRate(f.optimizer);
}

StatusOr<cpu_optim::AnyOptimizer> BuildOptimizer(const TrainFlags& f) {
  using cpu_optim::OptimizerKind;
  const auto lr = LearningRate(f, 0);
  const auto wd = static_cast<float>(f.weight_decay);
  const auto or_default = [](const std::optional<double>& v, double d) {
    return static_cast<float>(v.value_or(d));
  };
  cpu_optim::AnyOptimizer o;
  if (f.optimizer == "adamw" || f.optimizer == "adam" || f.optimizer == "adamw8bit") {
    cpu_optim::AdamWConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    c.beta1 = or_default(f.adam_beta1, 0.9);
    c.beta2 = or_default(f.adam_beta2, 0.999);
    c.eps = or_default(f.adam_eps, 1e-8);
    // "adam" is Adam with L2 weight decay; a config file may also ask for it (adam_w_mode).
    c.decoupled_weight_decay = f.optimizer != "adam" && f.adam_decoupled_weight_decay;
    c.bias_correction = f.adam_bias_correction;
    o.config = c;
    o.kind = f.optimizer == "adamw8bit" ? OptimizerKind::kAdamW8bit
             : c.decoupled_weight_decay ? OptimizerKind::kAdamW
                                        : OptimizerKind::kAdam;
  } else if (f.optimizer == "adafactor") {
    cpu_optim::AdafactorConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    c.beta1 = or_default(f.adam_beta1, 0.0);
    c.decay_rate = static_cast<float>(f.adafactor_decay_rate);
    c.clip_threshold = static_cast<float>(f.adafactor_clip_threshold);
    if (f.adam_eps) c.eps1 = static_cast<float>(*f.adam_eps);
    c.eps2 = static_cast<float>(f.adafactor_eps2);
    c.scale_parameter = f.adafactor_scale_parameter;
    o = {OptimizerKind::kAdafactor, c};
  } else if (f.optimizer == "lion") {
    cpu_optim::LionConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    c.beta1 = or_default(f.adam_beta1, 0.9);
    c.beta2 = or_default(f.adam_beta2, 0.99);
    o = {OptimizerKind::kLion, c};
  } else if (f.optimizer == "sgd") {
    cpu_optim::SgdConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    c.momentum = static_cast<float>(f.momentum);
    c.dampening = static_cast<float>(f.sgd_dampening);
    c.nesterov = f.sgd_nesterov;
    o = {OptimizerKind::kSgd, c};
  } else if (f.optimizer == "adagrad") {
    cpu_optim::AdagradConfig c;
    c.lr = lr;
    c.weight_decay = wd;
    c.eps = or_default(f.adam_eps, 1e-10);
    c.lr_decay = static_cast<float>(f.adagrad_lr_decay);
    c.initial_accumulator_value = static_cast<float>(f.adagrad_initial_accumulator);
    o = {OptimizerKind::kAdagrad, c};
  } else {
    return InvalidArgumentError(fmt::format(
        "--optimizer {} is not one of adamw, adam, adamw8bit, adafactor, lion, sgd, adagrad",
        f.optimizer));
  }
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(o).WithContext("--optimizer " + f.optimizer));
  return o;
}

}  // namespace strata::tools
