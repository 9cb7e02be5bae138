// Preference training's objectives on chosen/rejected pairs, as TRL computes them: DPO
// (Rafailov et al. 2023, "Direct Preference Optimization"; TRL DPOTrainer loss_type "sigmoid",
// with label_smoothing: the conservative DPO of Mitchell 2023), IPO (Azar et al. 2023, "A
// General Theoretical Paradigm to Understand Learning from Human Preferences"; TRL "ipo") and
// SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
// Reward"; TRL CPOTrainer loss_type "simpo"), each optionally with an NLL term on the chosen
// completions: TRL DPOConfig.rpo_alpha (RPO: Pang et al. 2024, "Iterative Reasoning Preference
// Optimization") for DPO and IPO, CPOConfig.cpo_alpha (CPO: Xu et al. 2024, "Contrastive
// Preference Optimization"; with SimPO, "CPO-SimPO") for SimPO.
//
// Per pair, from the completions' log-probabilities pi_c, pi_r under the policy and r_c, r_r
// under the frozen reference (each the sum over the completion's targets of log p(target), or,
// for IPO and SimPO, that sum over the completion's target count: TRL's average_log_prob):
//   DPO:   z = beta ((pi_c - r_c) - (pi_r - r_r)),
//          loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)
//          rewards: beta (pi_c - r_c), beta (pi_r - r_r)
//   IPO:   h = (pi_c - r_c) - (pi_r - r_r), loss = (h - 1 / (2 beta))^2; rewards as DPO
//   SimPO: z = beta (pi_c - pi_r) - gamma, loss as DPO's with this z (no reference);
//          rewards: beta pi_c, beta pi_r
// The step's loss is the mean over its pairs, plus alpha times the NLL term: the policy's mean
// cross-entropy over every target of the step's chosen completions (TRL's nll_loss: one
// cross-entropy over the chosen rows' targets, so a mean over targets, not pairs). Metrics as TRL
// logs them: rewards/chosen, rewards/rejected, rewards/accuracies (the fraction with chosen reward
// > rejected reward), rewards/margins, logps/chosen, logps/rejected (the policy's, averaged for
// IPO and SimPO), the means over the pairs, and nll_loss.
//
// Thread-safety: plain functions are pure; a PreferenceObjective is used by one thread.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/sequence_objective.h"

namespace strata::engine {

enum class PreferenceLoss { kDpo, kIpo, kSimpo };
std::string_view PreferenceLossName(PreferenceLoss loss);  // "dpo", "ipo", "simpo"
// The inverse; kInvalidArgument naming the three otherwise.
StatusOr<PreferenceLoss> ParsePreferenceLoss(std::string_view name);

struct PreferenceOptions {
  PreferenceLoss loss = PreferenceLoss::kDpo;
  double beta = 0.1;           // DPO's and SimPO's beta; IPO's tau (> 0)
  double label_smoothing = 0;  // DPO and SimPO: eps in [0, 0.5)
  double simpo_gamma = 0.5;    // SimPO's target reward margin gamma (TRL CPOConfig.simpo_gamma)
  // The NLL term's weight alpha >= 0 (TRL DPOConfig.rpo_alpha for DPO and IPO, CPOConfig.cpo_alpha
  // for SimPO); 0: none.
  double nll_alpha = 0;
  // Whether the loss reads the reference (DPO, IPO) and uses averaged log-probabilities (IPO,
  // SimPO).
  bool uses_reference() const { return loss != PreferenceLoss::kSimpo; }
  bool averaged() const { return loss != PreferenceLoss::kDpo; }
};
// kInvalidArgument naming the option (--beta, --label-smoothing, --simpo-gamma, and --rpo-alpha or
// --cpo-alpha for nll_alpha) out of range.
Status CheckPreferenceOptions(const PreferenceOptions& options);

// One pair's log-probabilities (summed or averaged as options.averaged() says); the reference's
// are ignored by SimPO.
struct PairLogps {
  double chosen = 0, rejected = 0, ref_chosen = 0, ref_rejected = 0;
};
// The pair's loss, its derivatives with respect to the policy's chosen and rejected
// log-probabilities, and its rewards. In double.
struct PairLoss {
  double loss = 0, dchosen = 0, drejected = 0, chosen_reward = 0, rejected_reward = 0;
};
PairLoss PreferencePairLoss(const PreferenceOptions& options, const PairLogps& logps);

// Means over the pairs seen (TRL's logged names in comments).
struct PreferenceMetrics {
  int64_t pairs = 0;
  // The pairs' mean loss, plus alpha times nll_loss where the NLL term is on: what the steps
  // minimise (TRL's loss).
  double loss = 0;
  double rewards_chosen = 0;    // rewards/chosen
  double rewards_rejected = 0;  // rewards/rejected
  double rewards_accuracy = 0;  // rewards/accuracies
  double rewards_margin = 0;    // rewards/margins
  double logps_chosen = 0;      // logps/chosen
  double logps_rejected = 0;    // logps/rejected
  // nll_loss: the policy's mean cross-entropy over the chosen completions' targets (nats), and
  // their count (its weight when means are combined).
  double nll_loss = 0;
  int64_t nll_targets = 0;
};

// Sums pairs into running means.
class PreferenceMetricsSum {
 public:
  void Add(const PairLogps& logps, const PairLoss& loss);
  // Chosen targets' cross-entropies: their sum (nats) and count.
  void AddNll(double cross_entropy_sum, int64_t targets);
  // The means; loss with nll_alpha times nll_loss added (PreferenceOptions::nll_alpha).
  PreferenceMetrics Means(double nll_alpha = 0) const;
  void Clear() { *this = PreferenceMetricsSum(); }
  // The running sums as kPackedSize doubles (counts included, exact below 2^53), so that sums
  // of several data-parallel ranks add element-wise, and back.
  static constexpr size_t kPackedSize = 10;
  std::vector<double> Packed() const;
  static PreferenceMetricsSum Unpacked(std::span<const double> packed);  // kPackedSize values

