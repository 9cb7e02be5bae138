// Model FLOPs per token (engine/plan/model_flops.h) against hand counts of a small GPT and a small
// Llama, parameter tensor by parameter tensor, as exact integers; MFU; the datasheet peaks and the
// machine profile's optional peak_bf16_TFLOPs.
#include "engine/plan/model_flops.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "engine/plan/machine_profile.h"
#include "models/gpt.h"
#include "models/llama.h"

namespace strata::engine {
namespace {

TEST(ModelFlops, GptTinyIsSixPerParamPlusAttentionByHand) {
  // The "tiny" preset: V 256, context 16, L 2, 2 heads, C 16, its own lm_head.
  auto shape = models::GptPreset("tiny");
  ASSERT_TRUE(shape.ok());
  ASSERT_EQ(shape->vocab_size, 256);
  ASSERT_EQ(shape->channels, 16);
  ASSERT_EQ(shape->num_layers, 2);
  ASSERT_FALSE(shape->tie_embeddings);
  const int64_t wte = 256 * 16, wpe = 16 * 16;
  const int64_t layer = 2 * 16 /* ln_1 */ + 16 * 48 + 48 /* c_attn */ + 16 * 16 +
                        16 /* attn c_proj */ + 2 * 16 /* ln_2 */ + 16 * 64 + 64 /* c_fc */ +
                        64 * 16 + 16 /* mlp c_proj */;
  const int64_t head = 2 * 16 /* ln_f */ + 16 * 256 /* lm_head */;
  const int64_t params = wte + wpe + 2 * layer + head;
  ASSERT_EQ(layer, 3280);
  ASSERT_EQ(params, 15040);
  auto model = models::GptModel::Create(*shape);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->num_params(), params);  // the hand count is the model's

  // T = 16: 6 * 15040 + 12 * 2 * 16 * 16 = 90240 + 6144.
  EXPECT_EQ(ModelFlopsPerToken(
                {.trained_params = params, .num_layers = 2, .attention_width = 16, .seq_len = 16}),
            96384);
  // Half the context: attention halves, the parameters' part stays.
  EXPECT_EQ(ModelFlopsPerToken(
                {.trained_params = params, .num_layers = 2, .attention_width = 16, .seq_len = 8}),
            90240 + 3072);
}

TEST(ModelFlops, LlamaCountsAttentionAtHeadsTimesHeadDimNotHidden) {
  // Grouped-query attention with head_dim 16 != C / H = 8: Q K^T and A V are 4 x 16 = 64 wide.
  models::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_seq_len = 16;
  const int64_t embed = 64 * 32;
  const int64_t layer = 32 /* input_layernorm */ + 64 * 32 /* q_proj */ + 32 * 32 /* k_proj */ +
                        32 * 32 /* v_proj */ + 32 * 64 /* o_proj */ +
                        32 /* post_attention_layernorm */ + 48 * 32 /* gate_proj */ +
                        48 * 32 /* up_proj */ + 32 * 48 /* down_proj */;
  const int64_t head = 32 /* norm */ + 64 * 32 /* lm_head */;
  const int64_t params = embed + 2 * layer + head;
  ASSERT_EQ(params, 25760);
  auto model = models::LlamaModel::Create(c);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->num_params(), params);

  // 6 * 25760 + 12 * 2 * 16 * 64 = 154560 + 24576.
  EXPECT_EQ(ModelFlopsPerToken(
                {.trained_params = params, .num_layers = 2, .attention_width = 64, .seq_len = 16}),
            179136);
}

TEST(ModelFlops, FrozenParamsCountForwardAndActivationGradientOnly) {
  // LoRA: 1000 adapter params trained, the 25760 of the base frozen (no weight gradient).
  EXPECT_EQ(ModelFlopsPerToken({.trained_params = 1000,
                                .frozen_params = 25760,
                                .num_layers = 2,
                                .attention_width = 64,
                                .seq_len = 16}),
            6 * 1000 + 4 * 25760 + 24576);
}

