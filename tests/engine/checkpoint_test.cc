// Engine::SaveCheckpoint / LoadCheckpoint: exact resume, validation before use, the directory
// protocol, and I/O faults during training followed by a resume.
#include "engine/checkpoint.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <tuple>

#include "engine/engine.h"
#include "formats/safetensors.h"
#include "gpu/device.h"
#include "io/fault_injection.h"
#include "io/swap_store.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void WriteFile(const fs::path& p, const std::string& s) {
  fs::remove(p);
  std::ofstream out(p, std::ios::binary);
  out << s;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto shape = models::GptPreset("tiny");
    ASSERT_TRUE(shape.ok());
    model_ = std::move(*models::GptModel::Create(*shape));
    root_ = fs::temp_directory_path() /
            ("strata_ckpt_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "swap");
    save_dir_ = (root_ / "ckpt").string();
    tokens_ = testing::RandomTokenVectors(64, 2 * 16, 99);
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    device_ = std::move(*device);
  }
  void TearDown() override { fs::remove_all(root_); }

  EngineOptions Options(DType precision, OptimizerHome optim) {
    EngineOptions o;
    o.precision = precision;
    o.micro_batch = {2, 16};
    o.grad_accum_steps = 2;
    o.optimizer.adamw().lr = 1e-2f;
    o.optimizer.adamw().weight_decay = 0.01f;
    o.seed = 7;
    o.placement.nvme_paths = {(root_ / "swap").string()};
    o.placement.optimizer_home = optim;
    o.placement.param_home = optim == OptimizerHome::kNvme ? ParamHome::kNvme : ParamHome::kHost;
    o.placement.device_budget_bytes =
        StreamingMinimumBytes(*model_, precision, o.micro_batch) + 1024;
    if (precision == DType::kF16) {
      // Start above what fp16 gradients tolerate and grow often, so the run has overflows,
      // skipped steps, backoffs and growths: the loss-scale history must resume exactly too.
      o.loss_scaler.initial_scale = 1048576.0f;  // 2^20
      o.loss_scaler.growth_interval = 2;
    }
    return o;
  }

  std::unique_ptr<Engine> MakeEngine(const EngineOptions& o) {
    auto e = Engine::Create(model_.get(), device_.get(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }

  // Steps [from, to) on the fixed token stream; appends (loss scale, skipped) per step.
  void Run(Engine& e, int from, int to, std::vector<std::pair<float, bool>>* history = nullptr) {
    for (int s = from; s < to; ++s) {
      e.SetLearningRate(1e-2f / (1 + s));
      std::vector<MicroBatch> mbs = {{tokens_[4 * s], tokens_[4 * s + 1]},
                                     {tokens_[4 * s + 2], tokens_[4 * s + 3]}};
      auto r = e.Step(mbs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      if (history) history->push_back({r->loss_scale, r->skipped});
    }
  }

  TrainerState State(int64_t step) {
    TrainerState t;
    t.step = step;
    t.tokens_seen = step * 64;
    t.data_rng = "data-rng-" + std::to_string(step);
    t.lr_schedule_json = R"({"next_step":)" + std::to_string(step) + "}";
    t.model_json = R"({"preset":"tiny"})";
    return t;
  }

  std::unique_ptr<models::GptModel> model_;
  std::unique_ptr<gpu::Device> device_;
  fs::path root_;
  std::string save_dir_;
  std::vector<std::vector<int32_t>> tokens_;
};

class ResumeTest : public CheckpointTest,
                   public ::testing::WithParamInterface<std::tuple<DType, OptimizerHome>> {};

TEST_P(ResumeTest, SaveAfterNStepsThenResumeForMIsBitIdenticalToNPlusM) {
  const auto [precision, home] = GetParam();
  const int n = 5, m = 6;
  const auto o = Options(precision, home);
  std::vector<std::pair<float, bool>> straight_history, resumed_history;
  uint64_t straight_hash = 0;
  int64_t straight_steps = 0;
  float straight_scale = 0;
  {
    auto e = MakeEngine(o);
    ASSERT_NE(e, nullptr);
    Run(*e, 0, n + m, &straight_history);
    straight_hash = *e->MasterWeightsXxh3();
    straight_steps = e->steps_taken();
    straight_scale = e->loss_scale();
  }
  {
    auto e = MakeEngine(o);
    ASSERT_NE(e, nullptr);
    Run(*e, 0, n, &resumed_history);
    std::string dir;
    ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(n), {}, &dir).ok());
    EXPECT_EQ(dir, save_dir_ + "/step-" + std::to_string(n));
    // Keep training the first engine past the save: the checkpoint must not change.
    Run(*e, n, n + 2);
  }
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  const uint64_t fresh_hash = *e->MasterWeightsXxh3();
  TrainerState t;
  const Status s = e->LoadCheckpoint(save_dir_, &t);  // through `latest`
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_NE(*e->MasterWeightsXxh3(), fresh_hash);
  EXPECT_EQ(t.step, n);
  EXPECT_EQ(t.tokens_seen, n * 64);
  EXPECT_EQ(t.data_rng, "data-rng-5");
  EXPECT_EQ(nlohmann::json::parse(t.lr_schedule_json)["next_step"], n);
  EXPECT_EQ(e->steps_taken(), n);
  Run(*e, n, n + m, &resumed_history);
  EXPECT_EQ(*e->MasterWeightsXxh3(), straight_hash);
  EXPECT_EQ(e->steps_taken(), straight_steps);
  EXPECT_EQ(e->loss_scale(), straight_scale);
  EXPECT_EQ(resumed_history, straight_history);
  int skipped = 0;
  for (const auto& [scale, skip] : straight_history) skipped += skip;
  EXPECT_LT(skipped, n + m);  // updates were applied
  if (precision == DType::kF16) {
    // The history really had overflows, and the scale changed after the save.
    EXPECT_GT(skipped, 0);
    std::set<float> scales_after;
    for (int s = n; s < n + m; ++s) scales_after.insert(straight_history[s].first);
    EXPECT_GT(scales_after.size(), 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(PrecisionAndOptimizerHome, ResumeTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16),
                                            ::testing::Values(OptimizerHome::kNvme,
                                                              OptimizerHome::kHost)),
                         [](const auto& info) {
                           return std::string(DTypeName(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == OptimizerHome::kNvme ? "_nvme"
                                                                                   : "_host");
                         });

TEST_F(CheckpointTest, LayoutModesLatestAndKeepLast) {
  auto e = MakeEngine(Options(DType::kBF16, OptimizerHome::kNvme));
  ASSERT_NE(e, nullptr);
  for (int s = 1; s <= 4; ++s) {
    Run(*e, s - 1, s);
    ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(s), {.keep_last = 2}).ok());
  }
  std::set<std::string> names;
  for (const auto& d : fs::directory_iterator(save_dir_)) names.insert(d.path().filename());
  EXPECT_EQ(names, (std::set<std::string>{"latest", "step-3", "step-4"}));
  EXPECT_EQ(ReadFile(fs::path(save_dir_) / "latest"), "step-4\n");
  struct stat st;
  ASSERT_EQ(::stat(save_dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const fs::path ckpt = fs::path(save_dir_) / "step-4";
  ASSERT_EQ(::stat(ckpt.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  std::set<std::string> files;
  for (const auto& f : fs::directory_iterator(ckpt)) {
    files.insert(f.path().filename());
    ASSERT_EQ(::stat(f.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f.path();
  }
  EXPECT_EQ(files, (std::set<std::string>{kManifestFileName, kMasterFile, kExpAvgFile,
                                          kExpAvgSqFile, kWorkingFile}));
  auto manifest = ReadManifest(ckpt.string());
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_TRUE(VerifyCheckpointFiles(ckpt.string(), *manifest).ok());
  EXPECT_EQ(manifest->trainer.step, 4);
  EXPECT_EQ(manifest->engine_steps, 4);
  // The master tensors are the engine's master weights, block by block.
  auto master = formats::OpenSafetensorsFile((ckpt / kMasterFile).string());
  ASSERT_TRUE(master.ok());
  for (int b = 0; b < model_->num_blocks(); ++b) {
    const auto* t = master->header.Find(model_->block_name(b));
    ASSERT_NE(t, nullptr);
    std::vector<float> v(t->num_elems);
    ASSERT_TRUE(
        formats::ReadTensorBytes(*master, *t, 0, std::as_writable_bytes(std::span(v))).ok());
    EXPECT_EQ(v, *e->MasterWeights(b)) << b;
  }
}

TEST_F(CheckpointTest, SavingTheSameStepAgainReplacesItAtomically) {
  auto e = MakeEngine(Options(DType::kBF16, OptimizerHome::kHost));
  ASSERT_NE(e, nullptr);
  Run(*e, 0, 1);
  ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(1)).ok());
  ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(1)).ok());
  TrainerState t;
  EXPECT_TRUE(e->LoadCheckpoint(save_dir_, &t).ok());
  int entries = 0;
  for (const auto& d : fs::directory_iterator(save_dir_)) entries += !d.path().empty();
  EXPECT_EQ(entries, 2);  // latest, step-1
}

// `latest` that cannot be replaced (a full drive; here a directory in its place): the save says
// the checkpoint is complete and where, `latest` is as it was, and no latest.tmp is left.
TEST_F(CheckpointTest, ALatestThatCannotBeWrittenLeavesTheCompleteCheckpointNamed) {
  auto e = MakeEngine(Options(DType::kBF16, OptimizerHome::kHost));
  ASSERT_NE(e, nullptr);
  Run(*e, 0, 1);
  fs::create_directories(save_dir_ + "/latest/occupied");
  const Status s = e->SaveCheckpoint(save_dir_, State(1));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("checkpoint '" + save_dir_ +
                             "/step-1' is complete but 'latest' "
                             "still names the one before"),
            std::string::npos)
      << s.ToString();
  EXPECT_FALSE(fs::exists(save_dir_ + "/latest.tmp"));
  EXPECT_TRUE(fs::exists(save_dir_ + "/step-1/manifest.json"));
  TrainerState t;
  EXPECT_TRUE(e->LoadCheckpoint(save_dir_ + "/step-1", &t).ok());
}

// The plan's NVMe bytes are what the swap store lays out: each extent padded to 4 KiB (the plan
// counted them unpadded, so `strata estimate` passed a drive that `strata train` then filled).
TEST_F(CheckpointTest, ThePlansNvmeBytesAreTheSwapFilesSize) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    const EngineOptions o = Options(precision, OptimizerHome::kNvme);
    auto e = MakeEngine(o);
    ASSERT_NE(e, nullptr);
    uint64_t on_disk = 0;
    for (const auto& dir : fs::recursive_directory_iterator(root_ / "swap")) {
      if (dir.is_regular_file()) on_disk += fs::file_size(dir.path());
    }
    EXPECT_GT(on_disk, 0u);
    EXPECT_EQ(e->plan().nvme_bytes, on_disk) << DTypeName(precision);
  }
}

