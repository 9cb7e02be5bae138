#include "tools/model_spec.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/untrusted_text.h"
#include "data/tokenizer.h"
#include "models/gpt.h"
#include "models/hf_bnb.h"
#include "models/hf_checkpoint.h"
#include "models/llama.h"
#include "models/lora_adapter.h"
#include "tools/option_flags.h"

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

std::string ModelSpec::default_tokenizer() const {
  if (!tokenizer.empty()) return tokenizer;
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    for (const auto& file : tokenizer_files) {
      if (std::filesystem::path(file).filename() == name) return file;
    }
  }
  return "";
}

int ModelSpec::vocab_size() const {
  return config.family == Family::kGpt2 ? config.gpt2.vocab_size : config.llama.vocab_size;
}

int ModelSpec::max_seq_len() const {
  return config.family == Family::kGpt2 ? config.gpt2.max_seq_len : config.llama.max_seq_len;
}

bool ModelSpec::byte_level() const { return vocab_size() == 256; }

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
  for (const auto& f : checkpoint->companion_files()) {
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
  if (!spec.tokenizer.empty()) j["tokenizer"] = spec.tokenizer;
  if (spec.config.family == Family::kGpt2) {
    // The GPT shape as checkpoints before Hugging Face support wrote it.
    const models::GptShape& s = spec.config.gpt2;
    j["vocab_size"] = s.vocab_size;
    j["max_seq_len"] = s.max_seq_len;
    j["num_layers"] = s.num_layers;
    j["num_heads"] = s.num_heads;
    j["channels"] = s.channels;
  }
  if (spec.base_quant.has_value()) {
    j["base_quant"] = {{"type", models::ops::Quant4TypeName(spec.base_quant->type)},
                       {"double_quant", spec.base_quant->double_quant}};
  }
  if (spec.lora.enabled()) {
    j["base"] = BaseIdentity(spec);
    j["lora"] = {{"rank", spec.lora.rank},
                 {"alpha", spec.lora.alpha},
                 {"targets", spec.lora.targets},
                 {"dropout", spec.lora.dropout}};
  }
  return j.dump();
}

StatusOr<ModelSpec> ModelSpecFromJson(const std::string& json) {
  const auto j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_object()) return DataLossError("the checkpoint's model description is not JSON");
  ModelSpec spec;
  if (j.contains("preset") && j["preset"].is_string()) spec.preset = j["preset"];
  if (j.contains("model_dir") && j["model_dir"].is_string()) spec.model_dir = j["model_dir"];
  if (j.contains("lora") && j["lora"].is_object()) {
    const auto& l = j["lora"];
    if (!l.contains("rank") || !l["rank"].is_number_integer() || l["rank"].get<int64_t>() < 1 ||
        l["rank"].get<int64_t>() > models::kMaxAdapterRank || !l.contains("alpha") ||
        !l["alpha"].is_number() || !l.contains("targets") || !l["targets"].is_array() ||
        !l.contains("dropout") || !l["dropout"].is_number()) {
      return DataLossError(
          "the checkpoint's model description has a 'lora' entry without an integer rank (1 to "
          "65536), "
          "numbers alpha and dropout and a list of targets");
    }
    spec.lora.rank = l["rank"].get<int>();
    spec.lora.alpha = l["alpha"].get<double>();
    spec.lora.dropout = l["dropout"].get<double>();
    for (const auto& t : l["targets"]) {
      if (t.is_string()) spec.lora.targets.push_back(t.get<std::string>());
    }
  }
  if (j.contains("base_quant")) {
    const auto& q = j["base_quant"];
    if (!q.is_object() || !q.contains("type") || !q["type"].is_string() ||
        !q.contains("double_quant") || !q["double_quant"].is_boolean()) {
      return DataLossError(
          "the checkpoint's model description has a 'base_quant' entry without a string type and "
          "a boolean double_quant");
    }
    STRATA_ASSIGN_OR_RETURN(const models::ops::Quant4Type type,
                            models::ops::ParseQuant4Type(q["type"].get<std::string>()));
    spec.base_quant = models::ops::Quant4Params{type, q["double_quant"].get<bool>()};
  }
  if (j.contains("tokenizer_files") && j["tokenizer_files"].is_array()) {
    for (const auto& f : j["tokenizer_files"]) {
      if (f.is_string()) spec.tokenizer_files.push_back(f);
    }
  }
  if (j.contains("tokenizer") && j["tokenizer"].is_string()) spec.tokenizer = j["tokenizer"];
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

