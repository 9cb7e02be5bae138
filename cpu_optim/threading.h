// Where cpu_optim's work runs: a oneTBB arena of a chosen size whose threads are
// bound to chosen cores while they work for it.
//
// Every cpu_optim function runs on the calling thread and the oneTBB workers of the
// caller's arena, so binding is a property of the arena, not of the optimizer:
//
//   ThreadingOptions options{.num_threads = 8, .cores = {0, 1, 2, 3, 4, 5, 6, 7}};
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WorkerArena> arena, WorkerArena::Create(options));
//   Status s;
//   arena->Execute([&] { s = AdamWUpdate(...); });
//
// Binding keeps the optimizer's threads off the cores that feed the GPU (the
// engine's copy and I/O threads) and on the NUMA node that holds the state, as
// ZeRO-Offload does with its thread binding. It never changes results: every
// optimizer is element-wise in fixed tiles, so results are bit-identical with or
// without binding, for any thread count.
//
// Mechanism: a tbb::task_arena with num_threads slots (one reserved for the calling
// thread) and a tbb::task_scheduler_observer on it; when a thread enters the arena
// it is bound with sched_setaffinity to cores[slot % cores.size()] (slot =
// tbb::this_task_arena::current_thread_index()), and when it leaves, its previous
// affinity mask is restored, so oneTBB workers that go on to serve other arenas are
// not left bound. Linux only (sched_setaffinity); elsewhere Create returns
// kUnimplemented when cores is not empty.
//
// Thread-safety: Execute may be called from several threads at once (they share the
// arena's slots). Do not call Execute of one WorkerArena from inside another's.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"

namespace strata::cpu_optim {

struct ThreadingOptions {
  // Threads that run cpu_optim work, the calling thread included; 0: one per entry
  // of `cores`, or oneTBB's default concurrency when `cores` is empty.
  int num_threads = 0;
  // Logical CPU ids (as sched_setaffinity and /proc/cpuinfo number them) to bind
  // to; each must be in the process's current affinity mask, none twice. Empty: no
  // binding.
  std::vector<int> cores = {};
};

class WorkerArena {
 public:
  // kInvalidArgument for num_threads < 0, a core id out of range, listed twice or
  // not allowed for this process (the message names it); kUnimplemented for
  // binding on a system without sched_setaffinity.
  static StatusOr<std::unique_ptr<WorkerArena>> Create(const ThreadingOptions& options);

  ~WorkerArena();
  WorkerArena(const WorkerArena&) = delete;
  WorkerArena& operator=(const WorkerArena&) = delete;

  // Runs fn on the calling thread inside the arena and returns when it returns;
  // cpu_optim calls made by fn run on the arena's threads. The calling thread is
  // bound (to cores[0] usually) for the duration and restored afterwards.
  void Execute(const std::function<void()>& fn);

  int num_threads() const;
  std::span<const int> cores() const;

 private:
  struct Impl;
  explicit WorkerArena(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::cpu_optim
