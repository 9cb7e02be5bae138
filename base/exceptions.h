// Exceptions at the edge of Status. Strata's code returns Status; the standard library and some
// libraries throw: std::bad_alloc when host memory or the address space runs out, an error of
// oneTBB or std::thread when a thread cannot start. On a worker thread such a throw reaches
// std::terminate, where no destructor runs (a run's swap files stay behind, its process aborts).
// The loops of worker threads (a host stream, a work queue) call their work through
// CallCatchingExceptions, which hands the exception back as the Status the work would have
// returned; `strata`'s main reports one that escapes a command the same way.
//
// Thread-safety: every function is thread-safe (getrlimit, no shared state).
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata {

// The Status of the exception `e`, its message prefixed with "what: " (nothing when `what` is
// empty):
//   std::bad_alloc          kResourceExhausted "out of host memory (an allocation failed)"
//   a thread that cannot    kResourceExhausted "could not start a thread: <why>"
//   start (std::system_error from std::thread, oneTBB's "pthread_create has failed")
//   another std::exception  kInternal, its what()
//   anything else           kInternal "an exception that is not a std::exception"
// The two resource errors end with ProcessLimitsNote(false) and ProcessLimitsNote(true).
Status StatusOfException(std::exception_ptr e, std::string_view what);

// Calls fn() (returning Status) and returns its Status, or StatusOfException of what it threw.
template <typename Fn>
Status CallCatchingExceptions(std::string_view what, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (...) {
    return StatusOfException(std::current_exception(), what);
  }
}

// "; the process's address space is limited to 160.0 MiB (ulimit -v)" when RLIMIT_AS is set
// for this process, and with `threads` "; the user's processes and threads are limited to 64
// (ulimit -u)" when RLIMIT_NPROC is; "" when neither is. Where a failed allocation or thread
// start may be the limit's doing, not the machine's.
std::string ProcessLimitsNote(bool threads);

// The soft RLIMIT_AS of this process in bytes; 0 when unlimited.
uint64_t AddressSpaceLimitBytes();

}  // namespace strata
