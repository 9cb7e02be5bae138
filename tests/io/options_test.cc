// Backend names and options, backend selection, and SwapStore::Create's argument and directory
// errors. Needs neither io_uring nor a particular backend.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "io/io_backend.h"
#include "io/swap_store.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

using ::testing::HasSubstr;

TEST(BackendKind, NamesRoundTripThroughParse) {
  for (BackendKind kind :
       {BackendKind::kAuto, BackendKind::kUring, BackendKind::kPosix, BackendKind::kMemory}) {
    auto parsed = ParseBackendKind(BackendKindName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_EQ(BackendKindName(BackendKind::kUring), "uring");
  EXPECT_EQ(BackendKindName(BackendKind::kPosix), "posix");
}

TEST(BackendKind, UnknownNameIsInvalidArgumentListingTheChoices) {
  auto parsed = ParseBackendKind("aio");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("'aio'"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("auto, uring, posix, memory"));
}

TEST(IoBackendOptions, OutOfRangeValuesAreInvalidArgumentNamingTheField) {
  IoBackendOptions options;
  options.kind = BackendKind::kPosix;
  EXPECT_TRUE(CreateIoBackend(options).ok());
  auto expect_invalid = [](IoBackendOptions o, std::string_view field) {
    auto backend = CreateIoBackend(o);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(backend.status().message(), HasSubstr(field));
  };
  IoBackendOptions o = options;
  o.queue_depth = 0;
  expect_invalid(o, "queue depth");
  o = options;
  o.queue_depth = 5000;
  expect_invalid(o, "queue depth");
  o = options;
  o.block_size_bytes = 1000;  // not a multiple of 4096: pieces of O_DIRECT requests would break
  expect_invalid(o, "block size");
  o = options;
  o.block_size_bytes = 0;
  expect_invalid(o, "block size");
  o = options;
  o.block_size_bytes = size_t{2} << 30;
  expect_invalid(o, "block size");
  o = options;
  o.posix_threads = 0;
  expect_invalid(o, "thread");
}

TEST(CreateIoBackend, AutoPicksUringWhenTheProbeSucceedsElsePosix) {
  IoBackendOptions options;  // kAuto
  auto backend = CreateIoBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_EQ((*backend)->name(), ProbeUring().ok() ? "uring" : "posix");
}

TEST(CreateIoBackend, PosixWithOneThreadRunsOnTheCallersThread) {
  IoBackendOptions options = SmallOptions(BackendKind::kPosix);
  options.posix_threads = 1;
  auto backend = CreateIoBackend(options);
  ASSERT_TRUE(backend.ok());
  TempDir dir;
  UniqueFd fd = OpenFile(dir.File("f"), /*direct=*/false);
  const std::vector<std::byte> data = RandomBytes(5 * kBlockBytes + 3, 1);
  ASSERT_TRUE((*backend)->Write(fd.get(), 7, data, "f").ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE((*backend)->Read(fd.get(), 7, back, "f").ok());
  EXPECT_TRUE(back == data);
}

class SwapStoreCreateTest : public ::testing::Test {
 protected:
  std::unique_ptr<IoBackend> backend_ =
      std::move(CreateIoBackend(SmallOptions(BackendKind::kMemory))).value();
};

TEST_F(SwapStoreCreateTest, NullBackendNoDirsOrBadStripeUnitAreInvalidArgument) {
  TempDir dir;
  SwapStoreOptions options;
  options.dirs = {dir.path()};
  EXPECT_EQ(SwapStore::Create(nullptr, options).status().code(), StatusCode::kInvalidArgument);
  SwapStoreOptions no_dirs;
  EXPECT_EQ(SwapStore::Create(backend_.get(), no_dirs).status().code(),
            StatusCode::kInvalidArgument);
  for (uint64_t stripe : {uint64_t{0}, uint64_t{1000}, uint64_t{4096 + 512}}) {
    SwapStoreOptions bad = options;
    bad.stripe_unit_bytes = stripe;
    auto store = SwapStore::Create(backend_.get(), bad);
    EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument) << stripe;
    EXPECT_THAT(store.status().message(), HasSubstr("stripe unit"));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST_F(SwapStoreCreateTest, DirUnderARegularFileIsAnErrorNamingThePath) {
  TempDir dir;
  const std::string file = dir.File("not-a-dir");
  std::ofstream(file) << "x";
  SwapStoreOptions options;
  options.dirs = {file + "/swap"};
  auto store = SwapStore::Create(backend_.get(), options);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument);  // ENOTDIR
  EXPECT_THAT(store.status().message(), HasSubstr(file + "/swap"));
}

TEST_F(SwapStoreCreateTest, DirUnderProcIsAnErrorNamingThePath) {
  SwapStoreOptions options;
  options.dirs = {"/proc/strata-swap-test"};
  auto store = SwapStore::Create(backend_.get(), options);
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(store.status().message(), HasSubstr("/proc/strata-swap-test"));
}

TEST_F(SwapStoreCreateTest, MissingDirIsNotFoundNamingThePath) {
  TempDir dir;
  SwapStoreOptions options;
  options.dirs = {dir.File("missing")};
  auto store = SwapStore::Create(backend_.get(), options);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(store.status().message(), HasSubstr(dir.File("missing")));
}

TEST_F(SwapStoreCreateTest, FailedCreateLeavesNothingBehindEvenWithKeep) {
  TempDir good;
  TempDir other;
  SwapStoreOptions options;
  options.dirs = {good.path(), other.File("missing")};
  options.keep = true;
  auto store = SwapStore::Create(backend_.get(), options);
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(std::filesystem::is_empty(good.path()));
}

}  // namespace
}  // namespace strata::io::testing
