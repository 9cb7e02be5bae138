#include "models/llama_config.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

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

const char* LlamaArchModelType(LlamaArch arch) {
  switch (arch) {
    case LlamaArch::kMistral:
      return "mistral";
    case LlamaArch::kQwen2:
      return "qwen2";
    case LlamaArch::kQwen3:
      return "qwen3";
    case LlamaArch::kPhi3:
      return "phi3";
    case LlamaArch::kGemma2:
      return "gemma2";
    case LlamaArch::kGemma3:
      return "gemma3_text";
    case LlamaArch::kLlama:
      break;
  }
  return "llama";
}

const char* LlamaArchArchitecture(LlamaArch arch) {
  switch (arch) {
    case LlamaArch::kMistral:
      return "MistralForCausalLM";
    case LlamaArch::kQwen2:
      return "Qwen2ForCausalLM";
    case LlamaArch::kQwen3:
      return "Qwen3ForCausalLM";
    case LlamaArch::kPhi3:
      return "Phi3ForCausalLM";
    case LlamaArch::kGemma2:
      return "Gemma2ForCausalLM";
    case LlamaArch::kGemma3:
      return "Gemma3ForCausalLM";
    case LlamaArch::kLlama:
      break;
  }
  return "LlamaForCausalLM";
}

const char* LlamaArchName(LlamaArch arch) {
  switch (arch) {
    case LlamaArch::kMistral:
      return "Mistral";
    case LlamaArch::kQwen2:
      return "Qwen2";
    case LlamaArch::kQwen3:
      return "Qwen3";
    case LlamaArch::kPhi3:
      return "Phi-3";
    case LlamaArch::kGemma2:
      return "Gemma 2";
    case LlamaArch::kGemma3:
      return "Gemma 3";
    case LlamaArch::kLlama:
      break;
  }
  return "Llama";
}

int LlamaRotaryDim(const LlamaConfig& c) {
  return static_cast<int>(c.head_dim * c.partial_rotary_factor);
}

double LongRopeDefaultAttentionFactor(int max_position_embeddings, int original_max) {
  const double s = static_cast<double>(max_position_embeddings) / original_max;
  if (s <= 1.0) return 1.0;
  return std::sqrt(1.0 + std::log(s) / std::log(static_cast<double>(original_max)));
}

ops::RopeParams LlamaLayerRopeParams(const LlamaConfig& c, int layer, int seq_len) {
  ops::RopeParams p;
  p.head_dim = c.head_dim;
  p.rotary_dim = LlamaRotaryDim(c) == c.head_dim ? 0 : LlamaRotaryDim(c);
  if (c.rope_local_theta > 0 && LlamaLayerWindow(c, layer) > 0) {
    p.theta = c.rope_local_theta;
    return p;
  }
  p.theta = c.rope_theta;
  p.llama3 = c.rope_llama3;
  p.factor = c.rope_factor;
  p.low_freq_factor = c.rope_low_freq_factor;
  p.high_freq_factor = c.rope_high_freq_factor;
  p.original_max_position = c.rope_original_max_position;
  p.linear_factor = c.rope_linear_factor;
  if (!c.rope_short_factor.empty()) {
    p.ext_factors =
        seq_len > c.rope_original_max_position ? c.rope_long_factor : c.rope_short_factor;
    p.attention_factor = c.rope_attention_factor;
  }
  return p;
}

int LlamaLayerWindow(const LlamaConfig& c, int layer) {
  if (c.sliding_window <= 0 || layer < 0 || layer >= static_cast<int>(c.sliding_layers.size())) {
    return 0;
  }
  return c.sliding_layers[layer] ? c.sliding_window : 0;
}

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
  const bool factor_ok = c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1;
  const int rotary = factor_ok ? LlamaRotaryDim(c) : 0;  // in range before the cast
  if (rotary < 2 || rotary % 2 != 0) {
    return InvalidArgumentError(
        fmt::format("partial_rotary_factor {} must be in (0, 1] and give an even rotary dim >= 2 "
                    "(head_dim {} x {} = {})",
                    c.partial_rotary_factor, c.head_dim, c.partial_rotary_factor, rotary));
  }
  if (!c.rope_short_factor.empty() || !c.rope_long_factor.empty()) {
    const auto factors_ok = [&](const std::vector<double>& v) {
      if (static_cast<int>(v.size()) != rotary / 2) return false;
      for (const double x : v) {
        if (!(x > 0) || !std::isfinite(x)) return false;
      }
      return true;
    };
    if (!factors_ok(c.rope_short_factor) || !factors_ok(c.rope_long_factor)) {
      return InvalidArgumentError(fmt::format(
          "rope_scaling (longrope) needs short_factor and long_factor of rotary dim / 2 = {} "
          "positive numbers each; got {} and {}",
          rotary / 2, c.rope_short_factor.size(), c.rope_long_factor.size()));
    }
    if (!(c.rope_attention_factor > 0) || !std::isfinite(c.rope_attention_factor) ||
        c.rope_original_max_position <= 0 || c.rope_llama3 || c.rope_linear_factor != 1.0) {
      return InvalidArgumentError(
          fmt::format("rope_scaling (longrope) needs a positive finite attention_factor (got {}), "
                      "original_max_position_embeddings > 0 (got {}) and no other RoPE scaling",
                      c.rope_attention_factor, c.rope_original_max_position));
    }
  }
  // A cap is divided by in fp32 on every backend: 0 (none) or a normal fp32 value.
  const auto cap_ok = [](double v) {
    return v == 0 ||
           (v >= std::numeric_limits<float>::min() && v <= std::numeric_limits<float>::max());
  };
  if (!cap_ok(c.attn_logit_softcapping) || !cap_ok(c.final_logit_softcapping)) {
    return InvalidArgumentError(
        fmt::format("attn_logit_softcapping {} and final_logit_softcapping {} must be 0 (none) or "
                    "a positive normal fp32 value",
                    c.attn_logit_softcapping, c.final_logit_softcapping));
  }
  if (!(c.rope_linear_factor > 0) || !(c.embed_scale > 0) || !(c.query_pre_attn_scalar >= 0) ||
      !(c.rope_local_theta >= 0)) {
    return InvalidArgumentError(fmt::format(
        "rope linear factor {}, embedding scale {}, query_pre_attn_scalar {} and local RoPE base "
        "{} must be positive (the last two 0: the default)",
        c.rope_linear_factor, c.embed_scale, c.query_pre_attn_scalar, c.rope_local_theta));
  }
  if (c.sliding_window < 0) {
    return InvalidArgumentError(
        fmt::format("sliding_window {} must be 0 (none) or positive", c.sliding_window));
  }
  if (!c.sliding_layers.empty() && static_cast<int64_t>(c.sliding_layers.size()) != c.num_layers) {
    return InvalidArgumentError(fmt::format("{} sliding-window layer flags for {} layers",
                                            c.sliding_layers.size(), c.num_layers));
  }
  return Status::Ok();
}

