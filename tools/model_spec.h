// Which model a command runs, as one description: a named preset (random initialisation: the
// byte-level GPT demo presets, llama-*, gpt2*) or a Hugging Face directory (--model-dir). The
// description rebuilds the model, travels in a checkpoint's manifest (TrainerState::model_json)
// so `strata eval/generate/export --checkpoint` know the model, and names the tokenizer files a
// run used so an export can copy them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/model.h"
#include "models/hf_config.h"

namespace strata::tools {

struct ModelSpec {
  std::string preset;            // the preset's name, or "" for a directory
  std::string model_dir;         // the Hugging Face directory (absolute), or ""
  models::HfModelConfig config;  // family and shape; the byte-level presets are untied GPT-2s
  std::vector<std::string> tokenizer_files;  // absolute paths (model_dir's, or --tokenizer)
  bool byte_level() const;  // a vocabulary of 256: tokens are bytes, text needs no tokenizer
};

// Exactly one of preset / model_dir (a non-empty model_dir wins over the default preset).
// Errors: an unknown preset (kInvalidArgument listing every name), the directory's config
// errors (models/hf_config.h, one line naming the file and field).
// config_only: read the directory's config.json alone (shapes for planning), not the
// safetensors headers.
StatusOr<ModelSpec> ResolveModelSpec(const std::string& preset, const std::string& model_dir,
                                     bool config_only = false);
// Every preset name, for help texts.
std::string PresetNames();

// The manifest form and back. ModelSpecFromJson also reads the byte-level GPT shape that
// checkpoints before Hugging Face support wrote ({"preset", "vocab_size", ...}).
std::string ModelSpecJson(const ModelSpec& spec);
StatusOr<ModelSpec> ModelSpecFromJson(const std::string& json);

// The engine Model. load_weights: a directory's weights become the initial master weights
// (streamed block by block from the safetensors files at Engine::Create); otherwise random
// initialisation. allow_tf32: GPT families on CUDA only.
StatusOr<std::unique_ptr<engine::Model>> BuildModel(const ModelSpec& spec, bool load_weights,
                                                    bool allow_tf32 = false);

}  // namespace strata::tools
