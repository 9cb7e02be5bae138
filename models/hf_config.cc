#include "models/hf_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <optional>

#include "base/file.h"
#include "base/untrusted_text.h"

namespace strata::models {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxConfigBytes = 16u << 20;
// The most layers a config.json may give (num_hidden_layers, n_layer): more is refused naming the
// field before anything per layer is made.
constexpr int kMaxHfLayers = 4096;

// Field access with one-line errors "PATH: field 'NAME' ...".
class Fields {
 public:
  Fields(const json& j, const std::string& path) : j_(j), path_(path) {}

  Status Error(std::string_view field, std::string_view what) const {
    return InvalidArgumentError(fmt::format("{}: field '{}' {}", path_, field, what));
  }
  // The value of `field`, or nullptr when it is absent or JSON null.
  const json* Find(std::string_view field) const {
    const auto it = j_.find(field);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  // Whether the config has `field` at all, null included (where null means something else than
  // the default, as Gemma 2's soft-capping fields: null is none, absent is the default).
  bool Has(std::string_view field) const { return j_.find(field) != j_.end(); }
  StatusOr<int> Int(std::string_view field, std::optional<int> fallback = std::nullopt) const {
    const json* v = Find(field);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Error(field, "is missing");
    }
    if (!v->is_number_integer())
      return Error(field, fmt::format("must be an integer, got {}", Dump(*v)));
    const int64_t x = v->get<int64_t>();
    if (x <= 0 || x > INT_MAX) {
      return Error(field, fmt::format("= {} is out of range (1..{})", x, INT_MAX));
    }
    return static_cast<int>(x);
  }
  // A layer count: Int, at most kMaxHfLayers (each layer gets its own entries here, in the
  // config written back and in the plan: a count of millions is a damaged file that would take
  // minutes and gigabytes before anything refused it).
  StatusOr<int> Layers(std::string_view field, std::optional<int> fallback = std::nullopt) const {
    STRATA_ASSIGN_OR_RETURN(const int n, Int(field, fallback));
    if (n > kMaxHfLayers) {
      return Error(field, fmt::format("= {} is out of range (1..{}: the deepest published "
                                      "decoders have about 130 layers)",
                                      n, kMaxHfLayers));
    }
    return n;
  }
  StatusOr<double> Double(std::string_view field, std::optional<double> fallback) const {
    const json* v = Find(field);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Error(field, "is missing");
    }
    if (!v->is_number()) return Error(field, fmt::format("must be a number, got {}", Dump(*v)));
    // The model computes in fp32: a value that rounds to 0 or to inf there is no value.
    const double d = v->get<double>();
    if (!(d >= std::numeric_limits<float>::min() && d <= std::numeric_limits<float>::max())) {
      return Error(field, fmt::format("= {} must be a positive finite number within fp32's normal "
                                      "range [{}, {}]",
                                      Dump(*v), std::numeric_limits<float>::min(),
                                      std::numeric_limits<float>::max()));
    }
    return d;
  }
  StatusOr<bool> Bool(std::string_view field, bool fallback) const {
    const json* v = Find(field);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      return Error(field, fmt::format("must be true or false, got {}", Dump(*v)));
    return v->get<bool>();
  }
  StatusOr<std::string> String(std::string_view field, std::string fallback) const {
    const json* v = Find(field);
    if (v == nullptr) return fallback;
    if (!v->is_string()) return Error(field, fmt::format("must be a string, got {}", Dump(*v)));
    return v->get<std::string>();
  }
  // A field that must be false or absent (a feature the family does not implement).
  Status FalseOrAbsent(std::string_view field, std::string_view why) const {
    STRATA_ASSIGN_OR_RETURN(const bool v, Bool(field, false));
    if (v) return Error(field, fmt::format("= true is not supported ({})", why));
    return Status::Ok();
  }

  // A bounded excerpt: never the whole value, never a recursion deeper than the parse allowed.
  static std::string Dump(const json& v) { return JsonExcerpt(v, 60); }

 private:
  const json& j_;
  const std::string& path_;
};

constexpr std::string_view kSupportedModelTypes =
    "llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, gpt2";
constexpr std::string_view kSupportedArchitectures =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
    "Gemma2ForCausalLM, Gemma3ForCausalLM, GPT2LMHeadModel";

constexpr LlamaArch kLlamaArchs[] = {LlamaArch::kLlama, LlamaArch::kMistral, LlamaArch::kQwen2,
                                     LlamaArch::kQwen3, LlamaArch::kPhi3,    LlamaArch::kGemma2,
                                     LlamaArch::kGemma3};

