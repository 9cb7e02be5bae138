// The preference losses (engine/preference_objective.h) against their formulas and their
// derivatives against central differences, and the weights the objective hands the engine.
#include "engine/preference_objective.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace strata::engine {
namespace {

PreferenceOptions Options(PreferenceLoss loss, double beta, double eps = 0, double gamma = 0.5) {
  PreferenceOptions o;
  o.loss = loss;
  o.beta = beta;
  o.label_smoothing = eps;
  o.simpo_gamma = gamma;
  return o;
}

double LogSigmoidRef(double x) { return -std::log1p(std::exp(-x)); }

TEST(PreferencePairLoss, DpoWithThePolicyAsItsReferenceIsLn2WithZeroRewards) {
  const PairLogps p{-12.5, -9.25, -12.5, -9.25};
  const PairLoss l = PreferencePairLoss(Options(PreferenceLoss::kDpo, 0.1), p);
  EXPECT_DOUBLE_EQ(l.loss, std::log(2.0));
  EXPECT_EQ(l.chosen_reward, 0);
  EXPECT_EQ(l.rejected_reward, 0);
  // dL/dpi_c = -beta sigmoid(0) = -beta / 2.
  EXPECT_DOUBLE_EQ(l.dchosen, -0.05);
  EXPECT_DOUBLE_EQ(l.drejected, 0.05);
}

TEST(PreferencePairLoss, MatchesTrlFormulas) {
  const PairLogps p{-3.0, -5.5, -3.4, -4.9};
  const double beta = 0.3, eps = 0.1;
  {
    const double z = beta * ((p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected));
    const PairLoss l = PreferencePairLoss(Options(PreferenceLoss::kDpo, beta, eps), p);
    EXPECT_NEAR(l.loss, -(1 - eps) * LogSigmoidRef(z) - eps * LogSigmoidRef(-z), 1e-15);
    EXPECT_NEAR(l.chosen_reward, beta * (p.chosen - p.ref_chosen), 1e-15);
    EXPECT_NEAR(l.rejected_reward, beta * (p.rejected - p.ref_rejected), 1e-15);
  }
  {
    const double h = (p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected);
    const PairLoss l = PreferencePairLoss(Options(PreferenceLoss::kIpo, beta), p);
    EXPECT_NEAR(l.loss, std::pow(h - 1 / (2 * beta), 2), 1e-14);
  }
  {
    const double gamma = 0.7;
    const double z = beta * (p.chosen - p.rejected) - gamma;
    const PairLoss l = PreferencePairLoss(Options(PreferenceLoss::kSimpo, beta, eps, gamma), p);
    EXPECT_NEAR(l.loss, -(1 - eps) * LogSigmoidRef(z) - eps * LogSigmoidRef(-z), 1e-15);
    EXPECT_NEAR(l.chosen_reward, beta * p.chosen, 1e-15);
  }
}

TEST(PreferencePairLoss, DerivativesMatchCentralDifferences) {
  const double h = 1e-6;
  for (const PreferenceOptions& o :
       {Options(PreferenceLoss::kDpo, 0.1), Options(PreferenceLoss::kDpo, 2.0, 0.2),
        Options(PreferenceLoss::kIpo, 0.5), Options(PreferenceLoss::kSimpo, 2.5, 0, 1.2),
        Options(PreferenceLoss::kSimpo, 0.1, 0.3, 0.5)}) {
    for (const PairLogps& p : {PairLogps{-3, -5, -3.5, -4}, PairLogps{-40, -2, -30, -3},
                               PairLogps{-0.5, -80, -0.7, -60}}) {
      PairLogps a = p, b = p;
      a.chosen += h;
      b.chosen -= h;
      const double dc = (PreferencePairLoss(o, a).loss - PreferencePairLoss(o, b).loss) / (2 * h);
      a = p;
      b = p;
      a.rejected += h;
      b.rejected -= h;
      const double dr = (PreferencePairLoss(o, a).loss - PreferencePairLoss(o, b).loss) / (2 * h);
      const PairLoss l = PreferencePairLoss(o, p);
      // Central differences: error O(h^2 |L'''|) plus rounding O(eps |L| / h).
      const double bound = 1e-7 * (1 + std::abs(l.loss));
      EXPECT_NEAR(l.dchosen, dc, bound) << PreferenceLossName(o.loss);
      EXPECT_NEAR(l.drejected, dr, bound) << PreferenceLossName(o.loss);
    }
  }
}

TEST(PreferencePairLoss, LargeMarginsStayFinite) {
  const PairLoss l = PreferencePairLoss(Options(PreferenceLoss::kDpo, 1.0), {0, -1e4, 0, 0});
  EXPECT_TRUE(std::isfinite(l.loss));
  EXPECT_NEAR(l.loss, 0, 1e-300);
  const PairLoss r = PreferencePairLoss(Options(PreferenceLoss::kDpo, 1.0), {-1e4, 0, 0, 0});
  EXPECT_NEAR(r.loss, 1e4, 1e-9);
  EXPECT_NEAR(r.dchosen, -1, 1e-12);
}

TEST(PreferenceOptions, OutOfRangeIsRefusedNamingTheFlag) {
  EXPECT_NE(CheckPreferenceOptions(Options(PreferenceLoss::kDpo, 0)).message().find("--beta"),
            std::string::npos);
  EXPECT_NE(CheckPreferenceOptions(Options(PreferenceLoss::kDpo, 0.1, 0.5))
                .message()
                .find("--label-smoothing"),
            std::string::npos);
  EXPECT_FALSE(CheckPreferenceOptions(Options(PreferenceLoss::kIpo, 0.1, 0.1)).ok());
  EXPECT_TRUE(CheckPreferenceOptions(Options(PreferenceLoss::kSimpo, 2.0, 0, 1.0)).ok());
  EXPECT_FALSE(ParsePreferenceLoss("orpo").ok());
  EXPECT_EQ(*ParsePreferenceLoss("ipo"), PreferenceLoss::kIpo);
}

TEST(CompletionLogps, SumsOrAveragesEachCompletionsTargets) {
  // Two pairs; -1 = an ignored target.
  const std::vector<int32_t> seq = {-1, 0, 0, -1, 1, 1, 1, 2, -1, 3};
  const std::vector<float> ce = {9, 1.5f, 2.5f, 9, 1, 2, 3, 0.25f, 9, 4};
  const auto sum = CompletionLogps(ce, seq, 2, false);
  ASSERT_TRUE(sum.ok()) << sum.status().message();
  EXPECT_EQ(*sum, (std::vector<double>{-4.0, -6.0, -0.25, -4.0}));
  const auto avg = CompletionLogps(ce, seq, 2, true);
  ASSERT_TRUE(avg.ok());
  EXPECT_EQ(*avg, (std::vector<double>{-2.0, -2.0, -0.25, -4.0}));
  EXPECT_FALSE(CompletionLogps(ce, seq, 1, false).ok());  // id 3 of one pair
  const std::vector<int32_t> missing = {0, 0, 1, -1, -1, -1, -1, -1, -1, -1};
  const auto m = CompletionLogps(ce, missing, 2, false);
  EXPECT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("pair 1"), std::string::npos);
}

