// Which model a command runs, as one description: a named preset (random initialisation: the
// byte-level GPT demo presets, llama-*, gpt2*) or a Hugging Face directory (--model-dir). The
// description rebuilds the model, travels in a checkpoint's manifest (TrainerState::model_json)
// so `strata eval/generate/export --checkpoint` know the model, and names the tokenizer files a
// run used so an export can copy them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/plan/model.h"
#include "models/hf_config.h"
#include "models/hf_export.h"
#include "models/lora.h"
#include "models/ops/quantize_4bit.h"

namespace CLI {
class App;
}

namespace strata::tools {

struct ModelSpec {
  std::string preset;            // the preset's name, or "" for a directory
  std::string model_dir;         // the Hugging Face directory (absolute), or ""
  models::HfModelConfig config;  // family and shape; the byte-level presets are untied GPT-2s
  std::vector<std::string> tokenizer_files;  // absolute paths (model_dir's, or --tokenizer's)
  // The file a run tokenized its text with when --tokenizer named one (absolute; one of
  // tokenizer_files), else "": the model directory's. Exported as tokenizer.json or
  // tokenizer.model whatever its own name.
  std::string tokenizer;
  // LoRA (models/lora.h): the base model frozen, adapters trained; rank 0 = none. The adapters
  // start from lora_init_dir (a PEFT adapter directory, absolute) when it is set.
  models::LoraConfig lora;
  std::string lora_init_dir;
  // QLoRA's 4-bit base (models/base_quant.h): with LoRA, the frozen layers held in 4 bits;
  // without (eval, generate only), the whole model frozen for inference
  // (DecoderModel::FreezeBase), its layers in 4 bits. nullopt: 16-bit.
  std::optional<models::ops::Quant4Params> base_quant;
  int vocab_size() const;   // the family config's
  int max_seq_len() const;  // the family config's context
  bool byte_level() const;  // a vocabulary of 256: tokens are bytes, text needs no tokenizer
  // The tokenizer text is read with by default: the model's tokenizer.model (SentencePiece) when
  // it ships one, else its tokenizer.json (Hugging Face: Llama 3, Qwen, GPT-2), else "".
  std::string default_tokenizer() const;
};

// --base-quant, --base-double-quant (strata train, estimate, eval, generate).
struct BaseQuantFlags {
  std::string quant =
      "auto";  // nf4, fp4, none, or auto: a bitsandbytes-4bit directory's, else none
  std::string double_quant = "auto";  // on, off, or auto: the directory's, else on (QLoRA's)
};
void AddBaseQuantFlags(CLI::App& cmd, BaseQuantFlags& f);

// --lora-rank, --lora-alpha, --lora-targets, --lora-dropout, --lora-init (strata train and
// estimate; a config file's strata.lora section sets the same fields).
struct LoraFlags {
  int rank = 0;
  double alpha = 16;
  std::vector<std::string> targets;  // empty: PEFT's default for the family
  double dropout = 0;
  // Whether --lora-alpha / --lora-dropout (or strata.lora's keys) were given: with --lora-init
  // alone, what was not given is the adapter's.
  bool alpha_given = false;
  bool dropout_given = false;
  std::string init;     // a PEFT adapter directory to start from
  BaseQuantFlags base;  // --base-quant, --base-double-quant (added by AddLoraFlags too)
};
void AddLoraFlags(CLI::App& cmd, LoraFlags& f);

// A run's --tokenizer (a tokenizer.json, a tokenizer.model, or a directory: its tokenizer.json,
// else its tokenizer.model, as data::Tokenizer::Load picks) recorded in `spec`: spec->tokenizer
// is the file, and a tokenizer from outside the model directory replaces the directory's
// tokenizer files (tokenizer.json, tokenizer.model, vocab.json, merges.txt) in
// spec->tokenizer_files, with its own directory's tokenizer_config.json, special_tokens_map.json
// and chat_template.jinja where it has them, so that an export carries the tokenizer the run
// trained with. Reads the file system (which files the tokenizer's directory has). Errors:
// data::Tokenizer::FilePath's (kNotFound for a directory with neither file).
Status UseTokenizer(const std::string& given, ModelSpec* spec);

// The tokenizer files to copy into an export of `spec`: each under its own name, the run's
// tokenizer (spec.tokenizer) under tokenizer.json / tokenizer.model. Pure.
std::vector<models::CompanionFile> ExportedTokenizerFiles(const ModelSpec& spec);

// Sets spec->base_quant (after the LoRA flags: spec->lora is final): with LoRA or for
// `inference` (eval, generate: the whole model is frozen), the flag's type, or for `auto` a
// bitsandbytes-4bit directory's; when training without LoRA none (nothing is frozen; such a
// directory's weights are read dequantized). Errors (kInvalidArgument, one line naming the
// flag): an unknown value; nf4/fp4 when training without LoRA, or on a GPT-2 model;
// --base-double-quant without a 4-bit base.
Status ApplyBaseQuantFlags(const BaseQuantFlags& f, ModelSpec* spec, bool inference = false);
// A directory's bitsandbytes 4-bit quantization (config.json's quantization_config with
// load_in_4bit), or nullopt.
std::optional<models::ops::Quant4Params> DirectoryBaseQuant(const models::HfModelConfig& config);
// Sets spec->lora from the flags (rank 0: nothing), then spec->base_quant
// (ApplyBaseQuantFlags). The targets default to PEFT's for the family
// (Llama: q_proj,v_proj). inference: eval and generate (ApplyBaseQuantFlags'). Errors:
// kInvalidArgument for --lora-* without --lora-rank, and a --lora-init directory that does not
// exist.
Status ApplyLoraFlags(const LoraFlags& f, ModelSpec* spec, bool inference = false);

// Exactly one of preset / model_dir (a non-empty model_dir wins over the default preset).
// Errors: an unknown preset (kInvalidArgument listing every name), the directory's config
// errors (models/hf_config.h, one line naming the file and field).
// config_only: read the directory's config.json alone (shapes for planning), not the
// safetensors headers.
StatusOr<ModelSpec> ResolveModelSpec(const std::string& preset, const std::string& model_dir,
                                     bool config_only = false);
// Every preset name, for help texts.
std::string PresetNames();

// A LoRA run's frozen base in words, recorded in its checkpoints (ModelSpecJson's "base"): the
// preset, or the directory with its safetensors files' names and sizes, and the 4-bit
// quantization ("nf4, double quantization" or "16-bit"). Resuming over another base is refused.
std::string BaseIdentity(const ModelSpec& spec);
// --resume of a LoRA run: kInvalidArgument naming both bases when the checkpoint's manifest
// (`checkpoint_model_json`, from `checkpoint`) records a base other than `spec`'s.
Status CheckResumeBase(const ModelSpec& spec, const std::string& checkpoint_model_json,
                       const std::string& checkpoint);

// The manifest form and back. ModelSpecFromJson also reads the byte-level GPT shape that
// checkpoints before Hugging Face support wrote ({"preset", "vocab_size", ...}).
std::string ModelSpecJson(const ModelSpec& spec);
StatusOr<ModelSpec> ModelSpecFromJson(const std::string& json);

// The engine Model. load_weights: a directory's weights become the initial master weights
// (streamed block by block from the safetensors files at Engine::Create); otherwise random
// initialisation. allow_tf32: GPT families on CUDA only. With spec.lora the model trains adapters
// over its frozen base (DecoderModel::EnableLora), whose weights come from the directory
// whatever load_weights says (a LoRA checkpoint holds the adapters only). With spec.base_quant
// and no LoRA, an inference model: the whole base frozen (DecoderModel::FreezeBase), its layers
// in 4 bits.
StatusOr<std::unique_ptr<engine::Model>> BuildModel(const ModelSpec& spec, bool load_weights,
                                                    bool allow_tf32 = false);
// `--precision auto` for a model: a directory's config.json torch_dtype (or transformers 5's
// dtype) when it is float32, bfloat16 or float16, as transformers loads it; else bf16. `why`
// (may be null) gets the reason in words, for the plan.
DType AutoPrecision(const ModelSpec& spec, std::string* why);

// The LoRA layout of a model BuildModel made (nullptr without LoRA).
const models::LoraLayout* LoraLayoutOf(const engine::Model& model);

}  // namespace strata::tools
