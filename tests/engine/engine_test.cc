#include "engine/engine.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "gpu/device.h"
#include "models/gpt.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

using testing::ExpectBitIdentical;
using testing::RandomTokenVectors;
using testing::TrainRun;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto shape = models::GptPreset("tiny");
    ASSERT_TRUE(shape.ok());
    auto model = models::GptModel::Create(*shape);
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    swap_dir_ = std::filesystem::temp_directory_path() /
                ("strata_engine_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(swap_dir_);
  }
  void TearDown() override { std::filesystem::remove_all(swap_dir_); }

  EngineOptions Options(DType precision) {
    EngineOptions o;
    o.precision = precision;
    o.micro_batch = {2, 16};
    o.grad_accum_steps = 2;
    o.optimizer.adamw().lr = 1e-2f;
    o.optimizer.adamw().weight_decay = 0.01f;
    o.grad_clip_norm = 1.0f;
    o.seed = 7;
    o.placement.nvme_paths = {swap_dir_.string()};
    o.io.kind = io::BackendKind::kAuto;
    return o;
  }

  EngineOptions Resident(DType precision) {
    auto o = Options(precision);
    o.placement.param_home = ParamHome::kDevice;
    o.placement.optimizer_home = OptimizerHome::kHost;
    o.placement.device_budget_bytes = 64 << 20;
    return o;
  }

  EngineOptions Streamed(DType precision, ParamHome home) {
    auto o = Options(precision);
    o.placement.param_home = home;
    o.placement.optimizer_home = OptimizerHome::kNvme;
    o.placement.device_budget_bytes =
        StreamingMinimumBytes(*model_, precision, o.micro_batch) + 1024;
    return o;
  }

  TrainRun Train(const EngineOptions& o, int steps) {
    auto device = gpu::CreateHostDevice({});
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return {};
    return testing::TrainOn(**device, *model_, o, steps);
  }

  std::unique_ptr<models::GptModel> model_;
  std::filesystem::path swap_dir_;
};

TEST_F(EngineTest, StreamedParamsAndNvmeOptimizerGiveBitIdenticalMasterWeights) {
  for (DType precision : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    const TrainRun resident = Train(Resident(precision), 10);
    const TrainRun nvme = Train(Streamed(precision, ParamHome::kNvme), 10);
    const TrainRun host = Train(Streamed(precision, ParamHome::kHost), 10);
    EXPECT_EQ(resident.plan.num_resident(), model_->num_blocks());
    EXPECT_LT(nvme.plan.num_resident(), model_->num_blocks());
    EXPECT_LE(nvme.counters.device_peak_bytes, nvme.plan.device_budget_bytes);
    EXPECT_GT(nvme.counters.nvme_bytes_written, 0u);
    EXPECT_GT(nvme.counters.nvme_bytes_read, 0u);
    EXPECT_GT(nvme.counters.bytes_h2d, resident.counters.bytes_h2d);
    ExpectBitIdentical(resident, nvme);
    ExpectBitIdentical(resident, host);
    // Training did something: the loss moved and the weights are not the initial ones.
    EXPECT_NE(resident.results.front().loss, resident.results.back().loss);
  }
}

// The model gets the compute stream once, at Engine::Create (the GPT on CUDA takes its cuBLAS
// workspace there, not inside a step); an error there fails Create and names the cause.
class PrepareRecorder final : public ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  Status PrepareComputeStream(gpu::Stream& stream) override {
    ++calls;
    stream_name = std::string(stream.name());
    return fail ? ResourceExhaustedError("no room for the workspace") : Status::Ok();
  }
  int calls = 0;
  std::string stream_name;
  bool fail = false;
};

TEST_F(EngineTest, ModelPreparesTheComputeStreamOnceAtCreate) {
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  PrepareRecorder model(model_.get());
  const EngineOptions o = Resident(DType::kBF16);
  auto engine = Engine::Create(&model, device->get(), o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ(model.calls, 1);
  EXPECT_EQ(model.stream_name, "compute");
  const auto tokens = RandomTokenVectors(4, o.micro_batch.tokens(), 3);
  const std::vector<MicroBatch> batch{{tokens[0], tokens[1]}, {tokens[2], tokens[3]}};
  ASSERT_TRUE((*engine)->Step(batch).ok());
  EXPECT_EQ(model.calls, 1);  // not again in a step

  PrepareRecorder failing(model_.get());
  failing.fail = true;
  auto refused = Engine::Create(&failing, device->get(), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("workspace"), std::string::npos);
}

TEST_F(EngineTest, LossDecreasesOnARepeatedBatch) {
  auto o = Streamed(DType::kBF16, ParamHome::kNvme);
  o.grad_accum_steps = 1;
  auto device = gpu::CreateHostDevice({});
  auto engine = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const auto tokens = RandomTokenVectors(2, o.micro_batch.tokens(), 3);
  std::vector<MicroBatch> mbs = {{tokens[0], tokens[1]}};
  float first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    auto r = (*engine)->Step(mbs);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    if (s == 0) first = r->loss;
    last = r->loss;
  }
  EXPECT_LT(last, first - 1.0f);
  // Evaluation on the same batch agrees with training's forward pass in scale.
  auto eval = (*engine)->EvaluateLoss(mbs[0], o.micro_batch);
  ASSERT_TRUE(eval.ok());
  EXPECT_LT(*eval, first);
}

