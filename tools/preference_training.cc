#include "tools/preference_training.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <tuple>

#include "base/dtype.h"
#include "base/file.h"
#include "base/json_fields.h"
#include "base/untrusted_text.h"

namespace strata::tools {
namespace {

constexpr std::string_view kReferenceFile = "reference-logps.json";
constexpr std::string_view kReferenceFormat = "strata reference log-probabilities";
constexpr uint64_t kReferenceFileMaxBytes = uint64_t{4} << 30;

engine::MicroBatch MicroBatchOf(const data::Batch& b) { return {b.tokens, b.targets, b.positions}; }

std::string Hex(uint64_t v) { return fmt::format("{:016x}", v); }

// The micro-batches of a split, and micro-batch g of it.
int64_t Groups(const data::PreferenceDataset& d, bool val) {
  return val ? d.val_groups() : d.train_groups();
}
void Group(const data::PreferenceDataset& d, bool val, int64_t g, data::Batch* batch) {
  if (val) {
    d.ValGroup(g, batch);
  } else {
    d.TrainGroup(g, batch);
  }
}

}  // namespace

StatusOr<std::optional<engine::PreferenceOptions>> PreferenceOptionsFromFlags(
    const std::string& objective, double beta, double label_smoothing, double simpo_gamma,
    double rpo_alpha, double cpo_alpha) {
  const engine::PreferenceOptions defaults;
  if (objective == "sft") {
    if (beta != defaults.beta || label_smoothing != defaults.label_smoothing ||
        simpo_gamma != defaults.simpo_gamma || rpo_alpha != 0 || cpo_alpha != 0) {
      return InvalidArgumentError(
          "--beta, --label-smoothing, --simpo-gamma, --rpo-alpha and --cpo-alpha are for "
          "--objective dpo, ipo or simpo");
    }
    return std::optional<engine::PreferenceOptions>();
  }
  engine::PreferenceOptions p;
  STRATA_ASSIGN_OR_RETURN(p.loss, engine::ParsePreferenceLoss(objective));
  p.beta = beta;
  p.label_smoothing = label_smoothing;
  p.simpo_gamma = simpo_gamma;
  const bool simpo = p.loss == engine::PreferenceLoss::kSimpo;
  if (simpo && rpo_alpha != 0) {
    return InvalidArgumentError(
        "--rpo-alpha is for --objective dpo or ipo; SimPO's NLL term is --cpo-alpha");
  }
  if (!simpo && cpo_alpha != 0) {
    return InvalidArgumentError(
        "--cpo-alpha is for --objective simpo; DPO's and IPO's NLL term is --rpo-alpha");
  }
  p.nll_alpha = simpo ? cpo_alpha : rpo_alpha;
  STRATA_RETURN_IF_ERROR(engine::CheckPreferenceOptions(p));
  if (!simpo && simpo_gamma != defaults.simpo_gamma) {
    return InvalidArgumentError("--simpo-gamma is for --objective simpo");
  }
  return std::optional<engine::PreferenceOptions>(p);
}

PreferenceTraining::PreferenceTraining(const engine::PreferenceOptions& options,
                                       const data::PreferenceDataset* data,
                                       bool reference_from_model, int micro_batch_size, int seq_len)
    : options_(options),
      data_(data),
      reference_from_model_(reference_from_model),
      micro_batch_size_(micro_batch_size),
      seq_len_(seq_len),
      objective_(options, reference_from_model) {}

std::vector<double> PreferenceTraining::ReferenceOf(const Completions& split,
                                                    const data::Batch& batch) const {
  std::vector<double> out(2 * static_cast<size_t>(batch.pairs()));
  for (int k = 0; k < batch.pairs(); ++k) {
    for (int side = 0; side < 2; ++side) {
      const size_t s = 2 * static_cast<size_t>(batch.pair_ids[k]) + side;
      const double sum = split.logp_sum[s];
      out[2 * k + side] = options_.averaged() ? sum / static_cast<double>(split.targets[s]) : sum;
    }
  }
  return out;
}

StatusOr<PreferenceTraining::Completions> PreferenceTraining::ComputeReference(
    engine::Engine& engine, bool val, const std::function<bool()>& cancel_requested) {
  Completions c;
  data::Batch batch;
  for (int64_t g = 0; g < Groups(*data_, val); ++g) {
    if (cancel_requested && cancel_requested()) {
      return CancelledError(fmt::format(
          "cancelled while computing the reference log-probabilities ({} group {} of {}); "
          "nothing was written",
          val ? "validation" : "training", g + 1, Groups(*data_, val)));
    }
    Group(*data_, val, g, &batch);
    STRATA_ASSIGN_OR_RETURN(
        const std::vector<float> losses,
        engine.EvaluateTargetLosses(MicroBatchOf(batch), {micro_batch_size_, seq_len_}));
    STRATA_ASSIGN_OR_RETURN(const std::vector<double> sums,
                            engine::CompletionLogps(losses, batch.sequences, batch.pairs(), false));
    std::vector<int64_t> counts(sums.size(), 0);
    for (int32_t s : batch.sequences) {
      if (s >= 0) ++counts[s];
    }
    for (int k = 0; k < batch.pairs(); ++k) {
      const size_t base = 2 * static_cast<size_t>(batch.pair_ids[k]);
      if (c.logp_sum.size() < base + 2) {
        c.logp_sum.resize(base + 2, 0.0);
        c.targets.resize(base + 2, 0);
      }
      for (int side = 0; side < 2; ++side) {
        c.logp_sum[base + side] = sums[2 * k + side];
        c.targets[base + side] = counts[2 * k + side];
      }
    }
  }
  return c;
}

uint64_t PreferenceTraining::DataXxh3() const {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  auto add = [&](const auto& v) { XXH3_64bits_update(state, v.data(), v.size() * sizeof(v[0])); };
  data::Batch batch;
  for (bool val : {false, true}) {
    for (int64_t g = 0; g < Groups(*data_, val); ++g) {
      Group(*data_, val, g, &batch);
      add(batch.tokens);
      add(batch.targets);
      add(batch.positions);
      add(batch.sequences);
      add(batch.pair_ids);
    }
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

StatusOr<bool> PreferenceTraining::ReadReferenceFile(const std::string& path, uint64_t data_hash,
                                                     uint64_t weights_hash,
                                                     std::string_view precision, bool resuming) {
  ReadSmallFileOptions read;
  read.max_bytes = kReferenceFileMaxBytes;
  read.unusable_code = StatusCode::kDataLoss;
  STRATA_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, read));
  auto damaged = [&](std::string_view why) {
    return DataLossError(fmt::format("'{}' is damaged: {}; remove it to recompute", path, why));
  };
  StatusOr<nlohmann::json> parsed = ParseJsonBounded(text);
  if (!parsed.ok()) return damaged(parsed.status().message());
  const nlohmann::json& j = *parsed;
  if (!j.is_object() || j.value("format", "") != kReferenceFormat || !j.contains("data_xxh3") ||
      !j.contains("initial_weights_xxh3")) {
    return damaged("not a reference log-probabilities file");
  }
  std::string differs;
  if (j["data_xxh3"] != Hex(data_hash)) {
    differs = "data (or --seq-len, --micro-batch-size, --pack)";
  }
  if (j["initial_weights_xxh3"] != Hex(weights_hash)) {
    differs += std::string(differs.empty() ? "" : " and ") + "initial weights";
  }
  // The log-probabilities of a bf16 forward are not an fp32 one's: the same weights in another
  // working precision are another reference. (A file from before the field: recomputed by a
  // fresh run, taken by a resumed one.)
  if (j.contains("precision") ? j["precision"] != precision : !resuming) {
    differs += std::string(differs.empty() ? "" : " and ") + "working precision";
  }
  if (!differs.empty()) {
    if (!resuming) return false;  // a fresh run recomputes it
    return FailedPreconditionError(
        fmt::format("'{}' does not match this run's {}; a resumed run needs the reference it "
                    "started with",
                    path, differs));
  }
  for (auto [key, split, pairs] : {std::tuple{"train", &train_ref_, data_->train_pairs()},
                                   std::tuple{"val", &val_ref_, data_->val_pairs()}}) {
    const nlohmann::json& s = j.value(key, nlohmann::json());
    if (!s.is_object() || !s.contains("logp_sum") || !s.contains("targets")) {
      return damaged(fmt::format("no \"{}\" log-probabilities", key));
    }
    try {
      split->logp_sum = s["logp_sum"].get<std::vector<double>>();
    } catch (const nlohmann::json::exception& e) {
      return damaged(e.what());
    }
    // Counts read with their type and range: get<int64_t>() of 1e300 is undefined.
    StatusOr<std::vector<int64_t>> targets =
        JsonInts(s["targets"], fmt::format("\"{}\".targets", key), 1, INT64_MAX,
                 2 * static_cast<size_t>(pairs));
    if (!targets.ok()) return damaged(targets.status().message());
    split->targets = std::move(*targets);
    // Two completions a pair, each a finite log-probability of at least one target.
    const size_t want = 2 * static_cast<size_t>(pairs);
    if (split->logp_sum.size() != want || split->targets.size() != want) {
      return damaged(
          fmt::format("\"{}\" holds {} log-probabilities and {} target counts for {} "
                      "completions",
                      key, split->logp_sum.size(), split->targets.size(), want));
    }
    for (size_t c = 0; c < want; ++c) {
      if (!std::isfinite(split->logp_sum[c]) || split->logp_sum[c] > 0 || split->targets[c] < 1) {
        return damaged(fmt::format("\"{}\" completion {}: log-probability {} over {} targets", key,
                                   c, split->logp_sum[c], split->targets[c]));
      }
    }
  }
  return true;
}

Status PreferenceTraining::PrepareReference(engine::Engine& engine, const std::string& save_dir,
                                            bool resuming, bool write,
                                            const std::function<bool()>& cancel_requested) {
  if (reference_from_model_ || !options_.uses_reference()) return Status::Ok();
  const uint64_t data_hash = DataXxh3();
  STRATA_ASSIGN_OR_RETURN(const uint64_t weights_hash, engine.MasterWeightsXxh3());
  const std::string precision(DTypeName(engine.plan().precision));
  const std::string path =
      save_dir.empty() ? "" : (std::filesystem::path(save_dir) / kReferenceFile).string();
  if (!path.empty() && std::filesystem::exists(path)) {
    STRATA_ASSIGN_OR_RETURN(const bool read,
                            ReadReferenceFile(path, data_hash, weights_hash, precision, resuming));
    if (read) {
      std::printf("reference log-probabilities: %s (%zu train and %zu val completions)\n",
                  path.c_str(), train_ref_.logp_sum.size(), val_ref_.logp_sum.size());
      return Status::Ok();
    }
  }
  STRATA_ASSIGN_OR_RETURN(train_ref_, ComputeReference(engine, /*val=*/false, cancel_requested));
  STRATA_ASSIGN_OR_RETURN(val_ref_, ComputeReference(engine, /*val=*/true, cancel_requested));
  if (path.empty() || !write) {
    std::printf(
        "reference log-probabilities: computed with the initial weights (%zu train and "
        "%zu val completions; kept in memory%s)\n",
        train_ref_.logp_sum.size(), val_ref_.logp_sum.size(),
        path.empty() ? " without --save-dir" : "");
    return Status::Ok();
  }
  const nlohmann::json j = {
      {"format", kReferenceFormat},
      {"version", 1},
      {"data_xxh3", Hex(data_hash)},
      {"initial_weights_xxh3", Hex(weights_hash)},
      {"precision", precision},
      {"train", {{"logp_sum", train_ref_.logp_sum}, {"targets", train_ref_.targets}}},
      {"val", {{"logp_sum", val_ref_.logp_sum}, {"targets", val_ref_.targets}}}};
  const std::string text = j.dump() + "\n";
  std::error_code ec;
  std::filesystem::create_directories(save_dir, ec);
  STRATA_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::Create(path, 0644));
  STRATA_RETURN_IF_ERROR(w.Append(std::as_bytes(std::span(text))));
  STRATA_RETURN_IF_ERROR(w.Commit());
  std::printf("reference log-probabilities: computed with the initial weights, written to %s\n",
              path.c_str());
  return Status::Ok();
}