// The weights of each target are -dL_k/dpi_s / P (over the count when averaged), the share
// sum_k L_k / P, for a step of two micro-batches.
TEST(PreferenceObjective, WeighsEachTargetWithItsCompletionsDerivative) {
  for (const PreferenceOptions& o :
       {Options(PreferenceLoss::kDpo, 0.2, 0.1), Options(PreferenceLoss::kIpo, 0.5),
        Options(PreferenceLoss::kSimpo, 2.0, 0, 0.8)}) {
    PreferenceObjective objective(o, /*reference_from_model=*/false);
    const std::vector<int32_t> seq0 = {0, 0, 1, -1, 2, 3, 3, 3};
    const std::vector<int32_t> seq1 = {-1, 0, 1, 1};
    std::vector<PreferenceObjective::MicroBatchPairs> step(2);
    step[0] = {seq0, 2, {-3.0, -2.0, -1.0, -5.0}};
    step[1] = {seq1, 1, {-0.5, -0.75}};
    ASSERT_TRUE(objective.BeginStep(step).ok());
    EXPECT_FALSE(objective.wants_reference());
    const std::vector<float> ce0 = {1, 2, 0.5f, 7, 0.25f, 1, 2, 3};
    std::vector<float> w0(8, -9);
    const auto share0 = objective.Weigh(0, ce0, {}, w0);
    ASSERT_TRUE(share0.ok()) << share0.status().message();
    const auto pi = *CompletionLogps(ce0, seq0, 2, o.averaged());
    const std::vector<double> ref = step[0].reference_logps;  // as given, summed or averaged
    const int counts[4] = {2, 1, 1, 3};
    double expect_share = 0;
    for (int k = 0; k < 2; ++k) {
      const PairLoss l =
          PreferencePairLoss(o, {pi[2 * k], pi[2 * k + 1], ref[2 * k], ref[2 * k + 1]});
      expect_share += l.loss / 3;
      for (int t = 0; t < 8; ++t) {
        if (seq0[t] == 2 * k || seq0[t] == 2 * k + 1) {
          const int s = seq0[t];
          const double d = s % 2 ? l.drejected : l.dchosen;
          const double expect = -d / 3 / (o.averaged() ? counts[s] : 1);
          EXPECT_EQ(w0[t], static_cast<float>(expect)) << t;
        }
      }
    }
    EXPECT_EQ(w0[3], 0.0f);
    EXPECT_NEAR(*share0, expect_share, 1e-15);
    std::vector<float> w1(4);
    ASSERT_TRUE(objective.Weigh(1, std::vector<float>{5, 1, 1, 1}, {}, w1).ok());
    EXPECT_EQ(objective.TakeMetrics().pairs, 3);
    EXPECT_EQ(objective.TakeMetrics().pairs, 0);
  }
}

