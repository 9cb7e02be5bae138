// SwapStore over every backend (see io_test_util.h for the instantiations).
#include "io/swap_store.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "io/fault_injection.h"
#include "tests/io/io_test_util.h"

namespace strata::io::testing {
namespace {

using ::testing::HasSubstr;

// Two parent dirs (stand-ins for two drives) and a store over the first `num_dirs` of them.
class StoreFixture {
 public:
  StoreFixture(IoBackend* backend, int num_dirs, bool verify_checksums = true) {
    SwapStoreOptions options;
    options.dirs.push_back(d0.path());
    if (num_dirs > 1) options.dirs.push_back(d1.path());
    options.stripe_unit_bytes = kStripeBytes;
    options.verify_checksums = verify_checksums;
    auto created = SwapStore::Create(backend, options);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (created.ok()) store = std::move(created).value();
  }
  TempDir d0, d1;
  std::unique_ptr<SwapStore> store;
};

std::unique_ptr<IoBackend> MakeBackend(BackendKind kind) {
  auto backend = CreateIoBackend(SmallOptions(kind));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

std::unique_ptr<FaultInjectingBackend> MakeFaulty(BackendKind kind) {
  auto backend = FaultInjectingBackend::Create(SmallOptions(kind));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

// Allocates `name`, writes random bytes, returns them (padded buffer).
AlignedBuffer AllocateAndWrite(SwapStore& store, const std::string& name, uint64_t size_bytes,
                               uint64_t seed) {
  EXPECT_TRUE(store.Allocate(name, size_bytes).ok());
  AlignedBuffer data = RandomAligned(SwapStore::PaddedSize(size_bytes), seed);
  const Status s = store.Write(name, data.span());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return data;
}

std::byte ReadByteOfFile(const std::string& path, uint64_t offset) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  std::byte b{0};
  EXPECT_EQ(::pread(fd.get(), &b, 1, static_cast<off_t>(offset)), 1);
  return b;
}

TEST_P(SwapStoreTest, RoundTripsBoundarySizesOverOneAndTwoDirs) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  const uint64_t sizes[] = {1,
                            4095,
                            4096,
                            4097,
                            kStripeBytes - 1,
                            kStripeBytes,
                            kStripeBytes + 1,
                            kBlockBytes - 1,
                            kBlockBytes,
                            kBlockBytes + 1,
                            3 * kStripeBytes + 17,
                            250000};
  for (int num_dirs : {1, 2}) {
    StoreFixture f(backend.get(), num_dirs);
    ASSERT_NE(f.store, nullptr);
    EXPECT_EQ(f.store->backend_name(), BackendKindName(GetParam()));
    uint64_t total = 0;
    for (uint64_t size : sizes) {
      SCOPED_TRACE(::testing::Message() << num_dirs << " dirs, size " << size);
      const std::string name = "extent" + std::to_string(size);
      AlignedBuffer data = AllocateAndWrite(*f.store, name, size, size * 31 + num_dirs);
      AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
      const Status s = f.store->Read(name, back.span());
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
      total += size;
    }
    EXPECT_EQ(f.store->bytes_written(), total);
    EXPECT_EQ(f.store->bytes_read(), total);
  }
}

TEST_P(SwapStoreTest, TwoDirsPutAlternateStripeUnitsInBothFiles) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  const std::vector<std::string> files = f.store->file_paths();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].rfind(f.d0.path(), 0), 0u);
  EXPECT_EQ(files[1].rfind(f.d1.path(), 0), 0u);
  AllocateAndWrite(*f.store, "first", 4096, 1);  // the next extent starts further in file 0
  const uint64_t size = 3 * kStripeBytes + 17;
  AlignedBuffer data = AllocateAndWrite(*f.store, "second", size, 2);

  // Units 0, 2 -> file 0 after "first"; units 1, 3 -> file 1 from its start.
  const std::pair<uint64_t, std::pair<size_t, uint64_t>> expected[] = {
      {0, {0, 4096}},
      {kStripeBytes + 5, {1, 5}},
      {2 * kStripeBytes, {0, 4096 + kStripeBytes}},
      {3 * kStripeBytes + 16, {1, kStripeBytes + 16}}};
  for (const auto& [offset, where] : expected) {
    auto located = f.store->Locate("second", offset);
    ASSERT_TRUE(located.ok()) << located.status().ToString();
    EXPECT_EQ(located->first, files[where.first]) << "offset " << offset;
    EXPECT_EQ(located->second, where.second) << "offset " << offset;
    if (real_files()) {  // the data really is there
      EXPECT_EQ(ReadByteOfFile(located->first, located->second), data.data()[offset]);
    }
  }
  if (real_files()) {
    EXPECT_GE(std::filesystem::file_size(files[0]), 4096 + 2 * kStripeBytes);
    EXPECT_GE(std::filesystem::file_size(files[1]), kStripeBytes + 4096);
  }
}

