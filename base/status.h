// Status and StatusOr<T>: the error type at every module boundary.
//
// Codes follow abseil's canonical codes and are chosen by what the caller should
// do: fix the input (kInvalidArgument), free space or lower a budget
// (kResourceExhausted), retry or fall back (kUnavailable), treat data as lost
// (kDataLoss), and so on. Our own small type so that the public C++ API does not
// force an Abseil version on a host framework.
//
// Thread-safety: values; safe to copy and move between threads.
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  // A status that came from the operating system's error number `os_error` (ErrnoToStatus).
  Status(StatusCode code, std::string message, int os_error)
      : code_(code), message_(std::move(message)), os_error_(os_error) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The errno a status made by ErrnoToStatus came from, kept by WithContext; 0 for any other.
  // For a caller that acts on one cause among those a code covers (a full drive, ENOSPC or
  // EDQUOT, among kResourceExhausted's ENOMEM, EMFILE and EFBIG).
  int os_error() const { return os_error_; }
  // "DATA_LOSS: extent 'block3.m' checksum mismatch ..." or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message" (the code is kept).
  Status WithContext(std::string_view context) const;

  // Explicitly ignore a Status (e.g. best-effort cleanup).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int os_error_ = 0;
};

Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);
Status CancelledError(std::string message);
Status AbortedError(std::string message);

// Maps an errno value to the canonical code a caller should act on (ENOSPC ->
// kResourceExhausted, ENOENT -> kNotFound, EACCES -> kPermissionDenied, EIO ->
// kDataLoss, EAGAIN -> kUnavailable, ...) with message "context: strerror (errno N)", and
// errno_value as its os_error().
// The one place errno becomes a Status (after leveldb's PosixError).
Status ErrnoToStatus(int errno_value, std::string_view context);

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);

// StatusOr<T>: either a value or a non-OK Status. Accessing the value of an
// error is a broken invariant (STRATA_CHECK), not a recoverable condition.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : v_(status) {  // NOLINT: implicit by design
    if (status.ok()) CheckFailed(__FILE__, __LINE__, "!status.ok()", "StatusOr from OK status");
  }
  StatusOr(Status&& status) : v_(std::move(status)) {  // NOLINT
    if (std::get<0>(v_).ok()) CheckFailed(__FILE__, __LINE__, "!status.ok()", "StatusOr from OK");
  }
  // One line each (clang-format 14 misplaces a requires clause).
  // clang-format off
  StatusOr(const T& value) : v_(value) {}  // NOLINT
  StatusOr(T&& value) : v_(std::move(value)) {}  // NOLINT
  template <typename U>
    requires(std::is_convertible_v<U &&, T> && !std::is_same_v<std::decay_t<U>, T> &&
             !std::is_same_v<std::decay_t<U>, Status>)
  StatusOr(U&& value) : v_(T(std::forward<U>(value))) {}  // NOLINT

  bool ok() const { return v_.index() == 1; }
  Status status() const { return ok() ? Status::Ok() : std::get<0>(v_); }

  T& value() & { Check(); return std::get<1>(v_); }
  const T& value() const& { Check(); return std::get<1>(v_); }
  T&& value() && { Check(); return std::get<1>(std::move(v_)); }
  // clang-format on
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void Check() const {
    if (!ok()) CheckFailed(__FILE__, __LINE__, "ok()", std::get<0>(v_).ToString());
  }
  std::variant<Status, T> v_;
};

}  // namespace strata

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// STRATA_ASSIGN_OR_RETURN(auto x, MakeX());  declares/assigns x or returns the error.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_statusor_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

// Always-on check for broken invariants only, never for anything the outside
// world (I/O results, allocation, user input) can cause.
#define STRATA_CHECK(cond)                                             \
  do {                                                                 \
    if (!(cond)) ::strata::CheckFailed(__FILE__, __LINE__, #cond, ""); \
  } while (0)
#define STRATA_CHECK_MSG(cond, msg)                                       \
  do {                                                                    \
    if (!(cond)) ::strata::CheckFailed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
