// WorkQueue: one host worker thread that runs submitted tasks in submission order (an in-order
// host "stream" for the engine's CPU-side work: prefetch loads, gradient folding, the optimizer
// pipeline's read, update and write stages).
//
// Each Submit returns a ticket; WaitFor(ticket) blocks the calling thread until that task and
// every earlier one have run. Errors are sticky, like a device stream's: the first task that
// returns a non-OK Status sets the queue's error, later tasks are skipped (their tickets still
// complete), and every WaitFor/Drain from then on returns that error. There is no reset: an
// engine whose queue failed must be recreated (its state is unknown).
//
// Thread-safety: Submit, WaitFor and Drain may be called from any thread, including from a task
// running on another WorkQueue. A task must not wait on its own queue. The destructor runs what
// was submitted, then joins the worker.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "base/status.h"
#include "base/thread_annotations.h"

namespace strata::engine {

class WorkQueue {
 public:
  explicit WorkQueue(std::string name);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  const std::string& name() const { return name_; }
  // Enqueues fn; returns its ticket (1, 2, 3, ... in submission order).
  uint64_t Submit(std::function<Status()> fn);
  // Waits until the task with `ticket` (and all before it) ran; the sticky error, if any.
  // ticket 0 waits for nothing.
  Status WaitFor(uint64_t ticket);
  // Waits for every task submitted so far.
  Status Drain();
  // True when `ticket` has completed (never blocks).
  bool Done(uint64_t ticket);

 private:
  void Run();

  const std::string name_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<Status()>> tasks_ STRATA_GUARDED_BY(mu_);
  uint64_t submitted_ STRATA_GUARDED_BY(mu_) = 0;
  uint64_t completed_ STRATA_GUARDED_BY(mu_) = 0;
  Status error_ STRATA_GUARDED_BY(mu_);
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace strata::engine
