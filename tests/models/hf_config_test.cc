#include "models/hf_config.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "models/gpt.h"
#include "models/lora_adapter.h"
#include "tests/models/hf_test_dir.h"

namespace strata::models {
namespace {

using ::testing::AllOf;
using testing::Gpt2ConfigText;
using testing::Gpt2TestShape;
using ::testing::HasSubstr;
using testing::LlamaConfigText;
using testing::LlamaTestShape;
using ::testing::Not;

constexpr char kPath[] = "/m/config.json";

// Every config error is one line naming the file and the field.
void ExpectOneLineError(const StatusOr<HfModelConfig>& r, const std::string& field) {
  ASSERT_FALSE(r.ok()) << "expected an error about " << field;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              AllOf(HasSubstr(kPath), HasSubstr(field), Not(HasSubstr("\n"))));
}

TEST(HfConfig, ParsesLlamaFieldsAndDefaults) {
  const auto r = ParseHfConfig(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8,
      "max_position_embeddings": 128})",
                               kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->family, HfModelConfig::Family::kLlama);
  const LlamaConfig& c = r->llama;
  EXPECT_EQ(c.vocab_size, 100);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 96);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 8);  // default = heads
  EXPECT_EQ(c.head_dim, 8);      // default hidden / heads
  EXPECT_EQ(c.max_seq_len, 128);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.rope_llama3);
  EXPECT_FALSE(c.tie_embeddings);
}

TEST(HfConfig, ParsesLlamaGqaExplicitHeadDimAndLlama3RopeScaling) {
  LlamaTestShape s;
  s.tied = true;
  const auto r =
      ParseHfConfig(LlamaConfigText(s, R"(, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const LlamaConfig& c = r->llama;
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_TRUE(c.rope_llama3);
  EXPECT_EQ(c.rope_factor, 32.0);
  EXPECT_EQ(c.rope_low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_original_max_position, 8192);
}

// A llama-family config.json of model_type `type` (and architectures [arch] unless empty) with
// the extra fields `extra` (", ...").
std::string FamilyConfig(std::string_view type, std::string_view arch, std::string_view extra) {
  const std::string archs =
      arch.empty() ? std::string() : fmt::format(R"("architectures": ["{}"], )", arch);
  return fmt::format(R"({{{}"model_type": "{}", "vocab_size": 101,
      "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256{}}})",
                     archs, type, extra);
}

std::vector<bool> SlidingLayers(const LlamaConfig& c) {
  std::vector<bool> v;
  for (int i = 0; i < c.num_layers; ++i) v.push_back(LlamaLayerWindow(c, i) > 0);
  return v;
}

TEST(HfConfig, MistralSlidingWindowCoversEveryLayer) {
  for (const char* window : {"null", "64", "100000"}) {
    const auto r = ParseHfConfig(FamilyConfig("mistral", "MistralForCausalLM",
                                              fmt::format(R"(, "sliding_window": {})", window)),
                                 kPath);
    ASSERT_TRUE(r.ok()) << window << ": " << r.status().ToString();
    EXPECT_EQ(r->family, HfModelConfig::Family::kLlama);
    EXPECT_EQ(r->llama.arch, LlamaArch::kMistral);
    EXPECT_EQ(r->llama.num_kv_heads, 2);
    const bool none = std::string_view(window) == "null";
    EXPECT_EQ(r->llama.sliding_window, none ? 0 : std::stoi(window));
    EXPECT_EQ(SlidingLayers(r->llama), std::vector<bool>(4, !none)) << window;
  }
  ExpectOneLineError(
      ParseHfConfig(FamilyConfig("mistral", "MistralForCausalLM", R"(, "sliding_window": 0)"),
                    kPath),
      "sliding_window");
}

// What a key left out means is the configuration class's default (transformers'
// MistralConfig, Qwen2Config, Qwen3Config, Phi3Config, Gemma3TextConfig), which is not always the
// same across families.
TEST(HfConfig, AbsentKeysTakeTheirFamilysDefaults) {
  // sliding_window: 4096 for Mistral, and for Qwen2/Qwen3 with use_sliding_window; null is none.
  auto r = ParseHfConfig(FamilyConfig("mistral", "MistralForCausalLM", ""), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.sliding_window, 4096);
  EXPECT_EQ(SlidingLayers(r->llama), std::vector<bool>(4, true));
  for (const char* type : {"qwen2", "qwen3"}) {
    r = ParseHfConfig(FamilyConfig(type, "", R"(, "head_dim": 8, "use_sliding_window": true,
        "max_window_layers": 1)"),
                      kPath);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->llama.sliding_window, 4096) << type;
    EXPECT_EQ(SlidingLayers(r->llama), (std::vector<bool>{false, true, true, true})) << type;
  }
  r = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", ""), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.sliding_window, 0);  // Phi3Config's default is None
  // rms_norm_eps: Phi3Config's is 1e-5, the others' 1e-6.
  EXPECT_EQ(r->llama.rms_norm_eps, 1e-5);
  for (const char* type : {"llama", "mistral", "qwen2", "qwen3"}) {
    r = ParseHfConfig(FamilyConfig(type, "", R"(, "head_dim": 8)"), kPath);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->llama.rms_norm_eps, 1e-6) << type;
  }
  // head_dim: Qwen3Config's is 128 whatever the width; the others' hidden / heads.
  r = ParseHfConfig(FamilyConfig("qwen3", "Qwen3ForCausalLM", ""), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.head_dim, 128);
  r = ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM", ""), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.head_dim, 8);
  // Gemma's sliding layers need a window: null is refused, not read as the default.
  ExpectOneLineError(
      ParseHfConfig(FamilyConfig("gemma3_text", "", R"(, "sliding_window": null)"), kPath),
      "sliding_window");
}

