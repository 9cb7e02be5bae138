// The preference losses (engine/preference_objective.h) against their formulas and their
// derivatives against central differences, and the weights the objective hands the engine.
#include "engine/preference_objective.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/plan/planner.h"
#include "gpu/device.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/tiny_families.h"

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

// The NLL term (rpo_alpha, cpo_alpha): alpha / N added to the weight of every chosen target, N
// the step's chosen targets (over every rank: job_chosen_targets), alpha times the chosen
// cross-entropies over N added to the share; the rejected targets' weights and everything at
// alpha 0 unchanged; nll_loss the chosen targets' mean cross-entropy.
TEST(PreferenceObjective, TheNllTermWeighsEveryChosenTargetByAlphaOverTheStepsChosenTargets) {
  for (PreferenceOptions o :
       {Options(PreferenceLoss::kDpo, 0.2, 0.1), Options(PreferenceLoss::kIpo, 0.5),
        Options(PreferenceLoss::kSimpo, 2.0, 0, 0.8)}) {
    const std::vector<int32_t> seq0 = {0, 0, 1, -1, 2, 3, 3, 3};  // chosen targets: 3
    const std::vector<int32_t> seq1 = {-1, 0, 1, 1};              // 1
    const std::vector<float> ce0 = {1, 2, 0.5f, 7, 0.25f, 1, 2, 3}, ce1 = {5, 1.5f, 1, 1};
    const auto run = [&](double alpha, int64_t job_chosen, std::vector<float>* w0,
                         std::vector<float>* w1) {
      o.nll_alpha = alpha;
      PreferenceObjective objective(o, /*reference_from_model=*/false);
      std::vector<PreferenceObjective::MicroBatchPairs> step(2);
      step[0] = {seq0, 2, {-3.0, -2.0, -1.0, -5.0}};
      step[1] = {seq1, 1, {-0.5, -0.75}};
      EXPECT_TRUE(objective.BeginStep(step, 0, job_chosen).ok());
      w0->assign(8, -9);
      w1->assign(4, -9);
      const double share = *objective.Weigh(0, ce0, {}, *w0) + *objective.Weigh(1, ce1, {}, *w1);
      return std::pair{share, objective.TakeMetrics()};
    };
    std::vector<float> p0, p1, n0, n1;
    const auto [plain, plain_metrics] = run(0, 0, &p0, &p1);
    EXPECT_EQ(plain_metrics.nll_targets, 4);  // measured without the term too
    const double alpha = 0.75;
    const auto [with, metrics] = run(alpha, 0, &n0, &n1);
    const double n = 4, chosen_ce = 1 + 2 + 0.25 + 1.5;
    EXPECT_NEAR(with, plain + alpha * chosen_ce / n, 1e-15);
    // A weight is a double rounded once to float: with and without the term each within half an
    // ulp of its double, so they differ by alpha / n to within 2^-24 of both magnitudes.
    const auto added = [&](float got, float without, double term) {
      const double w = without;
      return std::abs(got - (w + term)) <= 0x1p-24 * (2 * std::abs(w) + term);
    };
    for (size_t t = 0; t < 8; ++t) {
      const bool chosen = seq0[t] >= 0 && seq0[t] % 2 == 0;
      if (chosen) {
        EXPECT_TRUE(added(n0[t], p0[t], alpha / n)) << t << ": " << n0[t] << " vs " << p0[t];
      } else {
        EXPECT_EQ(n0[t], p0[t]) << t;
      }
    }
    EXPECT_TRUE(added(n1[1], p1[1], alpha / n));
    EXPECT_EQ(n1[2], p1[2]);
    EXPECT_EQ(n1[0], 0.0f);
    EXPECT_EQ(metrics.nll_targets, 4);
    EXPECT_DOUBLE_EQ(metrics.nll_loss, chosen_ce / n);
    EXPECT_DOUBLE_EQ(metrics.loss, plain_metrics.loss + alpha * chosen_ce / n);
    // Over 2 ranks of this step each: N = 8, the term halved.
    std::vector<float> d0, d1;
    const auto [ranked, ranked_metrics] = run(alpha, 8, &d0, &d1);
    EXPECT_NEAR(ranked, plain + alpha * chosen_ce / 8, 1e-15);
    EXPECT_TRUE(added(d1[1], p1[1], alpha / 8));
    EXPECT_EQ(ranked_metrics.nll_targets, 4);  // this rank's
  }
  PreferenceOptions bad = Options(PreferenceLoss::kSimpo, 2.0);
  bad.nll_alpha = -1;
  EXPECT_NE(CheckPreferenceOptions(bad).message().find("--cpo-alpha"), std::string::npos);
  bad.loss = PreferenceLoss::kDpo;
  EXPECT_NE(CheckPreferenceOptions(bad).message().find("--rpo-alpha"), std::string::npos);
  PreferenceObjective objective(Options(PreferenceLoss::kDpo, 0.1), false);
  const std::vector<int32_t> seq = {0, 0, 1};
  EXPECT_FALSE(objective.BeginStep({{seq, 1, {-1, -1}}}, 0, 1).ok());  // fewer than this rank's 2
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

// ---------------------------------------------------------------------------------------------
// Through the engine, on tiny Llamas on the host backend.

const models::LoraConfig kLora{.rank = 4, .alpha = 8, .targets = {"q_proj", "v_proj", "down_proj"}};

// Micro-batches of preference pairs, used in turn (step s takes micro-batches s A .. s A + A - 1,
// modulo their number): B = 2 rows (pair 0: chosen row 0, rejected row 1),
// T = 16; each row's completion is its targets t in [7, 15) (tokens[t + 1]); the others ignored.
struct PairData {
  std::vector<std::vector<int32_t>> tokens, targets, sequences;
  std::vector<MicroBatch> MicroBatches(int step, int accum) const {
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < accum; ++i) {
      const size_t k = (static_cast<size_t>(step) * accum + i) % tokens.size();
      mbs.push_back({tokens[k], targets[k]});
    }
    return mbs;
  }
};