TEST_F(EngineTest, Fp16OverflowSkipsTheStepHalvesTheScaleAndKeepsMasterWeights) {
  auto o = Streamed(DType::kF16, ParamHome::kNvme);
  o.loss_scaler.initial_scale = 1e30f;  // every fp16 gradient overflows to inf
  auto device = gpu::CreateHostDevice({});
  auto engine = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto& e = **engine;
  std::vector<std::vector<float>> before;
  for (int b = 0; b < model_->num_blocks(); ++b) before.push_back(*e.MasterWeights(b));
  const uint64_t hash_before = *e.MasterWeightsXxh3();
  const auto tokens = RandomTokenVectors(4, o.micro_batch.tokens(), 5);
  std::vector<MicroBatch> mbs = {{tokens[0], tokens[1]}, {tokens[2], tokens[3]}};
  auto r = e.Step(mbs);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(r->loss_scale, 1e30f);
  EXPECT_EQ(e.loss_scale(), 5e29f);
  for (int b = 0; b < model_->num_blocks(); ++b) {
    const auto after = *e.MasterWeights(b);
    ASSERT_EQ(after.size(), before[b].size());
    for (size_t i = 0; i < after.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(after[i]), std::bit_cast<uint32_t>(before[b][i]));
    }
  }
  EXPECT_EQ(*e.MasterWeightsXxh3(), hash_before);
  // The scale keeps halving until gradients fit, then steps apply.
  bool applied = false;
  for (int s = 0; s < 120 && !applied; ++s) {
    auto r2 = e.Step(mbs);
    ASSERT_TRUE(r2.ok());
    applied = !r2->skipped;
  }
  EXPECT_TRUE(applied);
  EXPECT_NE(*e.MasterWeightsXxh3(), hash_before);
}

TEST_F(EngineTest, InferenceOnlyEngineEvaluatesACheckpointOfAnyPrecisionAndRefusesToTrain) {
  auto o = Resident(DType::kF32);
  o.grad_accum_steps = 1;
  auto device = gpu::CreateHostDevice({});
  auto trained = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(trained.ok()) << trained.status().ToString();
  const auto tokens = RandomTokenVectors(2, o.micro_batch.tokens(), 11);
  std::vector<MicroBatch> mbs = {{tokens[0], tokens[1]}};
  for (int s = 0; s < 5; ++s) ASSERT_TRUE((*trained)->Step(mbs).ok());
  const std::string save_dir = (swap_dir_ / "ckpt").string();
  TrainerState saved;
  saved.step = 5;
  ASSERT_TRUE((*trained)->SaveCheckpoint(save_dir, saved).ok());
  auto trained_loss = (*trained)->EvaluateLoss(mbs[0], o.micro_batch);
  ASSERT_TRUE(trained_loss.ok());

  for (DType precision : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string(DTypeName(precision)));
    auto io = Resident(precision);
    io.placement.param_home = ParamHome::kHost;
    io.placement.device_budget_bytes =
        StreamingMinimumBytes(*model_, precision, io.micro_batch) + 1024;
    io.inference_only = true;
    auto e = Engine::Create(model_.get(), device->get(), io);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    auto fresh = (*e)->EvaluateLoss(mbs[0], o.micro_batch);
    ASSERT_TRUE(fresh.ok());
    TrainerState state;
    ASSERT_TRUE((*e)->LoadCheckpoint(save_dir, &state).ok());
    EXPECT_EQ(state.step, 5);
    auto loss = (*e)->EvaluateLoss(mbs[0], o.micro_batch);
    ASSERT_TRUE(loss.ok());
    EXPECT_NE(*loss, *fresh);  // the checkpoint's weights, not the initial ones
    if (precision == DType::kF32) {
      EXPECT_EQ(*loss, *trained_loss);
    } else {
      EXPECT_NEAR(*loss, *trained_loss, 0.05 * *trained_loss);
    }
    auto step = (*e)->Step(mbs);
    ASSERT_FALSE(step.ok());
    EXPECT_EQ(step.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ((*e)->SaveCheckpoint(save_dir, state).code(), StatusCode::kFailedPrecondition);
  }
  auto nvme = Streamed(DType::kBF16, ParamHome::kNvme);
  nvme.inference_only = true;
  auto refused = Engine::Create(model_.get(), device->get(), nvme);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, InfeasibleBudgetSaysWhatIsShortAndByHowMuch) {
  auto o = Streamed(DType::kBF16, ParamHome::kNvme);
  o.placement.device_budget_bytes = 4096;
  auto device = gpu::CreateHostDevice({});
  auto engine = Engine::Create(model_.get(), device->get(), o);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(engine.status().message().find("short"), std::string::npos);
  EXPECT_NE(engine.status().message().find("4.0 KiB"), std::string::npos);
}

TEST_F(EngineTest, TokenOutsideTheVocabularyIsRejected) {
  auto o = Resident(DType::kBF16);
  o.grad_accum_steps = 1;
  auto device = gpu::CreateHostDevice({});
  auto engine = Engine::Create(model_.get(), device->get(), o);
  ASSERT_TRUE(engine.ok());
  std::vector<int32_t> tokens(o.micro_batch.tokens(), 1), targets(tokens.size(), 1);
  tokens[5] = 300;
  std::vector<MicroBatch> mbs = {{tokens, targets}};
  auto r = (*engine)->Step(mbs);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::engine
