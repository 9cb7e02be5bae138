// LoRA adapters as Hugging Face PEFT saves them (save_pretrained of a LoraModel), written by
// `strata export --lora-dir` and read by `--lora-init` / `--lora`:
//
//   DIR/adapter_config.json        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r",
//                                  "lora_alpha", "lora_dropout", "target_modules", "bias": "none",
//                                  "fan_in_fan_out", "base_model_name_or_path", ...}
//   DIR/adapter_model.safetensors  per layer l and targeted module m, in layer order then the
//                                  family's module order: base_model.model.<layer prefix>.l.<m's
//                                  path>.lora_A.weight (r, in) and .lora_B.weight (out, r)
//
// (Llama's layer prefix is model.layers: base_model.model.model.layers.0.self_attn.q_proj.
// lora_A.weight. A multimodal Gemma 3's is its language model's, model.language_model.layers, as
// PEFT names it over transformers 4.52+'s Gemma3ForConditionalGeneration; the layout of earlier
// versions, language_model.model.layers, is read too. Its target_modules are then written as the
// regular expression ".*language_model.*\.(q_proj|v_proj|...)", which PEFT matches against whole
// module names, so that the vision tower's q_proj/k_proj/v_proj get no adapters; that form is
// read back as its names.) The adapters of layer l are the engine chunk of layer block l + 1
// (models/lora.h: A then B per site). Values are fp32 on write; F32, BF16 and F16 tensors are
// read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "base/dtype.h"
#include "base/status.h"
#include "models/hf_config.h"
#include "models/lora.h"
#include "models/weight_source.h"

namespace strata::models {

// What an adapter directory's adapter_config.json says (the fields Strata uses).
struct LoraAdapterConfig {
  LoraConfig lora;
  std::string base_model;  // base_model_name_or_path
};

// Reads DIR/adapter_config.json. Errors (one line naming the file and the field): kNotFound,
// kDataLoss for JSON that is not an object or fields of the wrong type, kInvalidArgument for a
// peft_type other than LORA or a feature Strata does not implement (use_rslora, use_dora,
// rank_pattern, alpha_pattern, layers_to_transform, bias other than "none").
StatusOr<LoraAdapterConfig> ReadLoraAdapterConfig(const std::string& dir);
// The same for the file's text; `path` names it in errors. Also kInvalidArgument for an r outside
// 1..kMaxAdapterRank, a lora_alpha that is not a positive fp32 number, a lora_dropout outside
// [0, 1). The JSON is parsed with base/untrusted_text.h's nesting limit.
inline constexpr int kMaxAdapterRank = 65536;
StatusOr<LoraAdapterConfig> ParseLoraAdapterConfig(std::string_view text, const std::string& path);

// The module names (LoraModule::name, the form --lora-targets takes) that `adapter`'s
// target_modules select in `config`'s family, by PEFT's rule (models/lora.h LoraTargetNames:
// "self_attn.q_proj" is q_proj). `dir` names the adapter directory in errors: kInvalidArgument,
// one line naming DIR/adapter_config.json, a target that selects none of the family's modules or
// only some of those of a name. Pure.
StatusOr<std::vector<std::string>> AdapterTargetNames(const LoraAdapterConfig& adapter,
                                                      const HfModelConfig& config,
                                                      const std::string& dir);

// Writes an adapter directory, crash-safe (WriteDirectoryAtomically: out_dir must not exist or be
// empty). read_layer(l, out) writes layer l's adapter chunk (layout.layer_params fp32) into out,
// called once per layer in order. base_model: base_model_name_or_path.
Status WriteLoraAdapterDir(
    const std::string& out_dir, const HfModelConfig& config, const LoraConfig& lora,
    const LoraLayout& layout, const std::string& base_model,
    const std::function<Status(int layer, std::span<float> out)>& read_layer);

// The adapters of DIR as a WeightSource of the LoRA model's blocks (block l + 1: layer l's chunk;
// the embedding and the head have none). Checks up front that adapter_config.json's rank,
// alpha and targets (by the module names they select) are `lora`'s and that every tensor is there
// with its shape; kInvalidArgument naming the file and what differs otherwise. ReadBlock errors:
// I/O naming the file.
StatusOr<std::shared_ptr<const WeightSource>> OpenLoraAdapter(const std::string& dir,
                                                              const HfModelConfig& config,
                                                              const LoraConfig& lora,
                                                              const LoraLayout& layout);

// "base_model.model.model.layers.3.self_attn.q_proj" for layer 3's q_proj of a Llama: the prefix
// of the site's lora_A.weight / lora_B.weight as Strata writes it (a multimodal Gemma 3's:
// "base_model.model.model.language_model.layers.3.self_attn.q_proj").
std::string LoraTensorPrefix(const HfModelConfig& config, int layer, const LoraSite& site);

}  // namespace strata::models