Status PreferenceTraining::ComputeValidationReference(engine::Engine& reference) {
  STRATA_CHECK(!reference_from_model_);
  STRATA_ASSIGN_OR_RETURN(val_ref_, ComputeReference(reference, /*val=*/true));
  return Status::Ok();
}

Status PreferenceTraining::BeginStep(std::span<const data::Batch> micro_batches, int64_t job_pairs,
                                     int64_t job_chosen_targets) {
  std::vector<engine::PreferenceObjective::MicroBatchPairs> step;
  step.reserve(micro_batches.size());
  const bool precomputed = options_.uses_reference() && !reference_from_model_;
  for (const data::Batch& b : micro_batches) {
    engine::PreferenceObjective::MicroBatchPairs m;
    m.sequences = b.sequences;
    m.pairs = b.pairs();
    if (precomputed) m.reference_logps = ReferenceOf(train_ref_, b);
    step.push_back(std::move(m));
  }
  return objective_.BeginStep(std::move(step), job_pairs, job_chosen_targets);
}

StatusOr<engine::PreferenceMetrics> PreferenceTraining::TakeMetrics(comm::Communicator* comm) {
  engine::PreferenceMetricsSum sums = objective_.TakeSums();
  if (comm != nullptr && comm->world_size() > 1) {
    // Every rank's sums added before the means.
    std::vector<double> packed = sums.Packed();
    STRATA_RETURN_IF_ERROR(comm->AllReduce(packed, comm::ReduceOp::kSum));
    sums = engine::PreferenceMetricsSum::Unpacked(packed);
  }
  return sums.Means(options_.nll_alpha);
}

