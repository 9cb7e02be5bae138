// The shape and hyper-parameters of a Llama-architecture decoder (Touvron et al., "LLaMA: Open
// and Efficient Foundation Language Models", 2023; "Llama 2", 2023), with the semantics of Hugging
// Face's LlamaForCausalLM: RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings in the
// rotate-half convention (Su et al., "RoFormer", 2021) with optional Llama-3 frequency scaling, a
// SwiGLU MLP (Shazeer, "GLU Variants Improve Transformer", 2020), grouped-query attention
// (Ainslie et al., "GQA", 2023).
//
// The families built on that layer are the same config with options (LlamaArch names which one;
// it decides the tensor names and the config.json written back):
//   Mistral (MistralForCausalLM): sliding-window attention on every layer (Jiang et al.,
//     "Mistral 7B", 2023).
//   Qwen2 / Qwen2.5 (Qwen2ForCausalLM): biases on q_proj, k_proj, v_proj; sliding windows on the
//     layers from max_window_layers when use_sliding_window.
//   Qwen3 (Qwen3ForCausalLM): an RMSNorm over each head of q and k (q_norm, k_norm: (head_dim)
//     weights) after the projections and before RoPE; head_dim * heads may differ from hidden.
//   Phi-3 / Phi-4 (Phi3ForCausalLM): q/k/v stored as one qkv_proj and gate/up as one
//     gate_up_proj (the chunk already holds them fused, so only the names differ); a sliding
//     window on every layer when sliding_window is set.
//   Llama with attention_bias: biases on q, k, v and o.
//   Gemma 2 (Gemma2ForCausalLM; Gemma Team, "Gemma 2: Improving Open Language Models at a
//     Practical Size", 2024): Gemma 3's layer without q/k norms, one RoPE base for every layer,
//     sliding windows on the even layers, and soft-capping of the attention scores and of the
//     final logits (c tanh(x / c)).
//   Gemma 3 (Gemma3ForCausalLM, gemma3_text; Gemma Team, "Gemma 3 Technical Report", 2025): every
//     RMSNorm multiplies by (1 + w); the embedding output times sqrt(hidden); per-head q/k norms;
//     sandwich norms (the attention and MLP outputs normalised before their residual adds, a
//     pre-MLP norm named pre_feedforward_layernorm); a GeGLU MLP (tanh GELU); scores scaled by
//     query_pre_attn_scalar^-1/2; sliding layers with their own RoPE base, full layers with
//     rope_theta and linear rope scaling.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/ops/rope.h"

