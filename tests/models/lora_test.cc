// LoRA (models/lora.h) on the Llama layer: the adapters' layout and errors, and the layer with
// adapters against the same layer with the adapters merged into its weights (W' = W + s B A,
// the same function without dropout) in double precision: outputs, input gradients, and the
// adapters' gradients from the merged weights' gradient (dB = s dW' A^T, dA = s B^T dW').
#include "models/lora.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "base/aligned_buffer.h"
#include "models/gpt_kernels.h"
#include "models/llama_config.h"
#include "models/llama_kernels.h"

namespace strata::models {
namespace {

LlamaConfig TinyLlama() {
  LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.max_seq_len = 8;
  c.rms_norm_eps = 1e-5;
  return c;
}

GptShape TinyGpt() {
  GptShape g;
  g.vocab_size = 64;
  g.max_seq_len = 8;
  g.num_layers = 1;
  g.num_heads = 2;
  g.channels = 8;
  return g;
}

TEST(LoraLayout, TargetsInTheFamilyOrderWithAThenB) {
  const LlamaConfig c = TinyLlama();
  LoraConfig lc{.rank = 3, .alpha = 6, .targets = {"down_proj", "q_proj", "v_proj"}};
  auto l = MakeLoraLayout(lc, LlamaLoraModules(c), "the Llama model");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ASSERT_EQ(l->sites.size(), 3u);
  EXPECT_EQ(l->sites[0].module.name, "q_proj");
  EXPECT_EQ(l->sites[1].module.name, "v_proj");
  EXPECT_EQ(l->sites[2].module.name, "down_proj");
  EXPECT_EQ(l->sites[0].a_offset, 0);
  EXPECT_EQ(l->sites[0].b_offset, 3 * 16);           // A_q (3, 16)
  EXPECT_EQ(l->sites[1].a_offset, 3 * 16 + 16 * 3);  // B_q (16, 3)
  EXPECT_EQ(l->sites[1].module.col, 16 + 8);         // after q (16) and k (8)
  EXPECT_EQ(l->layer_params, 3 * (16 + 16) + 3 * (16 + 8) + 3 * (24 + 16));
  EXPECT_FLOAT_EQ(l->scaling, 2.0f);
}

TEST(LoraLayout, BadSettingsAreOneLineErrorsNamingTheFlag) {
  const auto modules = LlamaLoraModules(TinyLlama());
  auto unknown = MakeLoraLayout({.rank = 4, .targets = {"c_attn"}}, modules, "the Llama model");
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("'c_attn'"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                            "down_proj"),
            std::string::npos)
      << unknown.status().message();
  EXPECT_EQ(MakeLoraLayout({.rank = 0, .targets = {"q_proj"}}, modules, "x").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeLoraLayout({.rank = 2, .targets = {"q_proj"}, .dropout = 1}, modules, "x")
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeLoraLayout({.rank = 2, .targets = {}}, modules, "x").status().code(),
            StatusCode::kInvalidArgument);
  // A negative alpha would flip the adapters' sign, 0 switch them off.
  for (const double alpha : {0.0, -8.0, double{NAN}, 1e300}) {
    const auto r = MakeLoraLayout({.rank = 2, .alpha = alpha, .targets = {"q_proj"}}, modules, "x");
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << alpha;
    EXPECT_NE(r.status().message().find("is not a positive number that fits fp32"),
              std::string::npos)
        << r.status().message();
  }
}

// PEFT's list rule (tuners_utils.check_target_module_exists): a module is adapted when its name
// equals a target or ends with "." + target; Strata adapts whole module names.
TEST(LoraLayout, TargetsSelectModulesByPeftsSuffixRule) {
  const auto llama = LlamaLoraModules(TinyLlama());
  const auto names = [&](std::vector<std::string> targets) {
    auto r = LoraTargetNames(targets, llama, "the Llama model", "--lora-targets");
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<std::string>{};
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names({"q_proj", "v_proj"}), (V{"q_proj", "v_proj"}));
  EXPECT_EQ(names({"self_attn.v_proj", "mlp.down_proj", "q_proj", "self_attn.q_proj"}),
            (V{"v_proj", "down_proj", "q_proj"}));
  auto layout = MakeLoraLayout({.rank = 2, .targets = {"self_attn.q_proj", "mlp.up_proj"}}, llama,
                               "the Llama model");
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  ASSERT_EQ(layout->sites.size(), 2u);
  EXPECT_EQ(layout->sites[0].module.name, "q_proj");
  EXPECT_EQ(layout->sites[1].module.name, "up_proj");
  // Not a suffix at a dot, a layer index (PEFT would adapt one layer), another family's path.
  for (const char* t : {"proj", "_proj", "layers.0.self_attn.q_proj", "mlp.q_proj", "self_attn"}) {
    const auto r = LoraTargetNames(std::vector<std::string>{t}, llama, "the Llama model",
                                   "x/adapter_config.json: target_modules");
    ASSERT_FALSE(r.ok()) << t;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(
        r.status().message(),
        std::string("x/adapter_config.json: target_modules: the Llama model has no module '") + t +
            "'; its modules are q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
  }
  // GPT-2 names two modules c_proj: a target that selects one of them is refused.
  const GptShape g = TinyGpt();
  const auto gpt = GptLoraModules(g);
  auto both =
      LoraTargetNames(std::vector<std::string>{"c_proj", "attn.c_attn"}, gpt, "the GPT", "t");
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  EXPECT_EQ(*both, (V{"c_proj", "c_attn"}));
  auto half = LoraTargetNames(std::vector<std::string>{"attn.c_proj"}, gpt, "the GPT", "t");
  ASSERT_FALSE(half.ok());
  EXPECT_EQ(half.status().message(),
            "t: 'attn.c_proj' selects attn.c_proj but not mlp.c_proj; Strata adapts every module "
            "named c_proj or none");
}

TEST(LoraLayout, InitialisationIsPeftsKaimingUniformAAndZeroB) {
  const LlamaConfig c = TinyLlama();
  auto l =
      MakeLoraLayout({.rank = 4, .targets = {"q_proj", "down_proj"}}, LlamaLoraModules(c), "x");
  ASSERT_TRUE(l.ok());
  std::vector<float> p(l->layer_params, NAN), again(l->layer_params);
  InitLoraLayer(*l, 1, 7, p.data());
  InitLoraLayer(*l, 1, 7, again.data());
  EXPECT_EQ(p, again);
  for (const LoraSite& s : l->sites) {
    const double bound = 1 / std::sqrt(static_cast<double>(s.module.in));
    double max_abs = 0;
    for (int64_t i = 0; i < 4 * s.module.in; ++i) {
      ASSERT_LT(std::abs(p[s.a_offset + i]), bound);
      max_abs = std::max(max_abs, static_cast<double>(std::abs(p[s.a_offset + i])));
    }
    EXPECT_GT(max_abs, 0.5 * bound);  // spread over the range, not a constant
    for (int64_t i = 0; i < s.module.out * 4; ++i) EXPECT_EQ(p[s.b_offset + i], 0.0f);
  }
}

// The element of a layer chunk that weight (row o, input i) of a site is: (out, in) rows
// [col, col + out) of the product's weight, or GPT-2's (in, product_out) columns.
int64_t WeightIndex(const LoraModule& m, int64_t o, int64_t i) {
  return m.weight_offset + (m.in_out ? i * m.product_out + m.col + o : (m.col + o) * m.in + i);
}

// base += s B A for every site, in double (A, B from the layer's adapter chunk).
template <typename T>
void MergeInDouble(const LoraLayout& l, const std::vector<T>& adapters, std::vector<double>* base) {
  for (const LoraSite& site : l.sites) {
    const LoraModule& m = site.module;
    for (int64_t o = 0; o < m.out; ++o) {
      for (int64_t i = 0; i < m.in; ++i) {
        double ba = 0;
        for (int64_t k = 0; k < l.rank; ++k) {
          ba += static_cast<double>(adapters[site.b_offset + o * l.rank + k]) *
                adapters[site.a_offset + k * m.in + i];
        }
        (*base)[WeightIndex(m, o, i)] += l.scaling * ba;
      }
    }
  }
}

TEST(LoraLayer, EqualsTheLayerWithMergedWeightsAndItsGradientsFollowTheChainRule) {
  const LlamaConfig c = TinyLlama();
  const LoraConfig lc{
      .rank = 3,
      .alpha = 5,
      .targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
  auto layout = MakeLoraLayout(lc, LlamaLoraModules(c), "the Llama model");
  ASSERT_TRUE(layout.ok());
  const int B = 2, T = 5;
  const int64_t N = B * T, C = c.hidden_size, P = LlamaLayerNumParams(c);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal(0, 0.3);
  std::vector<double> base(P), adapters(layout->layer_params), x(N * C), dy(N * C);
  for (auto* v : {&base, &adapters, &x, &dy}) {
    for (double& e : *v) e = normal(rng);
  }
  // The merged weights W' = W + s B A.
  const double s = layout->scaling;
  std::vector<double> merged = base;
  MergeInDouble(*layout, adapters, &merged);
  const int64_t layer_scratch = LlamaLayerScratchBytes<double>(c, B, T);
  auto scratch = AlignedBuffer::Allocate(
      (layer_scratch + 63) / 64 * 64 + LoraScratchBytes<double>(*layout, N), 64);
  ASSERT_TRUE(scratch.ok());
  LoraLayerArgs<double> lora;
  lora.layout = &*layout;
  lora.layer = 0;
  lora.adapters = adapters.data();
  lora.scratch = scratch->data() + (layer_scratch + 63) / 64 * 64;

  std::vector<double> y_lora(N * C), y_merged(N * C);
  LlamaLayerForward<double>(c, base.data(), x.data(), y_lora.data(), B, T, scratch->data(), lora);
  LlamaLayerForward<double>(c, merged.data(), x.data(), y_merged.data(), B, T, scratch->data());
  for (int64_t i = 0; i < N * C; ++i) {
    EXPECT_NEAR(y_lora[i], y_merged[i], 1e-12 * (1 + std::abs(y_merged[i]))) << i;
  }

  std::vector<double> dx_lora(N * C), dx_merged(N * C), dadapters(layout->layer_params, NAN),
      dmerged(P);
  lora.dadapters = dadapters.data();
  LlamaLayerBackward<double>(c, base.data(), x.data(), dy.data(), dx_lora.data(), nullptr, B, T,
                             scratch->data(), lora);
  LlamaLayerBackward<double>(c, merged.data(), x.data(), dy.data(), dx_merged.data(),
                             dmerged.data(), B, T, scratch->data());
  for (int64_t i = 0; i < N * C; ++i) {
    EXPECT_NEAR(dx_lora[i], dx_merged[i], 1e-11 * (1 + std::abs(dx_merged[i]))) << i;
  }
  // dB = s dW' A^T (out, r) and dA = s B^T dW' (r, in).
  for (const LoraSite& site : layout->sites) {
    SCOPED_TRACE(site.module.name);
    const int64_t in = site.module.in, out = site.module.out, r = layout->rank;
    const auto dw = [&](int64_t o, int64_t i) { return dmerged[WeightIndex(site.module, o, i)]; };
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < r; ++k) {
        double want = 0;
        for (int64_t i = 0; i < in; ++i) want += dw(o, i) * adapters[site.a_offset + k * in + i];
        want *= s;
        EXPECT_NEAR(dadapters[site.b_offset + o * r + k], want, 1e-10 * (1 + std::abs(want)));
      }
    }
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t i = 0; i < in; ++i) {
        double want = 0;
        for (int64_t o = 0; o < out; ++o) want += adapters[site.b_offset + o * r + k] * dw(o, i);
        want *= s;
        EXPECT_NEAR(dadapters[site.a_offset + k * in + i], want, 1e-10 * (1 + std::abs(want)));
      }
    }
  }
}

