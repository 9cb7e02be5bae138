// The CPU update during backward, exact: speculation, then validation (docs/ARCHITECTURE.md, "The
// update during backward").
//
// A block's CPU update can start as soon as its gradient is complete (its last micro-batch's
// contribution folded), during backward, but the exact step scales every gradient by
// clip / loss_scale and skips the step on a non-finite gradient, and neither is known before the
// whole backward has run. The update therefore starts *speculatively*, assuming no clipping and
// no overflow (gradient scale 1 / loss_scale, Adam's t + 1), and is validated when backward ends:
// when the global norm is within the clip threshold and every value is finite the speculative
// updates stand (they are the exact step bit for bit: the same kernel, the same scale, the same
// t); otherwise every block updated speculatively is restored and updated again with the clip
// coefficient, or left restored on an overflow (the step is skipped). After DeepSpeed
// SuperOffload's "speculation-then-validation" (Lian et al., ASPLOS 2026); LoHan (Liao et al.,
// 2024) updates during backward too.
//
// How a block is restored: from a copy of what its update overwrites, taken by the update stage
// just before it runs (UpdateSpeculation::BeforeUpdate): the fp32 master weights and optimizer
// state when they live in host memory, and the 16-bit working params when their home is a pinned
// buffer. Nothing is copied for what lives on NVMe: the write-back of a speculative block waits
// for the verdict (BeforeWrite) and is dropped on a rollback, so the extents keep the old values.
// Recomputing instead is not exact: an update is not invertible in floating point (m = b1 m + ...
// loses bits), so "undo" needs the old bytes. The copies come from one backup area of a fixed
// size (EngineOptions::speculation_backup_bytes), reserved in the order updates start: an update
// that would not fit waits for the verdict (and then needs no copy), so the area bounds the
// memory and only the blocks that really update before the verdict pay for the copy: about as
// many as the CPU updates during one backward pass.
//
// Prediction (SpeculationPolicy): a block is updated speculatively only while the step is
// predicted not to clip: the sum of squares folded so far plus last step's share of the blocks
// still to come, against (0.9 x clip)^2. A step whose norm will clip is then not speculated at
// all, so a run that clips every step (common early in training) updates after backward as
// before, instead of rolling back every step; a prediction cannot make a clipped step exact (the
// clip coefficient is a float of the whole norm), so it predicts *whether* the step clips. The
// first step with clipping on has no history and is not speculated.
//
// Threads. UpdateSpeculation: Begin, Resolve, Restore and the counters on the driving thread
// (Begin and Restore with the pipeline drained); Submitted on the gradient fold thread;
// BeforeUpdate and BeforeWrite on the optimizer pipeline's update and write threads (both may
// block until Resolve). SpeculationPolicy: BeginStep and EndStep on the driving thread, Speculate
// on the fold thread (between them: the step's folds).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "cpu_optim/grad_stats.h"

namespace strata::engine {

class UpdateSpeculation {
 public:
  // What the update stage does with a block (BeforeUpdate).
  enum class Action {
    kUpdate,            // not speculative, or the verdict came first and says it stands
    kUpdateWithBackup,  // speculative: copy what the update overwrites to *backup first
    kSkip,              // the verdict came first and says roll back: the block is redone later
  };

  // num_blocks blocks; a backup area of capacity_bytes (allocated by Allocate).
  UpdateSpeculation(int num_blocks, uint64_t capacity_bytes);
  // kResourceExhausted when the area cannot be allocated.
  Status Allocate();
  uint64_t capacity_bytes() const { return capacity_; }

  // A step's speculation opens: no block submitted, verdict pending, the area empty.
  void Begin() STRATA_EXCLUDES(mu_);
  // Block b was submitted speculatively (before the verdict).
  void Submitted(int b) STRATA_EXCLUDES(mu_);
  // Speculative submissions whose update has not started yet. The fold keeps this at most
  // kQueueDepth: the pipeline runs submissions in order, so a block queued behind many
  // speculative ones that never start before the verdict (backward order: block 0 last) would hold
  // up the next forward's first block, which the engine submits first after backward.
  static constexpr int kQueueDepth = 2;
  bool HasRoom() STRATA_EXCLUDES(mu_);
  bool WasSubmitted(int b) STRATA_EXCLUDES(mu_);
  // Update stage, before block b's update, which overwrites backup_bytes of memory that a
  // rollback must restore: reserves them in the area and returns kUpdateWithBackup with *backup
  // set, or waits for the verdict when the area is full.
  Action BeforeUpdate(int b, uint64_t backup_bytes, std::byte** backup) STRATA_EXCLUDES(mu_);
  // Write stage, before block b's write-back to NVMe: false to drop it (a rolled-back block, or
  // one whose update was skipped); waits for the verdict when b was updated speculatively.
  bool BeforeWrite(int b) STRATA_EXCLUDES(mu_);
  // The verdict: the speculative updates stand, or are rolled back. Wakes every waiting stage.
  void Resolve(bool stands) STRATA_EXCLUDES(mu_);
  // After a rollback with the pipeline drained: fn(b, backup) for every block updated
  // speculatively, to copy its backup back. Closes the step's speculation.
  void ForEachBackup(const std::function<void(int block, const std::byte* backup)>& fn)
      STRATA_EXCLUDES(mu_);
  // Blocks whose update ran before the verdict, this step.
  std::vector<int> UpdatedBeforeVerdict() STRATA_EXCLUDES(mu_);
  // The blocks submitted speculatively this step, in submission order.
  std::vector<int> SubmissionOrder() STRATA_EXCLUDES(mu_);

 private:
  enum class BlockState { kIdle, kSubmitted, kBackedUp, kRanAfter, kSkipped };
  enum class Verdict { kPending, kStands, kRollBack };

  const uint64_t capacity_;
  AlignedBuffer area_;
  std::mutex mu_;
  std::condition_variable resolved_;
  Verdict verdict_ STRATA_GUARDED_BY(mu_) = Verdict::kStands;
  uint64_t used_ STRATA_GUARDED_BY(mu_) = 0;
  std::vector<BlockState> state_ STRATA_GUARDED_BY(mu_);
  std::vector<uint64_t> offset_ STRATA_GUARDED_BY(mu_);  // of a kBackedUp block's copy
  std::vector<int> order_ STRATA_GUARDED_BY(mu_);        // submissions this step
  int queued_ STRATA_GUARDED_BY(mu_) = 0;                // submitted, update not started
};

class SpeculationPolicy {
 public:
  // clip_norm: EngineOptions::grad_clip_norm (0: off); always: speculate on every block whatever
  // the prediction (EngineTestHooks::always_speculate).
  SpeculationPolicy(int num_blocks, float clip_norm, bool always = false);

  // A step starts, its gradients scaled by loss_scale.
  void BeginStep(float loss_scale);
  // Block b's gradient is complete: its statistics and the step's so far (b's included). Whether
  // to update it now, speculatively; once false, false for the rest of the step.
  bool Speculate(int b, const cpu_optim::GradStats& block, const cpu_optim::GradStats& so_far);
  // The step ended; overflow: its statistics are not a prediction for the next one.
  void EndStep(bool overflow);

 private:
  const float clip_norm_;
  const bool always_;
  float scale_ = 1;
  bool stopped_ = false;
  bool have_last_ = false;
  std::vector<double> last_, now_;  // per block: unscaled sum of squares, last step and this one
  double last_remaining_ = 0;       // last step's sum over the blocks not done yet this step
};

}  // namespace strata::engine
