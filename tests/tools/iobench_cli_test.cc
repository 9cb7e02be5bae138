// Runs the real `strata` binary: what `strata iobench` measures when it writes (overwrites of a
// laid-out file, or with --first-write writes into freshly fallocated blocks) and what it leaves
// behind. The "posix" backend keeps these independent of io_uring being allowed here.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "run_strata.h"

namespace {

using strata::cli_test::Result;
using strata::cli_test::RunStrata;

constexpr uint64_t kMiB = uint64_t{1} << 20;

class IobenchCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("strata_iob_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string BenchFile() const { return (dir_ / "strata-iobench.0").string(); }
  // `strata iobench --json` on dir_ with 1 MiB blocks at queue depth 4 and `args`.
  Result Iobench(const std::string& args) const {
    return RunStrata("iobench --path " + dir_.string() +
                     " --block-size 1MiB --queue-depth 4 --backend posix --json " + args);
  }
  std::filesystem::path dir_;
};

nlohmann::json LastJsonLine(const std::string& out) {
  const size_t end = out.find_last_not_of('\n');
  const size_t begin = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(begin == std::string::npos ? 0 : begin + 1));
}

TEST_F(IobenchCliTest, WriteToANewFileLaysItOutFirstThenMeasuresOneOverwritePass) {
  const Result r = Iobench("--rw write --size 8MiB");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("laying out"), std::string::npos) << r.err;
  const nlohmann::json j = LastJsonLine(r.out);
  EXPECT_FALSE(j.at("first_write").get<bool>());
  // Only the measured pass is counted: 8 blocks of 1 MiB, not the layout's 8 more.
  EXPECT_EQ(j.at("bytes").get<uint64_t>(), 8 * kMiB);
  EXPECT_EQ(j.at("submissions").get<uint64_t>(), 8u);
  // A --loops pass is one backend call: the queue drains once per pass.
  EXPECT_EQ(j.at("bytes_per_call").get<uint64_t>(), 8 * kMiB);
  // The file iobench made is removed.
  EXPECT_FALSE(std::filesystem::exists(BenchFile()));
}

// SIGTERM (or SIGINT) ends the run: exit code 143, and the file iobench made is removed (before,
// the 64 MiB file stayed behind).
TEST_F(IobenchCliTest, ASignalEndsTheRunAndRemovesItsFile) {
  const std::string out = (dir_ / "out.txt").string();
  const std::string command = std::string(STRATA_BINARY) + " iobench --path " + dir_.string() +
                              " --block-size 1MiB --queue-depth 4 --backend posix --rw read " +
                              "--size 64MiB --runtime 60 >" + out + " 2>&1";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Wait until it measures (the file laid out and the progress line printed), then stop it.
  bool measuring = false;
  for (int i = 0; i < 300 && !measuring; ++i) {
    ::usleep(100 * 1000);
    std::ifstream f(out);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    measuring = text.find("iobench: read") != std::string::npos;
  }
  EXPECT_TRUE(measuring) << "no progress line within 30 s";
  EXPECT_TRUE(std::filesystem::exists(BenchFile()));
  ::kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 143);
  EXPECT_FALSE(std::filesystem::exists(BenchFile()));
}

// The sweep's config block carries the fastest run's settings in training's terms: for a posix
// winner io_threads is the worker threads it ran with (queue depth x threads, at most 256: what
// strata train's posix backend then keeps in flight), not its submitting threads.
TEST_F(IobenchCliTest, TheSweepsBlockGivesTrainingTheWinnersConcurrency) {
  const Result r =
      RunStrata("iobench --path " + dir_.string() + " --size 16MiB --rw read --sweep --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json best;
  std::string block;
  size_t at = 0;
  while (at < r.out.size()) {
    const size_t end = r.out.find('\n', at);
    const std::string line = r.out.substr(at, end == std::string::npos ? end : end - at);
    if (line.rfind("{\"", 0) == 0) {  // a result, one line each; the block is indented
      const nlohmann::json j = nlohmann::json::parse(line);
      if (best.is_null() || j.at("gb_per_s").get<double>() > best.at("gb_per_s").get<double>()) {
        best = j;
      }
    } else {
      block += line + "\n";
    }
    if (end == std::string::npos) break;
    at = end + 1;
  }
  ASSERT_FALSE(best.is_null()) << r.out;
  const nlohmann::json strata = nlohmann::json::parse(block).at("strata");
  EXPECT_EQ(strata.at("io_backend"), best.at("backend"));
  EXPECT_EQ(strata.at("io_block_size"), best.at("block_size_bytes"));
  EXPECT_EQ(strata.at("io_queue_depth"), best.at("queue_depth"));
  const int qd = best.at("queue_depth").get<int>(), threads = best.at("threads").get<int>();
  EXPECT_EQ(strata.at("io_threads").get<int>(),
            best.at("backend") == "posix" ? std::min(qd * threads, 256) : threads)
      << block;
}

TEST_F(IobenchCliTest, WriteToALaidOutFileDoesNotLayItOutAgainAndKeepsIt) {
  {
    std::ofstream f(BenchFile(), std::ios::binary);
    const std::string mib(kMiB, 'x');
    for (int i = 0; i < 8; ++i) f << mib;
  }
  const Result r = Iobench("--rw write --size 8MiB --loops 2");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("laying out"), std::string::npos) << r.err;
  EXPECT_EQ(LastJsonLine(r.out).at("bytes").get<uint64_t>(), 16 * kMiB);
  ASSERT_TRUE(std::filesystem::exists(BenchFile()));
  EXPECT_EQ(std::filesystem::file_size(BenchFile()), 8 * kMiB);
}

