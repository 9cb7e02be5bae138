// strata_optimizer: the C handle over the cpu_optim optimizers. A handle holds one
// cpu_optim::AnyOptimizer (its config parsed by capi/optimizer_configs.h, shared with the
// offload optimizer's groups) and steps it with cpu_optim::Update.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <climits>
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

namespace strata::capi {
namespace {

// The most elements of one tensor: far past any memory, and low enough that no byte count of its
// state (a few bytes an element) overflows.
constexpr int64_t kMaxTensorElems = int64_t{1} << 50;

// shape[0..ndim) checked: ndim >= 0, every dimension > 0, the product at most kMaxTensorElems.
StatusOr<std::vector<int64_t>> ParseShape(const char* call, const int64_t* shape, int ndim) {
  if (ndim < 0 || (ndim > 0 && shape == nullptr)) {
    return InvalidArgumentError(
        fmt::format("{}: shape must list ndim >= 0 dimensions, got ndim {} "
                    "and shape {}",
                    call, ndim, shape == nullptr ? "NULL" : "set"));
  }
  std::vector<int64_t> dims(shape, shape + ndim);
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    if (dims[i] <= 0 || dims[i] > kMaxTensorElems / n) {
      return InvalidArgumentError(
          fmt::format("{}: dimension {} of the shape is {}; each must be > 0 (and the product "
                      "at most 2^50 elements)",
                      call, i, dims[i]));
    }
    n *= dims[i];
  }
  return dims;
}

}  // namespace
}  // namespace strata::capi

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

void strata_adafactor_config_init(strata_adafactor_config* config) {
  if (config == nullptr) return;
  const strata::cpu_optim::AdafactorConfig d;
  *config = strata_adafactor_config{};
  config->struct_size = sizeof(strata_adafactor_config);
  config->lr = d.lr;
  config->eps1 = d.eps1;
  config->eps2 = d.eps2;
  config->clip_threshold = d.clip_threshold;
  config->decay_rate = d.decay_rate;
  config->beta1 = d.beta1;
  config->weight_decay = d.weight_decay;
  config->relative_step = d.relative_step ? 1 : 0;
  config->scale_parameter = d.scale_parameter ? 1 : 0;
  config->warmup_init = d.warmup_init ? 1 : 0;
  config->maximize = d.maximize ? 1 : 0;
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
    if (opt.kind == cpu_optim::OptimizerKind::kAdamW8bit ||
        opt.kind == cpu_optim::OptimizerKind::kAdafactor) {
      return InvalidArgumentError(
          fmt::format("{} step: its state is not one fp32 buffer per parameter: step it with "
                      "strata_optimizer_step_state (layout: strata_optimizer_state_layout)",
                      name));
    }
    const int expected_state = cpu_optim::NumState(opt);
    if (num_state != expected_state) {
      return InvalidArgumentError(
          fmt::format("{} step: num_state is {}, expected {}", name, num_state, expected_state));
    }
    constexpr const char* kCall = "strata_optimizer_step";
    STRATA_RETURN_IF_ERROR(CheckBuffer(kCall, "params", params, num_elems));
    STRATA_RETURN_IF_ERROR(CheckBuffer(kCall, "grad", grad, num_elems));
    if (state == nullptr && num_state > 0 && num_elems > 0) {
      return InvalidArgumentError(fmt::format(
          "{}: state is NULL with num_state {} and num_elems {}", kCall, num_state, num_elems));
    }
    for (int i = 0; state != nullptr && i < num_state; ++i) {
      STRATA_RETURN_IF_ERROR(
          CheckBuffer(kCall, fmt::format("state[{}] ({})", i, cpu_optim::StateName(opt, i)),
                      state[i], num_elems));
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
    for (int i = 0; state != nullptr && i < num_state; ++i)
      spans[i] = std::span<float>(state[i], n);
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

strata_status strata_optimizer_state_layout(const strata_optimizer* optimizer, const int64_t* shape,
                                            int ndim, strata_state_section* sections,
                                            int max_sections, int* num_sections) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_optimizer_state_layout";
  return Guard([&]() -> Status {
    if (optimizer == nullptr)
      return InvalidArgumentError(fmt::format("{}: optimizer is NULL", kCall));
    if (num_sections == nullptr) {
      return InvalidArgumentError(fmt::format("{}: num_sections is NULL", kCall));
    }
    if (max_sections < 0 || (max_sections > 0 && sections == nullptr)) {
      return InvalidArgumentError(fmt::format(
          "{}: sections must hold max_sections >= 0 entries, got max_sections {} and sections {}",
          kCall, max_sections, sections == nullptr ? "NULL" : "set"));
    }
    STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> dims, ParseShape(kCall, shape, ndim));
    const std::vector<std::vector<int64_t>> shapes = {dims};
    const std::vector<cpu_optim::StateSpec> layout =
        cpu_optim::StateLayout(optimizer->optimizer, shapes);
    *num_sections = static_cast<int>(layout.size());
    for (int i = 0; i < std::min<int>(max_sections, static_cast<int>(layout.size())); ++i) {
      sections[i] = ToCSection(layout[i]);
    }
    return Status::Ok();
  });
}

