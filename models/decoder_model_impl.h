// The member functions of DecoderModel<Family> (models/decoder_model.h). Included only by a
// family's .cc, which then instantiates `template class DecoderModel<Family>;`.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "base/dtype.h"
#include "cpu_optim/grad_stats.h"
#include "models/decoder_model.h"

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"  // plain C++: ScopedComputeSpan
#endif

namespace strata::models {

namespace decoder_internal {

inline bool OnCuda(const gpu::Stream& stream) {
  return stream.device_kind() == gpu::DeviceKind::kCuda;
}

// The message for a CUDA stream in a binary built without the CUDA backend (cannot happen
// through CreateDeviceFromFlag, which refuses `cuda` in such a build).
inline Status NoCudaKernels(const char* family) {
  return FailedPreconditionError(
      fmt::format("{} got a CUDA stream, but this strata was built without the CUDA backend (no "
                  "nvcc at build time); rebuild with nvcc or use --device host",
                  family));
}

// Where a layer's adapter scratch starts in the block scratch: after the backend's own bytes,
// at 256 bytes (cuBLASLt's best alignment; the host's 64 included).
inline int64_t LoraScratchOffset(int64_t block_scratch) {
  return (block_scratch + 255) / 256 * 256;
}

// The block's arguments; with `frozen` (DecoderModel::base_frozen) the base is the frozen chunk
// (no gradient), and with `lora` a layer's adapters are the trained chunk, their scratch after
// the backend's own (`block_scratch` bytes), except in the frozen reference's Forward
// (b.frozen_reference), whose layers get no adapters: the inactive LoraLayerArgs of a model
// without LoRA, so that the host and the CUDA layers run their plain bodies (LoraAddsTo is false
// for every product: no adapter kernel, GPT-2's GELU fused as without LoRA) on the frozen base.
template <typename S>
BlockArgs<S> ArgsOf(const engine::BlockBuffers& b, bool frozen = false,
                    const LoraLayout* lora = nullptr, DecoderBlock kind = DecoderBlock::kLayer,
                    int layer = 0, int64_t block_scratch = 0) {
  BlockArgs<S> a;
  a.B = b.shape.batch_size;
  a.T = b.shape.seq_len;
  a.layer = layer;
  a.params = b.params.as<S>();
  a.grads = b.grads.as<S>();
  a.tied_params = b.tied_params.as<S>();
  a.tied_grads = b.tied_grads.as<S>();
  a.x_in = b.x_in.as<S>();
  a.x_out = b.x_out.as<S>();
  a.dx_out = b.dx_out.as<S>();
  a.dx_in = b.dx_in.as<S>();
  a.tokens = b.tokens;
  a.targets = b.targets;
  a.position_ids = b.position_ids;
  a.max_positions = b.max_positions;
  a.loss_tokens = b.loss_tokens;
  a.logits = b.logits.as<S>();
  a.loss = b.loss;
  a.dloss = b.dloss;
  a.target_losses = b.target_losses;
  a.target_weights = b.target_weights;
  a.scratch = b.scratch.data;
  a.forward_kept = b.forward_kept;
  if (frozen) {
    // The base model is frozen: its params are the frozen chunk, and it gets no gradient.
    a.params = b.frozen_params.as<S>();
    a.grads = nullptr;
    a.tied_grads = nullptr;
    if (lora != nullptr && kind == DecoderBlock::kLayer && !b.frozen_reference) {
      a.lora.layout = lora;
      a.lora.layer = layer;
      a.lora.dropout_seed = b.dropout_seed;
      a.lora.adapters = b.params.as<S>();
      a.lora.dadapters = b.grads.as<S>();
      a.lora.scratch = b.scratch.data + LoraScratchOffset(block_scratch);
    }
  }
  return a;
}

// The host blocks: each block's kernels run as one host function on the compute stream, with
// copies of the family (its configuration) and of the typed buffer pointers.
template <typename S, typename Family>
Status HostForward(const Family& f, DecoderBlock kind, const BlockArgs<S>& a, gpu::Stream& stream) {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return stream.LaunchHost([f, a] {
        f.template HostEmbeddingForward<S>(a);
        return Status::Ok();
      });
    case DecoderBlock::kLayer:
      return stream.LaunchHost([f, a] {
        f.template HostLayerForward<S>(a);
        return Status::Ok();
      });
    case DecoderBlock::kHead:
      return stream.LaunchHost([f, a] {
        const float loss = f.template HostHeadForward<S>(a);
        if (a.targets && a.loss) *a.loss = loss;
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

template <typename S, typename Family>
Status HostBackward(const Family& f, DecoderBlock kind, const BlockArgs<S>& a,
                    gpu::Stream& stream) {
  switch (kind) {
    case DecoderBlock::kEmbedding:
      return stream.LaunchHost([f, a] {
        f.template HostEmbeddingBackward<S>(a);
        return Status::Ok();
      });
    case DecoderBlock::kLayer:
      return stream.LaunchHost([f, a] {
        f.template HostLayerBackward<S>(a);
        return Status::Ok();
      });
    case DecoderBlock::kHead:
      return stream.LaunchHost([f, a] {
        f.template HostHeadBackward<S>(a);
        return Status::Ok();
      });
  }
  return InternalError("unreachable");
}

#ifdef STRATA_HAVE_CUDA
// The CUDA blocks launch their kernels on the native stream, past the Stream's own operations,
// so each block call is traced as one compute span (a no-op unless the device traces).
template <typename S, typename Family>
Status CudaForward(const Family& f, DecoderBlock kind, const BlockArgs<S>& a, gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(f.CudaSupports());
  switch (kind) {
    case DecoderBlock::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding forward");
      return f.template CudaEmbeddingForward<S>(a, stream);
    }
    case DecoderBlock::kLayer: {
      gpu::ScopedComputeSpan span(stream, "layer forward");
      return f.template CudaLayerForward<S>(a, stream);
    }
    case DecoderBlock::kHead: {
      gpu::ScopedComputeSpan span(stream, "head forward");
      return f.template CudaHeadForward<S>(a, stream);
    }
  }
  return InternalError("unreachable");
}

template <typename S, typename Family>
Status CudaBackward(const Family& f, DecoderBlock kind, const BlockArgs<S>& a,
                    gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(f.CudaSupports());
  switch (kind) {
    case DecoderBlock::kEmbedding: {
      gpu::ScopedComputeSpan span(stream, "embedding backward");
      return f.template CudaEmbeddingBackward<S>(a, stream);
    }
    case DecoderBlock::kLayer: {
      // Includes the recomputed forward (activation checkpointing) unless a.forward_kept.
      gpu::ScopedComputeSpan span(stream, "layer backward");
      return f.template CudaLayerBackward<S>(a, stream);
    }
    case DecoderBlock::kHead: {
      gpu::ScopedComputeSpan span(stream, "head backward");
      return f.template CudaHeadBackward<S>(a, stream);
    }
  }
  return InternalError("unreachable");
}
#endif

}  // namespace decoder_internal

template <typename Family>
std::string DecoderModel<Family>::block_name(int block) const {
  return DecoderBlockName(block, num_blocks());
}

template <typename Family>
int64_t DecoderModel<Family>::block_num_params(int block) const {
  if (!base_frozen_) return BaseParams(block);
  return lora_ != nullptr && kind(block) == Kind::kLayer ? lora_->layer_params : 0;
}

template <typename Family>
std::vector<std::vector<int64_t>> DecoderModel<Family>::block_tensor_shapes(int block) const {
  if (!base_frozen_) return family_.TensorShapes(kind(block), block - 1);
  if (lora_ == nullptr || kind(block) != Kind::kLayer) return {{0}};
  std::vector<std::vector<int64_t>> shapes;
  for (const LoraSite& s : lora_->sites) {
    shapes.push_back({lora_->rank, s.module.in});   // lora_A (r, in)
    shapes.push_back({s.module.out, lora_->rank});  // lora_B (out, r)
  }
  return shapes;
}

template <typename Family>
std::vector<cpu_optim::ElemRange> DecoderModel<Family>::block_no_decay_ranges(int block) const {
  std::vector<cpu_optim::ElemRange> ranges;
  if (base_frozen_) return ranges;
  int64_t offset = 0;
  for (const std::vector<int64_t>& shape : family_.TensorShapes(kind(block), block - 1)) {
    const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    if (shape.size() == 1 && n > 0) {
      if (!ranges.empty() && ranges.back().end == offset) {
        ranges.back().end += n;  // adjacent: one range
      } else {
        ranges.push_back({offset, offset + n});
      }
    }
    offset += n;
  }
  return ranges;
}

template <typename Family>
int64_t DecoderModel<Family>::block_frozen_params(int block) const {
  return base_frozen_ ? BaseParams(block) : 0;
}

template <typename Family>
Status DecoderModel<Family>::EnableLora(const LoraConfig& config) {
  if (lora_ != nullptr) return FailedPreconditionError("LoRA is already on for this model");
  if (base_frozen_) return FailedPreconditionError("the base is frozen without adapters");
  const std::vector<LoraModule> modules = family_.LoraModules();
  if (modules.empty()) {
    return UnimplementedError(fmt::format(
        "LoRA is not built for {} yet: train it without --lora-rank, or use a Llama model",
        Family::kName));
  }
  STRATA_ASSIGN_OR_RETURN(LoraLayout layout, MakeLoraLayout(config, modules, Family::kName));
  lora_ = std::make_shared<const LoraLayout>(std::move(layout));
  base_frozen_ = true;
  return Status::Ok();
}

template <typename Family>
Status DecoderModel<Family>::FreezeBase() {
  if (lora_ != nullptr) return FailedPreconditionError("LoRA has frozen the base already");
  if (base_frozen_) return FailedPreconditionError("the base is frozen already");
  base_frozen_ = true;
  return Status::Ok();
}

template <typename Family>
int64_t DecoderModel<Family>::activation_elems(engine::MicroBatchShape s) const {
  return s.tokens() * family_.channels();
}

template <typename Family>
int64_t DecoderModel<Family>::logits_elems(engine::MicroBatchShape s) const {
  return int64_t{s.batch_size} * family_.vocab_size();  // the last position of each sequence
}

template <typename Family>
int64_t DecoderModel<Family>::scratch_bytes(int block, engine::MicroBatchShape s,
                                            DType precision) const {
  const int B = s.batch_size, T = s.seq_len;
  const Kind k = kind(block);
  // One figure for both backends (the model does not know the device here).
  return DispatchDType(precision, [&]<typename S>() -> int64_t {
    int64_t host = family_.template HostScratchBytes<S>(k, B, T);
    int64_t cuda = family_.template CudaScratchBytes<S>(k, B, T);
    if (lora_ != nullptr && k == Kind::kLayer) {
      // The adapters' scratch after the layer's, on either backend.
      const int64_t adapters = LoraScratchBytes<S>(*lora_, int64_t{B} * T);
      host = decoder_internal::LoraScratchOffset(host) + adapters;
      cuda = decoder_internal::LoraScratchOffset(cuda) + adapters;
    }
    return std::max(host, cuda);
  });
}

template <typename Family>
int64_t DecoderModel<Family>::activation_store_bytes(int block, engine::MicroBatchShape s,
                                                     DType precision) const {
  return kind(block) == Kind::kLayer ? scratch_bytes(block, s, precision) : 0;
}

template <typename Family>
int DecoderModel<Family>::tied_block(int block) const {
  return family_.tie_embeddings() && kind(block) == Kind::kHead ? 0 : -1;
}

template <typename Family>
Status DecoderModel<Family>::InitBase(int block, uint64_t seed, std::span<float> out) const {
  STRATA_CHECK(static_cast<int64_t>(out.size()) == BaseParams(block));
  if (weights_ != nullptr) return weights_->ReadBlock(block, out);
  family_.Init(kind(block), block - 1, seed, out.data());
  return Status::Ok();
}

template <typename Family>
Status DecoderModel<Family>::InitParams(int block, uint64_t seed, std::span<float> out) const {
  STRATA_CHECK(static_cast<int64_t>(out.size()) == block_num_params(block));
  if (!base_frozen_) return InitBase(block, seed, out);
  if (out.empty()) return Status::Ok();
  if (lora_init_ != nullptr) return lora_init_->ReadBlock(block, out);
  InitLoraLayer(*lora_, block - 1, seed, out.data());
  return Status::Ok();
}

template <typename Family>
Status DecoderModel<Family>::InitFrozenParams(int block, uint64_t seed,
                                              std::span<float> out) const {
  if (!base_frozen_) return engine::Model::InitFrozenParams(block, seed, out);
  return InitBase(block, seed, out);
}

template <typename Family>
Status DecoderModel<Family>::EnableBaseQuant(const ops::Quant4Params& params) {
  if (!base_frozen_) {
    return FailedPreconditionError(
        "a 4-bit base (--base-quant) holds frozen weights: enable LoRA (--lora-rank) or freeze "
        "the base for inference first");
  }
  if (base_quant_.has_value()) return FailedPreconditionError("the base is already quantized");
  if constexpr (!Family::kBaseQuant) {
    return UnimplementedError(fmt::format(
        "a 4-bit base (--base-quant) is built for the Llama families, not {}: use --base-quant "
        "none",
        Family::kName));
  }
  base_quant_ = params;
  // Every layer in every working precision (DType's order), made once: the decodes enqueued on a
  // stream point at them. A source quantized alike keeps in 16 bits what it stores so, and its
  // records dequantize to the type they were quantized from (their quant_state's dtype).
  const int L = family_.num_layers();
  const bool alike = SourceQuantizedAlike();
  if (alike) base_quant_->dtype = weights_->base_quant()->dtype;
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    STRATA_CHECK(static_cast<size_t>(d) * L == encoded_layouts_.size());
    for (int l = 0; l < L; ++l) {
      const auto kept = [&](int64_t offset) { return !weights_->HoldsQuantized(l + 1, offset); };
      encoded_layouts_.push_back(std::make_shared<const EncodedLayerLayout>(
          MakeEncodedLayerLayout(family_.TensorShapes(Kind::kLayer, l), *base_quant_, d,
                                 alike ? std::function<bool(int64_t)>(kept) : nullptr)));
    }
  }
  return Status::Ok();
}

template <typename Family>
bool DecoderModel<Family>::SourceQuantizedAlike() const {
  return base_quant_.has_value() && weights_ != nullptr && weights_->base_quant().has_value() &&
         weights_->base_quant()->type == base_quant_->type &&
         weights_->base_quant()->double_quant == base_quant_->double_quant;
}

template <typename Family>
const EncodedLayerLayout& DecoderModel<Family>::EncodedLayout(int block, DType precision) const {
  STRATA_CHECK(base_quant_.has_value() && kind(block) == Kind::kLayer);
  return *encoded_layouts_[static_cast<size_t>(precision) * family_.num_layers() + block - 1];
}

template <typename Family>
int64_t DecoderModel<Family>::block_frozen_bytes(int block, DType precision) const {
  if (!base_quant_.has_value() || kind(block) != Kind::kLayer) {
    return engine::Model::block_frozen_bytes(block, precision);
  }
  return EncodedLayout(block, precision).bytes;
}

template <typename Family>
Status DecoderModel<Family>::InitFrozenChunk(int block, uint64_t seed, DType precision,
                                             std::span<std::byte> out) const {
  if (!base_quant_.has_value()) {
    return engine::Model::InitFrozenChunk(block, seed, precision, out);
  }
  std::vector<float> values(BaseParams(block));
  // A source quantized alike gives a layer's records as they are, and only its other tensors'
  // values (the 4-bit ones are neither read twice nor dequantized).
  const bool alike = SourceQuantizedAlike();
  if (kind(block) != Kind::kLayer || !alike) {
    STRATA_RETURN_IF_ERROR(InitBase(block, seed, values));
  }
  if (kind(block) != Kind::kLayer) {
    // The embedding and the head stay in the working precision.
    STRATA_CHECK(static_cast<int64_t>(out.size()) == block_frozen_bytes(block, precision));
    return cpu_optim::ConvertFromF32(values.data(), out.data(), precision,
                                     static_cast<int64_t>(values.size()));
  }
  RecordSource records;
  if (alike) {
    STRATA_RETURN_IF_ERROR(weights_->ReadBlockSkippingQuantized(block, values));
    records = [&](const EncodedPart& p, std::span<std::byte> record) -> StatusOr<bool> {
      STRATA_RETURN_IF_ERROR(
          weights_->ReadQuantizedTensor(block, p.chunk_offset, p.record, record));
      return true;
    };
  }
  return EncodeLayerChunk(EncodedLayout(block, precision), precision, values, out, records);
}

template <typename Family>
int64_t DecoderModel<Family>::workspace_bytes(int block, engine::MicroBatchShape s,
                                              DType precision) const {
  if (!base_quant_.has_value() || kind(block) != Kind::kLayer) return 0;
  return BaseParams(block) * static_cast<int64_t>(SizeOf(precision));
}

template <typename Family>
template <typename S>
Status DecoderModel<Family>::DecodeBase(int block, const engine::BlockBuffers& b,
                                        gpu::Stream& stream, BlockArgs<S>* a) const {
  if (!base_quant_.has_value() || kind(block) != Kind::kLayer) return Status::Ok();
  const EncodedLayerLayout* layout = &EncodedLayout(block, b.precision);
  S* weights = b.workspace.as<S>();
  STRATA_RETURN_IF_ERROR(EnqueueDecodeLayerChunk<S>(layout, b.frozen_params.data, weights, stream));
  a->params = weights;
  return Status::Ok();
}

template <typename Family>
Status DecoderModel<Family>::PrepareComputeStream(gpu::Stream& stream) {
  if (!decoder_internal::OnCuda(stream)) return Status::Ok();
#ifdef STRATA_HAVE_CUDA
  STRATA_RETURN_IF_ERROR(family_.CudaSupports());  // refused at Engine::Create, not mid-step
  return family_.CudaPrepareStream(stream);
#else
  return decoder_internal::NoCudaKernels(Family::kName);
#endif
}

template <typename Family>
Status DecoderModel<Family>::Forward(int block, const engine::BlockBuffers& b,
                                     gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(engine::CheckBlockBuffers(*this, block, b, /*backward=*/false));
  const Kind k = kind(block);
  if (decoder_internal::OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return DispatchDType(b.precision, [&]<typename S>() -> Status {
      BlockArgs<S> a = Args<S>(block, b, /*on_cuda=*/true);
      STRATA_RETURN_IF_ERROR(DecodeBase<S>(block, b, stream, &a));
      return decoder_internal::CudaForward<S>(family_, k, a, stream);
    });
#else
    return decoder_internal::NoCudaKernels(Family::kName);
#endif
  }
  return DispatchDType(b.precision, [&]<typename S>() -> Status {
    BlockArgs<S> a = Args<S>(block, b, /*on_cuda=*/false);
    STRATA_RETURN_IF_ERROR(DecodeBase<S>(block, b, stream, &a));
    return decoder_internal::HostForward<S>(family_, k, a, stream);
  });
}

template <typename Family>
template <typename S>
BlockArgs<S> DecoderModel<Family>::Args(int block, const engine::BlockBuffers& b,
                                        bool on_cuda) const {
  const Kind k = kind(block);
  const int B = b.shape.batch_size, T = b.shape.seq_len;
  return decoder_internal::ArgsOf<S>(b, base_frozen_, lora_.get(), k, block - 1,
                                     on_cuda ? family_.template CudaScratchBytes<S>(k, B, T)
                                             : family_.template HostScratchBytes<S>(k, B, T));
}

template <typename Family>
Status DecoderModel<Family>::Backward(int block, const engine::BlockBuffers& b,
                                      gpu::Stream& stream) {
  STRATA_RETURN_IF_ERROR(engine::CheckBlockBuffers(*this, block, b, /*backward=*/true));
  const Kind k = kind(block);
  if (base_frozen_ && lora_ == nullptr) {
    return FailedPreconditionError(
        "a model frozen for inference (FreezeBase) has no gradient: nothing to run backward");
  }
  // LoRA: the frozen embedding has nothing to compute in a backward (no gradient, no input).
  if (lora_ != nullptr && k == Kind::kEmbedding) return Status::Ok();
  if (decoder_internal::OnCuda(stream)) {
#ifdef STRATA_HAVE_CUDA
    return DispatchDType(b.precision, [&]<typename S>() -> Status {
      BlockArgs<S> a = Args<S>(block, b, /*on_cuda=*/true);
      STRATA_RETURN_IF_ERROR(DecodeBase<S>(block, b, stream, &a));
      return decoder_internal::CudaBackward<S>(family_, k, a, stream);
    });
#else
    return decoder_internal::NoCudaKernels(Family::kName);
#endif
  }
  return DispatchDType(b.precision, [&]<typename S>() -> Status {
    BlockArgs<S> a = Args<S>(block, b, /*on_cuda=*/false);
    STRATA_RETURN_IF_ERROR(DecodeBase<S>(block, b, stream, &a));
    return decoder_internal::HostBackward<S>(family_, k, a, stream);
  });
}

}  // namespace strata::models
