// The shape and hyper-parameters of a Llama-architecture decoder (Touvron et al., "LLaMA: Open
// and Efficient Foundation Language Models", 2023; "Llama 2", 2023), with the semantics of Hugging
// Face's LlamaForCausalLM (and MistralForCausalLM without a sliding window): RMSNorm (Zhang &
// Sennrich, 2019), rotary position embeddings in the rotate-half convention (Su et al.,
// "RoFormer", 2021) with optional Llama-3 frequency scaling, a SwiGLU MLP (Shazeer, "GLU Variants
// Improve Transformer", 2020), grouped-query attention (Ainslie et al., "GQA", 2023), no biases.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::models {

struct LlamaConfig {
  int vocab_size = 32000;
  int hidden_size = 0;        // C
  int intermediate_size = 0;  // I: the SwiGLU hidden width
  int num_layers = 0;         // num_hidden_layers
  int num_heads = 0;          // H: num_attention_heads
  int num_kv_heads = 0;       // Hkv: num_key_value_heads; H % Hkv == 0
  int head_dim = 0;           // hs; Hugging Face default hidden_size / num_attention_heads
  int max_seq_len = 0;        // max_position_embeddings
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // rope_scaling {"rope_type": "llama3", ...} (Llama 3.1): frequencies below
  // original_max_position_embeddings / low_freq_factor wavelengths are divided by factor,
  // above / high_freq_factor kept, smoothly blended in between (transformers
  // modeling_rope_utils._compute_llama3_parameters).
  bool rope_llama3 = false;
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int rope_original_max_position = 8192;
  bool tie_embeddings = false;  // tie_word_embeddings
};

// kInvalidArgument naming the field and its value when a field is out of range: every size
// positive, num_heads % num_kv_heads == 0, head_dim even, eps > 0, theta > 0, llama3 factors
// with factor >= 1 and high_freq_factor > low_freq_factor > 0.
Status ValidateLlamaConfig(const LlamaConfig& config);

// Element offsets inside a block's chunk, in Hugging Face's tensor order and shapes (row-major,
// nn.Linear weights as (out, in)):
//   embedding: model.embed_tokens.weight (V, C)
//   layer i:   input_layernorm.weight (C), self_attn.q_proj.weight (H hs, C),
//              self_attn.k_proj.weight (Hkv hs, C), self_attn.v_proj.weight (Hkv hs, C),
//              self_attn.o_proj.weight (C, H hs), post_attention_layernorm.weight (C),
//              mlp.gate_proj.weight (I, C), mlp.up_proj.weight (I, C), mlp.down_proj.weight (C, I)
//              (names prefixed "model.layers.{i}.")
//   head:      model.norm.weight (C), then lm_head.weight (V, C) unless tied (then the head
//              reads model.embed_tokens.weight from the embedding chunk)
struct LlamaTensor {
  std::string name;  // Hugging Face name
  int64_t offset = 0;
  std::vector<int64_t> shape;
  int64_t num_elems = 0;
};
std::vector<LlamaTensor> LlamaEmbeddingTensors(const LlamaConfig& c);
std::vector<LlamaTensor> LlamaLayerTensors(const LlamaConfig& c, int layer);
std::vector<LlamaTensor> LlamaHeadTensors(const LlamaConfig& c);

}  // namespace strata::models
