// Packed sequences and ignored targets through the engine (issue 31): the block-diagonal causal
// attention, position ids restarting at each example and targets the loss does not count, for
// the tiny Llama and GPT-2 families on the host backend.
//
// Bound. A packed example and the same example alone compute the same products over the same
// inputs: every op works row by row (the products of a row do not read other rows, and a packed
// attention row adds exact zeros for the other examples' keys), so each token's loss is the same
// to the bit, in fp32 and in bf16. What differs is the arithmetic of the means: the packed mean
// sums every token's loss in double and rounds once to float; the reference rounds each
// example's mean to float (2^-24 relative each) and weighs them in double. Hence 2^-22 relative
// (four such roundings), in either precision.
//
// The same file built with STRATA_PACKED_BATCH_CUDA is packed_batch_cuda_test (label gpu): the
// same checks on the CUDA device. There a product's kernel may depend on its number of rows
// (cuBLAS picks one per shape), so a packed example and the example alone may sum in another
// order: each element within gamma_64 = 2^-18 of its terms in fp32, the loss, through 4 layers,
// within 2^-12 relative; in bf16 one storage rounding (2^-8) may go the other way, 2^-6 for the
// loss. That examples do not see each other still holds to the bit (a row's products do not
// read other rows; masked keys give exact zeros).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/micro_batch.h"
#include "gpu/device.h"
#include "tests/engine/tiny_families.h"
#ifdef STRATA_PACKED_BATCH_CUDA
#include "tests/gpu/cuda_test_util.h"
#endif