// rope_scaling {"type": "longrope", "short_factor": [...], "long_factor": [...]} of Phi-3 (128k),
// Phi-3.5 and Phi-4-mini, read as transformers' Phi3Config and _compute_longrope_parameters read
// it: the pretraining length is the config's own original_max_position_embeddings (Phi3Config's
// default 4096); the scale s = max_position_embeddings / that; the attention factor the given
// one, else sqrt(1 + ln s / ln original) (1 when s <= 1). A "factor" other than s is refused:
// transformers 4 ignores it and 5 uses it.
Status ParseLongRope(const Fields& f, const Fields& s, LlamaConfig& c) {
  if (c.arch != LlamaArch::kPhi3) {
    return f.Error("rope_scaling", fmt::format("type 'longrope' is supported for phi3 only, not {}",
                                               LlamaArchModelType(c.arch)));
  }
  const int half = LlamaRotaryDim(c) / 2;
  auto factors = [&](const char* key) -> StatusOr<std::vector<double>> {
    const json* v = s.Find(key);
    if (v == nullptr || !v->is_array() || static_cast<int>(v->size()) != half) {
      return f.Error(fmt::format("rope_scaling.{}", key),
                     fmt::format("must be a list of rotary dim / 2 = {} numbers", half));
    }
    std::vector<double> out;
    for (const json& x : *v) {
      if (!x.is_number() || !(x.get<double>() > 0) ||
          x.get<double>() > std::numeric_limits<float>::max()) {
        return f.Error(fmt::format("rope_scaling.{}", key),
                       fmt::format("holds {}: every factor must be a positive finite number",
                                   Fields::Dump(x)));
      }
      out.push_back(x.get<double>());
    }
    return out;
  };
  STRATA_ASSIGN_OR_RETURN(c.rope_short_factor, factors("short_factor"));
  STRATA_ASSIGN_OR_RETURN(c.rope_long_factor, factors("long_factor"));
  STRATA_ASSIGN_OR_RETURN(c.rope_original_max_position,
                          f.Int("original_max_position_embeddings", 4096));
  const double scale = static_cast<double>(c.max_seq_len) / c.rope_original_max_position;
  if (const json* factor = s.Find("factor"); factor != nullptr && !factor->is_null()) {
    if (!factor->is_number() || factor->get<double>() != scale) {
      return f.Error("rope_scaling.factor",
                     fmt::format("= {} is not max_position_embeddings / "
                                 "original_max_position_embeddings = {} (transformers 4 reads "
                                 "the ratio, 5 this factor: leave it out)",
                                 Fields::Dump(*factor), scale));
    }
  }
  c.rope_attention_factor =
      LongRopeDefaultAttentionFactor(c.max_seq_len, c.rope_original_max_position);
  if (const json* a = s.Find("attention_factor"); a != nullptr && !a->is_null()) {
    if (!a->is_number() || !(a->get<double>() > 0) ||
        a->get<double>() > std::numeric_limits<float>::max()) {
      return f.Error("rope_scaling.attention_factor",
                     fmt::format("= {} must be a positive finite number", Fields::Dump(*a)));
    }
    c.rope_attention_factor = a->get<double>();
  }
  return Status::Ok();
}

Status ParseRopeScaling(const Fields& f, const json* scaling, LlamaConfig& c) {
  if (scaling == nullptr) return Status::Ok();
  if (!scaling->is_object()) {
    return f.Error("rope_scaling",
                   fmt::format("must be null or an object, got {}", Fields::Dump(*scaling)));
  }
  const Fields s(*scaling, "");
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    const json* t = s.Find(key);
    if (t != nullptr && t->is_string()) {
      type = t->get<std::string>();
      break;
    }
  }
  if (type == "default") return Status::Ok();  // transformers' name for no scaling
  if (type.empty()) {
    return f.Error("rope_scaling",
                   "has no \"rope_type\" (or \"type\") string (supported: llama3, linear, and "
                   "longrope for phi3)");
  }
  // "su": LongRoPE's name in the first Phi-3 configs (transformers reads it as longrope).
  if (type == "longrope" || type == "su") return ParseLongRope(f, s, c);
  if (type == "linear") {
    const json* factor = s.Find("factor");
    if (factor == nullptr || !factor->is_number() || !(factor->get<double>() >= 1.0) ||
        factor->get<double>() > std::numeric_limits<float>::max()) {
      return f.Error("rope_scaling.factor", "must be a number >= 1 (linear scaling)");
    }
    c.rope_linear_factor = factor->get<double>();
    return Status::Ok();
  }
  if (type == "yarn") {
    // What Qwen2.5's and Qwen3's model cards suggest adding for long contexts.
    return f.Error("rope_scaling",
                   "type 'yarn' is not supported: transformers versions compute it three "
                   "different ways (docs/real-models.md); remove rope_scaling to fine-tune at up "
                   "to the model's original context");
  }
  if (type != "llama3") {
    return f.Error("rope_scaling",
                   fmt::format("type '{}' is not supported (supported: llama3, linear, "
                               "longrope for phi3, or null)",
                               Excerpt(type)));
  }
  auto num = [&](const char* key) -> StatusOr<double> {
    const json* v = s.Find(key);
    if (v == nullptr || !v->is_number()) {
      return f.Error(fmt::format("rope_scaling.{}", key), "is missing or not a number");
    }
    const double d = v->get<double>();
    if (!(d > 0 && d <= std::numeric_limits<float>::max())) {
      return f.Error(fmt::format("rope_scaling.{}", key),
                     fmt::format("= {} must be a positive finite number", Fields::Dump(*v)));
    }
    return d;
  };
  c.rope_llama3 = true;
  STRATA_ASSIGN_OR_RETURN(c.rope_factor, num("factor"));
  STRATA_ASSIGN_OR_RETURN(c.rope_low_freq_factor, num("low_freq_factor"));
  STRATA_ASSIGN_OR_RETURN(c.rope_high_freq_factor, num("high_freq_factor"));
  STRATA_ASSIGN_OR_RETURN(const double orig, num("original_max_position_embeddings"));
  if (!(orig >= 1 && orig <= INT_MAX) || orig != static_cast<int>(orig)) {
    return f.Error("rope_scaling.original_max_position_embeddings",
                   fmt::format("= {} must be a positive integer", orig));
  }
  c.rope_original_max_position = static_cast<int>(orig);
  return Status::Ok();
}

// A dropout probability: Strata trains without dropout, so only 0 (or absent) is taken.
Status NoDropout(const Fields& f, std::string_view field) {
  const json* v = f.Find(field);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number() || v->get<double>() != 0.0) {
    return f.Error(field, fmt::format("= {} is not supported (Strata trains without dropout; 0.0 "
                                      "is)",
                                      Fields::Dump(*v)));
  }
  return Status::Ok();
}

// A config with rope_parameters (transformers 5) and also the older rope_theta or rope_scaling:
// refused where they differ (which of the two a reader takes would change the model).
Status RopeKeysAgree(const Fields& f, const json& rope_parameters, double rope_theta) {
  if (const json* theta = f.Find("rope_theta");
      theta != nullptr && (!theta->is_number() || theta->get<double>() != rope_theta)) {
    return f.Error("rope_theta", fmt::format("= {} differs from rope_parameters.rope_theta = {}; "
                                             "give one",
                                             Fields::Dump(*theta), rope_theta));
  }
  if (const json* scaling = f.Find("rope_scaling"); scaling != nullptr) {
    // The same keys but rope_theta, "type" read as "rope_type".
    auto normalized = [](json j) {
      if (!j.is_object()) return j;
      j.erase("rope_theta");
      if (j.contains("type") && !j.contains("rope_type")) {
        j["rope_type"] = j["type"];
        j.erase("type");
      }
      return j;
    };
    if (normalized(*scaling) != normalized(rope_parameters)) {
      return f.Error("rope_scaling",
                     fmt::format("= {} differs from rope_parameters = {}; give one",
                                 Fields::Dump(*scaling), Fields::Dump(rope_parameters)));
    }
  }
  return Status::Ok();
}