// With two NVMe paths each swap file holds the plan's extents striped as
// io::SwapStore::StripeShareBytes says (what `strata train` and `estimate` check each path's free
// space against): an extent under one stripe unit lands whole on the first path, so the paths'
// sums differ from half the total (estimate passed two drives a run then could not fill).
TEST_F(CheckpointTest, EachSwapFileHoldsThePlansStripesOfItsExtents) {
  EngineOptions o = Options(DType::kBF16, OptimizerHome::kNvme);
  o.placement.nvme_paths = {(root_ / "swap").string(), (root_ / "swap2").string()};
  fs::create_directories(root_ / "swap2");
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  const Plan& plan = e->plan();
  uint64_t sum = 0;
  std::vector<uint64_t> expected(2, 0);
  for (uint64_t extent : plan.nvme_extent_bytes) {
    sum += extent;
    const std::vector<uint64_t> share =
        io::SwapStore::StripeShareBytes(extent, 2, io::SwapStoreOptions{}.stripe_unit_bytes);
    expected[0] += share[0];
    expected[1] += share[1];
  }
  EXPECT_EQ(sum, plan.nvme_bytes);
  for (int j = 0; j < 2; ++j) {
    uint64_t on_disk = 0;
    for (const auto& f : fs::recursive_directory_iterator(o.placement.nvme_paths[j])) {
      if (f.is_regular_file()) on_disk += fs::file_size(f.path());
    }
    EXPECT_EQ(on_disk, expected[j]) << "path " << j;
  }
  EXPECT_NE(expected[0], expected[1]);
}

