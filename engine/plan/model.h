// The block interface a model implements to be trained by the engine.
//
// A model is an ordered list of blocks (for a GPT: embedding, N transformer
// layers, head). Each block's parameters are ONE contiguous chunk of
// num_params elements: one H2D copy, one NVMe extent, addressable by
// (offset, length): with data parallelism (EngineOptions::comm in engine.h) the engine
// splits it into N partitions (planner.h, Partition), and each rank keeps the fp32 master
// weights and optimizer state of its own partition only. Blocks pass
// one boundary activation of activation_elems() elements between them; the
// first block reads tokens, the last block produces logits and the loss.
//
// Blocks compute in the working precision (docs/ARCHITECTURE.md, "One training step"): they
// read their working parameters where they sit (a resident region or a streaming slot, fp32,
// fp16 or bf16, no staging copy), keep activations, activation gradients and logits in the same
// dtype, and write their weight gradients in it straight into the device gradient bucket (fp32
// accumulation inside each matrix product, one rounding). Only the loss and the statistics
// inside a block (LayerNorm, softmax) are fp32. Every buffer carries its dtype.
//
// The engine owns all memory: every buffer a block sees was carved from the device arena; the
// block writes nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "gpu/device.h"

namespace strata::engine {

// A target the loss does not count (PyTorch's ignore_index, as a data loader writes it: -1 here).
inline constexpr int32_t kIgnoreTarget = -1;

struct MicroBatchShape {
  int batch_size = 1;  // B: sequences per micro-batch
  int seq_len = 1;     // T: tokens per sequence
  int64_t tokens() const { return int64_t{batch_size} * seq_len; }
};

// A typed view of device memory that crosses the Model interface: where it is, the element type
// and how many elements (DLPack's DLTensor reduced to what a block needs; the shape is in the
// field's comment). Byte is std::byte (TensorRef) or const std::byte (ConstTensorRef). Non-owning.
template <typename Byte>
struct BasicTensorRef {
  Byte* data = nullptr;
  DType dtype = DType::kF32;
  int64_t num_elems = 0;

  BasicTensorRef() = default;
  BasicTensorRef(Byte* d, DType t, int64_t n) : data(d), dtype(t), num_elems(n) {}
  // TensorRef -> ConstTensorRef.
  template <typename Other>
  requires(std::is_const_v<Byte> && !std::is_const_v<Other>)
      BasicTensorRef(const BasicTensorRef<Other>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), dtype(o.dtype), num_elems(o.num_elems) {}

