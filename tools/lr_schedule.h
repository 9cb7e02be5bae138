// The learning-rate schedule of `strata train`: Strata's own (linear warmup, cosine decay to 10 %
// of the peak), a constant rate, or one of DeepSpeed's schedulers
// (deepspeed/runtime/lr_schedules.py, https://deepspeed.readthedocs.io/en/latest/schedulers.html)
// with their parameters and their step convention, so that a DeepSpeed config's `scheduler` section
// gives the rates DeepSpeed gives.
//
// Rates are per optimizer step, unitless (the optimizer's lr). Every function is pure and
// thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata::tools {

enum class LrScheduleKind {
  kCosine,          // Strata: linear warmup to peak over warmup_steps, cosine to 10 % at `steps`
  kConstant,        // peak at every step (DeepSpeed with an optimizer and no scheduler)
  kWarmupLR,        // DeepSpeed WarmupLR: warmup_min_lr -> peak over warmup_steps, then peak
  kWarmupDecayLR,   // DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to warmup_min_lr
  kWarmupCosineLR,  // DeepSpeed WarmupCosineLR: ratios of peak, cosine to cos_min_ratio
};

enum class WarmupType { kLog, kLinear };  // DeepSpeed's warmup_type

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kCosine;
  double peak_lr = 3e-3;       // kCosine/kConstant/kWarmupCosineLR: the optimizer's lr;
                               // kWarmupLR/kWarmupDecayLR: warmup_max_lr
  int64_t warmup_steps = 20;   // DeepSpeed: warmup_num_steps (used as max(2, warmup_steps))
  int64_t total_steps = 300;   // kCosine: --steps; DeepSpeed kinds: total_num_steps
  double warmup_min_lr = 0.0;  // kWarmupLR/kWarmupDecayLR
  WarmupType warmup_type = WarmupType::kLog;
  double warmup_min_ratio = 0.0;  // kWarmupCosineLR
  double cos_min_ratio = 1e-4;    // kWarmupCosineLR
};

// "cosine", "constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR".
std::string_view LrScheduleKindName(LrScheduleKind kind);
// The inverse; kInvalidArgument naming the accepted spellings (flag spellings "warmup",
// "warmup-decay", "warmup-cosine" are accepted too).
StatusOr<LrScheduleKind> ParseLrScheduleKind(std::string_view name);
StatusOr<WarmupType> ParseWarmupType(std::string_view name);  // "log" | "linear"

// The rate of 0-based optimizer step `step`.
//   kCosine: peak * (step + 1) / warmup_steps during warmup, then
//            peak * (0.1 + 0.45 * (1 + cos(pi * progress))), progress = (step - warmup) /
//            max(1, total - warmup) capped at 1.
//   DeepSpeed kinds follow DeepSpeed's convention: the scheduler starts at iteration -1 (its
//   constructor sets the rate of iteration -1) and is stepped after each optimizer step that was
//   not skipped, so `step` here counts the updates taken so far (the caller leaves out skipped
//   steps), and update k runs with iteration i = k - 1. With W = max(2, warmup_steps), T =
//   total_steps, g(i) = ln(i + 1) / ln(W) (log) or i / W (linear):
//     WarmupLR:       i < 0: min; i < W: min + (peak - min) * g(i); else peak
//     WarmupDecayLR:  as WarmupLR for i < W; else min + (peak - min) * max(0, (T - i) /
//                     max(1, T - W))  (stays at min after T)
//     WarmupCosineLR: i < 0: 0; i < W: peak * (warmup_min_ratio + (1 - warmup_min_ratio) * g(i));
//                     else peak * max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) /
//                     2) with p = min(1, (i - W + 1) / max(1, T - W))
double LearningRateAt(const LrSchedule& s, int64_t step);

// One line for the run's header, e.g. "WarmupDecayLR: 0 -> 3e-05 over 10 steps (linear), then
// linear decay to 0 at step 100".
std::string DescribeLrSchedule(const LrSchedule& s);
// The schedule's parameters as a JSON object text (for checkpoint manifests and summaries).
std::string LrScheduleJson(const LrSchedule& s, int64_t next_step);

}  // namespace strata::tools
