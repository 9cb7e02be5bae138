// strata_optimizer: the C handle over the cpu_optim optimizers. Each optimizer kind
// is one OptimizerOps entry in kOptimizers (its config struct, its state buffers,
// how it validates and steps); adding an optimizer is adding one entry.
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <variant>
#include <vector>

#include "capi/capi_internal.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adamw.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/sgd.h"
#include "cpu_optim/threading.h"
#include "strata/strata.h"

namespace strata::capi {
namespace {

// The C++ hyper-parameters a handle holds, one alternative per config type.
using OptimizerConfig = std::variant<cpu_optim::AdamWConfig, cpu_optim::AdagradConfig,
                                     cpu_optim::LionConfig, cpu_optim::SgdConfig>;

// One strata_optimizer_step call, checked for null handle and dtypes.
struct StepArgs {
  int64_t step;
  float grad_scale;
  float* params;
  float* const* state;  // OptimizerOps::num_state(config) pointers
  cpu_optim::GradView grad;
  cpu_optim::CopyOut copy_out;
  size_t num_elems;
};

struct OptimizerOps {
  strata_optimizer_kind kind;
  const char* name;
  // State buffers the config needs, in the order the header documents.
  int (*num_state)(const OptimizerConfig& config);
  size_t config_size;  // sizeof the kind's C config struct
  // Converts and validates the C config (its struct_size already checked).
  Status (*parse_config)(const void* c_config, OptimizerConfig* out);
  Status (*step)(const OptimizerConfig& config, const StepArgs& args);
};

// --- AdamW and Adam -------------------------------------------------------------

Status ParseAdamW(const strata_adamw_config& c, bool decoupled, OptimizerConfig* out) {
  const cpu_optim::AdamWConfig config{.lr = c.lr,
                                      .beta1 = c.beta1,
                                      .beta2 = c.beta2,
                                      .eps = c.eps,
                                      .weight_decay = c.weight_decay,
                                      .decoupled_weight_decay = decoupled,
                                      .bias_correction = c.bias_correction != 0,
                                      .amsgrad = c.amsgrad != 0,
                                      .maximize = c.maximize != 0};
  // An empty update checks the hyper-parameters with cpu_optim's own rules (the
  // torch.optim ones) and touches nothing.
  STRATA_RETURN_IF_ERROR(cpu_optim::AdamWUpdate(config, cpu_optim::AdamWStep{}, {}, {}, {},
                                                cpu_optim::GradView{nullptr, DType::kF32}));
  *out = config;
  return Status::Ok();
}

Status ParseAdamWConfig(const void* c, OptimizerConfig* out) {
  return ParseAdamW(*static_cast<const strata_adamw_config*>(c), /*decoupled=*/true, out);
}
Status ParseAdamConfig(const void* c, OptimizerConfig* out) {
  return ParseAdamW(*static_cast<const strata_adamw_config*>(c), /*decoupled=*/false, out);
}

int NumStateAdamW(const OptimizerConfig& config) {
  return std::get<cpu_optim::AdamWConfig>(config).amsgrad ? 3 : 2;
}

Status StepAdamW(const OptimizerConfig& config, const StepArgs& a) {
  const size_t n = a.num_elems;
  const auto& c = std::get<cpu_optim::AdamWConfig>(config);
  return cpu_optim::AdamWUpdate(c, cpu_optim::AdamWStep{.step = a.step, .grad_scale = a.grad_scale},
                                std::span<float>(a.params, n), std::span<float>(a.state[0], n),
                                std::span<float>(a.state[1], n), a.grad, a.copy_out,
                                c.amsgrad ? std::span<float>(a.state[2], n) : std::span<float>());
}

// --- Adagrad --------------------------------------------------------------------

Status ParseAdagradConfig(const void* raw, OptimizerConfig* out) {
  const auto& c = *static_cast<const strata_adagrad_config*>(raw);
  const cpu_optim::AdagradConfig config{.lr = c.lr,
                                        .lr_decay = c.lr_decay,
                                        .weight_decay = c.weight_decay,
                                        .initial_accumulator_value = c.initial_accumulator_value,
                                        .eps = c.eps,
                                        .maximize = c.maximize != 0};
  STRATA_RETURN_IF_ERROR(cpu_optim::AdagradUpdate(config, cpu_optim::OptimStep{}, {}, {},
                                                  cpu_optim::GradView{nullptr, DType::kF32}));
  *out = config;
  return Status::Ok();
}

int NumStateOne(const OptimizerConfig&) { return 1; }

Status StepAdagrad(const OptimizerConfig& config, const StepArgs& a) {
  const size_t n = a.num_elems;
  return cpu_optim::AdagradUpdate(std::get<cpu_optim::AdagradConfig>(config),
                                  cpu_optim::OptimStep{.step = a.step, .grad_scale = a.grad_scale},
                                  std::span<float>(a.params, n), std::span<float>(a.state[0], n),
                                  a.grad, a.copy_out);
}

// --- Lion -----------------------------------------------------------------------

Status ParseLionConfig(const void* raw, OptimizerConfig* out) {
  const auto& c = *static_cast<const strata_lion_config*>(raw);
  const cpu_optim::LionConfig config{.lr = c.lr,
                                     .beta1 = c.beta1,
                                     .beta2 = c.beta2,
                                     .weight_decay = c.weight_decay,
                                     .maximize = c.maximize != 0};
  STRATA_RETURN_IF_ERROR(cpu_optim::LionUpdate(config, cpu_optim::OptimStep{}, {}, {},
                                               cpu_optim::GradView{nullptr, DType::kF32}));
  *out = config;
  return Status::Ok();
}

Status StepLion(const OptimizerConfig& config, const StepArgs& a) {
  const size_t n = a.num_elems;
  return cpu_optim::LionUpdate(std::get<cpu_optim::LionConfig>(config),
                               cpu_optim::OptimStep{.step = a.step, .grad_scale = a.grad_scale},
                               std::span<float>(a.params, n), std::span<float>(a.state[0], n),
                               a.grad, a.copy_out);
}

// --- SGD ------------------------------------------------------------------------

Status ParseSgdConfig(const void* raw, OptimizerConfig* out) {
  const auto& c = *static_cast<const strata_sgd_config*>(raw);
  const cpu_optim::SgdConfig config{.lr = c.lr,
                                    .momentum = c.momentum,
                                    .dampening = c.dampening,
                                    .weight_decay = c.weight_decay,
                                    .nesterov = c.nesterov != 0,
                                    .maximize = c.maximize != 0};
  STRATA_RETURN_IF_ERROR(cpu_optim::SgdUpdate(config, cpu_optim::OptimStep{}, {}, {},
                                              cpu_optim::GradView{nullptr, DType::kF32}));
  *out = config;
  return Status::Ok();
}

int NumStateSgd(const OptimizerConfig& config) {
  return std::get<cpu_optim::SgdConfig>(config).momentum != 0.0f ? 1 : 0;
}

Status StepSgd(const OptimizerConfig& config, const StepArgs& a) {
  const size_t n = a.num_elems;
  const auto& c = std::get<cpu_optim::SgdConfig>(config);
  return cpu_optim::SgdUpdate(
      c, cpu_optim::OptimStep{.step = a.step, .grad_scale = a.grad_scale},
      std::span<float>(a.params, n),
      c.momentum != 0.0f ? std::span<float>(a.state[0], n) : std::span<float>(), a.grad,
      a.copy_out);
}

constexpr OptimizerOps kOptimizers[] = {
    {STRATA_OPTIMIZER_ADAMW, "AdamW", NumStateAdamW, sizeof(strata_adamw_config), ParseAdamWConfig,
     StepAdamW},
    {STRATA_OPTIMIZER_ADAM, "Adam", NumStateAdamW, sizeof(strata_adamw_config), ParseAdamConfig,
     StepAdamW},
    {STRATA_OPTIMIZER_ADAGRAD, "Adagrad", NumStateOne, sizeof(strata_adagrad_config),
     ParseAdagradConfig, StepAdagrad},
    {STRATA_OPTIMIZER_LION, "Lion", NumStateOne, sizeof(strata_lion_config), ParseLionConfig,
     StepLion},
    {STRATA_OPTIMIZER_SGD, "SGD", NumStateSgd, sizeof(strata_sgd_config), ParseSgdConfig, StepSgd},
};

const OptimizerOps* FindOps(strata_optimizer_kind kind) {
  for (const OptimizerOps& ops : kOptimizers) {
    if (ops.kind == kind) return &ops;
  }
  return nullptr;
}

// Checks that config points to the kind's struct (by its leading struct_size).
Status ParseConfig(const OptimizerOps& ops, const void* config, OptimizerConfig* out) {
  if (config == nullptr) {
    return InvalidArgumentError(fmt::format("{}: config is NULL", ops.name));
  }
  size_t struct_size;
  static_assert(offsetof(strata_adamw_config, struct_size) == 0 &&
                offsetof(strata_adagrad_config, struct_size) == 0 &&
                offsetof(strata_lion_config, struct_size) == 0 &&
                offsetof(strata_sgd_config, struct_size) == 0);
  std::memcpy(&struct_size, config, sizeof(struct_size));
  if (struct_size != ops.config_size) {
    return InvalidArgumentError(
        fmt::format("{}: config->struct_size is {}, expected {}: initialize the config with its "
                    "strata_*_config_init function, and pass the struct that belongs to this kind",
                    ops.name, struct_size, ops.config_size));
  }
  return ops.parse_config(config, out);
}

}  // namespace
}  // namespace strata::capi

