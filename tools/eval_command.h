// `strata eval` (loss and perplexity of a model on a token file) and `strata generate` (text
// from a prompt), on a Hugging Face directory or a checkpoint, through an inference-only engine
// (engine/engine.h: working params only, streamed like in training when the device budget is
// small).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "tools/model_spec.h"

namespace strata::tools {

// The model and where it runs, shared by both commands.
struct InferenceFlags {
  std::string model_dir;
  std::string checkpoint;
  std::string precision = "auto";  // auto: the checkpoint's precision, else bf16
  std::string device = "auto";
  std::string device_budget = "auto";
  std::string lora;     // a PEFT adapter directory applied over --model-dir
  BaseQuantFlags base;  // --base-quant, --base-double-quant (--model-dir only)
};

struct EvalFlags {
  InferenceFlags model;
  std::vector<std::string> data;
  int seq_len = 0;
  int64_t max_tokens = 0;  // 0 = the whole file
  int micro_batch_size = 8;
  bool json = false;
  // Token files with per-token flags (instruction data): rows of whole examples, as training
  // lays them out (data/example_dataset.h).
  bool pack = false;
  std::string long_examples = "truncate";
  // Preference data (pairs from `strata tokenize`) scored with a preference loss and TRL's
  // metrics instead of the cross-entropy (tools/preference_training.h); sft: the cross-entropy.
  std::string objective = "sft";
  double beta = 0.1;
  double label_smoothing = 0;
  double simpo_gamma = 0.5;
  double rpo_alpha = 0;
  double cpo_alpha = 0;
  // DPO and IPO of a full model: the reference model (TRL's ref_model; the run's initial
  // weights reproduce training's validation), a Hugging Face directory or a checkpoint, run
  // alone before the model is loaded. A LoRA model's reference is its base instead.
  std::string reference_model_dir;
  std::string reference_checkpoint;
};
void AddEvalFlags(CLI::App& cmd, EvalFlags& f);
// Mean cross-entropy in nats per target token over every full window of the first max_tokens
// tokens: window i has inputs tokens[i T, i T + T) and targets tokens[i T + 1, i T + T + 1).
// Files with per-token flags (instruction data) are read as whole examples instead, one per row
// of T tokens (or packed), and the mean is over the targets in the loss only (the responses):
// what training's validation loss of the same file reports. With --objective dpo|ipo|simpo,
// preference data is scored as training validates it: every pair, its loss and TRL's metrics
// (the reference of DPO and IPO: a LoRA model's base, or for a full model the reference model
// of --reference-model-dir or --reference-checkpoint, evaluated first in the model's working
// precision and released before the model is built: never two models in memory).
Status RunEval(const EvalFlags& f);

struct GenerateFlags {
  InferenceFlags model;
  std::string prompt;
  std::string tokenizer;  // default: ModelSpec::default_tokenizer
  int max_new_tokens = 64;
  // Sampling (tools/sampling.h): each given flag over the model's generation_config.json, whose
  // keys are transformers' (do_sample false: greedy), over Strata's defaults without one
  // (temperature 0.8, top-k 40, top-p 1, no repetition penalty). temperature 0: greedy.
  std::optional<double> temperature;
  std::optional<int> top_k;  // 0 = the whole vocabulary
  std::optional<double> top_p;
  std::optional<double> repetition_penalty;
  uint64_t seed = 1337;
};
void AddGenerateFlags(CLI::App& cmd, GenerateFlags& f);
Status RunGenerate(const GenerateFlags& f);

}  // namespace strata::tools
