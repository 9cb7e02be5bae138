#include "models/lora_adapter.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "base/file.h"
#include "base/untrusted_text.h"
#include "cpu_optim/grad_stats.h"
#include "formats/safetensors.h"
#include "models/gpt.h"
#include "models/gpt_kernels.h"
#include "models/hf_export.h"
#include "models/llama.h"
#include "models/llama_kernels.h"

namespace strata::models {
namespace {

using json = nlohmann::json;
constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";

int NumLayers(const HfModelConfig& c) {
  return c.family == HfModelConfig::Family::kLlama ? c.llama.num_layers : c.gpt2.num_layers;
}

std::vector<LoraModule> FamilyLoraModules(const HfModelConfig& c) {
  return c.family == HfModelConfig::Family::kLlama ? LlamaLoraModules(c.llama)
                                                   : GptLoraModules(c.gpt2);
}

const char* FamilyName(const HfModelConfig& c) {
  return c.family == HfModelConfig::Family::kLlama ? LlamaFamily::kName : GptFamily::kName;
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// The regular expression a multimodal Gemma 3's target_modules are written as (PEFT matches a
// string against whole module names): the language model's modules, not the vision tower's.
constexpr std::string_view kLanguageModelTargetsHead = ".*language_model.*\\.(";

std::string LanguageModelTargets(const std::vector<std::string>& targets) {
  return fmt::format("{}{})", kLanguageModelTargetsHead, fmt::join(targets, "|"));
}

// The layer prefixes an adapter's tensors may carry: Strata's (LoraTensorPrefix) and, for a
// multimodal Gemma 3, that of PEFT over transformers before 4.52 (its language model as
// Gemma3ForCausalLM: "language_model.model.layers").
std::vector<std::string> LoraTensorPrefixes(const HfModelConfig& config, int layer,
                                            const LoraSite& site) {
  std::vector<std::string> out = {LoraTensorPrefix(config, layer, site)};
  if (config.family == HfModelConfig::Family::kLlama && config.gemma3_multimodal) {
    out.push_back(
        fmt::format("base_model.model.language_model.model.layers.{}.{}", layer, site.module.path));
  }
  return out;
}

class AdapterSource final : public WeightSource {
 public:
  // prefix_style: the index into LoraTensorPrefixes of the names the file holds.
  AdapterSource(formats::OpenSafetensors file, std::string path, HfModelConfig config,
                LoraLayout layout, size_t prefix_style)
      : file_(std::move(file)),
        path_(std::move(path)),
        config_(std::move(config)),
        layout_(std::move(layout)),
        prefix_style_(prefix_style) {}

  Status ReadBlock(int block, std::span<float> out) const override {
    if (out.empty()) return Status::Ok();  // the embedding and the head have no adapters
    const int layer = block - 1;
    for (const LoraSite& s : layout_.sites) {
      const std::string prefix = LoraTensorPrefixes(config_, layer, s)[prefix_style_];
      for (const auto& [suffix, offset, elems] :
           {std::tuple{".lora_A.weight", s.a_offset, layout_.rank * s.module.in},
            std::tuple{".lora_B.weight", s.b_offset, s.module.out * layout_.rank}}) {
        const formats::SafetensorsTensor* t = file_.header.Find(prefix + suffix);
        STRATA_CHECK(t != nullptr);  // checked by OpenLoraAdapter
        std::vector<std::byte> raw(t->size_bytes());
        STRATA_RETURN_IF_ERROR(formats::ReadTensorBytes(file_, *t, 0, raw));
        STRATA_RETURN_IF_ERROR(
            cpu_optim::ConvertToF32(raw.data(), t->dtype.dtype(), out.data() + offset, elems)
                .WithContext(path_));
      }
    }
    return Status::Ok();
  }

 private:
  formats::OpenSafetensors file_;
  std::string path_;
  HfModelConfig config_;
  LoraLayout layout_;
  size_t prefix_style_;
};

}  // namespace

std::string LoraTensorPrefix(const HfModelConfig& config, int layer, const LoraSite& site) {
  const char* layers = config.family != HfModelConfig::Family::kLlama ? "transformer.h"
                       : config.gemma3_multimodal ? "model.language_model.layers"
                                                  : "model.layers";
  return fmt::format("base_model.model.{}.{}.{}", layers, layer, site.module.path);
}

StatusOr<LoraAdapterConfig> ReadLoraAdapterConfig(const std::string& dir) {
  const std::string path = dir + "/" + kConfigFile;
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, {.max_bytes = 1 << 20}));
  return ParseLoraAdapterConfig(text, path);
}

