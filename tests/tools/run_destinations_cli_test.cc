// `strata train` with destinations it cannot write (issue 48): each fails at start, in under a
// second, with one line naming its flag, before step 1; a save directory and an NVMe path under
// missing parents are created (as `mkdir -p`) and the run completes. Paths under a regular file
// stand for unwritable ones (permission bits do not stop root, which CI runs as). A save
// directory that holds an earlier run is refused unless the run resumes, and left as it was.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "run_strata.h"

namespace {

namespace fs = std::filesystem;
using strata::cli_test::Lines;
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
  // Two steps (or `steps`) of the tiny model, a progress line every step, swap files in the
  // scratch directory.
  std::string Tiny(int steps = 2) const {
    return std::string("train --device host --data ") + STRATA_DATA +
           " --model tiny --seq-len 16 --steps " + std::to_string(steps) +
           " --log-every 1 --eval-batches 1 --sample-bytes 0 ";
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

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// What a second run must leave as it was: `latest`, the checkpoint's manifest and master weights
// (bytes), and the checkpoint directory itself (its inode: not exchanged for a new one).
struct SavedRun {
  std::string latest, manifest, master;
  ino_t step_inode = 0;
  bool operator==(const SavedRun&) const = default;
};
SavedRun ReadSavedRun(const fs::path& save, const std::string& step) {
  SavedRun s{ReadFile(save / "latest"), ReadFile(save / step / "manifest.json"),
             ReadFile(save / step / "master.safetensors")};
  struct stat st {};
  if (::stat((save / step).c_str(), &st) == 0) s.step_inode = st.st_ino;
  return s;
}

TEST_F(RunDestinationsCliTest, SaveDirUnderMissingParentsIsCreatedAndGetsTheCheckpoint) {
  const Result r =
      RunStrata(Tiny() + "--nvme-path " + dir_.string() + " --save-dir " + Path("runs/deep/a"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(Path("runs/deep/a/latest")));
  EXPECT_TRUE(fs::is_directory(Path("runs/deep/a/step-2")));
}

// The fault this guards against: a second run into the same --save-dir replaced step-2 and
// `latest` of the first, which could then no longer be resumed.
TEST_F(RunDestinationsCliTest, ASaveDirHoldingARunIsRefusedWithoutResumeAndKeptAsItWas) {
  const std::string save = Path("runs/a");
  const std::string flags = std::string("--nvme-path ") + dir_.string() + " --save-dir " + save;
  Result r = RunStrata(Tiny() + flags);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const SavedRun before = ReadSavedRun(save, "step-2");
  ASSERT_EQ(before.latest, "step-2\n");
  ASSERT_FALSE(before.master.empty());
  // Another seed: a run that did write would write other bytes.
  r = RunStrata(Tiny() + flags + " --seed 9 --save-every 1 --keep-last 1");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(std::string("--save-dir '") + save +
                       "' already holds a run (latest: step-2): resume it "
                       "with --resume latest, or give another --save-dir"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("| loss"), std::string::npos) << "a step ran:\n" << r.out;
  EXPECT_TRUE(ReadSavedRun(save, "step-2") == before);
  EXPECT_FALSE(fs::exists(Path("runs/a/step-1")));
  // Resuming it is what the line says, and it runs.
  r = RunStrata(Tiny(3) + flags + " --resume latest");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(Path("runs/a/latest")), "step-3\n");
}

// Leftovers of saves that were killed (.tmp-step-*, .old-step-*) alone are no run.
TEST_F(RunDestinationsCliTest, LeftoversOfKilledSavesAloneAreNotARun) {
  fs::create_directories(Path("runs/b/.tmp-step-4-Xa1b2c"));
  std::ofstream(Path("runs/b/.tmp-step-4-Xa1b2c/master.safetensors")) << "partial";
  fs::create_directories(Path("runs/b/.old-step-2-Yd3e4f"));
  const Result r =
      RunStrata(Tiny() + "--nvme-path " + dir_.string() + " --save-dir " + Path("runs/b"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(Path("runs/b/latest")), "step-2\n");
  EXPECT_TRUE(fs::is_directory(Path("runs/b/step-2")));
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

// A run refused after the metrics sinks are opened (here by its --summary-json) leaves none of
// them behind: an empty JSONL file and an event file holding only its header stayed, and the
// directories made for them.
TEST_F(RunDestinationsCliTest, ARunRefusedAfterItsMetricsOpenedLeavesNoMetricsFiles) {
  ExpectFailsBeforeStepOne("--metrics-jsonl " + Path("m.jsonl") + " --tensorboard-dir " +
                               Path("tb/run") + " --metrics-csv-dir " + Path("csv/run") +
                               " --summary-json " + Path("missing/run.json"),
                           "--summary-json");
  EXPECT_FALSE(fs::exists(Path("m.jsonl")));
  EXPECT_FALSE(fs::exists(Path("tb")));
  EXPECT_FALSE(fs::exists(Path("csv")));
}

// A CSV file a step would write that cannot be opened (a directory in its place) fails before the
// first step, not at its first value after minutes of setup.
TEST_F(RunDestinationsCliTest, ACsvTagFileThatCannotBeOpenedFailsBeforeStepOne) {
  fs::create_directories(Path("csv/train_grad_norm.csv"));
  ExpectFailsBeforeStepOne("--metrics-csv-dir " + Path("csv"),
                           "--metrics-csv-dir: cannot open '" + Path("csv/train_grad_norm.csv"));
  EXPECT_EQ(std::distance(fs::directory_iterator(Path("csv")), fs::directory_iterator()), 1);
}

// A run that records keeps its files; a tag never recorded (validation, with --eval-every 0)
// leaves no empty CSV file.
TEST_F(RunDestinationsCliTest, ARunKeepsTheCsvFilesOfTheTagsItRecorded) {
  const Result r = RunStrata(Tiny() + "--nvme-path " + dir_.string() + " --eval-every 0 " +
                             "--metrics-csv-dir " + Path("csv"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(ReadFile(Path("csv/train_loss.csv")).substr(0, 16), "step,train/loss\n");
  EXPECT_FALSE(fs::exists(Path("csv/val_loss.csv")));
}

// A plan that needs more host memory than `ulimit -v` lets the process map is refused before the
// engine allocates, with both sizes; out of memory later names the limit too.
TEST_F(RunDestinationsCliTest, APlanLargerThanTheAddressSpaceLimitIsRefusedBeforeAllocating) {
  const Result r = RunStrata(std::string("train --device host --data ") + STRATA_DATA +
                                 " --model gpt2-124m --seq-len 16 --offload-optimizer host "
                                 "--steps 1 --nvme-path " +
                                 dir_.string(),
                             "ulimit -v 1048576; ");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("of host memory ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("more than the 1.00 GiB this process's address space is limited to "
                       "(ulimit -v)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(Lines(r.err), 1) << r.err;
}

}  // namespace
