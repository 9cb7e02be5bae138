#include "tools/eval_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "base/dtype.h"
#include "base/file.h"
#include "base/units.h"
#include "base/untrusted_text.h"
#include "data/example_dataset.h"
#include "data/preference_dataset.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/plan/plan_choice.h"
#include "engine/plan/planner.h"
#include "engine/preference_objective.h"
#include "tools/device_select.h"
#include "tools/model_spec.h"
#include "tools/option_flags.h"
#include "tools/preference_training.h"
#include "tools/sampling.h"

namespace strata::tools {
namespace {

// The LoRA flags of an adapter directory given to eval or generate: its own config says the rest.
LoraFlags LoraInitFlags(const InferenceFlags& f) {
  LoraFlags flags;
  flags.init = f.lora;
  flags.base = f.base;
  return flags;
}

// A checkpoint records its model, 4-bit base included: the base flags have nothing to choose.
Status CheckCheckpointBase(const InferenceFlags& f) {
  if (f.base.quant == "auto" && f.base.double_quant == "auto") return Status::Ok();
  return InvalidArgumentError(
      "--base-quant and --base-double-quant choose how --model-dir's weights are held; a "
      "checkpoint records its own (a QLoRA run's 4-bit base): drop them");
}

void AddInferenceFlags(CLI::App& cmd, InferenceFlags& f) {
  cmd.add_option("--model-dir", f.model_dir,
                 "A Hugging Face model directory (config.json + safetensors)");
  cmd.add_option("--checkpoint", f.checkpoint,
                 "A Strata checkpoint directory, or a save directory with 'latest'");
  cmd.add_option("--precision", f.precision,
                 "Working precision: bf16, fp16, fp32, or auto (the checkpoint's, else the "
                 "--model-dir config.json torch_dtype, else bf16)")
      ->capture_default_str();
  cmd.add_option("--device", f.device, "auto, host or cuda")->capture_default_str();
  cmd.add_option("--lora", f.lora,
                 "With --model-dir: a LoRA adapter directory (PEFT's layout, as strata export "
                 "--lora-dir writes) applied over the model");
  AddBaseQuantFlags(cmd, f.base);
  cmd.add_option("--device-budget", f.device_budget,
                 "Device memory for the arena, e.g. 8GiB; auto = midway between the streaming "
                 "minimum and the working params alone")
      ->capture_default_str();
}

// A model with its working params ready: an inference-only engine on a device.
struct Loaded {
  ModelSpec spec;
  std::unique_ptr<engine::Model> model;
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<engine::Engine> engine;
};

// A model as a command names it, resolved without building it: its description, the checkpoint
// directory it loads (or ""), and its working precision.
struct Resolved {
  ModelSpec spec;
  std::string checkpoint_dir;
  DType precision = DType::kBF16;
};

StatusOr<Resolved> Resolve(const InferenceFlags& f) {
  if (f.model_dir.empty() == f.checkpoint.empty()) {
    return InvalidArgumentError("give exactly one of --model-dir DIR and --checkpoint DIR");
  }
  Resolved r;
  std::string precision_name = f.precision;
  if (!f.checkpoint.empty()) {
    STRATA_ASSIGN_OR_RETURN(r.checkpoint_dir, engine::ResolveCheckpointDir(f.checkpoint));
    STRATA_ASSIGN_OR_RETURN(engine::Manifest m, engine::ReadManifest(r.checkpoint_dir));
    STRATA_ASSIGN_OR_RETURN(r.spec, ModelSpecFromJson(m.trainer.model_json));
    STRATA_RETURN_IF_ERROR(CheckCheckpointBase(f));
    if (precision_name == "auto") precision_name = m.precision;
  } else {
    STRATA_ASSIGN_OR_RETURN(r.spec, ResolveModelSpec("", f.model_dir));
    STRATA_RETURN_IF_ERROR(ApplyLoraFlags(LoraInitFlags(f), &r.spec, /*inference=*/true));
  }
  if (!f.lora.empty() && f.model_dir.empty()) {
    return InvalidArgumentError(
        "--lora applies an adapter over --model-dir DIR; a LoRA checkpoint carries its own");
  }
  if (precision_name == "auto") {
    // A directory's config.json dtype, as transformers loads it.
    r.precision = AutoPrecision(r.spec, nullptr);
  } else {
    STRATA_ASSIGN_OR_RETURN(r.precision, ParseDType(precision_name));
  }
  return r;
}

// objective_buffers: the plan holds a sequence objective's per-target losses
// (Engine::EvaluateTargetLosses); reference: and, for a model with a frozen reference (LoRA),
// the reference's forward beside each block's (Engine::EvaluatePolicyAndReference). f: where the
// model runs (--device, --device-budget).
StatusOr<Loaded> Build(Resolved r, const InferenceFlags& f, engine::MicroBatchShape shape,
                       bool objective_buffers = false, bool reference = false) {
  Loaded l;
  l.spec = std::move(r.spec);
  const DType precision = r.precision;
  STRATA_ASSIGN_OR_RETURN(l.model, BuildModel(l.spec, /*load_weights=*/r.checkpoint_dir.empty()));
  if (shape.seq_len > l.model->max_seq_len()) {
    return InvalidArgumentError(fmt::format("--seq-len {} exceeds the model's context of {}",
                                            shape.seq_len, l.model->max_seq_len()));
  }
  engine::EngineOptions o;
  o.precision = precision;
  o.micro_batch = shape;
  o.inference_only = true;
  o.placement.param_home = engine::ParamHome::kHost;
  o.placement.optimizer_home = engine::OptimizerHome::kHost;
  o.placement.objective.target_weights = objective_buffers;
  o.placement.objective.reference_forward =
      objective_buffers && reference && l.model->has_frozen_reference();
  // The plan, chosen once (engine/plan/plan_choice.h): an auto budget is the plan's own.
  engine::PlanRequest request;
  request.precision = precision;
  request.micro_batch = shape;
  request.placement = o.placement;
  request.automatic.device_budget = f.device_budget == "auto";
  if (!request.automatic.device_budget) {
    STRATA_ASSIGN_OR_RETURN(request.placement.device_budget_bytes, ParseSize(f.device_budget));
  }
  STRATA_ASSIGN_OR_RETURN(engine::PlanChoice choice,
                          engine::ChoosePlan(*l.model, request, /*machine=*/nullptr));
  o.placement = choice.placement;
  STRATA_ASSIGN_OR_RETURN(l.device, CreateDeviceFromFlag(f.device, {}));
  STRATA_ASSIGN_OR_RETURN(
      l.engine, engine::Engine::Create(l.model.get(), l.device.get(), o, std::move(choice.plan)));
  if (!r.checkpoint_dir.empty()) {
    engine::TrainerState trainer;
    STRATA_RETURN_IF_ERROR(l.engine->LoadCheckpoint(r.checkpoint_dir, &trainer));
  }
  return l;
}

StatusOr<Loaded> Load(const InferenceFlags& f, engine::MicroBatchShape shape) {
  STRATA_ASSIGN_OR_RETURN(Resolved r, Resolve(f));
  return Build(std::move(r), f, shape);
}

}  // namespace

void AddEvalFlags(CLI::App& cmd, EvalFlags& f) {
  AddInferenceFlags(cmd, f.model);
  cmd.add_option("--data", f.data,
                 "Token files in llm.c's format (several, or a glob: shards read in order)")
      ->required();
  cmd.add_option("--seq-len", f.seq_len, "Tokens per window (<= the model's context)")
      ->required()
      ->check(PositiveNumber());
  cmd.add_option("--max-tokens", f.max_tokens,
                 "Only the windows within the first N tokens; 0 = the whole data")
      ->capture_default_str()
      ->check(NonNegativeNumber());
  cmd.add_option("--micro-batch-size", f.micro_batch_size, "Windows per forward pass")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_flag("--json", f.json,
               "Print one JSON object: loss, perplexity, tokens (target positions), windows");
  cmd.add_flag("--pack", f.pack,
               "Instruction data (token files with flags): pack several examples into each row, "
               "as train --pack does");
  cmd.add_option("--long-examples", f.long_examples,
                 "Instruction data: an example longer than --seq-len is truncated or skipped")
      ->check(CLI::IsMember({"truncate", "skip"}))
      ->capture_default_str();
  cmd.add_option("--objective", f.objective,
                 "Preference data: score the pairs with dpo, ipo or simpo and TRL's metrics "
                 "(DPO and IPO compare with a reference: a LoRA model's base, else "
                 "--reference-model-dir or --reference-checkpoint); sft: the cross-entropy of "
                 "every completion")
      ->check(CLI::IsMember({"sft", "dpo", "ipo", "simpo"}))
      ->capture_default_str();
  cmd.add_option("--beta", f.beta, "DPO and SimPO: beta; IPO: tau")->capture_default_str();
  cmd.add_option("--label-smoothing", f.label_smoothing, "DPO and SimPO: label smoothing")
      ->capture_default_str();
  cmd.add_option("--simpo-gamma", f.simpo_gamma, "SimPO: the target reward margin")
      ->capture_default_str();
  cmd.add_option("--rpo-alpha", f.rpo_alpha,
                 "DPO and IPO: the NLL term's weight in the loss (as train's)")
      ->capture_default_str();
  cmd.add_option("--cpo-alpha", f.cpo_alpha,
                 "SimPO: the NLL term's weight in the loss (as train's)")
      ->capture_default_str();
  cmd.add_option("--reference-model-dir", f.reference_model_dir,
                 "DPO and IPO of a full model: the reference model, a Hugging Face directory (the "
                 "run's initial weights reproduce training's validation); evaluated first, alone "
                 "in memory, in the model's working precision");
  cmd.add_option("--reference-checkpoint", f.reference_checkpoint,
                 "DPO and IPO of a full model: the reference model as a Strata checkpoint");
}

namespace {

void PrintEval(const EvalFlags& f, const Loaded& l, double loss, int64_t targets, int64_t rows,
               const std::string& what) {
  if (f.json) {
    std::printf(
        "%s\n",
        nlohmann::json{
            {"loss", loss}, {"perplexity", std::exp(loss)}, {"tokens", targets}, {"windows", rows}}
            .dump()
            .c_str());
    return;
  }
  std::printf("%s\n", l.model->description().c_str());
  std::printf("eval: %s (%lld targets): loss %.6f nats/token, perplexity %.4f\n", what.c_str(),
              static_cast<long long>(targets), loss, std::exp(loss));
}

// "token file 'a.bin'", or "3 token files ('a' ... 'c')": what a message about --data names.
std::string NameFiles(const data::TokenDataset& d) {
  const std::vector<std::string> paths = d.paths();
  if (paths.size() == 1) return fmt::format("token file '{}'", paths[0]);
  return fmt::format("{} token files ('{}' ... '{}')", paths.size(), paths.front(), paths.back());
}

// Instruction data: every row of whole examples, the mean over the targets in the loss.
Status EvalExamples(const EvalFlags& f, const Loaded& l, data::TokenDataset tokens) {
  const int T = f.seq_len;
  if (f.max_tokens > 0) {
    return InvalidArgumentError(
        "--max-tokens cuts plain token files; instruction data (a file with per-token flags) is "
        "evaluated whole, example by example: drop --max-tokens");
  }
  const data::ExampleRowOptions rows{.seq_len = T,
                                     .pack = f.pack,
                                     .long_examples = f.long_examples == "skip"
                                                          ? data::LongExamples::kSkip
                                                          : data::LongExamples::kTruncate};
  // The file is both splits: its rows are the validation split's.
  STRATA_ASSIGN_OR_RETURN(data::ExampleDataset d,
                          data::ExampleDataset::CreateWhole(tokens, rows, NameFiles(tokens)));
  const data::ExampleDataset::SplitStats& s = d.val_stats();
  double sum = 0;  // of per-target losses
  int64_t counted = 0;
  data::Batch batch;
  for (int64_t r = 0; r < s.rows; r += f.micro_batch_size) {
    const int B = static_cast<int>(std::min<int64_t>(f.micro_batch_size, s.rows - r));
    d.ValRows(r, B, T, &batch);
    const int64_t c = std::count_if(batch.targets.begin(), batch.targets.end(),
                                    [](int32_t t) { return t != engine::kIgnoreTarget; });
    if (c == 0) continue;  // rows of prompts only: nothing to score
    STRATA_ASSIGN_OR_RETURN(
        float loss, l.engine->EvaluateLoss({batch.tokens, batch.targets, batch.positions}, {B, T}));
    sum += static_cast<double>(loss) * static_cast<double>(c);
    counted += c;
  }
  if (counted == 0) {
    return InvalidArgumentError(
        "the instruction data has no target in the loss (no response tokens): nothing to "
        "evaluate");
  }
  PrintEval(f, l, sum / static_cast<double>(counted), counted, s.rows,
            fmt::format(
                "{} examples in {} rows of {} tokens{}{}{}", s.examples, s.rows, T,
                f.pack ? ", packed" : "",
                s.truncated > 0 ? fmt::format("; {} truncated", s.truncated) : "",
                s.no_target > 0 ? fmt::format("; {} without a target skipped", s.no_target) : ""));
  return Status::Ok();
}

// The reference model's flags: where and how it runs as the model does, its own weights, no
// adapter and its own base.
InferenceFlags ReferenceFlags(const EvalFlags& f) {
  InferenceFlags r = f.model;
  r.model_dir = f.reference_model_dir;
  r.checkpoint = f.reference_checkpoint;
  r.lora.clear();
  r.base = BaseQuantFlags{};
  return r;
}

// Preference data with --objective: every pair, laid out as training validates it. The
// reference of DPO and IPO: a LoRA model's base (in the same pass), or a full model's reference
// model, whose log-probabilities are computed first, with it alone in memory.
Status EvalPreference(const EvalFlags& f, const engine::PreferenceOptions& p) {
  const bool reference_model = !f.reference_model_dir.empty() || !f.reference_checkpoint.empty();
  STRATA_ASSIGN_OR_RETURN(Resolved policy, Resolve(f.model));
  const bool lora = policy.spec.lora.enabled();
  if (reference_model) {
    if (!p.uses_reference()) {
      return InvalidArgumentError(
          fmt::format("--objective {} has no reference model: drop --reference-model-dir and "
                      "--reference-checkpoint",
                      f.objective));
    }
    if (!f.reference_model_dir.empty() && !f.reference_checkpoint.empty()) {
      return InvalidArgumentError(
          "give one of --reference-model-dir DIR and --reference-checkpoint DIR");
    }
    if (lora) {
      return InvalidArgumentError(
          "a LoRA model's reference is its own base (adapters off), as in training: drop "
          "--reference-model-dir and --reference-checkpoint");
    }
  } else if (p.uses_reference() && !lora) {
    return InvalidArgumentError(fmt::format(
        "--objective {} compares the model with a reference: give the reference model with "
        "--reference-model-dir DIR or --reference-checkpoint DIR (the run's initial weights), "
        "evaluate a LoRA model (its base is the reference), or use --objective simpo",
        f.objective));
  }
  const int vocab = policy.spec.vocab_size();
  STRATA_ASSIGN_OR_RETURN(auto tokens, data::TokenDataset::Open(f.data, vocab));
  if (!tokens.has_flags() || !data::HasPairStarts(tokens)) {
    return InvalidArgumentError(fmt::format(
        "--objective {} scores preference pairs; {} holds none (`strata tokenize` of JSONL "
        "with \"prompt\", \"chosen\" and \"rejected\")",
        f.objective, NameFiles(tokens)));
  }
  const data::PreferenceBatchOptions rows{.seq_len = f.seq_len,
                                          .micro_batch_size = f.micro_batch_size,
                                          .pack = f.pack,
                                          .long_examples = f.long_examples == "skip"
                                                               ? data::LongExamples::kSkip
                                                               : data::LongExamples::kTruncate};
  // The file is both splits: its micro-batches are the validation split's.
  const std::string name = NameFiles(tokens);
  STRATA_ASSIGN_OR_RETURN(data::PreferenceDataset d,
                          data::PreferenceDataset::Create(tokens, tokens, rows, name));
  PreferenceTraining scorer(p, &d, /*reference_from_model=*/!reference_model, f.micro_batch_size,
                            f.seq_len);
  const engine::MicroBatchShape shape{f.micro_batch_size, f.seq_len};
  std::string reference_name;
  if (reference_model) {
    const InferenceFlags rf = ReferenceFlags(f);
    reference_name = rf.model_dir.empty() ? rf.checkpoint : rf.model_dir;
    STRATA_ASSIGN_OR_RETURN(Resolved r, Resolve(rf));
    // In the model's working precision, as training computes its reference.
    r.precision = policy.precision;
    if (r.spec.vocab_size() != vocab) {
      return InvalidArgumentError(fmt::format(
          "the reference model {} has a vocabulary of {}; the model's is {}: a reference scores "
          "the same tokens",
          reference_name, r.spec.vocab_size(), vocab));
    }
    STRATA_ASSIGN_OR_RETURN(Loaded ref, Build(std::move(r), rf, shape, /*objective_buffers=*/true));
    STRATA_RETURN_IF_ERROR(scorer.ComputeValidationReference(*ref.engine));
  }  // the reference model is released before the model is built
  STRATA_ASSIGN_OR_RETURN(Loaded l,
                          Build(std::move(policy), f.model, shape, /*objective_buffers=*/true,
                                /*reference=*/p.uses_reference() && !reference_model));
  STRATA_ASSIGN_OR_RETURN(const engine::PreferenceMetrics m, scorer.Evaluate(*l.engine));
  if (f.json) {
    nlohmann::json j = PreferenceTraining::Json(m);
    j["objective"] = f.objective;
    std::printf("%s\n", j.dump().c_str());
    return Status::Ok();
  }
  std::printf("%s\n", l.model->description().c_str());
  if (reference_model) std::printf("reference: %s\n", reference_name.c_str());
  std::printf("eval: %lld pairs of %s: %s loss %.6f | %s\n", static_cast<long long>(m.pairs),
              name.c_str(), f.objective.c_str(), m.loss, scorer.MetricsLine(m).c_str());
  return Status::Ok();
}

}  // namespace

Status RunEval(const EvalFlags& f) {
  const int T = f.seq_len;
  STRATA_ASSIGN_OR_RETURN(const std::optional<engine::PreferenceOptions> preference,
                          PreferenceOptionsFromFlags(f.objective, f.beta, f.label_smoothing,
                                                     f.simpo_gamma, f.rpo_alpha, f.cpo_alpha));
  if (preference) return EvalPreference(f, *preference);
  if (!f.reference_model_dir.empty() || !f.reference_checkpoint.empty()) {
    return InvalidArgumentError(
        "--reference-model-dir and --reference-checkpoint are DPO's and IPO's reference: give "
        "--objective dpo or ipo with preference data");
  }
  STRATA_ASSIGN_OR_RETURN(Loaded l, Load(f.model, {f.micro_batch_size, T}));
  STRATA_ASSIGN_OR_RETURN(auto data, data::TokenDataset::Open(f.data, l.model->vocab_size()));
  if (data.has_flags()) return EvalExamples(f, l, std::move(data));
  const int64_t windows = data.num_windows(T, f.max_tokens);
  if (windows == 0) {
    return InvalidArgumentError(fmt::format(
        "{} ({} tokens) holds no full window of {} + 1 tokens{}", NameFiles(data),
        data.num_tokens(), T,
        f.max_tokens > 0 ? fmt::format(" within the first {} tokens", f.max_tokens) : ""));
  }
  double sum = 0;  // of per-token losses
  std::vector<int32_t> tokens, targets;
  for (int64_t w = 0; w < windows; w += f.micro_batch_size) {
    const int B = static_cast<int>(std::min<int64_t>(f.micro_batch_size, windows - w));
    tokens.resize(static_cast<size_t>(B) * T);
    targets.resize(tokens.size());
    for (int b = 0; b < B; ++b) {
      data.EvalWindow(w + b, T, tokens.data() + b * T, targets.data() + b * T);
    }
    STRATA_ASSIGN_OR_RETURN(float loss, l.engine->EvaluateLoss({tokens, targets}, {B, T}));
    sum += static_cast<double>(loss) * B * T;
  }
  const int64_t counted = windows * T;
  PrintEval(f, l, sum / static_cast<double>(counted), counted, windows,
            fmt::format("{} windows of {} tokens", windows, T));
  return Status::Ok();
}

namespace {

// The eos_token_id of a generation_config.json or config.json object `j` (a number or a list of
// numbers), appended to *ids; absent or null adds nothing. Errors name `path` and the key.
Status AppendEosIds(const nlohmann::json& j, const std::string& path, std::vector<int32_t>* ids) {
  if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) {
    return Status::Ok();
  }
  const nlohmann::json& v = j["eos_token_id"];
  auto append = [&](const nlohmann::json& id) -> Status {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidArgumentError(
          fmt::format("{}: eos_token_id holds {}, not a token id", path, JsonExcerpt(id)));
    }
    ids->push_back(static_cast<int32_t>(id.get<int64_t>()));
    return Status::Ok();
  };
  if (!v.is_array()) return append(v);
  for (const nlohmann::json& id : v) STRATA_RETURN_IF_ERROR(append(id));
  return Status::Ok();
}

