#include "engine/work_queue.h"

#include <utility>

#include "base/exceptions.h"

namespace strata::engine {

WorkQueue::WorkQueue(std::string name) : name_(std::move(name)) {
  worker_ = std::thread([this] { Run(); });
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
}

uint64_t WorkQueue::Submit(std::function<Status()> fn) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(fn));
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

Status WorkQueue::WaitFor(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ >= ticket; });
  return error_;
}

Status WorkQueue::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = submitted_;
  done_cv_.wait(lock, [&] { return completed_ >= ticket; });
  return error_;
}

bool WorkQueue::Done(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= ticket;
}

void WorkQueue::Run() {
  for (;;) {
    std::function<Status()> fn;
    bool skip;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and nothing left
      fn = std::move(tasks_.front());
      tasks_.pop_front();
      skip = !error_.ok();
    }
    // Run outside the lock: tasks do I/O and wait on other queues.
    // A throw (std::bad_alloc) fails the queue as an error would, not the process.
    Status s = skip ? Status::Ok() : CallCatchingExceptions(name_, fn);
    fn = nullptr;  // release captures before completing
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && error_.ok()) error_ = std::move(s);
      ++completed_;
    }
    done_cv_.notify_all();
  }
}

}  // namespace strata::engine
