// tools/run_destinations.h on a scratch directory: directories made with their parents, paths
// that cannot be written refused with their flag, the checkpoint's room checked, NVMe paths made
// only when the plan keeps something there, a save directory that holds an earlier run refused
// unless the run resumes. (Paths under a regular file stand for unwritable ones: permission bits
// do not stop root, which CI runs as.)
#include "tools/run_destinations.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>

#include "base/units.h"
#include "engine/engine.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

class RunDestinationsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_run_destinations_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "file") << "x";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(RunDestinationsTest, MakeWritableDirectoryCreatesMissingParentsAndLeavesNoProbe) {
  ASSERT_TRUE(MakeWritableDirectory("--save-dir", Path("a/b/c"), S_IRWXU).ok());
  EXPECT_TRUE(fs::is_directory(Path("a/b/c")));
  EXPECT_TRUE(fs::is_empty(Path("a/b/c")));
  EXPECT_EQ(fs::status(Path("a/b/c")).permissions() & fs::perms::all, fs::perms::owner_all);
  // An existing directory is fine, and stays as it is.
  EXPECT_TRUE(MakeWritableDirectory("--save-dir", Path("a/b/c")).ok());
  EXPECT_TRUE(fs::is_empty(Path("a/b/c")));
}

TEST_F(RunDestinationsTest, MakeWritableDirectoryRefusesAFileOrAPathUnderOneNamingTheFlag) {
  const Status file = MakeWritableDirectory("--nvme-path", Path("file"));
  EXPECT_EQ(file.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(file.message().find("--nvme-path '" + Path("file") + "' exists and is not a directory"),
            std::string::npos)
      << file.message();
  const Status under = MakeWritableDirectory("--nvme-path", Path("file/sub/dir"));
  EXPECT_FALSE(under.ok());
  EXPECT_NE(under.message().find("--nvme-path '" + Path("file/sub/dir") +
                                 "': cannot create the directory"),
            std::string::npos)
      << under.message();
}

TEST_F(RunDestinationsTest, CheckWritableFileAcceptsANewOrExistingFileAndRefusesADirectory) {
  fs::create_directories(Path("out"));
  EXPECT_TRUE(CheckWritableFile("--summary-json", Path("out/run.json")).ok());
  EXPECT_FALSE(fs::exists(Path("out/run.json")));  // nothing written at the path itself
  EXPECT_TRUE(fs::is_empty(Path("out")));
  EXPECT_TRUE(CheckWritableFile("--summary-json", Path("file")).ok());
  const Status dir = CheckWritableFile("--trace", Path("out"));
  EXPECT_EQ(dir.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.message().find("--trace '" + Path("out") + "' is a directory"), std::string::npos);
  const Status under = CheckWritableFile("--trace", Path("file/trace.json"));
  EXPECT_FALSE(under.ok());
  EXPECT_NE(under.message().find("--trace '" + Path("file/trace.json") + "'"), std::string::npos)
      << under.message();
}

engine::Plan PlanOf(int64_t params, uint64_t optimizer_state_bytes, uint64_t nvme_bytes) {
  engine::Plan plan;
  plan.model_params = params;
  plan.precision = DType::kBF16;
  plan.optimizer_state_bytes = optimizer_state_bytes;
  plan.nvme_bytes = nvme_bytes;
  return plan;
}

TEST_F(RunDestinationsTest, CheckWritableFileRefusesAMissingDirectoryWithoutCreatingIt) {
  const Status s = CheckWritableFile("--trace", Path("missing/trace.json"));
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("--trace '" + Path("missing/trace.json") + "': the directory '" +
                             Path("missing") + "' does not exist"),
            std::string::npos)
      << s.message();
  EXPECT_FALSE(fs::exists(Path("missing")));
}

TEST_F(RunDestinationsTest, CheckpointBytesAreMasterWeightsStateAndWorkingParams) {
  EXPECT_EQ(CheckpointBytes(PlanOf(1000, 8000, 0)), 1000u * (4 + 2) + 8000u);
  engine::Plan fp32 = PlanOf(1000, 8000, 0);
  fp32.precision = DType::kF32;
  EXPECT_EQ(CheckpointBytes(fp32), 1000u * (4 + 4) + 8000u);
}