StatusOr<LoraAdapterConfig> ParseLoraAdapterConfig(std::string_view text, const std::string& path) {
  auto parsed = ParseJsonBounded(text);
  if (!parsed.ok()) return DataLossError(fmt::format("{}: {}", path, parsed.status().message()));
  const json j = std::move(*parsed);
  if (!j.is_object()) return DataLossError(fmt::format("{}: not a JSON object", path));
  auto field = [&](const char* key) -> const json* {
    return j.contains(key) && !j[key].is_null() ? &j[key] : nullptr;
  };
  if (const json* t = field("peft_type"); !t || !t->is_string() || *t != "LORA") {
    return InvalidArgumentError(
        fmt::format("{}: peft_type is not \"LORA\" (Strata reads LoRA adapters only)", path));
  }
  // Variants whose output is not x·W + (alpha/r)·x·Aᵀ·Bᵀ: rsLoRA scales by alpha/sqrt(r), DoRA
  // adds a magnitude vector, QA-LoRA pools the input before A.
  for (const char* unsupported : {"use_rslora", "use_dora", "use_qalora"}) {
    if (const json* v = field(unsupported); v && v->is_boolean() && v->get<bool>()) {
      return InvalidArgumentError(
          fmt::format("{}: {} is true; Strata implements plain LoRA only", path, unsupported));
    }
  }
  // Activated LoRA (aLoRA) applies the adapter only from its invocation tokens on.
  if (const json* v = field("alora_invocation_tokens"); v && !(v->is_array() && v->empty())) {
    return InvalidArgumentError(
        fmt::format("{}: alora_invocation_tokens is {}; Strata applies an adapter at every token",
                    path, JsonExcerpt(*v)));
  }
  // PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA initialise A and B from the base weights and subtract
  // their product from them, so the adapter fits only that changed base: PEFT converts it to a
  // plain LoRA on save_pretrained(..., path_initial_model_for_weight_conversion=...), which writes
  // init_lora_weights true (LoftQ's quantized base cannot be converted). true, false ("B = 0, A
  // random" or both random), "gaussian", "eva" and "orthogonal" leave the base as it is.
  if (const json* v = field("init_lora_weights"); v && !v->is_boolean()) {
    const bool base_unchanged =
        v->is_string() && (*v == "gaussian" || *v == "eva" || *v == "orthogonal");
    if (!base_unchanged) {
      return InvalidArgumentError(fmt::format(
          "{}: init_lora_weights is {}, which changes the base weights (or is not one Strata "
          "knows leaves them as they are); convert the adapter to a plain LoRA with PEFT's "
          "save_pretrained(..., path_initial_model_for_weight_conversion=...)",
          path, JsonExcerpt(*v)));
    }
  }
  for (const char* unsupported : {"rank_pattern", "alpha_pattern", "layers_to_transform"}) {
    if (const json* v = field(unsupported); v && !(v->is_object() && v->empty())) {
      return InvalidArgumentError(fmt::format(
          "{}: {} is set; Strata adapts every layer with one rank and alpha", path, unsupported));
    }
  }
  if (const json* b = field("bias"); b && !(b->is_string() && *b == "none")) {
    return InvalidArgumentError(
        fmt::format("{}: bias is not \"none\"; Strata trains no bias adapters", path));
  }
  if (const json* b = field("lora_bias"); b && !(b->is_boolean() && !b->get<bool>())) {
    return InvalidArgumentError(fmt::format(
        "{}: lora_bias is {}; Strata's adapters have no lora_B bias", path, JsonExcerpt(*b)));
  }
  // Whole modules an adapter replaces or extends (PEFT's modules_to_save: a retrained lm_head or
  // embedding, often after adding chat tokens; trainable_token_indices: some embedding rows):
  // applying only the A/B matrices would silently run the base's versions of them.
  for (const char* unsupported :
       {"modules_to_save", "trainable_token_indices", "layer_replication", "target_parameters"}) {
    if (const json* v = field(unsupported);
        v && !((v->is_array() || v->is_object()) && v->empty())) {
      return InvalidArgumentError(
          fmt::format("{}: {} is {}; Strata applies the A/B matrices of target_modules only", path,
                      unsupported, JsonExcerpt(*v)));
    }
  }
  LoraAdapterConfig c;
  const json* r = field("r");
  const json* alpha = field("lora_alpha");
  const json* targets = field("target_modules");
  if (!r || !r->is_number_integer() || !alpha || !alpha->is_number() || !targets) {
    return DataLossError(
        fmt::format("{}: needs an integer r, a number lora_alpha and target_modules", path));
  }
  // Checked before anything is sized from them: a rank of 2^40 would wrap in an int.
  const bool rank_ok =
      r->is_number_unsigned()
          ? r->get<uint64_t>() >= 1 && r->get<uint64_t>() <= static_cast<uint64_t>(kMaxAdapterRank)
          : r->get<int64_t>() >= 1 && r->get<int64_t>() <= kMaxAdapterRank;
  if (!rank_ok) {
    return InvalidArgumentError(fmt::format("{}: r is {}, not an integer in 1..{}", path,
                                            JsonExcerpt(*r), kMaxAdapterRank));
  }
  c.lora.rank = static_cast<int>(r->get<int64_t>());
  c.lora.alpha = alpha->get<double>();
  if (!(c.lora.alpha > 0 && c.lora.alpha <= std::numeric_limits<float>::max())) {
    return InvalidArgumentError(fmt::format(
        "{}: lora_alpha is {}, not a positive number that fits fp32", path, JsonExcerpt(*alpha)));
  }
  if (targets->is_string()) {
    // A regular expression: the form a multimodal Gemma 3's adapters are written in is read as
    // its names; any other string stays one name (and differs from every run's targets).
    const std::string& t = targets->get_ref<const std::string&>();
    if (t.starts_with(kLanguageModelTargetsHead) && t.ends_with(")") &&
        t.find_first_of("()", kLanguageModelTargetsHead.size()) == t.size() - 1) {
      const std::string_view names = std::string_view(t).substr(
          kLanguageModelTargetsHead.size(), t.size() - 1 - kLanguageModelTargetsHead.size());
      for (size_t at = 0; at <= names.size();) {
        const size_t bar = std::min(names.find('|', at), names.size());
        c.lora.targets.emplace_back(names.substr(at, bar - at));
        at = bar + 1;
      }
    } else {
      c.lora.targets.push_back(t);
    }
  } else if (targets->is_array()) {
    for (const json& t : *targets) {
      if (!t.is_string())
        return DataLossError(fmt::format("{}: target_modules holds a non-string", path));
      c.lora.targets.push_back(t.get<std::string>());
    }
  } else {
    return DataLossError(fmt::format("{}: target_modules is not a list of names", path));
  }
  if (const json* d = field("lora_dropout"); d && d->is_number()) {
    c.lora.dropout = d->get<double>();
    if (!(c.lora.dropout >= 0 && c.lora.dropout < 1)) {
      return InvalidArgumentError(
          fmt::format("{}: lora_dropout is {}, not a number in [0, 1)", path, JsonExcerpt(*d)));
    }
  }
  if (const json* b = field("base_model_name_or_path"); b && b->is_string()) {
    c.base_model = b->get<std::string>();
  }
  return c;
}

