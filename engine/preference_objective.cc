#include "engine/preference_objective.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include "base/logging.h"

namespace strata::engine {
namespace {

// log sigmoid(x) without overflow: -log1p(exp(-x)) for x >= 0, x - log1p(exp(x)) below.
double LogSigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}
double Sigmoid(double x) {
  if (x >= 0) return 1 / (1 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1 + e);
}

// -(1 - eps) log sigmoid(z) - eps log sigmoid(-z) and its derivative in z.
std::pair<double, double> SmoothedSigmoidLoss(double z, double eps) {
  const double loss = -(1 - eps) * LogSigmoid(z) - eps * LogSigmoid(-z);
  const double dz = -(1 - eps) * Sigmoid(-z) + eps * Sigmoid(z);
  return {loss, dz};
}

}  // namespace

std::string_view PreferenceLossName(PreferenceLoss loss) {
  switch (loss) {
    case PreferenceLoss::kDpo:
      return "dpo";
    case PreferenceLoss::kIpo:
      return "ipo";
    case PreferenceLoss::kSimpo:
      return "simpo";
  }
  return "?";
}

StatusOr<PreferenceLoss> ParsePreferenceLoss(std::string_view name) {
  if (name == "dpo") return PreferenceLoss::kDpo;
  if (name == "ipo") return PreferenceLoss::kIpo;
  if (name == "simpo") return PreferenceLoss::kSimpo;
  return InvalidArgumentError(
      fmt::format("preference loss '{}' is not one of dpo, ipo, simpo", name));
}

Status CheckPreferenceOptions(const PreferenceOptions& o) {
  if (!(o.beta > 0) || !std::isfinite(o.beta)) {
    return InvalidArgumentError(fmt::format("--beta {} must be a positive number", o.beta));
  }
  if (!(o.label_smoothing >= 0 && o.label_smoothing < 0.5)) {
    return InvalidArgumentError(
        fmt::format("--label-smoothing {} must be in [0, 0.5)", o.label_smoothing));
  }
  if (o.loss == PreferenceLoss::kIpo && o.label_smoothing != 0) {
    return InvalidArgumentError("--label-smoothing applies to dpo and simpo, not ipo");
  }
  if (!std::isfinite(o.simpo_gamma)) {
    return InvalidArgumentError(fmt::format("--simpo-gamma {} must be finite", o.simpo_gamma));
  }
  if (!(o.nll_alpha >= 0) || !std::isfinite(o.nll_alpha)) {
    return InvalidArgumentError(
        fmt::format("--{} {} must be a finite number >= 0",
                    o.loss == PreferenceLoss::kSimpo ? "cpo-alpha" : "rpo-alpha", o.nll_alpha));
  }
  return Status::Ok();
}

PairLoss PreferencePairLoss(const PreferenceOptions& o, const PairLogps& p) {
  PairLoss r;
  switch (o.loss) {
    case PreferenceLoss::kDpo: {
      const double dc = p.chosen - p.ref_chosen, dr = p.rejected - p.ref_rejected;
      const auto [loss, dz] = SmoothedSigmoidLoss(o.beta * (dc - dr), o.label_smoothing);
      r = {loss, dz * o.beta, -dz * o.beta, o.beta * dc, o.beta * dr};
      break;
    }
    case PreferenceLoss::kIpo: {
      const double dc = p.chosen - p.ref_chosen, dr = p.rejected - p.ref_rejected;
      const double d = (dc - dr) - 1 / (2 * o.beta);
      r = {d * d, 2 * d, -2 * d, o.beta * dc, o.beta * dr};
      break;
    }
    case PreferenceLoss::kSimpo: {
      const auto [loss, dz] =
          SmoothedSigmoidLoss(o.beta * (p.chosen - p.rejected) - o.simpo_gamma, o.label_smoothing);
      r = {loss, dz * o.beta, -dz * o.beta, o.beta * p.chosen, o.beta * p.rejected};
      break;
    }
  }
  return r;
}

void PreferenceMetricsSum::Add(const PairLogps& logps, const PairLoss& loss) {
  ++sum_.pairs;
  sum_.loss += loss.loss;
  sum_.rewards_chosen += loss.chosen_reward;
  sum_.rewards_rejected += loss.rejected_reward;
  sum_.rewards_accuracy += loss.chosen_reward > loss.rejected_reward ? 1 : 0;
  sum_.rewards_margin += loss.chosen_reward - loss.rejected_reward;
  sum_.logps_chosen += logps.chosen;
  sum_.logps_rejected += logps.rejected;
}