// sliding_window as an integer >= 1, 0 for null (no window), and `absent` when the config has no
// such key (the configuration class's default: 4096 for Mistral, Qwen2 and Qwen3, none for
// Phi-3).
StatusOr<int> SlidingWindow(const Fields& f, int absent) {
  if (!f.Has("sliding_window")) return absent;
  const json* w = f.Find("sliding_window");
  if (w == nullptr) return 0;
  if (!w->is_number_integer() || w->get<int64_t>() <= 0 || w->get<int64_t>() > INT_MAX) {
    return f.Error("sliding_window",
                   fmt::format("must be null or a positive integer, got {}", Fields::Dump(*w)));
  }
  return static_cast<int>(w->get<int64_t>());
}

// layer_types (transformers 4.53+): one "full_attention" or "sliding_attention" per layer, as
// flags (true: sliding); all false when the field is absent.
StatusOr<std::vector<bool>> LayerTypes(const Fields& f, int num_layers) {
  std::vector<bool> sliding(num_layers, false);
  const json* types = f.Find("layer_types");
  if (types == nullptr) return sliding;
  if (!types->is_array() || static_cast<int64_t>(types->size()) != num_layers) {
    return f.Error("layer_types", fmt::format("must be a list of {} names (one per layer), got {}",
                                              num_layers, Fields::Dump(*types)));
  }
  for (int i = 0; i < num_layers; ++i) {
    const json& t = (*types)[i];
    if (t == "sliding_attention") {
      sliding[i] = true;
    } else if (t != "full_attention") {
      return f.Error(fmt::format("layer_types[{}]", i),
                     fmt::format("{} is not supported (full_attention, sliding_attention are)",
                                 Fields::Dump(t)));
    }
  }
  return sliding;
}

// Qwen2 and Qwen3 (transformers' Qwen2Config/Qwen3Config): the window is sliding_window when
// use_sliding_window, else none; layer i slides when layer_types[i] is "sliding_attention" (by
// default: when there is a window and i >= max_window_layers) and there is a window.
Status ParseQwenWindows(const Fields& f, LlamaConfig& c) {
  STRATA_ASSIGN_OR_RETURN(const bool use, f.Bool("use_sliding_window", false));
  int window = 0;
  if (use) {
    STRATA_ASSIGN_OR_RETURN(window, SlidingWindow(f, 4096));
  }
  STRATA_ASSIGN_OR_RETURN(const int max_window_layers, f.Int("max_window_layers", 28));
  STRATA_ASSIGN_OR_RETURN(std::vector<bool> sliding, LayerTypes(f, c.num_layers));
  if (f.Find("layer_types") == nullptr) {
    for (int i = 0; i < c.num_layers; ++i) sliding[i] = window > 0 && i >= max_window_layers;
  }
  if (window > 0 && std::find(sliding.begin(), sliding.end(), true) != sliding.end()) {
    c.sliding_window = window;
    c.sliding_layers = std::move(sliding);
  }
  return Status::Ok();
}

// What Gemma 2 and Gemma 3 share (their configuration classes' common fields): (1 + w) and sandwich
// norms, GeGLU, embeddings times sqrt(hidden), attention_bias, query_pre_attn_scalar, a causal
// mask, and windows (4096 by default) on the layers layer_types names "sliding_attention" or,
// without layer_types, on those `default_sliding` picks.
template <typename DefaultSliding>
Status ParseGemmaLayer(const Fields& f, LlamaConfig& c, DefaultSliding default_sliding) {
  c.norm_unit_offset = c.sandwich_norms = c.gelu_tanh_mlp = true;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
  STRATA_ASSIGN_OR_RETURN(const bool bias, f.Bool("attention_bias", false));
  c.qkv_bias = c.o_bias = bias;
  STRATA_RETURN_IF_ERROR(f.FalseOrAbsent("use_bidirectional_attention", "a causal language model"));
  STRATA_ASSIGN_OR_RETURN(c.query_pre_attn_scalar, f.Double("query_pre_attn_scalar", 256.0));
  // Null is refused: transformers' Gemma masks need a window on the sliding layers.
  if (f.Has("sliding_window") && f.Find("sliding_window") == nullptr) {
    return f.Error("sliding_window", "is null; Gemma's sliding layers need a positive window");
  }
  STRATA_ASSIGN_OR_RETURN(const int window, SlidingWindow(f, 4096));
  STRATA_ASSIGN_OR_RETURN(std::vector<bool> sliding, LayerTypes(f, c.num_layers));
  if (f.Find("layer_types") == nullptr) {
    for (int i = 0; i < c.num_layers; ++i) sliding[i] = default_sliding(i);
  }
  if (window > 0) {
    c.sliding_window = window;
    c.sliding_layers = std::move(sliding);
  }
  return Status::Ok();
}

// Gemma 3's text model (transformers' Gemma3TextConfig): the Gemma layer with q/k norms, the
// sliding layers (default: all but every sliding_window_pattern-th) with their own RoPE base
// rope_local_base_freq; no soft-capping.
Status ParseGemma3(const Fields& f, LlamaConfig& c) {
  c.qk_norm = true;
  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    if (const json* v = f.Find(cap); v != nullptr) {
      return f.Error(cap, fmt::format("= {} is not supported (soft-capping: Gemma 2; null is)",
                                      Fields::Dump(*v)));
    }
  }
  STRATA_ASSIGN_OR_RETURN(c.rope_local_theta, f.Double("rope_local_base_freq", 10000.0));
  int pattern = 6;  // read only where layer_types does not say
  if (f.Find("layer_types") == nullptr) {
    const char* key = f.Find("_sliding_window_pattern") != nullptr ? "_sliding_window_pattern"
                                                                   : "sliding_window_pattern";
    STRATA_ASSIGN_OR_RETURN(pattern, f.Int(key, 6));
  }
  return ParseGemmaLayer(f, c, [pattern](int i) { return (i + 1) % pattern != 0; });
}

