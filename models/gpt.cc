#include "models/gpt.h"

#include <fmt/format.h>

#include <algorithm>

#include "models/cuda/gpt_cuda.h"

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"  // plain C++: ScopedComputeSpan
#endif

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

StatusOr<std::unique_ptr<GptModel>> GptModel::Create(const GptShape& shape,
                                                     const GptOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateShape(shape));
  return std::unique_ptr<GptModel>(new GptModel(shape, options));
}

std::string GptModel::description() const {
  return fmt::format("GPT: {} layers, {} heads, {} channels, context {}, vocabulary {}",
                     shape_.num_layers, shape_.num_heads, shape_.channels, shape_.max_seq_len,
                     shape_.vocab_size);
}

GptModel::Kind GptModel::kind(int block) const {
  STRATA_CHECK(block >= 0 && block < num_blocks());
  if (block == 0) return Kind::kEmbedding;
  if (block == num_blocks() - 1) return Kind::kHead;
  return Kind::kLayer;
}

std::string GptModel::block_name(int block) const {
  switch (kind(block)) {
    case Kind::kEmbedding:
      return "embedding";
    case Kind::kHead:
      return "head";
    case Kind::kLayer:
      break;
  }
  return fmt::format("layer{}", block - 1);
}

int64_t GptModel::block_num_params(int block) const {
  switch (kind(block)) {
    case Kind::kEmbedding:
      return EmbeddingNumParams(shape_);
    case Kind::kHead:
      return HeadNumParams(shape_);
    case Kind::kLayer:
      break;
  }
  return LayerNumParams(shape_);
}

int64_t GptModel::activation_elems(engine::MicroBatchShape s) const {
  return s.tokens() * shape_.channels;
}

int64_t GptModel::logits_elems(engine::MicroBatchShape s) const {
  return s.tokens() * shape_.vocab_size;
}

int64_t GptModel::scratch_bytes(int block, engine::MicroBatchShape s) const {
  switch (kind(block)) {
    case Kind::kEmbedding:
      return 0;
    case Kind::kHead:
      return std::max(HeadScratchElems(shape_, s.batch_size, s.seq_len),
                      cuda::CudaHeadScratchElems(shape_, s.batch_size, s.seq_len)) *
             4;
    case Kind::kLayer:
      break;
  }
  // One figure for both backends (the model does not know the device here): the CUDA layer
  // keeps whole T x T attention gradients where the host keeps row blocks.
  return std::max(LayerScratchElems(shape_, s.batch_size, s.seq_len),
                  cuda::CudaLayerScratchElems(shape_, s.batch_size, s.seq_len)) *
         4;
}

void GptModel::InitParams(int block, uint64_t seed, std::span<float> out) const {
  STRATA_CHECK(static_cast<int64_t>(out.size()) == block_num_params(block));
  switch (kind(block)) {
    case Kind::kEmbedding:
      InitEmbeddingParams(shape_, seed, out.data());
      return;
    case Kind::kHead:
      InitHeadParams(shape_, seed, out.data());
      return;
    case Kind::kLayer:
      InitLayerParams(shape_, block - 1, seed, out.data());
      return;
  }
}

namespace {

bool OnCuda(const gpu::Stream& stream) { return stream.device_kind() == gpu::DeviceKind::kCuda; }

#ifndef STRATA_HAVE_CUDA
// The message for a CUDA stream in a binary built without the CUDA backend (cannot
// happen through CreateDeviceFromFlag, which refuses `cuda` in such a build).
Status NoCudaKernels() {
  return FailedPreconditionError(
      "the GPT got a CUDA stream, but this strata was built without the CUDA backend "
      "(no nvcc at build time); rebuild with nvcc or use --device host");
}
#else
// The CUDA blocks launch their kernels on the native stream, past the Stream's own operations,
// so each block call is traced as one compute span (a no-op unless the device traces).
Status CudaForward(const GptShape& sh, const GptOptions& options, GptModel::Kind kind,
                   const engine::BlockBuffers& b, gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  const cuda::GptCudaOptions o{.allow_tf32 = options.allow_tf32};
  switch (kind) {
    case GptModel::Kind::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding forward");
      return cuda::CudaEmbeddingForward(sh, stream, b.params, b.tokens, B, T, b.x_out);
    }
    case GptModel::Kind::kLayer: {
      gpu::ScopedComputeSpan span(stream, "layer forward");
      return cuda::CudaLayerForward(sh, stream, b.params, b.x_in, b.x_out, B, T, b.scratch, o);
    }
    case GptModel::Kind::kHead: {
      gpu::ScopedComputeSpan span(stream, "head forward");
      return cuda::CudaHeadForward(sh, stream, b.params, b.x_in, b.targets, B, T, b.logits,
                                   b.scratch, b.loss, o);
    }
  }
  return InternalError("unreachable");
}