// The model's generation_config.json, read and parsed once: the copy a run recorded, else the
// model directory's. `path` is "" (and `json` null) when neither exists.
struct GenerationConfigFile {
  std::string path;
  nlohmann::json json;
};

StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, {.max_bytes = 1 << 20}));
  auto j = ParseJsonBounded(text);
  if (!j.ok()) return InvalidArgumentError(fmt::format("{}: {}", path, j.status().message()));
  return std::move(*j);
}

StatusOr<GenerationConfigFile> ReadGenerationConfig(const ModelSpec& spec) {
  GenerationConfigFile g;
  for (const std::string& f : spec.tokenizer_files) {
    if (std::filesystem::path(f).filename() == "generation_config.json") g.path = f;
  }
  std::error_code ec;
  if (g.path.empty() && !spec.model_dir.empty()) {
    g.path = spec.model_dir + "/generation_config.json";
  }
  if (!std::filesystem::is_regular_file(g.path, ec)) return GenerationConfigFile{};
  STRATA_ASSIGN_OR_RETURN(g.json, ReadJsonFile(g.path));
  return g;
}

// The ids that end a generation, as transformers' generate() takes them: generation_config.json's
// eos_token_id (one id or a list: Gemma 3's <end_of_turn> beside <eos>, Llama 3's <|eot_id|>),
// else config.json's (at the top, else a multimodal config's text_config); and the tokenizer's
// EOS. The files are the model directory's (a run's: the one it started from, or the copy of
// generation_config.json it recorded), where they still exist.
StatusOr<std::vector<int32_t>> EndOfGenerationIds(const ModelSpec& spec,
                                                  const GenerationConfigFile& generation_config,
                                                  const data::Tokenizer* tokenizer) {
  std::vector<int32_t> ids;
  if (tokenizer != nullptr) ids.push_back(tokenizer->eos_id());
  std::error_code ec;
  const size_t before = ids.size();
  if (!generation_config.path.empty()) {
    STRATA_RETURN_IF_ERROR(AppendEosIds(generation_config.json, generation_config.path, &ids));
  }
  const std::string config = spec.model_dir + "/config.json";
  if (ids.size() == before && !spec.model_dir.empty() &&
      std::filesystem::is_regular_file(config, ec)) {
    STRATA_ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonFile(config));
    STRATA_RETURN_IF_ERROR(AppendEosIds(j, config, &ids));
    if (ids.size() == before && j.is_object() && j.contains("text_config")) {
      STRATA_RETURN_IF_ERROR(AppendEosIds(j["text_config"], config + " text_config", &ids));
    }
  }
  return ids;
}

}  // namespace

