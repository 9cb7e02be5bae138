#include "capi/optimizer_configs.h"

#include <fmt/format.h>

#include <cstddef>
#include <cstring>

namespace strata::capi {
namespace {

static_assert(static_cast<int>(cpu_optim::OptimizerKind::kAdamW) == STRATA_OPTIMIZER_ADAMW &&
                  static_cast<int>(cpu_optim::OptimizerKind::kAdam) == STRATA_OPTIMIZER_ADAM &&
                  static_cast<int>(cpu_optim::OptimizerKind::kAdagrad) ==
                      STRATA_OPTIMIZER_ADAGRAD &&
                  static_cast<int>(cpu_optim::OptimizerKind::kLion) == STRATA_OPTIMIZER_LION &&
                  static_cast<int>(cpu_optim::OptimizerKind::kSgd) == STRATA_OPTIMIZER_SGD,
              "strata_optimizer_kind must mirror cpu_optim::OptimizerKind");
static_assert(offsetof(strata_adamw_config, struct_size) == 0 &&
              offsetof(strata_adagrad_config, struct_size) == 0 &&
              offsetof(strata_lion_config, struct_size) == 0 &&
              offsetof(strata_sgd_config, struct_size) == 0);

size_t ConfigSize(cpu_optim::OptimizerKind kind) {
  switch (kind) {
    case cpu_optim::OptimizerKind::kAdamW:
    case cpu_optim::OptimizerKind::kAdam:
      return sizeof(strata_adamw_config);
    case cpu_optim::OptimizerKind::kAdagrad:
      return sizeof(strata_adagrad_config);
    case cpu_optim::OptimizerKind::kLion:
      return sizeof(strata_lion_config);
    case cpu_optim::OptimizerKind::kSgd:
      return sizeof(strata_sgd_config);
  }
  return 0;
}

cpu_optim::OptimizerConfig Convert(cpu_optim::OptimizerKind kind, const void* raw) {
  switch (kind) {
    case cpu_optim::OptimizerKind::kAdamW:
    case cpu_optim::OptimizerKind::kAdam: {
      const auto& c = *static_cast<const strata_adamw_config*>(raw);
      return cpu_optim::AdamWConfig{
          .lr = c.lr,
          .beta1 = c.beta1,
          .beta2 = c.beta2,
          .eps = c.eps,
          .weight_decay = c.weight_decay,
          .decoupled_weight_decay = kind == cpu_optim::OptimizerKind::kAdamW,
          .bias_correction = c.bias_correction != 0,
          .amsgrad = c.amsgrad != 0,
          .maximize = c.maximize != 0};
    }
    case cpu_optim::OptimizerKind::kAdagrad: {
      const auto& c = *static_cast<const strata_adagrad_config*>(raw);
      return cpu_optim::AdagradConfig{.lr = c.lr,
                                      .lr_decay = c.lr_decay,
                                      .weight_decay = c.weight_decay,
                                      .initial_accumulator_value = c.initial_accumulator_value,
                                      .eps = c.eps,
                                      .maximize = c.maximize != 0};
    }
    case cpu_optim::OptimizerKind::kLion: {
      const auto& c = *static_cast<const strata_lion_config*>(raw);
      return cpu_optim::LionConfig{.lr = c.lr,
                                   .beta1 = c.beta1,
                                   .beta2 = c.beta2,
                                   .weight_decay = c.weight_decay,
                                   .maximize = c.maximize != 0};
    }
    case cpu_optim::OptimizerKind::kSgd: {
      const auto& c = *static_cast<const strata_sgd_config*>(raw);
      return cpu_optim::SgdConfig{.lr = c.lr,
                                  .momentum = c.momentum,
                                  .dampening = c.dampening,
                                  .weight_decay = c.weight_decay,
                                  .nesterov = c.nesterov != 0,
                                  .maximize = c.maximize != 0};
    }
  }
  return cpu_optim::AdamWConfig{};  // unreachable: ToOptimizerKind admits only the kinds above
}

}  // namespace

std::optional<cpu_optim::OptimizerKind> ToOptimizerKind(strata_optimizer_kind kind) {
  switch (kind) {
    case STRATA_OPTIMIZER_ADAMW:
    case STRATA_OPTIMIZER_ADAM:
    case STRATA_OPTIMIZER_ADAGRAD:
    case STRATA_OPTIMIZER_LION:
    case STRATA_OPTIMIZER_SGD:
      return static_cast<cpu_optim::OptimizerKind>(kind);
  }
  return std::nullopt;
}

Status BadOptimizerKind(const char* call, strata_optimizer_kind kind) {
  return InvalidArgumentError(
      fmt::format("{}: unknown optimizer kind {} (this library has STRATA_OPTIMIZER_ADAMW, _ADAM, "
                  "_ADAGRAD, _LION and _SGD)",
                  call, static_cast<int>(kind)));
}

StatusOr<cpu_optim::AnyOptimizer> ParseOptimizerConfig(cpu_optim::OptimizerKind kind,
                                                       const void* config) {
  const std::string_view name = cpu_optim::OptimizerKindName(kind);
  if (config == nullptr) return InvalidArgumentError(fmt::format("{}: config is NULL", name));
  size_t struct_size;
  std::memcpy(&struct_size, config, sizeof(struct_size));
  const size_t expected = ConfigSize(kind);
  if (struct_size != expected) {
    return InvalidArgumentError(
        fmt::format("{}: config->struct_size is {}, expected {}: initialize the config with its "
                    "strata_*_config_init function, and pass the struct that belongs to this kind",
                    name, struct_size, expected));
  }
  cpu_optim::AnyOptimizer optimizer{.kind = kind, .config = Convert(kind, config)};
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(optimizer));
  return optimizer;
}

}  // namespace strata::capi
