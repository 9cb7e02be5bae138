// WorkerArena: a tbb::task_arena plus an observer that binds its threads to cores.
#include "cpu_optim/threading.h"

#include <fmt/format.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif

#include "base/status.h"

namespace strata::cpu_optim {
namespace {

#if defined(__linux__)
// The affinity a thread had before it entered a binding arena, restored when it
// leaves. depth counts nested entries of the same thread (only the outermost
// saves and restores).
struct SavedAffinity {
  cpu_set_t mask;
  int depth = 0;
  bool valid = false;
};
thread_local SavedAffinity t_saved;

void BindCurrentThread(int core) {
  SavedAffinity& saved = t_saved;
  if (saved.depth++ == 0) {
    saved.valid = sched_getaffinity(0, sizeof(saved.mask), &saved.mask) == 0;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(core, &one);
  // Failure (the core went offline or a cgroup changed) leaves the thread unbound:
  // binding is a placement hint and never changes results.
  (void)sched_setaffinity(0, sizeof(one), &one);
}

void UnbindCurrentThread() {
  SavedAffinity& saved = t_saved;
  if (saved.depth == 0) return;
  if (--saved.depth == 0 && saved.valid) {
    (void)sched_setaffinity(0, sizeof(saved.mask), &saved.mask);
  }
}
#endif

class BindingObserver final : public tbb::task_scheduler_observer {
 public:
  BindingObserver(tbb::task_arena& arena, std::vector<int> cores)
      : tbb::task_scheduler_observer(arena), cores_(std::move(cores)) {
    observe(true);
  }
  ~BindingObserver() override { observe(false); }

  void on_scheduler_entry(bool /*is_worker*/) override {
#if defined(__linux__)
    const int slot = std::max(0, tbb::this_task_arena::current_thread_index());
    BindCurrentThread(cores_[static_cast<size_t>(slot) % cores_.size()]);
#endif
  }
  void on_scheduler_exit(bool /*is_worker*/) override {
#if defined(__linux__)
    UnbindCurrentThread();
#endif
  }

 private:
  std::vector<int> cores_;
};

}  // namespace

struct WorkerArena::Impl {
  int num_threads = 0;
  std::vector<int> cores;
  tbb::task_arena arena;
  std::unique_ptr<BindingObserver> observer;  // null: no binding
};

WorkerArena::WorkerArena(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WorkerArena::~WorkerArena() {
  // Stop observing before the arena goes away.
  if (impl_) impl_->observer.reset();
}

StatusOr<std::unique_ptr<WorkerArena>> WorkerArena::Create(const ThreadingOptions& options) {
  if (options.num_threads < 0) {
    return InvalidArgumentError(fmt::format(
        "WorkerArena: num_threads must be >= 0 (0: default), got {}", options.num_threads));
  }
  auto impl = std::make_unique<Impl>();
  impl->cores = options.cores;
  if (!options.cores.empty()) {
#if defined(__linux__)
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
      return ErrnoToStatus(errno, "WorkerArena: sched_getaffinity");
    }
    std::vector<int> seen;
    for (int core : options.cores) {
      if (core < 0 || core >= CPU_SETSIZE) {
        return InvalidArgumentError(
            fmt::format("WorkerArena: core {} is out of range [0, {})", core, CPU_SETSIZE));
      }
      if (!CPU_ISSET(core, &allowed)) {
        return InvalidArgumentError(fmt::format(
            "WorkerArena: core {} is not in this process's affinity mask ({} cores allowed); "
            "see taskset -p or the container's cpuset",
            core, CPU_COUNT(&allowed)));
      }
      if (std::find(seen.begin(), seen.end(), core) != seen.end()) {
        return InvalidArgumentError(fmt::format("WorkerArena: core {} is listed twice", core));
      }
      seen.push_back(core);
    }
#else
    return UnimplementedError(
        "WorkerArena: binding threads to cores needs Linux sched_setaffinity");
#endif
  }
  impl->num_threads = options.num_threads > 0  ? options.num_threads
                      : !options.cores.empty() ? static_cast<int>(options.cores.size())
                                               : tbb::info::default_concurrency();
  try {
    impl->arena.initialize(impl->num_threads, /*reserved_for_masters=*/1);
    if (!impl->cores.empty()) {
      impl->observer = std::make_unique<BindingObserver>(impl->arena, impl->cores);
    }
  } catch (const std::exception& e) {
    return InternalError(
        fmt::format("WorkerArena: oneTBB could not create the arena: {}", e.what()));
  }
  return std::unique_ptr<WorkerArena>(new WorkerArena(std::move(impl)));
}

void WorkerArena::Execute(const std::function<void()>& fn) {
  if (!impl_->observer) return impl_->arena.execute(fn);
#if defined(__linux__)
  // The observer binds the calling thread on entry; this makes sure its own mask is
  // restored even if oneTBB does not report the exit of an external thread.
  cpu_set_t before;
  const bool have_before = sched_getaffinity(0, sizeof(before), &before) == 0;
  impl_->arena.execute(fn);
  if (have_before) (void)sched_setaffinity(0, sizeof(before), &before);
#else
  impl_->arena.execute(fn);
#endif
}

int WorkerArena::num_threads() const { return impl_->num_threads; }

std::span<const int> WorkerArena::cores() const { return impl_->cores; }

}  // namespace strata::cpu_optim
