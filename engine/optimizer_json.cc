#include "engine/optimizer_json.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "base/untrusted_text.h"

namespace strata::engine {
namespace {

using Json = nlohmann::json;

// Every hyper-parameter of a config, by name, once: fn(name, field) for each; both the writer
// and the reader walk this list.
template <typename F>
void ForEachField(cpu_optim::AdamWConfig& c, F&& fn) {
  fn("lr", c.lr), fn("beta1", c.beta1), fn("beta2", c.beta2), fn("eps", c.eps);
  fn("weight_decay", c.weight_decay), fn("decoupled_weight_decay", c.decoupled_weight_decay);
  fn("bias_correction", c.bias_correction), fn("amsgrad", c.amsgrad), fn("maximize", c.maximize);
}
template <typename F>
void ForEachField(cpu_optim::AdagradConfig& c, F&& fn) {
  fn("lr", c.lr), fn("lr_decay", c.lr_decay), fn("weight_decay", c.weight_decay);
  fn("initial_accumulator_value", c.initial_accumulator_value), fn("eps", c.eps);
  fn("maximize", c.maximize);
}
template <typename F>
void ForEachField(cpu_optim::LionConfig& c, F&& fn) {
  fn("lr", c.lr), fn("beta1", c.beta1), fn("beta2", c.beta2);
  fn("weight_decay", c.weight_decay), fn("maximize", c.maximize);
}
template <typename F>
void ForEachField(cpu_optim::SgdConfig& c, F&& fn) {
  fn("lr", c.lr), fn("momentum", c.momentum), fn("dampening", c.dampening);
  fn("weight_decay", c.weight_decay), fn("nesterov", c.nesterov), fn("maximize", c.maximize);
}
template <typename F>
void ForEachField(cpu_optim::AdafactorConfig& c, F&& fn) {
  fn("lr", c.lr), fn("eps1", c.eps1), fn("eps2", c.eps2), fn("clip_threshold", c.clip_threshold);
  fn("decay_rate", c.decay_rate), fn("beta1", c.beta1), fn("weight_decay", c.weight_decay);
  fn("relative_step", c.relative_step), fn("scale_parameter", c.scale_parameter);
  fn("warmup_init", c.warmup_init), fn("maximize", c.maximize);
}

// The config alternative a kind takes, default-constructed.
cpu_optim::AnyOptimizer DefaultFor(cpu_optim::OptimizerKind kind) {
  cpu_optim::AnyOptimizer o;
  o.kind = kind;
  switch (kind) {
    case cpu_optim::OptimizerKind::kAdamW:
    case cpu_optim::OptimizerKind::kAdamW8bit:
      break;
    case cpu_optim::OptimizerKind::kAdafactor:
      o.config = cpu_optim::AdafactorConfig{};
      break;
    case cpu_optim::OptimizerKind::kAdam:
      o.adamw().decoupled_weight_decay = false;
      break;
    case cpu_optim::OptimizerKind::kAdagrad:
      o.config = cpu_optim::AdagradConfig{};
      break;
    case cpu_optim::OptimizerKind::kLion:
      o.config = cpu_optim::LionConfig{};
      break;
    case cpu_optim::OptimizerKind::kSgd:
      o.config = cpu_optim::SgdConfig{};
      break;
  }
  return o;
}

}  // namespace

Json OptimizerToJson(const cpu_optim::AnyOptimizer& optimizer) {
  cpu_optim::AnyOptimizer o = optimizer;
  Json j;
  j["kind"] = std::string(cpu_optim::OptimizerKindName(o.kind));
  std::visit([&](auto& c) { ForEachField(c, [&](const char* name, auto& v) { j[name] = v; }); },
             o.config);
  return j;
}

StatusOr<cpu_optim::AnyOptimizer> OptimizerFromJson(const Json& j, std::string_view where) {
  if (!j.is_object()) return DataLossError(fmt::format("{}: not a JSON object", where));
  const auto kind_it = j.find("kind");
  if (kind_it == j.end() || !kind_it->is_string()) {
    return DataLossError(fmt::format("{}: no \"kind\" string", where));
  }
  const std::string kind = kind_it->get<std::string>();
  for (int k = 1; k <= 16; ++k) {
    const auto candidate = static_cast<cpu_optim::OptimizerKind>(k);
    if (cpu_optim::OptimizerKindName(candidate) != kind) continue;
    cpu_optim::AnyOptimizer o = DefaultFor(candidate);
    Status status;
    std::visit(
        [&](auto& c) {
          ForEachField(c, [&](const char* name, auto& v) {
            using T = std::remove_reference_t<decltype(v)>;
            const auto it = j.find(name);
            const bool ok =
                it != j.end() && (std::is_same_v<T, bool> ? it->is_boolean() : it->is_number());
            if (!ok) {
              if (status.ok()) {
                status = DataLossError(fmt::format("{}: \"{}\" is missing or not a {}", where, name,
                                                   std::is_same_v<T, bool> ? "bool" : "number"));
              }
              return;
            }
            if constexpr (std::is_floating_point_v<T>) {
              // JSON holds no inf or NaN, but a number beyond T's range would become one.
              const double d = it->template get<double>();
              if (!(std::abs(d) <= static_cast<double>(std::numeric_limits<T>::max()))) {
                if (status.ok()) {
                  status = DataLossError(fmt::format("{}: \"{}\" = {} does not fit fp{}", where,
                                                     name, it->dump(), 8 * sizeof(T)));
                }
                return;
              }
              v = static_cast<T>(d);
            } else {
              v = it->template get<T>();
            }
          });
        },
        o.config);
    if (!status.ok()) return status;
    return o;
  }
  return DataLossError(fmt::format("{}: unknown optimizer kind '{}'", where, Excerpt(kind, 40)));
}

}  // namespace strata::engine
