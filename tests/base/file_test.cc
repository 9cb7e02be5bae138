// base/file.h against a real scratch directory: reading small files and its refusals, the new
// file, the durable rename, temporary directories, moving a directory into place, and the
// atomic file writer (committed, abandoned, refused twice).
#include "base/file.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "strata-file-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(Path(name), std::ios::binary) << text;
  }
  std::string Read(const std::string& name) const {
    std::ifstream in(Path(name), std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // Entries of the scratch directory, to see that nothing temporary is left.
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
};

TEST_F(FileTest, ReadSmallFileReturnsTheWholeFileUpToTheLimit) {
  const std::string text = "0123456789";
  Write("a", text);
  auto got = ReadSmallFile(Path("a"), {.max_bytes = text.size()});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, text);
  Write("empty", "");
  auto empty = ReadSmallFile(Path("empty"), {.max_bytes = 0});
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(*empty, "");
}

TEST_F(FileTest, ReadSmallFileRefusesAFileOverTheLimitNamingItWithTheCallersCode) {
  Write("a", "0123456789");
  auto over = ReadSmallFile(Path("a"), {.max_bytes = 9});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(over.status().message(),
              HasSubstr("'" + Path("a") + "' is 10 bytes, more than the 9 allowed"));
  auto damaged = ReadSmallFile(Path("a"), {.max_bytes = 9, .unusable_code = StatusCode::kDataLoss});
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss);
}

// Runs `read` (which opens the FIFO at `fifo`) and gives its result; when it is still blocked
// after 5 s, opens the FIFO for writing so that the read returns, and fails the test.
template <typename Fn>
auto WithoutBlocking(const std::string& fifo, Fn read) -> decltype(read()) {
  auto result = std::async(std::launch::async, read);
  if (result.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "opening the FIFO '" << fifo << "' blocked";
    UniqueFd writer(::open(fifo.c_str(), O_WRONLY | O_CLOEXEC));
  }
  return result.get();
}

TEST_F(FileTest, ReadSmallFileRefusesAFifoWithoutWaitingForAWriter) {
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  auto got = WithoutBlocking(Path("fifo"),
                             [&] { return ReadSmallFile(Path("fifo"), {.max_bytes = 1 << 20}); });
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("'" + Path("fifo") + "' is a FIFO"));
}

TEST_F(FileTest, OpenRegularFileRefusesAFifoADirectoryAndADeviceNamingThePath) {
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  auto fifo =
      WithoutBlocking(Path("fifo"), [&] { return OpenRegularFile(Path("fifo"), "token file"); });
  ASSERT_FALSE(fifo.ok());
  EXPECT_THAT(fifo.status().message(),
              HasSubstr("token file '" + Path("fifo") + "' is a FIFO, not a regular file"));
  fs::create_directory(Path("d"));
  auto dir = OpenRegularFile(Path("d"), "text file");
  ASSERT_FALSE(dir.ok());
  EXPECT_THAT(dir.status().message(), HasSubstr("is a directory, not a regular file"));
  auto dev = OpenRegularFile("/dev/null", "text file");
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(dev.status().message(), HasSubstr("'/dev/null' is a character device"));
  Write("f", "abc");
  struct stat st;
  auto file = OpenRegularFile(Path("f"), "text file", 0, &st);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(st.st_size, 3);
  EXPECT_EQ(::fcntl(file->get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST_F(FileTest, ReadSmallFileOfAMissingFileIsNotFoundNamingIt) {
  auto missing = ReadSmallFile(Path("missing"), {.max_bytes = 100});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("'" + Path("missing") + "'"));
}

TEST_F(FileTest, ReadSmallFileRefusesADirectory) {
  fs::create_directory(Path("d"));
  auto got = ReadSmallFile(Path("d"), {.max_bytes = 1 << 20});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(),
              HasSubstr("'" + Path("d") + "' is a directory, not a regular file"));
  auto damaged =
      ReadSmallFile(Path("d"), {.max_bytes = 1 << 20, .unusable_code = StatusCode::kDataLoss});
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss);
}

TEST_F(FileTest, ReadSmallFileFollowsASymlinkOnlyWhenAllowed) {
  Write("target", "abc");
  fs::create_symlink(Path("target"), Path("link"));
  auto followed = ReadSmallFile(Path("link"), {.max_bytes = 3});
  ASSERT_TRUE(followed.ok()) << followed.status().ToString();
  EXPECT_EQ(*followed, "abc");
  auto refused = ReadSmallFile(Path("link"), {.max_bytes = 3, .follow_symlinks = false});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);  // ELOOP
  EXPECT_THAT(refused.status().message(), HasSubstr(Path("link")));
}