TEST_F(IobenchCliTest, FirstWriteWritesFreshlyAllocatedBlocksOfAnExistingFileEveryPass) {
  // A laid-out file of 'x' bytes: --first-write gives its blocks back and allocates them again
  // before each pass, so no 'x' survives and the file keeps its size and its blocks.
  {
    std::ofstream f(BenchFile(), std::ios::binary);
    const std::string mib(kMiB, 'x');
    for (int i = 0; i < 8; ++i) f << mib;
  }
  const Result r = Iobench("--rw write --size 8MiB --loops 3 --first-write");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("laying out"), std::string::npos) << r.err;
  const nlohmann::json j = LastJsonLine(r.out);
  EXPECT_TRUE(j.at("first_write").get<bool>());
  EXPECT_EQ(j.at("bytes").get<uint64_t>(), 24 * kMiB);
  EXPECT_EQ(j.at("submissions").get<uint64_t>(), 24u);

  ASSERT_TRUE(std::filesystem::exists(BenchFile()));
  EXPECT_EQ(std::filesystem::file_size(BenchFile()), 8 * kMiB);
  struct stat st {};
  ASSERT_EQ(::stat(BenchFile().c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8 * kMiB);
  std::ifstream in(BenchFile(), std::ios::binary);
  std::vector<char> bytes(8 * kMiB);
  ASSERT_TRUE(in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())));
  for (size_t i = 0; i < bytes.size(); i += 4096) {
    ASSERT_NE(bytes[i], 'x') << "byte " << i << " was never rewritten";
  }
}

// A sweep whose --size is too small for its largest configuration (4 MiB blocks x 2 threads) is
// refused before any configuration runs (before, after 26 of them); a negative --runtime is
// refused (before, it ran one pass); the flags a sweep does not use are said to be unused.
TEST_F(IobenchCliTest, BadSweepsAndRuntimesAreRefusedBeforeAnythingRuns) {
  Result r = RunStrata("iobench --path " + dir_.string() + " --size 4MiB --rw read --sweep");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--sweep: --size 4.0 MiB is too small"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("iobench: sweep 1/"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  r = Iobench("--rw read --size 8MiB --runtime -1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--runtime -1: use 0"), std::string::npos) << r.err;
  r = RunStrata("iobench --path " + dir_.string() + " --size 16MiB --rw read --sweep --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--threads and --backend are not used"), std::string::npos) << r.err;
}

// A --size past the drive's free space is refused before a byte is written (a run that filled
// the drive first would take the space from everything else on it), and a --config-out that
// cannot be written is refused before the sweep's minutes of measuring.
TEST_F(IobenchCliTest, ASizePastTheFreeSpaceAndAnUnwritableConfigOutAreRefusedFirst) {
  Result r = Iobench("--rw write --size 1000TiB");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--path '" + dir_.string() + "' has "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("free, less than the "), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(BenchFile()));
  r = RunStrata("iobench --path " + dir_.string() + " --size 16MiB --rw read --sweep " +
                "--config-out " + (dir_ / "missing" / "best.json").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--config-out"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("iobench: sweep 1/"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(BenchFile()));
}

TEST_F(IobenchCliTest, FirstWriteWithReadsIsRefusedNamingTheFlag) {
  const Result r = Iobench("--rw read --size 8MiB --first-write");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--first-write measures writes"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(BenchFile()));
}

}  // namespace