TEST(PreferenceObjective, ReferenceFromTheModelIsReadFromWeigh) {
  PreferenceObjective objective(Options(PreferenceLoss::kDpo, 0.1), /*reference_from_model=*/true);
  EXPECT_TRUE(objective.wants_reference());
  const std::vector<int32_t> seq = {0, 1};
  ASSERT_TRUE(objective.BeginStep({{seq, 1, {}}}).ok());
  const std::vector<float> ce = {1.25f, 0.5f};
  std::vector<float> w(2);
  const auto share = objective.Weigh(0, ce, ce, w);
  ASSERT_TRUE(share.ok());
  EXPECT_DOUBLE_EQ(*share, std::log(2.0));
  EXPECT_EQ(w[0], 0.05f);  // -dL/dpi_c = beta / 2
  EXPECT_EQ(w[1], -0.05f);
  const PreferenceMetrics m = objective.TakeMetrics();
  EXPECT_EQ(m.rewards_accuracy, 0);
  EXPECT_EQ(m.rewards_margin, 0);
  EXPECT_EQ(m.logps_chosen, -1.25);
}

TEST(PreferenceObjective, AStepWithoutPairsOrReferencesIsRefused) {
  PreferenceObjective objective(Options(PreferenceLoss::kDpo, 0.1), false);
  const std::vector<int32_t> seq = {0, 1};
  EXPECT_FALSE(objective.BeginStep({{seq, 0, {}}}).ok());
  EXPECT_FALSE(objective.BeginStep({{seq, 1, {-1.0}}}).ok());
  std::vector<float> w(2);
  EXPECT_FALSE(objective.Weigh(0, std::vector<float>{1, 1}, {}, w).ok());  // no step begun
}

}  // namespace
}  // namespace strata::engine