Status UseTokenizer(const std::string& given, ModelSpec* spec) {
  namespace fs = std::filesystem;
  STRATA_ASSIGN_OR_RETURN(const std::string resolved, data::Tokenizer::FilePath(given));
  std::error_code ec;
  const fs::path file = fs::absolute(resolved, ec).lexically_normal();
  spec->tokenizer = file.string();
  const fs::path dir = file.parent_path();
  if (!spec->model_dir.empty() && dir == fs::path(spec->model_dir).lexically_normal()) {
    // The model directory's own file: already among its tokenizer files.
    if (std::find(spec->tokenizer_files.begin(), spec->tokenizer_files.end(), spec->tokenizer) ==
        spec->tokenizer_files.end()) {
      spec->tokenizer_files.push_back(spec->tokenizer);
    }
    return Status::Ok();
  }
  const auto named = [](const std::string& path, std::initializer_list<const char*> names) {
    const std::string name = fs::path(path).filename().string();
    return std::any_of(names.begin(), names.end(), [&](const char* n) { return name == n; });
  };
  std::erase_if(spec->tokenizer_files, [&](const std::string& f) {
    return named(f, {"tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"});
  });
  for (const char* name :
       {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}) {
    if (!fs::is_regular_file(dir / name, ec)) continue;
    std::erase_if(spec->tokenizer_files, [&](const std::string& f) { return named(f, {name}); });
    spec->tokenizer_files.push_back((dir / name).string());
  }
  spec->tokenizer_files.push_back(spec->tokenizer);
  return Status::Ok();
}

std::vector<models::CompanionFile> ExportedTokenizerFiles(const ModelSpec& spec) {
  std::vector<models::CompanionFile> files;
  for (const std::string& f : spec.tokenizer_files) {
    if (f != spec.tokenizer) {
      files.emplace_back(f);
    } else {
      files.emplace_back(f, f.ends_with(".json") ? "tokenizer.json" : "tokenizer.model");
    }
  }
  return files;
}

void AddLoraFlags(CLI::App& cmd, LoraFlags& f) {
  cmd.add_option("--lora-rank", f.rank,
                 "LoRA (Hu et al. 2021, as Hugging Face PEFT): train rank-R adapters on the "
                 "targeted weights and freeze the base model (no gradient, master weights or "
                 "optimizer state for it); 0 = full training")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--lora-alpha", f.alpha, "LoRA: the adapters' output is scaled by alpha / rank")
      ->capture_default_str()
      ->each([&f](const std::string&) { f.alpha_given = true; });
  cmd.add_option("--lora-targets", f.targets,
                 "LoRA: the Hugging Face module names to adapt, comma-separated (Llama: q_proj, "
                 "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2: c_attn, c_proj, "
                 "c_fc); default PEFT's: q_proj,v_proj (Llama), c_attn (GPT-2)")
      ->delimiter(',');
  cmd.add_option("--lora-dropout", f.dropout, "LoRA: dropout on the adapters' input, in [0, 1)")
      ->capture_default_str()
      ->each([&f](const std::string&) { f.dropout_given = true; });
  cmd.add_option("--lora-init", f.init,
                 "LoRA: start from this PEFT adapter directory (adapter_config.json and "
                 "adapter_model.safetensors, as strata export --lora-dir writes)");
  AddBaseQuantFlags(cmd, f.base);
}