Status WriteLoraAdapterDir(
    const std::string& out_dir, const HfModelConfig& config, const LoraConfig& lora,
    const LoraLayout& layout, const std::string& base_model,
    const std::function<Status(int layer, std::span<float> out)>& read_layer) {
  const bool gpt2 = config.family == HfModelConfig::Family::kGpt2;
  const json cfg = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"target_modules", config.family == HfModelConfig::Family::kLlama && config.gemma3_multimodal
                             ? json(LanguageModelTargets(Sorted(lora.targets)))
                             : json(Sorted(lora.targets))},
      {"bias", "none"},
      {"fan_in_fan_out", gpt2},  // GPT-2's Conv1D base weights are (in, out)
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"base_model_name_or_path", base_model}};
  std::vector<formats::SafetensorsWriter::TensorSpec> tensors;
  const int layers = NumLayers(config);
  for (int l = 0; l < layers; ++l) {
    for (const LoraSite& s : layout.sites) {
      const std::string prefix = LoraTensorPrefix(config, l, s);
      tensors.push_back({prefix + ".lora_A.weight", DType::kF32, {layout.rank, s.module.in}});
      tensors.push_back({prefix + ".lora_B.weight", DType::kF32, {s.module.out, layout.rank}});
    }
  }
  return WriteDirectoryAtomically(out_dir, "adapter export", [&](const std::string& tmp) -> Status {
    STRATA_RETURN_IF_ERROR(WriteNewFile(tmp + "/" + kConfigFile, cfg.dump(2) + "\n", 0644));
    STRATA_ASSIGN_OR_RETURN(auto w, formats::SafetensorsWriter::Create(
                                        tmp + "/" + kWeightsFile, tensors, {{"format", "pt"}}));
    std::vector<float> chunk(layout.layer_params);
    for (int l = 0; l < layers; ++l) {
      STRATA_RETURN_IF_ERROR(read_layer(l, chunk));
      // The chunk is A then B per site, the tensors' order: appended as it is.
      STRATA_RETURN_IF_ERROR(w.Append(std::as_bytes(std::span(chunk))));
    }
    STRATA_RETURN_IF_ERROR(FinishHfShard(w, tmp + "/" + kWeightsFile));
    return FsyncDirectory(tmp);
  });
}