TEST_F(FileTest, WriteNewFileWritesWithTheModeAndNeverReplaces) {
  ASSERT_TRUE(WriteNewFile(Path("n"), "hello\n", 0600).ok());
  EXPECT_EQ(Read("n"), "hello\n");
  struct stat st;
  ASSERT_EQ(::stat(Path("n").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const Status again = WriteNewFile(Path("n"), "other", 0600);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(again.message(), HasSubstr("creating '" + Path("n") + "'"));
  EXPECT_EQ(Read("n"), "hello\n");
  const Status no_dir = WriteNewFile(Path("nodir/n"), "x", 0600);
  EXPECT_EQ(no_dir.code(), StatusCode::kNotFound);
}

// A command's output file: replaced whole (the old file until the new one is complete, no
// temporary left), through a symlink to its target, and written directly to what is not a
// regular file (here a FIFO with a reader, as /dev/stdout piped would be).
TEST_F(FileTest, WriteOutputFileReplacesAFileWholeAndWritesAFifoDirectly) {
  ASSERT_TRUE(WriteOutputFile(Path("out.json"), "{\"a\": 1}\n", "--summary-json").ok());
  EXPECT_EQ(Read("out.json"), "{\"a\": 1}\n");
  ASSERT_TRUE(WriteOutputFile(Path("out.json"), "{}\n", "--summary-json").ok());
  EXPECT_EQ(Read("out.json"), "{}\n");
  EXPECT_EQ(Entries(), (std::vector<std::string>{"out.json"}));

  fs::create_symlink("out.json", Path("link.json"));
  ASSERT_TRUE(WriteOutputFile(Path("link.json"), "[1]\n", "--summary-json").ok());
  EXPECT_TRUE(fs::is_symlink(Path("link.json")));
  EXPECT_EQ(Read("out.json"), "[1]\n");

  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  auto reader = std::async(std::launch::async, [&] { return Read("fifo"); });
  ASSERT_TRUE(WriteOutputFile(Path("fifo"), "piped\n", "--summary-json").ok());
  EXPECT_EQ(reader.get(), "piped\n");
  EXPECT_EQ(Entries(), (std::vector<std::string>{"fifo", "link.json", "out.json"}));

  const Status missing = WriteOutputFile(Path("nodir/out.json"), "{}", "--config-out");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  const std::string prefix = "--config-out: creating '";
  EXPECT_THAT(missing.message(), HasSubstr(prefix + Path("nodir/out.json")));
}

// The streamed form: a regular file keeps its old bytes until Commit (and keeps them when the
// writer is dropped uncommitted); a FIFO receives each Append as it comes.
TEST_F(FileTest, OutputFileWriterStreamsWholeIntoAFileAndDirectlyIntoAFifo) {
  ASSERT_TRUE(WriteOutputFile(Path("tokens.bin"), "old", "token file").ok());
  {
    auto w = OutputFileWriter::Create(Path("tokens.bin"), "token file");
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_TRUE(w->atomic());
    ASSERT_TRUE(w->Append(std::as_bytes(std::span("new part", 8))).ok());
    EXPECT_EQ(Read("tokens.bin"), "old");
  }  // dropped: the old file stays, no temporary left
  EXPECT_EQ(Read("tokens.bin"), "old");
  EXPECT_EQ(Entries(), (std::vector<std::string>{"tokens.bin"}));
  auto w = OutputFileWriter::Create(Path("tokens.bin"), "token file");
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span("ab", 2))).ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span("cd", 2))).ok());
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(Read("tokens.bin"), "abcd");
  EXPECT_EQ(w->Commit().code(), StatusCode::kFailedPrecondition);

  ASSERT_EQ(::mkfifo(Path("pipe").c_str(), 0600), 0);
  auto reader = std::async(std::launch::async, [&] { return Read("pipe"); });
  auto f = OutputFileWriter::Create(Path("pipe"), "token file");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_FALSE(f->atomic());
  ASSERT_TRUE(f->Append(std::as_bytes(std::span("12", 2))).ok());
  ASSERT_TRUE(f->Append(std::as_bytes(std::span("34", 2))).ok());
  ASSERT_TRUE(f->Commit().ok());
  EXPECT_EQ(reader.get(), "1234");
}

TEST_F(FileTest, WriteAllWritesEveryByteAndNamesThePathOnError) {
  std::string big(3 << 20, 'x');  // several pipe-buffer-sized writes into a file
  for (size_t i = 0; i < big.size(); i += 4093) big[i] = static_cast<char>('a' + i % 26);
  UniqueFd fd(::open(Path("w").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  ASSERT_TRUE(WriteAll(fd.get(), std::as_bytes(std::span(big)), Path("w")).ok());
  EXPECT_TRUE(FsyncFile(fd.get(), Path("w")).ok());
  fd.reset();
  EXPECT_EQ(Read("w"), big);
  UniqueFd ro(::open(Path("w").c_str(), O_RDONLY | O_CLOEXEC));
  const Status bad = WriteAll(ro.get(), std::as_bytes(std::span(big)), Path("w"));
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);  // EBADF
  EXPECT_THAT(bad.message(), HasSubstr("writing '" + Path("w") + "'"));
}

TEST_F(FileTest, FsyncDirectoryOfAMissingDirectoryIsNotFound) {
  EXPECT_TRUE(FsyncDirectory(dir_).ok());
  const Status missing = FsyncDirectory(Path("missing"));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr(Path("missing")));
}