namespace strata::models {

// Which Hugging Face family a LlamaConfig is: its model_type and architecture, tensor names and
// config.json.
enum class LlamaArch { kLlama, kMistral, kQwen2, kQwen3, kPhi3, kGemma2, kGemma3 };

// "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"; and the architecture
// ("LlamaForCausalLM", ...).
const char* LlamaArchModelType(LlamaArch arch);
const char* LlamaArchArchitecture(LlamaArch arch);
// "Llama", "Mistral", "Qwen2", "Qwen3", "Phi-3", "Gemma 2", "Gemma 3" (for plan and description
// text).
const char* LlamaArchName(LlamaArch arch);

struct LlamaConfig {
  LlamaArch arch = LlamaArch::kLlama;
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
  bool qkv_bias = false;        // biases on q_proj, k_proj, v_proj (Qwen2; attention_bias)
  bool o_bias = false;          // a bias on o_proj (attention_bias of Llama and Qwen3)
  bool qk_norm = false;         // Qwen3's q_norm and k_norm: RMSNorm over each head of q and k
  // Sliding-window attention: query i sees key j when i - w < j <= i (transformers'
  // sliding-window causal mask), on the layers whose sliding_layers entry is true (empty: no
  // layer). 0: none.
  int sliding_window = 0;
  std::vector<bool> sliding_layers;
  // rope_scaling {"rope_type": "linear", "factor": f}: every frequency / f (on the full-attention
  // layers when the sliding ones have their own base). 1: none.
  double rope_linear_factor = 1.0;
  // The sliding layers' RoPE base (Gemma 3's rope_local_base_freq, unscaled); 0: rope_theta and
  // its scaling, as the full layers.
  double rope_local_theta = 0;
  // partial_rotary_factor (Phi-4-mini): only the first int(head_dim * factor) columns of each head
  // turn (LlamaRotaryDim); 1: all.
  double partial_rotary_factor = 1.0;
  // rope_scaling {"type": "longrope", "short_factor", "long_factor"} (Phi-3 128k, Phi-3.5,
  // Phi-4-mini; transformers _compute_longrope_parameters): each frequency divided by its factor,
  // the short ones while a forward's sequence is at most rope_original_max_position tokens, the
  // long ones past it (as transformers switches on the longest position), and cos and sin times
  // rope_attention_factor. Both empty: no LongRoPE; else rotary dim / 2 each.
  std::vector<double> rope_short_factor, rope_long_factor;
  double rope_attention_factor = 1.0;
  bool norm_unit_offset = false;  // every RMSNorm (q/k and final too) multiplies by (1 + w)
  // post_attention_layernorm normalises the attention output before its residual add,
  // pre_feedforward_layernorm is the MLP's input norm and post_feedforward_layernorm normalises
  // the MLP output before its residual add (Gemma 2/3).
  bool sandwich_norms = false;
  bool gelu_tanh_mlp = false;  // GeGLU: gelu_pytorch_tanh(gate) * up instead of SwiGLU
  double embed_scale = 1.0;    // the embedding's output times this, rounded to the storage type
  // Attention scores times query_pre_attn_scalar^-1/2 (Gemma); 0: 1 / sqrt(head_dim).
  double query_pre_attn_scalar = 0;
  // Soft-capping (Gemma 2): each scaled attention score s becomes c tanh(s / c) before the
  // softmax (attn_logit_softcapping, ops::AttentionDims::softcap), and each logit of the head
  // the same with its own c (final_logit_softcapping: the loss, eval and generate all see the
  // capped logits). 0: none.
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
};

// The rotary embedding of `layer` (its base and scaling) for a forward over sequences of seq_len
// tokens (which of LongRoPE's factors apply; without LongRoPE seq_len changes nothing).
ops::RopeParams LlamaLayerRopeParams(const LlamaConfig& c, int layer, int seq_len = 0);

// The columns of each head that turn: int(head_dim * partial_rotary_factor), as transformers
// truncates it.
int LlamaRotaryDim(const LlamaConfig& c);

// LongRoPE's default attention factor (transformers): sqrt(1 + ln(s) / ln(original_max)) with
// s = max_position_embeddings / original_max, or 1 when s <= 1.
double LongRopeDefaultAttentionFactor(int max_position_embeddings, int original_max);

// The attention window of `layer` (0: full causal attention).
int LlamaLayerWindow(const LlamaConfig& c, int layer);

// kInvalidArgument naming the field and its value when a field is out of range: every size
// positive, num_heads % num_kv_heads == 0, head_dim even, eps > 0, theta > 0, llama3 factors
// with factor >= 1 and high_freq_factor > low_freq_factor > 0, sliding_window >= 0 and
// sliding_layers empty or one entry per layer (some true only with a window).
Status ValidateLlamaConfig(const LlamaConfig& config);

// Element offsets inside a block's chunk, Hugging Face's names and shapes (row-major, nn.Linear
// weights as (out, in)):
//   embedding: model.embed_tokens.weight (V, C)
//   layer i:   input_layernorm.weight (C), self_attn.q_proj.weight (H hs, C),
//              self_attn.k_proj.weight (Hkv hs, C), self_attn.v_proj.weight (Hkv hs, C),
//              [qkv_bias: self_attn.q_proj.bias (H hs), k_proj.bias (Hkv hs), v_proj.bias
//              (Hkv hs)], [qk_norm: self_attn.q_norm.weight (hs), self_attn.k_norm.weight (hs)],
//              self_attn.o_proj.weight (C, H hs), [o_bias: self_attn.o_proj.bias (C)],
//              post_attention_layernorm.weight (C) [sandwich_norms: then
//              pre_feedforward_layernorm.weight (C), the MLP's input norm, and
//              post_feedforward_layernorm.weight (C)], mlp.gate_proj.weight (I, C),
//              mlp.up_proj.weight (I, C), mlp.down_proj.weight (C, I)
//              (names prefixed "model.layers.{i}."). Phi-3 names the three q/k/v rows
//              self_attn.qkv_proj.weight ((H + 2 Hkv) hs, C) and gate/up mlp.gate_up_proj.weight
//              (2I, C): the same elements in the same order.
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

// Element offsets of the layer chunk's parts by role (the layout above; -1 for a part the config
// has not). wqkv is the (Dqkv, C) q/k/v matrix, bqkv its (Dqkv) bias, qk_norm the (2, hs)
// q_norm then k_norm weights, wgu the (2I, C) gate/up matrix. w_post is the MLP's input norm
// (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm); w_attn_out and w_mlp_out
// the sandwich norms (Gemma's post_attention_layernorm and post_feedforward_layernorm).
struct LlamaLayerOffsets {
  int64_t w_in = 0, wqkv = 0, bqkv = -1, qk_norm = -1, wo = 0, bo = -1, w_attn_out = -1, w_post = 0,
          w_mlp_out = -1, wgu = 0, wd = 0, total = 0;
};
LlamaLayerOffsets LlamaLayerOffsetsOf(const LlamaConfig& c);

}  // namespace strata::models