// The handle: hyper-parameters and threading; no tensor memory.
struct strata_optimizer {
  const strata::capi::OptimizerOps* ops;
  strata::capi::OptimizerConfig config;
  // Private arena when num_threads > 0 or cores are given; nullptr runs in the
  // caller's arena.
  std::unique_ptr<strata::cpu_optim::WorkerArena> arena;
};

extern "C" {

void strata_adamw_config_init(strata_adamw_config* config) {
  if (config == nullptr) return;
  *config = strata_adamw_config{};
  config->struct_size = sizeof(strata_adamw_config);
  config->lr = 1e-3f;
  config->beta1 = 0.9f;
  config->beta2 = 0.999f;
  config->eps = 1e-8f;
  config->weight_decay = 1e-2f;
  config->bias_correction = 1;
  config->amsgrad = 0;
  config->maximize = 0;
}

void strata_adagrad_config_init(strata_adagrad_config* config) {
  if (config == nullptr) return;
  *config = strata_adagrad_config{};
  config->struct_size = sizeof(strata_adagrad_config);
  config->lr = 1e-2f;
  config->lr_decay = 0.0f;
  config->weight_decay = 0.0f;
  config->initial_accumulator_value = 0.0f;
  config->eps = 1e-10f;
  config->maximize = 0;
}

void strata_lion_config_init(strata_lion_config* config) {
  if (config == nullptr) return;
  *config = strata_lion_config{};
  config->struct_size = sizeof(strata_lion_config);
  config->lr = 1e-4f;
  config->beta1 = 0.9f;
  config->beta2 = 0.99f;
  config->weight_decay = 0.0f;
  config->maximize = 0;
}

void strata_sgd_config_init(strata_sgd_config* config) {
  if (config == nullptr) return;
  *config = strata_sgd_config{};
  config->struct_size = sizeof(strata_sgd_config);
  config->lr = 1e-3f;
  config->momentum = 0.0f;
  config->dampening = 0.0f;
  config->weight_decay = 0.0f;
  config->nesterov = 0;
  config->maximize = 0;
}

void strata_optimizer_options_init(strata_optimizer_options* options) {
  if (options == nullptr) return;
  *options = strata_optimizer_options{};
  options->struct_size = sizeof(strata_optimizer_options);
  options->num_threads = 0;
  options->cores = nullptr;
  options->num_cores = 0;
}

strata_status strata_optimizer_create(strata_optimizer_kind kind, const void* config,
                                      const strata_optimizer_options* options,
                                      strata_optimizer** out) {
  using namespace strata;
  using namespace strata::capi;
  if (out != nullptr) *out = nullptr;
  return Guard([&]() -> Status {
    if (out == nullptr) return InvalidArgumentError("strata_optimizer_create: out is NULL");
    const OptimizerOps* ops = FindOps(kind);
    if (ops == nullptr) {
      return InvalidArgumentError(
          fmt::format("strata_optimizer_create: unknown optimizer kind {} (this library has "
                      "STRATA_OPTIMIZER_ADAMW, _ADAM, _ADAGRAD, _LION and _SGD)",
                      static_cast<int>(kind)));
    }
    strata_optimizer_options opts;
    strata_optimizer_options_init(&opts);
    if (options != nullptr) {
      // The 0.1.0 struct ended after num_threads; its callers get no binding.
      constexpr size_t kSize010 = offsetof(strata_optimizer_options, cores);
      if (options->struct_size != sizeof(strata_optimizer_options) &&
          options->struct_size != kSize010) {
        return InvalidArgumentError(
            fmt::format("strata_optimizer_create: options->struct_size is {}, expected {}: "
                        "initialize options with strata_optimizer_options_init",
                        options->struct_size, sizeof(strata_optimizer_options)));
      }
      std::memcpy(&opts, options, options->struct_size);
      opts.struct_size = sizeof(strata_optimizer_options);
    }
    if (opts.num_threads < 0) {
      return InvalidArgumentError(
          fmt::format("strata_optimizer_create: num_threads must be >= 0 (0 = all CPUs), got {}",
                      opts.num_threads));
    }
    if (opts.num_cores < 0 || (opts.num_cores > 0 && opts.cores == nullptr)) {
      return InvalidArgumentError(
          fmt::format("strata_optimizer_create: cores must list num_cores >= 0 ids, got "
                      "num_cores {} and cores {}",
                      opts.num_cores, opts.cores == nullptr ? "NULL" : "set"));
    }
    auto handle = std::make_unique<strata_optimizer>();
    handle->ops = ops;
    STRATA_RETURN_IF_ERROR(ParseConfig(*ops, config, &handle->config));
    if (opts.num_threads > 0 || opts.num_cores > 0) {
      cpu_optim::ThreadingOptions threading{
          .num_threads = opts.num_threads,
          .cores = std::vector<int>(opts.cores, opts.cores + opts.num_cores)};
      STRATA_ASSIGN_OR_RETURN(handle->arena, cpu_optim::WorkerArena::Create(threading));
    }
    *out = handle.release();
    return Status::Ok();
  });
}

void strata_optimizer_destroy(strata_optimizer* optimizer) { delete optimizer; }

strata_status strata_optimizer_set_config(strata_optimizer* optimizer, const void* config) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    if (optimizer == nullptr) {
      return InvalidArgumentError("strata_optimizer_set_config: optimizer is NULL");
    }
    OptimizerConfig parsed;
    STRATA_RETURN_IF_ERROR(ParseConfig(*optimizer->ops, config, &parsed));
    optimizer->config = parsed;
    return Status::Ok();
  });
}

