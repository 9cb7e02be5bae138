// One decoder adapter: the engine::Model of every decoder family of models/ (embedding block,
// transformer layers, head; models/decoder_blocks.h), written once. A family is its
// configuration and its block functions (as llm.c's gpt2_forward is a list of op calls):
//
//   struct Family {
//     // Configuration.
//     int num_layers() const;  int vocab_size() const;  int max_seq_len() const;
//     int64_t channels() const;  bool tie_embeddings() const;
//     static constexpr const char* kName;  // "the GPT": error messages
//     // Per block kind: the tensors' shapes (in chunk order), the parameter count, the
//     // deterministic initialisation of (seed, block kind, layer index), and the scratch of each
//     // backend in bytes for storage type S and a micro-batch of B sequences of T tokens.
//     std::vector<std::vector<int64_t>> TensorShapes(DecoderBlock kind, int layer) const;
//     int64_t NumParams(DecoderBlock kind) const;
//     std::vector<LoraModule> LoraModules() const;  // what LoRA may target (models/lora.h)
//     void Init(DecoderBlock kind, int layer, uint64_t seed, float* out) const;
//     template <typename S> int64_t HostScratchBytes(DecoderBlock kind, int B, int T) const;
//     template <typename S> int64_t CudaScratchBytes(DecoderBlock kind, int B, int T) const;
//     // The host blocks (run on the compute stream's host worker; STRATA_CHECK on misuse):
//     template <typename S> void HostEmbeddingForward(const BlockArgs<S>&) const;  // and
//     //   HostLayerForward, HostHeadForward (returns the mean loss), HostEmbeddingBackward,
//     //   HostLayerBackward, HostHeadBackward;
//     // with the CUDA backend (STRATA_HAVE_CUDA) the CUDA blocks, enqueued on the stream:
//     template <typename S> Status CudaEmbeddingForward(const BlockArgs<S>&, gpu::Stream&) const;
//     //   and the five others as above; Status CudaSupports() const (what the CUDA blocks do
//     //   not implement: checked when the engine prepares its CUDA compute stream, and again
//     //   before every CUDA block); Status CudaPrepareStream(gpu::Stream&).
//   };
//
// DecoderModel<Family> does the rest: block kinds and names, the tied head, activation and
// logits sizes, the scratch (the larger of the two backends: the model does not know the device
// when the engine sizes it), InitParams (from a WeightSource when given, else Family::Init per
// block, a function of (seed, block) only), the buffer checks, the host/CUDA switch, the storage
// type dispatch, and the one trace span per CUDA block call. Thread-safety as engine::Model: const
// members are safe to call concurrently; Forward/Backward on one stream at a time per block.
//
// The member functions are defined in models/decoder_model_impl.h, which only a family's .cc
// includes, explicitly instantiating DecoderModel<Family> there.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "engine/plan/model.h"
#include "models/base_quant.h"
#include "models/decoder_blocks.h"
#include "models/lora.h"
#include "models/weight_source.h"

