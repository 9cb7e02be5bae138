#include "engine/optimizer_pipeline.h"

#include <utility>

#include "base/logging.h"

namespace strata::engine {

OptimizerPipeline::OptimizerPipeline(int num_blocks, int num_buffers, Stages stages)
    : num_buffers_(num_buffers), stages_(std::move(stages)), done_ticket_(num_blocks, 0) {
  STRATA_CHECK(num_buffers >= 1 && stages_.update);
}

OptimizerPipeline::~OptimizerPipeline() { Drain().IgnoreError(); }

void OptimizerPipeline::Submit(int block) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(block >= 0 && block < static_cast<int>(done_ticket_.size()));
  // Submission k (0-based) is ticket k+1 on every stage queue: each queue gets one task per
  // submission, in the same order.
  const uint64_t k = submissions_++;
  const int buffer = static_cast<int>(k % num_buffers_);
  const uint64_t ticket = k + 1;
  const uint64_t frees_buffer =
      ticket > static_cast<uint64_t>(num_buffers_) ? ticket - num_buffers_ : 0;
  read_.Submit([this, block, buffer, frees_buffer]() -> Status {
    // The buffer's previous user must have finished its write-back.
    STRATA_RETURN_IF_ERROR(write_.WaitFor(frees_buffer));
    return stages_.read ? stages_.read(block, buffer) : Status::Ok();
  });
  update_.Submit([this, block, buffer, ticket]() -> Status {
    STRATA_RETURN_IF_ERROR(read_.WaitFor(ticket));
    return stages_.update(block, buffer);
  });
  write_.Submit([this, block, buffer, ticket]() -> Status {
    STRATA_RETURN_IF_ERROR(update_.WaitFor(ticket));
    return stages_.write ? stages_.write(block, buffer) : Status::Ok();
  });
  done_ticket_[block] = ticket;
}

Status OptimizerPipeline::WaitBlock(int block) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = done_ticket_.at(block);
  }
  return write_.WaitFor(ticket);
}

Status OptimizerPipeline::WaitUpdated(int block) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = done_ticket_.at(block);
  }
  return update_.WaitFor(ticket);
}

Status OptimizerPipeline::Drain() {
  // Every stage, in pipeline order: after a failure the write stage skips its tasks at once while
  // read tasks may still be queued, and those wait on the write stage (the destructor relies on
  // nothing being left on any stage).
  Status read = read_.Drain();
  Status update = update_.Drain();
  Status write = write_.Drain();
  if (!write.ok()) return write;
  if (!update.ok()) return update;
  return read;
}

}  // namespace strata::engine