TEST_F(RunDestinationsTest, ASaveDirWithoutRoomForOneCheckpointIsRefusedWithBothSizes) {
  TrainFlags flags;
  flags.checkpoint.save_dir = Path("runs/a");
  // 10^15 params: 14 PB, more than any scratch file system holds.
  const Status s =
      PrepareRunDestinations(flags, PlanOf(1'000'000'000'000'000, 8'000'000'000'000'000, 0));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--save-dir '" + Path("runs/a") + "': one checkpoint needs"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("free"), std::string::npos);
  EXPECT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, 0)).ok());
}

TEST_F(RunDestinationsTest, NvmePathsAreMadeOnlyWhenThePlanKeepsSomethingOnNvme) {
  TrainFlags flags;
  flags.nvme_paths = {Path("nvme/r0"), Path("nvme/r1")};
  ASSERT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, /*nvme_bytes=*/0)).ok());
  EXPECT_FALSE(fs::exists(Path("nvme")));
  ASSERT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, /*nvme_bytes=*/4096)).ok());
  EXPECT_TRUE(fs::is_directory(Path("nvme/r0")));
  EXPECT_TRUE(fs::is_directory(Path("nvme/r1")));
  flags.nvme_paths.push_back(Path("file/r2"));
  const Status s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 4096));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--nvme-path '" + Path("file/r2") + "'"), std::string::npos)
      << s.message();
}

TEST_F(RunDestinationsTest, TheFirstBadOutputFileIsNamedByItsFlag) {
  TrainFlags flags;
  flags.summary_json = Path("summary.json");
  flags.trace = Path("file/trace.json");
  const Status s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--trace '" + Path("file/trace.json") + "'"), std::string::npos)
      << s.message();
  flags.trace = Path("trace.json");
  EXPECT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, 0)).ok());
}

// A save directory as a run leaves it: `latest` when given, a step-N directory per step.
void MakeRun(const std::string& dir, std::initializer_list<int> steps, const char* latest) {
  fs::create_directories(dir);
  for (int step : steps) {
    fs::create_directories(dir + "/step-" + std::to_string(step));
    std::ofstream(dir + "/step-" + std::to_string(step) + "/manifest.json") << "{}";
  }
  if (latest != nullptr) std::ofstream(dir + "/latest") << latest;
}

TEST_F(RunDestinationsTest, ASaveDirHoldingARunIsRefusedNamingItsLatestUnlessTheRunResumes) {
  TrainFlags flags;
  flags.checkpoint.save_dir = Path("runs/a");
  MakeRun(flags.checkpoint.save_dir, {100, 1000, 200}, "step-1000\n");
  const Status s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), std::string("--save-dir '") + Path("runs/a") +
                             "' already holds a run (latest: step-1000): resume it with --resume "
                             "latest, or give another --save-dir");
  // Refused before anything is written: the directory is as it was.
  EXPECT_EQ(std::distance(fs::directory_iterator(Path("runs/a")), fs::directory_iterator()), 4);
  flags.checkpoint.resume = "latest";
  EXPECT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, 0)).ok());
  flags.checkpoint.resume = Path("runs/a/step-100");
  EXPECT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, 0)).ok());
}

TEST_F(RunDestinationsTest, StepDirectoriesWithoutAReadableLatestAreARunResumedFromTheNewest) {
  TrainFlags flags;
  flags.checkpoint.save_dir = Path("runs/b");
  MakeRun(flags.checkpoint.save_dir, {3, 12, 7}, nullptr);
  Status s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), std::string("--save-dir '") + Path("runs/b") +
                             "' already holds a run (step-12 and 2 older, no readable 'latest'): "
                             "resume it with --resume " +
                             Path("runs/b/step-12") + ", or give another --save-dir");
  // A `latest` that names no checkpoint is not read as one.
  std::ofstream(Path("runs/b/latest")) << "../elsewhere\n";
  s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_NE(s.message().find("(step-12 and 2 older, no readable 'latest')"), std::string::npos)
      << s.message();
  // A `latest` naming a checkpoint that is gone points the resume at the newest one there.
  std::ofstream(Path("runs/b/latest")) << "step-20\n";
  s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_EQ(s.message(), std::string("--save-dir '") + Path("runs/b") +
                             "' already holds a run (step-12 and 2 older, a 'latest' naming "
                             "step-20, which is not there): resume it with --resume " +
                             Path("runs/b/step-12") + ", or give another --save-dir");
  // A `latest` alone (its checkpoints removed by hand) is still another run's, and is not
  // named as one to resume.
  fs::remove_all(Path("runs/b"));
  MakeRun(Path("runs/b"), {}, "step-5\n");
  s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), std::string("--save-dir '") + Path("runs/b") +
                             "' already holds a run (a 'latest' naming step-5, which is not "
                             "there): remove it, or give another --save-dir");
  std::ofstream(Path("runs/b/latest")) << "junk";
  s = PrepareRunDestinations(flags, PlanOf(1000, 8000, 0));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("already holds a run (a 'latest' that names no checkpoint): remove "
                             "it, or give another --save-dir"),
            std::string::npos)
      << s.message();
}

