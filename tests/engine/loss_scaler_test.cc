// DynamicLossScaler against a reference written here from DeepSpeed's published algorithm
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale: an iteration counter,
// the iteration of the last overflow, and a hysteresis countdown), on random overflow sequences.
#include "engine/loss_scaler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace strata::engine {
namespace {

// DeepSpeed's update rule, in its own terms (cur_iter, last_overflow_iter, cur_hysteresis).
struct ReferenceScaler {
  double scale, min_scale, factor = 2.0;
  int64_t window;
  int delayed_shift;
  bool consecutive;
  int64_t cur_iter = 0, last_overflow_iter = -1;
  int cur_hysteresis;

  ReferenceScaler(double s, double min_s, int64_t w, int h, bool c)
      : scale(s),
        min_scale(min_s),
        window(w),
        delayed_shift(h),
        consecutive(c),
        cur_hysteresis(h) {}

  void Update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        scale = std::max(scale / factor, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % window == 0) {
        if (!consecutive) cur_hysteresis = delayed_shift;
        scale *= factor;
      }
    }
    cur_iter += 1;
  }
};

struct Case {
  int hysteresis;
  bool consecutive;
  double overflow_rate;
};

class LossScalerHysteresis : public ::testing::TestWithParam<Case> {};

TEST_P(LossScalerHysteresis, FollowsDeepSpeedsScaleOnRandomOverflowSequences) {
  const Case c = GetParam();
  LossScalerOptions o;
  o.initial_scale = 65536.0f;
  o.min_scale = 1.0f;
  o.max_scale = 1e30f;  // DeepSpeed's scaler has no ceiling
  o.growth_interval = 4;
  o.hysteresis = c.hysteresis;
  o.consecutive_hysteresis = c.consecutive;
  DynamicLossScaler scaler(o);
  ReferenceScaler ref(o.initial_scale, o.min_scale, o.growth_interval, c.hysteresis, c.consecutive);
  std::mt19937_64 rng(1234 + c.hysteresis * 7 + c.consecutive);
  std::bernoulli_distribution overflow(c.overflow_rate);
  int lowered = 0;
  for (int i = 0; i < 2000; ++i) {
    const bool of = overflow(rng);
    const float before = scaler.scale();
    EXPECT_EQ(scaler.Update(of), of) << "step " << i;
    ref.Update(of);
    ASSERT_EQ(static_cast<double>(scaler.scale()), ref.scale) << "step " << i;
    lowered += scaler.scale() < before;
  }
  EXPECT_GT(lowered, 5);  // the sequences really exercise both directions
}

INSTANTIATE_TEST_SUITE_P(DeepSpeedCases, LossScalerHysteresis,
                         ::testing::Values(Case{1, false, 0.3}, Case{2, false, 0.3},
                                           Case{2, true, 0.3}, Case{3, false, 0.5},
                                           Case{3, true, 0.5}, Case{4, false, 0.7}));

TEST(LossScaler, HysteresisTwoSkipsTheFirstOverflowWithoutLoweringTheScale) {
  LossScalerOptions o;
  o.initial_scale = 1024.0f;
  o.hysteresis = 2;
  DynamicLossScaler scaler(o);
  EXPECT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.hysteresis_left(), 1);
  EXPECT_TRUE(scaler.Update(true));
  EXPECT_EQ(scaler.scale(), 512.0f);
}

TEST(LossScaler, RestoreKeepsTheHysteresisAllowanceOfTheCheckpoint) {
  LossScalerOptions o;
  o.initial_scale = 1024.0f;
  o.hysteresis = 3;
  DynamicLossScaler scaler(o);
  scaler.Restore(256.0f, 5, 2, /*hysteresis_left=*/1);
  EXPECT_EQ(scaler.hysteresis_left(), 1);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 128.0f);
  scaler.Restore(256.0f, 5, 2);  // an old checkpoint: the full allowance
  EXPECT_EQ(scaler.hysteresis_left(), 3);
}

TEST(LossScaler, StaticScaleNeverMovesButOverflowsStillSkip) {
  LossScalerOptions o;
  o.dynamic = false;
  o.initial_scale = 128.0f;
  o.hysteresis = 2;
  DynamicLossScaler scaler(o);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(scaler.Update(i % 3 == 0), i % 3 == 0);
  EXPECT_EQ(scaler.scale(), 128.0f);
}

}  // namespace
}  // namespace strata::engine