// transformers 5's rope_parameters decides; an older rope_theta or rope_scaling beside it must
// say the same (before, a top-level rope_theta made the reader skip rope_parameters' scaling).
TEST(HfConfig, RopeParametersDecideAndTheOlderKeysMustAgree) {
  auto r = ParseHfConfig(FamilyConfig("mistral", "", R"(, "rope_theta": 10000.0,
      "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})"),
                         kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.rope_theta, 10000.0);
  EXPECT_EQ(r->llama.rope_linear_factor, 4.0);
  r = ParseHfConfig(FamilyConfig("mistral", "", R"(, "rope_theta": 10000.0,
      "rope_scaling": {"type": "linear", "factor": 4.0},
      "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.rope_linear_factor, 4.0);
  ExpectOneLineError(ParseHfConfig(FamilyConfig("mistral", "", R"(, "rope_theta": 500000.0,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0})"),
                                   kPath),
                     "rope_theta");
  ExpectOneLineError(ParseHfConfig(FamilyConfig("mistral", "", R"(,
      "rope_scaling": {"type": "linear", "factor": 2.0},
      "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})"),
                                   kPath),
                     "rope_scaling");
}

TEST(HfConfig, Qwen2HasQkvBiasesAndWindowsFromMaxWindowLayers) {
  auto r = ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                      R"(, "use_sliding_window": false, "sliding_window": 32,
      "max_window_layers": 2, "tie_word_embeddings": true, "rope_theta": 1000000.0)"),
                         kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.arch, LlamaArch::kQwen2);
  EXPECT_TRUE(r->llama.qkv_bias);
  EXPECT_FALSE(r->llama.o_bias);
  EXPECT_FALSE(r->llama.qk_norm);
  EXPECT_TRUE(r->llama.tie_embeddings);
  EXPECT_EQ(SlidingLayers(r->llama), std::vector<bool>(4, false));  // use_sliding_window false

  // As transformers' Qwen2Config derives layer_types: sliding from max_window_layers on.
  r = ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                 R"(, "use_sliding_window": true, "sliding_window": 32,
      "max_window_layers": 2)"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.sliding_window, 32);
  EXPECT_EQ(SlidingLayers(r->llama), (std::vector<bool>{false, false, true, true}));

  // An explicit layer_types wins.
  r = ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                 R"(, "use_sliding_window": true, "sliding_window": 32,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                      "full_attention"])"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(SlidingLayers(r->llama), (std::vector<bool>{true, false, true, false}));

  ExpectOneLineError(ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                                R"(, "layer_types": ["full_attention"])"),
                                   kPath),
                     "layer_types");
  ExpectOneLineError(
      ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                 R"(, "layer_types": ["full_attention", "chunked_attention",
                                    "full_attention", "full_attention"])"),
                    kPath),
      "layer_types[1]");
  ExpectOneLineError(ParseHfConfig(FamilyConfig("qwen2", "Qwen2ForCausalLM",
                                                R"(, "rope_scaling": {"type": "yarn",
          "factor": 4.0, "original_max_position_embeddings": 32768})"),
                                   kPath),
                     "remove rope_scaling");
}

TEST(HfConfig, Qwen3HasQkNormsAnOwnHeadDimAndOptionalBiases) {
  auto r = ParseHfConfig(
      FamilyConfig("qwen3", "Qwen3ForCausalLM", R"(, "head_dim": 16, "attention_bias": false)"),
      kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.arch, LlamaArch::kQwen3);
  EXPECT_TRUE(r->llama.qk_norm);
  EXPECT_EQ(r->llama.head_dim, 16);  // 4 heads x 16 = 64 != hidden 32
  EXPECT_FALSE(r->llama.qkv_bias);
  r = ParseHfConfig(
      FamilyConfig("qwen3", "Qwen3ForCausalLM", R"(, "head_dim": 16, "attention_bias": true)"),
      kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->llama.qkv_bias);
  EXPECT_TRUE(r->llama.o_bias);
  // transformers 5 writes rope_parameters instead of rope_theta.
  r = ParseHfConfig(FamilyConfig("qwen3", "Qwen3ForCausalLM",
                                 R"(, "rope_parameters": {"rope_type": "default",
      "rope_theta": 1000000.0})"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.rope_theta, 1e6);
  EXPECT_FALSE(r->llama.rope_llama3);
}

TEST(HfConfig, Phi3IsFusedAndRefusesDropout) {
  auto r = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM",
                                      R"(, "sliding_window": 48, "resid_pdrop": 0.0,
      "embd_pdrop": 0.0, "attention_dropout": 0.0, "original_max_position_embeddings": 256,
      "partial_rotary_factor": 1.0, "rope_scaling": null)"),
                         kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->llama.arch, LlamaArch::kPhi3);
  EXPECT_EQ(SlidingLayers(r->llama), std::vector<bool>(4, true));
  const std::vector<HfTensor> t = HfBlockTensors(*r, 1);
  std::vector<std::string> names;
  for (const HfTensor& x : t) names.push_back(x.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"}));
  EXPECT_EQ(t[1].shape, (std::vector<int64_t>{8 * 8, 32}));  // (H + 2 Hkv) hs = 8 x 8
  EXPECT_EQ(t[4].shape, (std::vector<int64_t>{2 * 48, 32}));

  ExpectOneLineError(
      ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", R"(, "resid_pdrop": 0.1)"), kPath),
      "resid_pdrop");
}