Status CudaBackward(const GptShape& sh, const GptOptions& options, GptModel::Kind kind,
                    const engine::BlockBuffers& b, gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  const cuda::GptCudaOptions o{.allow_tf32 = options.allow_tf32};
  switch (kind) {
    case GptModel::Kind::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding backward");
      return cuda::CudaEmbeddingBackward(sh, stream, b.tokens, b.dx_out, B, T, b.grads);
    }
    case GptModel::Kind::kLayer: {
      // Includes the recomputed forward (activation checkpointing).
      gpu::ScopedComputeSpan span(stream, "layer backward");
      return cuda::CudaLayerBackward(sh, stream, b.params, b.x_in, b.dx_out, b.dx_in, b.grads, B, T,
                                     b.scratch, o);
    }
    case GptModel::Kind::kHead: {
      gpu::ScopedComputeSpan span(stream, "head backward");
      return cuda::CudaHeadBackward(sh, stream, b.params, b.x_in, b.targets, b.dloss, B, T, b.dx_in,
                                    b.grads, b.logits, b.scratch, o);
    }
  }
  return InternalError("unreachable");
}
#endif

}  // namespace

Status GptModel::PrepareComputeStream(gpu::Stream& stream) {
  if (!OnCuda(stream)) return Status::Ok();
#ifdef STRATA_HAVE_CUDA
  return cuda::CudaPrepareStream(stream);
#else
  return NoCudaKernels();
#endif
}

Status GptModel::Forward(int block, const engine::BlockBuffers& b, gpu::Stream& stream) {
  const GptShape sh = shape_;
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  if (OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return CudaForward(sh, options_, kind(block), b, stream);
#else
    return NoCudaKernels();
#endif
  }
  switch (kind(block)) {
    case Kind::kEmbedding:
      return stream.LaunchHost([=] {
        EmbeddingForward<float>(sh, b.params, b.tokens, B, T, b.x_out);
        return Status::Ok();
      });
    case Kind::kLayer:
      return stream.LaunchHost([=] {
        LayerForward<float>(sh, b.params, b.x_in, b.x_out, B, T, b.scratch);
        return Status::Ok();
      });
    case Kind::kHead:
      return stream.LaunchHost([=] {
        const float loss =
            HeadForward<float>(sh, b.params, b.x_in, b.targets, B, T, b.logits, b.scratch);
        if (b.targets && b.loss) *b.loss = loss;
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

Status GptModel::Backward(int block, const engine::BlockBuffers& b, gpu::Stream& stream) {
  const GptShape sh = shape_;
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  if (OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return CudaBackward(sh, options_, kind(block), b, stream);
#else
    return NoCudaKernels();
#endif
  }
  switch (kind(block)) {
    case Kind::kEmbedding:
      return stream.LaunchHost([=] {
        EmbeddingBackward<float>(sh, b.tokens, b.dx_out, B, T, b.grads);
        return Status::Ok();
      });
    case Kind::kLayer:
      return stream.LaunchHost([=] {
        LayerBackward<float>(sh, b.params, b.x_in, b.dx_out, b.dx_in, b.grads, B, T, b.scratch);
        return Status::Ok();
      });
    case Kind::kHead:
      return stream.LaunchHost([=] {
        HeadBackward<float>(sh, b.params, b.x_in, b.targets, b.dloss, B, T, b.dx_in, b.grads,
                            b.logits, b.scratch);
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

}  // namespace strata::models