namespace strata::engine {
namespace {

constexpr int kT = 16;  // the tiny families' max_seq_len

struct Example {
  std::vector<int32_t> tokens;
};

// One micro-batch of one row packing `examples` (their lengths sum to kT): targets are the next
// token within the example, ignored at each example's end; position ids restart at each example.
struct Packed {
  std::vector<int32_t> tokens, targets, position_ids;
  MicroBatch batch() const { return {tokens, targets, position_ids}; }
};

Packed Pack(const std::vector<Example>& examples) {
  Packed p;
  for (const Example& e : examples) {
    for (size_t i = 0; i < e.tokens.size(); ++i) {
      p.tokens.push_back(e.tokens[i]);
      p.targets.push_back(i + 1 < e.tokens.size() ? e.tokens[i + 1] : kIgnoreTarget);
      p.position_ids.push_back(static_cast<int32_t>(i));
    }
  }
  return p;
}

std::vector<Example> RandomExamples(const std::vector<int>& lengths, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Example> out;
  for (int n : lengths) {
    Example e;
    for (int i = 0; i < n; ++i) e.tokens.push_back(static_cast<int32_t>(rng() % 256));
    out.push_back(e);
  }
  return out;
}

class PackedBatchTest : public ::testing::TestWithParam<testing::Family> {
 protected:
  void SetUp() override {
    model_ = GetParam().make();
#ifdef STRATA_PACKED_BATCH_CUDA
    if (const std::string why = gpu::testing::NoCudaReason(); !why.empty()) GTEST_SKIP() << why;
    gpu::CudaDeviceOptions d;
    d.pinned_budget_bytes = size_t{256} << 20;
    auto device = gpu::CreateCudaDevice(d);
#else
    auto device = gpu::CreateHostDevice({});
#endif
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = std::move(*device);
  }
  std::unique_ptr<Engine> MakeEngine(DType precision) {
    EngineOptions o;
    o.precision = precision;
    o.micro_batch = {1, kT};
    o.grad_accum_steps = 2;
    o.seed = 11;
    o.placement.device_budget_bytes = 64 << 20;
    o.placement.param_home = ParamHome::kDevice;
    o.placement.optimizer_home = OptimizerHome::kHost;
    auto e = Engine::Create(model_.get(), device_.get(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }
  // The loss of `batch` in shape (1, T).
  float Loss(Engine& e, const MicroBatch& batch, int T) {
    auto loss = e.EvaluateLoss(batch, {1, T});
    EXPECT_TRUE(loss.ok()) << loss.status().ToString();
    return loss.ok() ? *loss : NAN;
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<gpu::Device> device_;
};

// A packed row's loss is the mean over its counted targets, so it equals the examples' losses
// evaluated one by one, weighted by their counted targets.
TEST_P(PackedBatchTest, PackedLossIsTheExamplesLossesWeightedByTheirTargets) {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(precision));
    auto engine = MakeEngine(precision);
    ASSERT_NE(engine, nullptr);
    const std::vector<Example> examples = RandomExamples({5, 7, 4}, 3);
    const float packed = Loss(*engine, Pack(examples).batch(), kT);
    double sum = 0;
    int64_t counted = 0;
    for (const Example& ex : examples) {
      const Packed alone = Pack({ex});
      const int n = static_cast<int>(ex.tokens.size());
      sum += double{Loss(*engine, {alone.tokens, alone.targets}, n)} * (n - 1);
      counted += n - 1;
    }
    const double want = sum / counted;
#ifdef STRATA_PACKED_BATCH_CUDA
    const double bound = precision == DType::kF32 ? 0x1p-12 : 0x1p-6;
#else
    const double bound = 0x1p-22;
#endif
    EXPECT_NEAR(packed, want, bound * std::abs(want)) << "packed " << packed << " alone " << want;
  }
}

// A row of one example padded as example data pads it (data/example_dataset.h: pad tokens at
// position 0, each a one-token example of its own, their targets ignored) has the example's loss
// alone: the longest sequence is the example, so LongRoPE uses the factors the example alone
// uses (short ones here: 6 <= 8 original positions; padding counted on to 16 would pick the
// long ones), as transformers does for a batch padded to its longest example.
TEST_P(PackedBatchTest, APaddedRowHasItsExamplesLossAlone) {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(precision));
    auto engine = MakeEngine(precision);
    ASSERT_NE(engine, nullptr);
    const Example ex = RandomExamples({6}, 5)[0];
    const Packed alone = Pack({ex});
    Packed padded = alone;
    for (int t = 6; t < kT; ++t) {
      padded.tokens.push_back(0);
      padded.targets.push_back(kIgnoreTarget);
      padded.position_ids.push_back(0);
    }
    const float want = Loss(*engine, {alone.tokens, alone.targets}, 6);
#ifdef STRATA_PACKED_BATCH_CUDA
    const double bound = precision == DType::kF32 ? 0x1p-12 : 0x1p-6;
#else
    const double bound = 0x1p-22;
#endif
    const float got = Loss(*engine, padded.batch(), kT);
    EXPECT_NEAR(got, want, bound * std::abs(want)) << "padded " << got << " alone " << want;
  }
}

// Changing one example changes nothing of another's loss: with only the first example's
// targets counted, the loss is the same to the bit whatever the second example holds.
TEST_P(PackedBatchTest, AnExampleDoesNotSeeTheOtherExamplesOfItsRow) {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(precision));
    auto engine = MakeEngine(precision);
    ASSERT_NE(engine, nullptr);
    std::vector<Example> examples = RandomExamples({9, 7}, 4);
    Packed first = Pack(examples);
    std::fill(first.targets.begin() + 9, first.targets.end(), kIgnoreTarget);
    const float before = Loss(*engine, first.batch(), kT);
    for (int32_t& t : examples[1].tokens) t = (t + 101) % 256;
    Packed changed = Pack(examples);
    std::fill(changed.targets.begin() + 9, changed.targets.end(), kIgnoreTarget);
    EXPECT_EQ(Loss(*engine, changed.batch(), kT), before);
    // Without position ids the second example's tokens come after the first's, which still sees
    // none of them (causal): the same loss too, and the check above is not vacuous for it.
    const float unpacked = Loss(*engine, {first.tokens, first.targets}, kT);
    EXPECT_EQ(Loss(*engine, {changed.tokens, changed.targets}, kT), unpacked);
    // The other way round the packed row must differ from the causal one: the second example
    // alone is not the second example after the first.
    Packed second = Pack(examples);
    std::fill(second.targets.begin(), second.targets.begin() + 9, kIgnoreTarget);
    EXPECT_NE(Loss(*engine, second.batch(), kT),
              Loss(*engine, {second.tokens, second.targets}, kT));
  }
}

// A training step weighs each micro-batch by its counted targets: its loss is the counted mean
// over both micro-batches; a step where no target counts is refused before anything changes.
TEST_P(PackedBatchTest, AStepIsTheMeanOverItsCountedTargets) {
  auto engine = MakeEngine(DType::kF32);
  ASSERT_NE(engine, nullptr);
  const Packed a = Pack(RandomExamples({16}, 5));
  Packed b = Pack(RandomExamples({6, 10}, 6));
  std::fill(b.targets.begin(), b.targets.begin() + 6, kIgnoreTarget);  // a prompt
  const float la = Loss(*engine, a.batch(), kT), lb = Loss(*engine, b.batch(), kT);
  const auto count = [](const Packed& p) {
    return std::count_if(p.targets.begin(), p.targets.end(), [](int32_t t) { return t >= 0; });
  };
  const double want = (double{la} * count(a) + double{lb} * count(b)) / (count(a) + count(b));
  const uint64_t hash_before = *engine->MasterWeightsXxh3();
  Packed none = b;
  std::fill(none.targets.begin(), none.targets.end(), kIgnoreTarget);
  const std::vector<MicroBatch> empty = {none.batch(), none.batch()};
  auto refused = engine->Step(empty);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no target"), std::string::npos)
      << refused.status().message();
  EXPECT_EQ(*engine->MasterWeightsXxh3(), hash_before);
  const std::vector<MicroBatch> mbs = {a.batch(), b.batch()};
  auto step = engine->Step(mbs);
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  EXPECT_NEAR(step->loss, want, 1e-6 * want);
  EXPECT_NE(*engine->MasterWeightsXxh3(), hash_before);
}