void AddGenerateFlags(CLI::App& cmd, GenerateFlags& f) {
  AddInferenceFlags(cmd, f.model);
  cmd.add_option("--prompt", f.prompt, "Text to continue")->required();
  cmd.add_option("--tokenizer", f.tokenizer,
                 "tokenizer.model, tokenizer.json or a model directory (default: the model's or "
                 "run's, tokenizer.model first; byte-level models need none)");
  cmd.add_option("--max-new-tokens", f.max_new_tokens, "Tokens to sample")
      ->capture_default_str()
      ->check(PositiveNumber());
  cmd.add_option("--temperature", f.temperature,
                 "Sampling temperature; 0 = greedy (default: the model's generation_config.json, "
                 "greedy when its do_sample is false; without one 0.8)")
      ->check(NonNegativeNumber());
  cmd.add_option("--top-k", f.top_k,
                 "Sample among the k most likely tokens (and those tied with the k-th); 0 = all "
                 "(default: generation_config.json's, else 40)")
      ->check(NonNegativeNumber());
  cmd.add_option("--top-p", f.top_p,
                 "Sample among the most likely tokens until their probability reaches p "
                 "(default: generation_config.json's, else 1 = all)")
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--repetition-penalty", f.repetition_penalty,
                 "Divide the logits of tokens already in the text by this (multiply negative "
                 "ones) (default: generation_config.json's, else 1 = none)")
      ->check(PositiveNumber());
  cmd.add_option("--seed", f.seed, "Sampling seed")->capture_default_str();
}