TEST_F(FileTest, RenameDurablyReplacesTheTargetAndNamesBothOnError) {
  Write("from", "new");
  Write("to", "old");
  ASSERT_TRUE(RenameDurably(Path("from"), Path("to")).ok());
  EXPECT_EQ(Read("to"), "new");
  EXPECT_EQ(Entries(), std::vector<std::string>{"to"});
  const Status missing = RenameDurably(Path("from"), Path("to"));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("renaming '" + Path("from") + "' to '" + Path("to")));
}

TEST_F(FileTest, MakeTempDirectoryMakesAPrivateDirectory) {
  auto made = MakeTempDirectory(Path("t-XXXXXX"));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_NE(*made, Path("t-XXXXXX"));
  struct stat st;
  ASSERT_EQ(::stat(made->c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto bad = MakeTempDirectory(Path("no-template"));  // mkdtemp needs the XXXXXX suffix
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto missing = MakeTempDirectory(Path("nodir/t-XXXXXX"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST_F(FileTest, MoveIntoPlaceMovesAnExistingTargetAsideForTheCallerToRemove) {
  fs::create_directory(Path("new"));
  Write("new/f", "2");
  std::string displaced;
  ASSERT_TRUE(MoveIntoPlace(Path("new"), Path("target"), &displaced).ok());
  EXPECT_EQ(displaced, "");
  EXPECT_EQ(Read("target/f"), "2");

  fs::create_directory(Path("newer"));
  Write("newer/f", "3");
  ASSERT_TRUE(MoveIntoPlace(Path("newer"), Path("target"), &displaced).ok());
  EXPECT_EQ(Read("target/f"), "3");
  // Exchanged: the old directory is under the temporary's name.
  ASSERT_EQ(displaced, Path("newer"));
  EXPECT_EQ(Read("newer/f"), "2");
  RemoveTree(displaced);
  EXPECT_EQ(Entries(), std::vector<std::string>{"target"});

  const Status missing = MoveIntoPlace(Path("gone"), Path("other"), &displaced);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
}

// A replacement that fails leaves the old target in place (a crash could not leave it missing
// either: the exchange is one step), so `latest` never names a directory that is not there.
TEST_F(FileTest, MoveIntoPlaceThatFailsLeavesTheOldTargetInPlace) {
  fs::create_directory(Path("target"));
  Write("target/f", "1");
  std::string displaced = "stale";
  const Status gone = MoveIntoPlace(Path("gone"), Path("target"), &displaced);
  EXPECT_EQ(gone.code(), StatusCode::kNotFound) << gone.ToString();
  EXPECT_THAT(gone.message(), HasSubstr(Path("gone")));
  EXPECT_EQ(displaced, "");
  EXPECT_EQ(Read("target/f"), "1");
  EXPECT_EQ(Entries(), std::vector<std::string>{"target"});
}

TEST_F(FileTest, AtomicFileWriterShowsTheOldFileUntilCommit) {
  Write("f", "old");
  auto w = AtomicFileWriter::Create(Path("f"), 0644);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::string part1 = "new ", part2 = "content";
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(part1))).ok());
  ASSERT_TRUE(w->Append(std::as_bytes(std::span(part2))).ok());
  EXPECT_EQ(Read("f"), "old");
  EXPECT_EQ(fs::path(w->temp_path()).parent_path(), fs::path(dir_));  // same file system
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(Read("f"), "new content");
  EXPECT_EQ(Entries(), std::vector<std::string>{"f"});
  struct stat st;
  ASSERT_EQ(::stat(Path("f").c_str(), &st), 0);
  EXPECT_EQ(
      st.st_mode & 0777, 0644u & ~[] {
        const mode_t m = ::umask(0);
        ::umask(m);
        return m;
      }());
  EXPECT_EQ(w->Commit().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(w->Append(std::as_bytes(std::span(part1))).code(), StatusCode::kFailedPrecondition);
}

TEST_F(FileTest, AnAbandonedAtomicFileWriterLeavesTheOldFileAndNoTemporary) {
  Write("f", "old");
  {
    auto w = AtomicFileWriter::Create(Path("f"), 0644);
    ASSERT_TRUE(w.ok());
    const std::string text = "partial";
    ASSERT_TRUE(w->Append(std::as_bytes(std::span(text))).ok());
    AtomicFileWriter moved = std::move(*w);  // the moved-from writer removes nothing
    EXPECT_TRUE(fs::exists(moved.temp_path()));
  }
  EXPECT_EQ(Read("f"), "old");
  EXPECT_EQ(Entries(), std::vector<std::string>{"f"});
  auto missing = AtomicFileWriter::Create(Path("nodir/f"), 0644);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(Path("nodir/f")));
}

// Out of file descriptors (the EMFILE that may have ended a save), RemoveTree still removes an
// empty directory: remove_all needs a descriptor to list it and left it behind. In a child, whose
// descriptor table is filled.
TEST(RemoveTree, RemovesAnEmptyDirectoryWithNoFileDescriptorLeft) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("strata_rmtree_" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  const pid_t pid = ::fork();
  if (pid == 0) {
    while (::dup(0) >= 0) {
    }
    RemoveTree(dir);
    ::_exit(::access(dir.c_str(), F_OK) != 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata
