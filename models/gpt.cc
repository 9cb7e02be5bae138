#include "models/gpt.h"

#include <fmt/format.h>

#include "models/cuda/gpt_cuda.h"
#include "models/decoder_model_impl.h"

namespace strata::models {

namespace {
struct Preset {
  const char* name;
  GptShape shape;
};
// vocab 256 (bytes); max_seq_len, layers, heads, channels.
const Preset kPresets[] = {
    {"tiny", {256, 16, 2, 2, 16}},
    {"small", {256, 64, 12, 4, 128}},
    {"gpt2-124m", {256, 1024, 12, 12, 768}},
    {"gpt2-350m", {256, 1024, 24, 16, 1024}},
    {"gpt2-774m", {256, 1024, 36, 20, 1280}},
    {"gpt2-1.5b", {256, 1024, 48, 25, 1600}},
    // The width, depth and heads of the well-known 7B and 13B decoder shapes (randomly
    // initialised, GPT-2 blocks), for planning and benchmarks.
    {"gpt-7b", {256, 2048, 32, 32, 4096}},
    {"gpt-13b", {256, 2048, 40, 40, 5120}},
};
}  // namespace

StatusOr<GptShape> GptPreset(std::string_view name) {
  for (const auto& p : kPresets) {
    if (name == p.name) return p.shape;
  }
  std::string names;
  for (const auto& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  return InvalidArgumentError(
      fmt::format("unknown model preset '{}': choose one of {}", name, names));
}

std::vector<std::string> GptPresetNames() {
  std::vector<std::string> v;
  for (const auto& p : kPresets) v.emplace_back(p.name);
  return v;
}

std::vector<std::vector<int64_t>> GptFamily::TensorShapes(DecoderBlock kind, int) const {
  std::vector<TensorInfo> tensors;
  switch (kind) {
    case DecoderBlock::kEmbedding:
      tensors = EmbeddingTensors(shape);
      break;
    case DecoderBlock::kHead:
      tensors = HeadTensors(shape);
      break;
    case DecoderBlock::kLayer:
      tensors = LayerTensors(shape);
      break;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const TensorInfo& t : tensors) shapes.push_back(t.shape);
  return shapes;
}

int64_t GptFamily::NumParams(DecoderBlock kind) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return EmbeddingNumParams(shape);
    case DecoderBlock::kHead:
      return HeadNumParams(shape);
    case DecoderBlock::kLayer:
      break;
  }
  return LayerNumParams(shape);
}

std::vector<LoraModule> GptFamily::LoraModules() const { return GptLoraModules(shape); }

void GptFamily::Init(DecoderBlock kind, int layer, uint64_t seed, float* out) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return InitGptEmbeddingParams(shape, seed, out);
    case DecoderBlock::kHead:
      return InitGptHeadParams(shape, seed, out);
    case DecoderBlock::kLayer:
      return InitGptLayerParams(shape, layer, seed, out);
  }
}

template <typename S>
int64_t GptFamily::HostScratchBytes(DecoderBlock kind, int B, int T) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return GptEmbeddingScratchBytes<S>(shape, B, T);
    case DecoderBlock::kHead:
      return GptHeadScratchBytes<S>(shape, B, T);
    case DecoderBlock::kLayer:
      break;
  }
  return GptLayerScratchBytes<S>(shape, B, T);
}

template <typename S>
int64_t GptFamily::CudaScratchBytes(DecoderBlock kind, int B, int T) const {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return cuda::GptCudaEmbeddingScratchBytes<S>(shape, B, T);
    case DecoderBlock::kHead:
      return cuda::GptCudaHeadScratchBytes<S>(shape, B, T);
    case DecoderBlock::kLayer:
      break;
  }
  return cuda::GptCudaLayerScratchBytes<S>(shape, B, T);
}

// The host blocks (gpt_kernels.h).
template <typename S>
void GptFamily::HostEmbeddingForward(const BlockArgs<S>& a) const {
  GptEmbeddingForward<S>(shape, a.params, a.tokens, a.B, a.T, a.x_out, a.position_ids);
}
template <typename S>
void GptFamily::HostLayerForward(const BlockArgs<S>& a) const {
  GptLayerForward<S>(shape, a.params, a.x_in, a.x_out, a.B, a.T, a.scratch, a.lora, a.position_ids);
}
template <typename S>
float GptFamily::HostHeadForward(const BlockArgs<S>& a) const {
  return GptHeadForward<S>(shape, a.params, a.x_in, a.targets, a.B, a.T, a.logits, a.scratch,
                           a.tied_params, a.loss_tokens, a.target_losses);
}
template <typename S>
void GptFamily::HostEmbeddingBackward(const BlockArgs<S>& a) const {
  GptEmbeddingBackward<S>(shape, a.tokens, a.dx_out, a.B, a.T, a.grads, a.scratch, a.position_ids);
}
template <typename S>
void GptFamily::HostLayerBackward(const BlockArgs<S>& a) const {
  GptLayerBackward<S>(shape, a.params, a.x_in, a.dx_out, a.dx_in, a.grads, a.B, a.T, a.scratch,
                      a.lora, a.position_ids, a.forward_kept);
}
template <typename S>
void GptFamily::HostHeadBackward(const BlockArgs<S>& a) const {
  GptHeadBackward<S>(shape, a.params, a.x_in, a.targets, a.dloss, a.B, a.T, a.dx_in, a.grads,
                     a.scratch, a.tied_params, a.tied_grads, a.loss_tokens, a.target_weights);
}

#ifdef STRATA_HAVE_CUDA
// What the CUDA blocks do not implement yet: a LayerNorm eps other than the kernels' 1e-5.
Status GptFamily::CudaSupports() const {
  if (shape.layer_norm_eps != 1e-5) {
    return UnimplementedError(
        fmt::format("the GPT's CUDA kernels use LayerNorm eps 1e-5, not {}; use --device host",
                    shape.layer_norm_eps));
  }
  return Status::Ok();
}

Status GptFamily::CudaPrepareStream(gpu::Stream& stream) const {
  return cuda::GptCudaPrepareStream(stream);
}

// The CUDA blocks (models/cuda/gpt_cuda.h).
template <typename S>
Status GptFamily::CudaEmbeddingForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaEmbeddingForward<S>(shape, stream, a.params, a.tokens, a.B, a.T, a.x_out,
                                          a.position_ids);
}
template <typename S>
Status GptFamily::CudaLayerForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaLayerForward<S>(shape, stream, a.params, a.x_in, a.x_out, a.B, a.T, a.scratch,
                                      {.allow_tf32 = options.allow_tf32}, a.position_ids, a.lora);
}
template <typename S>
Status GptFamily::CudaHeadForward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaHeadForward<S>(shape, stream, a.params, a.x_in, a.targets, a.B, a.T, a.logits,
                                     a.scratch, a.loss, {.allow_tf32 = options.allow_tf32},
                                     a.tied_params, a.loss_tokens, a.target_losses);
}
template <typename S>
Status GptFamily::CudaEmbeddingBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaEmbeddingBackward<S>(shape, stream, a.tokens, a.dx_out, a.B, a.T, a.grads,
                                           a.scratch, a.position_ids);
}
template <typename S>
Status GptFamily::CudaLayerBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaLayerBackward<S>(shape, stream, a.params, a.x_in, a.dx_out, a.dx_in, a.grads,
                                       a.B, a.T, a.scratch, {.allow_tf32 = options.allow_tf32},
                                       a.position_ids, a.lora, a.forward_kept);
}
template <typename S>
Status GptFamily::CudaHeadBackward(const BlockArgs<S>& a, gpu::Stream& stream) const {
  return cuda::GptCudaHeadBackward<S>(shape, stream, a.params, a.x_in, a.targets, a.dloss, a.B, a.T,
                                      a.dx_in, a.grads, a.scratch,
                                      {.allow_tf32 = options.allow_tf32}, a.tied_params,
                                      a.tied_grads, a.loss_tokens, a.target_weights);
}
#endif

template class DecoderModel<GptFamily>;

StatusOr<std::unique_ptr<GptModel>> GptModel::Create(const GptShape& shape,
                                                     const GptOptions& options,
                                                     std::shared_ptr<const WeightSource> weights) {
  STRATA_RETURN_IF_ERROR(ValidateShape(shape));
  return std::unique_ptr<GptModel>(new GptModel(shape, options, std::move(weights)));
}

std::string GptModel::description() const {
  return fmt::format("GPT: {} layers, {} heads, {} channels, context {}, vocabulary {}{}",
                     shape().num_layers, shape().num_heads, shape().channels, shape().max_seq_len,
                     shape().vocab_size, shape().tie_embeddings ? ", tied embeddings" : "");
}

}  // namespace strata::models
