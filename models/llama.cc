#include "models/llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "models/cuda/llama_cuda.h"
#include "models/llama_kernels.h"

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"  // plain C++: ScopedComputeSpan
#endif

namespace strata::models {

namespace {

LlamaConfig Llama2(int vocab, int C, int I, int layers, int heads, int kv_heads, int context) {
  LlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = C;
  c.intermediate_size = I;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = C / heads;
  c.max_seq_len = context;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_embeddings = false;
  return c;
}

struct Preset {
  const char* name;
  LlamaConfig config;
};

std::vector<Preset> Presets() {
  return {{"llama-tiny", Llama2(256, 64, 96, 2, 4, 2, 64)},
          {"llama-1b", Llama2(32000, 2048, 5632, 22, 32, 4, 2048)},
          {"llama-7b", Llama2(32000, 4096, 11008, 32, 32, 32, 4096)},
          {"llama-13b", Llama2(32000, 5120, 13824, 40, 40, 40, 4096)}};
}

bool OnCuda(const gpu::Stream& stream) { return stream.device_kind() == gpu::DeviceKind::kCuda; }

#ifndef STRATA_HAVE_CUDA
// The message for a CUDA stream in a binary built without the CUDA backend.
Status NoCudaKernels() {
  return FailedPreconditionError(
      "the Llama model got a CUDA stream, but this strata was built without the CUDA backend "
      "(no nvcc at build time); rebuild with nvcc or use --device host");
}
#endif

}  // namespace

StatusOr<LlamaConfig> LlamaPreset(std::string_view name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) return p.config;
  }
  return InvalidArgumentError(fmt::format("unknown llama preset '{}': choose one of {}", name,
                                          fmt::join(LlamaPresetNames(), ", ")));
}

std::vector<std::string> LlamaPresetNames() {
  std::vector<std::string> v;
  for (const Preset& p : Presets()) v.emplace_back(p.name);
  return v;
}

StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const LlamaConfig& config, std::shared_ptr<const WeightSource> weights) {
  STRATA_RETURN_IF_ERROR(ValidateLlamaConfig(config));
  return std::unique_ptr<LlamaModel>(new LlamaModel(config, std::move(weights)));
}

std::string LlamaModel::description() const {
  const LlamaConfig& c = config_;
  std::string s = fmt::format(
      "Llama: {} layers, {} heads ({} key/value), {} channels, head dim {}, MLP {}, context {}, "
      "vocabulary {}",
      c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim, c.intermediate_size,
      c.max_seq_len, c.vocab_size);
  if (c.tie_embeddings) s += ", tied embeddings";
  if (c.rope_llama3) s += fmt::format(", llama3 RoPE scaling x{}", c.rope_factor);
  return s;
}

LlamaModel::Kind LlamaModel::kind(int block) const { return DecoderBlockOf(block, num_blocks()); }

std::string LlamaModel::block_name(int block) const {
  return DecoderBlockName(block, num_blocks());
}

std::vector<std::vector<int64_t>> LlamaModel::block_tensor_shapes(int block) const {
  std::vector<LlamaTensor> tensors;
  switch (kind(block)) {
    case Kind::kEmbedding:
      tensors = LlamaEmbeddingTensors(config_);
      break;
    case Kind::kHead:
      tensors = LlamaHeadTensors(config_);
      break;
    case Kind::kLayer:
      tensors = LlamaLayerTensors(config_, block - 1);
      break;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const LlamaTensor& t : tensors) shapes.push_back(t.shape);
  return shapes;
}

int64_t LlamaModel::block_num_params(int block) const {
  switch (kind(block)) {
    case Kind::kEmbedding:
      return LlamaEmbeddingNumParams(config_);
    case Kind::kHead:
      return LlamaHeadNumParams(config_);
    case Kind::kLayer:
      break;
  }
  return LlamaLayerNumParams(config_);
}

int64_t LlamaModel::activation_elems(engine::MicroBatchShape s) const {
  return s.tokens() * config_.hidden_size;
}

int64_t LlamaModel::logits_elems(engine::MicroBatchShape s) const {
  return int64_t{s.batch_size} * config_.vocab_size;
}