namespace {

// "Org/Name" for a Hugging Face hub cache snapshot, .../models--Org--Name/snapshots/<revision>
// (what huggingface_hub's snapshot_download returns; the hub refuses "--" inside a repo id, so
// the folder name splits back unambiguously), else "".
std::string HubCacheRepoId(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::filesystem::path snapshots = std::filesystem::path(dir).parent_path();
  const std::string repo = snapshots.parent_path().filename().string();
  if (snapshots.filename() != "snapshots" || !repo.starts_with("models--")) return "";
  std::string id = repo.substr(std::string_view("models--").size());
  for (size_t at = id.find("--"); at != std::string::npos; at = id.find("--", at + 1)) {
    id.replace(at, 2, "/");
  }
  return id;
}

// An adapter directory's base must be this run's model: the same directory (or one of the same
// name, moved), the hub repository whose cached snapshot it is, or the same preset.
Status CheckAdapterBase(const std::string& dir, const models::LoraAdapterConfig& c,
                        const ModelSpec& spec) {
  const std::string mine = spec.model_dir.empty() ? "strata:" + spec.preset : spec.model_dir;
  const auto name = [](std::string p) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    return std::filesystem::path(p).filename().string();
  };
  const std::string repo = spec.model_dir.empty() ? "" : HubCacheRepoId(spec.model_dir);
  if (c.base_model.empty() || c.base_model == mine ||
      (!spec.model_dir.empty() && name(c.base_model) == name(spec.model_dir)) ||
      (!repo.empty() && name(c.base_model) == name(repo))) {
    return Status::Ok();
  }
  return InvalidArgumentError(fmt::format(
      "{}/adapter_config.json: base_model_name_or_path is '{}', this run's model is '{}': give "
      "--model-dir for the adapter's base, or an adapter trained on this model",
      dir, c.base_model, mine));
}

}  // namespace

Status ApplyLoraFlags(const LoraFlags& given, ModelSpec* spec, bool inference) {
  LoraFlags f = given;
  if (!f.init.empty()) {
    if (!std::filesystem::is_directory(f.init)) {
      return InvalidArgumentError(fmt::format(
          "--lora-init '{}' is not a directory (a PEFT adapter directory: adapter_config.json "
          "and adapter_model.safetensors)",
          f.init));
    }
    STRATA_ASSIGN_OR_RETURN(const models::LoraAdapterConfig c,
                            models::ReadLoraAdapterConfig(f.init));
    STRATA_RETURN_IF_ERROR(CheckAdapterBase(f.init, c, *spec));
    if (f.rank == 0) {
      // --lora-init alone: the adapter's own rank, and its alpha, targets and dropout where
      // those flags were not given (a given alpha or targets that differ are refused when the
      // adapter is opened; a given dropout is this run's choice).
      f.rank = c.lora.rank;
      if (!f.alpha_given) f.alpha = c.lora.alpha;
      if (!f.dropout_given) f.dropout = c.lora.dropout;
      if (f.targets.empty()) {
        STRATA_ASSIGN_OR_RETURN(f.targets, models::AdapterTargetNames(c, spec->config, f.init));
      }
    }
    spec->lora_init_dir = std::filesystem::absolute(f.init).string();
  }
  if (f.rank == 0) {
    if (!f.targets.empty() || f.dropout != 0) {
      return InvalidArgumentError("--lora-targets and --lora-dropout need --lora-rank R (R >= 1)");
    }
    return ApplyBaseQuantFlags(given.base, spec, inference);
  }
  spec->lora.rank = f.rank;
  spec->lora.alpha = f.alpha;
  spec->lora.dropout = f.dropout;
  spec->lora.targets = f.targets;
  if (spec->lora.targets.empty()) {
    // PEFT's defaults (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
    spec->lora.targets = spec->config.family == Family::kLlama
                             ? std::vector<std::string>{"q_proj", "v_proj"}
                             : std::vector<std::string>{"c_attn"};
  }
  return ApplyBaseQuantFlags(given.base, spec, inference);
}

