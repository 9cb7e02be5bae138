// Internal to capi/: the bridge between strata::Status and the C ABI of
// include/strata/strata.h. Every exported function converts its result here, so no
// C++ exception and no Status crosses the ABI.
#pragma once

#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"
#include "strata/strata.h"

namespace strata::capi {

// Records status as the calling thread's strata_last_error() message when it is
// not OK, and returns its code as a strata_status.
strata_status Report(const Status& status);

// The DType of a C dtype; nullopt for a value outside strata_dtype.
std::optional<DType> ToDType(strata_dtype dtype);
// An INVALID_ARGUMENT Status naming the parameter and the bad dtype value.
Status BadDType(const char* what, strata_dtype dtype);
// INVALID_ARGUMENT "CALL: PARAM is NULL with num_elems N" when `data` is NULL and num_elems > 0
// (a NULL buffer of no elements is allowed, as the header says); OK otherwise.
Status CheckBuffer(const char* call, std::string_view param, const void* data, int64_t num_elems);

// Reports the exception being handled (call only inside a catch block):
// std::bad_alloc as RESOURCE_EXHAUSTED "out of memory", anything else as INTERNAL
// naming it. Throws nothing: when even the message cannot be had, the code alone.
strata_status ReportCurrentException() noexcept;

// Runs fn() -> Status and reports it; an exception (from oneTBB or an allocation)
// becomes RESOURCE_EXHAUSTED or INTERNAL instead of unwinding through C frames.
template <typename F>
strata_status Guard(const F& fn) {
  try {
    return Report(fn());
  } catch (...) {
    return ReportCurrentException();
  }
}

}  // namespace strata::capi
