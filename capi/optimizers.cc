// strata_optimizer: the C handle over the cpu_optim optimizers. A handle holds one
// cpu_optim::AnyOptimizer (its config parsed by capi/optimizer_configs.h, shared with the
// offload optimizer's groups) and steps it with cpu_optim::Update.
#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "capi/capi_internal.h"
#include "capi/optimizer_configs.h"
#include "cpu_optim/any_optimizer.h"
#include "cpu_optim/threading.h"
#include "strata/strata.h"

// The handle: hyper-parameters and threading; no tensor memory.
struct strata_optimizer {
  strata::cpu_optim::AnyOptimizer optimizer;
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
    const auto cpp_kind = ToOptimizerKind(kind);
    if (!cpp_kind) return BadOptimizerKind("strata_optimizer_create", kind);
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
    STRATA_ASSIGN_OR_RETURN(handle->optimizer, ParseOptimizerConfig(*cpp_kind, config));
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
    STRATA_ASSIGN_OR_RETURN(cpu_optim::AnyOptimizer parsed,
                            ParseOptimizerConfig(optimizer->optimizer.kind, config));
    optimizer->optimizer = std::move(parsed);
    return Status::Ok();
  });
}

strata_optimizer_kind strata_optimizer_get_kind(const strata_optimizer* optimizer) {
  return optimizer == nullptr ? static_cast<strata_optimizer_kind>(0)
                              : static_cast<strata_optimizer_kind>(optimizer->optimizer.kind);
}

int strata_optimizer_num_state(const strata_optimizer* optimizer) {
  return optimizer == nullptr ? 0 : strata::cpu_optim::NumState(optimizer->optimizer);
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
    const cpu_optim::AnyOptimizer& opt = optimizer->optimizer;
    const std::string_view name = cpu_optim::OptimizerKindName(opt.kind);
    if (num_elems < 0) {
      return InvalidArgumentError(
          fmt::format("{} step: num_elems must be >= 0, got {}", name, num_elems));
    }
    const int expected_state = cpu_optim::NumState(opt);
    if (num_state != expected_state) {
      return InvalidArgumentError(
          fmt::format("{} step: num_state is {}, expected {}", name, num_state, expected_state));
    }
    if (state == nullptr && num_state > 0) {
      return InvalidArgumentError(fmt::format("{} step: state is NULL", name));
    }
    const auto gd = ToDType(grad_dtype);
    if (!gd) return BadDType("strata_optimizer_step grad_dtype", grad_dtype);
    cpu_optim::CopyOut out;
    if (copy_out != nullptr) {
      const auto od = ToDType(copy_out_dtype);
      if (!od) return BadDType("strata_optimizer_step copy_out_dtype", copy_out_dtype);
      out = cpu_optim::CopyOut{copy_out, *od};
    }
    const size_t n = static_cast<size_t>(num_elems);
    std::array<std::span<float>, 3> spans;
    for (int i = 0; i < num_state; ++i) spans[i] = std::span<float>(state[i], n);
    auto run = [&] {
      return cpu_optim::Update(opt, cpu_optim::OptimStep{.step = step, .grad_scale = grad_scale},
                               std::span<float>(params, n),
                               std::span<const std::span<float>>(spans.data(), num_state),
                               cpu_optim::GradView{grad, *gd}, out);
    };
    if (optimizer->arena == nullptr) return run();
    Status status;
    optimizer->arena->Execute([&] { status = run(); });
    return status;
  });
}

}  // extern "C"