// A soft-capping constant (Gemma 2): a positive number, or null for none; `fallback` when absent.
StatusOr<double> Softcap(const Fields& f, const char* field, double fallback) {
  if (!f.Has(field)) return fallback;
  const json* v = f.Find(field);
  if (v == nullptr) return 0.0;  // null
  if (!v->is_number() || !(v->get<double>() > 0) ||
      v->get<double>() > std::numeric_limits<float>::max()) {
    return f.Error(field,
                   fmt::format("must be null or a positive number, got {}", Fields::Dump(*v)));
  }
  return v->get<double>();
}

// Gemma 2 (transformers' Gemma2Config): the Gemma layer without q/k norms and with one RoPE
// base; attention scores and final logits soft-capped (attn_logit_softcapping 50 and
// final_logit_softcapping 30 by default, null: none); by default the even layers 0, 2, ... slide.
Status ParseGemma2(const Fields& f, LlamaConfig& c) {
  STRATA_ASSIGN_OR_RETURN(c.attn_logit_softcapping, Softcap(f, "attn_logit_softcapping", 50.0));
  STRATA_ASSIGN_OR_RETURN(c.final_logit_softcapping, Softcap(f, "final_logit_softcapping", 30.0));
  return ParseGemmaLayer(f, c, [](int i) { return (i + 1) % 2 != 0; });
}

// Phi-3's partial_rotary_factor (Phi-4-mini: 0.75), at the top level or, as transformers 5 saves
// it, in rope_parameters: RoPE on the first int(head_dim * factor) columns of each head.
Status ParsePartialRotary(const Fields& f, LlamaConfig& c) {
  const json* prf = f.Find("partial_rotary_factor");
  std::string key = "partial_rotary_factor";
  if (const json* rp = f.Find("rope_parameters");
      prf == nullptr && rp != nullptr && rp->is_object() && rp->contains("partial_rotary_factor")) {
    prf = &rp->at("partial_rotary_factor");
    key = "rope_parameters.partial_rotary_factor";
  }
  if (prf == nullptr || prf->is_null()) return Status::Ok();
  const double v = prf->is_number() ? prf->get<double>() : 0;
  const int dim = v > 0 && v <= 1 ? static_cast<int>(c.head_dim * v) : 0;  // in range to cast
  if (dim < 2 || dim % 2 != 0) {
    return f.Error(key, fmt::format("= {} must be in (0, 1] and give an even number of rotated "
                                    "columns (head_dim {} x factor = {})",
                                    Fields::Dump(*prf), c.head_dim, dim));
  }
  c.partial_rotary_factor = v;
  return Status::Ok();
}

