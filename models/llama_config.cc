#include "models/llama_config.h"

#include <fmt/format.h>

namespace strata::models {
namespace {

std::vector<LlamaTensor> Lay(std::vector<std::pair<std::string, std::vector<int64_t>>> specs) {
  std::vector<LlamaTensor> out;
  int64_t offset = 0;
  for (auto& [name, shape] : specs) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({std::move(name), offset, shape, n});
    offset += n;
  }
  return out;
}

}  // namespace

Status ValidateLlamaConfig(const LlamaConfig& c) {
  auto positive = [](const char* name, double v) -> Status {
    if (v > 0) return Status::Ok();
    return InvalidArgumentError(fmt::format("config field {} = {} must be positive", name, v));
  };
  STRATA_RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  STRATA_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  STRATA_RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  STRATA_RETURN_IF_ERROR(positive("num_hidden_layers", c.num_layers));
  STRATA_RETURN_IF_ERROR(positive("num_attention_heads", c.num_heads));
  STRATA_RETURN_IF_ERROR(positive("num_key_value_heads", c.num_kv_heads));
  STRATA_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  STRATA_RETURN_IF_ERROR(positive("max_position_embeddings", c.max_seq_len));
  STRATA_RETURN_IF_ERROR(positive("rms_norm_eps", c.rms_norm_eps));
  STRATA_RETURN_IF_ERROR(positive("rope_theta", c.rope_theta));
  if (c.num_heads % c.num_kv_heads != 0) {
    return InvalidArgumentError(
        fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    c.num_heads, c.num_kv_heads));
  }
  if (c.head_dim % 2 != 0) {
    return InvalidArgumentError(
        fmt::format("head_dim {} must be even (rotary embeddings rotate pairs)", c.head_dim));
  }
  if (c.rope_llama3) {
    if (!(c.rope_factor >= 1.0) || !(c.rope_low_freq_factor > 0) ||
        !(c.rope_high_freq_factor > c.rope_low_freq_factor) || c.rope_original_max_position <= 0) {
      return InvalidArgumentError(fmt::format(
          "rope_scaling (llama3) needs factor >= 1, high_freq_factor > low_freq_factor > 0 and "
          "original_max_position_embeddings > 0; got factor {}, low_freq_factor {}, "
          "high_freq_factor {}, original_max_position_embeddings {}",
          c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
          c.rope_original_max_position));
    }
  }
  return Status::Ok();
}

std::vector<LlamaTensor> LlamaEmbeddingTensors(const LlamaConfig& c) {
  return Lay({{"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}}});
}

std::vector<LlamaTensor> LlamaLayerTensors(const LlamaConfig& c, int layer) {
  const std::string p = fmt::format("model.layers.{}.", layer);
  const int64_t C = c.hidden_size, I = c.intermediate_size;
  const int64_t q = int64_t{c.num_heads} * c.head_dim, kv = int64_t{c.num_kv_heads} * c.head_dim;
  return Lay({{p + "input_layernorm.weight", {C}},
              {p + "self_attn.q_proj.weight", {q, C}},
              {p + "self_attn.k_proj.weight", {kv, C}},
              {p + "self_attn.v_proj.weight", {kv, C}},
              {p + "self_attn.o_proj.weight", {C, q}},
              {p + "post_attention_layernorm.weight", {C}},
              {p + "mlp.gate_proj.weight", {I, C}},
              {p + "mlp.up_proj.weight", {I, C}},
              {p + "mlp.down_proj.weight", {C, I}}});
}

std::vector<LlamaTensor> LlamaHeadTensors(const LlamaConfig& c) {
  if (c.tie_embeddings) return Lay({{"model.norm.weight", {c.hidden_size}}});
  return Lay(
      {{"model.norm.weight", {c.hidden_size}}, {"lm_head.weight", {c.vocab_size, c.hidden_size}}});
}

}  // namespace strata::models