std::vector<LlamaTensor> LlamaEmbeddingTensors(const LlamaConfig& c) {
  return Lay({{"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}}});
}

std::vector<LlamaTensor> LlamaLayerTensors(const LlamaConfig& c, int layer) {
  const std::string p = fmt::format("model.layers.{}.", layer);
  const int64_t C = c.hidden_size, I = c.intermediate_size, hs = c.head_dim;
  const int64_t q = int64_t{c.num_heads} * hs, kv = int64_t{c.num_kv_heads} * hs;
  const bool fused = c.arch == LlamaArch::kPhi3;
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
      {p + "input_layernorm.weight", {C}}};
  if (fused) {
    specs.push_back({p + "self_attn.qkv_proj.weight", {q + 2 * kv, C}});
  } else {
    specs.push_back({p + "self_attn.q_proj.weight", {q, C}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, C}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, C}});
  }
  if (c.qkv_bias) {
    if (fused) {
      specs.push_back({p + "self_attn.qkv_proj.bias", {q + 2 * kv}});
    } else {
      specs.push_back({p + "self_attn.q_proj.bias", {q}});
      specs.push_back({p + "self_attn.k_proj.bias", {kv}});
      specs.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
  }
  if (c.qk_norm) {
    specs.push_back({p + "self_attn.q_norm.weight", {hs}});
    specs.push_back({p + "self_attn.k_norm.weight", {hs}});
  }
  specs.push_back({p + "self_attn.o_proj.weight", {C, q}});
  if (c.o_bias) specs.push_back({p + "self_attn.o_proj.bias", {C}});
  specs.push_back({p + "post_attention_layernorm.weight", {C}});
  if (c.sandwich_norms) {
    specs.push_back({p + "pre_feedforward_layernorm.weight", {C}});
    specs.push_back({p + "post_feedforward_layernorm.weight", {C}});
  }
  if (fused) {
    specs.push_back({p + "mlp.gate_up_proj.weight", {2 * I, C}});
  } else {
    specs.push_back({p + "mlp.gate_proj.weight", {I, C}});
    specs.push_back({p + "mlp.up_proj.weight", {I, C}});
  }
  specs.push_back({p + "mlp.down_proj.weight", {C, I}});
  return Lay(std::move(specs));
}

LlamaLayerOffsets LlamaLayerOffsetsOf(const LlamaConfig& c) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, hs = c.head_dim;
  const int64_t dqkv = int64_t{c.num_heads + 2 * c.num_kv_heads} * hs,
                dq = int64_t{c.num_heads} * hs;
  LlamaLayerOffsets o;
  int64_t at = 0;
  auto take = [&at](int64_t n) {
    const int64_t start = at;
    at += n;
    return start;
  };
  o.w_in = take(C);
  o.wqkv = take(dqkv * C);
  if (c.qkv_bias) o.bqkv = take(dqkv);
  if (c.qk_norm) o.qk_norm = take(2 * hs);
  o.wo = take(C * dq);
  if (c.o_bias) o.bo = take(C);
  if (c.sandwich_norms) {
    o.w_attn_out = take(C);  // post_attention_layernorm
    o.w_post = take(C);      // pre_feedforward_layernorm
    o.w_mlp_out = take(C);   // post_feedforward_layernorm
  } else {
    o.w_post = take(C);
  }
  o.wgu = take(2 * I * C);
  o.wd = take(C * I);
  o.total = at;
  return o;
}

std::vector<LlamaTensor> LlamaHeadTensors(const LlamaConfig& c) {
  if (c.tie_embeddings) return Lay({{"model.norm.weight", {c.hidden_size}}});
  return Lay(
      {{"model.norm.weight", {c.hidden_size}}, {"lm_head.weight", {c.vocab_size, c.hidden_size}}});
}

}  // namespace strata::models