void PreferenceMetricsSum::AddNll(double cross_entropy_sum, int64_t targets) {
  sum_.nll_loss += cross_entropy_sum;
  sum_.nll_targets += targets;
}

PreferenceMetrics PreferenceMetricsSum::Means(double nll_alpha) const {
  PreferenceMetrics m = sum_;
  if (m.pairs == 0) return m;
  const double n = static_cast<double>(m.pairs);
  for (double* v : {&m.loss, &m.rewards_chosen, &m.rewards_rejected, &m.rewards_accuracy,
                    &m.rewards_margin, &m.logps_chosen, &m.logps_rejected}) {
    *v /= n;
  }
  if (m.nll_targets > 0) m.nll_loss /= static_cast<double>(m.nll_targets);
  if (nll_alpha != 0) m.loss += nll_alpha * m.nll_loss;
  return m;
}

std::vector<double> PreferenceMetricsSum::Packed() const {
  const PreferenceMetrics& s = sum_;
  return {static_cast<double>(s.pairs),
          s.loss,
          s.rewards_chosen,
          s.rewards_rejected,
          s.rewards_accuracy,
          s.rewards_margin,
          s.logps_chosen,
          s.logps_rejected,
          s.nll_loss,
          static_cast<double>(s.nll_targets)};
}

PreferenceMetricsSum PreferenceMetricsSum::Unpacked(std::span<const double> v) {
  STRATA_CHECK(v.size() == kPackedSize);
  PreferenceMetricsSum r;
  PreferenceMetrics& s = r.sum_;
  s.pairs = static_cast<int64_t>(v[0]);
  s.loss = v[1];
  s.rewards_chosen = v[2];
  s.rewards_rejected = v[3];
  s.rewards_accuracy = v[4];
  s.rewards_margin = v[5];
  s.logps_chosen = v[6];
  s.logps_rejected = v[7];
  s.nll_loss = v[8];
  s.nll_targets = static_cast<int64_t>(v[9]);
  return r;
}

StatusOr<std::vector<double>> CompletionLogps(std::span<const float> target_losses,
                                              std::span<const int32_t> sequences, int pairs,
                                              bool averaged) {
  if (target_losses.size() != sequences.size()) {
    return InvalidArgumentError(fmt::format("{} per-target losses for {} sequence ids",
                                            target_losses.size(), sequences.size()));
  }
  std::vector<double> sum(2 * static_cast<size_t>(pairs), 0.0);
  std::vector<int64_t> count(sum.size(), 0);
  for (size_t t = 0; t < sequences.size(); ++t) {
    const int32_t s = sequences[t];
    if (s < 0) continue;
    if (s >= 2 * pairs) {
      return InvalidArgumentError(
          fmt::format("position {}: completion {} of a micro-batch of {} pairs", t, s, pairs));
    }
    sum[s] -= static_cast<double>(target_losses[t]);
    ++count[s];
  }
  for (size_t s = 0; s < sum.size(); ++s) {
    if (count[s] == 0) {
      return InvalidArgumentError(fmt::format("the {} completion of pair {} has no target",
                                              s % 2 ? "rejected" : "chosen", s / 2));
    }
    if (averaged) sum[s] /= static_cast<double>(count[s]);
  }
  return sum;
}

int64_t ChosenTargets(std::span<const int32_t> sequences) {
  int64_t n = 0;
  for (int32_t s : sequences) n += s >= 0 && s % 2 == 0;
  return n;
}

double ChosenCrossEntropySum(std::span<const float> target_losses,
                             std::span<const int32_t> sequences) {
  double sum = 0;
  for (size_t t = 0; t < sequences.size() && t < target_losses.size(); ++t) {
    if (sequences[t] >= 0 && sequences[t] % 2 == 0) sum += static_cast<double>(target_losses[t]);
  }
  return sum;
}

PreferenceObjective::PreferenceObjective(const PreferenceOptions& options,
                                         bool reference_from_model)
    : options_(options), reference_from_model_(reference_from_model) {}