int64_t LlamaModel::scratch_bytes(int block, engine::MicroBatchShape s, DType precision) const {
  const int B = s.batch_size, T = s.seq_len;
  // One figure for both backends (the model does not know the device here).
  return DispatchDType(precision, [&]<typename S>() -> int64_t {
    switch (kind(block)) {
      case Kind::kEmbedding:
        return std::max(LlamaEmbeddingScratchBytes<S>(config_, B, T),
                        cuda::LlamaCudaEmbeddingScratchBytes<S>(config_, B, T));
      case Kind::kHead:
        return std::max(LlamaHeadScratchBytes<S>(config_, B, T),
                        cuda::LlamaCudaHeadScratchBytes<S>(config_, B, T));
      case Kind::kLayer:
        break;
    }
    return std::max(LlamaLayerScratchBytes<S>(config_, B, T),
                    cuda::LlamaCudaLayerScratchBytes<S>(config_, B, T));
  });
}

int LlamaModel::tied_block(int block) const {
  return config_.tie_embeddings && kind(block) == Kind::kHead ? 0 : -1;
}

Status LlamaModel::InitParams(int block, uint64_t seed, std::span<float> out) const {
  STRATA_CHECK(static_cast<int64_t>(out.size()) == block_num_params(block));
  if (weights_ != nullptr) return weights_->ReadBlock(block, out);
  switch (kind(block)) {
    case Kind::kEmbedding:
      InitLlamaEmbeddingParams(config_, seed, out.data());
      break;
    case Kind::kHead:
      InitLlamaHeadParams(config_, seed, out.data());
      break;
    case Kind::kLayer:
      InitLlamaLayerParams(config_, block - 1, seed, out.data());
      break;
  }
  return Status::Ok();
}