strata_optimizer_kind strata_optimizer_get_kind(const strata_optimizer* optimizer) {
  return optimizer == nullptr ? static_cast<strata_optimizer_kind>(0) : optimizer->ops->kind;
}

int strata_optimizer_num_state(const strata_optimizer* optimizer) {
  return optimizer == nullptr ? 0 : optimizer->ops->num_state(optimizer->config);
}

strata_status strata_optimizer_step(const strata_optimizer* optimizer, int64_t step,
                                    float grad_scale, float* params, float* const* state,
                                    int num_state, const void* grad, strata_dtype grad_dtype,
                                    void* copy_out, strata_dtype copy_out_dtype,
                                    int64_t num_elems) {
  using namespace strata;
  using namespace strata::capi;
  return Guard([&]() -> Status {
    if (optimizer == nullptr) {
      return InvalidArgumentError("strata_optimizer_step: optimizer is NULL");
    }
    const OptimizerOps& ops = *optimizer->ops;
    if (num_elems < 0) {
      return InvalidArgumentError(
          fmt::format("{} step: num_elems must be >= 0, got {}", ops.name, num_elems));
    }
    const int expected_state = ops.num_state(optimizer->config);
    if (num_state != expected_state) {
      return InvalidArgumentError(fmt::format("{} step: num_state is {}, expected {}", ops.name,
                                              num_state, expected_state));
    }
    if (state == nullptr && num_state > 0) {
      return InvalidArgumentError(fmt::format("{} step: state is NULL", ops.name));
    }
    const auto gd = ToDType(grad_dtype);
    if (!gd) return BadDType("strata_optimizer_step grad_dtype", grad_dtype);
    StepArgs args{.step = step,
                  .grad_scale = grad_scale,
                  .params = params,
                  .state = state,
                  .grad = cpu_optim::GradView{grad, *gd},
                  .copy_out = {},
                  .num_elems = static_cast<size_t>(num_elems)};
    if (copy_out != nullptr) {
      const auto od = ToDType(copy_out_dtype);
      if (!od) return BadDType("strata_optimizer_step copy_out_dtype", copy_out_dtype);
      args.copy_out = cpu_optim::CopyOut{copy_out, *od};
    }
    if (optimizer->arena == nullptr) return ops.step(optimizer->config, args);
    Status status;
    optimizer->arena->Execute([&] { status = ops.step(optimizer->config, args); });
    return status;
  });
}

}  // extern "C"