Status PreferenceObjective::BeginStep(std::vector<MicroBatchPairs> micro_batches, int64_t job_pairs,
                                      int64_t job_chosen_targets) {
  step_pairs_ = 0;
  step_chosen_targets_ = 0;
  chosen_targets_.clear();
  const bool precomputed = options_.uses_reference() && !reference_from_model_;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const MicroBatchPairs& m = micro_batches[i];
    step_pairs_ += m.pairs;
    chosen_targets_.push_back(ChosenTargets(m.sequences));
    step_chosen_targets_ += chosen_targets_.back();
    if (precomputed && m.reference_logps.size() != 2 * static_cast<size_t>(m.pairs)) {
      return InvalidArgumentError(
          fmt::format("micro-batch {}: {} reference log-probabilities for {} pairs", i,
                      m.reference_logps.size(), m.pairs));
    }
  }
  if (step_pairs_ == 0) return InvalidArgumentError("a preference step without pairs");
  if (job_pairs != 0) {
    if (job_pairs < step_pairs_) {
      return InvalidArgumentError(fmt::format(
          "{} pairs in the job's step, fewer than this rank's {}", job_pairs, step_pairs_));
    }
    step_pairs_ = job_pairs;
  }
  if (job_chosen_targets != 0) {
    if (job_chosen_targets < step_chosen_targets_) {
      return InvalidArgumentError(
          fmt::format("{} chosen targets in the job's step, fewer than this rank's {}",
                      job_chosen_targets, step_chosen_targets_));
    }
    step_chosen_targets_ = job_chosen_targets;
  }
  step_ = std::move(micro_batches);
  return Status::Ok();
}

StatusOr<double> PreferenceObjective::Weigh(size_t i, std::span<const float> policy,
                                            std::span<const float> reference,
                                            std::span<float> weights) {
  if (i >= step_.size()) {
    return InvalidArgumentError(fmt::format(
        "micro-batch {} of a step of {} (PreferenceObjective::BeginStep)", i, step_.size()));
  }
  const MicroBatchPairs& m = step_[i];
  const bool averaged = options_.averaged();
  STRATA_ASSIGN_OR_RETURN(const std::vector<double> pi,
                          CompletionLogps(policy, m.sequences, m.pairs, averaged));
  std::vector<double> ref(pi.size(), 0.0);
  if (wants_reference()) {
    STRATA_ASSIGN_OR_RETURN(ref, CompletionLogps(reference, m.sequences, m.pairs, averaged));
  } else if (options_.uses_reference()) {
    ref = m.reference_logps;
  }
  // d(step objective)/d(pi_s), then per target.
  std::vector<double> dpi(pi.size());
  std::vector<int64_t> count(pi.size(), 0);
  for (int32_t s : m.sequences) {
    if (s >= 0) ++count[s];
  }
  const double inv_pairs = 1.0 / static_cast<double>(step_pairs_);
  double share = 0;
  for (int k = 0; k < m.pairs; ++k) {
    const PairLogps p{pi[2 * k], pi[2 * k + 1], ref[2 * k], ref[2 * k + 1]};
    const PairLoss l = PreferencePairLoss(options_, p);
    metrics_.Add(p, l);
    share += l.loss * inv_pairs;
    dpi[2 * k] = l.dchosen * inv_pairs;
    dpi[2 * k + 1] = l.drejected * inv_pairs;
  }
  // The NLL term: alpha times the mean cross-entropy over the step's chosen targets.
  const double chosen_ce = ChosenCrossEntropySum(policy, m.sequences);
  metrics_.AddNll(chosen_ce, chosen_targets_[i]);
  const double nll_weight = step_chosen_targets_ > 0
                                ? options_.nll_alpha / static_cast<double>(step_chosen_targets_)
                                : 0.0;
  share += nll_weight * chosen_ce;
  // pi_s = -sum_t CE_t (over n_s when averaged): dL/dCE_t = -dL/dpi_s (/ n_s).
  for (size_t t = 0; t < weights.size(); ++t) {
    const int32_t s = t < m.sequences.size() ? m.sequences[t] : -1;
    if (s < 0) {
      weights[t] = 0;
      continue;
    }
    const double w = averaged ? -dpi[s] / static_cast<double>(count[s]) : -dpi[s];
    // Without the term (alpha 0) the weights are the preference loss's alone, bit for bit.
    weights[t] = static_cast<float>(s % 2 == 0 && nll_weight != 0 ? w + nll_weight : w);
  }
  return share;
}

PreferenceMetricsSum PreferenceObjective::TakeSums() {
  const PreferenceMetricsSum s = metrics_;
  metrics_.Clear();
  return s;
}

PreferenceMetrics PreferenceObjective::TakeMetrics() {
  return TakeSums().Means(options_.nll_alpha);
}

}  // namespace strata::engine
