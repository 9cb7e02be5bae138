#include "engine/update_speculation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/logging.h"

namespace strata::engine {

UpdateSpeculation::UpdateSpeculation(int num_blocks, uint64_t capacity_bytes)
    : capacity_(capacity_bytes), state_(num_blocks, BlockState::kIdle), offset_(num_blocks, 0) {}

Status UpdateSpeculation::Allocate() {
  if (capacity_ == 0) return Status::Ok();
  StatusOr<AlignedBuffer> area = AlignedBuffer::Allocate(capacity_, 64);
  if (!area.ok()) {
    return ResourceExhaustedError(
        fmt::format("the update during backward could not allocate its {} MiB backup area; lower "
                    "`speculation_backup_bytes` or turn it off (`update_during_backward off`)",
                    capacity_ >> 20));
  }
  area_ = std::move(area).value();
  return Status::Ok();
}

void UpdateSpeculation::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  verdict_ = Verdict::kPending;
  used_ = 0;
  queued_ = 0;
  order_.clear();
  std::fill(state_.begin(), state_.end(), BlockState::kIdle);
}

void UpdateSpeculation::Submitted(int b) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(verdict_ == Verdict::kPending && state_[b] == BlockState::kIdle);
  state_[b] = BlockState::kSubmitted;
  order_.push_back(b);
  ++queued_;
}

bool UpdateSpeculation::HasRoom() {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_ < kQueueDepth;
}

std::vector<int> UpdateSpeculation::SubmissionOrder() {
  std::lock_guard<std::mutex> lock(mu_);
  return order_;
}

bool UpdateSpeculation::WasSubmitted(int b) {
  std::lock_guard<std::mutex> lock(mu_);
  return state_[b] != BlockState::kIdle;
}

UpdateSpeculation::Action UpdateSpeculation::BeforeUpdate(int b, uint64_t backup_bytes,
                                                          std::byte** backup) {
  std::unique_lock<std::mutex> lock(mu_);
  if (state_[b] != BlockState::kSubmitted) return Action::kUpdate;
  // Copies start on 64-byte boundaries.
  const uint64_t bytes = (backup_bytes + 63) / 64 * 64;
  resolved_.wait(lock, [&] { return verdict_ != Verdict::kPending || used_ + bytes <= capacity_; });
  --queued_;  // starts now (a wait for space counted as queued)
  if (verdict_ == Verdict::kPending) {
    state_[b] = BlockState::kBackedUp;
    offset_[b] = used_;
    *backup = area_.data() + used_;
    used_ += bytes;
    return Action::kUpdateWithBackup;
  }
  if (verdict_ == Verdict::kStands) {
    state_[b] = BlockState::kRanAfter;
    return Action::kUpdate;
  }
  state_[b] = BlockState::kSkipped;
  return Action::kSkip;
}

bool UpdateSpeculation::BeforeWrite(int b) {
  std::unique_lock<std::mutex> lock(mu_);
  if (state_[b] == BlockState::kSkipped) return false;
  if (state_[b] != BlockState::kBackedUp) return true;
  resolved_.wait(lock, [&] { return verdict_ != Verdict::kPending; });
  return verdict_ == Verdict::kStands;
}

void UpdateSpeculation::Resolve(bool stands) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    verdict_ = stands ? Verdict::kStands : Verdict::kRollBack;
  }
  resolved_.notify_all();
}

void UpdateSpeculation::ForEachBackup(
    const std::function<void(int block, const std::byte* backup)>& fn) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(verdict_ == Verdict::kRollBack);
  for (size_t b = 0; b < state_.size(); ++b) {
    if (state_[b] == BlockState::kBackedUp) fn(static_cast<int>(b), area_.data() + offset_[b]);
    state_[b] = BlockState::kIdle;
  }
}

std::vector<int> UpdateSpeculation::UpdatedBeforeVerdict() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> blocks;
  for (size_t b = 0; b < state_.size(); ++b) {
    if (state_[b] == BlockState::kBackedUp) blocks.push_back(static_cast<int>(b));
  }
  return blocks;
}

SpeculationPolicy::SpeculationPolicy(int num_blocks, float clip_norm, bool always)
    : clip_norm_(clip_norm), always_(always), last_(num_blocks, 0), now_(num_blocks, 0) {}

void SpeculationPolicy::BeginStep(float loss_scale) {
  scale_ = loss_scale;
  stopped_ = false;
  last_remaining_ = 0;
  for (double s : last_) last_remaining_ += s;
}

bool SpeculationPolicy::Speculate(int b, const cpu_optim::GradStats& block,
                                  const cpu_optim::GradStats& so_far) {
  const double inv2 = 1.0 / (static_cast<double>(scale_) * scale_);
  now_[b] = block.sum_squares * inv2;
  last_remaining_ -= last_[b];
  if (always_) return true;
  if (stopped_) return false;
  if (so_far.nonfinite || !std::isfinite(so_far.sum_squares)) {
    stopped_ = true;  // the step will be skipped
  } else if (clip_norm_ > 0) {
    // Predicted norm: what is folded so far plus last step's share of the rest.
    const double limit = 0.9 * clip_norm_;
    const double predicted = so_far.sum_squares * inv2 + std::max(0.0, last_remaining_);
    if (!have_last_ || predicted > limit * limit) stopped_ = true;
  }
  return !stopped_;
}

void SpeculationPolicy::EndStep(bool overflow) {
  have_last_ = !overflow;
  if (!overflow) last_ = now_;
}

}  // namespace strata::engine
