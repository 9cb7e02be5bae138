// The collective watchdog: ends the job when a collective waits too long for the other ranks.
//
// A rank that dies or hangs leaves every other rank blocked inside its next collective, forever
// (MPI and NCCL have no timeout of their own). Each collective registers itself here while it
// runs (a Scope); one thread per watchdog wakes when the earliest registered deadline passes and,
// for every collective still registered past its timeout, calls on_timeout once with the line
//   "strata: rank R: <collective> waited N s for the other ranks; a rank died or hangs: aborting
//   the job"
// (no trailing newline; N is whole seconds). The MPI backend's on_timeout prints it to stderr and
// calls MPI_Abort, so on_timeout does not return there; a watchdog whose on_timeout returns goes
// on watching the other collectives (tests use that).
//
// Internal to comm/: the backends keep one watchdog per process (communicator.h promises one
// thread per process, not per communicator).
//
// Thread-safety: Begin/End/Scope from any thread; on_timeout runs on the watchdog's thread with no
// lock held. Cost per collective: one mutex lock and one condition-variable notify at Begin, one
// lock at End.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "base/thread_annotations.h"

namespace strata::comm::internal {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // rank: this process's rank in the world, for the line. Starts the thread.
  Watchdog(int rank, std::function<void(const std::string& line)> on_timeout);
  ~Watchdog();  // Stop()
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Registers `collective` (a string literal: "all-reduce") as started now, with a deadline
  // timeout_seconds from now (> 0). Returns the id to End() it with.
  uint64_t Begin(const char* collective, double timeout_seconds);
  // The collective `id` finished (or failed): it is no longer watched. Unknown ids are ignored.
  void End(uint64_t id);
  // Joins the thread; later Begin calls register but nothing fires. Idempotent.
  void Stop();

  // Registers for its lifetime; does nothing when watchdog is null or timeout_seconds <= 0.
  class Scope {
   public:
    Scope(Watchdog* watchdog, const char* collective, double timeout_seconds);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Watchdog* watchdog_ = nullptr;
    uint64_t id_ = 0;
  };

 private:
  struct Entry {
    const char* collective;
    Clock::time_point start;
    Clock::time_point deadline;
  };
  void Run();

  const int rank_;
  const std::function<void(const std::string&)> on_timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> running_ STRATA_GUARDED_BY(mu_);
  uint64_t next_id_ STRATA_GUARDED_BY(mu_) = 1;
  bool stop_ STRATA_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The process's watchdog for the MPI job (defined by the MPI backend, mpi_communicator.cc): made
// on the first call, with an on_timeout that prints the line to stderr and calls
// MPI_Abort(MPI_COMM_WORLD, 1); never destroyed (its thread is stopped at exit, before
// MPI_Finalize). nullptr when timeout_seconds <= 0 or MPI is not initialised. Thread-safe.
Watchdog* JobWatchdog(double timeout_seconds);

}  // namespace strata::comm::internal
