// The engine with every CPU optimizer (engine/plan/optimizer_state.h): each trains, gives the same
// bits in every placement (state in host memory or on NVMe, params resident or streamed, overlapped
// or sequential), resumes exactly from a checkpoint, and a checkpoint of one optimizer refuses to
// load into a run of another. The 16-bit host gradients of a one-micro-batch step give the bits
// of fp32 accumulators.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>

#include "engine/engine.h"
#include "engine/plan/optimizer_state.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "tests/engine/engine_test_util.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
using cpu_optim::AnyOptimizer;
using cpu_optim::OptimizerKind;
using testing::ExpectBitIdentical;
using testing::MixedPlacementOptions;
using testing::TrainOn;
using testing::TrainRun;

// The optimizers under test, with hyper-parameters that move a tiny GPT in a few steps.
std::vector<AnyOptimizer> Optimizers() {
  std::vector<AnyOptimizer> all = testing::ElementwiseOptimizers();
  all.push_back(
      {OptimizerKind::kAdamW8bit, cpu_optim::AdamWConfig{.lr = 1e-2f, .weight_decay = 0.01f}});
  all.push_back({OptimizerKind::kAdafactor, cpu_optim::AdafactorConfig{.lr = 1e-2f}});
  all.push_back({OptimizerKind::kAdafactor,
                 cpu_optim::AdafactorConfig{.lr = 1e-2f, .beta1 = 0.9f, .weight_decay = 0.01f}});
  return all;
}

class EngineOptimizersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 8 blocks; 2-D weights of odd and even sizes for the factored optimizers.
    auto model = models::GptModel::Create({256, 16, 6, 2, 32});
    ASSERT_TRUE(model.ok());
    model_ = std::move(*model);
    root_ = fs::temp_directory_path() /
            ("strata_engine_optimizers_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(root_ / "swap");
    auto device = gpu::CreateHostDevice({});
    ASSERT_TRUE(device.ok());
    device_ = std::move(*device);
  }
  void TearDown() override { fs::remove_all(root_); }

  EngineOptions Options(const AnyOptimizer& optimizer, ParamHome params, OptimizerHome optim,
                        int accum = 2, DType precision = DType::kBF16) {
    EngineOptions o =
        MixedPlacementOptions(*model_, precision, params, optim, accum, (root_ / "swap").string());
    o.optimizer = optimizer;
    return o;
  }

  std::unique_ptr<models::GptModel> model_;
  std::unique_ptr<gpu::Device> device_;
  fs::path root_;
};

TEST_F(EngineOptimizersTest, EveryOptimizerTrainsAndMatchesAcrossPlacements) {
  for (const AnyOptimizer& optimizer : Optimizers()) {
    SCOPED_TRACE(OptimizerFlagName(optimizer));
    auto ref_options = Options(optimizer, ParamHome::kDevice, OptimizerHome::kHost);
    ref_options.overlap = false;
    const TrainRun reference = TrainOn(*device_, *model_, ref_options, 5);
    ASSERT_EQ(reference.results.size(), 5u);
    // It updated every block, to finite weights (random tokens leave the loss near log 256).
    const TrainRun initial = TrainOn(*device_, *model_, ref_options, 0);
    for (size_t b = 0; b < reference.master.size(); ++b) {
      EXPECT_NE(reference.master[b], initial.master[b]) << "block " << b;
      for (float w : reference.master[b]) ASSERT_TRUE(std::isfinite(w)) << "block " << b;
    }
    const TrainRun nvme =
        TrainOn(*device_, *model_, Options(optimizer, ParamHome::kNvme, OptimizerHome::kNvme), 5);
    EXPECT_EQ(reference.plan.optimizer_name, OptimizerFlagName(optimizer));
    ExpectBitIdentical(reference, nvme);
    const TrainRun host =
        TrainOn(*device_, *model_, Options(optimizer, ParamHome::kHost, OptimizerHome::kHost), 5);
    ExpectBitIdentical(reference, host);
  }
}

