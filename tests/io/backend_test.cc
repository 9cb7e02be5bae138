// The IoBackend contract, for every backend (see io_test_util.h for the instantiations).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "io/io_backend.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<IoBackend> MakeBackend(BackendKind kind) {
  auto backend = CreateIoBackend(SmallOptions(kind));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

TEST_P(BackendTest, ReportsItsName) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), BackendKindName(GetParam()));
}

TEST_P(BackendTest, RoundTripsBelowAtAndAbovePageAndBlockSizes) {
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("data"), /*direct=*/false);
  ASSERT_TRUE(fd.valid());
  const size_t sizes[] = {1,
                          4095,
                          4096,
                          4097,
                          kBlockBytes - 1,
                          kBlockBytes,
                          kBlockBytes + 1,
                          3 * kBlockBytes + 17,
                          11 * kBlockBytes + 5};
  const uint64_t offsets[] = {0, 1, 4096, kBlockBytes + 3};
  uint64_t seed = 1;
  for (size_t size : sizes) {
    for (uint64_t offset : offsets) {
      SCOPED_TRACE(::testing::Message() << "size " << size << " offset " << offset);
      const std::vector<std::byte> data = RandomBytes(size, ++seed);
      ASSERT_TRUE(backend->Write(fd.get(), offset, data, "data file").ok());
      std::vector<std::byte> back(size);
      const Status s = backend->Read(fd.get(), offset, back, "data file");
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(back == data);
    }
  }
}

TEST_P(BackendTest, RoundTripsAlignedRequestsOnAnODirectFile) {
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("direct"), /*direct=*/true);
  ASSERT_TRUE(fd.valid()) << "O_DIRECT open failed: " << std::strerror(errno);
  const size_t sizes[] = {4096, kBlockBytes, kBlockBytes + 4096, 9 * kBlockBytes + 8192};
  for (size_t size : sizes) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{3 * 4096}}) {
      SCOPED_TRACE(::testing::Message() << "size " << size << " offset " << offset);
      AlignedBuffer data = RandomAligned(size, size + offset);
      ASSERT_TRUE(backend->Write(fd.get(), offset, data.span(), "direct file").ok());
      AlignedBuffer back = ZeroAligned(size);
      const Status s = backend->Read(fd.get(), offset, back.span(), "direct file");
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
    }
  }
}

TEST_P(BackendTest, DefaultOptionsMoveMultiMegabyteRequests) {
  TempDir dir;
  IoBackendOptions options;
  options.kind = GetParam();
  auto backend = CreateIoBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  UniqueFd fd = OpenFile(dir.File("big"), /*direct=*/true);
  ASSERT_TRUE(fd.valid());
  const size_t size = (3 << 20) + 3 * 4096;
  AlignedBuffer data = RandomAligned(size, 7);
  ASSERT_TRUE((*backend)->Write(fd.get(), 4096, data.span(), "big file").ok());
  AlignedBuffer back = ZeroAligned(size);
  ASSERT_TRUE((*backend)->Read(fd.get(), 4096, back.span(), "big file").ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
}

TEST_P(BackendTest, ReadPastEndOfFileIsDataLossNamingTheFile) {
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("short"), /*direct=*/false);
  const std::vector<std::byte> data = RandomBytes(5000, 3);
  ASSERT_TRUE(backend->Write(fd.get(), 0, data, "short file").ok());
  std::vector<std::byte> back(3 * kBlockBytes);
  const Status s = backend->Read(fd.get(), 0, back, "short file");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("short file"));
  EXPECT_THAT(s.message(), HasSubstr("end of file"));
}

TEST_P(BackendTest, ReadPastEndOfAnODirectFileIsDataLossAtTheRightOffset) {
  if (!real_files()) GTEST_SKIP() << "the memory backend does not see the truncation";
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("direct"), /*direct=*/true);
  ASSERT_TRUE(fd.valid());
  AlignedBuffer data = RandomAligned(2 * kBlockBytes, 14);
  ASSERT_TRUE(backend->Write(fd.get(), 0, data.span(), "direct file").ok());
  ASSERT_EQ(::ftruncate(fd.get(), kBlockBytes + 5000), 0);  // ends inside the second piece
  AlignedBuffer back = ZeroAligned(2 * kBlockBytes);
  const Status s = backend->Read(fd.get(), 0, back.span(), "direct file");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("direct file"));
  EXPECT_THAT(s.message(),
              HasSubstr("end of file at offset " + std::to_string(kBlockBytes + 5000)));
}