// Phi-4-mini's partial_rotary_factor and Phi-3.5's LongRoPE, as transformers' Phi3Config and
// _compute_longrope_parameters read them (head_dim 8 here).
TEST(HfConfig, Phi3ReadsPartialRotaryAndLongRope) {
  // int(8 x factor) columns turn, truncated as Python's int() does.
  for (const auto& [factor, dim] :
       {std::pair{"0.75", 6}, {"0.5", 4}, {"0.3", 2}, {"0.6", 4}, {"1.0", 8}}) {
    const auto r =
        ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM",
                                   fmt::format(R"(, "partial_rotary_factor": {})", factor)),
                      kPath);
    ASSERT_TRUE(r.ok()) << factor << ": " << r.status().ToString();
    EXPECT_EQ(LlamaRotaryDim(r->llama), dim) << factor;
    EXPECT_EQ(RopeRotaryDim(LlamaLayerRopeParams(r->llama, 0)), dim) << factor;
  }
  // transformers 5 saves it inside rope_parameters.
  const auto v5 = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", R"(, "rope_parameters":
      {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})"),
                                kPath);
  ASSERT_TRUE(v5.ok()) << v5.status().ToString();
  EXPECT_EQ(LlamaRotaryDim(v5->llama), 4);
  // 1e300: refused before head_dim x factor is cast to an int (UBSan's float-cast-overflow).
  for (const char* bad : {"0.1", "0.7", "0", "1.5", "1e300", "-1e300", "\"half\""}) {
    ExpectOneLineError(
        ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM",
                                   fmt::format(R"(, "partial_rotary_factor": {})", bad)),
                      kPath),
        "partial_rotary_factor");
  }

  // LongRoPE over the 6 rotated columns: 3 factors each; 256 positions over an original 64.
  const std::string longrope = R"(, "partial_rotary_factor": 0.75,
      "original_max_position_embeddings": 64, "rope_scaling": {"type": "longrope",
      "short_factor": [1.0, 1.5, 2.25], "long_factor": [3.0, 4.5, 6.75]})";
  const auto r = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", longrope), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const LlamaConfig& c = r->llama;
  EXPECT_EQ(c.rope_short_factor, (std::vector<double>{1.0, 1.5, 2.25}));
  EXPECT_EQ(c.rope_long_factor, (std::vector<double>{3.0, 4.5, 6.75}));
  EXPECT_EQ(c.rope_original_max_position, 64);
  // sqrt(1 + ln(256 / 64) / ln 64) = sqrt(1 + 1/3).
  EXPECT_DOUBLE_EQ(c.rope_attention_factor, std::sqrt(4.0 / 3.0));
  // The short factors while a forward's sequence fits the original 64 positions, the long past it.
  EXPECT_EQ(LlamaLayerRopeParams(c, 1, 64).ext_factors, c.rope_short_factor);
  EXPECT_EQ(LlamaLayerRopeParams(c, 1, 65).ext_factors, c.rope_long_factor);
  EXPECT_EQ(LlamaLayerRopeParams(c, 1, 65).attention_factor, c.rope_attention_factor);
  const std::vector<double> inv = RopeInverseFrequencies(LlamaLayerRopeParams(c, 0, 200));
  ASSERT_EQ(inv.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_DOUBLE_EQ(inv[i], 1.0 / (c.rope_long_factor[i] * std::pow(10000.0, 2.0 * i / 6)));
  }
  // "su" (the first Phi-3 configs), an explicit attention factor, and Phi3Config's default
  // original length of 4096 (here above max_position_embeddings: no scaling, factor 1).
  const auto su = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", R"(,
      "rope_scaling": {"type": "su", "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2],
      "attention_factor": 1.25})"),
                                kPath);
  ASSERT_TRUE(su.ok()) << su.status().ToString();
  EXPECT_EQ(su->llama.rope_original_max_position, 4096);
  EXPECT_EQ(su->llama.rope_attention_factor, 1.25);
  const auto none = ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", R"(,
      "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2]})"),
                                  kPath);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->llama.rope_attention_factor, 1.0);

  // Refused, each naming its key: factor lists of the wrong length or with a non-positive entry,
  // a factor other than the positions' ratio, longrope outside phi3.
  for (const auto& [extra, key] :
       {std::pair{R"(, "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                      "long_factor": [1, 1, 1, 1]})",
                  "rope_scaling.short_factor"},
        {R"(, "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1],
                      "long_factor": [1, 0, 1, 1]})",
         "rope_scaling.long_factor"},
        {R"(, "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1],
                      "long_factor": [1, 1, 1, 1], "factor": 4.0})",
         "rope_scaling.factor"},
        {R"(, "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1],
                      "long_factor": [1, 1, 1, 1], "attention_factor": -1})",
         "rope_scaling.attention_factor"}}) {
    ExpectOneLineError(ParseHfConfig(FamilyConfig("phi3", "Phi3ForCausalLM", extra), kPath), key);
  }
  ExpectOneLineError(ParseHfConfig(FamilyConfig("llama", "LlamaForCausalLM",
                                                R"(, "rope_scaling": {"type": "longrope",
          "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]})"),
                                   kPath),
                     "phi3 only");
}