std::string BaseIdentity(const ModelSpec& spec) {
  std::string s;
  if (spec.model_dir.empty()) {
    s = "preset " + spec.preset;
  } else {
    std::vector<std::string> files;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(spec.model_dir, ec)) {
      if (e.path().extension() != ".safetensors") continue;
      files.push_back(fmt::format("{} {} bytes", e.path().filename().string(), e.file_size(ec)));
    }
    std::sort(files.begin(), files.end());
    s = fmt::format("{} ({})", spec.model_dir, fmt::join(files, ", "));
  }
  if (!spec.base_quant.has_value()) return s + ", 16-bit";
  return fmt::format("{}, {}{}", s, models::ops::Quant4TypeName(spec.base_quant->type),
                     spec.base_quant->double_quant ? " with double quantization" : "");
}

Status CheckResumeBase(const ModelSpec& spec, const std::string& checkpoint_model_json,
                       const std::string& checkpoint) {
  if (!spec.lora.enabled()) return Status::Ok();
  const auto j = nlohmann::json::parse(checkpoint_model_json, nullptr, false);
  // Checkpoints from before the base was recorded carry no "base": nothing to compare.
  if (!j.is_object() || !j.contains("base") || !j["base"].is_string()) return Status::Ok();
  const std::string theirs = j["base"].get<std::string>(), mine = BaseIdentity(spec);
  if (theirs == mine) return Status::Ok();
  return InvalidArgumentError(fmt::format(
      "--resume {}: its adapters were trained over the base {}; this run's base is {}: give the "
      "same --model-dir and --base-quant",
      checkpoint, Excerpt(theirs, 200), mine));
}

void AddBaseQuantFlags(CLI::App& cmd, BaseQuantFlags& f) {
  cmd.add_option("--base-quant", f.quant,
                 "QLoRA (Dettmers et al. 2023): hold the frozen base's layer weights in 4 bits, "
                 "bitsandbytes' nf4 or fp4 layout (blocks of 64), dequantized per layer before its "
                 "products; with --lora-rank in training, the whole model in eval and generate. "
                 "none: 16-bit; auto: a bitsandbytes-4bit directory's quantization, else none")
      ->capture_default_str();
  cmd.add_option("--base-double-quant", f.double_quant,
                 "With --base-quant: quantize the per-block absmax values to 8 bits too "
                 "(bitsandbytes' bnb_4bit_use_double_quant): on, off, or auto (the directory's, "
                 "else on)")
      ->capture_default_str();
}

std::optional<models::ops::Quant4Params> DirectoryBaseQuant(const models::HfModelConfig& config) {
  // Open has refused a quantization_config it cannot read; here only its parameters matter.
  auto q = models::ParseBnbQuantizationConfig(config.raw, "config.json");
  return q.ok() ? *q : std::nullopt;
}

Status ApplyBaseQuantFlags(const BaseQuantFlags& f, ModelSpec* spec, bool inference) {
  const std::optional<models::ops::Quant4Params> dir =
      spec->model_dir.empty() ? std::nullopt : DirectoryBaseQuant(spec->config);
  if (f.double_quant != "auto" && f.double_quant != "on" && f.double_quant != "off") {
    return InvalidArgumentError(
        fmt::format("--base-double-quant '{}': choose on, off or auto", f.double_quant));
  }
  std::optional<models::ops::Quant4Params> q;
  if (f.quant == "auto") {
    q = dir;
  } else if (f.quant != "none") {
    const StatusOr<models::ops::Quant4Type> type = models::ops::ParseQuant4Type(f.quant);
    if (!type.ok()) {
      return InvalidArgumentError(
          fmt::format("--base-quant '{}': choose nf4, fp4, none or auto", f.quant));
    }
    q = models::ops::Quant4Params{*type, dir.has_value() ? dir->double_quant : true};
  }
  // Training without LoRA freezes nothing: a bitsandbytes directory's weights are read
  // dequantized (the same values), and a plain model has no base to quantize. Inference freezes
  // the whole model, so its layers can stay in 4 bits.
  if (!spec->lora.enabled() && !inference) {
    if (f.quant != "auto" && f.quant != "none") {
      return InvalidArgumentError(fmt::format(
          "--base-quant {} holds a frozen base in 4 bits, and a full fine-tune trains every "
          "weight: give --lora-rank R (QLoRA)",
          f.quant));
    }
    q.reset();
  }
  if (!q.has_value()) {
    if (f.double_quant != "auto") {
      return InvalidArgumentError(
          "--base-double-quant applies to a 4-bit base: give --base-quant nf4 or fp4");
    }
    spec->base_quant.reset();
    return Status::Ok();
  }
  if (f.double_quant != "auto") q->double_quant = f.double_quant == "on";
  if (spec->config.family != Family::kLlama) {
    return InvalidArgumentError(fmt::format(
        "--base-quant {} is built for the Llama families (their layers are nn.Linear weights), "
        "not GPT-2: use --base-quant none",
        models::ops::Quant4TypeName(q->type)));
  }
  spec->base_quant = q;
  return Status::Ok();
}

