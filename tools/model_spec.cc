#include "tools/model_spec.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "models/gpt.h"
#include "models/hf_checkpoint.h"
#include "models/llama.h"

namespace strata::tools {
namespace {

using Family = models::HfModelConfig::Family;

StatusOr<ModelSpec> PresetSpec(const std::string& name) {
  ModelSpec spec;
  spec.preset = name;
  if (auto gpt = models::GptPreset(name); gpt.ok()) {
    spec.config.family = Family::kGpt2;
    spec.config.gpt2 = *gpt;
    return spec;
  }
  if (auto gpt2 = models::Gpt2Preset(name); gpt2.ok()) {
    spec.config.family = Family::kGpt2;
    spec.config.gpt2 = *gpt2;
    return spec;
  }
  if (auto llama = models::LlamaPreset(name); llama.ok()) {
    spec.config.family = Family::kLlama;
    spec.config.llama = *llama;
    return spec;
  }
  return InvalidArgumentError(
      fmt::format("unknown model preset '{}': choose one of {}, or --model-dir DIR (a Hugging "
                  "Face directory)",
                  name, PresetNames()));
}

}  // namespace

bool ModelSpec::byte_level() const {
  const int vocab =
      config.family == Family::kGpt2 ? config.gpt2.vocab_size : config.llama.vocab_size;
  return vocab == 256;
}

std::string PresetNames() {
  std::vector<std::string> names = models::GptPresetNames();
  for (const auto& n : models::Gpt2PresetNames()) names.push_back(n);
  for (const auto& n : models::LlamaPresetNames()) names.push_back(n);
  return fmt::format("{}", fmt::join(names, ", "));
}

StatusOr<ModelSpec> ResolveModelSpec(const std::string& preset, const std::string& model_dir,
                                     bool config_only) {
  if (model_dir.empty()) return PresetSpec(preset);
  std::error_code ec;
  const std::string dir = std::filesystem::absolute(model_dir, ec).lexically_normal().string();
  if (config_only) {
    ModelSpec spec;
    spec.model_dir = dir;
    STRATA_ASSIGN_OR_RETURN(spec.config, models::ReadHfConfig(dir));
    return spec;
  }
  STRATA_ASSIGN_OR_RETURN(auto checkpoint, models::HfCheckpoint::Open(dir));
  ModelSpec spec;
  spec.model_dir = dir;
  spec.config = checkpoint->config();
  for (const auto& f : checkpoint->tokenizer_files()) {
    spec.tokenizer_files.push_back(std::filesystem::path(f).is_absolute() ? f : dir + "/" + f);
  }
  return spec;
}

std::string ModelSpecJson(const ModelSpec& spec) {
  nlohmann::json j = {
      {"family", spec.config.family == Family::kLlama ? "llama" : "gpt2"},
      {"preset", spec.preset},
      {"model_dir", spec.model_dir},
      {"hf_config", nlohmann::json::parse(models::HfConfigJson(spec.config))},
      {"tokenizer_files", spec.tokenizer_files},
  };
  if (spec.config.family == Family::kGpt2) {
    // The GPT shape as checkpoints before Hugging Face support wrote it.
    const models::GptShape& s = spec.config.gpt2;
    j["vocab_size"] = s.vocab_size;
    j["max_seq_len"] = s.max_seq_len;
    j["num_layers"] = s.num_layers;
    j["num_heads"] = s.num_heads;
    j["channels"] = s.channels;
  }
  return j.dump();
}

StatusOr<ModelSpec> ModelSpecFromJson(const std::string& json) {
  const auto j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_object()) return DataLossError("the checkpoint's model description is not JSON");
  ModelSpec spec;
  if (j.contains("preset") && j["preset"].is_string()) spec.preset = j["preset"];
  if (j.contains("model_dir") && j["model_dir"].is_string()) spec.model_dir = j["model_dir"];
  if (j.contains("tokenizer_files") && j["tokenizer_files"].is_array()) {
    for (const auto& f : j["tokenizer_files"]) {
      if (f.is_string()) spec.tokenizer_files.push_back(f);
    }
  }
  if (j.contains("hf_config")) {
    STRATA_ASSIGN_OR_RETURN(spec.config,
                            models::ParseHfConfig(j["hf_config"].dump(), "checkpoint manifest"));
    return spec;
  }
  // A byte-level GPT checkpoint of an earlier version: the shape's fields.
  models::GptShape s;
  for (auto [key, out] : {std::pair{"vocab_size", &s.vocab_size},
                          {"max_seq_len", &s.max_seq_len},
                          {"num_layers", &s.num_layers},
                          {"num_heads", &s.num_heads},
                          {"channels", &s.channels}}) {
    if (!j.contains(key) || !j[key].is_number_integer()) {
      return DataLossError(
          fmt::format("the checkpoint's model description has no integer '{}'", key));
    }
    *out = j[key].get<int>();
  }
  STRATA_RETURN_IF_ERROR(models::ValidateShape(s).WithContext("the checkpoint's model"));
  spec.config.family = Family::kGpt2;
  spec.config.gpt2 = s;
  return spec;
}

StatusOr<std::unique_ptr<engine::Model>> BuildModel(const ModelSpec& spec, bool load_weights,
                                                    bool allow_tf32) {
  std::shared_ptr<const models::WeightSource> weights;
  if (load_weights && !spec.model_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto checkpoint, models::HfCheckpoint::Open(spec.model_dir));
    weights = std::move(checkpoint);
  }
  if (spec.config.family == Family::kLlama) {
    STRATA_ASSIGN_OR_RETURN(auto m, models::LlamaModel::Create(spec.config.llama, weights));
    return std::unique_ptr<engine::Model>(std::move(m));
  }
  STRATA_ASSIGN_OR_RETURN(
      auto m, models::GptModel::Create(spec.config.gpt2, {.allow_tf32 = allow_tf32}, weights));
  return std::unique_ptr<engine::Model>(std::move(m));
}

}  // namespace strata::tools