TEST(HfConfig, Gemma3TextReadsItsNormsWindowsAndTwoRopeBases) {
  auto r = ParseHfConfig(FamilyConfig("gemma3_text", "Gemma3ForCausalLM",
                                      R"(, "head_dim": 16, "query_pre_attn_scalar": 24,
      "sliding_window": 8, "sliding_window_pattern": 2, "rope_theta": 1000000.0,
      "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
      "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": null,
      "final_logit_softcapping": null)"),
                         kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const LlamaConfig& c = r->llama;
  EXPECT_EQ(c.arch, LlamaArch::kGemma3);
  EXPECT_TRUE(c.norm_unit_offset && c.sandwich_norms && c.gelu_tanh_mlp && c.qk_norm);
  EXPECT_TRUE(c.tie_embeddings);  // Gemma3TextConfig's default
  EXPECT_DOUBLE_EQ(c.embed_scale, std::sqrt(32.0));
  EXPECT_EQ(c.query_pre_attn_scalar, 24);
  EXPECT_EQ(c.head_dim, 16);
  // Every second layer global: (i + 1) % 2 == 0.
  EXPECT_EQ(SlidingLayers(c), (std::vector<bool>{true, false, true, false}));
  const ops::RopeParams local = LlamaLayerRopeParams(c, 0), global = LlamaLayerRopeParams(c, 1);
  EXPECT_EQ(local.theta, 10000.0);
  EXPECT_EQ(local.linear_factor, 1.0);  // the sliding layers' RoPE is unscaled
  EXPECT_EQ(global.theta, 1e6);
  EXPECT_EQ(global.linear_factor, 8.0);
  // Written back with layer_types and, for transformers before 4.53, the pattern they follow;
  // query_pre_attn_scalar as the int transformers 5's config types it.
  const auto written = nlohmann::json::parse(HfConfigJson(*r));
  EXPECT_EQ(written["sliding_window_pattern"], 2);
  EXPECT_TRUE(written["query_pre_attn_scalar"].is_number_integer()) << written;
  EXPECT_EQ(written["query_pre_attn_scalar"], 24);
  auto without_types = written;
  without_types.erase("layer_types");
  auto back = ParseHfConfig(without_types.dump(), kPath);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(SlidingLayers(back->llama), SlidingLayers(c));
  // Layers that follow no pattern: layer_types alone.
  auto odd = ParseHfConfig(
      FamilyConfig("gemma3_text", "Gemma3ForCausalLM",
                   R"(, "head_dim": 16, "sliding_window": 8, "layer_types": ["full_attention",
          "sliding_attention", "sliding_attention", "full_attention"])"),
      kPath);
  ASSERT_TRUE(odd.ok()) << odd.status().ToString();
  EXPECT_FALSE(nlohmann::json::parse(HfConfigJson(*odd)).contains("sliding_window_pattern"));
  std::vector<std::string> names;
  for (const HfTensor& x : HfBlockTensors(*r, 1)) names.push_back(x.name);
  EXPECT_THAT(names, ::testing::Contains("model.layers.0.pre_feedforward_layernorm.weight"));
  EXPECT_THAT(names, ::testing::Contains("model.layers.0.post_feedforward_layernorm.weight"));
  EXPECT_THAT(names, ::testing::Contains("model.layers.0.self_attn.q_norm.weight"));

  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    ExpectOneLineError(ParseHfConfig(FamilyConfig("gemma3_text", "Gemma3ForCausalLM",
                                                  fmt::format(R"(, "{}": 50.0)", cap)),
                                     kPath),
                       cap);
  }
  ExpectOneLineError(ParseHfConfig(FamilyConfig("gemma3_text", "Gemma3ForCausalLM",
                                                R"(, "hidden_activation": "gelu")"),
                                   kPath),
                     "hidden_activation");
}

TEST(HfConfig, Gemma2ReadsItsSoftCapsAndEvenSlidingLayers) {
  // Gemma2Config's defaults: scores capped at 50, logits at 30, a 4096 window on layers 0, 2, ...
  auto r = ParseHfConfig(
      FamilyConfig("gemma2", "Gemma2ForCausalLM", R"(, "head_dim": 16, "query_pre_attn_scalar": 24,
      "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh")"),
      kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  LlamaConfig c = r->llama;
  EXPECT_EQ(c.arch, LlamaArch::kGemma2);
  EXPECT_TRUE(c.norm_unit_offset && c.sandwich_norms && c.gelu_tanh_mlp);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.embed_scale, std::sqrt(32.0));
  EXPECT_EQ(c.attn_logit_softcapping, 50.0);
  EXPECT_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(SlidingLayers(c), (std::vector<bool>{true, false, true, false}));
  // One RoPE base on every layer (10000 by default).
  EXPECT_EQ(LlamaLayerRopeParams(c, 0).theta, 10000.0);
  EXPECT_EQ(LlamaLayerRopeParams(c, 1).theta, 10000.0);
  std::vector<std::string> names;
  for (const HfTensor& x : HfBlockTensors(*r, 1)) names.push_back(x.name);
  EXPECT_THAT(names, ::testing::Contains("model.layers.0.pre_feedforward_layernorm.weight"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("model.layers.0.self_attn.q_norm.weight")));

  // null: no capping; layer_types as given.
  r = ParseHfConfig(FamilyConfig("gemma2", "Gemma2ForCausalLM",
                                 R"(, "attn_logit_softcapping": null,
      "final_logit_softcapping": 12.5, "sliding_window": 8, "layer_types": ["full_attention",
      "sliding_attention", "sliding_attention", "full_attention"])"),
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  c = r->llama;
  EXPECT_EQ(c.attn_logit_softcapping, 0.0);
  EXPECT_EQ(c.final_logit_softcapping, 12.5);
  EXPECT_EQ(SlidingLayers(c), (std::vector<bool>{false, true, true, false}));

  for (const char* bad :
       {R"(, "attn_logit_softcapping": -1.0)", R"(, "final_logit_softcapping": "30")",
        R"(, "attn_logit_softcapping": 0)"}) {
    ExpectOneLineError(ParseHfConfig(FamilyConfig("gemma2", "Gemma2ForCausalLM", bad), kPath),
                       "softcapping");
  }
  ExpectOneLineError(ParseHfConfig(FamilyConfig("gemma2", "Gemma2ForCausalLM",
                                                R"(, "use_bidirectional_attention": true)"),
                                   kPath),
                     "use_bidirectional_attention");
}

TEST(HfConfig, Gemma3ConditionalGenerationReadsItsTextConfig) {
  // The sizes left out of text_config take Gemma3TextConfig's defaults.
  const auto r = ParseHfConfig(R"({"architectures": ["Gemma3ForConditionalGeneration"],
      "model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
      "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
      "num_key_value_heads": 4, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}})",
                               kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->gemma3_multimodal);
  EXPECT_EQ(r->llama.arch, LlamaArch::kGemma3);
  EXPECT_EQ(r->llama.vocab_size, 262208);
  EXPECT_EQ(r->llama.head_dim, 256);
  EXPECT_EQ(r->llama.rope_linear_factor, 8.0);
  // Export writes the language model alone.
  EXPECT_EQ(nlohmann::json::parse(HfConfigJson(*r))["model_type"], "gemma3_text");
  // Token ids kept only in text_config go to the text model's top level; the top's win.
  const auto ids = ParseHfConfig(R"({"model_type": "gemma3", "eos_token_id": [1, 106],
      "text_config": {"model_type": "gemma3_text", "bos_token_id": 2, "eos_token_id": 1,
      "pad_token_id": 0}})",
                                 kPath);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  const auto written = nlohmann::json::parse(HfConfigJson(*ids));
  EXPECT_EQ(written["bos_token_id"], 2);
  EXPECT_EQ(written["pad_token_id"], 0);
  EXPECT_EQ(written["eos_token_id"], nlohmann::json::parse("[1, 106]"));
  const auto bad =
      ParseHfConfig(R"({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
      "final_logit_softcapping": 30.0}})",
                    kPath);
  ExpectOneLineError(bad, "final_logit_softcapping");
  EXPECT_THAT(bad.status().message(), HasSubstr("text_config"));
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "gemma3"})", kPath), "text_config");
}