StatusOr<engine::PreferenceMetrics> PreferenceTraining::Evaluate(engine::Engine& engine) {
  engine::PreferenceMetricsSum sum;
  data::Batch batch;
  const bool averaged = options_.averaged();
  for (int64_t g = 0; g < data_->val_groups(); ++g) {
    data_->ValGroup(g, &batch);
    const engine::MicroBatch mb = MicroBatchOf(batch);
    const engine::MicroBatchShape shape{micro_batch_size_, seq_len_};
    std::vector<double> ref(2 * static_cast<size_t>(batch.pairs()), 0.0);
    std::vector<float> p;
    if (options_.uses_reference() && reference_from_model_) {
      // LoRA: the base and the adapted model in one pass over the (streamed) base.
      STRATA_ASSIGN_OR_RETURN(engine::Engine::PolicyAndReferenceLosses both,
                              engine.EvaluatePolicyAndReference(mb, shape));
      STRATA_ASSIGN_OR_RETURN(
          ref, engine::CompletionLogps(both.reference, batch.sequences, batch.pairs(), averaged));
      p = std::move(both.policy);
    } else {
      if (options_.uses_reference()) ref = ReferenceOf(val_ref_, batch);
      STRATA_ASSIGN_OR_RETURN(p, engine.EvaluateTargetLosses(mb, shape));
    }
    STRATA_ASSIGN_OR_RETURN(const std::vector<double> pi,
                            engine::CompletionLogps(p, batch.sequences, batch.pairs(), averaged));
    for (int k = 0; k < batch.pairs(); ++k) {
      const engine::PairLogps logps{pi[2 * k], pi[2 * k + 1], ref[2 * k], ref[2 * k + 1]};
      sum.Add(logps, engine::PreferencePairLoss(options_, logps));
    }
    sum.AddNll(engine::ChosenCrossEntropySum(p, batch.sequences),
               engine::ChosenTargets(batch.sequences));
  }
  return sum.Means(options_.nll_alpha);
}