// EngineOptions::cancel_requested (strata train's SIGINT/SIGTERM): a cancelled Create leaves no
// swap files; a load cancelled while verifying leaves the engine as it was, one cancelled while
// reading refuses to step until a load succeeds.
TEST_F(CheckpointTest, CancelledCreateAndLoadsStopBetweenBlocksAndLeaveNothingBehind) {
  int polls = 0;
  int cancel_at = 0;  // the poll that says "cancel" (and every later one); -1: never
  EngineOptions o = Options(DType::kBF16, OptimizerHome::kNvme);
  o.cancel_requested = [&] { return cancel_at >= 0 && polls++ >= cancel_at; };
  {
    auto cancelled = Engine::Create(model_.get(), device_.get(), o);
    ASSERT_FALSE(cancelled.ok());
    EXPECT_EQ(cancelled.status().code(), StatusCode::kCancelled);
    EXPECT_NE(cancelled.status().message().find(
                  "cancelled while initialising the master weights and optimizer state, block 1 "
                  "of "),
              std::string::npos)
        << cancelled.status().ToString();
    EXPECT_TRUE(fs::is_empty(root_ / "swap"));  // the swap directory is removed
  }
  cancel_at = -1;
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  Run(*e, 0, 2);
  std::string dir;
  ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(2), {}, &dir).ok());
  const uint64_t saved = *e->MasterWeightsXxh3();
  Run(*e, 2, 3);
  const uint64_t after = *e->MasterWeightsXxh3();
  TrainerState t;
  // While verifying (before the second file): nothing changes, the engine steps on.
  polls = 0;
  cancel_at = 1;
  Status s = e->LoadCheckpoint(save_dir_, &t);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.ToString();
  EXPECT_NE(s.message().find("cancelled while verifying checkpoint '" + dir + "'"),
            std::string::npos)
      << s.ToString();
  EXPECT_EQ(*e->MasterWeightsXxh3(), after);
  EXPECT_EQ(e->steps_taken(), 3);
  // While reading (one poll per file verified, then one per block): the second block.
  const auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok());
  polls = 0;
  cancel_at = static_cast<int>(manifest->files.size()) + 1;
  s = e->LoadCheckpoint(save_dir_, &t);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.ToString();
  EXPECT_NE(s.message().find("cancelled while reading the checkpoint, block 2 of " +
                             std::to_string(model_->num_blocks())),
            std::string::npos)
      << s.ToString();
  std::vector<MicroBatch> mbs = {{tokens_[0], tokens_[1]}, {tokens_[2], tokens_[3]}};
  EXPECT_EQ(e->Step(mbs).status().code(), StatusCode::kFailedPrecondition);
  cancel_at = -1;
  ASSERT_TRUE(e->LoadCheckpoint(save_dir_, &t).ok());
  EXPECT_EQ(*e->MasterWeightsXxh3(), saved);
  EXPECT_EQ(t.step, 2);
  Run(*e, 2, 3);
  EXPECT_EQ(*e->MasterWeightsXxh3(), after);
}

