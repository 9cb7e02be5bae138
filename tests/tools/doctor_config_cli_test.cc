// Runs the real `strata` binary: `strata doctor` and `strata train --config`.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "run_strata.h"

namespace {

using strata::cli_test::Lines;
using strata::cli_test::Result;
using strata::cli_test::RunStrata;

uint64_t MemTotalFromProc() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

class DoctorConfigCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("strata_dc_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string WriteConfig(const std::string& name, const std::string& text) const {
    const auto path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }
  nlohmann::json ReadJson(const std::string& name) const {
    std::ifstream in(dir_ / name);
    return nlohmann::json::parse(in);
  }
  std::string TinyRun() const {
    return std::string("train --data ") + STRATA_DATA +
           " --model tiny --seq-len 16 --eval-every 0 --sample-bytes 0 --nvme-path " +
           dir_.string();
  }
  std::filesystem::path dir_;
};

const nlohmann::json* FindCheck(const nlohmann::json& report, const std::string& name) {
  for (const auto& c : report["checks"]) {
    if (c["name"] == name) return &c;
  }
  return nullptr;
}

TEST_F(DoctorConfigCliTest, DoctorJsonHasEveryCheckWithSaneNumbers) {
  const Result r = RunStrata("doctor --json --probe-seconds 0.2 --path " + dir_.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto report = nlohmann::json::parse(r.out);
  EXPECT_EQ(report["ok"], true);
  ASSERT_TRUE(report["checks"].is_array());
  for (const auto& c : report["checks"]) {
    for (const char* key : {"name", "value", "verdict", "advice"}) {
      ASSERT_TRUE(c.contains(key) && c[key].is_string()) << key << " in " << c.dump();
    }
    const std::string v = c["verdict"];
    EXPECT_TRUE(v == "OK" || v == "WARN") << c.dump();
  }
  for (const char* name : {"kernel", "io_uring", "memlock", "cpu", "cpu isa", "cores", "numa",
                           "memory", "gpu", "path", "free space", "o_direct", "probe"}) {
    EXPECT_NE(FindCheck(report, name), nullptr) << name;
  }
  const auto* memory = FindCheck(report, "memory");
  ASSERT_NE(memory, nullptr);
  EXPECT_EQ((*memory)["total_bytes"].get<uint64_t>(), MemTotalFromProc());
  EXPECT_GT((*memory)["available_bytes"].get<uint64_t>(), 0u);
  EXPECT_LE((*memory)["available_bytes"].get<uint64_t>(), (*memory)["total_bytes"].get<uint64_t>());

  const auto* cores = FindCheck(report, "cores");
  ASSERT_NE(cores, nullptr);
  EXPECT_EQ((*cores)["logical"].get<int>(), static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  const auto* isa = FindCheck(report, "cpu isa");
  ASSERT_NE(isa, nullptr);
  const std::string kernel = (*isa)["kernel"];
  EXPECT_TRUE(kernel == "avx512" || kernel == "avx2" || kernel == "generic") << kernel;
  if (kernel == "avx512") {
    EXPECT_TRUE((*isa)["avx512f"].get<bool>());
  }
  if (kernel == "avx2") {
    EXPECT_TRUE((*isa)["avx2"].get<bool>());
  }
  const auto* cpu = FindCheck(report, "cpu");
  ASSERT_NE(cpu, nullptr);
  EXPECT_FALSE((*cpu)["vendor"].get<std::string>().empty());

  const auto* space = FindCheck(report, "free space");
  ASSERT_NE(space, nullptr);
  EXPECT_EQ((*space)["path"], dir_.string());
  EXPECT_GT((*space)["total_bytes"].get<uint64_t>(), 0u);
  EXPECT_LE((*space)["free_bytes"].get<uint64_t>(), (*space)["total_bytes"].get<uint64_t>());
  const auto* probe = FindCheck(report, "probe");
  ASSERT_NE(probe, nullptr);
  EXPECT_GT((*probe)["write_gb_per_s"].get<double>(), 0.0);
  EXPECT_GT((*probe)["first_write_gb_per_s"].get<double>(), 0.0);
  EXPECT_GE((*probe)["file_bytes"].get<uint64_t>(), (*probe)["request_bytes"].get<uint64_t>());
  EXPECT_LE((*probe)["file_bytes"].get<uint64_t>(), 1ull << 30);
  EXPECT_GT((*probe)["read_gb_per_s"].get<double>(), 0.0);
  EXPECT_GT((*probe)["read_bytes"].get<uint64_t>(), 0u);
  const std::string backend = (*probe)["backend"];
  EXPECT_TRUE(backend == "uring" || backend == "posix") << backend;
  // io_uring's verdict agrees with the backend the probe used.
  EXPECT_EQ(FindCheck(report, "io_uring")->at("available").get<bool>(), backend == "uring");
  // The probe file is gone.
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

TEST_F(DoctorConfigCliTest, DoctorTextPrintsOneVerdictPerLine) {
  const Result r = RunStrata("doctor --probe-seconds 0 --path " + dir_.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::getline(lines, line);  // title
  int checks = 0;
  while (std::getline(lines, line)) {
    ++checks;
    EXPECT_TRUE(line.find("  OK  ") != std::string::npos ||
                line.find("  WARN  ") != std::string::npos)
        << line;
  }
  EXPECT_GE(checks, 13);
}

TEST_F(DoctorConfigCliTest, DoctorFailsForAMissingPathAndNamesIt) {
  const std::string missing = (dir_ / "no" / "such").string();
  const Result r = RunStrata("doctor --json --probe-seconds 0 --path " + missing);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(Lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  const auto report = nlohmann::json::parse(r.out);
  EXPECT_EQ(report["ok"], false);
  const auto* path = FindCheck(report, "path");
  ASSERT_NE(path, nullptr);
  EXPECT_EQ((*path)["verdict"], "FAIL");
  EXPECT_EQ((*path)["path"], missing);

  // A regular file is not a directory for swap files either; the good path still passes.
  const std::string file = WriteConfig("plain", "x");
  const Result f =
      RunStrata("doctor --probe-seconds 0 --path " + dir_.string() + " --path " + file);
  EXPECT_EQ(f.exit_code, 1);
  EXPECT_NE(f.out.find("not a directory"), std::string::npos) << f.out;
  EXPECT_NE(f.err.find("path " + file), std::string::npos) << f.err;
  EXPECT_NE(f.err.find("1 check(s) failed"), std::string::npos) << f.err;
}

// A directory mounted read-only on this machine (from /proc/self/mounts), or "" when none is.
std::string ReadOnlyMountPoint() {
  std::ifstream in("/proc/self/mounts");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string device, dir, type, options;
    if (!(fields >> device >> dir >> type >> options)) continue;
    options = "," + options + ",";
    // Octal escapes (a space is \040) are not worth decoding for a test.
    if (options.find(",ro,") == std::string::npos || dir.find('\\') != std::string::npos) {
      continue;
    }
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec)) return dir;
  }
  return "";
}

TEST_F(DoctorConfigCliTest, AReadOnlyPathIsBlamedOnItsMountNotOnItsOwnerOrMode) {
  const std::string read_only = ReadOnlyMountPoint();
  if (read_only.empty()) GTEST_SKIP() << "no read-only mount on this machine";
  const Result r = RunStrata("doctor --json --probe-seconds 0 --path " + read_only);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const auto report = nlohmann::json::parse(r.out);
  const auto* path = FindCheck(report, "path");
  ASSERT_NE(path, nullptr) << r.out;
  EXPECT_EQ((*path)["verdict"], "FAIL");
  EXPECT_EQ((*path)["value"], "on a read-only file system") << r.out;
  EXPECT_EQ((*path)["advice"], "remount it read-write or pick another --path") << r.out;
}

TEST_F(DoctorConfigCliTest, TrainTakesDeepSpeedsAioBlockWithItsThreadsAsParallelism) {
  // DeepSpeed keeps queue_depth requests in flight on each of thread_count threads: 8 x 2.
  const std::string config =
      WriteConfig("sweep.json",
                  R"({"aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 2},
 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                       "offload_param": {"device": "nvme"}},
 "strata": {"io_backend": "posix"}})");
  const Result r = RunStrata(TinyRun() + " --steps 2 --config " + config + " --summary-json " +
                             (dir_ / "s.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto j = ReadJson("s.json");
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["io_backend"], "posix");
  EXPECT_GT(j["nvme_bytes_written"].get<uint64_t>(), 0u);
  // The aio block reached the engine's I/O options.
  EXPECT_NE(r.out.find("posix backend (block 256.0 KiB, queue depth 16, 2 threads)"),
            std::string::npos)
      << r.out;
}