PairData MakePairs(int micro_batches, uint64_t seed) {
  PairData d;
  const auto raw = testing::RandomTokenVectors(micro_batches, 32, seed);
  for (const auto& r : raw) {
    std::vector<int32_t> tokens(r.begin(), r.end()), targets(32, -1), seq(32, -1);
    // Chosen and rejected share their prompt (tokens 0..7 of the row).
    std::copy_n(tokens.begin(), 8, tokens.begin() + 16);
    for (int row = 0; row < 2; ++row) {
      for (int t = 7; t < 15; ++t) {
        targets[row * 16 + t] = tokens[row * 16 + t + 1];
        seq[row * 16 + t] = row;
      }
    }
    d.tokens.push_back(tokens);
    d.targets.push_back(targets);
    d.sequences.push_back(seq);
  }
  return d;
}

class PreferenceEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("strata_preference_engine_test_{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::unique_ptr<models::LlamaModel> Llama(bool lora) {
    auto m = models::LlamaModel::Create(testing::TinyLlama(false));
    EXPECT_TRUE(m.ok());
    if (lora) {
      EXPECT_TRUE((*m)->EnableLora(kLora).ok());
    }
    return std::move(*m);
  }

  EngineOptions Options(const Model& model, ParamHome params, Schedule schedule, bool reference) {
    EngineOptions o = testing::MixedPlacementOptions(model, DType::kBF16, params,
                                                     OptimizerHome::kHost, 2, dir_.string());
    o.placement.schedule = schedule;
    o.placement.objective = {.target_weights = true, .reference_forward = reference};
    if (params != ParamHome::kDevice) {
      const int held = schedule == Schedule::kLayerMajor ? 2 : 1;
      o.placement.device_budget_bytes =
          StreamingMinimumBytes(model, DType::kBF16, o.micro_batch, 3, false, 1, false, held,
                                o.placement.objective) +
          (model.frozen_params() > 0 ? 1024 : model.block_num_params(1) * 2 + 1024);
    }
    return o;
  }

  struct Run {
    std::vector<StepResult> results;
    std::vector<PreferenceMetrics> metrics;
    testing::TrainRun train;
  };

  // `steps` steps of `p` over MakePairs' data: the reference from the model (LoRA) or computed
  // with EvaluateTargetLosses before the first step (full fine-tuning).
  // distinct: the micro-batches of the data (0: one per micro-batch of the run).
  Run Train(Model& model, const EngineOptions& o, const PreferenceOptions& p, bool lora, int steps,
            int distinct = 0) {
    Run run;
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    auto engine = Engine::Create(&model, device->get(), o);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return run;
    Engine& e = **engine;
    const int accum = o.grad_accum_steps;
    const PairData data = MakePairs(distinct > 0 ? distinct : steps * accum, 5);
    std::vector<std::vector<double>> reference(data.tokens.size());
    if (!lora && p.uses_reference()) {
      for (size_t k = 0; k < data.tokens.size(); ++k) {
        auto ce = e.EvaluateTargetLosses({data.tokens[k], data.targets[k]}, o.micro_batch);
        EXPECT_TRUE(ce.ok()) << ce.status().ToString();
        if (!ce.ok()) return run;
        reference[k] = *CompletionLogps(*ce, data.sequences[k], 1, p.averaged());
      }
    }
    PreferenceObjective objective(p, lora);
    for (int s = 0; s < steps; ++s) {
      std::vector<PreferenceObjective::MicroBatchPairs> pairs;
      for (int i = 0; i < accum; ++i) {
        const size_t k = (static_cast<size_t>(s) * accum + i) % data.tokens.size();
        pairs.push_back({data.sequences[k], 1, reference[k]});
      }
      EXPECT_TRUE(objective.BeginStep(pairs).ok());
      auto r = e.Step(data.MicroBatches(s, accum), &objective);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (!r.ok()) return run;
      run.results.push_back(*r);
      run.metrics.push_back(objective.TakeMetrics());
    }
    for (int b = 0; b < model.num_blocks(); ++b) {
      auto w = e.MasterWeights(b);
      EXPECT_TRUE(w.ok());
      if (w.ok()) run.train.master.push_back(*w);
    }
    run.train.hash = *e.MasterWeightsXxh3();
    run.train.results = run.results;
    return run;
  }
  std::filesystem::path dir_;
};

