#include "tools/lr_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

namespace strata::tools {
namespace {

// DeepSpeed's warmup fraction at iteration i (0 <= i < W).
double WarmupGamma(const LrSchedule& s, int64_t i, int64_t w) {
  if (s.warmup_type == WarmupType::kLog) {
    return std::log(static_cast<double>(i + 1)) / std::log(static_cast<double>(w));
  }
  return static_cast<double>(i) / static_cast<double>(w);
}

std::string_view WarmupTypeName(WarmupType t) { return t == WarmupType::kLog ? "log" : "linear"; }

}  // namespace

std::string_view LrScheduleKindName(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kCosine:
      return "cosine";
    case LrScheduleKind::kConstant:
      return "constant";
    case LrScheduleKind::kWarmupLR:
      return "WarmupLR";
    case LrScheduleKind::kWarmupDecayLR:
      return "WarmupDecayLR";
    case LrScheduleKind::kWarmupCosineLR:
      return "WarmupCosineLR";
  }
  return "?";
}

StatusOr<LrScheduleKind> ParseLrScheduleKind(std::string_view name) {
  if (name == "cosine") return LrScheduleKind::kCosine;
  if (name == "constant") return LrScheduleKind::kConstant;
  if (name == "WarmupLR" || name == "warmup") return LrScheduleKind::kWarmupLR;
  if (name == "WarmupDecayLR" || name == "warmup-decay") return LrScheduleKind::kWarmupDecayLR;
  if (name == "WarmupCosineLR" || name == "warmup-cosine") return LrScheduleKind::kWarmupCosineLR;
  return InvalidArgumentError(
      fmt::format("learning-rate schedule '{}' is not one of cosine, constant, warmup (WarmupLR), "
                  "warmup-decay (WarmupDecayLR), warmup-cosine (WarmupCosineLR)",
                  name));
}

StatusOr<WarmupType> ParseWarmupType(std::string_view name) {
  if (name == "log") return WarmupType::kLog;
  if (name == "linear") return WarmupType::kLinear;
  return InvalidArgumentError(fmt::format("warmup type '{}' is not one of log, linear", name));
}

double LearningRateAt(const LrSchedule& s, int64_t step) {
  const double peak = s.peak_lr;
  switch (s.kind) {
    case LrScheduleKind::kConstant:
      return peak;
    case LrScheduleKind::kCosine: {
      if (step < s.warmup_steps) {
        return peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
      }
      const double span = static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
      const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
      return peak * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)));
    }
    default:
      break;
  }
  // DeepSpeed: the scheduler steps after the optimizer; step k runs with iteration k - 1.
  const int64_t i = step - 1;
  const int64_t w = std::max<int64_t>(2, s.warmup_steps);
  if (s.kind == LrScheduleKind::kWarmupCosineLR) {
    if (i < 0) return 0.0;  // DeepSpeed's constructor sets 0 for the first update
    if (i < w) {
      return peak * (s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * WarmupGamma(s, i, w));
    }
    const double progress =
        std::min(1.0, static_cast<double>(i - w + 1) /
                          static_cast<double>(std::max<int64_t>(1, s.total_steps - w)));
    const double cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
    return peak * std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
  }
  const double delta = peak - s.warmup_min_lr;
  if (i < 0) return s.warmup_min_lr;
  double gamma = 1.0;
  if (i < w) {
    gamma = WarmupGamma(s, i, w);
  } else if (s.kind == LrScheduleKind::kWarmupDecayLR) {
    gamma = std::max(0.0, static_cast<double>(s.total_steps - i) /
                              static_cast<double>(std::max<int64_t>(1, s.total_steps - w)));
  }
  return s.warmup_min_lr + delta * gamma;
}

std::string DescribeLrSchedule(const LrSchedule& s) {
  switch (s.kind) {
    case LrScheduleKind::kCosine:
      return fmt::format(
          "cosine: linear warmup to {:g} over {} steps, cosine decay to {:g} at step {}", s.peak_lr,
          s.warmup_steps, 0.1 * s.peak_lr, s.total_steps);
    case LrScheduleKind::kConstant:
      return fmt::format("constant: {:g}", s.peak_lr);
    case LrScheduleKind::kWarmupLR:
      return fmt::format("WarmupLR: {:g} -> {:g} over {} steps ({}), then constant",
                         s.warmup_min_lr, s.peak_lr, std::max<int64_t>(2, s.warmup_steps),
                         WarmupTypeName(s.warmup_type));
    case LrScheduleKind::kWarmupDecayLR:
      return fmt::format(
          "WarmupDecayLR: {:g} -> {:g} over {} steps ({}), then linear decay to {:g} at step {}",
          s.warmup_min_lr, s.peak_lr, std::max<int64_t>(2, s.warmup_steps),
          WarmupTypeName(s.warmup_type), s.warmup_min_lr, s.total_steps);
    case LrScheduleKind::kWarmupCosineLR:
      return fmt::format(
          "WarmupCosineLR: {:g} -> {:g} over {} steps ({}), then cosine decay to {:g} at step {}",
          s.peak_lr * s.warmup_min_ratio, s.peak_lr, std::max<int64_t>(2, s.warmup_steps),
          WarmupTypeName(s.warmup_type), s.peak_lr * s.cos_min_ratio, s.total_steps);
  }
  return "?";
}

std::string LrScheduleJson(const LrSchedule& s, int64_t next_step) {
  nlohmann::json j = {{"kind", LrScheduleKindName(s.kind)},
                      {"peak_lr", s.peak_lr},
                      {"warmup_steps", s.warmup_steps},
                      {"total_steps", s.total_steps},
                      {"next_step", next_step}};
  switch (s.kind) {
    case LrScheduleKind::kCosine:
      j["min_lr_ratio"] = 0.1;
      break;
    case LrScheduleKind::kWarmupLR:
    case LrScheduleKind::kWarmupDecayLR:
      j["warmup_min_lr"] = s.warmup_min_lr;
      j["warmup_type"] = WarmupTypeName(s.warmup_type);
      break;
    case LrScheduleKind::kWarmupCosineLR:
      j["warmup_min_ratio"] = s.warmup_min_ratio;
      j["cos_min_ratio"] = s.cos_min_ratio;
      j["warmup_type"] = WarmupTypeName(s.warmup_type);
      break;
    case LrScheduleKind::kConstant:
      break;
  }
  return j.dump();
}

}  // namespace strata::tools