// model_type llama, mistral, qwen2, qwen3, phi3, gemma2 and gemma3_text: the Llama layer with the
// family's options (llama_config.h), read as transformers' configuration classes read them.
StatusOr<LlamaConfig> ParseLlama(const Fields& f, LlamaArch arch, const std::string& path) {
  LlamaConfig c;
  c.arch = arch;
  // Gemma3TextConfig has a default for every field (a Gemma3ForConditionalGeneration's
  // text_config often leaves the sizes out): vocabulary 262208, 2304 channels, MLP 9216, 26
  // layers, 8 heads, 4 key/value heads, head_dim 256, rope_theta 1e6, tied, 131072 positions.
  // Gemma2Config's are the same but for vocabulary 256000, rope_theta 1e4 and 8192 positions.
  const bool gemma2 = arch == LlamaArch::kGemma2;
  const bool gemma = gemma2 || arch == LlamaArch::kGemma3;
  auto size = [&](const char* field, int gemma_default) {
    return gemma ? f.Int(field, gemma_default) : f.Int(field);
  };
  auto layers = [&](const char* field, int gemma_default) {
    return gemma ? f.Layers(field, gemma_default) : f.Layers(field);
  };
  STRATA_ASSIGN_OR_RETURN(c.vocab_size, size("vocab_size", gemma2 ? 256000 : 262208));
  STRATA_ASSIGN_OR_RETURN(c.hidden_size, size("hidden_size", 2304));
  STRATA_ASSIGN_OR_RETURN(c.intermediate_size, size("intermediate_size", 9216));
  STRATA_ASSIGN_OR_RETURN(c.num_layers, layers("num_hidden_layers", 26));
  STRATA_ASSIGN_OR_RETURN(c.num_heads, size("num_attention_heads", 8));
  STRATA_ASSIGN_OR_RETURN(c.num_kv_heads, f.Int("num_key_value_heads", gemma ? 4 : c.num_heads));
  if (!gemma && arch != LlamaArch::kQwen3 && f.Find("head_dim") == nullptr &&
      c.hidden_size % c.num_heads != 0) {
    return f.Error("hidden_size", fmt::format("= {} is not a multiple of num_attention_heads = {} "
                                              "(and there is no head_dim)",
                                              c.hidden_size, c.num_heads));
  }
  // The configuration classes' defaults: Gemma's and Qwen3Config's head_dim are their own (256,
  // 128), the others' hidden_size / num_attention_heads.
  STRATA_ASSIGN_OR_RETURN(
      c.head_dim, f.Int("head_dim", gemma                       ? 256
                                    : arch == LlamaArch::kQwen3 ? 128
                                                                : c.hidden_size / c.num_heads));
  if (gemma) {
    STRATA_ASSIGN_OR_RETURN(c.max_seq_len,
                            f.Int("max_position_embeddings", gemma2 ? 8192 : 131072));
  } else {
    STRATA_ASSIGN_OR_RETURN(c.max_seq_len, f.Int("max_position_embeddings"));
  }
  // Phi3Config's default epsilon is 1e-5; the other classes' 1e-6.
  STRATA_ASSIGN_OR_RETURN(c.rms_norm_eps,
                          f.Double("rms_norm_eps", arch == LlamaArch::kPhi3 ? 1e-5 : 1e-6));
  if (arch == LlamaArch::kPhi3) STRATA_RETURN_IF_ERROR(ParsePartialRotary(f, c));
  // transformers 5 writes rope_parameters {"rope_type", "rope_theta", ...} for rope_theta and
  // rope_scaling.
  const json* rope_parameters = f.Find("rope_parameters");
  if (rope_parameters != nullptr && !rope_parameters->is_object()) {
    return f.Error("rope_parameters", fmt::format("must be null or an object, got {}",
                                                  Fields::Dump(*rope_parameters)));
  }
  const double default_theta = gemma && !gemma2 ? 1e6 : 10000.0;
  if (rope_parameters != nullptr) {
    // rope_parameters decides, as transformers 5 reads it; a top-level rope_theta or rope_scaling
    // beside it must say the same.
    const Fields rp(*rope_parameters, path);
    STRATA_ASSIGN_OR_RETURN(c.rope_theta, rp.Double("rope_theta", default_theta));
    STRATA_RETURN_IF_ERROR(RopeKeysAgree(f, *rope_parameters, c.rope_theta));
    STRATA_RETURN_IF_ERROR(ParseRopeScaling(f, rope_parameters, c));
  } else {
    STRATA_ASSIGN_OR_RETURN(c.rope_theta, f.Double("rope_theta", default_theta));
    STRATA_RETURN_IF_ERROR(ParseRopeScaling(f, f.Find("rope_scaling"), c));
  }
  STRATA_ASSIGN_OR_RETURN(c.tie_embeddings, f.Bool("tie_word_embeddings", gemma));
  if (gemma) {
    STRATA_ASSIGN_OR_RETURN(const std::string act,
                            f.String("hidden_activation", "gelu_pytorch_tanh"));
    if (act != "gelu_pytorch_tanh" && act != "gelu_new") {
      return f.Error("hidden_activation",
                     fmt::format("'{}' is not supported (the Gemma MLP's tanh GELU is: "
                                 "gelu_pytorch_tanh, gelu_new)",
                                 Excerpt(act)));
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(const std::string act, f.String("hidden_act", "silu"));
    if (act != "silu") {
      return f.Error("hidden_act", fmt::format("'{}' is not supported (the Llama MLP is SwiGLU: "
                                               "silu)",
                                               Excerpt(act)));
    }
  }
  STRATA_RETURN_IF_ERROR(f.FalseOrAbsent("mlp_bias", "the MLP has no biases"));
  STRATA_RETURN_IF_ERROR(NoDropout(f, "attention_dropout"));
  switch (arch) {
    case LlamaArch::kLlama: {
      STRATA_ASSIGN_OR_RETURN(const bool bias, f.Bool("attention_bias", false));
      c.qkv_bias = c.o_bias = bias;
      break;
    }
    case LlamaArch::kMistral: {
      STRATA_ASSIGN_OR_RETURN(c.sliding_window, SlidingWindow(f, 4096));
      if (c.sliding_window > 0) c.sliding_layers.assign(c.num_layers, true);
      break;
    }
    case LlamaArch::kQwen2:
      c.qkv_bias = true;
      STRATA_RETURN_IF_ERROR(ParseQwenWindows(f, c));
      break;
    case LlamaArch::kQwen3: {
      STRATA_ASSIGN_OR_RETURN(const bool bias, f.Bool("attention_bias", false));
      c.qkv_bias = c.o_bias = bias;
      c.qk_norm = true;
      STRATA_RETURN_IF_ERROR(ParseQwenWindows(f, c));
      break;
    }
    case LlamaArch::kGemma2: {
      STRATA_RETURN_IF_ERROR(ParseGemma2(f, c));
      break;
    }
    case LlamaArch::kGemma3: {
      STRATA_RETURN_IF_ERROR(ParseGemma3(f, c));
      break;
    }
    case LlamaArch::kPhi3: {
      STRATA_RETURN_IF_ERROR(NoDropout(f, "resid_pdrop"));
      STRATA_RETURN_IF_ERROR(NoDropout(f, "embd_pdrop"));
      STRATA_ASSIGN_OR_RETURN(c.sliding_window, SlidingWindow(f, 0));
      if (c.sliding_window > 0) c.sliding_layers.assign(c.num_layers, true);
      break;
    }
  }
  if (Status s = ValidateLlamaConfig(c); !s.ok()) return s.WithContext(path);
  return c;
}

StatusOr<GptShape> ParseGpt2(const Fields& f, const std::string& path) {
  GptShape g;
  STRATA_ASSIGN_OR_RETURN(g.vocab_size, f.Int("vocab_size", 50257));
  STRATA_ASSIGN_OR_RETURN(g.channels, f.Int("n_embd"));
  STRATA_ASSIGN_OR_RETURN(g.num_layers, f.Layers("n_layer"));
  STRATA_ASSIGN_OR_RETURN(g.num_heads, f.Int("n_head"));
  if (f.Find("n_positions") != nullptr) {
    STRATA_ASSIGN_OR_RETURN(g.max_seq_len, f.Int("n_positions"));
  } else {
    STRATA_ASSIGN_OR_RETURN(g.max_seq_len, f.Int("n_ctx"));  // older configs
  }
  STRATA_ASSIGN_OR_RETURN(g.layer_norm_eps, f.Double("layer_norm_epsilon", 1e-5));
  if (!(g.layer_norm_eps > 0)) {
    return f.Error("layer_norm_epsilon", fmt::format("= {} must be positive", g.layer_norm_eps));
  }
  STRATA_ASSIGN_OR_RETURN(g.tie_embeddings, f.Bool("tie_word_embeddings", true));
  STRATA_ASSIGN_OR_RETURN(const std::string act, f.String("activation_function", "gelu_new"));
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    return f.Error(
        "activation_function",
        fmt::format("'{}' is not supported (the tanh GELU is: gelu_new, gelu_pytorch_tanh)", act));
  }
  if (const json* inner = f.Find("n_inner"); inner != nullptr) {
    if (!inner->is_number_integer() || inner->get<int64_t>() != 4 * int64_t{g.channels}) {
      return f.Error("n_inner", fmt::format("= {} is not supported (null or 4 n_embd = {} is)",
                                            Fields::Dump(*inner), 4 * int64_t{g.channels}));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const bool scale_attn, f.Bool("scale_attn_weights", true));
  if (!scale_attn) return f.Error("scale_attn_weights", "= false is not supported");
  STRATA_RETURN_IF_ERROR(f.FalseOrAbsent("scale_attn_by_inverse_layer_idx",
                                         "attention scores scale by 1/sqrt(hs) only"));
  STRATA_RETURN_IF_ERROR(f.FalseOrAbsent("add_cross_attention", "a decoder-only model"));
  if (Status s = ValidateShape(g); !s.ok()) return s.WithContext(path);
  return g;
}

std::string TorchDtype(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF32:
      break;
  }
  return "float32";
}