TEST_F(PreferenceEngineTest, DpoStartsAtLn2WithZeroRewardsAndLearnsThePreference) {
  PreferenceOptions p;
  p.beta = 0.5;
  for (bool lora : {true, false}) {
    SCOPED_TRACE(lora ? "LoRA, the base as reference" : "full, the initial weights as reference");
    auto model = Llama(lora);
    EngineOptions o = Options(*model, ParamHome::kDevice, Schedule::kMicroBatchMajor, lora);
    o.optimizer.adamw().lr = lora ? 3e-2f : 3e-3f;
    const Run run = Train(*model, o, p, lora, 12, /*distinct=*/2);  // the same two pairs
    ASSERT_EQ(run.results.size(), 12u);
    // The policy is its reference before the first update: z = 0 for every pair, bit for bit.
    EXPECT_DOUBLE_EQ(run.results[0].loss, static_cast<float>(std::log(2.0)));
    EXPECT_EQ(run.metrics[0].rewards_margin, 0);
    EXPECT_EQ(run.metrics[0].rewards_chosen, 0);
    EXPECT_LT(run.results.back().loss, 0.5f * run.results[0].loss);
    EXPECT_GT(run.metrics.back().rewards_margin, 0);
  }
}

TEST_F(PreferenceEngineTest, EveryPlacementAndScheduleGivesTheSameStepsBitForBit) {
  for (PreferenceLoss loss : {PreferenceLoss::kDpo, PreferenceLoss::kIpo, PreferenceLoss::kSimpo}) {
    PreferenceOptions p;
    p.loss = loss;
    p.beta = loss == PreferenceLoss::kSimpo ? 2.0 : 0.3;
    for (bool lora : {true, false}) {
      const bool reference = lora && p.uses_reference();
      SCOPED_TRACE(fmt::format("{} {}", PreferenceLossName(loss), lora ? "lora" : "full"));
      auto m0 = Llama(lora);
      const Run ref = Train(
          *m0, Options(*m0, ParamHome::kDevice, Schedule::kMicroBatchMajor, reference), p, lora, 3);
      for (auto [params, schedule] : {std::pair{ParamHome::kHost, Schedule::kMicroBatchMajor},
                                      std::pair{ParamHome::kNvme, Schedule::kLayerMajor},
                                      std::pair{ParamHome::kDevice, Schedule::kLayerMajor}}) {
        auto m = Llama(lora);
        const Run run = Train(*m, Options(*m, params, schedule, reference), p, lora, 3);
        testing::ExpectBitIdentical(ref.train, run.train);
      }
      // Every layer keeping its activations: the reference forward runs before the layer's
      // training forward, whose activations the layer's backward then reads from its store.
      for (Schedule schedule : {Schedule::kMicroBatchMajor, Schedule::kLayerMajor}) {
        auto m = Llama(lora);
        EngineOptions o = Options(*m, ParamHome::kDevice, schedule, reference);
        o.placement.activation_checkpointing = ActivationCheckpointing::kNone;
        const Run run = Train(*m, o, p, lora, 3);
        testing::ExpectBitIdentical(ref.train, run.train);
      }
    }
  }
}

