// The GPT reference model (pre-LayerNorm GPT-2 architecture; Radford et al.,
// "Language Models are Unsupervised Multitask Learners", 2019) as an engine
// Model: block 0 = token and position embeddings, blocks 1..L = transformer
// layers, block L+1 = final LayerNorm and the LM head (its own (C, V) weight, or with
// tie_embeddings the embedding's wte, BlockBuffers::tied_params). Each block's
// parameters are one contiguous chunk in the layout of gpt_kernels.h.
//
// Forward/Backward dispatch on the stream's backend (gpu::Stream::device_kind()):
// on the host backend each block's forward/backward is enqueued on the compute
// stream as a host function running the kernels of gpt_kernels.h; on the CUDA
// backend (binaries built with STRATA_HAVE_CUDA) the block functions of
// models/cuda/gpt_cuda.h launch CUDA kernels and cuBLAS GEMMs on the stream, on the
// same device buffers and chunk layouts. Blocks compute in the working precision of their
// buffers (BlockBuffers::precision: fp32, fp16 or bf16) with the rounding points of
// gpt_kernels.h on both backends; Forward/Backward check every buffer's dtype and size first
// (kInvalidArgument naming the buffer). scratch_bytes covers both paths.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/plan/model.h"
#include "models/decoder_blocks.h"
#include "models/decoder_model.h"
#include "models/gpt_kernels.h"
#include "models/weight_source.h"

namespace strata::models {

// Named shapes. "tiny" (tests), "small" (the default of `strata train`: trains
// on 2 CPU cores in minutes), and GPT-2 family widths/depths/heads with a
// byte-level vocabulary (256): "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b",
// and "gpt-7b" (32 layers, 32 heads, 4096 channels), "gpt-13b" (40, 40, 5120) with context 2048.
// kInvalidArgument naming the choices for an unknown name.
StatusOr<GptShape> GptPreset(std::string_view name);
std::vector<std::string> GptPresetNames();

// How the model computes; the shape says what it computes.
struct GptOptions {
  // CUDA backend only: the layer and head matrix products run on TF32 tensor cores (inputs
  // rounded to a 10-bit mantissa, fp32 accumulation; several times faster on Ampere and
  // Hopper). The host backend computes in fp32 either way.
  bool allow_tf32 = false;
};

// The GPT as a decoder family (models/decoder_model.h): its shape and options, and its blocks,
// each a call of the kernels of gpt_kernels.h (host) or models/cuda/gpt_cuda.h (CUDA).
struct GptFamily {
  static constexpr const char* kName = "the GPT";
  // No 4-bit base (models/base_quant.h): its layers are Conv1D (in, out) layouts.
  static constexpr bool kBaseQuant = false;

  GptShape shape;
  GptOptions options;

  int num_layers() const { return shape.num_layers; }
  int vocab_size() const { return shape.vocab_size; }
  int max_seq_len() const { return shape.max_seq_len; }
  int64_t channels() const { return shape.channels; }
  bool tie_embeddings() const { return shape.tie_embeddings; }
  STRATA_DECODER_FAMILY_FUNCTIONS()
};

extern template class DecoderModel<GptFamily>;

class GptModel final : public DecoderModel<GptFamily> {
 public:
  // kInvalidArgument for an invalid shape (see ValidateShape). With `weights` (an imported
  // Hugging Face checkpoint, models/hf_checkpoint.h), InitParams reads each block from it
  // instead of the random initialisation; the source must describe this shape's chunks.
  static StatusOr<std::unique_ptr<GptModel>> Create(
      const GptShape& shape, const GptOptions& options = {},
      std::shared_ptr<const WeightSource> weights = nullptr);

  const GptShape& shape() const { return family().shape; }
  const GptOptions& options() const { return family().options; }
  std::string description() const override;

 private:
  GptModel(const GptShape& shape, const GptOptions& options,
           std::shared_ptr<const WeightSource> weights)
      : DecoderModel(GptFamily{shape, options}, std::move(weights)) {}
};

}  // namespace strata::models