namespace strata::models {

// Typed views of engine::BlockBuffers for storage type S: B sequences of T tokens; what a block
// does not use is null (see engine/plan/model.h for each buffer's shape and role).
template <typename S>
struct BlockArgs {
  int B = 0, T = 0;
  int layer = 0;  // a layer block's index in 0..L-1 (its sliding window, LoRA's dropout mask)
  const S* params = nullptr;
  S* grads = nullptr;
  const S* tied_params = nullptr;
  S* tied_grads = nullptr;
  const S* x_in = nullptr;
  S* x_out = nullptr;
  const S* dx_out = nullptr;
  S* dx_in = nullptr;
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;       // engine::kIgnoreTarget where the loss does not count
  const int32_t* position_ids = nullptr;  // (B, T) or null: see engine::BlockBuffers
  int max_positions = 0;                  // engine::BlockBuffers::max_positions (0: T)
  int64_t loss_tokens = 0;                // targets that count (the mean loss's divisor)
  S* logits = nullptr;
  float* loss = nullptr;
  float dloss = 1.0f;
  // The head's sequence objectives (engine::BlockBuffers): (B, T) fp32 or null, each position's
  // cross-entropy (Forward) and each position's weight in the objective (Backward).
  float* target_losses = nullptr;
  const float* target_weights = nullptr;
  void* scratch = nullptr;
  // Layer backward: the scratch holds what the layer's forward on this micro-batch left there
  // (engine::BlockBuffers::forward_kept): the backward skips its recomputed forward.
  bool forward_kept = false;
  // Layers of a model with LoRA (DecoderModel::EnableLora): the adapters, their gradients and
  // their scratch; then params are the frozen base layer's and grads null. Inactive otherwise, and
  // in the frozen reference's Forward (engine::BlockBuffers::frozen_reference).
  LoraLayerArgs<S> lora;
};

// Declares, inside a family struct, the functions of the interface above that DecoderModel
// calls (the configuration accessors and kName are the family's own); the family's .cc defines
// them (the CUDA ones only with STRATA_HAVE_CUDA).
#define STRATA_DECODER_FAMILY_FUNCTIONS()                                             \
  std::vector<std::vector<int64_t>> TensorShapes(DecoderBlock kind, int layer) const; \
  std::vector<LoraModule> LoraModules() const;                                        \
  int64_t NumParams(DecoderBlock kind) const;                                         \
  void Init(DecoderBlock kind, int layer, uint64_t seed, float* out) const;           \
  template <typename S>                                                               \
  int64_t HostScratchBytes(DecoderBlock kind, int B, int T) const;                    \
  template <typename S>                                                               \
  int64_t CudaScratchBytes(DecoderBlock kind, int B, int T) const;                    \
  template <typename S>                                                               \
  void HostEmbeddingForward(const BlockArgs<S>& a) const;                             \
  template <typename S>                                                               \
  void HostLayerForward(const BlockArgs<S>& a) const;                                 \
  template <typename S>                                                               \
  float HostHeadForward(const BlockArgs<S>& a) const;                                 \
  template <typename S>                                                               \
  void HostEmbeddingBackward(const BlockArgs<S>& a) const;                            \
  template <typename S>                                                               \
  void HostLayerBackward(const BlockArgs<S>& a) const;                                \
  template <typename S>                                                               \
  void HostHeadBackward(const BlockArgs<S>& a) const;                                 \
  Status CudaSupports() const;                                                        \
  Status CudaPrepareStream(gpu::Stream& stream) const;                                \
  template <typename S>                                                               \
  Status CudaEmbeddingForward(const BlockArgs<S>& a, gpu::Stream& stream) const;      \
  template <typename S>                                                               \
  Status CudaLayerForward(const BlockArgs<S>& a, gpu::Stream& stream) const;          \
  template <typename S>                                                               \
  Status CudaHeadForward(const BlockArgs<S>& a, gpu::Stream& stream) const;           \
  template <typename S>                                                               \
  Status CudaEmbeddingBackward(const BlockArgs<S>& a, gpu::Stream& stream) const;     \
  template <typename S>                                                               \
  Status CudaLayerBackward(const BlockArgs<S>& a, gpu::Stream& stream) const;         \
  template <typename S>                                                               \
  Status CudaHeadBackward(const BlockArgs<S>& a, gpu::Stream& stream) const;

template <typename Family>
class DecoderModel : public engine::Model {
 public:
  // What a block is: embedding (block 0), transformer layer, or head (the last).
  using Kind = DecoderBlock;

  int num_blocks() const override { return family_.num_layers() + 2; }
  std::string block_name(int block) const override;
  int64_t block_num_params(int block) const override;
  std::vector<std::vector<int64_t>> block_tensor_shapes(int block) const override;
  // The block's one-dimensional tensors: its biases and norm weights (transformers' Trainer's
  // no-decay group for every family here). None for LoRA's adapters (all matrices).
  std::vector<cpu_optim::ElemRange> block_no_decay_ranges(int block) const override;
  int64_t activation_elems(engine::MicroBatchShape s) const override;
  int64_t logits_elems(engine::MicroBatchShape s) const override;
  int vocab_size() const override { return family_.vocab_size(); }
  int max_seq_len() const override { return family_.max_seq_len(); }
  int64_t scratch_bytes(int block, engine::MicroBatchShape s, DType precision) const override;
  // A layer's whole scratch (with LoRA the adapters' part too): its forward leaves there every
  // activation its backward reads, on both backends, and the backward overwrites them only after
  // their last use. 0 for the embedding and the head (nothing to recompute: the head's chunked
  // logits are recomputed by design, never stored).
  int64_t activation_store_bytes(int block, engine::MicroBatchShape s,
                                 DType precision) const override;
  // With tied embeddings the head (the last block) reads the embedding (block 0).
  int tied_block(int block) const override;
  // The weight source's block (its errors returned), else Family::Init from seed.
  Status InitParams(int block, uint64_t seed, std::span<float> out) const override;
  Status Forward(int block, const engine::BlockBuffers& buffers, gpu::Stream& stream) override;
  Status Backward(int block, const engine::BlockBuffers& buffers, gpu::Stream& stream) override;
  // CUDA stream: the family's CudaSupports (kUnimplemented for a config its CUDA blocks do not
  // take), then its CudaPrepareStream (cuBLAS/cuBLASLt handles and workspace, now rather than at
  // the first product of a step). Host stream: nothing.
  Status PrepareComputeStream(gpu::Stream& stream) override;

