// Dynamic loss scaling for fp16 training, as in Micikevicius et al., "Mixed
// Precision Training", ICLR 2018: multiply the loss by a scale so small
// gradients survive fp16; on an overflow (inf/nan in any gradient) skip the
// step and halve the scale; after `growth_interval` clean steps double it.
// Hysteresis as in DeepSpeed's DynamicLossScaler (`fp16.hysteresis`,
// `fp16.consecutive_hysteresis`): with hysteresis h, the first h - 1 overflows
// only skip their steps and the h-th lowers the scale; the allowance is
// restored when the scale grows (or after every clean step when consecutive).
#pragma once

#include <algorithm>
#include <cstdint>

namespace strata::engine {

struct LossScalerOptions {
  bool dynamic = true;             // false: the scale stays at initial_scale
  float initial_scale = 65536.0f;  // 2^16
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  // 2^24
  float backoff_factor = 0.5f;
  float growth_factor = 2.0f;
  int64_t growth_interval = 1000;       // clean steps before growing
  int hysteresis = 1;                   // overflows until the scale is lowered; 1 = at the first
  bool consecutive_hysteresis = false;  // restore the allowance after every clean step
};

// Not thread-safe; owned by the engine's step thread.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScalerOptions& o)
      : o_(o), scale_(o.initial_scale), hysteresis_left_(std::max(1, o.hysteresis)) {}
  float scale() const { return scale_; }
  int64_t overflows() const { return overflows_; }
  // Clean steps since the last overflow or growth (the growth counter).
  int64_t clean_steps() const { return clean_steps_; }
  // Overflows left before the next one lowers the scale (1..hysteresis).
  int hysteresis_left() const { return hysteresis_left_; }
  // Restores the state saved in a checkpoint (scale, growth counter, overflow count, hysteresis
  // allowance; 0 = the full allowance, for checkpoints that predate hysteresis).
  void Restore(float scale, int64_t clean_steps, int64_t overflows, int hysteresis_left = 0) {
    scale_ = scale;
    clean_steps_ = clean_steps;
    overflows_ = overflows;
    hysteresis_left_ = hysteresis_left > 0 ? std::min(hysteresis_left, std::max(1, o_.hysteresis))
                                           : std::max(1, o_.hysteresis);
  }
  // Call once per optimizer step with whether any gradient was non-finite.
  // Returns true when the step must be skipped.
  bool Update(bool overflow) {
    if (overflow) {
      ++overflows_;
      clean_steps_ = 0;
      if (!o_.dynamic) return true;
      if (hysteresis_left_ <= 1) {
        scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
      } else {
        --hysteresis_left_;
      }
      return true;
    }
    if (!o_.dynamic) return false;
    if (o_.consecutive_hysteresis) hysteresis_left_ = std::max(1, o_.hysteresis);
    if (++clean_steps_ >= o_.growth_interval) {
      clean_steps_ = 0;
      hysteresis_left_ = std::max(1, o_.hysteresis);
      scale_ = std::min(o_.max_scale, scale_ * o_.growth_factor);
    }
    return false;
  }

 private:
  LossScalerOptions o_;
  float scale_;
  int64_t clean_steps_ = 0;
  int64_t overflows_ = 0;
  int hysteresis_left_;
};

}  // namespace strata::engine
