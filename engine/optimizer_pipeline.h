// The CPU-optimizer pipeline (docs/ARCHITECTURE.md, "The CPU optimizer pipeline and NVMe swap"):
// block updates run on three host threads (WorkQueues) so that, for optimizer state on NVMe, the
// read of block b+1's state, the update of block b and the write-back of block b-1 overlap:
//
//   read   stage:  NVMe -> pinned buffer (m, v, fp32 master weights)      "nvme read"
//   update stage:  CPU optimizer on the buffer, copy-out of new p16        "cpu optimizer"
//   write  stage:  pinned buffer -> NVMe (state, and params whose home is NVMe)  "nvme write"
//
// num_buffers pinned buffers cycle through the stages: submission k (counted from 0) uses buffer
// k % num_buffers, and its read waits until the write of submission k - num_buffers has released
// that buffer. With 3 buffers all three stages are busy at once. The stages are the caller's
// callbacks (the pipeline owns no memory); a null read or write callback is a stage with nothing
// to do (optimizer state in host memory).
//
// Ordering: stages run submissions in submission order; a block's update is "done" when its
// write stage has returned. WaitBlock(b) is what the next forward pass of block b waits on, so
// the step of later blocks overlaps the next forward (no stale update: b's new weights are
// always used).
//
// Errors: the first failing stage's Status is sticky for the pipeline (later submissions are
// skipped) and comes back from every WaitBlock and Drain.
//
// Thread-safety: Submit, WaitBlock and Drain may be called from any thread; concurrent Submits
// are serialized (the order is then the order they took the lock). The callbacks run on the
// stage threads and must not call back into the pipeline.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "base/thread_annotations.h"
#include "engine/work_queue.h"

namespace strata::engine {

class OptimizerPipeline {
 public:
  // (block, buffer index in [0, num_buffers)).
  using StageFn = std::function<Status(int block, int buffer)>;
  struct Stages {
    StageFn read;    // may be null
    StageFn update;  // required
    StageFn write;   // may be null
  };

  OptimizerPipeline(int num_blocks, int num_buffers, Stages stages);
  ~OptimizerPipeline();  // drains

  int num_buffers() const { return num_buffers_; }
  // Queues the read, update and write of `block`; returns at once.
  void Submit(int block) STRATA_EXCLUDES(mu_);
  // Waits until the last submitted update of `block` has been written (OK at once if none was
  // submitted); the sticky error of any stage.
  Status WaitBlock(int block) STRATA_EXCLUDES(mu_);
  // Waits only until the last submitted update stage of `block` has returned (its write-back may
  // still run): what a reader of the update's outputs outside the pipeline buffers needs (the
  // offload optimizer's caller buffers). Errors: the update stage's sticky error (which includes
  // a failed read, and a failed write once a later read waited on it).
  Status WaitUpdated(int block) STRATA_EXCLUDES(mu_);
  // Waits for every submitted update.
  Status Drain();

 private:
  const int num_buffers_;
  const Stages stages_;
  std::mutex mu_;
  uint64_t submissions_ STRATA_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> done_ticket_ STRATA_GUARDED_BY(mu_);  // per block; 0 = none
  // Declared last: destroyed (joined) first, while everything above is alive.
  WorkQueue read_{"optimizer read"}, update_{"optimizer update"}, write_{"optimizer write"};
};

}  // namespace strata::engine
