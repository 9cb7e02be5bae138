// "io_uring refused at setup -> the posix backend is used and the run succeeds", for real: a
// forked child installs a seccomp-BPF filter that makes io_uring_setup fail (as container
// runtimes' default profiles do), then creates a backend with kAuto and round-trips a swap store.
// Also the LatencyHistogram behind IoBackend::stats().
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "io/io_backend.h"
#include "io/swap_store.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

#if defined(__x86_64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
#error "add the AUDIT_ARCH_* of this architecture"
#endif

// Makes io_uring_setup fail with errno_value in this process (and its future threads).
// Returns 0 or the errno of prctl.
int RefuseIoUringSetup(int errno_value) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K,
               SECCOMP_RET_ERRNO | (static_cast<uint32_t>(errno_value) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(std::size(filter)), filter};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return errno;
  if (::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) return errno;
  return 0;
}

// The child's body: returns its exit code, 0 on success, and says why on stderr otherwise.
int ChildRun(int errno_value) {
  if (int err = RefuseIoUringSetup(errno_value); err != 0) {
    std::fprintf(stderr, "child: installing the seccomp filter failed: %s\n", std::strerror(err));
    return 2;
  }
  const Status probe = ProbeUring();
  if (probe.ok() || probe.code() != StatusCode::kUnavailable) {
    std::fprintf(stderr, "child: ProbeUring under the filter: %s\n", probe.ToString().c_str());
    return 3;
  }
  IoBackendOptions forced = SmallOptions(BackendKind::kUring);
  if (auto b = CreateIoBackend(forced); b.ok() || b.status().code() != StatusCode::kUnavailable) {
    std::fprintf(stderr, "child: forced uring was not kUnavailable\n");
    return 4;
  }
  auto backend = CreateIoBackend(SmallOptions(BackendKind::kAuto));
  if (!backend.ok() || (*backend)->name() != "posix") {
    std::fprintf(stderr, "child: kAuto gave %s\n",
                 backend.ok() ? std::string((*backend)->name()).c_str()
                              : backend.status().ToString().c_str());
    return 5;
  }
  TempDir d0, d1;
  SwapStoreOptions options;
  options.dirs = {d0.path(), d1.path()};
  options.stripe_unit_bytes = kStripeBytes;
  auto store = SwapStore::Create(backend->get(), options);
  if (!store.ok()) {
    std::fprintf(stderr, "child: %s\n", store.status().ToString().c_str());
    return 6;
  }
  const uint64_t size = 5 * kStripeBytes + 123;
  AlignedBuffer data = RandomAligned(SwapStore::PaddedSize(size), 42);
  AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
  Status s = (*store)->Allocate("block0.p", size);
  if (s.ok()) s = (*store)->Write("block0.p", data.span());
  if (s.ok()) s = (*store)->Read("block0.p", back.span());
  if (!s.ok()) {
    std::fprintf(stderr, "child: swap store round trip: %s\n", s.ToString().c_str());
    return 7;
  }
  if (!SameBytes(back.data(), data.data(), size)) {
    std::fprintf(stderr, "child: swap store round trip returned different bytes\n");
    return 8;
  }
  return 0;
}

class UringRefusedTest : public ::testing::TestWithParam<int> {};

TEST_P(UringRefusedTest, AutoFallsBackToPosixAndASwapStoreRoundTripSucceeds) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) ::_exit(ChildRun(GetParam()));
  int wstatus = 0;
  pid_t waited;
  do {
    waited = ::waitpid(pid, &wstatus, 0);
  } while (waited < 0 && errno == EINTR);
  ASSERT_EQ(waited, pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << "child died, wait status " << wstatus;
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "see the child's message on stderr";
}

INSTANTIATE_TEST_SUITE_P(Seccomp, UringRefusedTest, ::testing::Values(ENOSYS, EPERM),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == ENOSYS ? "ENOSYS" : "EPERM");
                         });

TEST(LatencyHistogram, BucketsCoverEveryValueWithBoundedRelativeWidth) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 100000; ++i) {
    const int bits = static_cast<int>(rng() % 64);
    const uint64_t v = bits == 0 ? 0 : (rng() >> (64 - bits));
    const int b = LatencyHistogram::BucketOf(v);
    ASSERT_GE(b, 0);
    ASSERT_LT(b, LatencyHistogram::kNumBuckets);
    const uint64_t upper = LatencyHistogram::BucketUpperNs(b);
    ASSERT_GE(upper, v);
    const uint64_t lower = b == 0 ? 0 : LatencyHistogram::BucketUpperNs(b - 1) + 1;
    ASSERT_LE(lower, v);
    // Width at most 1/16 of the lower bound (exact buckets below 16 ns).
    ASSERT_LE(static_cast<double>(upper - lower), static_cast<double>(lower) / 16.0 + 0.5);
  }
  EXPECT_EQ(LatencyHistogram::BucketOf(UINT64_MAX), LatencyHistogram::kNumBuckets - 1);
  EXPECT_EQ(LatencyHistogram::BucketUpperNs(LatencyHistogram::kNumBuckets - 1), UINT64_MAX);
}

TEST(LatencyHistogram, QuantilesAndMeanMatchTheExactValuesWithinTheBucketWidth) {
  LatencyHistogram h;
  EXPECT_EQ(h.QuantileNs(0.99), 0u);
  EXPECT_EQ(h.MeanNs(), 0.0);
  std::mt19937_64 rng(9);
  std::lognormal_distribution<double> dist(11.0, 1.5);  // around 60 us, long tail
  std::vector<uint64_t> values;
  long double sum = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint64_t v = static_cast<uint64_t>(dist(rng));
    values.push_back(v);
    sum += v;
    h.Record(v);
  }
  std::sort(values.begin(), values.end());
  EXPECT_EQ(h.count(), values.size());
  EXPECT_EQ(h.max_ns(), values.back());
  EXPECT_DOUBLE_EQ(h.MeanNs(), static_cast<double>(sum / values.size()));
  for (double q : {0.0, 0.5, 0.9, 0.99, 0.999, 1.0}) {
    const size_t rank = std::max<size_t>(1, static_cast<size_t>(std::ceil(q * values.size())));
    const uint64_t exact = values[rank - 1];
    const uint64_t got = h.QuantileNs(q);
    EXPECT_GE(got, exact) << "q " << q;
    EXPECT_LE(static_cast<double>(got), static_cast<double>(exact) * (1.0 + 1.0 / 16) + 1)
        << "q " << q;
  }
  LatencyHistogram other;
  other.Record(10);
  other.Merge(h);
  EXPECT_EQ(other.count(), h.count() + 1);
  EXPECT_EQ(other.QuantileNs(0.0), 10u);
  h.Reset();
  EXPECT_EQ(h.count(), 0u);
  EXPECT_EQ(h.max_ns(), 0u);
}

}  // namespace
}  // namespace strata::io::testing
