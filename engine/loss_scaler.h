// Dynamic loss scaling for fp16 training, as in Micikevicius et al., "Mixed
// Precision Training", ICLR 2018: multiply the loss by a scale so small
// gradients survive fp16; on an overflow (inf/nan in any gradient) skip the
// step and halve the scale; after `growth_interval` clean steps double it.
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
  int64_t growth_interval = 1000;  // clean steps before growing
};

// Not thread-safe; owned by the engine's step thread.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScalerOptions& o) : o_(o), scale_(o.initial_scale) {}
  float scale() const { return scale_; }
  int64_t overflows() const { return overflows_; }
  // Clean steps since the last overflow or growth (the growth counter).
  int64_t clean_steps() const { return clean_steps_; }
  // Restores the state saved in a checkpoint (scale, growth counter, overflow count).
  void Restore(float scale, int64_t clean_steps, int64_t overflows) {
    scale_ = scale;
    clean_steps_ = clean_steps;
    overflows_ = overflows;
  }
  // Call once per optimizer step with whether any gradient was non-finite.
  // Returns true when the step must be skipped.
  bool Update(bool overflow) {
    if (overflow) {
      ++overflows_;
      clean_steps_ = 0;
      if (o_.dynamic) scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
      return true;
    }
    if (o_.dynamic && ++clean_steps_ >= o_.growth_interval) {
      clean_steps_ = 0;
      scale_ = std::min(o_.max_scale, scale_ * o_.growth_factor);
    }
    return false;
  }

 private:
  LossScalerOptions o_;
  float scale_;
  int64_t clean_steps_ = 0;
  int64_t overflows_ = 0;
};

}  // namespace strata::engine
