// Injected faults go through each backend's own resubmit/retry/error logic.
#include "io/fault_injection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>

#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<FaultInjectingBackend> MakeFaulty(BackendKind kind) {
  auto backend = FaultInjectingBackend::Create(SmallOptions(kind));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

class FaultFixture {
 public:
  explicit FaultFixture(BackendKind kind, bool direct = false)
      : backend(MakeFaulty(kind)), fd(OpenFile(dir.File("data"), direct)) {}
  TempDir dir;
  std::unique_ptr<FaultInjectingBackend> backend;
  UniqueFd fd;
};

TEST_P(FaultInjectionTest, KeepsTheInnerBackendsName) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  EXPECT_EQ(f.backend->name(), BackendKindName(GetParam()));
}

TEST_P(FaultInjectionTest, ShortWriteIsResubmittedForTheRemainder) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  // 4 full pieces, so whichever completes second is longer than the injected 1000 bytes.
  const std::vector<std::byte> data = RandomBytes(4 * kBlockBytes, 1);
  f.backend->AddFault(Fault::ShortTransfer(IoOp::kWrite, 1000, /*nth=*/2));
  const Status s = f.backend->Write(f.fd.get(), 0, data, "data file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(f.backend->faults_injected(), 1u);
  EXPECT_EQ(f.backend->completions(IoOp::kWrite), 5u);  // 4 pieces + 1 resubmitted remainder
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(f.backend->Read(f.fd.get(), 0, back, "data file").ok());
  EXPECT_TRUE(back == data);
}

TEST_P(FaultInjectionTest, RepeatedShortReadsAreResubmittedUntilComplete) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  // An unaligned buffer: pieces resume exactly where the short read stopped.
  constexpr size_t kSize = 3 * kBlockBytes;  // 3 pieces
  AlignedBuffer data = RandomAligned(kSize + 4096, 2);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data.span().subspan(1, kSize), "data file").ok());
  f.backend->AddFault(Fault::ShortTransfer(IoOp::kRead, 100, /*nth=*/1, /*times=*/3));
  AlignedBuffer back = ZeroAligned(kSize + 4096);
  const Status s = f.backend->Read(f.fd.get(), 0, back.span().subspan(1, kSize), "data file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameBytes(back.data() + 1, data.data() + 1, kSize));
  EXPECT_EQ(f.backend->faults_injected(), 3u);
  EXPECT_EQ(f.backend->completions(IoOp::kRead), 6u);  // 3 pieces + 3 remainders
}

TEST_P(FaultInjectionTest, ShortTransfersOnAnODirectFileResumeAtAlignedOffsets) {
  FaultFixture f(GetParam(), /*direct=*/true);
  ASSERT_NE(f.backend, nullptr);
  ASSERT_TRUE(f.fd.valid());
  // 5000 bytes done: an unaligned remainder would be EINVAL on O_DIRECT; resuming at 4096 is not.
  f.backend->AddFault(Fault::ShortTransfer(std::nullopt, 5000, /*nth=*/1, /*times=*/4));
  AlignedBuffer data = RandomAligned(4 * kBlockBytes, 3);
  Status s = f.backend->Write(f.fd.get(), 8192, data.span(), "direct file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  AlignedBuffer back = ZeroAligned(4 * kBlockBytes);
  s = f.backend->Read(f.fd.get(), 8192, back.span(), "direct file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameBytes(back.data(), data.data(), data.size_bytes()));
  // A piece cut short three times has a 4096-byte remainder, which is not cut again.
  EXPECT_GE(f.backend->faults_injected(), 3u);
}

TEST_P(FaultInjectionTest, EagainIsRetriedTransparently) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  f.backend->AddFault(Fault::Errno(IoOp::kWrite, EAGAIN, /*nth=*/1, /*times=*/3));
  f.backend->AddFault(Fault::Errno(IoOp::kRead, EAGAIN, /*nth=*/2, /*times=*/2));
  const std::vector<std::byte> data = RandomBytes(3 * kBlockBytes, 4);
  Status s = f.backend->Write(f.fd.get(), 0, data, "data file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<std::byte> back(data.size());
  s = f.backend->Read(f.fd.get(), 0, back, "data file");
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(back == data);
  EXPECT_EQ(f.backend->faults_injected(), 5u);
}

TEST_P(FaultInjectionTest, EagainThatNeverStopsIsUnavailable) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  const std::vector<std::byte> data = RandomBytes(4096, 5);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data, "data file").ok());
  f.backend->AddFault(Fault::Errno(IoOp::kRead, EAGAIN, 1, Fault::kForever));
  std::vector<std::byte> back(data.size());
  const Status s = f.backend->Read(f.fd.get(), 0, back, "data file");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("gave up"));
}