DType AutoPrecision(const ModelSpec& spec, std::string* why) {
  std::string reason = "bf16 (no config.json dtype)";
  DType d = DType::kBF16;
  const nlohmann::json& raw = spec.config.raw;
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (spec.model_dir.empty() || !raw.is_object() || !raw.contains(key) || !raw[key].is_string()) {
      continue;
    }
    const std::string name = raw[key].get<std::string>();
    const std::pair<const char*, DType> known[] = {
        {"float32", DType::kF32}, {"bfloat16", DType::kBF16}, {"float16", DType::kF16}};
    for (const auto& [n, dtype] : known) {
      if (name == n) {
        d = dtype;
        reason = fmt::format("{} ({} \"{}\" in {}/config.json)", DTypeName(dtype), key, name,
                             spec.model_dir);
        if (why != nullptr) *why = reason;
        return d;
      }
    }
    reason = fmt::format("bf16 ({} \"{}\" is not float32, bfloat16 or float16)", key, name);
    break;
  }
  if (why != nullptr) *why = reason;
  return d;
}

const models::LoraLayout* LoraLayoutOf(const engine::Model& model) {
  if (const auto* llama = dynamic_cast<const models::LlamaModel*>(&model)) return llama->lora();
  if (const auto* gpt = dynamic_cast<const models::GptModel*>(&model)) return gpt->lora();
  return nullptr;
}

StatusOr<std::unique_ptr<engine::Model>> BuildModel(const ModelSpec& spec, bool load_weights,
                                                    bool allow_tf32) {
  std::shared_ptr<const models::WeightSource> weights;
  // A LoRA run's base is never in its checkpoint: always the directory's weights.
  if ((load_weights || spec.lora.enabled()) && !spec.model_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto checkpoint, models::HfCheckpoint::Open(spec.model_dir));
    weights = std::move(checkpoint);
  }

  // LoRA: the adapters over the frozen base, from PEFT's initialisation or --lora-init's.
  // Without LoRA, a 4-bit base is an inference model's: the whole model frozen.
  auto with_lora = [&](auto& m) -> Status {
    if (!spec.lora.enabled()) {
      if (!spec.base_quant.has_value()) return Status::Ok();
      STRATA_RETURN_IF_ERROR(m->FreezeBase());
      return m->EnableBaseQuant(*spec.base_quant);
    }
    STRATA_RETURN_IF_ERROR(m->EnableLora(spec.lora));
    if (spec.base_quant.has_value()) STRATA_RETURN_IF_ERROR(m->EnableBaseQuant(*spec.base_quant));
    if (spec.lora_init_dir.empty()) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(
        auto init, models::OpenLoraAdapter(spec.lora_init_dir, spec.config, spec.lora, *m->lora()));
    m->SetLoraInit(std::move(init));
    return Status::Ok();
  };
  if (spec.config.family == Family::kLlama) {
    STRATA_ASSIGN_OR_RETURN(auto m, models::LlamaModel::Create(spec.config.llama, weights));
    STRATA_RETURN_IF_ERROR(with_lora(m));
    return std::unique_ptr<engine::Model>(std::move(m));
  }
  STRATA_ASSIGN_OR_RETURN(
      auto m, models::GptModel::Create(spec.config.gpt2, {.allow_tf32 = allow_tf32}, weights));
  STRATA_RETURN_IF_ERROR(with_lora(m));
  return std::unique_ptr<engine::Model>(std::move(m));
}

}  // namespace strata::tools
