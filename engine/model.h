// The block interface a model implements to be trained by the engine.
//
// A model is an ordered list of blocks (for a GPT: embedding, N transformer
// layers, head). Each block's parameters are ONE contiguous chunk of
// num_params elements: one H2D copy, one NVMe extent, addressable by
// (offset, length) so a later data-parallel engine can partition it. Blocks pass
// one boundary activation of activation_elems() fp32 elements between them; the
// first block reads tokens, the last block produces logits and the loss.
//
// The engine owns all memory. It stages a block's working parameters as fp32 on
// the device, and gives the block fp32 gradient and scratch buffers it carved
// from the device arena; the block writes nothing else.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "base/status.h"
#include "gpu/device.h"

namespace strata::engine {

struct MicroBatchShape {
  int batch_size = 1;  // B: sequences per micro-batch
  int seq_len = 1;     // T: tokens per sequence
  int64_t tokens() const { return int64_t{batch_size} * seq_len; }
};

// Device pointers for one block's forward or backward on a micro-batch. Fields
// not used by a block's role are null. All buffers are device memory.
struct BlockBuffers {
  const float* params = nullptr;     // (num_params) fp32 working parameters
  float* grads = nullptr;            // (num_params) fp32, overwritten by Backward
  const float* x_in = nullptr;       // (B, T, C) boundary activation in; null for the first block
  float* x_out = nullptr;            // (B, T, C) out; null for the last block
  const float* dx_out = nullptr;     // (B, T, C) gradient of x_out (Backward, not the last block)
  float* dx_in = nullptr;            // (B, T, C) gradient of x_in (Backward, not the first block)
  const int32_t* tokens = nullptr;   // (B, T) first block
  const int32_t* targets = nullptr;  // (B, T) last block; null in Forward = no loss
  float* logits = nullptr;           // (B, T, V) last block
  float* loss = nullptr;             // (1) last block Forward: mean cross-entropy over B*T
  float dloss = 1.0f;        // last block Backward: d(objective)/d(mean loss), incl. loss scale
  float* scratch = nullptr;  // ScratchBytes(shape) bytes
  MicroBatchShape shape;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string description() const = 0;
  virtual int num_blocks() const = 0;
  virtual std::string block_name(int block) const = 0;  // "embedding", "layer3", "head"
  virtual int64_t block_num_params(int block) const = 0;
  virtual int64_t activation_elems(MicroBatchShape shape) const = 0;  // (B, T, C)
  virtual int64_t logits_elems(MicroBatchShape shape) const = 0;      // (B, T, V)
  virtual int vocab_size() const = 0;
  virtual int max_seq_len() const = 0;
  virtual int64_t scratch_bytes(int block, MicroBatchShape shape) const = 0;
  // fp32 initial master weights of a block, deterministic from seed.
  virtual void InitParams(int block, uint64_t seed, std::span<float> out) const = 0;
  // Enqueue the block's forward / backward (backward recomputes the forward from
  // x_in: activation checkpointing at block boundaries) on `stream`. Work runs
  // in stream order; errors surface through the stream.
  virtual Status Forward(int block, const BlockBuffers& buffers, gpu::Stream& stream) = 0;
  virtual Status Backward(int block, const BlockBuffers& buffers, gpu::Stream& stream) = 0;
  // Called once by Engine::Create with the stream Forward/Backward will run on, before any
  // step: the model takes here whatever its kernels need outside the arena (the GPT on CUDA:
  // the stream's cuBLAS handle and its workspace), so that nothing is allocated inside a step.
  // Runs on the thread calling Engine::Create, before any other call on `stream`. Errors
  // (kResourceExhausted, kUnavailable for a missing library) fail Engine::Create.
  virtual Status PrepareComputeStream(gpu::Stream& stream) { return Status::Ok(); }

  int64_t num_params() const {
    int64_t n = 0;
    for (int b = 0; b < num_blocks(); ++b) n += block_num_params(b);
    return n;
  }
};

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
  int64_t activation_elems(MicroBatchShape s) const override { return inner_->activation_elems(s); }
  int64_t logits_elems(MicroBatchShape s) const override { return inner_->logits_elems(s); }
  int vocab_size() const override { return inner_->vocab_size(); }
  int max_seq_len() const override { return inner_->max_seq_len(); }
  int64_t scratch_bytes(int block, MicroBatchShape s) const override {
    return inner_->scratch_bytes(block, s);
  }
  void InitParams(int block, uint64_t seed, std::span<float> out) const override {
    inner_->InitParams(block, seed, out);
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