TEST(HfConfig, LlamaAttentionBiasAddsQkvAndOBiases) {
  const auto r = ParseHfConfig(
      FamilyConfig("llama", "LlamaForCausalLM", R"(, "attention_bias": true)"), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->llama.qkv_bias);
  EXPECT_TRUE(r->llama.o_bias);
  std::vector<std::string> names;
  for (const HfTensor& x : HfBlockTensors(*r, 2)) names.push_back(x.name);
  EXPECT_THAT(names, ::testing::Contains("model.layers.1.self_attn.q_proj.bias"));
  EXPECT_THAT(names, ::testing::Contains("model.layers.1.self_attn.o_proj.bias"));
}

TEST(HfConfig, EveryFamilyRoundTripsThroughItsOwnConfigJson) {
  const std::pair<const char*, const char*> families[] = {
      {"llama", R"(, "attention_bias": true)"},
      {"mistral", R"(, "sliding_window": 64)"},
      {"qwen2", R"(, "use_sliding_window": true, "sliding_window": 32, "max_window_layers": 3,
                   "tie_word_embeddings": true)"},
      {"qwen3", R"(, "head_dim": 16, "attention_bias": true)"},
      {"phi3", R"(, "sliding_window": 48, "original_max_position_embeddings": 128)"},
      {"phi3", R"(, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                  "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.25],
                  "long_factor": [3.0, 4.5, 6.75], "attention_factor": 1.125})"},
      {"gemma3_text", R"(, "head_dim": 16, "query_pre_attn_scalar": 168, "sliding_window": 8,
                         "sliding_window_pattern": 3, "rope_scaling": {"rope_type": "linear",
                         "factor": 8.0}, "tie_word_embeddings": false)"},
      {"gemma2", R"(, "head_dim": 16, "query_pre_attn_scalar": 144, "sliding_window": 8,
                    "final_logit_softcapping": null)"}};
  for (const auto& [type, extra] : families) {
    SCOPED_TRACE(type);
    const auto a = ParseHfConfig(FamilyConfig(type, "", extra), kPath);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    const std::string text = HfConfigJson(*a);
    const nlohmann::json j = nlohmann::json::parse(text);
    EXPECT_EQ(j["model_type"], type);
    EXPECT_EQ(j["architectures"][0], LlamaArchArchitecture(a->llama.arch));
    const auto b = ParseHfConfig(text, kPath);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const LlamaConfig &x = a->llama, &y = b->llama;
    EXPECT_EQ(y.arch, x.arch);
    EXPECT_EQ(y.qkv_bias, x.qkv_bias);
    EXPECT_EQ(y.o_bias, x.o_bias);
    EXPECT_EQ(y.qk_norm, x.qk_norm);
    EXPECT_EQ(y.head_dim, x.head_dim);
    EXPECT_EQ(y.tie_embeddings, x.tie_embeddings);
    EXPECT_EQ(y.sliding_window, x.sliding_window);
    EXPECT_EQ(SlidingLayers(y), SlidingLayers(x));
    if (x.arch == LlamaArch::kPhi3) {
      EXPECT_EQ(j["original_max_position_embeddings"], x.rope_short_factor.empty() ? 128 : 64);
    }
    if (x.arch == LlamaArch::kQwen2) {
      // What transformers before 4.53 (no layer_types) reads: layers 3.. slide.
      EXPECT_EQ(j["max_window_layers"], 3);
      nlohmann::json old = j;
      old.erase("layer_types");
      const auto c = ParseHfConfig(old.dump(), kPath);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_EQ(SlidingLayers(c->llama), SlidingLayers(x));
    }
    EXPECT_EQ(y.partial_rotary_factor, x.partial_rotary_factor);
    EXPECT_EQ(y.rope_short_factor, x.rope_short_factor);
    EXPECT_EQ(y.rope_long_factor, x.rope_long_factor);
    EXPECT_EQ(y.rope_attention_factor, x.rope_attention_factor);
    EXPECT_EQ(y.rope_original_max_position, x.rope_original_max_position);
    EXPECT_EQ(y.norm_unit_offset, x.norm_unit_offset);
    EXPECT_EQ(y.sandwich_norms, x.sandwich_norms);
    EXPECT_EQ(y.gelu_tanh_mlp, x.gelu_tanh_mlp);
    EXPECT_EQ(y.embed_scale, x.embed_scale);
    EXPECT_EQ(y.query_pre_attn_scalar, x.query_pre_attn_scalar);
    EXPECT_EQ(y.rope_local_theta, x.rope_local_theta);
    EXPECT_EQ(y.rope_linear_factor, x.rope_linear_factor);
    EXPECT_EQ(y.attn_logit_softcapping, x.attn_logit_softcapping);
    EXPECT_EQ(y.final_logit_softcapping, x.final_logit_softcapping);
  }
}

TEST(HfConfig, ParsesGpt2FieldsAndTheOlderNCtx) {
  Gpt2TestShape s;
  s.tied = false;
  auto r = ParseHfConfig(Gpt2ConfigText(s), kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->family, HfModelConfig::Family::kGpt2);
  EXPECT_EQ(r->gpt2.vocab_size, 41);
  EXPECT_EQ(r->gpt2.channels, 12);
  EXPECT_EQ(r->gpt2.num_layers, 2);
  EXPECT_EQ(r->gpt2.num_heads, 3);
  EXPECT_EQ(r->gpt2.max_seq_len, 20);
  EXPECT_FALSE(r->gpt2.tie_embeddings);
  EXPECT_EQ(r->gpt2.layer_norm_eps, 1e-5);

  r = ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2,
      "n_ctx": 64, "layer_norm_epsilon": 1e-6, "activation_function": "gelu_pytorch_tanh"})",
                    kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->gpt2.max_seq_len, 64);
  EXPECT_EQ(r->gpt2.vocab_size, 50257);
  EXPECT_TRUE(r->gpt2.tie_embeddings);  // GPT-2's default
  EXPECT_EQ(r->gpt2.layer_norm_eps, 1e-6);
}

