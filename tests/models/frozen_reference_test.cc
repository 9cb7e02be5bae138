// Preference training's model side (issue 46) through whole models on the host device, with the
// buffers the engine gives the blocks (tests/models/gpt_model_run.h):
//   - the frozen reference (engine::BlockBuffers::frozen_reference): a Llama (untied; Gemma 2 with
//     its soft-capped logits; Qwen3 with q/k norms and windows) and a GPT-2 (tied and untied) with
//     LoRA on every module and non-zero adapters compute, in the reference's Forward, the head's
//     target_losses, loss and logits bit for bit equal to those of the same model without LoRA over
//     the same base (fp32 and bf16), whether the layers get their adapter chunks or none; the
//     policy's (adapters on) differ. Over a 4-bit base (QLoRA) the reference is the model without
//     LoRA over the dequantized base, bit for bit;
//   - has_frozen_reference exactly with LoRA; the flag in a model without it, or in a Backward, is
//     kInvalidArgument;
//   - the head's target_losses are the values the mean loss sums; target_weights of 1 / (B T) give
//     the mean's gradients bit for bit (B T = 16: 1 / 16 and dloss / 16 are exact), and other
//     weights other gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/device.h"
#include "models/base_quant.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/lora.h"
#include "tests/engine/tiny_families.h"
#include "tests/models/gpt_model_run.h"
#include "tests/models/gpt_test_model.h"
#include "tests/models/llama_test_model.h"

