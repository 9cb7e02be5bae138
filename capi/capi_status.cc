// Version, status codes, the thread-local last error and dtypes of the C API.
#include <fmt/format.h>

#include <string>

#include "capi/capi_internal.h"
#include "cpu_optim/adamw.h"
#include "strata/strata.h"

static_assert(STRATA_VERSION_MAJOR == STRATA_PROJECT_VERSION_MAJOR &&
                  STRATA_VERSION_MINOR == STRATA_PROJECT_VERSION_MINOR &&
                  STRATA_VERSION_PATCH == STRATA_PROJECT_VERSION_PATCH,
              "include/strata/strata.h version macros differ from project(Strata VERSION ...)");
static_assert(static_cast<int>(strata::StatusCode::kDataLoss) == STRATA_DATA_LOSS &&
                  static_cast<int>(strata::StatusCode::kInvalidArgument) ==
                      STRATA_INVALID_ARGUMENT &&
                  static_cast<int>(strata::StatusCode::kUnimplemented) == STRATA_UNIMPLEMENTED,
              "strata_status must mirror strata::StatusCode");
static_assert(static_cast<int>(strata::DType::kF32) == STRATA_DTYPE_F32 &&
                  static_cast<int>(strata::DType::kF16) == STRATA_DTYPE_F16 &&
                  static_cast<int>(strata::DType::kBF16) == STRATA_DTYPE_BF16,
              "strata_dtype must mirror strata::DType");

namespace strata::capi {
namespace {

// The message behind strata_last_error(): one per thread, replaced by each failing
// call on that thread.
std::string& LastError() {
  thread_local std::string message;
  return message;
}

}  // namespace

strata_status Report(const Status& status) {
  if (status.ok()) return STRATA_OK;
  try {
    LastError() = status.ToString();
  } catch (...) {
    LastError().clear();  // no memory for the message; the code still tells what happened
  }
  return static_cast<strata_status>(status.code());
}

strata_status ReportCurrentException() noexcept {
  StatusCode code = StatusCode::kInternal;
  try {
    try {
      throw;
    } catch (const std::bad_alloc&) {
      code = StatusCode::kResourceExhausted;
      return Report(ResourceExhaustedError("out of memory"));
    } catch (const std::exception& e) {
      return Report(InternalError(std::string("unexpected exception: ") + e.what()));
    } catch (...) {
      return Report(InternalError("unexpected exception of unknown type"));
    }
  } catch (...) {  // building the message threw (no memory): the code still says what happened
    LastError().clear();
    return static_cast<strata_status>(code);
  }
}

std::optional<DType> ToDType(strata_dtype dtype) {
  switch (dtype) {
    case STRATA_DTYPE_F32:
      return DType::kF32;
    case STRATA_DTYPE_F16:
      return DType::kF16;
    case STRATA_DTYPE_BF16:
      return DType::kBF16;
  }
  return std::nullopt;
}

Status CheckBuffer(const char* call, std::string_view param, const void* data, int64_t num_elems) {
  if (data != nullptr || num_elems <= 0) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("{}: {} is NULL with num_elems {}", call, param, num_elems));
}

Status BadDType(const char* what, strata_dtype dtype) {
  return InvalidArgumentError(
      fmt::format("{}: unknown dtype {} (use STRATA_DTYPE_F32, STRATA_DTYPE_F16 or "
                  "STRATA_DTYPE_BF16)",
                  what, static_cast<int>(dtype)));
}

}  // namespace strata::capi

extern "C" {

const char* strata_version(void) { return STRATA_PROJECT_VERSION_STRING; }

int strata_version_number(void) { return STRATA_VERSION_NUMBER; }

const char* strata_status_name(strata_status status) {
  const int code = static_cast<int>(status);
  if (code < STRATA_OK || code > STRATA_DATA_LOSS) return "UNKNOWN_CODE";
  // StatusCodeName returns views of string literals, so data() is NUL-terminated.
  return strata::StatusCodeName(static_cast<strata::StatusCode>(code)).data();
}

const char* strata_last_error(void) { return strata::capi::LastError().c_str(); }

size_t strata_dtype_size(strata_dtype dtype) {
  const auto d = strata::capi::ToDType(dtype);
  return d ? strata::SizeOf(*d) : 0;
}

const char* strata_kernel_name(void) {
  // A view of the kernel table's static name string.
  return strata::cpu_optim::ActiveKernelName().data();
}

}  // extern "C"
