#include "base/exceptions.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <new>
#include <stdexcept>
#include <system_error>

#include "base/units.h"

namespace strata {
namespace {

std::string Prefixed(std::string_view what, std::string_view message) {
  return what.empty() ? std::string(message) : fmt::format("{}: {}", what, message);
}

// oneTBB reports a failed pthread_create as a std::runtime_error with this text.
bool IsThreadStartFailure(std::string_view message) {
  return message.rfind("pthread_create", 0) == 0;
}

}  // namespace

uint64_t AddressSpaceLimitBytes() {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 0;
  return static_cast<uint64_t>(limit.rlim_cur);
}

std::string ProcessLimitsNote(bool threads) {
  std::string note;
  if (const uint64_t as = AddressSpaceLimitBytes(); as > 0) {
    note +=
        fmt::format("; the process's address space is limited to {} (ulimit -v)", FormatBytes(as));
  }
  struct rlimit nproc {};
  if (threads && ::getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY) {
    note += fmt::format("; the user's processes and threads are limited to {} (ulimit -u)",
                        static_cast<unsigned long long>(nproc.rlim_cur));
  }
  return note;
}

Status StatusOfException(std::exception_ptr e, std::string_view what) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(
        Prefixed(what, "out of host memory (an allocation failed)" + ProcessLimitsNote(false)));
  } catch (const std::system_error& s) {
    if (s.code() == std::errc::resource_unavailable_try_again) {
      return ResourceExhaustedError(
          Prefixed(what, fmt::format("could not start a thread: {}{}", s.code().message(),
                                     ProcessLimitsNote(true))));
    }
    return InternalError(Prefixed(what, s.what()));
  } catch (const std::exception& x) {
    if (IsThreadStartFailure(x.what())) {
      return ResourceExhaustedError(Prefixed(
          what, fmt::format("could not start a thread ({}){}", x.what(), ProcessLimitsNote(true))));
    }
    return InternalError(Prefixed(what, x.what()));
  } catch (...) {
    return InternalError(Prefixed(what, "an exception that is not a std::exception"));
  }
}

}  // namespace strata