namespace {

// The sampling of a generation: the flags given, over generation_config.json's, over Strata's
// defaults without one; notes for what the file asks that is not applied.
StatusOr<SamplingSettings> GenerateSampling(const GenerateFlags& f,
                                            const GenerationConfigFile& generation_config,
                                            std::vector<std::string>* notes) {
  SamplingSettings s;  // without generation_config.json: temperature 0.8, top-k 40
  if (!generation_config.path.empty()) {
    STRATA_ASSIGN_OR_RETURN(
        GenerationConfigSampling g,
        ParseGenerationConfigSampling(generation_config.json, generation_config.path));
    s = g.settings;
    *notes = std::move(g.notes);
  }
  if (f.temperature) {
    s.greedy = *f.temperature == 0;
    if (!s.greedy) s.temperature = *f.temperature;
  }
  if (f.top_k) s.top_k = *f.top_k;
  if (f.top_p) s.top_p = *f.top_p;
  if (f.repetition_penalty) s.repetition_penalty = *f.repetition_penalty;
  return s;
}

}  // namespace

Status RunGenerate(const GenerateFlags& f) {
  // The model first (its spec names the tokenizer), with a context of one sequence.
  const InferenceFlags& mf = f.model;
  STRATA_ASSIGN_OR_RETURN(Resolved resolved, Resolve(mf));
  const ModelSpec& spec = resolved.spec;
  const std::string tokenizer_path = f.tokenizer.empty() ? spec.default_tokenizer() : f.tokenizer;
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::vector<int32_t> context;
  std::vector<int32_t> prompt_ids;
  if (!tokenizer_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(tokenizer, data::Tokenizer::Load(tokenizer_path));
    if (tokenizer->adds_bos()) context.push_back(tokenizer->bos_id());
    STRATA_ASSIGN_OR_RETURN(prompt_ids, tokenizer->Encode(f.prompt));
    context.insert(context.end(), prompt_ids.begin(), prompt_ids.end());
  } else if (spec.byte_level()) {
    for (unsigned char c : f.prompt) context.push_back(c);
  } else {
    return InvalidArgumentError(
        "this model's vocabulary is not bytes: give --tokenizer with its tokenizer.model or "
        "tokenizer.json");
  }
  if (context.empty()) return InvalidArgumentError("the prompt has no tokens");
  const int context_len = spec.max_seq_len();
  if (static_cast<int64_t>(context.size()) > context_len) {
    return InvalidArgumentError(fmt::format(
        "the prompt is {} tokens, more than the model's context of {}: shorten --prompt",
        context.size(), context_len));
  }
  STRATA_ASSIGN_OR_RETURN(const GenerationConfigFile generation_config, ReadGenerationConfig(spec));
  STRATA_ASSIGN_OR_RETURN(const std::vector<int32_t> end_ids,
                          EndOfGenerationIds(spec, generation_config, tokenizer.get()));
  std::vector<std::string> notes;
  STRATA_ASSIGN_OR_RETURN(const SamplingSettings sampling,
                          GenerateSampling(f, generation_config, &notes));
  for (const std::string& note : notes) std::fprintf(stderr, "note: %s\n", note.c_str());
  // Ids a tokenizer cannot decode (a vocabulary padded past the tokenizer's) are never sampled.
  const int64_t vocab_limit =
      tokenizer ? tokenizer->vocab_size() : std::numeric_limits<int64_t>::max();
  const int max_len = static_cast<int>(
      std::min<int64_t>(context_len, static_cast<int64_t>(context.size()) + f.max_new_tokens));
  STRATA_ASSIGN_OR_RETURN(Loaded l, Build(std::move(resolved), mf, {1, max_len}));
  std::mt19937_64 rng(f.seed);
  std::vector<int32_t> generated;
  bool stopped_at_context = true;
  for (int i = 0; i < f.max_new_tokens; ++i) {
    if (static_cast<int>(context.size()) >= context_len) break;
    STRATA_ASSIGN_OR_RETURN(auto logits, l.engine->NextTokenLogits(context));
    const int32_t next = SampleNextToken(logits, sampling, vocab_limit, context, rng);
    if (std::find(end_ids.begin(), end_ids.end(), next) != end_ids.end()) {
      stopped_at_context = false;
      break;
    }
    context.push_back(next);
    generated.push_back(next);
  }
  if (stopped_at_context && static_cast<int>(generated.size()) < f.max_new_tokens) {
    std::fprintf(stderr, "note: stopped after %zu new tokens at the model's context of %d\n",
                 generated.size(), context_len);
  }
  std::string text;
  if (tokenizer) {
    // Decoded with the prompt and cut after the prompt's text, as transformers' pipelines do: a
    // decoder that strips the first token's leading space (SentencePiece, Llama 2's and
    // Mistral's tokenizer.json) would otherwise drop the space between prompt and continuation.
    STRATA_ASSIGN_OR_RETURN(const std::string prompt_text, tokenizer->Decode(prompt_ids));
    std::vector<int32_t> all = prompt_ids;
    all.insert(all.end(), generated.begin(), generated.end());
    STRATA_ASSIGN_OR_RETURN(const std::string all_text, tokenizer->Decode(all));
    if (all_text.starts_with(prompt_text)) {
      text = all_text.substr(prompt_text.size());
    } else {
      STRATA_ASSIGN_OR_RETURN(text, tokenizer->Decode(generated));
    }
  } else {
    for (int32_t t : generated) text.push_back(static_cast<char>(t));
  }
  // Written whole: a NUL among the bytes ends nothing.
  text = f.prompt + text + "\n";
  std::fwrite(text.data(), 1, text.size(), stdout);
  return Status::Ok();
}

}  // namespace strata::tools