// Corrupted or hostile checkpoints: each is a clear error and leaves the engine as it was.
class CorruptionTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    engine_ = MakeEngine(Options(DType::kBF16, OptimizerHome::kNvme));
    ASSERT_NE(engine_, nullptr);
    Run(*engine_, 0, 2);
    ASSERT_TRUE(engine_->SaveCheckpoint(save_dir_, State(2), {}, &dir_).ok());
    Run(*engine_, 2, 3);  // the engine's state now differs from the checkpoint's
    hash_ = *engine_->MasterWeightsXxh3();
  }
  // Loads, expects `code` and `needle` in the message, and an unchanged, still usable engine.
  void ExpectRejected(StatusCode code, const std::string& needle) {
    TrainerState t;
    t.step = -7;
    const Status s = engine_->LoadCheckpoint(save_dir_, &t);
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.ToString();
    EXPECT_EQ(t.step, -7);
    EXPECT_EQ(*engine_->MasterWeightsXxh3(), hash_);
    EXPECT_EQ(engine_->steps_taken(), 3);
    Run(*engine_, 3, 4);
  }
  // Replaces a file and fixes its size and xxh3 in the manifest, so only the content is wrong.
  void ReplaceFileKeepingManifestConsistent(const std::string& name, const std::string& bytes) {
    WriteFile(fs::path(dir_) / name, bytes);
    auto text = ReadFile(fs::path(dir_) / kManifestFileName);
    auto j = nlohmann::json::parse(text);
    uint64_t size = 0;
    auto hash = formats::FileXxh3(dir_ + "/" + name, &size);
    ASSERT_TRUE(hash.ok());
    for (auto& f : j["files"]) {
      if (f["name"] == name) {
        f["size_bytes"] = size;
        f["xxh3"] = fmt::format("{:016x}", *hash);
      }
    }
    WriteFile(fs::path(dir_) / kManifestFileName, j.dump());
  }
  void EditManifest(const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(ReadFile(fs::path(dir_) / kManifestFileName));
    edit(j);
    WriteFile(fs::path(dir_) / kManifestFileName, j.dump());
  }
  std::unique_ptr<Engine> engine_;
  std::string dir_;
  uint64_t hash_ = 0;
};

