#include "capi/optimizer_configs.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace strata::capi {
namespace {

static_assert(
    static_cast<int>(cpu_optim::OptimizerKind::kAdamW) == STRATA_OPTIMIZER_ADAMW &&
        static_cast<int>(cpu_optim::OptimizerKind::kAdam) == STRATA_OPTIMIZER_ADAM &&
        static_cast<int>(cpu_optim::OptimizerKind::kAdagrad) == STRATA_OPTIMIZER_ADAGRAD &&
        static_cast<int>(cpu_optim::OptimizerKind::kLion) == STRATA_OPTIMIZER_LION &&
        static_cast<int>(cpu_optim::OptimizerKind::kSgd) == STRATA_OPTIMIZER_SGD &&
        static_cast<int>(cpu_optim::OptimizerKind::kAdamW8bit) == STRATA_OPTIMIZER_ADAMW8BIT &&
        static_cast<int>(cpu_optim::OptimizerKind::kAdafactor) == STRATA_OPTIMIZER_ADAFACTOR,
    "strata_optimizer_kind must mirror cpu_optim::OptimizerKind");
static_assert(offsetof(strata_adamw_config, struct_size) == 0 &&
              offsetof(strata_adagrad_config, struct_size) == 0 &&
              offsetof(strata_lion_config, struct_size) == 0 &&
              offsetof(strata_sgd_config, struct_size) == 0 &&
              offsetof(strata_adafactor_config, struct_size) == 0);

size_t ConfigSize(cpu_optim::OptimizerKind kind) {
  switch (kind) {
    case cpu_optim::OptimizerKind::kAdamW:
    case cpu_optim::OptimizerKind::kAdam:
    case cpu_optim::OptimizerKind::kAdamW8bit:
      return sizeof(strata_adamw_config);
    case cpu_optim::OptimizerKind::kAdafactor:
      return sizeof(strata_adafactor_config);
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
    case cpu_optim::OptimizerKind::kAdam:
    case cpu_optim::OptimizerKind::kAdamW8bit: {
      const auto& c = *static_cast<const strata_adamw_config*>(raw);
      return cpu_optim::AdamWConfig{
          .lr = c.lr,
          .beta1 = c.beta1,
          .beta2 = c.beta2,
          .eps = c.eps,
          .weight_decay = c.weight_decay,
          .decoupled_weight_decay = kind != cpu_optim::OptimizerKind::kAdam,
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
    case cpu_optim::OptimizerKind::kAdafactor: {
      const auto& c = *static_cast<const strata_adafactor_config*>(raw);
      return cpu_optim::AdafactorConfig{.lr = c.lr,
                                        .eps1 = c.eps1,
                                        .eps2 = c.eps2,
                                        .clip_threshold = c.clip_threshold,
                                        .decay_rate = c.decay_rate,
                                        .beta1 = c.beta1,
                                        .weight_decay = c.weight_decay,
                                        .relative_step = c.relative_step != 0,
                                        .scale_parameter = c.scale_parameter != 0,
                                        .warmup_init = c.warmup_init != 0,
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
    case STRATA_OPTIMIZER_ADAMW8BIT:
    case STRATA_OPTIMIZER_ADAFACTOR:
      return static_cast<cpu_optim::OptimizerKind>(kind);
  }
  return std::nullopt;
}

strata_state_section ToCSection(const cpu_optim::StateSpec& spec) {
  strata_state_section c{};
  const size_t n = std::min(spec.name.size(), sizeof(c.name) - 1);
  std::memcpy(c.name, spec.name.data(), n);
  c.name[n] = '\0';
  c.dtype = spec.dtype == cpu_optim::StateDType::kU8 ? STRATA_STATE_U8 : STRATA_STATE_F32;
  c.num_elems = spec.num_elems;
  c.size_bytes = static_cast<int64_t>(spec.size_bytes());
  c.initial_value = spec.initial_value;
  c.initial_code = spec.initial_code;
  return c;
}

Status BadOptimizerKind(const char* call, strata_optimizer_kind kind) {
  return InvalidArgumentError(
      fmt::format("{}: unknown optimizer kind {} (this library has STRATA_OPTIMIZER_ADAMW, _ADAM, "
                  "_ADAGRAD, _LION, _SGD, _ADAMW8BIT and _ADAFACTOR)",
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