namespace {

std::vector<Scalar> ScalarsOf(std::string_view prefix, const engine::PreferenceMetrics& m,
                              const engine::PreferenceOptions& options) {
  const std::string p(prefix);
  std::vector<Scalar> s = {
      {p + "rewards/chosen", m.rewards_chosen},       {p + "rewards/rejected", m.rewards_rejected},
      {p + "rewards/accuracies", m.rewards_accuracy}, {p + "rewards/margins", m.rewards_margin},
      {p + "logps/chosen", m.logps_chosen},           {p + "logps/rejected", m.logps_rejected}};
  if (options.nll_alpha > 0) s.push_back({p + "nll_loss", m.nll_loss});
  return s;
}

}  // namespace

std::vector<Scalar> PreferenceTraining::Scalars(std::string_view prefix,
                                                const engine::PreferenceMetrics& m) const {
  return ScalarsOf(prefix, m, options_);
}

std::vector<std::string> PreferenceTraining::Tags(std::string_view prefix,
                                                  const engine::PreferenceOptions& options) {
  std::vector<std::string> tags;
  for (Scalar& s : ScalarsOf(prefix, {}, options)) tags.push_back(std::move(s.tag));
  return tags;
}

std::string PreferenceTraining::MetricsLine(const engine::PreferenceMetrics& m) const {
  std::string s = fmt::format(
      "rewards/accuracies {:.4f} | rewards/margins {:.4f} | rewards/chosen {:.4f} | "
      "rewards/rejected {:.4f} | logps/chosen {:.4f} | logps/rejected {:.4f}",
      m.rewards_accuracy, m.rewards_margin, m.rewards_chosen, m.rewards_rejected, m.logps_chosen,
      m.logps_rejected);
  if (options_.nll_alpha > 0) s += fmt::format(" | nll_loss {:.4f}", m.nll_loss);
  return s;
}

nlohmann::json PreferenceTraining::Json(const engine::PreferenceMetrics& m) {
  return {{"pairs", m.pairs},
          {"loss", m.loss},
          {"rewards/chosen", m.rewards_chosen},
          {"rewards/rejected", m.rewards_rejected},
          {"rewards/accuracies", m.rewards_accuracy},
          {"rewards/margins", m.rewards_margin},
          {"logps/chosen", m.logps_chosen},
          {"logps/rejected", m.logps_rejected},
          {"nll_loss", m.nll_loss}};
}

std::string PreferenceTraining::Summary(const engine::PreferenceMetrics& m) {
  return fmt::format("acc {:.2f} margin {:.3f}", m.rewards_accuracy, m.rewards_margin);
}

}  // namespace strata::tools