TEST(HfConfig, ArchitectureAloneSelectsTheFamily) {
  const auto r = ParseHfConfig(R"({"architectures": ["GPT2LMHeadModel"], "n_embd": 16,
      "n_layer": 1, "n_head": 2, "n_positions": 8})",
                               kPath);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->family, HfModelConfig::Family::kGpt2);
}

TEST(HfConfig, UnknownModelTypeListsTheSupportedOnes) {
  const auto r = ParseHfConfig(R"({"model_type": "bert", "hidden_size": 8})", kPath);
  ExpectOneLineError(r, "model_type");
  EXPECT_THAT(r.status().message(),
              AllOf(HasSubstr("bert"), HasSubstr("llama"), HasSubstr("mistral"), HasSubstr("qwen2"),
                    HasSubstr("qwen3"), HasSubstr("phi3"), HasSubstr("gpt2")));
  const auto a = ParseHfConfig(R"({"architectures": ["BertForMaskedLM"]})", kPath);
  ExpectOneLineError(a, "architectures");
  EXPECT_THAT(a.status().message(),
              AllOf(HasSubstr("LlamaForCausalLM"), HasSubstr("GPT2LMHeadModel")));
  ExpectOneLineError(
      ParseHfConfig(R"({"model_type": "llama", "architectures": ["GPT2LMHeadModel"]})", kPath),
      "architectures");
}

// Found by hf_config_json_fuzz: a name holding a JSON "\n" was quoted raw, a two-line message.
TEST(HfConfig, AnUnsupportedNameWithControlCharactersIsQuotedEscapedOnOneLine) {
  const auto a = ParseHfConfig(R"({"architectures": ["Llam\n_embdForCausalLM"]})", kPath);
  ExpectOneLineError(a, "architectures");
  EXPECT_THAT(a.status().message(), HasSubstr("Llam\\x0A_embd"));
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "bert\u0000\r"})", kPath), "model_type");
  ExpectOneLineError(
      ParseHfConfig(R"({"model_type": "gpt2", "architectures": ["GPT2\nHead"]})", kPath),
      "architectures");
}

TEST(HfConfig, MissingFieldIsNamed) {
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8})",
                                   kPath),
                     "intermediate_size");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 1,
      "n_head": 2})",
                                   kPath),
                     "n_ctx");
}

TEST(HfConfig, FieldsOutOfRangeAreNamed) {
  LlamaTestShape s;
  s.H = 4;
  s.Hkv = 3;  // 4 heads are not a multiple of 3 kv heads
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s), kPath), "num_key_value_heads");
  s = LlamaTestShape();
  s.C = 0;
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s), kPath), "hidden_size");
  s = LlamaTestShape();
  s.hs = 3;  // rotary embeddings need an even head_dim
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s), kPath), "head_dim");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10,
      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "max_position_embeddings": 8, "rms_norm_eps": -1})",
                                   kPath),
                     "rms_norm_eps");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10,
      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 99999999999,
      "num_attention_heads": 2, "max_position_embeddings": 8})",
                                   kPath),
                     "num_hidden_layers");
  // A layer count past 4096 is a damaged file: refused before anything per layer is made
  // (4444592 layers of a gemma3_text took 30 s to parse; INT_MAX would exhaust memory).
  for (const char* type : {"llama", "gemma3_text", "qwen2"}) {
    const auto r =
        ParseHfConfig(fmt::format(R"({{"model_type": "{}", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": {}, "num_attention_heads": 2,
            "head_dim": 4, "max_position_embeddings": 8}})",
                                  type, 4097),
                      kPath);
    ExpectOneLineError(r, "num_hidden_layers");
    EXPECT_THAT(r.status().message(), HasSubstr("out of range (1..4096"));
  }
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 2147483647,
      "n_head": 2, "n_positions": 8})",
                                   kPath),
                     "n_layer");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "llama", "vocab_size": "many"})", kPath),
                     "vocab_size");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 1,
      "n_head": 3, "n_positions": 8})",
                                   kPath),
                     "channels");
}

TEST(HfConfig, UnsupportedFeaturesAreNamed) {
  LlamaTestShape s;
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s, R"(, "mlp_bias": true)"), kPath), "mlp_bias");
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s, R"(, "attention_dropout": 0.1)"), kPath),
                     "attention_dropout");
  // A repeated key: the last one counts (nlohmann::json, like Python's json).
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s, R"(, "hidden_act": "gelu")"), kPath),
                     "hidden_act");
  const auto dynamic = ParseHfConfig(
      LlamaConfigText(s, R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"), kPath);
  ExpectOneLineError(dynamic, "rope_scaling");
  EXPECT_THAT(dynamic.status().message(), AllOf(HasSubstr("dynamic"), HasSubstr("llama3")));
  // Linear scaling (position interpolation) is read: every frequency / factor.
  const auto linear = ParseHfConfig(
      LlamaConfigText(s, R"(, "rope_scaling": {"type": "linear", "factor": 2.0})"), kPath);
  ASSERT_TRUE(linear.ok()) << linear.status().ToString();
  EXPECT_EQ(linear->llama.rope_linear_factor, 2.0);
  ExpectOneLineError(
      ParseHfConfig(LlamaConfigText(s, R"(, "rope_scaling": {"factor": 2.0})"), kPath),
      "rope_scaling");
  ExpectOneLineError(ParseHfConfig(LlamaConfigText(s, R"(, "rope_scaling": {"rope_type": "llama3",
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})"),
                                   kPath),
                     "rope_scaling.original_max_position_embeddings");
  // A "default" rope_type is transformers' spelling of no scaling.
  const auto plain =
      ParseHfConfig(LlamaConfigText(s, R"(, "rope_scaling": {"rope_type": "default"})"), kPath);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(plain->llama.rope_llama3);
  Gpt2TestShape g;
  ExpectOneLineError(
      ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2,
          "n_positions": 8, "activation_function": "relu"})",
                    kPath),
      "activation_function");
  ExpectOneLineError(ParseHfConfig(R"({"model_type": "gpt2", "n_embd": 16, "n_layer": 1,
      "n_head": 2, "n_positions": 8, "n_inner": 48})",
                                   kPath),
                     "n_inner");
  ExpectOneLineError(
      ParseHfConfig(Gpt2ConfigText(g, R"(, "scale_attn_by_inverse_layer_idx": true)"), kPath),
      "scale_attn_by_inverse_layer_idx");
}