TEST_F(CorruptionTest, FlippedByteIsAChecksumMismatchNamingTheFile) {
  auto bytes = ReadFile(fs::path(dir_) / kExpAvgFile);
  bytes[bytes.size() / 2] ^= 0x10;
  WriteFile(fs::path(dir_) / kExpAvgFile, bytes);
  ExpectRejected(StatusCode::kDataLoss, std::string(kExpAvgFile) + "': xxh3");
}

TEST_F(CorruptionTest, TruncatedFileIsASizeMismatch) {
  fs::resize_file(fs::path(dir_) / kWorkingFile, fs::file_size(fs::path(dir_) / kWorkingFile) - 3);
  ExpectRejected(StatusCode::kDataLoss, "truncated");
}

TEST_F(CorruptionTest, MissingFileIsNotFound) {
  fs::remove(fs::path(dir_) / kMasterFile);
  ExpectRejected(StatusCode::kNotFound, kMasterFile);
}

TEST_F(CorruptionTest, ManifestWithWrongShapesIsAModelMismatch) {
  EditManifest([](nlohmann::json& j) { j["model"]["block_num_params"][1] = 12345; });
  ExpectRejected(StatusCode::kInvalidArgument, "12345");
}

TEST_F(CorruptionTest, ManifestNamingAFileOutsideTheCheckpointIsRejected) {
  EditManifest(
      [](nlohmann::json& j) { j["files"][0]["name"] = "../ckpt/step-2/master.safetensors"; });
  ExpectRejected(StatusCode::kDataLoss, "not a plain file name");
}

TEST_F(CorruptionTest, AFileNameWithAControlCharacterIsQuotedEscaped) {
  // Found by manifest_fuzz: the name was quoted raw, a tab in the one-line message.
  EditManifest([](nlohmann::json& j) { j["files"][0]["name"] = "master\tweights.safetensors"; });
  ExpectRejected(StatusCode::kDataLoss,
                 "'master\\x09weights.safetensors' is not a plain file name");
}

TEST_F(CorruptionTest, LatestNamingAPathOutsideTheSaveDirIsRejected) {
  WriteFile(fs::path(save_dir_) / kLatestFileName, "../step-2\n");
  ExpectRejected(StatusCode::kDataLoss, "not a checkpoint directory name");
}

TEST_F(CorruptionTest, OtherFormatVersionIsFailedPrecondition) {
  EditManifest([](nlohmann::json& j) { j["format_version"] = 99; });
  ExpectRejected(StatusCode::kFailedPrecondition, "version 99");
}

TEST_F(CorruptionTest, TensorOffsetsOutsideTheFileAreRejected) {
  auto bytes = ReadFile(fs::path(dir_) / kMasterFile);
  // Shift the first tensor's end offset in the header text without changing its length.
  const auto pos = bytes.find("\"data_offsets\":[0,");
  ASSERT_NE(pos, std::string::npos);
  bytes[pos + 18] = '9';
  ReplaceFileKeepingManifestConsistent(kMasterFile, bytes);
  ExpectRejected(StatusCode::kDataLoss, "data_offsets");
}

