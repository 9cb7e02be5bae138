// Issue 13: blocks compute in the working precision. Training with bf16 or fp16 compute must
// learn what fp32 compute learns, and the 16-bit flow must keep the engine's exactness
// guarantees (tested across placements in overlap_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "gpu/device.h"
#include "models/gpt.h"

namespace strata::engine {
namespace {

// A learnable token stream: a fixed permutation of 37 distinct byte values repeated, so every
// next token is a function of the current one (a bigram table a 2-layer GPT learns in tens of
// steps). Micro-batches are windows at random offsets; targets are the next tokens.
class CycleData {
 public:
  // The cycle is the same for every instance; `offsets_seed` picks the windows (training and
  // held-out windows come from different seeds).
  explicit CycleData(uint64_t offsets_seed) : rng_(offsets_seed) {
    std::mt19937_64 cycle_rng(2026);
    std::vector<int32_t> bytes(256);
    std::iota(bytes.begin(), bytes.end(), 0);
    std::shuffle(bytes.begin(), bytes.end(), cycle_rng);
    cycle_.assign(bytes.begin(), bytes.begin() + kPeriod);
  }
  void Next(MicroBatchShape shape, std::vector<int32_t>* tokens, std::vector<int32_t>* targets) {
    tokens->resize(shape.tokens());
    targets->resize(shape.tokens());
    for (int b = 0; b < shape.batch_size; ++b) {
      const size_t start = rng_() % kPeriod;
      for (int t = 0; t < shape.seq_len; ++t) {
        (*tokens)[b * shape.seq_len + t] = cycle_[(start + t) % kPeriod];
        (*targets)[b * shape.seq_len + t] = cycle_[(start + t + 1) % kPeriod];
      }
    }
  }

 private:
  static constexpr size_t kPeriod = 37;
  std::mt19937_64 rng_;
  std::vector<int32_t> cycle_;
};

struct Curve {
  std::vector<float> losses;  // per step
  float eval_loss = 0;        // on held-out windows after training
};

Curve Train(DType precision, int steps) {
  Curve curve;
  auto device = gpu::CreateHostDevice({});
  EXPECT_TRUE(device.ok());
  auto model = models::GptModel::Create(*models::GptPreset("tiny"));
  EXPECT_TRUE(model.ok());
  if (!device.ok() || !model.ok()) return curve;
  EngineOptions o;
  o.precision = precision;
  o.micro_batch = {4, 16};
  o.optimizer.adamw().lr = 1e-2f;
  o.grad_clip_norm = 1.0f;
  o.seed = 3;
  o.placement.param_home = ParamHome::kDevice;
  o.placement.optimizer_home = OptimizerHome::kHost;
  o.placement.device_budget_bytes = 64 << 20;
  auto engine = Engine::Create(model->get(), device->get(), o);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return curve;
  CycleData data(11);
  std::vector<int32_t> tokens, targets;
  for (int s = 0; s < steps; ++s) {
    data.Next(o.micro_batch, &tokens, &targets);
    const MicroBatch mb{tokens, targets};
    auto r = (*engine)->Step(std::span<const MicroBatch>(&mb, 1));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return curve;
    curve.losses.push_back(r->loss);
  }
  CycleData held_out(12);
  held_out.Next(o.micro_batch, &tokens, &targets);
  auto eval = (*engine)->EvaluateLoss(MicroBatch{tokens, targets}, o.micro_batch);
  EXPECT_TRUE(eval.ok()) << eval.status().ToString();
  if (eval.ok()) curve.eval_loss = *eval;
  return curve;
}

// The first loss is log(256) = 5.55 nats in every precision (random init, tiny logits). All
// precisions must learn the bigram table (held-out loss below 0.2 nats after 60 steps; it is
// about 0.05), and the 16-bit runs must stay with the fp32 run all along: each step's loss
// within 0.03 nats (the bound for the default run; bf16 measured 0.0073 at worst, fp16
// 0.0025) and the held-out loss within 0.01 (measured 0.0009 and 0.0005). A rounding to 16 bits
// costs a relative 2^-9 (bf16) per stored value; a misplaced rounding (a gradient accumulated in
// 16 bits across rows) or a dropped gradient term shows as a gap of tenths or a curve that does
// not fall.
TEST(PrecisionTest, SixteenBitComputeLearnsWhatFp32Learns) {
  constexpr int kSteps = 60;
  const Curve fp32 = Train(DType::kF32, kSteps);
  ASSERT_EQ(fp32.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_NEAR(fp32.losses.front(), std::log(256.0f), 0.1f);
  EXPECT_LT(fp32.eval_loss, 0.2f);
  for (DType precision : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(precision));
    const Curve c = Train(precision, kSteps);
    ASSERT_EQ(c.losses.size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(c.losses[s], fp32.losses[s], 0.03f) << "step " << s;
    }
    EXPECT_LT(c.eval_loss, 0.2f);
    EXPECT_NEAR(c.eval_loss, fp32.eval_loss, 0.01f);
  }
}

}  // namespace
}  // namespace strata::engine
