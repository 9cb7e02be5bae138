// `strata train` with destinations it cannot write (issue 48): each fails at start, in under a
// second, with one line naming its flag, before step 1; a save directory and an NVMe path under
// missing parents are created (as `mkdir -p`) and the run completes. Paths under a regular file
// stand for unwritable ones (permission bits do not stop root, which CI runs as).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "run_strata.h"

namespace {

namespace fs = std::filesystem;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;

class RunDestinationsCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_destinations_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "file") << "x";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  // Two steps of the tiny model, a progress line every step, swap files in the scratch directory.
  std::string Tiny() const {
    return std::string("train --device host --data ") + STRATA_DATA +
           " --model tiny --seq-len 16 --steps 2 --log-every 1 --eval-batches 1 --sample-bytes 0 ";
  }
  // Runs a train that must fail at start: a non-zero exit, `expected` in the error line, no
  // step started (the progress line of step 1 is absent).
  void ExpectFailsBeforeStepOne(const std::string& flags, const std::string& expected) {
    const Result r = RunStrata(Tiny() + " --nvme-path " + dir_.string() + " " + flags);
    EXPECT_NE(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("| loss"), std::string::npos) << "a step ran:\n" << r.out;
  }
  fs::path dir_;
};

TEST_F(RunDestinationsCliTest, SaveDirUnderMissingParentsIsCreatedAndGetsTheCheckpoint) {
  const Result r =
      RunStrata(Tiny() + "--nvme-path " + dir_.string() + " --save-dir " + Path("runs/deep/a"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(Path("runs/deep/a/latest")));
  EXPECT_TRUE(fs::is_directory(Path("runs/deep/a/step-2")));
}

TEST_F(RunDestinationsCliTest, NvmePathUnderMissingParentsIsCreated) {
  const Result r = RunStrata(Tiny() + "--offload-optimizer nvme --nvme-path " + Path("nv/me/r0"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_directory(Path("nv/me/r0")));
}

TEST_F(RunDestinationsCliTest, SaveDirUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--save-dir " + Path("file/a"), "--save-dir '" + Path("file/a") + "'");
}

TEST_F(RunDestinationsCliTest, SaveDirThatIsAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--save-dir " + Path("file"), "is not a directory");
}

TEST_F(RunDestinationsCliTest, NvmePathUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--offload-optimizer nvme --nvme-path " + Path("file/nvme"),
                           "--nvme-path '" + Path("file/nvme") + "'");
}

TEST_F(RunDestinationsCliTest, SummaryJsonUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--summary-json " + Path("file/run.json"),
                           "--summary-json '" + Path("file/run.json") + "'");
}

TEST_F(RunDestinationsCliTest, SummaryJsonThatIsADirectoryFailsBeforeStepOne) {
  fs::create_directories(Path("out"));
  ExpectFailsBeforeStepOne("--summary-json " + Path("out"), "is a directory");
}

TEST_F(RunDestinationsCliTest, SummaryJsonInAMissingDirectoryFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--summary-json " + Path("missing/run.json"), "does not exist");
  EXPECT_FALSE(fs::exists(Path("missing")));
}

TEST_F(RunDestinationsCliTest, TraceUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--trace " + Path("file/trace.json"),
                           "--trace '" + Path("file/trace.json") + "'");
}

TEST_F(RunDestinationsCliTest, TensorboardDirUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--tensorboard-dir " + Path("file/tb"), "--tensorboard-dir");
}

TEST_F(RunDestinationsCliTest, MetricsJsonlUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--metrics-jsonl " + Path("file/m.jsonl"), "--metrics-jsonl");
}

TEST_F(RunDestinationsCliTest, MetricsCsvDirUnderAFileFailsBeforeStepOne) {
  ExpectFailsBeforeStepOne("--metrics-csv-dir " + Path("file/csv"), "--metrics-csv-dir");
}

}  // namespace