namespace {

template <typename S>
Status HostForward(const LlamaConfig& c, LlamaModel::Kind kind, const engine::BlockBuffers& b,
                   gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  const S* params = b.params.as<S>();
  void* scratch = b.scratch.data;
  switch (kind) {
    case LlamaModel::Kind::kEmbedding:
      return stream.LaunchHost([=, tokens = b.tokens, x_out = b.x_out.as<S>()] {
        LlamaEmbeddingForward<S>(c, params, tokens, B, T, x_out);
        return Status::Ok();
      });
    case LlamaModel::Kind::kLayer:
      return stream.LaunchHost([=, x_in = b.x_in.as<S>(), x_out = b.x_out.as<S>()] {
        LlamaLayerForward<S>(c, params, x_in, x_out, B, T, scratch);
        return Status::Ok();
      });
    case LlamaModel::Kind::kHead:
      return stream.LaunchHost([=, tied = b.tied_params.as<S>(), x_in = b.x_in.as<S>(),
                                logits = b.logits.as<S>(), targets = b.targets, loss_out = b.loss] {
        const float loss =
            LlamaHeadForward<S>(c, params, tied, x_in, targets, B, T, logits, scratch);
        if (targets && loss_out) *loss_out = loss;
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

template <typename S>
Status HostBackward(const LlamaConfig& c, LlamaModel::Kind kind, const engine::BlockBuffers& b,
                    gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  const S* params = b.params.as<S>();
  S* grads = b.grads.as<S>();
  void* scratch = b.scratch.data;
  switch (kind) {
    case LlamaModel::Kind::kEmbedding:
      return stream.LaunchHost([=, tokens = b.tokens, dx_out = b.dx_out.as<S>()] {
        LlamaEmbeddingBackward<S>(c, tokens, dx_out, B, T, grads, scratch);
        return Status::Ok();
      });
    case LlamaModel::Kind::kLayer:
      return stream.LaunchHost(
          [=, x_in = b.x_in.as<S>(), dx_out = b.dx_out.as<S>(), dx_in = b.dx_in.as<S>()] {
            LlamaLayerBackward<S>(c, params, x_in, dx_out, dx_in, grads, B, T, scratch);
            return Status::Ok();
          });
    case LlamaModel::Kind::kHead:
      return stream.LaunchHost([=, tied = b.tied_params.as<S>(), tied_grads = b.tied_grads.as<S>(),
                                x_in = b.x_in.as<S>(), dx_in = b.dx_in.as<S>(), targets = b.targets,
                                dloss = b.dloss] {
        LlamaHeadBackward<S>(c, params, tied, x_in, targets, dloss, B, T, dx_in, grads, tied_grads,
                             scratch);
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

#ifdef STRATA_HAVE_CUDA
// The CUDA blocks (models/cuda/llama_cuda.h) launch on the native stream, past the Stream's own
// operations, so each block call is traced as one compute span.
template <typename S>
Status CudaForward(const LlamaConfig& c, LlamaModel::Kind kind, const engine::BlockBuffers& b,
                   gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  void* scratch = b.scratch.data;
  switch (kind) {
    case LlamaModel::Kind::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding forward");
      return cuda::LlamaCudaEmbeddingForward<S>(c, stream, b.params.as<S>(), b.tokens, B, T,
                                                b.x_out.as<S>());
    }
    case LlamaModel::Kind::kLayer: {
      gpu::ScopedComputeSpan span(stream, "layer forward");
      return cuda::LlamaCudaLayerForward<S>(c, stream, b.params.as<S>(), b.x_in.as<S>(),
                                            b.x_out.as<S>(), B, T, scratch);
    }
    case LlamaModel::Kind::kHead: {
      gpu::ScopedComputeSpan span(stream, "head forward");
      return cuda::LlamaCudaHeadForward<S>(c, stream, b.params.as<S>(), b.tied_params.as<S>(),
                                           b.x_in.as<S>(), b.targets, B, T, b.logits.as<S>(),
                                           scratch, b.loss);
    }
  }
  return InternalError("unreachable");
}

template <typename S>
Status CudaBackward(const LlamaConfig& c, LlamaModel::Kind kind, const engine::BlockBuffers& b,
                    gpu::Stream& stream) {
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  void* scratch = b.scratch.data;
  switch (kind) {
    case LlamaModel::Kind::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding backward");
      return cuda::LlamaCudaEmbeddingBackward<S>(c, stream, b.tokens, b.dx_out.as<S>(), B, T,
                                                 b.grads.as<S>(), scratch);
    }
    case LlamaModel::Kind::kLayer: {
      // Includes the recomputed forward (activation checkpointing).
      gpu::ScopedComputeSpan span(stream, "layer backward");
      return cuda::LlamaCudaLayerBackward<S>(c, stream, b.params.as<S>(), b.x_in.as<S>(),
                                             b.dx_out.as<S>(), b.dx_in.as<S>(), b.grads.as<S>(), B,
                                             T, scratch);
    }
    case LlamaModel::Kind::kHead: {
      gpu::ScopedComputeSpan span(stream, "head backward");
      return cuda::LlamaCudaHeadBackward<S>(
          c, stream, b.params.as<S>(), b.tied_params.as<S>(), b.x_in.as<S>(), b.targets, b.dloss, B,
          T, b.dx_in.as<S>(), b.grads.as<S>(), b.tied_grads.as<S>(), scratch);
    }
  }
  return InternalError("unreachable");
}
#endif

}  // namespace

Status LlamaModel::PrepareComputeStream(gpu::Stream& stream) {
  if (!OnCuda(stream)) return Status::Ok();
#ifdef STRATA_HAVE_CUDA
  return cuda::LlamaCudaPrepareStream(stream);
#else
  return NoCudaKernels();
#endif
}

Status LlamaModel::Forward(int block, const engine::BlockBuffers& b, gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(engine::CheckBlockBuffers(*this, block, b, /*backward=*/false));
  const Kind k = kind(block);
  if (OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return DispatchDType(b.precision,
                         [&]<typename S>() { return CudaForward<S>(config_, k, b, stream); });
#else
    return NoCudaKernels();
#endif
  }
  return DispatchDType(b.precision,
                       [&]<typename S>() { return HostForward<S>(config_, k, b, stream); });
}

Status LlamaModel::Backward(int block, const engine::BlockBuffers& b, gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(engine::CheckBlockBuffers(*this, block, b, /*backward=*/true));
  const Kind k = kind(block);
  if (OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return DispatchDType(b.precision,
                         [&]<typename S>() { return CudaBackward<S>(config_, k, b, stream); });
#else
    return NoCudaKernels();
#endif
  }
  return DispatchDType(b.precision,
                       [&]<typename S>() { return HostBackward<S>(config_, k, b, stream); });
}

}  // namespace strata::models