// A Gemma3ForConditionalGeneration directory (model_type "gemma3"): its language model, from
// text_config (a gemma3_text config); the vision tower's weights are not read.
StatusOr<HfModelConfig> ParseGemma3ConditionalGeneration(const Fields& f, const std::string& path,
                                                         HfModelConfig& config) {
  if (const json* arch = f.Find("architectures"); arch != nullptr) {
    if (!arch->is_array() || arch->size() != 1 || (*arch)[0] != "Gemma3ForConditionalGeneration") {
      return f.Error("architectures",
                     fmt::format("{} is not supported for model_type 'gemma3' (supported: "
                                 "Gemma3ForConditionalGeneration)",
                                 Fields::Dump(*arch)));
    }
  }
  const json* text = f.Find("text_config");
  if (text == nullptr || !text->is_object()) {
    return f.Error("text_config", "must be an object (the language model's gemma3_text config)");
  }
  const std::string text_path = path + " text_config";
  const Fields t(*text, text_path);
  STRATA_ASSIGN_OR_RETURN(const std::string text_type, t.String("model_type", "gemma3_text"));
  if (text_type != "gemma3_text") {
    return t.Error("model_type",
                   fmt::format("'{}' is not supported (gemma3_text is)", Excerpt(text_type)));
  }
  config.family = HfModelConfig::Family::kLlama;
  config.gemma3_multimodal = true;
  STRATA_ASSIGN_OR_RETURN(config.llama, ParseLlama(t, LlamaArch::kGemma3, text_path));
  return config;
}

}  // namespace

StatusOr<HfModelConfig> ParseHfConfig(std::string_view json_text, const std::string& path) {
  HfModelConfig config;
  auto parsed = ParseJsonBounded(json_text);
  if (!parsed.ok()) return parsed.status().WithContext(path);
  config.raw = std::move(*parsed);
  if (!config.raw.is_object())
    return InvalidArgumentError(fmt::format("{}: not a JSON object", path));
  const Fields f(config.raw, path);
  STRATA_ASSIGN_OR_RETURN(std::string model_type, f.String("model_type", ""));
  if (model_type == "gemma3" || (model_type.empty() && f.Find("text_config") != nullptr)) {
    return ParseGemma3ConditionalGeneration(f, path, config);
  }
  std::string architecture;
  if (const json* arch = f.Find("architectures"); arch != nullptr) {
    if (!arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string()) {
      return f.Error("architectures",
                     fmt::format("must be a list of one name, got {}", Fields::Dump(*arch)));
    }
    architecture = (*arch)[0].get<std::string>();
  }
  if (model_type.empty()) {
    if (architecture.empty()) {
      return f.Error(
          "model_type",
          fmt::format("is missing (and so is architectures); supported: {}", kSupportedModelTypes));
    }
    if (architecture == "GPT2LMHeadModel") model_type = "gpt2";
    for (LlamaArch arch : kLlamaArchs) {
      if (architecture == LlamaArchArchitecture(arch)) model_type = LlamaArchModelType(arch);
    }
    if (model_type.empty()) {
      return f.Error("architectures", fmt::format("'{}' is not supported (supported: {})",
                                                  Excerpt(architecture), kSupportedArchitectures));
    }
  }
  std::string_view expected_arch;
  std::optional<LlamaArch> llama_arch;
  for (LlamaArch arch : kLlamaArchs) {
    if (model_type == LlamaArchModelType(arch)) llama_arch = arch;
  }
  if (llama_arch) {
    expected_arch = LlamaArchArchitecture(*llama_arch);
  } else if (model_type == "gpt2") {
    expected_arch = "GPT2LMHeadModel";
  } else {
    return f.Error("model_type", fmt::format("'{}' is not supported (supported: {})",
                                             Excerpt(model_type), kSupportedModelTypes));
  }
  if (!architecture.empty() && architecture != expected_arch) {
    return f.Error("architectures",
                   fmt::format("'{}' is not supported for model_type '{}' (supported: {})",
                               Excerpt(architecture), model_type, expected_arch));
  }
  if (model_type == "gpt2") {
    config.family = HfModelConfig::Family::kGpt2;
    STRATA_ASSIGN_OR_RETURN(config.gpt2, ParseGpt2(f, path));
  } else {
    config.family = HfModelConfig::Family::kLlama;
    STRATA_ASSIGN_OR_RETURN(config.llama, ParseLlama(f, *llama_arch, path));
  }
  return config;
}

StatusOr<HfModelConfig> ReadHfConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  STRATA_ASSIGN_OR_RETURN(const std::string text,
                          ReadSmallFile(path, {.max_bytes = kMaxConfigBytes}));
  return ParseHfConfig(text, path);
}

