// One optimizer of any kind behind one interface: the kind, its hyper-parameters and its state
// buffers, for code that holds optimizers chosen at run time (the offload optimizer's parameter
// groups, the C API's strata_optimizer handle).
//
// Kinds and their state buffers, in this order (the names are torch.optim's state keys):
//   kAdamW, kAdam  exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)     adamw.h
//   kAdagrad       sum (starts at initial_accumulator_value)                 adagrad.h
//   kLion          exp_avg                                                   lion.h
//   kSgd           momentum_buffer when momentum != 0, none otherwise        sgd.h
// Every state buffer starts at InitialStateValue (0 except Adagrad's sum).
//
// Update() is the kind's XxxUpdate (same numerics, threading and errors: optimizer.h); the kind
// decides how many state spans it takes (NumState). Thread-safety: a const AnyOptimizer may be
// used from several threads at once.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <variant>

#include "base/status.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/optimizer.h"
#include "cpu_optim/sgd.h"

namespace strata::cpu_optim {

// Values are those of the C API's strata_optimizer_kind (include/strata/strata.h).
enum class OptimizerKind : int { kAdamW = 1, kAdam = 2, kAdagrad = 3, kLion = 4, kSgd = 5 };

using OptimizerConfig = std::variant<AdamWConfig, AdagradConfig, LionConfig, SgdConfig>;

struct AnyOptimizer {
  OptimizerKind kind = OptimizerKind::kAdamW;
  // The kind's config: AdamWConfig for kAdamW (decoupled_weight_decay true) and kAdam (false),
  // AdagradConfig, LionConfig, SgdConfig.
  OptimizerConfig config = AdamWConfig{};
};

// "AdamW", "Adam", "Adagrad", "Lion", "SGD"; "unknown" for a value outside the enum.
std::string_view OptimizerKindName(OptimizerKind kind);

// kInvalidArgument when the config alternative does not belong to the kind, or a
// hyper-parameter is one that torch.optim rejects (the message names it).
Status Validate(const AnyOptimizer& optimizer);

// The number of state buffers (0..3) and their names (torch.optim's state keys).
int NumState(const AnyOptimizer& optimizer);
std::string_view StateName(const AnyOptimizer& optimizer, int index);
// The value every element of state buffer `index` starts at.
float InitialStateValue(const AnyOptimizer& optimizer, int index);

// One step over master.size() elements: state holds NumState(optimizer) spans of that length
// (kInvalidArgument otherwise). As the kind's XxxUpdate (optimizer.h).
Status Update(const AnyOptimizer& optimizer, const OptimStep& step, std::span<float> master,
              std::span<const std::span<float>> state, GradView grad, CopyOut copy_out = {});

}  // namespace strata::cpu_optim