TEST_P(SwapStoreTest, ReadingAnExtentNeverWrittenIsFailedPrecondition) {
  auto backend = MakeBackend(GetParam());
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("block0.p", 5000).ok());
  AlignedBuffer back = ZeroAligned(8192);
  const Status s = f.store->Read("block0.p", back.span());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("block0.p"));
}

TEST_P(SwapStoreTest, AllocatingAnExistingNameIsAlreadyExists) {
  auto backend = MakeBackend(GetParam());
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("block1.v", 100).ok());
  const Status s = f.store->Allocate("block1.v", 100);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("block1.v"));
}

TEST_P(SwapStoreTest, BadArgumentsAreRejected) {
  auto backend = MakeBackend(GetParam());
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  EXPECT_EQ(f.store->Allocate("empty", 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.store->Allocate("", 10).code(), StatusCode::kInvalidArgument);
  AlignedBuffer buf = ZeroAligned(3 * 4096);
  EXPECT_EQ(f.store->Read("missing", buf.span()).code(), StatusCode::kNotFound);
  EXPECT_EQ(f.store->Write("missing", buf.span()).code(), StatusCode::kNotFound);
  ASSERT_TRUE(f.store->Allocate("e", 4097).ok());
  EXPECT_EQ(f.store->Write("e", buf.span().subspan(0, 4097)).code(),
            StatusCode::kInvalidArgument);  // smaller than PaddedSize
  EXPECT_EQ(f.store->Write("e", buf.span().subspan(16, 8192)).code(),
            StatusCode::kInvalidArgument);  // not 4096-aligned
  EXPECT_EQ(f.store->Locate("e", 4097).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(f.store->Locate("missing", 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(SwapStore::PaddedSize(1), 4096u);
  EXPECT_EQ(SwapStore::PaddedSize(4096), 4096u);
  EXPECT_EQ(SwapStore::PaddedSize(4097), 8192u);
}

TEST_P(SwapStoreTest, AllocationBeyondFreeSpaceIsResourceExhaustedNamingTheDir) {
  auto backend = MakeBackend(GetParam());
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  const Status s = f.store->Allocate("huge", uint64_t{1} << 55);  // 32 PiB
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(f.d0.path()));
  EXPECT_THAT(s.message(), HasSubstr("short"));
  EXPECT_THAT(s.message(), HasSubstr("huge"));
  // The failed name is free again and no space was consumed.
  ASSERT_TRUE(f.store->Allocate("huge", 4096).ok());
  auto located = f.store->Locate("huge", 0);
  ASSERT_TRUE(located.ok());
  EXPECT_EQ(located->second, 0u);
}

TEST_P(SwapStoreTest, ShortReadIsResubmittedThenReportedAsDataLossNamingTheExtent) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  AllocateAndWrite(*f.store, "block3.m", 3 * kStripeBytes + 17, 3);
  // Every read completion after the first comes back short, the last at end of file.
  backend->AddFault(Fault::ShortTransfer(IoOp::kRead, 4096, /*nth=*/1, /*times=*/1));
  backend->AddFault(Fault::ShortTransfer(IoOp::kRead, 0, /*nth=*/2, Fault::kForever));
  AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(3 * kStripeBytes + 17));
  const Status s = f.store->Read("block3.m", back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("extent 'block3.m'"));
  EXPECT_EQ(f.store->bytes_read(), 0u);
}

TEST_P(SwapStoreTest, ShortTransfersAreResubmittedAndTheDataSurvives) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  backend->AddFault(Fault::ShortTransfer(std::nullopt, 5000, /*nth=*/1, /*times=*/6));
  const uint64_t size = 5 * kStripeBytes + 123;
  AlignedBuffer data = AllocateAndWrite(*f.store, "block4.p", size, 4);
  AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
  const Status s = f.store->Read("block4.p", back.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
  // A remainder of 4096 bytes is not cut short again, but only follows an injection.
  EXPECT_GE(backend->faults_injected(), 3u);
}

TEST_P(SwapStoreTest, EagainIsRetriedTransparently) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  backend->AddFault(Fault::Errno(std::nullopt, EAGAIN, /*nth=*/1, /*times=*/4));
  const uint64_t size = 4 * kStripeBytes;
  AlignedBuffer data = AllocateAndWrite(*f.store, "block5.m", size, 5);
  AlignedBuffer back = ZeroAligned(size);
  ASSERT_TRUE(f.store->Read("block5.m", back.span()).ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
  EXPECT_EQ(backend->faults_injected(), 4u);
}

TEST_P(SwapStoreTest, EioOnReadIsDataLossNamingTheExtent) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  AllocateAndWrite(*f.store, "block6.v", 3 * kBlockBytes, 6);
  backend->AddFault(Fault::Errno(IoOp::kRead, EIO, /*nth=*/2));
  AlignedBuffer back = ZeroAligned(3 * kBlockBytes);
  const Status s = f.store->Read("block6.v", back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("extent 'block6.v'"));
  EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[0]));
  EXPECT_THAT(s.message(), HasSubstr("errno 5"));
}

