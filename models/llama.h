// The Llama family (Hugging Face LlamaForCausalLM, and the families built on its layer:
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM; llama_config.h) as an
// engine Model: block 0 = token embedding, blocks 1..L = decoder layers, block L+1 = final
// RMSNorm and LM head. Chunk layouts: models/llama_config.h; the block computations:
// models/llama_kernels.h. With tie_embeddings the head's chunk is model.norm.weight only and the
// head reads embed_tokens from the embedding chunk (tied_block(head) = 0,
// BlockBuffers::tied_params) and writes its gradient contribution to tied_grads.
//
// Forward/Backward check every buffer's dtype and size first (kInvalidArgument naming the
// buffer), then dispatch on the stream's backend: on the host backend each block runs as one
// host function on the compute stream in the working precision of its buffers (fp32, fp16 or
// bf16); on a CUDA stream the blocks of models/cuda/llama_cuda.h run (binaries built with
// STRATA_HAVE_CUDA; without it a CUDA stream is kFailedPrecondition). scratch_bytes is the
// larger of the two backends' figures.
//
// Thread-safety: const methods are thread-safe; Forward/Backward keep no state beyond the work
// they enqueue. The weight source is shared and read only from InitParams (one call at a time,
// as Engine::Create makes them).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/plan/model.h"
#include "models/decoder_blocks.h"
#include "models/decoder_model.h"
#include "models/llama_config.h"
#include "models/weight_source.h"

namespace strata::models {

// Named configs with random initialisation (all vocabulary 32000, rms_norm_eps 1e-5, theta 10000,
// untied): "llama-1b" (TinyLlama-1.1B's Llama-2 architecture: C 2048, I 5632, 22 layers, 32 heads,
// 4 key/value heads, context 2048), "llama-7b" (4096, 11008, 32, 32, 32, 4096), "llama-13b" (5120,
// 13824, 40, 40, 40, 4096), "llama-70b" (Llama-3-70B's published configuration: vocabulary 128256,
// 8192, 28672, 80, 64, 8 key/value heads, 8192, rope_theta 500000; 70.55e9 params); and
// "llama-tiny" for tests (vocabulary 256, C 64, I 96, 2 layers,
// 4 heads, 2 key/value heads, context 64); the other families' published base configurations:
// "mistral-7b" (Mistral-7B-v0.1, window 4096), "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b",
// "qwen3-8b", "phi4" (Phi-4, 14.7e9 params), "gemma2-2b", "gemma2-9b", "gemma3-1b",
// "gemma3-27b" (the text model).
// kInvalidArgument naming the choices for another name.
StatusOr<LlamaConfig> LlamaPreset(std::string_view name);
std::vector<std::string> LlamaPresetNames();

// Llama as a decoder family (models/decoder_model.h): its config, and its blocks, each a call of
// the kernels of models/llama_kernels.h (host) or models/cuda/llama_cuda.h (CUDA).
struct LlamaFamily {
  static constexpr const char* kName = "the Llama model";
  // A 4-bit base (models/base_quant.h): the layers' 2-D tensors are nn.Linear (out, in) weights.
  static constexpr bool kBaseQuant = true;

  LlamaConfig config;

  int num_layers() const { return config.num_layers; }
  int vocab_size() const { return config.vocab_size; }
  int max_seq_len() const { return config.max_seq_len; }
  int64_t channels() const { return config.hidden_size; }
  bool tie_embeddings() const { return config.tie_embeddings; }
  STRATA_DECODER_FAMILY_FUNCTIONS()
};

extern template class DecoderModel<LlamaFamily>;

class LlamaModel final : public DecoderModel<LlamaFamily> {
 public:
  // kInvalidArgument for an invalid config (ValidateLlamaConfig). With `weights`, InitParams
  // reads each block from it instead of initialising randomly.
  static StatusOr<std::unique_ptr<LlamaModel>> Create(
      const LlamaConfig& config, std::shared_ptr<const WeightSource> weights = nullptr);

  const LlamaConfig& config() const { return family().config; }
  std::string description() const override;

 private:
  LlamaModel(const LlamaConfig& config, std::shared_ptr<const WeightSource> weights)
      : DecoderModel(LlamaFamily{config}, std::move(weights)) {}
};

}  // namespace strata::models