TEST_P(BackendTest, ErrorNamesTheFileTheOffsetAndTheErrno) {
  if (!real_files()) GTEST_SKIP() << "the memory backend makes no system calls on the fd";
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("readonly"), /*direct=*/false, O_RDONLY);
  ASSERT_TRUE(fd.valid());
  const std::vector<std::byte> data = RandomBytes(100, 4);
  const Status s = backend->Write(fd.get(), 12288, data, "read-only file");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();  // EBADF
  EXPECT_THAT(s.message(), HasSubstr("read-only file"));
  EXPECT_THAT(s.message(), HasSubstr("offset 12288"));
  EXPECT_THAT(s.message(), HasSubstr("errno 9"));
}

TEST_P(BackendTest, MisalignedODirectRequestIsAnErrorNotACrash) {
  if (!real_files()) GTEST_SKIP() << "the memory backend makes no system calls on the fd";
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("direct"), /*direct=*/true);
  ASSERT_TRUE(fd.valid());
  AlignedBuffer buf = RandomAligned(2 * 4096, 5);
  const Status s = backend->Write(fd.get(), 1, buf.span().subspan(1, 100), "direct file");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();  // EINVAL
  EXPECT_THAT(s.message(), HasSubstr("direct file"));
}

TEST_P(BackendTest, BatchKeepsSegmentsOnSeveralFilesApart) {
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd a = OpenFile(dir.File("a"), /*direct=*/false);
  UniqueFd b = OpenFile(dir.File("b"), /*direct=*/false);
  const std::vector<std::byte> d0 = RandomBytes(3 * kBlockBytes + 5, 10);
  const std::vector<std::byte> d1 = RandomBytes(4096, 11);
  const std::vector<std::byte> d2 = RandomBytes(1, 12);
  const std::vector<std::byte> d3 = RandomBytes(kBlockBytes, 13);
  const WriteSegment writes[] = {{a.get(), 0, d0, "a"},
                                 {b.get(), 0, d1, "b"},
                                 {a.get(), 4 * kBlockBytes, d2, "a"},
                                 {b.get(), 4096, d3, "b"}};
  ASSERT_TRUE(backend->WriteBatch(writes).ok());
  std::vector<std::byte> r0(d0.size()), r1(d1.size()), r2(d2.size()), r3(d3.size());
  const ReadSegment reads[] = {{b.get(), 4096, r3, "b"},
                               {a.get(), 0, r0, "a"},
                               {a.get(), 4 * kBlockBytes, r2, "a"},
                               {b.get(), 0, r1, "b"}};
  const Status s = backend->ReadBatch(reads);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(r0 == d0);
  EXPECT_TRUE(r1 == d1);
  EXPECT_TRUE(r2 == d2);
  EXPECT_TRUE(r3 == d3);
}

TEST_P(BackendTest, ConcurrentCallersOnOneFdDoNotInterfere) {
  TempDir dir;
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  UniqueFd fd = OpenFile(dir.File("shared"), /*direct=*/true);
  ASSERT_TRUE(fd.valid());
  constexpr int kThreads = 4;
  constexpr uint64_t kRegionBytes = 16 * kBlockBytes;
  std::vector<Status> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t size = 5 * kBlockBytes + 4096 * static_cast<size_t>(t + 1);
      AlignedBuffer back = ZeroAligned(size);
      for (int round = 0; round < 20; ++round) {
        AlignedBuffer data = RandomAligned(size, static_cast<uint64_t>(t * 100 + round));
        Status s = backend->Write(fd.get(), t * kRegionBytes, data.span(), "shared file");
        if (s.ok()) s = backend->Read(fd.get(), t * kRegionBytes, back.span(), "shared file");
        if (s.ok() && !SameBytes(back.data(), data.data(), size)) {
          s = DataLossError("round trip mismatch");
        }
        if (!s.ok()) {
          failures[t] = s;
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(failures[t].ok()) << failures[t].ToString();
}

TEST_P(BackendTest, EmptyTransferSucceedsWithoutTouchingTheFile) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  EXPECT_TRUE(backend->Read(1000, 0, {}, "nothing").ok());
  EXPECT_TRUE(backend->Write(1000, 0, {}, "nothing").ok());
}

TEST_P(BackendTest, NegativeFdIsInvalidArgument) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  std::vector<std::byte> buf(10);
  const Status s = backend->Read(-1, 0, buf, "no file");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("no file"));
}

}  // namespace
}  // namespace strata::io::testing