TEST_P(SwapStoreTest, EnospcOnWriteIsResourceExhaustedAndLeavesTheExtentUnreadable) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  const uint64_t size = 4 * kStripeBytes + 1;
  ASSERT_TRUE(f.store->Allocate("block7.m", size).ok());
  AlignedBuffer data = RandomAligned(SwapStore::PaddedSize(size), 7);
  backend->AddFault(Fault::Errno(IoOp::kWrite, ENOSPC, /*nth=*/2));
  Status s = f.store->Write("block7.m", data.span());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("extent 'block7.m'"));
  // Names the swap files and how much is missing.
  EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[0]));
  EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[1]));
  EXPECT_THAT(s.message(), HasSubstr(" short)"));
  AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
  s = f.store->Read("block7.m", back.span());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(f.store->bytes_written(), 0u);
  // Writing it again repairs it.
  backend->ClearFaults();
  ASSERT_TRUE(f.store->Write("block7.m", data.span()).ok());
  ASSERT_TRUE(f.store->Read("block7.m", back.span()).ok());
  EXPECT_TRUE(SameBytes(back.data(), data.data(), size));
}

TEST_P(SwapStoreTest, EdquotOnWriteIsOutOfSpaceToo) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("block7.v", 2 * kBlockBytes).ok());
  AlignedBuffer data = RandomAligned(2 * kBlockBytes, 7);
  backend->AddFault(Fault::Errno(IoOp::kWrite, EDQUOT));
  const Status s = f.store->Write("block7.v", data.span());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("out of space writing extent 'block7.v'"));
}

// ErrnoToStatus maps ENOMEM (and EMFILE, EFBIG) to kResourceExhausted too, but that is no full
// disk: the cause is kept, naming the extent and its file.
TEST_P(SwapStoreTest, EnomemOnWriteKeepsItsCauseAndIsNotCalledOutOfSpace) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("block8.m", 3 * kBlockBytes).ok());
  AlignedBuffer data = RandomAligned(3 * kBlockBytes, 8);
  backend->AddFault(Fault::Errno(IoOp::kWrite, ENOMEM, /*nth=*/2));
  Status s = f.store->Write("block8.m", data.span());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("out of space")));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("free space")));
  EXPECT_THAT(s.message(), HasSubstr("extent 'block8.m'"));
  EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[0]));
  EXPECT_THAT(s.message(), HasSubstr("(errno 12)"));
  // The extent is unreadable until written again, as after any failed write.
  AlignedBuffer back = ZeroAligned(3 * kBlockBytes);
  EXPECT_EQ(f.store->Read("block8.m", back.span()).code(), StatusCode::kFailedPrecondition);
}

