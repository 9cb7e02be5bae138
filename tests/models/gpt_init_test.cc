// Parameter layout, shape validation and initialisation of the GPT blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "models/gpt_kernels.h"

namespace strata::models {
namespace {

const TensorInfo& Find(const std::vector<TensorInfo>& tensors, const std::string& name) {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

void ExpectContiguous(const std::vector<TensorInfo>& tensors, int64_t total) {
  int64_t offset = 0;
  for (const TensorInfo& t : tensors) {
    EXPECT_EQ(t.offset, offset) << t.name;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    EXPECT_EQ(t.num_elems, n) << t.name;
    offset += t.num_elems;
  }
  EXPECT_EQ(offset, total);
}

std::vector<std::string> Names(const std::vector<TensorInfo>& tensors) {
  std::vector<std::string> names;
  for (const TensorInfo& t : tensors) names.push_back(t.name);
  return names;
}

TEST(GptShape, ValidateRejectsNonPositiveFieldsAndIndivisibleHeads) {
  EXPECT_TRUE(ValidateShape({256, 64, 4, 4, 128}).ok());
  EXPECT_EQ(ValidateShape({256, 64, 4, 3, 128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({0, 64, 4, 4, 128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({256, 0, 4, 4, 128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({256, 64, 0, 4, 128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({256, 64, 4, 0, 128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape({256, 64, 4, 4, -128}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateShape(GptShape{}).code(), StatusCode::kInvalidArgument);
}

TEST(GptShape, ChunkLayoutsAreContiguousInTheDocumentedOrder) {
  const GptShape s{50257, 1024, 12, 12, 768};
  const int64_t C = 768, V = 50257;
  EXPECT_EQ(Names(EmbeddingTensors(s)), (std::vector<std::string>{"wte", "wpe"}));
  EXPECT_EQ(Names(LayerTensors(s)),
            (std::vector<std::string>{"ln1_w", "ln1_b", "attn_qkv_w", "attn_qkv_b", "attn_proj_w",
                                      "attn_proj_b", "ln2_w", "ln2_b", "mlp_fc_w", "mlp_fc_b",
                                      "mlp_proj_w", "mlp_proj_b"}));
  EXPECT_EQ(Names(HeadTensors(s)), (std::vector<std::string>{"lnf_w", "lnf_b", "lm_head_w"}));
  EXPECT_EQ(EmbeddingNumParams(s), (V + 1024) * C);
  EXPECT_EQ(LayerNumParams(s), 12 * C * C + 13 * C);
  EXPECT_EQ(HeadNumParams(s), 2 * C + C * V);
  ExpectContiguous(EmbeddingTensors(s), EmbeddingNumParams(s));
  ExpectContiguous(LayerTensors(s), LayerNumParams(s));
  ExpectContiguous(HeadTensors(s), HeadNumParams(s));
  EXPECT_EQ(Find(LayerTensors(s), "attn_qkv_w").shape, (std::vector<int64_t>{C, 3 * C}));
  EXPECT_EQ(Find(LayerTensors(s), "mlp_proj_w").shape, (std::vector<int64_t>{4 * C, C}));
  EXPECT_EQ(Find(HeadTensors(s), "lm_head_w").shape, (std::vector<int64_t>{C, V}));
  EXPECT_EQ(Find(EmbeddingTensors(s), "wpe").shape, (std::vector<int64_t>{1024, C}));
}

struct Stats {
  double mean = 0, stddev = 0;
};

Stats StatsOf(const float* x, int64_t n) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / n;
  for (int64_t i = 0; i < n; ++i) sq += (x[i] - mean) * (x[i] - mean);
  return {mean, std::sqrt(sq / n)};
}

// A normal tensor of n samples: mean within 5 standard errors of 0, standard
// deviation within 2%.
void ExpectNormal(const std::vector<float>& chunk, const TensorInfo& t, double stddev) {
  const Stats st = StatsOf(chunk.data() + t.offset, t.num_elems);
  EXPECT_NEAR(st.mean, 0.0, 5 * stddev / std::sqrt(static_cast<double>(t.num_elems))) << t.name;
  EXPECT_NEAR(st.stddev, stddev, 0.02 * stddev) << t.name;
}

void ExpectConstant(const std::vector<float>& chunk, const TensorInfo& t, float value) {
  for (int64_t i = 0; i < t.num_elems; ++i) {
    ASSERT_EQ(chunk[t.offset + i], value) << t.name << "[" << i << "]";
  }
}

const GptShape kInitShape{1000, 128, 4, 4, 256};

TEST(GptInit, LayerFollowsGpt2StatisticsAndScalesResidualProjections) {
  const GptShape& s = kInitShape;
  std::vector<float> chunk(LayerNumParams(s), -7.0f);
  InitGptLayerParams(s, 2, 42, chunk.data());
  const std::vector<TensorInfo> t = LayerTensors(s);
  const double residual = 0.02 / std::sqrt(2.0 * s.num_layers);
  ExpectConstant(chunk, Find(t, "ln1_w"), 1.0f);
  ExpectConstant(chunk, Find(t, "ln1_b"), 0.0f);
  ExpectNormal(chunk, Find(t, "attn_qkv_w"), 0.02);
  ExpectConstant(chunk, Find(t, "attn_qkv_b"), 0.0f);
  ExpectNormal(chunk, Find(t, "attn_proj_w"), residual);
  ExpectConstant(chunk, Find(t, "attn_proj_b"), 0.0f);
  ExpectConstant(chunk, Find(t, "ln2_w"), 1.0f);
  ExpectConstant(chunk, Find(t, "ln2_b"), 0.0f);
  ExpectNormal(chunk, Find(t, "mlp_fc_w"), 0.02);
  ExpectConstant(chunk, Find(t, "mlp_fc_b"), 0.0f);
  ExpectNormal(chunk, Find(t, "mlp_proj_w"), residual);
  ExpectConstant(chunk, Find(t, "mlp_proj_b"), 0.0f);
}

TEST(GptInit, EmbeddingAndHeadFollowGpt2Statistics) {
  const GptShape& s = kInitShape;
  std::vector<float> emb(EmbeddingNumParams(s), -7.0f);
  InitGptEmbeddingParams(s, 42, emb.data());
  ExpectNormal(emb, Find(EmbeddingTensors(s), "wte"), 0.02);
  ExpectNormal(emb, Find(EmbeddingTensors(s), "wpe"), 0.02);
  std::vector<float> head(HeadNumParams(s), -7.0f);
  InitGptHeadParams(s, 42, head.data());
  ExpectConstant(head, Find(HeadTensors(s), "lnf_w"), 1.0f);
  ExpectConstant(head, Find(HeadTensors(s), "lnf_b"), 0.0f);
  ExpectNormal(head, Find(HeadTensors(s), "lm_head_w"), 0.02);
}

TEST(GptInit, IsAFunctionOfSeedAndBlock) {
  const GptShape& s = kInitShape;
  auto layer = [&](int index, uint64_t seed) {
    std::vector<float> chunk(LayerNumParams(s));
    InitGptLayerParams(s, index, seed, chunk.data());
    return chunk;
  };
  auto embedding = [&](uint64_t seed) {
    std::vector<float> chunk(EmbeddingNumParams(s));
    InitGptEmbeddingParams(s, seed, chunk.data());
    return chunk;
  };
  auto head = [&](uint64_t seed) {
    std::vector<float> chunk(HeadNumParams(s));
    InitGptHeadParams(s, seed, chunk.data());
    return chunk;
  };
  EXPECT_EQ(layer(1, 7), layer(1, 7));
  EXPECT_NE(layer(1, 7), layer(1, 8));
  EXPECT_NE(layer(1, 7), layer(2, 7));
  EXPECT_EQ(embedding(7), embedding(7));
  EXPECT_NE(embedding(7), embedding(8));
  EXPECT_EQ(head(7), head(7));
  EXPECT_NE(head(7), head(8));
  // Pinned values: mt19937_64 and the Box-Muller transform are fixed, so the
  // stream must not change with the standard library or a refactoring (the
  // tolerance allows only for libm's last-bit differences in log/sin/cos).
  const std::vector<float> e = embedding(7);
  EXPECT_NEAR(e[0], -0.0045537632f, 1e-8f);
  EXPECT_NEAR(e[1], -0.013631735f, 1e-8f);
  EXPECT_NEAR(e[2], 0.0278994665f, 1e-8f);
  const std::vector<float> l = layer(1, 7);
  const int64_t qkv = Find(LayerTensors(s), "attn_qkv_w").offset;
  EXPECT_NEAR(l[qkv], -0.00980890635f, 1e-8f);
  EXPECT_NEAR(l[qkv + 1], -0.034950994f, 1e-8f);
  const std::vector<float> h = head(7);
  const int64_t lm = Find(HeadTensors(s), "lm_head_w").offset;
  EXPECT_NEAR(h[lm], -0.0136636719f, 1e-8f);
  EXPECT_NEAR(h[lm + 1], 0.0262669437f, 1e-8f);
}

}  // namespace
}  // namespace strata::models
