// LearningRateAt against references written here from DeepSpeed's schedulers (lr_schedules.py:
// a scheduler object stepped after every optimizer step, starting at last_batch_iteration -1),
// simulated step by step in long double, element by element over whole runs.
#include "tools/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace strata::tools {
namespace {

// DeepSpeed's schedulers as objects: the constructor sets the first rate, Step() advances.
struct ReferenceScheduler {
  LrSchedule s;
  long double lr;
  int64_t last = -1;

  explicit ReferenceScheduler(const LrSchedule& sched) : s(sched) {
    lr = s.kind == LrScheduleKind::kWarmupCosineLR ? 0.0L : (long double)s.warmup_min_lr;
  }
  long double Gamma(int64_t w) const {
    return s.warmup_type == WarmupType::kLog
               ? std::log((long double)(last + 1)) / std::log((long double)w)
               : (long double)last / w;
  }
  void Step() {
    ++last;
    const int64_t w = std::max<int64_t>(2, s.warmup_steps);
    if (s.kind == LrScheduleKind::kWarmupCosineLR) {
      long double ratio;
      if (last < w) {
        ratio = s.warmup_min_ratio + Gamma(w) * (1 - s.warmup_min_ratio);
      } else {
        const long double p = std::min<long double>(
            1, (long double)(last - w + 1) / std::max<int64_t>(1, s.total_steps - w));
        ratio = (1 + std::cos(M_PIl * p)) / 2;
        ratio = std::max<long double>(0, s.cos_min_ratio + (1 - s.cos_min_ratio) * ratio);
      }
      lr = s.peak_lr * ratio;
      return;
    }
    long double gamma = 1;
    if (last < w) {
      gamma = Gamma(w);
    } else if (s.kind == LrScheduleKind::kWarmupDecayLR) {
      gamma = std::max<long double>(
          0, (long double)(s.total_steps - last) / std::max<int64_t>(1, s.total_steps - w));
    }
    lr = s.warmup_min_lr + (s.peak_lr - s.warmup_min_lr) * gamma;
  }
};

void ExpectMatchesReference(const LrSchedule& s, int64_t steps) {
  ReferenceScheduler ref(s);
  for (int64_t k = 0; k < steps; ++k) {
    const double got = LearningRateAt(s, k);
    ASSERT_NEAR(got, static_cast<double>(ref.lr), 1e-15 * s.peak_lr + 1e-300)
        << LrScheduleKindName(s.kind) << " step " << k;
    ref.Step();  // after the optimizer step, as DeepSpeed's engine does
  }
}

TEST(LrSchedule, WarmupLRLogAndLinearMatchDeepSpeedStepByStep) {
  for (WarmupType t : {WarmupType::kLog, WarmupType::kLinear}) {
    LrSchedule s;
    s.kind = LrScheduleKind::kWarmupLR;
    s.peak_lr = 3e-4;
    s.warmup_min_lr = 1e-6;
    s.warmup_steps = 17;
    s.warmup_type = t;
    ExpectMatchesReference(s, 60);
  }
}

TEST(LrSchedule, WarmupDecayLRDecaysLinearlyToZeroAndStaysThere) {
  LrSchedule s;
  s.kind = LrScheduleKind::kWarmupDecayLR;
  s.peak_lr = 2e-5;
  s.warmup_steps = 10;
  s.total_steps = 50;
  s.warmup_type = WarmupType::kLinear;
  ExpectMatchesReference(s, 80);
  EXPECT_EQ(LearningRateAt(s, 51), 0.0);  // iteration 50 = total_num_steps
  EXPECT_EQ(LearningRateAt(s, 79), 0.0);
  EXPECT_NEAR(LearningRateAt(s, 11), 2e-5, 1e-18);  // iteration 10: the end of warmup
}

TEST(LrSchedule, WarmupCosineLRScalesTheOptimizersRate) {
  for (WarmupType t : {WarmupType::kLog, WarmupType::kLinear}) {
    LrSchedule s;
    s.kind = LrScheduleKind::kWarmupCosineLR;
    s.peak_lr = 1e-3;
    s.warmup_steps = 8;
    s.total_steps = 40;
    s.warmup_min_ratio = 0.05;
    s.cos_min_ratio = 0.01;
    s.warmup_type = t;
    ExpectMatchesReference(s, 60);  // past total_num_steps: held at cos_min_ratio
    EXPECT_EQ(LearningRateAt(s, 0), 0.0);
    EXPECT_NEAR(LearningRateAt(s, 59), 1e-3 * 0.01, 1e-18);
  }
}

TEST(LrSchedule, OneStepWarmupIsTwoStepsAsInDeepSpeed) {
  LrSchedule s;
  s.kind = LrScheduleKind::kWarmupLR;
  s.peak_lr = 1.0;
  s.warmup_steps = 1;  // DeepSpeed: max(2, warmup_num_steps)
  s.warmup_type = WarmupType::kLinear;
  EXPECT_EQ(LearningRateAt(s, 0), 0.0);
  EXPECT_EQ(LearningRateAt(s, 1), 0.0);
  EXPECT_EQ(LearningRateAt(s, 2), 0.5);
  EXPECT_EQ(LearningRateAt(s, 3), 1.0);
}

TEST(LrSchedule, StrataCosineWarmsUpLinearlyAndEndsAtATenth) {
  LrSchedule s;
  s.peak_lr = 3e-3;
  s.warmup_steps = 20;
  s.total_steps = 300;
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 0), 3e-3 / 20);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 19), 3e-3);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 20), 3e-3);
  EXPECT_NEAR(LearningRateAt(s, 300), 3e-4, 1e-18);
  s.kind = LrScheduleKind::kConstant;
  for (int k : {0, 1, 19, 299}) EXPECT_EQ(LearningRateAt(s, k), 3e-3);
}

TEST(LrSchedule, ParsesDeepSpeedAndFlagSpellingsAndRejectsOthers) {
  EXPECT_EQ(*ParseLrScheduleKind("WarmupDecayLR"), LrScheduleKind::kWarmupDecayLR);
  EXPECT_EQ(*ParseLrScheduleKind("warmup-cosine"), LrScheduleKind::kWarmupCosineLR);
  EXPECT_FALSE(ParseLrScheduleKind("OneCycle").ok());
  EXPECT_FALSE(ParseWarmupType("exp").ok());
}

TEST(LrSchedule, DescribeNamesTheKindAndItsEndpoints) {
  LrSchedule s;
  s.kind = LrScheduleKind::kWarmupDecayLR;
  s.peak_lr = 3e-5;
  s.warmup_steps = 10;
  s.total_steps = 100;
  s.warmup_type = WarmupType::kLinear;
  EXPECT_EQ(DescribeLrSchedule(s),
            "WarmupDecayLR: 0 -> 3e-05 over 10 steps (linear), then linear decay to 0 at step 100");
}

}  // namespace
}  // namespace strata::tools