TEST_P(SwapStoreTest, ReadDuringAWriteOfTheSameExtentIsFailedPrecondition) {
  auto backend = MakeFaulty(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("slow", 4096).ok());
  AlignedBuffer data = RandomAligned(4096, 8);
  backend->AddFault(Fault::Latency(IoOp::kWrite, std::chrono::milliseconds(300)));
  std::atomic<bool> written{false};
  std::thread writer([&] {
    EXPECT_TRUE(f.store->Write("slow", data.span()).ok());
    written = true;
  });
  AlignedBuffer back = ZeroAligned(4096);
  bool saw_busy = false;
  while (!written && !saw_busy) {
    const Status s = f.store->Read("slow", back.span());
    saw_busy = s.code() == StatusCode::kFailedPrecondition &&
               s.message().find("being written") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  writer.join();
  EXPECT_TRUE(saw_busy);
  EXPECT_TRUE(f.store->Read("slow", back.span()).ok());
}

TEST_P(SwapStoreTest, ConcurrentReadsAndWritesOfDifferentExtentsFromFourThreads) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  constexpr int kThreads = 4;
  constexpr int kExtentsPerThread = 3;
  std::vector<Status> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto fail = [&](Status s) { failures[t] = std::move(s); };
      for (int e = 0; e < kExtentsPerThread; ++e) {
        const std::string name = fmt::format("t{}.e{}", t, e);
        Status s = f.store->Allocate(name, 7 * kStripeBytes + 1000 * (t + 1) + e);
        if (!s.ok()) return fail(s);
      }
      for (int round = 0; round < 8; ++round) {
        for (int e = 0; e < kExtentsPerThread; ++e) {
          const std::string name = fmt::format("t{}.e{}", t, e);
          const uint64_t size = 7 * kStripeBytes + 1000 * (t + 1) + e;
          AlignedBuffer data =
              RandomAligned(SwapStore::PaddedSize(size), static_cast<uint64_t>(t * 1000 + round));
          Status s = f.store->Write(name, data.span());
          if (!s.ok()) return fail(s);
          AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
          s = f.store->Read(name, back.span());
          if (!s.ok()) return fail(s);
          if (!SameBytes(back.data(), data.data(), size)) {
            return fail(DataLossError("mismatch in " + name));
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(failures[t].ok()) << failures[t].ToString();
}

TEST_P(SwapStoreTest, FilesAre0600InA0700DirAndRemovedAtDestruction) {
  auto backend = MakeBackend(GetParam());
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  AllocateAndWrite(*f.store, "x", 10000, 9);
  const std::vector<std::string> files = f.store->file_paths();
  const std::vector<std::string> dirs = f.store->private_dirs();
  ASSERT_EQ(files.size(), 2u);
  ASSERT_EQ(dirs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    struct stat st;
    ASSERT_EQ(::stat(files[i].c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0600u) << files[i];
    ASSERT_EQ(::stat(dirs[i].c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0700u) << dirs[i];
    EXPECT_THAT(dirs[i], HasSubstr("/strata-swap-"));
  }
  f.store.reset();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_FALSE(std::filesystem::exists(files[i])) << files[i];
    EXPECT_FALSE(std::filesystem::exists(dirs[i])) << dirs[i];
  }
  EXPECT_TRUE(std::filesystem::is_empty(f.d0.path()));
  EXPECT_TRUE(std::filesystem::is_empty(f.d1.path()));
}

TEST_P(SwapStoreTest, KeepLeavesTheFilesInPlace) {
  auto backend = MakeBackend(GetParam());
  TempDir dir;
  SwapStoreOptions options;
  options.dirs = {dir.path()};
  options.keep = true;
  auto store = SwapStore::Create(backend.get(), options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  AllocateAndWrite(**store, "kept", 4096, 10);
  const std::string file = (*store)->file_paths()[0];
  store->reset();  // destroys the store
  EXPECT_TRUE(std::filesystem::exists(file));
  if (real_files()) {
    EXPECT_EQ(std::filesystem::file_size(file), 4096u);
  }
}

// A run killed before its destructor (SIGKILL, MPI_Abort of its job) left its private directory
// and a full-size swap file; the next store in that parent removes it. A live store's directory
// (flock held), one `keep` left, and one holding other files stay.
TEST_P(SwapStoreTest, ADeadRunsPrivateDirectoryIsRemovedByTheNextStore) {
  auto backend = MakeBackend(GetParam());
  TempDir dir;
  namespace fs = std::filesystem;
  const fs::path parent = dir.path();
  fs::create_directory(parent / "strata-swap-dead01");
  std::ofstream(parent / "strata-swap-dead01" / "swap.0") << std::string(8192, 'x');
  fs::create_directory(parent / "strata-swap-notes1");
  std::ofstream(parent / "strata-swap-notes1" / "notes.txt") << "mine";
  SwapStoreOptions options;
  options.dirs = {dir.path()};
  options.keep = true;
  {
    auto kept = SwapStore::Create(backend.get(), options);
    ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  }
  options.keep = false;
  auto live = SwapStore::Create(backend.get(), options);
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  EXPECT_FALSE(fs::exists(parent / "strata-swap-dead01"));
  const AlignedBuffer data = AllocateAndWrite(**live, "x", 10000, 11);
  auto next = SwapStore::Create(backend.get(), options);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  // The live store's directory and data are untouched by the next store's scan.
  AlignedBuffer back = RandomAligned(data.size_bytes(), 99);
  ASSERT_TRUE((*live)->Read("x", back.span()).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 10000), 0);
  int dirs = 0;
  for (const auto& e : fs::directory_iterator(parent)) {
    EXPECT_EQ(e.path().filename().string().rfind("strata-swap-", 0), 0u) << e.path();
    ++dirs;
  }
  EXPECT_EQ(dirs, 4);  // kept, notes1, live, next
  EXPECT_TRUE(fs::exists(parent / "strata-swap-notes1" / "notes.txt"));
}

// Byte-level corruption of the real swap files.

TEST_P(SwapStoreOnDiskTest, FlippedByteInSwapFileIsReportedAsDataLoss) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 2);
  ASSERT_NE(f.store, nullptr);
  EXPECT_TRUE(f.store->direct_io());  // /tmp is ext4 here; tmpfs would fall back (logged)
  const uint64_t size = 3 * kStripeBytes + 17;
  AllocateAndWrite(*f.store, "block3.m", size, 11);
  auto located = f.store->Locate("block3.m", kStripeBytes + 77);  // lives in the second file
  ASSERT_TRUE(located.ok());
  EXPECT_EQ(located->first, f.store->file_paths()[1]);
  {
    UniqueFd fd(::open(located->first.c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    std::byte b;
    ASSERT_EQ(::pread(fd.get(), &b, 1, static_cast<off_t>(located->second)), 1);
    b ^= std::byte{0x20};
    ASSERT_EQ(::pwrite(fd.get(), &b, 1, static_cast<off_t>(located->second)), 1);
    ASSERT_EQ(::fsync(fd.get()), 0);
  }
  AlignedBuffer back = ZeroAligned(SwapStore::PaddedSize(size));
  const Status s = f.store->Read("block3.m", back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("extent 'block3.m'"));
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
}

TEST_P(SwapStoreOnDiskTest, TruncatedSwapFileIsAShortReadReportedAsDataLoss) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1);
  ASSERT_NE(f.store, nullptr);
  AllocateAndWrite(*f.store, "block8.p", 3 * kBlockBytes, 12);
  ASSERT_EQ(::truncate(f.store->file_paths()[0].c_str(), kBlockBytes), 0);
  AlignedBuffer back = ZeroAligned(3 * kBlockBytes);
  const Status s = f.store->Read("block8.p", back.span());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("extent 'block8.p'"));
  EXPECT_THAT(s.message(), HasSubstr("end of file"));
}

TEST_P(SwapStoreOnDiskTest, WithChecksumsOffAFlippedByteGoesUnnoticed) {
  auto backend = MakeBackend(GetParam());
  ASSERT_NE(backend, nullptr);
  StoreFixture f(backend.get(), 1, /*verify_checksums=*/false);
  ASSERT_NE(f.store, nullptr);
  AlignedBuffer data = AllocateAndWrite(*f.store, "plain", 4096, 13);
  auto located = f.store->Locate("plain", 100);
  ASSERT_TRUE(located.ok());
  {
    UniqueFd fd(::open(located->first.c_str(), O_RDWR | O_CLOEXEC));
    const std::byte b = data.data()[100] ^ std::byte{1};
    ASSERT_EQ(::pwrite(fd.get(), &b, 1, static_cast<off_t>(located->second)), 1);
  }
  AlignedBuffer back = ZeroAligned(4096);
  ASSERT_TRUE(f.store->Read("plain", back.span()).ok());
  EXPECT_EQ(back.data()[100], data.data()[100] ^ std::byte{1});
}

// A backend whose every read or every write fails with `error`, as "uring" does when it cannot
// make a ring or submit: such errors name no piece. The other operation does nothing.
class FailingBackend final : public IoBackend {
 public:
  FailingBackend(IoOp op, Status error) : op_(op), error_(std::move(error)) {}
  std::string_view name() const override { return "failing"; }
  Status Read(int, uint64_t, std::span<std::byte>, std::string_view) override {
    return op_ == IoOp::kRead ? error_ : Status::Ok();
  }
  Status Write(int, uint64_t, std::span<const std::byte>, std::string_view) override {
    return op_ == IoOp::kWrite ? error_ : Status::Ok();
  }

 private:
  IoOp op_;
  Status error_;
};

TEST(SwapStore, BackendErrorsThatNameNoPieceGetTheExtentAndItsFiles) {
  const Status submit = ErrnoToStatus(EAGAIN, "io_uring_submit made no progress");
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    SCOPED_TRACE(IoOpName(op));
    FailingBackend backend(op, submit);
    StoreFixture f(&backend, 2);
    ASSERT_NE(f.store, nullptr);
    ASSERT_TRUE(f.store->Allocate("block9.m", 4 * kStripeBytes).ok());
    AlignedBuffer data = RandomAligned(4 * kStripeBytes, 9);
    Status s = f.store->Write("block9.m", data.span());
    if (op == IoOp::kRead) {
      ASSERT_TRUE(s.ok()) << s.ToString();
      s = f.store->Read("block9.m", data.span());
    }
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("extent 'block9.m'"));
    EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[0]));
    EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[1]));
    EXPECT_THAT(s.message(), HasSubstr(submit.message()));
  }
}

TEST(SwapStore, RingSetupEnomemOnWriteIsNotCalledOutOfSpace) {
  FailingBackend backend(
      IoOp::kWrite,
      ErrnoToStatus(ENOMEM,
                    "io_uring_queue_init(4 entries) (RLIMIT_MEMLOCK too low for the ring on this "
                    "kernel)"));
  StoreFixture f(&backend, 1);
  ASSERT_NE(f.store, nullptr);
  ASSERT_TRUE(f.store->Allocate("block10.v", kStripeBytes).ok());
  AlignedBuffer data = RandomAligned(kStripeBytes, 10);
  const Status s = f.store->Write("block10.v", data.span());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("out of space")));
  EXPECT_THAT(s.message(), HasSubstr("extent 'block10.v'"));
  EXPECT_THAT(s.message(), HasSubstr(f.store->file_paths()[0]));
  EXPECT_THAT(s.message(), HasSubstr("RLIMIT_MEMLOCK"));
}

}  // namespace
}  // namespace strata::io::testing