  bool empty() const { return data == nullptr; }
  size_t size_bytes() const { return static_cast<size_t>(num_elems) * SizeOf(dtype); }
  // The elements as storage type S (float, Fp16, Bf16); STRATA_CHECKs that S is the dtype.
  template <typename S>
  auto as() const {
    STRATA_CHECK_MSG(data == nullptr || DTypeOf<S>() == dtype,
                     std::string("buffer is ") + std::string(DTypeName(dtype)) + ", read as " +
                         std::string(DTypeName(DTypeOf<S>())));
    using Elem = std::conditional_t<std::is_const_v<Byte>, const S, S>;
    return reinterpret_cast<Elem*>(data);
  }
};
using TensorRef = BasicTensorRef<std::byte>;
using ConstTensorRef = BasicTensorRef<const std::byte>;

// Device buffers for one block's forward or backward on a micro-batch. Fields not used by a
// block's role are empty. All buffers are device memory. The typed ones are all of one dtype,
// the working precision (`precision`); a block checks that (kInvalidArgument otherwise).
struct BlockBuffers {
  DType precision = DType::kF32;
  ConstTensorRef params;  // (num_params) working parameters, as they sit on the device
  TensorRef grads;        // (num_params) weight gradients, OVERWRITTEN by Backward
  // Tied parameters (Model::tied_block(b) = t >= 0): block t's working params, read as well as
  // the block's own, and this block's gradient contribution to block t's chunk, (num_params of
  // t), OVERWRITTEN by Backward (zero where the block uses none of t's params). The engine folds
  // it into block t's accumulator with t's own gradient. Both empty when the block ties nothing.
  ConstTensorRef tied_params;
  TensorRef tied_grads;
  // Frozen parameters (Model::block_frozen_params(b) > 0): the block's frozen chunk, read only;
  // empty when the block has none. When the tied block's own chunk is empty and its params are
  // frozen, tied_params is that block's frozen chunk and tied_grads is empty. An encoded chunk
  // (Model::frozen_chunk_encoded) keeps dtype (the working precision) and num_elems (the
  // parameter count), but `data` holds the block_frozen_bytes bytes of the model's encoding.
  ConstTensorRef frozen_params;
  ConstTensorRef x_in;              // (B, T, C) boundary activation in; empty for the first block
  TensorRef x_out;                  // (B, T, C) out; empty for the last block
  ConstTensorRef dx_out;            // (B, T, C) gradient of x_out (Backward, not the last block)
  TensorRef dx_in;                  // (B, T, C) gradient of x_in (Backward, not the first block)
  const int32_t* tokens = nullptr;  // (B, T) first block
  // (B, T) last block; null in Forward = no loss. kIgnoreTarget (-1) marks a position the loss
  // does not count (a prompt token, padding, the end of a packed example).
  const int32_t* targets = nullptr;
  // (B, T) int32 or null, every block: the position of each token within its example (packed
  // sequences, Krell et al., "Efficient Sequence Packing without Cross-contamination", 2021).
  // Within a row position_ids[0] == 0 and position_ids[t] is 0 (an example starts) or
  // position_ids[t - 1] + 1 (the engine checks). Token t attends to tokens t - position_ids[t]
  // .. t of its row only, and position embeddings (learned or rotary) use position_ids[t]. Null:
  // one sequence per row, position t.
  const int32_t* position_ids = nullptr;
  // With position_ids: max(position_ids) + 1 over the micro-batch, the positions its longest
  // sequence spans (known on the host when the batch is staged); 0: T. Rotary embeddings whose
  // frequencies depend on the sequence length (LongRoPE's short and long factors) choose by it,
  // as transformers chooses by max(position_ids) + 1.
  int max_positions = 0;
  // The number of targets that are not kIgnoreTarget, B*T when none is ignored: the divisor of
  // the mean loss (last block).
  int64_t loss_tokens = 0;
  TensorRef logits;       // (B, V) last block Forward: the logits of each sequence's last position
  float* loss = nullptr;  // (1) fp32, last block Forward: sum of cross-entropy / loss_tokens
  float dloss = 1.0f;     // last block Backward: d(objective)/d(mean loss), incl. loss scale
  // Sequence objectives (preference training, engine/sequence_objective.h), last block only.
  // target_losses: (B, T) fp32 or null; Forward with targets writes each position's
  // cross-entropy -log p(target) there, in fp32 as the mean loss sums them (0 where the target is
  // kIgnoreTarget). target_weights: (B, T) fp32 or null; when set, Backward's objective is
  // sum_t target_weights[t] CE_t instead of the mean over loss_tokens: the dlogits of row t are
  // S(dloss * target_weights[t] * (softmax - onehot)) (0 where the target is ignored), and
  // loss_tokens is not read. Forward's `loss` stays the mean.
  float* target_losses = nullptr;
  const float* target_weights = nullptr;
  // The model's reference (Model::has_frozen_reference, Forward only): the block computes the
  // function of its frozen parameters alone (LoRA: every adapter off), reading no own params
  // (params may be empty). Preference training's frozen reference policy.
  bool frozen_reference = false;
  // Training steps: this micro-batch's seed of the model's random choices (LoRA dropout, the same
  // in a block's Forward and its Backward's recomputation), never 0; 0 in evaluation and
  // generation (no dropout).
  uint64_t dropout_seed = 0;
  // scratch_bytes(block, shape, precision) bytes, contents undefined; or, for a block that keeps
  // its activations (Model::activation_store_bytes), the block's activation store for this
  // micro-batch (activation_store_bytes bytes) in its Forward and its Backward.
  gpu::DeviceSpan scratch;
  // Model::workspace_bytes(block, shape, precision) bytes (empty when 0), contents undefined:
  // device memory a Forward or Backward may use that is never an activation store (one region
  // shared by every block; a 4-bit base dequantizes a layer's weights into it).
  gpu::DeviceSpan workspace;
  // Backward only: `scratch` is this block's activation store and holds what this block's
  // Forward on this micro-batch (same params, x_in, position_ids and dropout_seed) left there,
  // untouched since; the Backward reads those activations instead of recomputing the forward,
  // with bit-identical results. false: the Backward recomputes the forward from x_in. Forward
  // ignores it.
  bool forward_kept = false;
  MicroBatchShape shape;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string description() const = 0;
  virtual int num_blocks() const = 0;
  virtual std::string block_name(int block) const = 0;  // "embedding", "layer3", "head"
  virtual int64_t block_num_params(int block) const = 0;
  // The shapes of the tensors a block's chunk holds, in chunk order, back to back (their element
  // counts sum to block_num_params). Optimizers whose state depends on a tensor's shape
  // (Adafactor factors the second moment of every tensor of two or more dimensions) read them;
  // the default, one flat tensor, makes every tensor one-dimensional to them.
  virtual std::vector<std::vector<int64_t>> block_tensor_shapes(int block) const {
    return {{block_num_params(block)}};
  }
  // Weight decay groups: the elements of a block's chunk that weight decay leaves alone, as
  // sorted, disjoint, non-empty ranges that cover whole tensors of block_tensor_shapes. The
  // decoder families name their biases and norm weights (every one-dimensional tensor), the
  // parameters transformers' Trainer puts in its weight_decay=0 group (get_decay_parameter_names)
  // and nanoGPT and llm.c leave undecayed. The engine steps them with weight_decay 0 unless
  // EngineOptions::decay_norms_and_biases. The default: none (every element is decayed).
  virtual std::vector<cpu_optim::ElemRange> block_no_decay_ranges(int block) const { return {}; }
  virtual int64_t activation_elems(MicroBatchShape shape) const = 0;  // (B, T, C)
  // (B, V): the head's Forward writes the logits of the last position (t = T - 1) of each
  // sequence, all generation needs; the (B, T, V) logits never exist (the head computes the
  // loss in chunks of rows inside its scratch).
  virtual int64_t logits_elems(MicroBatchShape shape) const = 0;
  virtual int vocab_size() const = 0;
  virtual int max_seq_len() const = 0;
  // Device scratch of one Forward/Backward of `block` computing in `precision`, in bytes; the
  // engine gives every block one region of the largest. Must hold for every backend the model
  // runs on (the model does not know the device here).
  virtual int64_t scratch_bytes(int block, MicroBatchShape shape, DType precision) const = 0;
  // Activation checkpointing per block: the bytes of `block`'s activation store, the device
  // memory in which its Forward leaves every activation its Backward needs (on every backend the
  // model runs on), for a micro-batch of `shape` in `precision`; at least scratch_bytes(block,
  // shape, precision). A block that keeps its activations gets its store as its scratch in its
  // Forward and, with BlockBuffers::forward_kept, in its Backward, which then skips the
  // recomputation. 0 (the default): the block cannot keep them (its Backward recomputes what it
  // needs, or has nothing to recompute). Pure; thread-safe as the const methods are.
  virtual int64_t activation_store_bytes(int block, MicroBatchShape shape, DType precision) const {
    return 0;
  }
  // Tied parameters (tied embeddings: the LM head reads the token embedding): the block whose
  // chunk `block` reads besides its own, or -1. It must be an earlier block that ties nothing
  // itself, and at most one block may tie a given chunk (Engine::Create checks:
  // kInvalidArgument). The engine keeps one chunk, hands it to both blocks, and folds both
  // gradient contributions into one accumulator (BlockBuffers::tied_params, tied_grads).
  virtual int tied_block(int block) const { return -1; }
  // Frozen parameters (LoRA's base weights, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
  // Language Models"): a second chunk of the block, of this many elements, that the engine moves
  // to the device beside the block's own chunk (BlockBuffers::frozen_params) but never trains:
  // no gradient, no master weights, no optimizer state, never written. It lives in the working
  // precision only, at the home the planner gives the working params (device, pinned host memory
  // or NVMe). A block may have frozen params and no own params (block_num_params 0: a wholly
  // frozen block, which gets no gradient bucket and no update), but not neither. Default: none.
  virtual int64_t block_frozen_params(int block) const { return 0; }
  // The frozen chunk's values in fp32 (the engine rounds them to the working precision once):
  // read from the weights the model was created with, or deterministic from seed. Called by
  // Engine::Create for every block with frozen params, from one thread. Errors: those of reading
  // the weights.
  virtual Status InitFrozenParams(int block, uint64_t seed, std::span<float> out) const {
    return UnimplementedError("this model has no frozen parameters");
  }
  // Encoded frozen chunks (QLoRA's 4-bit base, Dettmers et al. 2023: models/ops/quantize_4bit.h):
  // when true, a block's frozen chunk is block_frozen_bytes(block, precision) bytes in the
  // model's own encoding, written by InitFrozenChunk (not InitFrozenParams), and the engine
  // stores, streams and hands them to the block as they are (BlockBuffers::frozen_params).
  virtual bool frozen_chunk_encoded() const { return false; }
  // The frozen chunk's bytes in the working precision `precision`: block_frozen_params elements
  // of it (the default), or the encoding's size. Pure.
  virtual int64_t block_frozen_bytes(int block, DType precision) const {
    return block_frozen_params(block) * static_cast<int64_t>(SizeOf(precision));
  }
  // An encoded frozen chunk into out (block_frozen_bytes bytes, host memory, OVERWRITTEN), for
  // the working precision `precision`; called as InitFrozenParams is. Errors: those of reading
  // the weights.
  virtual Status InitFrozenChunk(int block, uint64_t seed, DType precision,
                                 std::span<std::byte> out) const {
    return UnimplementedError("this model's frozen chunks are not encoded");
  }
  // Whether Forward takes BlockBuffers::frozen_reference: the model's frozen parameters alone
  // are a model of their own (LoRA's base, adapters off), the reference of preference training
  // (Rafailov et al. 2023, "Direct Preference Optimization"). Default: false.
  virtual bool has_frozen_reference() const { return false; }
  // Device workspace of one Forward/Backward of `block` in `precision`, bytes
  // (BlockBuffers::workspace); the engine gives every block one shared region of the largest.
  // Default: none. Pure; thread-safe as the const methods are.
  virtual int64_t workspace_bytes(int block, MicroBatchShape shape, DType precision) const {
    return 0;
  }
  // fp32 initial master weights of a block: deterministic from seed for a random
  // initialisation, or read from the weights the model was created with (an imported Hugging
  // Face checkpoint). Errors: those of reading the weights (I/O, kDataLoss naming the file).
  // Called by Engine::Create, block after block, from one thread.
  virtual Status InitParams(int block, uint64_t seed, std::span<float> out) const = 0;
  // Enqueue the block's forward / backward on `stream`. The backward recomputes the forward from
  // x_in (activation checkpointing at block boundaries) unless BlockBuffers::forward_kept says
  // its scratch still holds the forward's activations. Work runs in stream order; errors surface
  // through the stream.
  virtual Status Forward(int block, const BlockBuffers& buffers, gpu::Stream& stream) = 0;
  virtual Status Backward(int block, const BlockBuffers& buffers, gpu::Stream& stream) = 0;
  // Called once by Engine::Create with the stream Forward/Backward will run on, before any
  // step: the model takes here whatever its kernels need outside the arena (the GPT on CUDA:
  // the stream's cuBLAS handle and its workspace), so that nothing is allocated inside a step.
  // Runs on the thread calling Engine::Create, before any other call on `stream`. Errors
  // (kResourceExhausted, kUnavailable for a missing library) fail Engine::Create.
  virtual Status PrepareComputeStream(gpu::Stream& stream) { return Status::Ok(); }