TEST_F(CorruptionTest, TensorRenamedWithDotDotIsAMissingTensor) {
  auto bytes = ReadFile(fs::path(dir_) / kMasterFile);
  const auto pos = bytes.find("\"embedding\"");
  ASSERT_NE(pos, std::string::npos);
  bytes.replace(pos + 1, 9, "../emb/..");  // same length: offsets stay valid
  ReplaceFileKeepingManifestConsistent(kMasterFile, bytes);
  ExpectRejected(StatusCode::kDataLoss, "tensor 'embedding' is missing");
}

TEST_F(CorruptionTest, OtherPrecisionIsRejectedBeforeUse) {
  EditManifest([](nlohmann::json& j) { j["precision"] = "fp16"; });
  ExpectRejected(StatusCode::kInvalidArgument, "`precision fp16`");  // the option
}

TEST_F(CorruptionTest, ManifestThatIsNotJsonIsDataLoss) {
  WriteFile(fs::path(dir_) / kManifestFileName, "{\"format\": \"strata-checkpoint\", ");
  ExpectRejected(StatusCode::kDataLoss, "not a JSON object");
}

// I/O faults during training end the step with an error naming the swap file and the cause;
// a fresh engine then resumes from the last checkpoint and matches an uninterrupted run.
class IoFaultTest : public CheckpointTest, public ::testing::WithParamInterface<int> {};

TEST_P(IoFaultTest, FaultDuringTrainingIsClearAndResumingFromTheLastCheckpointIsExact) {
  const int err = GetParam();
  auto o = Options(DType::kBF16, OptimizerHome::kNvme);
  uint64_t straight = 0;
  {
    auto e = MakeEngine(o);
    ASSERT_NE(e, nullptr);
    Run(*e, 0, 6);
    straight = *e->MasterWeightsXxh3();
  }
  io::FaultInjectingBackend* faults = nullptr;
  auto faulty = o;
  faulty.test_hooks.io_backend_factory =
      [&](const io::IoBackendOptions& io_options) -> StatusOr<std::unique_ptr<io::IoBackend>> {
    STRATA_ASSIGN_OR_RETURN(auto b, io::FaultInjectingBackend::Create(io_options));
    faults = b.get();
    return std::unique_ptr<io::IoBackend>(std::move(b));
  };
  {
    auto e = MakeEngine(faulty);
    ASSERT_NE(e, nullptr);
    ASSERT_NE(faults, nullptr);
    Run(*e, 0, 3);
    ASSERT_TRUE(e->SaveCheckpoint(save_dir_, State(3)).ok());
    faults->AddFault(io::Fault::Errno(
        err == ENOSPC ? std::optional(io::IoOp::kWrite) : std::optional(io::IoOp::kRead), err, 1,
        io::Fault::kForever));
    std::vector<MicroBatch> mbs = {{tokens_[12], tokens_[13]}, {tokens_[14], tokens_[15]}};
    // A read fails in this step's forward; a write fails in its update, which runs behind the
    // step's return and comes back from the next call that needs it (here Flush).
    auto r = e->Step(mbs);
    const Status status = r.ok() ? e->Flush() : r.status();
    ASSERT_FALSE(status.ok());
    const std::string msg = status.message();
    EXPECT_EQ(status.code(), err == ENOSPC ? StatusCode::kResourceExhausted : StatusCode::kDataLoss)
        << msg;
    EXPECT_NE(msg.find((root_ / "swap").string()), std::string::npos) << msg;  // the path
    EXPECT_NE(msg.find(std::strerror(err)), std::string::npos) << msg;         // the cause
  }
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TrainerState t;
  ASSERT_TRUE(e->LoadCheckpoint(save_dir_, &t).ok());
  EXPECT_EQ(t.step, 3);
  Run(*e, 3, 6);
  EXPECT_EQ(*e->MasterWeightsXxh3(), straight);
}

INSTANTIATE_TEST_SUITE_P(Errno, IoFaultTest, ::testing::Values(ENOSPC, EIO),
                         [](const auto& info) { return info.param == ENOSPC ? "ENOSPC" : "EIO"; });

}  // namespace
}  // namespace strata::engine