std::string HfConfigJson(const HfModelConfig& config, DType torch_dtype) {
  json j = json::object();
  if (config.family == HfModelConfig::Family::kLlama) {
    const LlamaConfig& c = config.llama;
    j["architectures"] = {LlamaArchArchitecture(c.arch)};
    j["model_type"] = LlamaArchModelType(c.arch);
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["num_hidden_layers"] = c.num_layers;
    j["num_attention_heads"] = c.num_heads;
    j["num_key_value_heads"] = c.num_kv_heads;
    j["head_dim"] = c.head_dim;
    j["max_position_embeddings"] = c.max_seq_len;
    j["rms_norm_eps"] = c.rms_norm_eps;
    j["rope_theta"] = c.rope_theta;
    if (c.rope_llama3) {
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", c.rope_factor},
                           {"low_freq_factor", c.rope_low_freq_factor},
                           {"high_freq_factor", c.rope_high_freq_factor},
                           {"original_max_position_embeddings", c.rope_original_max_position}};
    } else if (c.rope_linear_factor != 1.0) {
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope_linear_factor}};
    } else if (!c.rope_short_factor.empty()) {
      // "type" as the Phi-3 directories write it (transformers 4 reads rope_scaling["type"]).
      j["rope_scaling"] = {{"type", "longrope"},
                           {"short_factor", c.rope_short_factor},
                           {"long_factor", c.rope_long_factor}};
      if (c.rope_attention_factor !=
          LongRopeDefaultAttentionFactor(c.max_seq_len, c.rope_original_max_position)) {
        j["rope_scaling"]["attention_factor"] = c.rope_attention_factor;
      }
    } else {
      j["rope_scaling"] = nullptr;
    }
    j["tie_word_embeddings"] = c.tie_embeddings;
    if (c.gelu_tanh_mlp) {
      j["hidden_activation"] = "gelu_pytorch_tanh";
    } else {
      j["hidden_act"] = "silu";
    }
    j["attention_dropout"] = 0.0;
    j["initializer_range"] = 0.02;
    j["use_cache"] = true;
    const json window = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
    switch (c.arch) {
      case LlamaArch::kLlama:
        j["attention_bias"] = c.qkv_bias;
        j["mlp_bias"] = false;
        j["pretraining_tp"] = 1;
        break;
      case LlamaArch::kMistral:
      case LlamaArch::kPhi3:
        j["sliding_window"] = window;
        if (c.arch == LlamaArch::kPhi3) {
          j["resid_pdrop"] = 0.0;
          j["embd_pdrop"] = 0.0;
          j["original_max_position_embeddings"] =
              c.rope_short_factor.empty() ? c.max_seq_len : c.rope_original_max_position;
          if (c.partial_rotary_factor != 1.0) {
            j["partial_rotary_factor"] = c.partial_rotary_factor;
          }
        }
        break;
      case LlamaArch::kGemma2:
      case LlamaArch::kGemma3: {
        json types = json::array();
        for (int i = 0; i < c.num_layers; ++i) {
          types.push_back(LlamaLayerWindow(c, i) > 0 ? "sliding_attention" : "full_attention");
        }
        const auto softcap = [](double v) { return v > 0 ? json(v) : json(nullptr); };
        j["attention_bias"] = c.qkv_bias;
        // An int where it is one: transformers 5's strict config dataclasses type it int.
        const double scalar = c.query_pre_attn_scalar;
        j["query_pre_attn_scalar"] = scalar == std::floor(scalar) && std::abs(scalar) < 1e15
                                         ? json(static_cast<int64_t>(scalar))
                                         : json(scalar);
        if (c.arch == LlamaArch::kGemma3) {
          j["rope_local_base_freq"] = c.rope_local_theta;
          // transformers before 4.53 (and candle, MLX) read no layer_types: layer i slides
          // unless (i + 1) % sliding_window_pattern == 0. The pattern where the layers follow
          // one (Gemma 3's own layout), else left out (layer_types says it to 4.53+).
          for (int p = 1; p <= c.num_layers + 1; ++p) {
            bool fits = true;
            for (int i = 0; i < c.num_layers && fits; ++i) {
              fits = (LlamaLayerWindow(c, i) > 0) == ((i + 1) % p != 0);
            }
            if (fits) {
              j["sliding_window_pattern"] = p;
              break;
            }
          }
        }
        j["sliding_window"] = window;
        j["layer_types"] = std::move(types);
        j["attn_logit_softcapping"] = softcap(c.attn_logit_softcapping);
        j["final_logit_softcapping"] = softcap(c.final_logit_softcapping);
        j["use_bidirectional_attention"] = false;
        break;
      }
      case LlamaArch::kQwen2:
      case LlamaArch::kQwen3: {
        if (c.arch == LlamaArch::kQwen3) j["attention_bias"] = c.qkv_bias;
        json types = json::array();
        // transformers before 4.53 reads no layer_types: layer i slides when i >=
        // max_window_layers. The sliding layers as such a suffix where they are one (Qwen2's
        // own rule), else all layers full for those versions (layer_types says the rest).
        int first_sliding = c.num_layers;
        bool suffix = true;
        for (int i = 0; i < c.num_layers; ++i) {
          const bool slides = LlamaLayerWindow(c, i) > 0;
          types.push_back(slides ? "sliding_attention" : "full_attention");
          if (slides && first_sliding == c.num_layers) first_sliding = i;
          suffix = suffix && (slides == (i >= first_sliding));
        }
        j["use_sliding_window"] = c.sliding_window > 0;
        j["sliding_window"] = window;
        j["max_window_layers"] = suffix ? first_sliding : c.num_layers;
        j["layer_types"] = std::move(types);
        break;
      }
    }
  } else {
    const GptShape& g = config.gpt2;
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["vocab_size"] = g.vocab_size;
    j["n_embd"] = g.channels;
    j["n_layer"] = g.num_layers;
    j["n_head"] = g.num_heads;
    j["n_positions"] = g.max_seq_len;
    j["n_ctx"] = g.max_seq_len;
    j["n_inner"] = nullptr;
    j["layer_norm_epsilon"] = g.layer_norm_eps;
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = g.tie_embeddings;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    j["initializer_range"] = 0.02;
    j["use_cache"] = true;
  }
  if (config.raw.is_object()) {
    const auto text = config.raw.find("text_config");
    // Phi-3's original_max_position_embeddings is the one it was read with.
    for (const char* key :
         {"bos_token_id", "eos_token_id", "pad_token_id", "original_max_position_embeddings"}) {
      if (std::string_view(key) == "original_max_position_embeddings" &&
          !(config.family == HfModelConfig::Family::kLlama &&
            config.llama.arch == LlamaArch::kPhi3)) {
        continue;
      }
      // A multimodal Gemma 3's ids may be in its text_config only (exported as its text model).
      const auto it = config.raw.find(key);
      if (it != config.raw.end()) {
        j[key] = *it;
      } else if (text != config.raw.end() && text->is_object() && text->contains(key)) {
        j[key] = (*text)[key];
      }
    }
  }
  j["torch_dtype"] = TorchDtype(torch_dtype);
  return j.dump(2) + "\n";
}