 private:
  PreferenceMetrics sum_;
};

// The completions' log-probabilities of one micro-batch: out[s] for completion s (2 k chosen,
// 2 k + 1 rejected side of pair k, k < pairs) is -sum of target_losses[t] over the positions t
// with sequences[t] == s (summed in double in position order), over their count when `averaged`.
// target_losses and sequences: (B, T) each (data/dataset.h Batch::sequences). Errors
// (kInvalidArgument): a sequence id outside [-1, 2 pairs), a completion without a target.
StatusOr<std::vector<double>> CompletionLogps(std::span<const float> target_losses,
                                              std::span<const int32_t> sequences, int pairs,
                                              bool averaged);

// The targets of chosen completions (sequence ids 2 k) in one micro-batch's Batch::sequences.
int64_t ChosenTargets(std::span<const int32_t> sequences);
// The sum of target_losses over those targets (double, in position order). target_losses and
// sequences of one size.
double ChosenCrossEntropySum(std::span<const float> target_losses,
                             std::span<const int32_t> sequences);

// The SequenceObjective of preference training for Engine::Step. Before each step the caller
// describes the step's micro-batches (BeginStep); the engine then calls Weigh once per
// micro-batch. Weights: for a target t of completion s of pair k, w_t = -dL_k/dpi_s / P (over
// the completion's target count when averaged), P the step's pairs, plus alpha / N for a target
// of a chosen completion, N the step's chosen targets; the share is sum_k L_k / P plus alpha
// times the micro-batch's chosen cross-entropies over N.
class PreferenceObjective final : public SequenceObjective {
 public:
  // reference_from_model: the reference log-probabilities come from the engine's frozen reference
  // (LoRA: Weigh's `reference`); else from BeginStep's (computed before training, full
  // fine-tuning). Ignored by SimPO, which has none.
  PreferenceObjective(const PreferenceOptions& options, bool reference_from_model);

  // One micro-batch of the step to come: its Batch::sequences (B T, kept alive by the caller
  // until the step returns), its pair count, and, without a reference from the model, the
  // reference log-probabilities of its pairs' completions (2 per pair, as CompletionLogps gives
  // them; empty otherwise).
  struct MicroBatchPairs {
    std::span<const int32_t> sequences;
    int pairs = 0;
    std::vector<double> reference_logps;
  };
  // Starts a step. job_pairs and job_chosen_targets: the pairs and chosen targets (ChosenTargets)
  // of the whole step over every data-parallel rank, P and N above (0: those of `micro_batches`,
  // one rank). Errors (kInvalidArgument): a step without pairs, fewer job pairs or chosen targets
  // than this rank's, reference log-probabilities missing or of the wrong count.
  Status BeginStep(std::vector<MicroBatchPairs> micro_batches, int64_t job_pairs = 0,
                   int64_t job_chosen_targets = 0);

  bool wants_reference() const override {
    return options_.uses_reference() && reference_from_model_;
  }
  StatusOr<double> Weigh(size_t micro_batch, std::span<const float> policy,
                         std::span<const float> reference, std::span<float> weights) override;

  // The metrics of the pairs weighed since the last call, and a reset; TakeSums: their sums (to
  // add over data-parallel ranks before the means).
  PreferenceMetrics TakeMetrics();
  PreferenceMetricsSum TakeSums();

 private:
  PreferenceOptions options_;
  bool reference_from_model_;
  std::vector<MicroBatchPairs> step_;
  int64_t step_pairs_ = 0;
  int64_t step_chosen_targets_ = 0;      // N: the job's, or this rank's
  std::vector<int64_t> chosen_targets_;  // each micro-batch's (ChosenTargets)
  PreferenceMetricsSum metrics_;
};

}  // namespace strata::engine
