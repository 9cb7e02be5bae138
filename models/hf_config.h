// Hugging Face model configurations (config.json) for the model families Strata trains, and the
// tensor layout of each engine block in Hugging Face's names and shapes.
//
// Supported (model_type / architectures), read as transformers' configuration classes read them:
//   "llama"   LlamaForCausalLM (attention_bias: biases on q, k, v, o)
//   "mistral" MistralForCausalLM, sliding_window (null: none) on every layer
//   "qwen2"   Qwen2ForCausalLM (Qwen2, Qwen2.5): q/k/v biases; the window sliding_window when
//             use_sliding_window, on the layers layer_types names "sliding_attention" (default:
//             those from max_window_layers)
//   "qwen3"   Qwen3ForCausalLM: per-head q/k RMSNorms, attention_bias, windows as qwen2
//   "phi3"    Phi3ForCausalLM (Phi-3, Phi-4): fused qkv_proj and gate_up_proj; sliding_window on
//             every layer; partial_rotary_factor other than 1 and rope_scaling "longrope"
//             refused
//   "gemma3_text" Gemma3ForCausalLM (Gemma 3's text model), and "gemma3"
//             (Gemma3ForConditionalGeneration): its text_config's language model
//   "gpt2"    GPT2LMHeadModel, tanh GELU ("gelu_new" or "gelu_pytorch_tanh"), n_inner = 4 n_embd
// Every family except gpt2 refuses hidden_act other than silu, mlp_bias, rope_scaling other than
// null/default/llama3, and a non-zero dropout (attention_dropout; Phi-3's resid_pdrop and
// embd_pdrop): Strata trains without dropout. transformers 5's rope_parameters is read where
// rope_theta is absent.
//
// Every error is ONE line "PATH: field 'NAME' ..." naming the file and the field, with code
// kInvalidArgument (kNotFound for a missing config.json, errno-derived codes for I/O). Pure
// functions apart from ReadHfConfig's read; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "models/gpt_kernels.h"
#include "models/llama_config.h"

namespace strata::models {

struct HfModelConfig {
  enum class Family { kLlama, kGpt2 };
  Family family = Family::kLlama;
  LlamaConfig llama;   // family kLlama
  GptShape gpt2;       // family kGpt2 (tie_embeddings and layer_norm_eps from the config)
  nlohmann::json raw;  // the parsed config.json as it was (token ids and the like)
  // A Gemma3ForConditionalGeneration directory (model_type "gemma3"): llama holds its
  // text_config; its language model's tensors are stored as "language_model.model.*" (or
  // "model.language_model.*", transformers 4.52+), and the vision tower's are not read.
  // HfConfigJson writes the text model (gemma3_text).
  bool gemma3_multimodal = false;
};

// Parses config.json text. path_for_messages names the file in errors.
StatusOr<HfModelConfig> ParseHfConfig(std::string_view json_text,
                                      const std::string& path_for_messages);
// Reads and parses DIR/config.json (at most 16 MiB).
StatusOr<HfModelConfig> ReadHfConfig(const std::string& dir);

// A config.json for `config` that transformers' from_pretrained accepts: architectures,
// model_type (the family's: LlamaArchModelType, or "gpt2"), every field ParseHfConfig reads,
// torch_dtype ("float32", "float16", "bfloat16" after torch_dtype), and bos/eos/pad token ids
// copied from config.raw when it has them. ParseHfConfig(HfConfigJson(c)) gives back c's family,
// llama or gpt2 fields.
std::string HfConfigJson(const HfModelConfig& config, DType torch_dtype = DType::kF32);

// GPT-2 presets for random-initialisation pretraining, with GPT2LMHeadModel's shapes: "gpt2"
// (124M: 12 layers, 12 heads, 768 channels), "gpt2-medium" (24, 16, 1024), "gpt2-large" (36, 20,
// 1280), "gpt2-xl" (48, 25, 1600); vocabulary 50257, context 1024, tied embeddings, LayerNorm eps
// 1e-5. kInvalidArgument listing the names for an unknown one.
StatusOr<GptShape> Gpt2Preset(std::string_view name);
std::vector<std::string> Gpt2PresetNames();

// One tensor of an engine block as a Hugging Face checkpoint stores it.
struct HfTensor {
  std::string name;            // Hugging Face name ("model.layers.0.mlp.up_proj.weight")
  std::vector<int64_t> shape;  // in the checkpoint (row-major)
  int64_t num_elems = 0;
  int64_t chunk_offset = 0;  // element offset of the tensor in the block's fp32 chunk
  // The chunk holds the transpose of the stored 2-D tensor: the GPT-2 untied lm_head.weight is
  // stored (V, C) and the GPT head's lm_head_w is (C, V).
  bool transposed = false;
};

// Blocks as the engine models number them: 0 = embedding, 1..L = layers, L + 1 = head.
int HfNumBlocks(const HfModelConfig& config);
// "embedding", "layer{i}" (i = block - 1), "head", as GptModel::block_name.
std::string HfBlockName(const HfModelConfig& config, int block);
// The tensors of `block` in chunk order; they tile the chunk exactly. Tied embeddings: the head
// holds no lm_head (the LM head reads the embedding chunk). GPT-2 names carry the
// "transformer." prefix of GPT2LMHeadModel. block in [0, HfNumBlocks) (STRATA_CHECK).
std::vector<HfTensor> HfBlockTensors(const HfModelConfig& config, int block);
// Sum of num_elems of HfBlockTensors(config, block).
int64_t HfBlockNumParams(const HfModelConfig& config, int block);

// QLoRA's 4-bit frozen base (issue 45), the one rule everything that reads, writes or holds a
// 4-bit base follows: the tensors stored in 4 bits are the 2-D tensors of the layer blocks
// (1..L) of a Llama-family model -- q/k/v/o and gate/up/down projections, Phi-3's fused
// qkv_proj and gate_up_proj -- each quantized as one Hugging Face tensor, in its stored
// row-major (out, in) order. Embeddings, norms, biases and the LM head stay 16-bit, as
// transformers' bitsandbytes integration leaves them (it converts the layers' nn.Linear and
// keeps lm_head). False for every GPT-2 tensor: CheckHfBaseQuantizable refuses that family.
// block in [0, HfNumBlocks) (STRATA_CHECK).
bool HfBaseQuantized(const HfModelConfig& config, int block, const HfTensor& tensor);
// OK for the Llama families; kInvalidArgument, one line naming gpt2, for GPT-2.
Status CheckHfBaseQuantizable(const HfModelConfig& config);

}  // namespace strata::models