TEST_P(PackedBatchTest, BadPositionIdsAndTargetsAreOneLineErrors) {
  auto engine = MakeEngine(DType::kF32);
  ASSERT_NE(engine, nullptr);
  Packed p = Pack(RandomExamples({8, 8}, 7));
  p.position_ids[3] = 5;  // neither 0 nor the previous one plus 1
  auto loss = engine->EvaluateLoss(p.batch(), {1, kT});
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loss.status().message().find("position id 5 at 3"), std::string::npos)
      << loss.status().message();
  p = Pack(RandomExamples({8, 8}, 7));
  p.targets[2] = -2;
  loss = engine->EvaluateLoss(p.batch(), {1, kT});
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("target at 2 is -2"), std::string::npos)
      << loss.status().message();
}

INSTANTIATE_TEST_SUITE_P(Families, PackedBatchTest, ::testing::ValuesIn(testing::TinyFamilies()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(MicroBatchLossWeights, AreTodaysWeightsWhenEveryTargetCountsElseTheCountedShares) {
  const std::vector<int64_t> full = {16, 16, 16};
  auto w = MicroBatchLossWeights(full, 16, 1024.0f, 2, 2 * 48);
  ASSERT_TRUE(w.ok());
  for (float x : *w) EXPECT_EQ(x, 1024.0f / static_cast<float>(3 * 2));
  const std::vector<int64_t> partial = {16, 4, 0};
  w = MicroBatchLossWeights(partial, 16, 8.0f, 1, 20);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)[0], 8.0f * 16 / 20);
  EXPECT_EQ((*w)[1], 8.0f * 4 / 20);
  EXPECT_EQ((*w)[2], 0.0f);
  const std::vector<int64_t> none = {0, 0};
  EXPECT_FALSE(MicroBatchLossWeights(none, 16, 1.0f, 1, 0).ok());
  // Two ranks: each micro-batch's share of the targets both ranks count, so that the summed
  // gradients are one rank's over all four micro-batches ({16, 4} here, {10, 2} there: 32).
  const std::vector<int64_t> here = {16, 4}, there = {10, 2}, all = {16, 4, 10, 2};
  const auto one_rank = MicroBatchLossWeights(all, 16, 8.0f, 1, 32);
  const auto rank0 = MicroBatchLossWeights(here, 16, 8.0f, 2, 32);
  const auto rank1 = MicroBatchLossWeights(there, 16, 8.0f, 2, 32);
  ASSERT_TRUE(one_rank.ok() && rank0.ok() && rank1.ok());
  EXPECT_EQ((*rank0)[0], (*one_rank)[0]);
  EXPECT_EQ((*rank0)[1], (*one_rank)[1]);
  EXPECT_EQ((*rank1)[0], (*one_rank)[2]);
  EXPECT_EQ((*rank1)[1], (*one_rank)[3]);
  // A rank whose micro-batches count nothing contributes nothing, and is no error while another
  // rank's count; all of them counting every target on one rank only is not "every target".
  const auto empty = MicroBatchLossWeights(none, 16, 8.0f, 2, 32);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(*empty, (std::vector<float>{0.0f, 0.0f}));
  const auto half = MicroBatchLossWeights(std::vector<int64_t>{16, 16}, 16, 8.0f, 2, 32);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(*half, (std::vector<float>{4.0f, 4.0f}));
  EXPECT_THAT(MicroBatchLossWeights(none, 16, 1.0f, 2, 0).status().message(),
              ::testing::HasSubstr("no target of this step's 4 micro-batches on 2 ranks"));
  EXPECT_FALSE(MicroBatchLossWeights(here, 16, 1.0f, 2, 3).ok());
  const std::vector<float> losses = {2.0f, 4.0f};
  const std::vector<int64_t> counts = {16, 16}, uneven = {12, 4};
  EXPECT_EQ(StepLoss(losses, counts, 16), 3.0f);
  EXPECT_EQ(StepLoss(losses, uneven, 16), 2.5f);
}

}  // namespace
}  // namespace strata::engine