strata_status strata_optimizer_init_state(const strata_optimizer* optimizer, const int64_t* shape,
                                          int ndim, void* const* state, int num_sections) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_optimizer_init_state";
  return Guard([&]() -> Status {
    if (optimizer == nullptr)
      return InvalidArgumentError(fmt::format("{}: optimizer is NULL", kCall));
    STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> dims, ParseShape(kCall, shape, ndim));
    const std::vector<std::vector<int64_t>> shapes = {dims};
    const std::vector<cpu_optim::StateSpec> layout =
        cpu_optim::StateLayout(optimizer->optimizer, shapes);
    if (num_sections != static_cast<int>(layout.size())) {
      return InvalidArgumentError(fmt::format("{}: num_sections is {}, the layout has {}", kCall,
                                              num_sections, layout.size()));
    }
    for (size_t i = 0; i < layout.size(); ++i) {
      if (state == nullptr || state[i] == nullptr) {
        return InvalidArgumentError(
            fmt::format("{}: the buffer of section '{}' is NULL", kCall, layout[i].name));
      }
      // fp32 sections are written as floats (8-bit codes need no alignment), as step_state reads
      // them.
      if (layout[i].dtype == cpu_optim::StateDType::kF32 &&
          reinterpret_cast<uintptr_t>(state[i]) % alignof(float) != 0) {
        return InvalidArgumentError(fmt::format(
            "{}: the buffer of fp32 section '{}' is not 4-byte aligned", kCall, layout[i].name));
      }
    }
    for (size_t i = 0; i < layout.size(); ++i) {
      cpu_optim::InitializeState(
          layout[i], std::span(static_cast<std::byte*>(state[i]), layout[i].size_bytes()));
    }
    return Status::Ok();
  });
}

strata_status strata_optimizer_step_state(const strata_optimizer* optimizer, int64_t step,
                                          float grad_scale, float* params, const int64_t* shape,
                                          int ndim, void* const* state,
                                          const int64_t* state_size_bytes, int num_sections,
                                          const void* grad, strata_dtype grad_dtype, void* copy_out,
                                          strata_dtype copy_out_dtype) {
  using namespace strata;
  using namespace strata::capi;
  constexpr const char* kCall = "strata_optimizer_step_state";
  return Guard([&]() -> Status {
    if (optimizer == nullptr)
      return InvalidArgumentError(fmt::format("{}: optimizer is NULL", kCall));
    const cpu_optim::AnyOptimizer& opt = optimizer->optimizer;
    STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> dims, ParseShape(kCall, shape, ndim));
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    STRATA_RETURN_IF_ERROR(CheckBuffer(kCall, "params", params, n));
    STRATA_RETURN_IF_ERROR(CheckBuffer(kCall, "grad", grad, n));
    if (num_sections < 0 ||
        (num_sections > 0 && (state == nullptr || state_size_bytes == nullptr))) {
      return InvalidArgumentError(
          fmt::format("{}: state and state_size_bytes must hold num_sections >= 0 entries, got {}",
                      kCall, num_sections));
    }
    const auto gd = ToDType(grad_dtype);
    if (!gd) return BadDType("strata_optimizer_step_state grad_dtype", grad_dtype);
    cpu_optim::CopyOut out;
    if (copy_out != nullptr) {
      const auto od = ToDType(copy_out_dtype);
      if (!od) return BadDType("strata_optimizer_step_state copy_out_dtype", copy_out_dtype);
      out = cpu_optim::CopyOut{copy_out, *od};
    }
    std::vector<std::span<std::byte>> spans;
    for (int i = 0; i < num_sections; ++i) {
      if (state[i] == nullptr || state_size_bytes[i] < 0) {
        return InvalidArgumentError(fmt::format(
            "{}: section {} is NULL or has a negative size ({})", kCall, i, state_size_bytes[i]));
      }
      spans.emplace_back(static_cast<std::byte*>(state[i]),
                         static_cast<size_t>(state_size_bytes[i]));
    }
    const std::vector<std::vector<int64_t>> shapes = {dims};
    auto run = [&] {
      return cpu_optim::UpdateState(opt,
                                    cpu_optim::OptimStep{.step = step, .grad_scale = grad_scale},
                                    shapes, std::span<float>(params, static_cast<size_t>(n)), spans,
                                    cpu_optim::GradView{grad, *gd}, out)
          .WithContext(kCall);
    };
    if (optimizer->arena == nullptr) return run();
    Status status;
    optimizer->arena->Execute([&] { status = run(); });
    return status;
  });
}

}  // extern "C"