  // LoRA (models/lora.h): from now on the model's trained params are the layers' adapters only
  // (block_num_params: the layout's layer_params for a layer, 0 for the embedding and the head)
  // and the whole base model is frozen (block_frozen_params: the family's chunks, initialised as
  // InitParams did before). InitParams gives PEFT's initial adapters, or SetLoraInit's. Call
  // before Engine::Create, once. Errors: MakeLoraLayout's (kInvalidArgument naming the flag);
  // kUnimplemented for a family without LoRA; kFailedPrecondition when LoRA is already on.
  Status EnableLora(const LoraConfig& config);
  const LoraLayout* lora() const { return lora_.get(); }
  // Inference over a frozen base without adapters (strata eval/generate --base-quant): from now
  // on every block's params are frozen (block_frozen_params: the family's chunks, initialised as
  // InitParams did before) and none is trained (block_num_params 0), so that EnableBaseQuant can
  // hold the layers in 4 bits. Forward computes what it computed before, over the same values;
  // Backward is not for such a model (nothing has a gradient: kFailedPrecondition). Call before
  // Engine::Create (an inference-only engine: EngineOptions::inference_only), once, instead of
  // EnableLora. Errors: kFailedPrecondition when LoRA is on or the base is already frozen.
  Status FreezeBase();
  // The adapters InitParams reads instead (models/lora_adapter.h OpenLoraAdapter: the layers'
  // adapter chunks as blocks 1..L).
  void SetLoraInit(std::shared_ptr<const WeightSource> init) { lora_init_ = std::move(init); }
  int64_t block_frozen_params(int block) const override;
  Status InitFrozenParams(int block, uint64_t seed, std::span<float> out) const override;
  // With LoRA the base model is the frozen reference (engine::BlockBuffers::frozen_reference): a
  // Forward with the flag leaves every adapter out (the layers run with an inactive
  // LoraLayerArgs, the code of a model without LoRA, on both backends; with a 4-bit base the
  // layer's chunk is decoded as in any Forward) and reads no own params; the embedding and the
  // head are frozen under LoRA anyway. Its outputs are bit for bit those of the same model
  // without LoRA over the same base (the dequantized one with a 4-bit base) on the same backend.
  bool has_frozen_reference() const override { return lora_ != nullptr; }

  // QLoRA (models/base_quant.h): from now on the layers' frozen chunks are encoded, their 2-D
  // tensors in 4 bits (`params`), and each layer's Forward and Backward first decode its chunk
  // into the block workspace (workspace_bytes: one layer in the working precision). A weight
  // source that holds the tensors quantized with the same params (WeightSource::base_quant)
  // gives their records as they are, dequantized to its dtype (bitsandbytes' quant_state dtype,
  // then the working precision) whatever `params.dtype` says; otherwise they are quantized from
  // its values (or the
  // random initialisation) once, in InitFrozenChunk, block by block. Call after EnableLora or
  // FreezeBase, before Engine::Create, once. Errors: kFailedPrecondition without a frozen base
  // or when already on;
  // kUnimplemented for a family whose layers are not the Llama family's nn.Linear layouts.
  Status EnableBaseQuant(const ops::Quant4Params& params);
  const std::optional<ops::Quant4Params>& base_quant() const { return base_quant_; }
  bool frozen_chunk_encoded() const override { return base_quant_.has_value(); }
  int64_t block_frozen_bytes(int block, DType precision) const override;
  Status InitFrozenChunk(int block, uint64_t seed, DType precision,
                         std::span<std::byte> out) const override;
  int64_t workspace_bytes(int block, engine::MicroBatchShape s, DType precision) const override;
  // The encoded layout of layer block `block` (1..L) in `precision`, owned by the model (stable
  // until it is destroyed). Requires base_quant() (STRATA_CHECK). Pure; thread-safe.
  const EncodedLayerLayout& EncodedLayout(int block, DType precision) const;

  Kind kind(int block) const { return DecoderBlockOf(block, num_blocks()); }
  const Family& family() const { return family_; }

 protected:
  DecoderModel(Family family, std::shared_ptr<const WeightSource> weights)
      : family_(std::move(family)), weights_(std::move(weights)) {}

 private:
  // The base model's chunk of a block and its initialisation (without a frozen base: the block's
  // params).
  int64_t BaseParams(int block) const { return family_.NumParams(kind(block)); }
  // The typed buffers of a block, with the LoRA arguments of a layer when LoRA is on (the
  // adapters' scratch after the backend's own: the CUDA layer's on_cuda, else the host's).
  template <typename S>
  BlockArgs<S> Args(int block, const engine::BlockBuffers& b, bool on_cuda) const;
  // With base_quant: a layer's weights decoded into the workspace, enqueued on `stream`, and `a`
  // pointed at them. Otherwise nothing.
  template <typename S>
  Status DecodeBase(int block, const engine::BlockBuffers& b, gpu::Stream& stream,
                    BlockArgs<S>* a) const;
  Status InitBase(int block, uint64_t seed, std::span<float> out) const;
  // With base_quant: the weight source holds the layers quantized with the same params (its
  // records are read as they are, and what it keeps in 16 bits stays so).
  bool SourceQuantizedAlike() const;

  Family family_;
  std::shared_ptr<const WeightSource> weights_;  // null: random initialisation
  std::shared_ptr<const LoraLayout> lora_;       // null: no LoRA
  bool base_frozen_ = false;                     // EnableLora or FreezeBase
  std::shared_ptr<const WeightSource> lora_init_;
  std::optional<ops::Quant4Params> base_quant_;
  // The encoded layouts of a layer in each working precision (fp32, fp16, bf16: DType's order),
  // made by EnableBaseQuant; every layer has the same tensor shapes. Stable addresses: the
  // decodes enqueued on a stream point at them.
  std::vector<std::shared_ptr<const EncodedLayerLayout>> encoded_layouts_;
};

}  // namespace strata::models