TEST(ModelFlops, RefusesNegativeFieldsAndOverflow) {
  EXPECT_EQ(ModelFlopsPerToken({.trained_params = -1}), std::nullopt);
  EXPECT_EQ(ModelFlopsPerToken({.seq_len = -2}), std::nullopt);
  const int64_t big = std::numeric_limits<int64_t>::max() / 6;
  EXPECT_EQ(ModelFlopsPerToken({.trained_params = big}), 6 * big);
  EXPECT_EQ(ModelFlopsPerToken({.trained_params = big + 1}), std::nullopt);
  EXPECT_EQ(ModelFlopsPerToken({.trained_params = big, .frozen_params = 1}), std::nullopt);
  EXPECT_EQ(
      ModelFlopsPerToken({.num_layers = 1 << 30, .attention_width = 1 << 30, .seq_len = 1 << 30}),
      std::nullopt);
}

TEST(ModelFlops, UtilisationIsModelFlopRateOverPeakAndAbsentWithoutPeak) {
  // 96384 FLOP/token x 1e6 tokens/s = 96.384 TFLOP/s over a 989 TFLOP/s peak.
  const std::optional<double> mfu = ModelFlopsUtilisation(96384, 1e6, 989);
  ASSERT_TRUE(mfu.has_value());
  EXPECT_DOUBLE_EQ(*mfu, 96384e6 / 989e12);
  EXPECT_EQ(ModelFlopsUtilisation(96384, 1e6, 0), std::nullopt);
  EXPECT_EQ(ModelFlopsUtilisation(96384, std::numeric_limits<double>::infinity(), 989),
            std::nullopt);
}

TEST(DatasheetPeak, KnownDevicesByNameUnknownIsZero) {
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA H200"), 989);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA H200 NVL"), 835);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA H100 80GB HBM3"), 989);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA H100 PCIe"), 756);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA H100 NVL"), 835);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA GH200 480GB"), 989);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA A100-SXM4-80GB"), 312);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA A100 80GB PCIe"), 312);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA L40S"), 362);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA L4"), 121);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA GeForce RTX 4090"), 165);
  // Whole words only: an L40 is not an L4, an unknown card is unknown.
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA L40"), 0);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA GeForce RTX 4090 D"), 165);
  EXPECT_EQ(DatasheetPeakBf16Tflops("NVIDIA GeForce RTX 3060"), 0);
  EXPECT_EQ(DatasheetPeakBf16Tflops(""), 0);
}

TEST(MachineProfilePeak, OptionalKeyIsReadWrittenAndChecked) {
  const std::string old_file =
      R"({"device": {"name": "X", "memory_GiB": 10, "bf16_TFLOPs": 100, "memory_GBps": 900}})";
  auto old_profile = ParseMachineProfile(old_file, "old");
  ASSERT_TRUE(old_profile.ok()) << old_profile.status().ToString();  // files before the key
  EXPECT_EQ(old_profile->device->peak_bf16_TFLOPs, 0);
  EXPECT_EQ(MachineProfileJson(*old_profile).find("peak_bf16_TFLOPs"), std::string::npos);

  const std::string with_peak =
      R"({"device": {"name": "X", "memory_GiB": 10, "bf16_TFLOPs": 100, "memory_GBps": 900,
          "peak_bf16_TFLOPs": 312}})";
  auto p = ParseMachineProfile(with_peak, "new");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->device->peak_bf16_TFLOPs, 312);
  auto again = ParseMachineProfile(MachineProfileJson(*p), "written");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->device->peak_bf16_TFLOPs, 312);

  for (const char* bad : {"0", "-5", "\"fast\"", "2e6"}) {
    const std::string text =
        std::string(R"({"device": {"name": "X", "memory_GiB": 10, "bf16_TFLOPs": 100,
                    "memory_GBps": 900, "peak_bf16_TFLOPs": )") +
        bad + "}}";
    auto r = ParseMachineProfile(text, "bad");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("device.peak_bf16_TFLOPs"), std::string::npos)
        << r.status().message();
  }
}

TEST(MachineProfilePeak, CommittedH200ProfileHasTheDatasheetPeak) {
  auto p = ReadMachineProfile(std::string(STRATA_SOURCE_DIR) + "/bench/machines/h200.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(p->device.has_value());
  EXPECT_EQ(p->device->peak_bf16_TFLOPs, DatasheetPeakBf16Tflops(p->device->name));
  EXPECT_EQ(p->device->peak_bf16_TFLOPs, 989);
}

}  // namespace
}  // namespace strata::engine