TEST_F(RunDestinationsTest, LeftoversOfKilledSavesAndOtherFilesAreNotARun) {
  TrainFlags flags;
  flags.checkpoint.save_dir = Path("runs/c");
  MakeRun(flags.checkpoint.save_dir, {}, nullptr);
  for (const char* leftover : {".tmp-step-4-abc123", ".old-step-2-def456"}) {
    fs::create_directories(Path("runs/c/") + leftover);
  }
  std::ofstream(Path("runs/c/reference-logps.json")) << "{}";
  std::ofstream(Path("runs/c/latest.tmp")) << "step-4\n";
  fs::create_directories(Path("runs/c/step-x"));
  fs::create_directories(Path("runs/c/steps-4"));
  EXPECT_TRUE(PrepareRunDestinations(flags, PlanOf(1000, 8000, 0)).ok());
}

// Rank 0 commits every checkpoint of a data-parallel run, and decides alone, so that a job ends
// with its one line; the other ranks end when it aborts the job.
TEST_F(RunDestinationsTest, OnlyRankZeroRefusesASaveDirHoldingARun) {
  TrainFlags flags;
  flags.checkpoint.save_dir = Path("runs/d");
  MakeRun(flags.checkpoint.save_dir, {2}, "step-2\n");
  engine::Plan plan = PlanOf(1000, 8000, 0);
  plan.ranks = 2;
  EXPECT_EQ(PrepareRunDestinations(flags, plan).code(), StatusCode::kAlreadyExists);
  plan.rank = 1;
  EXPECT_TRUE(PrepareRunDestinations(flags, plan).ok());
}

// Each NVMe path against its share of the plan's extents as the swap store stripes them: a plan
// this file system holds passes; one it cannot is refused naming the path, the share and the
// shortfall; two paths on one file system count together.
TEST_F(RunDestinationsTest, NvmePathsAreCheckedForTheirStripesOfThePlansExtents) {
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir_.c_str(), &vfs), 0);
  const uint64_t free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  fs::create_directories(Path("n1"));
  fs::create_directories(Path("n2"));
  engine::Plan plan;
  plan.nvme_extent_bytes = {4096, 8192};
  plan.nvme_bytes = 12288;
  EXPECT_TRUE(CheckNvmePathsHoldThePlan({Path("n1")}, plan).ok());
  EXPECT_TRUE(CheckNvmePathsHoldThePlan({Path("n1"), Path("n2")}, plan).ok());

  // Twice the free space, in 1 MiB stripes over two paths of one file system: refused as one.
  const uint64_t big = (free / (1 << 20) + 1) * 2 * (1 << 20);
  plan.nvme_extent_bytes = {big};
  plan.nvme_bytes = big;
  const Status one = CheckNvmePathsHoldThePlan({Path("n1")}, plan);
  EXPECT_EQ(one.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(one.message().rfind("--nvme-path '" + Path("n1") + "': the plan swaps " +
                                    FormatBytes(big) + " there, but its file system has ",
                                0),
            0u)
      << one.message();
  EXPECT_NE(one.message().find("or add a --nvme-path on another drive"), std::string::npos);
  const Status two = CheckNvmePathsHoldThePlan({Path("n1"), Path("n2")}, plan);
  EXPECT_EQ(two.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(two.message().rfind(
                "--nvme-path '" + Path("n1") + "', '" + Path("n2") + "' (one file system): ", 0),
            0u)
      << two.message();
  EXPECT_EQ(two.message().find("another drive"), std::string::npos) << two.message();
}

}  // namespace
}  // namespace strata::tools