// The reference log-probabilities the step hands the objective are those of a forward pass of
// the frozen reference alone, bit for bit, also after the adapters have moved.
class RecordingObjective final : public SequenceObjective {
 public:
  bool wants_reference() const override { return true; }
  StatusOr<double> Weigh(size_t, std::span<const float> policy, std::span<const float> reference,
                         std::span<float> weights) override {
    policy_.assign(policy.begin(), policy.end());
    reference_.assign(reference.begin(), reference.end());
    for (size_t t = 0; t < weights.size(); ++t) weights[t] = t % 3 == 0 ? 0.01f : -0.02f;
    return 0.0;
  }
  std::vector<float> policy_, reference_;
};

TEST_F(PreferenceEngineTest, TheReferenceForwardEqualsAForwardOfTheBaseAlone) {
  auto model = Llama(true);
  EngineOptions o = Options(*model, ParamHome::kHost, Schedule::kMicroBatchMajor, true);
  o.grad_accum_steps = 1;
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto engine = Engine::Create(model.get(), device->get(), o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const PairData data = MakePairs(3, 11);
  RecordingObjective objective;
  for (int s = 0; s < 3; ++s) {
    const std::vector<MicroBatch> mbs = data.MicroBatches(s, 1);
    ASSERT_TRUE((*engine)->Step(mbs, &objective).ok());
    ASSERT_TRUE((*engine)->Flush().ok());
    // After the step the adapters moved; the base did not.
    auto base = (*engine)->EvaluateTargetLosses(mbs[0], o.micro_batch, /*reference=*/true);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    ASSERT_EQ(base->size(), objective.reference_.size());
    for (size_t t = 0; t < base->size(); ++t) {
      EXPECT_EQ(std::bit_cast<uint32_t>((*base)[t]),
                std::bit_cast<uint32_t>(objective.reference_[t]))
          << "step " << s << " position " << t;
    }
    auto policy = (*engine)->EvaluateTargetLosses(mbs[0], o.micro_batch);
    ASSERT_TRUE(policy.ok());
    if (s > 0) {
      EXPECT_NE(*policy, *base);
    }
    // Both from one pass over the blocks: the two passes' losses, bit for bit.
    auto both = (*engine)->EvaluatePolicyAndReference(mbs[0], o.micro_batch);
    ASSERT_TRUE(both.ok()) << both.status().ToString();
    ASSERT_EQ(both->policy.size(), policy->size());
    for (size_t t = 0; t < policy->size(); ++t) {
      EXPECT_EQ(std::bit_cast<uint32_t>(both->policy[t]), std::bit_cast<uint32_t>((*policy)[t]))
          << "step " << s << " position " << t;
      EXPECT_EQ(std::bit_cast<uint32_t>(both->reference[t]), std::bit_cast<uint32_t>((*base)[t]))
          << "step " << s << " position " << t;
    }
  }
}

// Weights 1 / counted targets at every counted target are the mean cross-entropy: the objective's
// gradient is the plain step's, to within the rounding of the two scalings.
class MeanObjective final : public SequenceObjective {
 public:
  explicit MeanObjective(std::vector<std::vector<int32_t>> targets)
      : targets_(std::move(targets)) {}
  bool wants_reference() const override { return false; }
  StatusOr<double> Weigh(size_t i, std::span<const float> policy, std::span<const float>,
                         std::span<float> weights) override {
    int64_t n = 0;
    for (int32_t t : targets_[i]) n += t >= 0;
    double sum = 0;
    for (size_t t = 0; t < weights.size(); ++t) {
      weights[t] = targets_[i][t] >= 0 ? 1.0f / static_cast<float>(n * targets_.size()) : 0.0f;
      sum += targets_[i][t] >= 0 ? policy[t] : 0;
    }
    return sum / static_cast<double>(n * targets_.size());
  }
  std::vector<std::vector<int32_t>> targets_;
};

TEST_F(PreferenceEngineTest, MeanWeightsReproduceThePlainStepsGradient) {
  const PairData data = MakePairs(2, 3);
  std::vector<std::vector<float>> grads[2];
  float losses[2] = {};
  for (int weighted : {0, 1}) {
    auto model = Llama(false);
    EngineOptions o = Options(*model, ParamHome::kDevice, Schedule::kMicroBatchMajor, false);
    o.precision = DType::kF32;
    o.optimizer.adamw().lr = 0;
    o.grad_clip_norm = 0;
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    auto engine = Engine::Create(model.get(), device->get(), o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    MeanObjective mean({data.targets[0], data.targets[1]});
    auto r = (*engine)->Step(data.MicroBatches(0, 2), weighted ? &mean : nullptr);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    losses[weighted] = r->loss;
    for (int b = 0; b < model->num_blocks(); ++b) {
      grads[weighted].push_back(*(*engine)->AccumulatedGradient(b));
    }
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-6 * losses[0]);
  for (size_t b = 0; b < grads[0].size(); ++b) {
    double scale = 0;
    for (float g : grads[0][b]) scale = std::max(scale, std::abs(static_cast<double>(g)));
    for (size_t k = 0; k < grads[0][b].size(); ++k) {
      // fp32 throughout; the two differ in how 1/n enters the head's dlogits (one rounding each
      // way, about 2^-24 relative), carried through the backward's sums.
      EXPECT_NEAR(grads[0][b][k], grads[1][b][k], 1e-5 * scale + 1e-12) << b << " " << k;
    }
  }
}

TEST_F(PreferenceEngineTest, AnObjectiveNeedsThePlansBuffers) {
  auto model = Llama(true);
  EngineOptions o = Options(*model, ParamHome::kDevice, Schedule::kMicroBatchMajor, false);
  o.placement.objective = {};
  auto device = gpu::CreateHostDevice({});
  auto engine = Engine::Create(model.get(), device->get(), o);
  ASSERT_TRUE(engine.ok());
  const PairData data = MakePairs(2, 3);
  PreferenceObjective objective({}, /*reference_from_model=*/true);
  ASSERT_TRUE(objective.BeginStep({{data.sequences[0], 1, {}}, {data.sequences[1], 1, {}}}).ok());
  auto r = (*engine)->Step(data.MicroBatches(0, 2), &objective);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("PlacementOptions::objective"), std::string::npos);
  EXPECT_EQ((*engine)
                ->EvaluateTargetLosses({data.tokens[0], data.targets[0]}, o.micro_batch)
                .status()
                .code(),
            StatusCode::kFailedPrecondition);
  // One pass of both needs the reference forward's buffers: a plan with the per-target losses
  // alone refuses it.
  EngineOptions w = o;
  w.placement.objective.target_weights = true;
  auto weights_only = Engine::Create(model.get(), device->get(), w);
  ASSERT_TRUE(weights_only.ok()) << weights_only.status().ToString();
  EXPECT_EQ((*weights_only)
                ->EvaluatePolicyAndReference({data.tokens[0], data.targets[0]}, o.micro_batch)
                .status()
                .code(),
            StatusCode::kFailedPrecondition);
  // A reference forward on a model without a frozen reference is refused when planned.
  auto full = Llama(false);
  EngineOptions f = Options(*full, ParamHome::kDevice, Schedule::kMicroBatchMajor, true);
  EXPECT_EQ(Engine::Create(full.get(), device->get(), f).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::engine