StatusOr<std::vector<std::string>> AdapterTargetNames(const LoraAdapterConfig& adapter,
                                                      const HfModelConfig& config,
                                                      const std::string& dir) {
  return LoraTargetNames(adapter.lora.targets, FamilyLoraModules(config), FamilyName(config),
                         fmt::format("{}/{}: target_modules", dir, kConfigFile));
}

StatusOr<std::shared_ptr<const WeightSource>> OpenLoraAdapter(const std::string& dir,
                                                              const HfModelConfig& config,
                                                              const LoraConfig& lora,
                                                              const LoraLayout& layout) {
  STRATA_ASSIGN_OR_RETURN(const LoraAdapterConfig c, ReadLoraAdapterConfig(dir));
  const std::string cfg_path = dir + "/" + kConfigFile;
  if (c.lora.rank != lora.rank) {
    return InvalidArgumentError(
        fmt::format("{}: r is {}, the run's --lora-rank {}: give --lora-rank {} or another adapter",
                    cfg_path, c.lora.rank, lora.rank, c.lora.rank));
  }
  if (std::abs(c.lora.alpha - lora.alpha) > 1e-9 * std::abs(lora.alpha)) {
    return InvalidArgumentError(fmt::format("{}: lora_alpha is {}, the run's --lora-alpha {}",
                                            cfg_path, c.lora.alpha, lora.alpha));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> adapter_targets,
                          AdapterTargetNames(c, config, dir));
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> run_targets,
                          LoraTargetNames(lora.targets, FamilyLoraModules(config),
                                          FamilyName(config), "--lora-targets"));
  if (Sorted(adapter_targets) != Sorted(run_targets)) {
    return InvalidArgumentError(fmt::format(
        "{}: target_modules are {}, the run's --lora-targets {}: give --lora-targets {}", cfg_path,
        fmt::join(Sorted(adapter_targets), ","), fmt::join(Sorted(run_targets), ","),
        fmt::join(Sorted(adapter_targets), ",")));
  }
  const std::string path = dir + "/" + kWeightsFile;
  STRATA_ASSIGN_OR_RETURN(auto file, formats::OpenSafetensorsFile(path));
  // The naming the file uses: the first of LoraTensorPrefixes whose first A matrix it holds.
  size_t style = 0;
  if (!layout.sites.empty() && NumLayers(config) > 0) {
    const std::vector<std::string> prefixes = LoraTensorPrefixes(config, 0, layout.sites.front());
    for (size_t k = 0; k < prefixes.size(); ++k) {
      if (file.header.Find(prefixes[k] + ".lora_A.weight") != nullptr) {
        style = k;
        break;
      }
    }
  }
  std::set<std::string> expected;
  for (int l = 0; l < NumLayers(config); ++l) {
    for (const LoraSite& s : layout.sites) {
      const std::string prefix = LoraTensorPrefixes(config, l, s)[style];
      for (const auto& [suffix, shape] :
           {std::pair{".lora_A.weight", std::vector<int64_t>{layout.rank, s.module.in}},
            std::pair{".lora_B.weight", std::vector<int64_t>{s.module.out, layout.rank}}}) {
        expected.insert(prefix + suffix);
        const formats::SafetensorsTensor* t = file.header.Find(prefix + suffix);
        if (t == nullptr) {
          return InvalidArgumentError(
              fmt::format("{}: no tensor '{}{}': the adapter is not for this model's layers", path,
                          prefix, suffix));
        }
        const DType d = t->dtype.dtype();
        if (t->shape != shape || t->dtype.is_u8() ||
            !(d == DType::kF32 || d == DType::kBF16 || d == DType::kF16)) {
          return InvalidArgumentError(fmt::format(
              "{}: '{}{}' is {} [{}], this model needs F32/BF16/F16 [{}] (a different base model "
              "or rank)",
              path, prefix, suffix, formats::SafetensorsDTypeName(t->dtype),
              fmt::join(t->shape, ", "), fmt::join(shape, ", ")));
        }
      }
    }
  }
  // Anything else (a modules_to_save copy, a lora_B bias, a layer past the model's) would be
  // left out of the run without a word: refused, naming it.
  for (const formats::SafetensorsTensor& t : file.header.tensors) {
    if (!expected.contains(t.name)) {
      return InvalidArgumentError(fmt::format(
          "{}: tensor '{}' is not a LoRA A/B matrix of this model's target_modules (Strata "
          "applies those only)",
          path, Excerpt(t.name)));
    }
  }
  return std::shared_ptr<const WeightSource>(
      std::make_shared<AdapterSource>(std::move(file), path, config, layout, style));
}

}  // namespace strata::models