TEST_F(EngineOptimizersTest, ResumeFromACheckpointIsExactForEveryOptimizer) {
  const std::vector<MicroBatch> none;
  for (const AnyOptimizer& optimizer : Optimizers()) {
    SCOPED_TRACE(OptimizerFlagName(optimizer));
    const EngineOptions o = Options(optimizer, ParamHome::kNvme, OptimizerHome::kNvme);
    const TrainRun straight = TrainOn(*device_, *model_, o, 6);
    // 3 steps, save, a new engine loads and trains 3 more on the same token stream.
    const auto tokens = testing::RandomTokenVectors(6 * 2 * 2, o.micro_batch.tokens(), 99);
    const std::string save = (root_ / ("ckpt-" + OptimizerFlagName(optimizer))).string();
    auto step = [&](Engine& e, int s) {
      std::vector<MicroBatch> mbs = {{tokens[4 * s], tokens[4 * s + 1]},
                                     {tokens[4 * s + 2], tokens[4 * s + 3]}};
      auto r = e.Step(mbs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    };
    {
      auto e = Engine::Create(model_.get(), device_.get(), o);
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      for (int s = 0; s < 3; ++s) step(**e, s);
      TrainerState t;
      t.step = 3;
      ASSERT_TRUE((*e)->SaveCheckpoint(save, t).ok());
    }
    auto e = Engine::Create(model_.get(), device_.get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    TrainerState t;
    const Status loaded = (*e)->LoadCheckpoint(save, &t);
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    EXPECT_EQ(t.step, 3);
    for (int s = 3; s < 6; ++s) step(**e, s);
    auto hash = (*e)->MasterWeightsXxh3();
    ASSERT_TRUE(hash.ok());
    EXPECT_EQ(*hash, straight.hash);
  }
}

TEST_F(EngineOptimizersTest, ACheckpointOfOneOptimizerRefusesToLoadIntoAnother) {
  const std::vector<AnyOptimizer> all = Optimizers();
  const std::string save = (root_ / "ckpt").string();
  {
    auto e = Engine::Create(model_.get(), device_.get(),
                            Options(all[2], ParamHome::kHost, OptimizerHome::kHost));  // lion
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE((*e)->SaveCheckpoint(save, TrainerState{}).ok());
  }
  auto e = Engine::Create(model_.get(), device_.get(),
                          Options(all[0], ParamHome::kHost, OptimizerHome::kHost));  // adamw
  ASSERT_TRUE(e.ok());
  const auto before = (*e)->MasterWeightsXxh3();
  TrainerState t;
  const Status s = (*e)->LoadCheckpoint(save, &t);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("holds lion optimizer state, this run uses adamw"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find("`optimizer lion`"), std::string::npos)
      << s.ToString();                                           // the option, not the flag
  EXPECT_EQ((*e)->MasterWeightsXxh3().value(), before.value());  // nothing changed

  // The same kind with another state layout (SGD with and without momentum) is refused too.
  {
    auto sgd = Engine::Create(model_.get(), device_.get(),
                              Options(all[3], ParamHome::kHost, OptimizerHome::kHost));
    ASSERT_TRUE(sgd.ok());
    TrainerState later;
    later.step = 1;
    ASSERT_TRUE((*sgd)->SaveCheckpoint(save, later).ok());
  }
  AnyOptimizer plain = all[3];
  std::get<cpu_optim::SgdConfig>(plain.config).momentum = 0;
  auto no_momentum = Engine::Create(model_.get(), device_.get(),
                                    Options(plain, ParamHome::kHost, OptimizerHome::kHost));
  ASSERT_TRUE(no_momentum.ok());
  const Status layout = (*no_momentum)->LoadCheckpoint(save, &t);
  EXPECT_EQ(layout.code(), StatusCode::kInvalidArgument) << layout.ToString();
  EXPECT_NE(layout.message().find("momentum_buffer.safetensors"), std::string::npos)
      << layout.ToString();
}

TEST_F(EngineOptimizersTest, StateLayoutFollowsTheOptimizerAndTheTensorShapes) {
  const int layer = 1;  // (C, 3C), (C, C), (C, 4C), (4C, C) weights and vectors
  const int64_t n = model_->block_num_params(layer);
  const BlockState adamw = LayoutBlockState(*model_, layer, Optimizers()[0]);
  ASSERT_EQ(adamw.sections.size(), 2u);
  EXPECT_EQ(adamw.sections[0].name, "exp_avg");
  EXPECT_EQ(adamw.sections[1].num_elems, n);

  // 8-bit: codes and one absmax per 2048 values; the embedding block keeps fp32 AdamW state.
  const BlockState q8 = LayoutBlockState(*model_, layer, Optimizers()[5]);
  EXPECT_EQ(q8.kind, OptimizerKind::kAdamW8bit);
  ASSERT_EQ(q8.sections.size(), 4u);
  EXPECT_EQ(q8.sections[0].dtype, cpu_optim::StateDType::kU8);
  EXPECT_EQ(q8.sections[0].num_elems, n);
  EXPECT_EQ(q8.sections[1].name, "exp_avg.absmax");
  EXPECT_EQ(q8.sections[1].num_elems, (n + 2047) / 2048);
  int64_t raw = 0;
  for (const auto& section : q8.sections) raw += static_cast<int64_t>(section.size_bytes());
  EXPECT_LT(static_cast<double>(raw), 2.01 * static_cast<double>(n));
  const BlockState embedding = LayoutBlockState(*model_, 0, Optimizers()[5]);
  EXPECT_EQ(embedding.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(embedding.sections.size(), 2u);

  // Adafactor: a row and a column statistic per 2-D tensor, every element of the others.
  int64_t rows = 0, cols = 0, vectors = 0;
  for (const auto& shape : model_->block_tensor_shapes(layer)) {
    if (shape.size() >= 2) {
      rows += shape[0];
      cols += shape[1];
    } else {
      vectors += shape[0];
    }
  }
  EXPECT_GT(rows, 0);
  const BlockState factored = LayoutBlockState(*model_, layer, Optimizers()[6]);
  ASSERT_EQ(factored.sections.size(), 3u);
  EXPECT_EQ(factored.sections[0].name, "exp_avg_sq_row");
  EXPECT_EQ(factored.sections[0].num_elems, rows);
  EXPECT_EQ(factored.sections[1].num_elems, cols);
  EXPECT_EQ(factored.sections[2].num_elems, vectors);
  const BlockState with_m = LayoutBlockState(*model_, layer, Optimizers()[7]);
  ASSERT_EQ(with_m.sections.size(), 4u);
  EXPECT_EQ(with_m.sections[3].name, "exp_avg");
  // Regions are [p32 | sections], each padded to kStateAlign.
  EXPECT_EQ(factored.offsets[0], factored.master_bytes);
  EXPECT_EQ(factored.region_bytes % kStateAlign, 0u);
}

// Every family's blocks list tensor shapes that tile the chunk exactly.
void ExpectShapesTileTheChunks(const Model& model) {
  for (int b = 0; b < model.num_blocks(); ++b) {
    int64_t total = 0;
    for (const auto& shape : model.block_tensor_shapes(b)) {
      total += std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    }
    EXPECT_EQ(total, model.block_num_params(b)) << model.description() << " block " << b;
  }
}

TEST(BlockTensorShapes, GptAndLlamaShapesTileEveryChunk) {
  for (bool tied : {false, true}) {
    auto gpt = models::GptModel::Create({256, 16, 3, 2, 32, tied});
    ASSERT_TRUE(gpt.ok());
    ExpectShapesTileTheChunks(**gpt);
    models::LlamaConfig c;
    c.vocab_size = 96;
    c.hidden_size = 32;
    c.intermediate_size = 80;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    c.max_seq_len = 16;
    c.tie_embeddings = tied;
    auto llama = models::LlamaModel::Create(c);
    ASSERT_TRUE(llama.ok()) << llama.status().ToString();
    ExpectShapesTileTheChunks(**llama);
    // A layer: 2 norms and 7 matrices.
    EXPECT_EQ((*llama)->block_tensor_shapes(1).size(), 9u);
  }
}

TEST_F(EngineOptimizersTest, SixteenBitHostGradientsGiveTheBitsOfFp32Accumulators) {
  for (DType precision : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(precision));
    EngineOptions o = Options(Optimizers()[0], ParamHome::kNvme, OptimizerHome::kNvme,
                              /*accum=*/1, precision);
    const TrainRun grad16 = TrainOn(*device_, *model_, o, 5);
    EXPECT_EQ(grad16.plan.host_grad16_params, model_->num_params());
    EXPECT_EQ(grad16.plan.host_grad_bytes, static_cast<uint64_t>(model_->num_params()) * 2);
    o.test_hooks.fp32_host_grads = true;
    const TrainRun fp32 = TrainOn(*device_, *model_, o, 5);
    ExpectBitIdentical(grad16, fp32);
    // Two micro-batches accumulate in fp32.
    const TrainRun accum =
        TrainOn(*device_, *model_,
                Options(Optimizers()[0], ParamHome::kNvme, OptimizerHome::kNvme, 2, precision), 1);
    EXPECT_EQ(accum.plan.host_grad16_params, 0);
    EXPECT_EQ(accum.plan.host_grad_bytes, static_cast<uint64_t>(model_->num_params()) * 4);
  }
}

TEST_F(EngineOptimizersTest, ATiedChunkKeepsAnFp32AccumulatorAtOneMicroBatch) {
  auto tied = models::GptModel::Create({256, 16, 6, 2, 32, /*tie_embeddings=*/true});
  ASSERT_TRUE(tied.ok());
  EngineOptions o = MixedPlacementOptions(**tied, DType::kBF16, ParamHome::kHost,
                                          OptimizerHome::kHost, 1, (root_ / "swap").string());
  const TrainRun grad16 = TrainOn(*device_, **tied, o, 4);
  const int64_t embedding = (*tied)->block_num_params(0);
  EXPECT_EQ(grad16.plan.host_grad16_params, (*tied)->num_params() - embedding);
  o.test_hooks.fp32_host_grads = true;
  ExpectBitIdentical(grad16, TrainOn(*device_, **tied, o, 4));
}

// Weight decay groups: one step of every optimizer with a large weight decay leaves the GPT's
// biases and LayerNorm parameters (GptModel::block_no_decay_ranges) exactly where the step
// without weight decay puts them, and every other element where the step that decays all
// (decay_norms_and_biases) puts it; in every optimizer home, the device's (the emulated
// device update) for the kinds that run there. One step: all three runs see the same gradient.
TEST_F(EngineOptimizersTest, WeightDecaySkipsTheBiasesAndNormWeights) {
  int64_t exempt = 0;
  for (int b = 0; b < model_->num_blocks(); ++b) {
    for (const cpu_optim::ElemRange& r : model_->block_no_decay_ranges(b))
      exempt += r.end - r.begin;
  }
  ASSERT_GT(exempt, 0);
  for (AnyOptimizer optimizer : Optimizers()) {
    std::visit([](auto& c) { c.weight_decay = 0.5f; }, optimizer.config);
    const bool on_device = CheckDeviceOptimizer(optimizer).ok();
    for (OptimizerHome home :
         {OptimizerHome::kHost, OptimizerHome::kNvme, OptimizerHome::kDevice}) {
      if (home == OptimizerHome::kDevice && !on_device) continue;
      SCOPED_TRACE(fmt::format("{} {}", OptimizerFlagName(optimizer), OptimizerHomeName(home)));
      const ParamHome params =
          home == OptimizerHome::kDevice ? ParamHome::kDevice : ParamHome::kHost;
      EngineOptions decay_all = Options(optimizer, params, home);
      decay_all.decay_norms_and_biases = true;
      const TrainRun all = TrainOn(*device_, *model_, decay_all, 1);
      const TrainRun none = TrainOn(
          *device_, *model_, Options(cpu_optim::WithoutWeightDecay(optimizer), params, home), 1);
      const TrainRun groups = TrainOn(*device_, *model_, Options(optimizer, params, home), 1);
      ASSERT_EQ(groups.master.size(), all.master.size());
      int64_t decay_showed = 0;  // exempt elements that decay would have moved
      for (size_t b = 0; b < groups.master.size(); ++b) {
        const auto ranges = model_->block_no_decay_ranges(static_cast<int>(b));
        for (size_t i = 0; i < groups.master[b].size(); ++i) {
          bool exempt_elem = false;
          for (const auto& r : ranges)
            exempt_elem |= static_cast<int64_t>(i) >= r.begin && static_cast<int64_t>(i) < r.end;
          const float want = exempt_elem ? none.master[b][i] : all.master[b][i];
          ASSERT_EQ(std::bit_cast<uint32_t>(groups.master[b][i]), std::bit_cast<uint32_t>(want))
              << "block " << b << " element " << i << (exempt_elem ? " (exempt)" : "");
          decay_showed += exempt_elem && all.master[b][i] != none.master[b][i];
        }
      }
      EXPECT_GT(decay_showed, 0);  // the LayerNorm weights (the biases start at 0)
    }
  }
}

}  // namespace
}  // namespace strata::engine
