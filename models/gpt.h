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

#include "engine/model.h"
#include "models/decoder_blocks.h"
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

class GptModel final : public engine::Model {
 public:
  // What a block is: embedding (block 0), transformer layer, or head (the last).
  using Kind = DecoderBlock;

  // kInvalidArgument for an invalid shape (see ValidateShape). With `weights` (an imported
  // Hugging Face checkpoint, models/hf_checkpoint.h), InitParams reads each block from it
  // instead of the random initialisation; the source must describe this shape's chunks.
  static StatusOr<std::unique_ptr<GptModel>> Create(
      const GptShape& shape, const GptOptions& options = {},
      std::shared_ptr<const WeightSource> weights = nullptr);

  const GptShape& shape() const { return shape_; }
  const GptOptions& options() const { return options_; }
  std::string description() const override;
  int num_blocks() const override { return shape_.num_layers + 2; }
  std::string block_name(int block) const override;
  int64_t block_num_params(int block) const override;
  std::vector<std::vector<int64_t>> block_tensor_shapes(int block) const override;
  int64_t activation_elems(engine::MicroBatchShape s) const override;
  int64_t logits_elems(engine::MicroBatchShape s) const override;
  int vocab_size() const override { return shape_.vocab_size; }
  int max_seq_len() const override { return shape_.max_seq_len; }
  int64_t scratch_bytes(int block, engine::MicroBatchShape s, DType precision) const override;
  // With shape().tie_embeddings the head (the last block) ties the embedding (block 0).
  int tied_block(int block) const override;
  Status InitParams(int block, uint64_t seed, std::span<float> out) const override;
  Status Forward(int block, const engine::BlockBuffers& buffers, gpu::Stream& stream) override;
  Status Backward(int block, const engine::BlockBuffers& buffers, gpu::Stream& stream) override;
  // CUDA stream: creates its cuBLAS handle and workspace (gpu/cuda/cuda_native.h) now rather
  // than at the first matrix product inside a step. Host stream: nothing.
  Status PrepareComputeStream(gpu::Stream& stream) override;

 private:
  GptModel(const GptShape& shape, const GptOptions& options,
           std::shared_ptr<const WeightSource> weights)
      : shape_(shape), options_(options), weights_(std::move(weights)) {}
  Kind kind(int block) const;
  GptShape shape_;
  GptOptions options_;
  std::shared_ptr<const WeightSource> weights_;  // null: random initialisation
};

}  // namespace strata::models