TEST_F(DoctorConfigCliTest, FlagsOverrideTheConfigAndUnsetFlagsKeepItsValues) {
  const std::string config = WriteConfig("run.json", R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "bf16": {"enabled": false}, "fp16": {"enabled": false},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "strata": {"steps": 50, "seq_len": 8, "io_backend": "posix"}})");
  // --config after --steps on the command line: the flag still wins.
  const Result r = RunStrata(TinyRun() + " --steps 2 --config " + config + " --summary-json " +
                             (dir_ / "o.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto j = ReadJson("o.json");
  EXPECT_EQ(j["steps"], 2);             // flag over file
  EXPECT_EQ(j["seq_len"], 16);          // flag over file
  EXPECT_EQ(j["micro_batch_size"], 2);  // file
  EXPECT_EQ(j["grad_accum_steps"], 3);  // file
  EXPECT_EQ(j["precision"], "fp32");    // file
}

TEST_F(DoctorConfigCliTest, BadConfigsAndIoFlagsExitWithOneLineNamingTheKey) {
  struct Case {
    std::string args;
    std::string names;
  };
  const std::string unknown =
      WriteConfig("u.json", R"({"zero_optimization": {"offload_param": {"foo": 1}}})");
  const std::string malformed = WriteConfig("m.json", "{\"aio\": ");
  const Case cases[] = {
      {"--config " + unknown, "'zero_optimization.offload_param.foo'"},
      {"--config " + malformed, "malformed JSON"},
      {"--config " + (dir_ / "absent.json").string(), "absent.json"},
      {"--io-queue-depth 0", "--io-queue-depth"},
      {"--io-block-size 1000", "--io-block-size"},
      {"--io-block-size 12XB", "--io-block-size"},
      {"--io-threads 300", "--io-threads"},
  };
  for (const auto& c : cases) {
    const Result r = RunStrata(TinyRun() + " --steps 1 " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_EQ(Lines(r.err), 1) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.names), std::string::npos) << c.args << ": " << r.err;
  }
}

TEST_F(DoctorConfigCliTest, IoFlagsReachTheEngineAndChangeHowNotWhatIsTransferred) {
  // A posix run with a small block size, queue depth 1 and one thread trains exactly like the
  // defaults (same seed, same bytes): the I/O settings change how, not what, is transferred.
  const Result a = RunStrata(TinyRun() + " --steps 2 --io-backend posix --summary-json " +
                             (dir_ / "a.json").string());
  const Result b = RunStrata(TinyRun() +
                             " --steps 2 --io-backend posix --io-block-size 8KiB "
                             "--io-queue-depth 1 --io-threads 1 --summary-json " +
                             (dir_ / "b.json").string());
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_NE(a.out.find("posix backend (block 1.0 MiB, queue depth 32, 4 threads)"),
            std::string::npos)
      << a.out;
  EXPECT_NE(b.out.find("posix backend (block 8.0 KiB, queue depth 1, 1 thread)"), std::string::npos)
      << b.out;
  const auto ja = ReadJson("a.json"), jb = ReadJson("b.json");
  EXPECT_EQ(ja["master_weights_xxh3"], jb["master_weights_xxh3"]);
  EXPECT_EQ(ja["nvme_bytes_written"], jb["nvme_bytes_written"]);
}

}  // namespace