StatusOr<GptShape> Gpt2Preset(std::string_view name) {
  GptShape g;
  g.vocab_size = 50257;
  g.max_seq_len = 1024;
  g.tie_embeddings = true;
  g.layer_norm_eps = 1e-5;
  auto set = [&g](int layers, int heads, int channels) {
    g.num_layers = layers;
    g.num_heads = heads;
    g.channels = channels;
    return g;
  };
  if (name == "gpt2") return set(12, 12, 768);
  if (name == "gpt2-medium") return set(24, 16, 1024);
  if (name == "gpt2-large") return set(36, 20, 1280);
  if (name == "gpt2-xl") return set(48, 25, 1600);
  return InvalidArgumentError(fmt::format("unknown GPT-2 preset '{}' (choices: {})", name,
                                          fmt::join(Gpt2PresetNames(), ", ")));
}

std::vector<std::string> Gpt2PresetNames() {
  return {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"};
}

// ---------------------------------------------------------------------------
// Block layouts.

int HfNumBlocks(const HfModelConfig& config) {
  return (config.family == HfModelConfig::Family::kLlama ? config.llama.num_layers
                                                         : config.gpt2.num_layers) +
         2;
}

std::string HfBlockName(const HfModelConfig& config, int block) {
  STRATA_CHECK(block >= 0 && block < HfNumBlocks(config));
  if (block == 0) return "embedding";
  if (block == HfNumBlocks(config) - 1) return "head";
  return fmt::format("layer{}", block - 1);
}

namespace {

std::vector<HfTensor> FromLlama(const std::vector<LlamaTensor>& tensors) {
  std::vector<HfTensor> out;
  for (const LlamaTensor& t : tensors)
    out.push_back({t.name, t.shape, t.num_elems, t.offset, false});
  return out;
}

// The GPT chunk layout (gpt_kernels.h) in GPT2LMHeadModel's names: Conv1D weights are stored
// (in, out) like our chunk, so only the untied lm_head is transposed.
std::vector<HfTensor> Gpt2Tensors(const GptShape& g, int block, int num_blocks) {
  const int64_t C = g.channels, V = g.vocab_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs;
  bool transpose_last = false;
  if (block == 0) {
    specs = {{"transformer.wte.weight", {V, C}}, {"transformer.wpe.weight", {g.max_seq_len, C}}};
  } else if (block == num_blocks - 1) {
    specs = {{"transformer.ln_f.weight", {C}}, {"transformer.ln_f.bias", {C}}};
    if (!g.tie_embeddings) {
      specs.push_back({"lm_head.weight", {V, C}});
      transpose_last = true;
    }
  } else {
    const std::string p = fmt::format("transformer.h.{}.", block - 1);
    specs = {{p + "ln_1.weight", {C}},
             {p + "ln_1.bias", {C}},
             {p + "attn.c_attn.weight", {C, 3 * C}},
             {p + "attn.c_attn.bias", {3 * C}},
             {p + "attn.c_proj.weight", {C, C}},
             {p + "attn.c_proj.bias", {C}},
             {p + "ln_2.weight", {C}},
             {p + "ln_2.bias", {C}},
             {p + "mlp.c_fc.weight", {C, 4 * C}},
             {p + "mlp.c_fc.bias", {4 * C}},
             {p + "mlp.c_proj.weight", {4 * C, C}},
             {p + "mlp.c_proj.bias", {C}}};
  }
  std::vector<HfTensor> out;
  int64_t offset = 0;
  for (auto& [name, shape] : specs) {
    const int64_t n = shape.size() == 1 ? shape[0] : shape[0] * shape[1];
    out.push_back({std::move(name), std::move(shape), n, offset, false});
    offset += n;
  }
  if (transpose_last) out.back().transposed = true;
  return out;
}

}  // namespace

std::vector<HfTensor> HfBlockTensors(const HfModelConfig& config, int block) {
  const int n = HfNumBlocks(config);
  STRATA_CHECK(block >= 0 && block < n);
  if (config.family == HfModelConfig::Family::kGpt2) return Gpt2Tensors(config.gpt2, block, n);
  if (block == 0) return FromLlama(LlamaEmbeddingTensors(config.llama));
  if (block == n - 1) return FromLlama(LlamaHeadTensors(config.llama));
  return FromLlama(LlamaLayerTensors(config.llama, block - 1));
}

int64_t HfBlockNumParams(const HfModelConfig& config, int block) {
  int64_t n = 0;
  for (const HfTensor& t : HfBlockTensors(config, block)) n += t.num_elems;
  return n;
}

bool HfBaseQuantized(const HfModelConfig& config, int block, const HfTensor& tensor) {
  const int n = HfNumBlocks(config);
  STRATA_CHECK(block >= 0 && block < n);
  return config.family == HfModelConfig::Family::kLlama && block >= 1 && block <= n - 2 &&
         tensor.shape.size() == 2;
}

Status CheckHfBaseQuantizable(const HfModelConfig& config) {
  if (config.family == HfModelConfig::Family::kLlama) return Status::Ok();
  return InvalidArgumentError(
      "a 4-bit base (bitsandbytes nf4/fp4) is supported for the Llama families (llama, mistral, "
      "qwen2, qwen3, phi3, gemma2, gemma3_text), not for gpt2 (GPT2LMHeadModel)");
}

}  // namespace strata::models
