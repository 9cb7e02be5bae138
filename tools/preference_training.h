// Preference training in `strata train` (--objective dpo|ipo|simpo, docs/preference.md): the
// objective of each step (engine/preference_objective.h) over the micro-batches of a preference
// dataset (data/preference_dataset.h), its reference log-probabilities, and its validation.
//
// The reference:
//   - with LoRA, the frozen base (adapters off): the engine computes it in the same pass over
//     each block as the policy (PlacementOptions::objective.reference_forward), for training and
//     for validation (both in one pass too: Engine::EvaluatePolicyAndReference);
//   - with full fine-tuning, the initial weights: before the first step (and before --resume
//     loads a checkpoint) a forward pass over every training and validation pair writes each
//     completion's summed log-probability and target count to `reference-logps.json` in the save
//     directory (in memory only without --save-dir; TRL's precompute_ref_log_probs). The file
//     records the xxh3 of the data's micro-batches and of the initial master weights: a fresh
//     run recomputes a file that does not match, a resumed run refuses one (kFailedPrecondition,
//     naming the file and what differs), and a missing file is recomputed.
// SimPO has no reference.
//
// Thread-safety: one thread (the training loop's).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "data/preference_dataset.h"
#include "engine/engine.h"
#include "engine/preference_objective.h"
#include "tools/metrics.h"

namespace strata::tools {

// --objective sft|dpo|ipo|simpo and its hyper-parameters (train's and eval's flags, or the
// config's keys) as options: nullopt for sft. One author for both commands. Errors
// (kInvalidArgument, one line naming the flag): a value out of range
// (engine::CheckPreferenceOptions), --beta, --label-smoothing or --simpo-gamma given (not at
// their defaults) for an objective that does not read them, and --rpo-alpha (DPO, IPO) or
// --cpo-alpha (SimPO) for the other objectives (they set PreferenceOptions::nll_alpha).
StatusOr<std::optional<engine::PreferenceOptions>> PreferenceOptionsFromFlags(
    const std::string& objective, double beta, double label_smoothing, double simpo_gamma,
    double rpo_alpha = 0, double cpo_alpha = 0);

class PreferenceTraining {
 public:
  // data: not owned, outlives this. reference_from_model: LoRA (the engine's frozen reference).
  PreferenceTraining(const engine::PreferenceOptions& options, const data::PreferenceDataset* data,
                     bool reference_from_model, int micro_batch_size, int seq_len);

  // Full fine-tuning with a reference (DPO, IPO): the reference log-probabilities of every pair,
  // read from save_dir/reference-logps.json or computed with the engine's current (initial)
  // weights and written there (save_dir empty, or a data-parallel rank other than 0 (`write`
  // false): kept in memory). Call once, before --resume loads a checkpoint. Prints one line
  // saying which. `cancel_requested` (may be empty; strata train's stop signal) is polled before
  // each group of pairs: kCancelled once it says so, nothing written. Errors: the engine's, the
  // file's (a damaged file is kDataLoss naming it; a resumed run's mismatch
  // kFailedPrecondition), writing it.
  Status PrepareReference(engine::Engine& engine, const std::string& save_dir, bool resuming,
                          bool write = true, const std::function<bool()>& cancel_requested = {});

  // strata eval of a full model against a reference model (--reference-model-dir): the
  // reference log-probabilities of every validation pair, computed with `reference` (an engine
  // over the reference model with the evaluation's micro-batch shape and objective buffers), for
  // Evaluate. Construct with reference_from_model false. Errors: the engine's.
  Status ComputeValidationReference(engine::Engine& reference);

  // Describes a step's micro-batches (kept alive by the caller until the step returns) to the
  // objective; job_pairs and job_chosen_targets: the pairs and the chosen completions' targets
  // (engine::ChosenTargets) of the step over every data-parallel rank (0: one rank).
  // Errors: PreferenceObjective::BeginStep's.
  Status BeginStep(std::span<const data::Batch> micro_batches, int64_t job_pairs = 0,
                   int64_t job_chosen_targets = 0);
  engine::SequenceObjective* objective() { return &objective_; }
  // The metrics of the pairs weighed since the last call: this rank's, or with `comm` (not
  // owned; may be null) every rank's, a collective all ranks call alike. Errors: comm's.
  StatusOr<engine::PreferenceMetrics> TakeMetrics(comm::Communicator* comm);

  // The metrics over every validation pair (with LoRA the reference and the policy in one pass,
  // Engine::EvaluatePolicyAndReference).
  StatusOr<engine::PreferenceMetrics> Evaluate(engine::Engine& engine);

  // TRL's names under `prefix` ("train/", "val/"): <prefix>rewards/chosen, rewards/rejected,
  // rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, and nll_loss where the
  // NLL term is on (options' nll_alpha > 0).
  std::vector<Scalar> Scalars(std::string_view prefix, const engine::PreferenceMetrics& m) const;
  // The tags of Scalars under `prefix` for a run with these options, in its order.
  static std::vector<std::string> Tags(std::string_view prefix,
                                       const engine::PreferenceOptions& options);
  // "acc 0.75 margin 0.123" for the progress line.
  static std::string Summary(const engine::PreferenceMetrics& m);
  // "rewards/accuracies 0.9500 | rewards/margins ... | logps/rejected -1.2345" (and " | nll_loss
  // ..." where the NLL term is on): the metrics of a validation or eval line.
  std::string MetricsLine(const engine::PreferenceMetrics& m) const;
  // The metrics under TRL's names with "pairs", "loss" and "nll_loss" (for --summary-json and
  // eval --json).
  static nlohmann::json Json(const engine::PreferenceMetrics& m);

 private:
  // Completion s of pair p of a split: its summed log-probability and target count.
  struct Completions {
    std::vector<double> logp_sum;  // 2 per pair: chosen, rejected
    std::vector<int64_t> targets;
  };
  // Reference log-probabilities of a micro-batch's pairs, summed or averaged as the loss wants.
  std::vector<double> ReferenceOf(const Completions& split, const data::Batch& batch) const;
  StatusOr<Completions> ComputeReference(engine::Engine& engine, bool val,
                                         const std::function<bool()>& cancel_requested = {});
  // Fills train_ref_ and val_ref_ from the file at `path` when it was made for this data,
  // these initial weights and this working precision ("bf16", ...) (true); false when it was not
  // and the run is fresh (recompute). Errors: kDataLoss naming the file (unreadable, not the
  // format, arrays not two completions a pair of finite log-probabilities over >= 1 target
  // each); kFailedPrecondition for a resumed run's file of other data, weights or precision.
  StatusOr<bool> ReadReferenceFile(const std::string& path, uint64_t data_hash,
                                   uint64_t weights_hash, std::string_view precision,
                                   bool resuming);
  uint64_t DataXxh3() const;

  engine::PreferenceOptions options_;
  const data::PreferenceDataset* data_;
  bool reference_from_model_;
  int micro_batch_size_, seq_len_;
  engine::PreferenceObjective objective_;
  Completions train_ref_, val_ref_;  // full fine-tuning only
};

}  // namespace strata::tools