TEST(HfConfig, NotJsonIsOneLineNamingTheFile) {
  const auto r = ParseHfConfig("{\"model_type\": \n", kPath);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr(kPath), Not(HasSubstr("\n"))));
}

// Issue 47: a number field holding 100,000 nested arrays crashed the error path, which dumped
// the value whole; it is refused at the parse, naming the file, the field and the limit.
TEST(HfConfig, ADeeplyNestedFieldIsOneShortLineNamingTheFieldAndTheLimit) {
  for (int depth : {30000, 100000}) {
    const auto r = ParseHfConfig(R"({"model_type": "llama", "vocab_size": )" +
                                     std::string(depth, '[') + std::string(depth, ']') + "}",
                                 kPath);
    ExpectOneLineError(r, "under /vocab_size/0/0/0/...");
    EXPECT_THAT(r.status().message(), HasSubstr("nested deeper than 64 levels (the limit)"));
    EXPECT_LT(r.status().message().size(), 300u);
  }
  // Within the limit the field's refusal quotes a bounded excerpt of the value.
  const auto r = ParseHfConfig(R"({"model_type": "llama", "vocab_size": )" + std::string(60, '[') +
                                   std::string(60, ']') + "}",
                               kPath);
  ExpectOneLineError(r, "vocab_size");
  EXPECT_LT(r.status().message().size(), 300u);
  const auto s = ParseHfConfig(
      R"({"model_type": "llama", "vocab_size": ")" + std::string(10 << 20, 'x') + "\"}", kPath);
  ExpectOneLineError(s, "vocab_size");
  EXPECT_LT(s.status().message().size(), 300u);
}

TEST(HfConfig, RealNumbersOutsideFp32AreRefusedNamingTheField) {
  const std::string head = R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "max_position_embeddings": 8, )";
  for (const char* field : {R"("rms_norm_eps": 5e-324})", R"("rms_norm_eps": 1e300})",
                            R"("rope_theta": 1e300})", R"("rope_theta": 0})"}) {
    const auto r = ParseHfConfig(head + field, kPath);
    ExpectOneLineError(r, std::string(field).substr(1, std::string(field).find('"', 1) - 1));
    EXPECT_THAT(r.status().message(), HasSubstr("fp32's normal range"));
  }
  ExpectOneLineError(
      ParseHfConfig(head + R"("rope_scaling": {"rope_type": "llama3", "factor": 1e300,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}})",
                    kPath),
      "rope_scaling.factor");
}

// adapter_config.json (models/lora_adapter.h): the numbers are checked before anything is sized
// from them, and every refusal names the file.
TEST(LoraAdapterConfig, OutOfRangeOrDeepValuesAreRefusedNamingTheFile) {
  constexpr char kAdapter[] = "/a/adapter_config.json";
  const std::string head = R"({"peft_type": "LORA", "target_modules": ["q_proj"], )";
  const auto ok = ParseLoraAdapterConfig(head + R"("r": 8, "lora_alpha": 16})", kAdapter);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->lora.rank, 8);
  // What PEFT writes when those options are off.
  const auto peft_off = ParseLoraAdapterConfig(
      head + R"("r": 8, "lora_alpha": 16, "modules_to_save": null, "lora_bias": false,
                "trainable_token_indices": null, "layer_replication": null,
                "use_qalora": false, "alora_invocation_tokens": null})",
      kAdapter);
  ASSERT_TRUE(peft_off.ok()) << peft_off.status().ToString();
  // Initialisations that leave the base weights as they are: A and B are read from the adapter.
  for (const char* init : {"true", "false", R"("gaussian")", R"("eva")", R"("orthogonal")"}) {
    const auto r = ParseLoraAdapterConfig(
        head + fmt::format(R"("r": 8, "lora_alpha": 16, "init_lora_weights": {}}})", init),
        kAdapter);
    EXPECT_TRUE(r.ok()) << init << ": " << r.status().ToString();
  }
  for (const auto& [fields, what] : std::vector<std::pair<std::string, std::string>>{
           {R"("r": 1099511627776, "lora_alpha": 16})", "r is 1099511627776, not an integer"},
           {R"("r": 0, "lora_alpha": 16})", "r is 0"},
           {R"("r": 8, "lora_alpha": 1e300})", "lora_alpha is 1e+300"},
           {R"("r": 8, "lora_alpha": 16, "lora_dropout": 1.5})", "lora_dropout is 1.5"},
           // PEFT options whose tensors are more than the A/B matrices: refused, not half-applied.
           {R"("r": 8, "lora_alpha": 16, "modules_to_save": ["lm_head"]})",
            "modules_to_save is [\"lm_head\"]"},
           {R"("r": 8, "lora_alpha": 16, "lora_bias": true})", "lora_bias is true"},
           {R"("r": 8, "lora_alpha": 16, "trainable_token_indices": [5, 6]})",
            "trainable_token_indices is [5,6]"},
           // Variants that compute something other than W + (alpha/r)·B·A, or fit a changed base.
           {R"("r": 8, "lora_alpha": 16, "use_qalora": true})", "use_qalora is true"},
           {R"("r": 8, "lora_alpha": 16, "alora_invocation_tokens": [151644, 77091]})",
            "alora_invocation_tokens is [151644,77091]"},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": "pissa"})",
            "init_lora_weights is \"pissa\", which changes the base weights"},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": "pissa_niter_16"})",
            "init_lora_weights is \"pissa_niter_16\""},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": "olora"})", "\"olora\""},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": "corda"})", "\"corda\""},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": "loftq"})", "\"loftq\""},
           {R"("r": 8, "lora_alpha": 16, "init_lora_weights": 3})", "init_lora_weights is 3"},
           {R"("r": )" + std::string(100000, '[') + std::string(100000, ']') + "}",
            "nested deeper than 64 levels (the limit) under /r/"}}) {
    const auto r = ParseLoraAdapterConfig(head + fields, kAdapter);
    ASSERT_FALSE(r.ok()) << fields.substr(0, 80);
    EXPECT_THAT(r.status().message(),
                AllOf(HasSubstr(kAdapter), HasSubstr(what), Not(HasSubstr("\n"))));
    EXPECT_LT(r.status().message().size(), 300u);
  }
}

