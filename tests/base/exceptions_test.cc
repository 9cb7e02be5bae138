// base/exceptions: each kind of exception becomes the Status its header names, and the note of
// the process's limits reads back the limit set (in a child process, so that this one keeps an
// unlimited address space).
#include "base/exceptions.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>

namespace strata {
namespace {

Status Thrown(auto&& throw_it, std::string_view what = "optimizer") {
  return CallCatchingExceptions(what, [&]() -> Status {
    throw_it();
    return Status::Ok();
  });
}

TEST(CallCatchingExceptions, ReturnsTheStatusOfWorkThatDoesNotThrow) {
  EXPECT_TRUE(CallCatchingExceptions("x", [] { return Status::Ok(); }).ok());
  const Status s = CallCatchingExceptions("x", [] { return DataLossError("block 3"); });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "block 3");
}

TEST(CallCatchingExceptions, AFailedAllocationIsOutOfHostMemory) {
  const Status s = Thrown([] { throw std::bad_alloc(); });
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message().rfind("optimizer: out of host memory (an allocation failed)", 0), 0u)
      << s.message();
}

TEST(CallCatchingExceptions, AThreadThatCannotStartIsNamedAsSuch) {
  const Status from_std = Thrown([] {
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
  });
  EXPECT_EQ(from_std.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(from_std.message().rfind("optimizer: could not start a thread: ", 0), 0u)
      << from_std.message();
  // oneTBB's words for the same failure.
  const Status from_tbb = Thrown(
      [] {
        throw std::runtime_error("pthread_create has failed: Resource temporarily unavailable");
      },
      "");
  EXPECT_EQ(from_tbb.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(from_tbb.message().rfind("could not start a thread (pthread_create has failed: "
                                     "Resource temporarily unavailable)",
                                     0),
            0u)
      << from_tbb.message();
}

TEST(CallCatchingExceptions, OtherExceptionsAreInternalErrorsWithTheirText) {
  const Status s = Thrown([] { throw std::out_of_range("map::at"); });
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "optimizer: map::at");
  const Status odd = Thrown([] { throw 42; }, "");
  EXPECT_EQ(odd.code(), StatusCode::kInternal);
  EXPECT_EQ(odd.message(), "an exception that is not a std::exception");
}

// Runs `fn` in a child whose address space is limited to `limit_bytes`; returns what it wrote.
std::string InChildWithAddressSpaceLimit(uint64_t limit_bytes, std::string (*fn)()) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const struct rlimit limit = {limit_bytes, limit_bytes};
    const std::string out = ::setrlimit(RLIMIT_AS, &limit) == 0 ? fn() : "setrlimit failed";
    const ssize_t n = ::write(fds[1], out.data(), out.size());
    ::_exit(n == static_cast<ssize_t>(out.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string out;
  std::array<char, 512> buf;
  for (ssize_t n; (n = ::read(fds[0], buf.data(), buf.size())) > 0;) out.append(buf.data(), n);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return out;
}

TEST(ProcessLimitsNote, NamesTheAddressSpaceLimitWhenOneIsSet) {
  if (AddressSpaceLimitBytes() != 0) GTEST_SKIP() << "this process already has ulimit -v";
  EXPECT_EQ(ProcessLimitsNote(/*threads=*/false), "");
  const std::string note = InChildWithAddressSpaceLimit(uint64_t{8} << 30, [] {
    return std::to_string(AddressSpaceLimitBytes()) + "|" + ProcessLimitsNote(false);
  });
  EXPECT_EQ(note, std::to_string(uint64_t{8} << 30) +
                      "|; the process's address space is limited to 8.00 GiB (ulimit -v)");
}

}  // namespace
}  // namespace strata