  // The trained parameters (the own chunks); frozen_params() counts the frozen ones.
  int64_t num_params() const {
    int64_t n = 0;
    for (int b = 0; b < num_blocks(); ++b) n += block_num_params(b);
    return n;
  }
  int64_t frozen_params() const {
    int64_t n = 0;
    for (int b = 0; b < num_blocks(); ++b) n += block_frozen_params(b);
    return n;
  }
};

// What a block's Forward (backward = false) or Backward checks before it enqueues anything: a
// micro-batch shape within the model's context; every buffer its role uses present, of the
// working precision b.precision and large enough (params and grads: the block's num_params;
// tied_params/tied_grads: the tied block's (its frozen chunk, no tied_grads, when its own chunk is
// empty); frozen_params: block_frozen_params; params and grads not needed when the block has no
// own params; activations: activation_elems; logits:
// logits_elems); tokens for the first block, targets for the last block's backward; scratch of
// scratch_bytes; workspace of workspace_bytes; with forward_kept (Backward), a block with an
// activation store and scratch of its activation_store_bytes; frozen_reference only in a Forward
// of a model with has_frozen_reference (then params are not needed). kInvalidArgument naming the
// block and the buffer otherwise. Reads only the Model's const interface; thread-safe if the
// model's const methods are.
Status CheckBlockBuffers(const Model& model, int block, const BlockBuffers& b, bool backward);

// A Model that forwards every call to `inner` (not owned; must outlive this). Derive from it and
// override what changes: a test's injected fault, a benchmark's cached initial weights. Thread-
// safety and errors are those of `inner`.
class ForwardingModel : public Model {
 public:
  explicit ForwardingModel(Model* inner) : inner_(inner) {}
  std::string description() const override { return inner_->description(); }
  int num_blocks() const override { return inner_->num_blocks(); }
  std::string block_name(int block) const override { return inner_->block_name(block); }
  int64_t block_num_params(int block) const override { return inner_->block_num_params(block); }
  std::vector<std::vector<int64_t>> block_tensor_shapes(int block) const override {
    return inner_->block_tensor_shapes(block);
  }
  std::vector<cpu_optim::ElemRange> block_no_decay_ranges(int block) const override {
    return inner_->block_no_decay_ranges(block);
  }
  int64_t activation_elems(MicroBatchShape s) const override { return inner_->activation_elems(s); }
  int64_t logits_elems(MicroBatchShape s) const override { return inner_->logits_elems(s); }
  int vocab_size() const override { return inner_->vocab_size(); }
  int max_seq_len() const override { return inner_->max_seq_len(); }
  int64_t scratch_bytes(int block, MicroBatchShape s, DType precision) const override {
    return inner_->scratch_bytes(block, s, precision);
  }
  int64_t activation_store_bytes(int block, MicroBatchShape s, DType precision) const override {
    return inner_->activation_store_bytes(block, s, precision);
  }
  int tied_block(int block) const override { return inner_->tied_block(block); }
  int64_t block_frozen_params(int block) const override {
    return inner_->block_frozen_params(block);
  }
  Status InitFrozenParams(int block, uint64_t seed, std::span<float> out) const override {
    return inner_->InitFrozenParams(block, seed, out);
  }
  bool frozen_chunk_encoded() const override { return inner_->frozen_chunk_encoded(); }
  bool has_frozen_reference() const override { return inner_->has_frozen_reference(); }
  // An encoding is the inner model's; plain chunks follow this model's block_frozen_params (which
  // a derived model may override).
  int64_t block_frozen_bytes(int block, DType precision) const override {
    return inner_->frozen_chunk_encoded() ? inner_->block_frozen_bytes(block, precision)
                                          : Model::block_frozen_bytes(block, precision);
  }
  Status InitFrozenChunk(int block, uint64_t seed, DType precision,
                         std::span<std::byte> out) const override {
    return inner_->InitFrozenChunk(block, seed, precision, out);
  }
  int64_t workspace_bytes(int block, MicroBatchShape s, DType precision) const override {
    return inner_->workspace_bytes(block, s, precision);
  }
  Status InitParams(int block, uint64_t seed, std::span<float> out) const override {
    return inner_->InitParams(block, seed, out);
  }
  Status Forward(int block, const BlockBuffers& buffers, gpu::Stream& stream) override {
    return inner_->Forward(block, buffers, stream);
  }
  Status Backward(int block, const BlockBuffers& buffers, gpu::Stream& stream) override {
    return inner_->Backward(block, buffers, stream);
  }
  Status PrepareComputeStream(gpu::Stream& stream) override {
    return inner_->PrepareComputeStream(stream);
  }

 protected:
  Model* inner() const { return inner_; }

 private:
  Model* inner_;
};

}  // namespace strata::engine
