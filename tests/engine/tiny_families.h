// The tiny Hugging Face family models the engine's offload tests train: a Llama with
// grouped-query attention (untied or tied head), a tied Qwen3 with every option of the Llama
// layer's families (q/k/v and o biases, per-head q/k norms, a sliding window shorter than the
// sequence on two of its four layers), a tied Gemma 3, a tied Gemma 2 with soft-capping, a tied
// Phi-4-mini-style partial rotary LongRoPE and a tied GPT-2, all over byte tokens.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "engine/plan/model.h"
#include "models/gpt.h"
#include "models/llama.h"

namespace strata::engine::testing {

inline models::LlamaConfig TinyLlama(bool tied) {
  models::LlamaConfig c;
  c.vocab_size = 256;  // the test tokens are bytes
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 6;
  c.max_seq_len = 16;
  c.rms_norm_eps = 1e-5;
  c.tie_embeddings = tied;
  return c;
}

// Qwen3 with attention_bias and Qwen2-style windows (5 tokens) on layers 1 and 3.
inline models::LlamaConfig TinyQwen3Window() {
  models::LlamaConfig c = TinyLlama(true);
  c.arch = models::LlamaArch::kQwen3;
  c.qkv_bias = c.o_bias = true;
  c.qk_norm = true;
  c.sliding_window = 5;
  c.sliding_layers = {false, true, false, true};
  return c;
}

// Gemma 3: (1 + w) and sandwich norms, GeGLU, q/k norms, a scaled embedding and query scale, a
// 5-token window with its own RoPE base on layers 0-2, layer 3 global with linear scaling.
inline models::LlamaConfig TinyGemma3() {
  models::LlamaConfig c = TinyLlama(true);
  c.arch = models::LlamaArch::kGemma3;
  c.qk_norm = c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  c.query_pre_attn_scalar = 8;
  c.rope_local_theta = 100;
  c.rope_linear_factor = 4;
  c.sliding_window = 5;
  c.sliding_layers = {true, true, true, false};
  return c;
}

// Gemma 2: Gemma 3's norms and MLP, no q/k norms, one RoPE base, the 5-token window on the even
// layers, soft-capped scores and logits (caps of the order of the tiny model's values, so that
// tanh bends).
inline models::LlamaConfig TinyGemma2() {
  models::LlamaConfig c = TinyGemma3();
  c.arch = models::LlamaArch::kGemma2;
  c.qk_norm = false;
  c.rope_local_theta = 0;
  c.rope_linear_factor = 1;
  c.sliding_layers = {true, false, true, false};
  c.attn_logit_softcapping = 1.5;
  c.final_logit_softcapping = 2.0;
  return c;
}

// Phi-4-mini's rotary embedding: RoPE on int(6 x 0.7) = 4 of each head's 6 columns with LongRoPE
// from an original 8 positions (the short factors up to 8 tokens, the long ones past it) and its
// attention factor; fused q/k/v and gate/up are only names, so this is the Llama layer otherwise.
inline models::LlamaConfig TinyPhi4MiniLongRope() {
  models::LlamaConfig c = TinyLlama(true);
  c.arch = models::LlamaArch::kPhi3;
  c.partial_rotary_factor = 0.7;
  c.rope_original_max_position = 8;
  c.rope_short_factor = {1.0, 1.8};
  c.rope_long_factor = {2.5, 9.0};
  c.rope_attention_factor = models::LongRopeDefaultAttentionFactor(c.max_seq_len, 8);
  return c;
}

struct Family {
  const char* name;
  std::function<std::unique_ptr<Model>()> make;
};

// "llama" (untied, when with_untied), "llama_tied", "qwen3_window", "gemma3", "gemma2",
// "phi4_mini_longrope", "gpt2_tied".
inline std::vector<Family> TinyFamilies(bool with_untied = true) {
  std::vector<Family> all;
  if (with_untied) {
    all.push_back({"llama", [] {
                     return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyLlama(false)));
                   }});
  }
  all.push_back({"llama_tied", [] {
                   return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyLlama(true)));
                 }});
  all.push_back({"qwen3_window", [] {
                   return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyQwen3Window()));
                 }});
  all.push_back(
      {"gemma3", [] { return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyGemma3())); }});
  all.push_back(
      {"gemma2", [] { return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyGemma2())); }});
  all.push_back(
      {"phi4_mini_longrope",
       [] { return std::unique_ptr<Model>(*models::LlamaModel::Create(TinyPhi4MiniLongRope())); }});
  all.push_back({"gpt2_tied", [] {
                   models::GptShape s{256, 16, 5, 2, 32};
                   s.tie_embeddings = true;
                   return std::unique_ptr<Model>(*models::GptModel::Create(s));
                 }});
  return all;
}

}  // namespace strata::engine::testing
