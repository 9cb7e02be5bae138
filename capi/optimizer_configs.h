// Internal to capi/: the C optimizer config structs of include/strata/strata.h
// (strata_adamw_config, ...) as cpu_optim::AnyOptimizer, validated with cpu_optim's
// rules. Shared by the strata_optimizer handle and the offload optimizer's groups, so
// both accept and reject exactly the same configs with the same messages.
#pragma once

#include <optional>

#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "strata/strata.h"

namespace strata::capi {

// The cpu_optim kind of a C kind (same values); nullopt for a value outside
// strata_optimizer_kind.
std::optional<cpu_optim::OptimizerKind> ToOptimizerKind(strata_optimizer_kind kind);

// A cpu_optim state section as the C struct (the name truncated to 47 bytes; none is longer).
strata_state_section ToCSection(const cpu_optim::StateSpec& spec);

// INVALID_ARGUMENT "<call>: unknown optimizer kind N (this library has ...)".
Status BadOptimizerKind(const char* call, strata_optimizer_kind kind);

// Reads config, which must point to the C struct of `kind` (strata_adamw_config for
// AdamW, Adam and AdamW8bit, strata_adagrad_config, strata_lion_config,
// strata_sgd_config, strata_adafactor_config) with
// its struct_size set, and validates the hyper-parameters (cpu_optim::Validate: the
// torch.optim rules). Errors, INVALID_ARGUMENT with a message naming the kind ("AdamW:
// ..."): NULL config, a struct_size that is not the kind's struct's (it says how to
// fix it), a rejected hyper-parameter. config is only read.
StatusOr<cpu_optim::AnyOptimizer> ParseOptimizerConfig(cpu_optim::OptimizerKind kind,
                                                       const void* config);

}  // namespace strata::capi
