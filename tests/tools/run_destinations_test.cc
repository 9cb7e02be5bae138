// tools/run_destinations.h on a scratch directory: directories made with their parents, paths
// that cannot be written refused with their flag, the checkpoint's room checked, NVMe paths made
// only when the plan keeps something there. (Paths under a regular file stand for unwritable
// ones: permission bits do not stop root, which CI runs as.)
#include "tools/run_destinations.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

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

}  // namespace
}  // namespace strata::tools