TEST(HfConfig, ConfigJsonParsesBackToTheSameLlama) {
  LlamaTestShape s;
  s.tied = true;
  auto c = ParseHfConfig(LlamaConfigText(s, R"(, "rope_scaling": {"type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.5, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})"),
                         kPath);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const std::string text = HfConfigJson(*c, DType::kBF16);
  auto back = ParseHfConfig(text, "written");
  ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << text;
  const LlamaConfig &a = c->llama, &b = back->llama;
  EXPECT_EQ(back->family, HfModelConfig::Family::kLlama);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_llama3, b.rope_llama3);
  EXPECT_EQ(a.rope_factor, b.rope_factor);
  EXPECT_EQ(a.rope_low_freq_factor, b.rope_low_freq_factor);
  EXPECT_EQ(a.rope_high_freq_factor, b.rope_high_freq_factor);
  EXPECT_EQ(a.rope_original_max_position, b.rope_original_max_position);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(back->raw["torch_dtype"], "bfloat16");
  EXPECT_EQ(back->raw["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(back->raw["bos_token_id"], 1);
  EXPECT_EQ(back->raw["eos_token_id"], 2);
}

TEST(HfConfig, ConfigJsonParsesBackToTheSameGpt2) {
  for (bool tied : {true, false}) {
    Gpt2TestShape s;
    s.tied = tied;
    auto c = ParseHfConfig(Gpt2ConfigText(s), kPath);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    c->gpt2.layer_norm_eps = 3e-6;
    auto back = ParseHfConfig(HfConfigJson(*c, DType::kF16), "written");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->family, HfModelConfig::Family::kGpt2);
    const GptShape &a = c->gpt2, &b = back->gpt2;
    EXPECT_EQ(a.vocab_size, b.vocab_size);
    EXPECT_EQ(a.max_seq_len, b.max_seq_len);
    EXPECT_EQ(a.num_layers, b.num_layers);
    EXPECT_EQ(a.num_heads, b.num_heads);
    EXPECT_EQ(a.channels, b.channels);
    EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
    EXPECT_EQ(a.layer_norm_eps, b.layer_norm_eps);
    EXPECT_EQ(back->raw["torch_dtype"], "float16");
    EXPECT_EQ(back->raw["architectures"][0], "GPT2LMHeadModel");
  }
}

TEST(HfConfig, Gpt2PresetsHaveThePublishedShapesAndParameterCounts) {
  struct Want {
    const char* name;
    int layers, heads, channels;
    int64_t params;  // GPT2LMHeadModel.num_parameters() (tied)
  };
  for (const Want& w :
       {Want{"gpt2", 12, 12, 768, 124'439'808}, Want{"gpt2-medium", 24, 16, 1024, 354'823'168},
        Want{"gpt2-large", 36, 20, 1280, 774'030'080},
        Want{"gpt2-xl", 48, 25, 1600, 1'557'611'200}}) {
    auto g = Gpt2Preset(w.name);
    ASSERT_TRUE(g.ok()) << w.name;
    EXPECT_EQ(g->num_layers, w.layers);
    EXPECT_EQ(g->num_heads, w.heads);
    EXPECT_EQ(g->channels, w.channels);
    EXPECT_EQ(g->vocab_size, 50257);
    EXPECT_EQ(g->max_seq_len, 1024);
    EXPECT_TRUE(g->tie_embeddings);
    EXPECT_EQ(g->layer_norm_eps, 1e-5);
    HfModelConfig c;
    c.family = HfModelConfig::Family::kGpt2;
    c.gpt2 = *g;
    int64_t total = 0;
    for (int b = 0; b < HfNumBlocks(c); ++b) total += HfBlockNumParams(c, b);
    EXPECT_EQ(total, w.params) << w.name;
  }
  const auto bad = Gpt2Preset("gpt3");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), AllOf(HasSubstr("gpt3"), HasSubstr("gpt2-xl")));
}

TEST(HfConfig, Gpt2BlocksHaveTheGptModelChunkSizesTiedAndUntied) {
  for (bool tied : {false, true}) {
    Gpt2TestShape s;
    s.tied = tied;
    auto c = ParseHfConfig(Gpt2ConfigText(s), kPath);
    ASSERT_TRUE(c.ok());
    auto model = GptModel::Create(c->gpt2);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    ASSERT_EQ(HfNumBlocks(*c), (*model)->num_blocks());
    for (int b = 0; b < HfNumBlocks(*c); ++b) {
      EXPECT_EQ(HfBlockNumParams(*c, b), (*model)->block_num_params(b)) << tied << " " << b;
      EXPECT_EQ(HfBlockName(*c, b), (*model)->block_name(b));
    }
    EXPECT_EQ((*model)->tied_block(HfNumBlocks(*c) - 1), tied ? 0 : -1);
  }
}

}  // namespace
}  // namespace strata::models
