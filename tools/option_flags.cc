#include "tools/option_flags.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

namespace strata::tools {

namespace {

// A validator that refuses a value that is not a finite number, or one `ok` refuses, saying
// "must be WHAT, got VALUE".
CLI::Validator NumberCheck(bool (*ok)(double), std::string_view what, std::string name) {
  return CLI::Validator(
      [ok, what = std::string(what)](std::string& value) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(value.c_str(), &end);
        if (end == value.c_str() || *end != '\0') return value + " is not a number";
        if (!std::isfinite(x)) return value + " is not a finite number";
        return ok(x) ? std::string() : "must be " + what + ", got " + value;
      },
      std::move(name));
}

}  // namespace

CLI::Validator PositiveNumber() {
  return NumberCheck([](double x) { return x > 0; }, "> 0", "POSITIVE");
}

CLI::Validator NonNegativeNumber() {
  return NumberCheck([](double x) { return x >= 0; }, ">= 0", "NONNEGATIVE");
}
namespace {

// Engine option (PlacementOptions, EngineOptions, PlanRequest fields) -> the flag of `strata
// train`/`estimate` that sets it.
constexpr std::array<std::pair<std::string_view, std::string_view>, 18> kOptionFlags = {{
    {"device_budget", "--device-budget"},
    {"host_budget", "--host-budget"},
    {"pinned_budget", "--pinned-budget"},
    {"param_home", "--offload-params"},
    {"optimizer_home", "--offload-optimizer"},
    {"optimizer_device_fraction", "--optimizer-device-fraction"},
    {"nvme_paths", "--nvme-path"},
    {"schedule", "--schedule"},
    {"micro_batch", "--micro-batch-size/--seq-len"},
    {"grad_accum_steps", "--grad-accum-steps"},
    {"update_during_backward", "--update-during-backward"},
    {"optimizer", "--optimizer"},
    {"precision", "--precision"},
    {"host_grad_buckets", "--grad-buckets"},
    {"optimizer_buffers", "--optimizer-buffers"},
    {"offload_activations", "--offload-activations"},
    {"activation_checkpointing", "--activation-checkpointing"},
    {"machine", "--machine FILE"},
}};

}  // namespace

std::string_view FlagOfOption(std::string_view option) {
  for (const auto& [name, flag] : kOptionFlags) {
    if (name == option) return flag;
  }
  return {};
}

std::string InFlagTerms(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  size_t at = 0;
  while (at < message.size()) {
    const size_t open = message.find('`', at);
    const size_t close = open == std::string_view::npos ? open : message.find('`', open + 1);
    if (close == std::string_view::npos) {
      out.append(message.substr(at));
      break;
    }
    out.append(message.substr(at, open - at));
    const std::string_view inside = message.substr(open + 1, close - open - 1);
    const size_t name_end = inside.find(' ');
    const std::string_view name = inside.substr(0, name_end);
    const std::string_view flag = FlagOfOption(name);
    if (flag.empty()) {
      out.append(message.substr(open, close - open + 1));  // as written, backticks kept
    } else {
      out.append(flag);
      if (name_end != std::string_view::npos) out.append(inside.substr(name_end));
    }
    at = close + 1;
  }
  return out;
}

}  // namespace strata::tools