TEST(LoraLayer, GptLayerEqualsTheLayerWithMergedConv1DWeights) {
  // GPT-2's base weights are (in, out) (Conv1D); MergeLoraLayer adds s B A transposed into
  // them. The layer with adapters equals the layer with the merged weights (double precision),
  // and MergeLoraLayer (fp32) is that merge rounded once per weight.
  const GptShape g = TinyGpt();
  auto layout = MakeLoraLayout({.rank = 2, .alpha = 3, .targets = {"c_attn", "c_proj", "c_fc"}},
                               GptLoraModules(g), "the GPT");
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  ASSERT_EQ(layout->sites.size(), 4u);  // c_proj names the attention's and the MLP's
  const int B = 2, T = 5;
  const int64_t N = B * T, C = g.channels, P = LayerNumParams(g);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0, 0.3);
  std::vector<double> base(P), adapters(layout->layer_params), x(N * C), merged;
  for (auto* v : {&base, &adapters, &x}) {
    for (double& e : *v) e = normal(rng);
  }
  merged = base;
  MergeInDouble(*layout, adapters, &merged);
  const int64_t layer_scratch = GptLayerScratchBytes<double>(g, B, T);
  auto scratch = AlignedBuffer::Allocate(
      (layer_scratch + 63) / 64 * 64 + LoraScratchBytes<double>(*layout, N), 64);
  ASSERT_TRUE(scratch.ok());
  LoraLayerArgs<double> lora{.layout = &*layout,
                             .adapters = adapters.data(),
                             .scratch = scratch->data() + (layer_scratch + 63) / 64 * 64};
  std::vector<double> y_lora(N * C), y_merged(N * C);
  GptLayerForward<double>(g, base.data(), x.data(), y_lora.data(), B, T, scratch->data(), lora);
  GptLayerForward<double>(g, merged.data(), x.data(), y_merged.data(), B, T, scratch->data());
  for (int64_t i = 0; i < N * C; ++i) {
    EXPECT_NEAR(y_lora[i], y_merged[i], 1e-12 * (1 + std::abs(y_merged[i]))) << i;
  }
  std::vector<float> base32(base.begin(), base.end()), adapters32(adapters.begin(), adapters.end());
  std::vector<double> merged_from32(base32.begin(), base32.end());
  MergeInDouble(*layout, adapters32, &merged_from32);
  MergeLoraLayer(*layout, adapters32.data(), base32.data());
  for (int64_t i = 0; i < P; ++i) {
    ASSERT_EQ(base32[i], static_cast<float>(merged_from32[i])) << i;  // one rounding
  }
}

TEST(LoraDropout, MaskIsAFunctionOfSeedLayerSiteAndIndexWithRateP) {
  int kept = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) kept += LoraDropoutUniform(11, 2, 1, i) >= 0.25f;
  EXPECT_NEAR(kept / static_cast<double>(n), 0.75, 0.01);
  EXPECT_EQ(LoraDropoutUniform(11, 2, 1, 5), LoraDropoutUniform(11, 2, 1, 5));
  EXPECT_NE(LoraDropoutUniform(11, 2, 1, 5), LoraDropoutUniform(12, 2, 1, 5));
  EXPECT_NE(LoraDropoutUniform(11, 2, 1, 5), LoraDropoutUniform(11, 3, 1, 5));
  EXPECT_NE(LoraDropoutUniform(11, 2, 1, 5), LoraDropoutUniform(11, 2, 2, 5));
}

}  // namespace
}  // namespace strata::models