TEST_P(FaultInjectionTest, EioOnReadIsDataLossNamingTheFileOffsetAndErrno) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  const std::vector<std::byte> data = RandomBytes(3 * kBlockBytes, 6);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data, "data file").ok());
  f.backend->AddFault(Fault::Errno(IoOp::kRead, EIO, /*nth=*/2));
  std::vector<std::byte> back(data.size());
  const Status s = f.backend->Read(f.fd.get(), 0, back, "data file");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("data file: read of"));
  EXPECT_THAT(s.message(), HasSubstr("at offset"));
  EXPECT_THAT(s.message(), HasSubstr("errno 5"));
  // Nothing is left in flight: the next call works.
  f.backend->ClearFaults();
  EXPECT_TRUE(f.backend->Read(f.fd.get(), 0, back, "data file").ok());
}

TEST_P(FaultInjectionTest, EnospcOnWriteIsResourceExhausted) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  f.backend->AddFault(Fault::Errno(IoOp::kWrite, ENOSPC, /*nth=*/3));
  const std::vector<std::byte> data = RandomBytes(5 * kBlockBytes, 7);
  const Status s = f.backend->Write(f.fd.get(), 0, data, "data file");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("errno 28"));
}

TEST_P(FaultInjectionTest, EndOfFileOnReadIsDataLoss) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  const std::vector<std::byte> data = RandomBytes(kBlockBytes, 8);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data, "data file").ok());
  f.backend->AddFault(Fault::ShortTransfer(IoOp::kRead, 0));
  std::vector<std::byte> back(data.size());
  const Status s = f.backend->Read(f.fd.get(), 0, back, "data file");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("end of file"));
}

TEST_P(FaultInjectionTest, LatencyDelaysCompletions) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  const std::vector<std::byte> data = RandomBytes(4096, 9);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data, "data file").ok());
  f.backend->AddFault(Fault::Latency(IoOp::kRead, std::chrono::milliseconds(40)));
  std::vector<std::byte> back(data.size());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(f.backend->Read(f.fd.get(), 0, back, "data file").ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(40));
  EXPECT_TRUE(back == data);
}

TEST_P(FaultInjectionTest, FaultsMatchOnlyTheirOperationAndStopWhenCleared) {
  FaultFixture f(GetParam());
  ASSERT_NE(f.backend, nullptr);
  f.backend->AddFault(Fault::Errno(IoOp::kRead, EIO, 1, Fault::kForever));
  const std::vector<std::byte> data = RandomBytes(4096, 10);
  ASSERT_TRUE(f.backend->Write(f.fd.get(), 0, data, "data file").ok());
  std::vector<std::byte> back(data.size());
  EXPECT_EQ(f.backend->Read(f.fd.get(), 0, back, "data file").code(), StatusCode::kDataLoss);
  f.backend->ClearFaults();
  EXPECT_TRUE(f.backend->Read(f.fd.get(), 0, back, "data file").ok());
  EXPECT_TRUE(back == data);
}

}  // namespace
}  // namespace strata::io::testing