namespace strata::models {
namespace {

using test_model::CastVector;
using test_model::ModelRun;
using test_model::ModelRunResult;
using test_model::SequenceOptions;

constexpr int kB = 2, kT = 8;

const LoraConfig kLlamaLora{
    .rank = 4,
    .alpha = 8,
    .targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
// c_proj names the attention's and the MLP's projection; c_fc adapts the GELU's pre-activation
// (the GPT layer's unfused path).
const LoraConfig kGptLora{.rank = 4, .alpha = 8, .targets = {"c_attn", "c_proj", "c_fc"}};

// Random adapters for every layer of `m` (LoRA on): A uniform in +-1/sqrt(in), B uniform in
// +-0.25 (not PEFT's zero, so that the adapters change the output).
template <typename S>
test_model::Model<S> RandomAdapters(const engine::Model& m, const LoraLayout& l, uint64_t seed) {
  std::mt19937_64 rng(seed);
  test_model::Model<S> adapters;
  for (int b = 0; b < m.num_blocks(); ++b) {
    std::vector<double> chunk(m.block_num_params(b));
    for (const LoraSite& s : l.sites) {
      if (chunk.empty()) break;
      const double a = 1 / std::sqrt(static_cast<double>(s.module.in));
      std::uniform_real_distribution<double> ua(-a, a), ub(-0.25, 0.25);
      for (int64_t i = 0; i < l.rank * s.module.in; ++i) chunk[s.a_offset + i] = ua(rng);
      for (int64_t i = 0; i < s.module.out * l.rank; ++i) chunk[s.b_offset + i] = ub(rng);
    }
    adapters.blocks.push_back(CastVector<S>(chunk));
  }
  return adapters;
}

template <typename S>
std::vector<std::vector<S>> Cast(const std::vector<std::vector<double>>& blocks) {
  std::vector<std::vector<S>> out;
  for (const auto& b : blocks) out.push_back(CastVector<S>(b));
  return out;
}

std::vector<int32_t> Tokens(int vocab, uint64_t seed) {
  return llama_test::RandomTokens(kB * kT, vocab, seed);
}

// Targets with a few ignored positions (engine::kIgnoreTarget).
std::vector<int32_t> Targets(int vocab, uint64_t seed) {
  std::vector<int32_t> t = llama_test::RandomTokens(kB * kT, vocab, seed);
  t[1] = t[6] = t[kT + 3] = engine::kIgnoreTarget;
  return t;
}

// The reference's Forward (BlockBuffers::frozen_reference), with or without the layers' own
// params in their buffers.
SequenceOptions ReferenceOptions(bool with_params) {
  SequenceOptions o;
  o.frozen_reference = true;
  o.reference_params = with_params;
  return o;
}
SequenceOptions WeightOptions(std::vector<float> weights) {
  SequenceOptions o;
  o.target_weights = std::move(weights);
  return o;
}

// One Forward of `model` on the host device with `options` (target_losses on): the run's results.
template <typename S>
ModelRunResult<S> RunForward(engine::Model& model, const test_model::Model<S>& params,
                             const std::vector<std::vector<S>>* frozen,
                             const std::vector<int32_t>& tokens,
                             const std::vector<int32_t>& targets, SequenceOptions options,
                             std::vector<std::vector<std::byte>> frozen_bytes = {}) {
  auto device = gpu::CreateHostDevice({});
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  auto stream = (*device)->CreateStream("host compute");
  EXPECT_TRUE(stream.ok()) << stream.status().ToString();
  auto run = ModelRun<S>::Create(model, **device, {kB, kT});
  EXPECT_TRUE(run.ok()) << run.status().ToString();
  options.target_losses = true;
  (*run)->set_sequence_options(std::move(options));
  if (!frozen_bytes.empty()) (*run)->set_frozen_bytes(std::move(frozen_bytes));
  auto r = (*run)->Forward(**stream, params, tokens, targets, frozen);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : ModelRunResult<S>{};
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// The reference (adapters off) of `lora` against `plain` (the same family and base, no LoRA):
// bit for bit, with and without the adapter chunks in the layers' buffers; the policy (adapters
// on) differs from it.
template <typename S>
void ExpectReferenceIsTheBaseModel(engine::Model& lora, const LoraLayout& layout,
                                   engine::Model& plain,
                                   const std::vector<std::vector<double>>& base, int vocab) {
  ASSERT_TRUE(lora.has_frozen_reference());
  ASSERT_FALSE(plain.has_frozen_reference());
  const std::vector<std::vector<S>> frozen = Cast<S>(base);
  const test_model::Model<S> adapters = RandomAdapters<S>(lora, layout, 17);
  test_model::Model<S> base_params;
  base_params.blocks = frozen;
  const std::vector<int32_t> tokens = Tokens(vocab, 5), targets = Targets(vocab, 6);

  const ModelRunResult<S> want = RunForward<S>(plain, base_params, nullptr, tokens, targets, {});
  const ModelRunResult<S> policy = RunForward<S>(lora, adapters, &frozen, tokens, targets, {});
  ASSERT_EQ(want.target_losses.size(), static_cast<size_t>(kB * kT));
  for (const bool params : {false, true}) {
    SCOPED_TRACE(params ? "the layers get their adapter chunks" : "no own params");
    const ModelRunResult<S> ref =
        RunForward<S>(lora, adapters, &frozen, tokens, targets, ReferenceOptions(params));
    EXPECT_TRUE(SameBits(ref.target_losses, want.target_losses)) << "target_losses";
    EXPECT_EQ(std::memcmp(&ref.loss, &want.loss, sizeof(float)), 0)
        << "loss " << ref.loss << " vs " << want.loss;
    EXPECT_TRUE(SameBits(ref.logits, want.logits)) << "last-position logits";
  }
  // The adapters are on in the policy: its per-position losses are others (by far more than a
  // rounding: B is of the size of the weights).
  double moved = 0;
  for (size_t i = 0; i < want.target_losses.size(); ++i) {
    moved = std::max<double>(moved, std::abs(policy.target_losses[i] - want.target_losses[i]));
  }
  EXPECT_GT(moved, 1e-2) << "the policy's target_losses should differ from the reference's";
}

template <typename S>
class FrozenReferenceTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16>;
TYPED_TEST_SUITE(FrozenReferenceTest, StorageTypes);

TYPED_TEST(FrozenReferenceTest, LlamaReferenceIsTheModelWithoutLora) {
  using S = TypeParam;
  const std::vector<std::pair<const char*, LlamaConfig>> configs = {
      {"llama", engine::testing::TinyLlama(false)},
      {"gemma2", engine::testing::TinyGemma2()},
      {"qwen3_window", engine::testing::TinyQwen3Window()}};
  for (const auto& [name, config] : configs) {
    SCOPED_TRACE(name);
    auto lora = LlamaModel::Create(config);
    auto plain = LlamaModel::Create(config);
    ASSERT_TRUE(lora.ok() && plain.ok());
    EXPECT_FALSE((*lora)->has_frozen_reference());
    ASSERT_TRUE((*lora)->EnableLora(kLlamaLora).ok());
    ExpectReferenceIsTheBaseModel<S>(**lora, *(*lora)->lora(), **plain,
                                     llama_test::RandomLlama(config, 31), config.vocab_size);
  }
}

TYPED_TEST(FrozenReferenceTest, GptReferenceIsTheModelWithoutLora) {
  using S = TypeParam;
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    GptShape shape{256, 16, 2, 2, 32};
    shape.tie_embeddings = tied;
    auto lora = GptModel::Create(shape);
    auto plain = GptModel::Create(shape);
    ASSERT_TRUE(lora.ok() && plain.ok());
    EXPECT_FALSE((*lora)->has_frozen_reference());
    ASSERT_TRUE((*lora)->EnableLora(kGptLora).ok());
    ExpectReferenceIsTheBaseModel<S>(**lora, *(*lora)->lora(), **plain,
                                     test_model::RandomModel(shape, 41).blocks, shape.vocab_size);
  }
}

// QLoRA: the layers' frozen chunks in 4 bits (NF4 with double quantization) decode as in any
// Forward; the reference is the model without LoRA whose layers hold the decoded weights (in S,
// as the decode writes them; the embedding and the head as initialised).
TYPED_TEST(FrozenReferenceTest, QloraReferenceIsTheModelWithoutLoraOverTheDequantizedBase) {
  using S = TypeParam;
  const DType precision = DTypeOf<S>();
  const uint64_t seed = 7;
  const LlamaConfig config = engine::testing::TinyLlama(false);
  auto quantized = LlamaModel::Create(config);
  auto plain = LlamaModel::Create(config);
  ASSERT_TRUE(quantized.ok() && plain.ok());
  ASSERT_TRUE((*quantized)->EnableLora(kLlamaLora).ok());
  ASSERT_TRUE((*quantized)->EnableBaseQuant({}).ok());
  LlamaModel& q = **quantized;
  EXPECT_TRUE(q.has_frozen_reference());
  std::vector<std::vector<std::byte>> chunks;
  test_model::Model<S> base;
  for (int b = 0; b < q.num_blocks(); ++b) {
    std::vector<std::byte> chunk(q.block_frozen_bytes(b, precision));
    ASSERT_TRUE(q.InitFrozenChunk(b, seed, precision, chunk).ok());
    std::vector<float> values(q.block_frozen_params(b));
    if (q.kind(b) == DecoderBlock::kLayer) {
      DecodeLayerChunkToF32(q.EncodedLayout(b, precision), precision, chunk.data(), values.data());
    } else {
      ASSERT_TRUE(q.InitFrozenParams(b, seed, values).ok());
    }
    chunks.push_back(std::move(chunk));
    base.blocks.push_back(CastVector<S>(std::vector<double>(values.begin(), values.end())));
  }
  const test_model::Model<S> adapters = RandomAdapters<S>(q, *q.lora(), 19);
  const std::vector<int32_t> tokens = Tokens(config.vocab_size, 8),
                             targets = Targets(config.vocab_size, 9);
  const ModelRunResult<S> want = RunForward<S>(**plain, base, nullptr, tokens, targets, {});
  const ModelRunResult<S> ref =
      RunForward<S>(q, adapters, nullptr, tokens, targets, ReferenceOptions(false), chunks);
  const ModelRunResult<S> policy = RunForward<S>(q, adapters, nullptr, tokens, targets, {}, chunks);
  ASSERT_EQ(want.target_losses.size(), static_cast<size_t>(kB * kT));
  EXPECT_TRUE(SameBits(ref.target_losses, want.target_losses)) << "target_losses";
  EXPECT_EQ(std::memcmp(&ref.loss, &want.loss, sizeof(float)), 0);
  EXPECT_TRUE(SameBits(ref.logits, want.logits)) << "last-position logits";
  EXPECT_FALSE(SameBits(policy.target_losses, want.target_losses));
}

// The flag is a Forward's, of a model that has a reference: a Backward with it, or a Forward of a
// model without LoRA, is kInvalidArgument naming the flag, before anything runs.
TEST(FrozenReference, OutsideALoraForwardIsInvalidArgument) {
  const LlamaConfig config = engine::testing::TinyLlama(false);
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto stream = (*device)->CreateStream("host compute");
  ASSERT_TRUE(stream.ok());
  const std::vector<int32_t> tokens = Tokens(config.vocab_size, 1),
                             targets = Targets(config.vocab_size, 2);

  auto plain = LlamaModel::Create(config);
  ASSERT_TRUE(plain.ok());
  test_model::Model<float> params;
  params.blocks = Cast<float>(llama_test::RandomLlama(config, 3));
  auto run = ModelRun<float>::Create(**plain, **device, {kB, kT});
  ASSERT_TRUE(run.ok());
  (*run)->set_sequence_options(ReferenceOptions(true));
  auto r = (*run)->Forward(**stream, params, tokens, targets);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("frozen_reference"), std::string::npos);

  auto lora = LlamaModel::Create(config);
  ASSERT_TRUE(lora.ok());
  ASSERT_TRUE((*lora)->EnableLora(kLlamaLora).ok());
  const std::vector<std::vector<float>> frozen = params.blocks;
  auto lora_run = ModelRun<float>::Create(**lora, **device, {kB, kT});
  ASSERT_TRUE(lora_run.ok());
  (*lora_run)->set_sequence_options(ReferenceOptions(false));
  const test_model::Model<float> adapters = RandomAdapters<float>(**lora, *(*lora)->lora(), 4);
  ASSERT_TRUE((*lora_run)->Forward(**stream, adapters, tokens, targets, &frozen).ok());
  engine::BlockBuffers head = (*lora_run)->BackwardBuffers((*lora)->num_blocks() - 1);
  head.frozen_reference = true;
  const Status s = (*lora)->Backward((*lora)->num_blocks() - 1, head, **stream);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("frozen_reference"), std::string::npos);
}

// target_losses are the values the mean loss sums (in double, in token order, over B T here),
// and target_weights replace the mean: weights of 1 / (B T) everywhere give the mean's gradients
// bit for bit (1 / 16 and dloss / 16 are exact), other weights other gradients. Both families,
// in fp32 and bf16, through every block's Backward.
template <typename S>
void ExpectTargetLossesAndWeights(engine::Model& model,
                                  const std::vector<std::vector<double>>& blocks, int vocab) {
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok());
  auto stream = (*device)->CreateStream("host compute");
  ASSERT_TRUE(stream.ok());
  test_model::Model<S> params;
  params.blocks = Cast<S>(blocks);
  const std::vector<int32_t> tokens = Tokens(vocab, 11);
  const std::vector<int32_t> targets = llama_test::RandomTokens(kB * kT, vocab, 12);
  const auto run = [&](SequenceOptions o) {
    auto r = ModelRun<S>::Create(model, **device, {kB, kT});
    EXPECT_TRUE(r.ok());
    o.target_losses = true;
    (*r)->set_sequence_options(std::move(o));
    auto result = (*r)->ForwardBackward(**stream, params, tokens, targets);
    EXPECT_TRUE(result.ok()) << result.status().ToString();
    return result.ok() ? *result : ModelRunResult<S>{};
  };
  const ModelRunResult<S> mean = run({});
  ASSERT_EQ(mean.target_losses.size(), static_cast<size_t>(kB * kT));
  double sum = 0;
  for (float l : mean.target_losses) sum += l;
  EXPECT_EQ(mean.loss, static_cast<float>(sum / (kB * kT)));
  const ModelRunResult<S> uniform = run(WeightOptions(std::vector<float>(kB * kT, 1.0f / 16)));
  std::vector<float> other(kB * kT, 1.0f / 16);
  other[3] = -0.5f;
  other[9] = 0.0f;
  const ModelRunResult<S> weighted = run(WeightOptions(other));
  EXPECT_TRUE(SameBits(uniform.target_losses, mean.target_losses));
  for (int b = 0; b < model.num_blocks(); ++b) {
    SCOPED_TRACE(model.block_name(b));
    EXPECT_TRUE(SameBits(uniform.grads[b], mean.grads[b]));
    EXPECT_TRUE(SameBits(uniform.tied_grads[b], mean.tied_grads[b]));
  }
  EXPECT_TRUE(SameBits(uniform.dx0, mean.dx0));
  EXPECT_FALSE(SameBits(weighted.dx0, mean.dx0));
}

TYPED_TEST(FrozenReferenceTest, TargetLossesAreWhatTheLossSumsAndWeightsReplaceTheMean) {
  using S = TypeParam;
  static_assert(kB * kT == 16);
  {
    SCOPED_TRACE("gemma2 (tied, soft-capped logits)");
    const LlamaConfig config = engine::testing::TinyGemma2();
    auto m = LlamaModel::Create(config);
    ASSERT_TRUE(m.ok());
    ExpectTargetLossesAndWeights<S>(**m, llama_test::RandomLlama(config, 21), config.vocab_size);
  }
  {
    SCOPED_TRACE("gpt2 (untied)");
    const GptShape shape{256, 16, 2, 2, 32};
    auto m = GptModel::Create(shape);
    ASSERT_TRUE(m.ok());
    ExpectTargetLossesAndWeights<S>(**m, test_model::RandomModel(shape, 22).blocks,
                                    shape.vocab_size);
  }
}

}  // namespace
}  // namespace strata::models
