// Test helper: one micro-batch of a whole model through engine::Model::Forward/Backward on a
// gpu::Device (the host emulation or CUDA), with the buffers the engine gives the blocks
// (engine/engine.cc: ForwardPass and the backward loop): typed BlockBuffers in the working
// precision S, each block's parameters and gradient chunk, one boundary activation per block
// output, two activation-gradient buffers used in turn (dx_in of block b is dx[b % 2]), the
// last-position logits (B, V), the fp32 loss, a tied block's tied_params (the tied block's
// parameters) and tied_grads (its own region per tying block), and one scratch region of the
// largest scratch_bytes(block, shape, S) over the blocks (and one workspace region of the largest
// workspace_bytes, given to the blocks that have one). Everything lives in one arena span; the
// inputs are uploaded once and every other byte starts as 0xff (NaN in every storage type), so a
// block that reads an output before writing it shows up. A model with frozen chunks (LoRA:
// Model::block_frozen_params) gets them as BlockBuffers::frozen_params, uploaded from the
// `frozen` blocks of Upload/ForwardBackward; a tied block whose tied chunk is frozen reads that
// chunk and gets no tied_grads, as the engine gives them. Preference training's buffers
// (SequenceOptions: the head's target_losses and target_weights, the frozen reference's Forward
// without own params) are off unless set.
//
// Also the whole model's error bound in the terms of the host suite (gpt_kernels_test.cc,
// "Error model" and the whole-model Bf16 test), shared by the host and the CUDA tests.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "engine/plan/model.h"
#include "gpu/device.h"
#include "models/gpt.h"
#include "models/gpt_kernels.h"
#include "tests/models/gpt_test_model.h"

namespace strata::models::test_model {

// What one forward and backward leaves behind, copied back to the host.
template <typename S>
struct ModelRunResult {
  float loss = 0;                     // mean cross-entropy over B T tokens (the head's Forward)
  std::vector<std::vector<S>> grads;  // per block: its chunk's gradient (dloss = 1)
  // per block: its contribution to the tied block's chunk (BlockBuffers::tied_grads); empty for
  // a block that ties nothing.
  std::vector<std::vector<S>> tied_grads;
  std::vector<S> dx0;     // (B, T, C) gradient of the embedding's output
  std::vector<S> logits;  // (B, V) the head's last-position logits (its Forward)
  // (B T) fp32, the head Forward's BlockBuffers::target_losses (SequenceOptions::target_losses);
  // empty otherwise.
  std::vector<float> target_losses;
};

// Preference training's buffers of a ModelRun (engine::BlockBuffers), all off by default.
struct SequenceOptions {
  bool target_losses = false;         // the head's Forward writes BlockBuffers::target_losses
  std::vector<float> target_weights;  // (B T) or empty: the head Backward's target_weights
  // Every Forward gets BlockBuffers::frozen_reference, and no own params (empty `params`) unless
  // reference_params.
  bool frozen_reference = false;
  bool reference_params = false;
};

template <typename S>
class ModelRun {
 public:
  // Carves one span from a new arena of `device` and a pinned image of it. `model` must outlive
  // the run. kResourceExhausted when the device cannot hold it.
  static StatusOr<std::unique_ptr<ModelRun>> Create(engine::Model& model, gpu::Device& device,
                                                    engine::MicroBatchShape shape) {
    std::unique_ptr<ModelRun> run(new ModelRun(model, shape));
    const size_t a = gpu::DeviceArena::kAlignment;  // the arena carves whole alignment units
    run->size_bytes_ = (run->size_bytes_ + a - 1) / a * a;
    STRATA_ASSIGN_OR_RETURN(run->arena_, device.CreateArena(run->size_bytes_));
    STRATA_ASSIGN_OR_RETURN(run->all_, run->arena_->Carve(run->size_bytes_, "model run"));
    STRATA_ASSIGN_OR_RETURN(run->image_, device.AllocatePinned(run->size_bytes_, "model run"));
    return run;
  }

  // The buffers of block `b`'s Forward and Backward, as the engine fills them.
  engine::BlockBuffers ForwardBuffers(int b) const {
    engine::BlockBuffers buf = Common(b);
    if (seq_.frozen_reference) {
      buf.frozen_reference = true;
      if (!seq_.reference_params) buf.params = {};
    }
    if (b > 0) buf.x_in = Typed(acts_[b - 1], act_elems_);
    if (b < num_blocks_ - 1) {
      buf.x_out = Typed(acts_[b], act_elems_);
    } else {
      buf.targets = Span(targets_).template as<const int32_t>();
      buf.logits = Typed(logits_, logits_elems_);
      buf.loss = Span(loss_).template as<float>();
      if (seq_.target_losses) buf.target_losses = Span(target_losses_).template as<float>();
    }
    return buf;
  }
  engine::BlockBuffers BackwardBuffers(int b) const {
    engine::BlockBuffers buf = Common(b);
    if (model_.block_num_params(b) > 0) buf.grads = Typed(grads_[b], model_.block_num_params(b));
    if (const int t = model_.tied_block(b); t >= 0 && model_.block_num_params(t) > 0) {
      buf.tied_grads = Typed(tied_grads_[b], model_.block_num_params(t));
    }
    if (b > 0) {
      buf.x_in = Typed(acts_[b - 1], act_elems_);
      buf.dx_in = Typed(dx_[b % 2], act_elems_);
    }
    if (b < num_blocks_ - 1) {
      buf.dx_out = Typed(dx_[(b + 1) % 2], act_elems_);
    } else {
      buf.targets = Span(targets_).template as<const int32_t>();
      buf.dloss = 1.0f;
      if (!seq_.target_weights.empty()) {
        buf.target_weights = Span(target_weights_).template as<const float>();
      }
    }
    return buf;
  }

  // The micro-batch's dropout seed (BlockBuffers::dropout_seed; 0, the default: no dropout).
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }
  // Preference training's buffers for the next Upload and runs (target_weights: B T or empty).
  void set_sequence_options(SequenceOptions o) {
    STRATA_CHECK(o.target_weights.empty() ||
                 static_cast<int64_t>(o.target_weights.size()) == shape_.tokens());
    seq_ = std::move(o);
  }

  // Encoded frozen chunks (Model::frozen_chunk_encoded: a 4-bit base), one per block of
  // block_frozen_bytes(b, S) bytes (empty for a block without), which Upload copies in place of
  // its `frozen` argument.
  void set_frozen_bytes(std::vector<std::vector<std::byte>> chunks) {
    STRATA_CHECK(static_cast<int>(chunks.size()) == num_blocks_);
    frozen_bytes_ = std::move(chunks);
  }

  // Poisons every byte, then copies the parameters (one chunk of S per block), the frozen chunks
  // (`frozen`, one per block, sized block_frozen_params; null when the model has none, or
  // set_frozen_bytes's), tokens and targets (B T each) in; waits for the copy.
  Status Upload(gpu::Stream& stream, const Model<S>& params, const std::vector<int32_t>& tokens,
                const std::vector<int32_t>& targets,
                const std::vector<std::vector<S>>* frozen = nullptr) {
    STRATA_CHECK(static_cast<int>(params.blocks.size()) == num_blocks_);
    STRATA_CHECK(static_cast<int64_t>(tokens.size()) == shape_.tokens());
    STRATA_CHECK(static_cast<int64_t>(targets.size()) == shape_.tokens());
    std::memset(image_.data(), 0xff, size_bytes_);
    for (int b = 0; b < num_blocks_; ++b) {
      STRATA_CHECK(static_cast<int64_t>(params.blocks[b].size()) == model_.block_num_params(b));
      Put(params_[b], params.blocks[b]);
      if (model_.block_frozen_params(b) > 0 && !frozen_bytes_.empty()) {
        Put(frozen_[b], frozen_bytes_[b]);
      } else if (model_.block_frozen_params(b) > 0) {
        STRATA_CHECK(frozen != nullptr &&
                     static_cast<int64_t>((*frozen)[b].size()) == model_.block_frozen_params(b));
        Put(frozen_[b], (*frozen)[b]);
      }
    }
    Put(tokens_, tokens);
    Put(targets_, targets);
    if (!seq_.target_weights.empty()) Put(target_weights_, seq_.target_weights);
    STRATA_RETURN_IF_ERROR(stream.CopyH2D(all_, image_.span().subspan(0, size_bytes_)));
    return stream.Synchronize();
  }

  // Prepares the stream, uploads, runs every block's Forward (embedding -> layers -> head) and
  // Backward (head -> layers -> embedding) on `stream`, and copies the results back.
  StatusOr<ModelRunResult<S>> ForwardBackward(gpu::Stream& stream, const Model<S>& params,
                                              const std::vector<int32_t>& tokens,
                                              const std::vector<int32_t>& targets,
                                              const std::vector<std::vector<S>>* frozen = nullptr) {
    return Run(stream, params, tokens, targets, frozen, /*backward=*/true);
  }
  // The same with the Forwards only: the loss, the logits and target_losses come back; the
  // gradients are whatever the buffers held (poison).
  StatusOr<ModelRunResult<S>> Forward(gpu::Stream& stream, const Model<S>& params,
                                      const std::vector<int32_t>& tokens,
                                      const std::vector<int32_t>& targets,
                                      const std::vector<std::vector<S>>* frozen = nullptr) {
    return Run(stream, params, tokens, targets, frozen, /*backward=*/false);
  }

 private:
  struct Region {
    size_t offset = 0;
    size_t size_bytes = 0;
  };

  StatusOr<ModelRunResult<S>> Run(gpu::Stream& stream, const Model<S>& params,
                                  const std::vector<int32_t>& tokens,
                                  const std::vector<int32_t>& targets,
                                  const std::vector<std::vector<S>>* frozen, bool backward) {
    STRATA_RETURN_IF_ERROR(model_.PrepareComputeStream(stream));
    STRATA_RETURN_IF_ERROR(Upload(stream, params, tokens, targets, frozen));
    for (int b = 0; b < num_blocks_; ++b) {
      STRATA_RETURN_IF_ERROR(
          model_.Forward(b, ForwardBuffers(b), stream).WithContext(model_.block_name(b)));
    }
    for (int b = num_blocks_ - 1; backward && b >= 0; --b) {
      STRATA_RETURN_IF_ERROR(
          model_.Backward(b, BackwardBuffers(b), stream).WithContext(model_.block_name(b)));
    }
    STRATA_RETURN_IF_ERROR(stream.CopyD2H(image_.span().subspan(0, size_bytes_), all_));
    STRATA_RETURN_IF_ERROR(stream.Synchronize());
    ModelRunResult<S> r;
    std::memcpy(&r.loss, image_.data() + loss_.offset, sizeof(float));
    for (int b = 0; b < num_blocks_; ++b) {
      r.grads.push_back(Get(grads_[b]));
      const int t = model_.tied_block(b);
      r.tied_grads.push_back(t >= 0 && model_.block_num_params(t) > 0 ? Get(tied_grads_[b])
                                                                      : std::vector<S>());
    }
    r.dx0 = Get(dx_[1]);  // the embedding's dx_out
    r.logits = Get(logits_);
    if (seq_.target_losses) r.target_losses = Get<float>(target_losses_);
    return r;
  }

  ModelRun(engine::Model& model, engine::MicroBatchShape shape)
      : model_(model),
        shape_(shape),
        num_blocks_(model.num_blocks()),
        act_elems_(model.activation_elems(shape)),
        logits_elems_(model.logits_elems(shape)) {
    const size_t act_bytes = static_cast<size_t>(act_elems_) * sizeof(S);
    int64_t scratch_bytes = 0, workspace_bytes = 0;
    for (int b = 0; b < num_blocks_; ++b) {
      const size_t chunk = static_cast<size_t>(model.block_num_params(b)) * sizeof(S);
      params_.push_back(Add(chunk));
      grads_.push_back(Add(chunk));
      frozen_.push_back(Add(static_cast<size_t>(model.block_frozen_bytes(b, DTypeOf<S>()))));
      workspace_bytes = std::max(workspace_bytes, model.workspace_bytes(b, shape, DTypeOf<S>()));
      const int t = model.tied_block(b);
      tied_grads_.push_back(t >= 0 ? Add(static_cast<size_t>(model.block_num_params(t)) * sizeof(S))
                                   : Region{});
      scratch_bytes = std::max(scratch_bytes, model.scratch_bytes(b, shape, DTypeOf<S>()));
    }
    for (int b = 0; b + 1 < num_blocks_; ++b) acts_.push_back(Add(act_bytes));
    dx_[0] = Add(act_bytes);
    dx_[1] = Add(act_bytes);
    tokens_ = Add(static_cast<size_t>(shape.tokens()) * sizeof(int32_t));
    targets_ = Add(static_cast<size_t>(shape.tokens()) * sizeof(int32_t));
    logits_ = Add(static_cast<size_t>(logits_elems_) * sizeof(S));
    loss_ = Add(sizeof(float));
    target_losses_ = Add(static_cast<size_t>(shape.tokens()) * sizeof(float));
    target_weights_ = Add(static_cast<size_t>(shape.tokens()) * sizeof(float));
    scratch_ = Add(static_cast<size_t>(scratch_bytes));
    workspace_ = Add(static_cast<size_t>(workspace_bytes));
  }

  // Regions start at the arena's alignment, as the engine's carves do.
  Region Add(size_t size_bytes) {
    const size_t a = gpu::DeviceArena::kAlignment;
    const Region r{(size_bytes_ + a - 1) / a * a, size_bytes};
    size_bytes_ = r.offset + std::max<size_t>(size_bytes, 1);
    return r;
  }
  gpu::DeviceSpan Span(const Region& r) const { return all_.subspan(r.offset, r.size_bytes); }
  engine::TensorRef Typed(const Region& r, int64_t num_elems) const {
    return {Span(r).data, DTypeOf<S>(), num_elems};
  }
  engine::BlockBuffers Common(int b) const {
    engine::BlockBuffers buf;
    buf.precision = DTypeOf<S>();
    buf.dropout_seed = dropout_seed_;
    if (model_.block_num_params(b) > 0) buf.params = Typed(params_[b], model_.block_num_params(b));
    if (model_.block_frozen_params(b) > 0) {
      buf.frozen_params = Typed(frozen_[b], model_.block_frozen_params(b));
    }
    if (const int t = model_.tied_block(b); t >= 0) {
      // A tied chunk with no own params is the tied block's frozen chunk (LoRA).
      buf.tied_params = model_.block_num_params(t) > 0
                            ? Typed(params_[t], model_.block_num_params(t))
                            : Typed(frozen_[t], model_.block_frozen_params(t));
    }
    buf.shape = shape_;
    buf.scratch = Span(scratch_);
    if (model_.workspace_bytes(b, shape_, DTypeOf<S>()) > 0) buf.workspace = Span(workspace_);
    if (b == 0) buf.tokens = Span(tokens_).template as<const int32_t>();
    return buf;
  }
  template <typename T>
  void Put(const Region& r, const std::vector<T>& v) {
    STRATA_CHECK(v.size() * sizeof(T) == r.size_bytes);
    if (r.size_bytes > 0) std::memcpy(image_.data() + r.offset, v.data(), r.size_bytes);
  }
  template <typename T = S>
  std::vector<T> Get(const Region& r) const {
    std::vector<T> v(r.size_bytes / sizeof(T));
    if (r.size_bytes > 0) std::memcpy(v.data(), image_.data() + r.offset, r.size_bytes);
    return v;
  }

  engine::Model& model_;
  engine::MicroBatchShape shape_;
  int num_blocks_;
  int64_t act_elems_, logits_elems_;
  size_t size_bytes_ = 0;
  uint64_t dropout_seed_ = 0;
  SequenceOptions seq_;
  std::vector<std::vector<std::byte>> frozen_bytes_;
  std::vector<Region> params_, grads_, frozen_, tied_grads_, acts_;
  Region dx_[2], tokens_, targets_, logits_, loss_, target_losses_, target_weights_, scratch_,
      workspace_;
  std::unique_ptr<gpu::DeviceArena> arena_;
  gpu::DeviceSpan all_;
  gpu::PinnedBuffer image_;  // the span's contents on the host
};

// The whole model's error against exact arithmetic on the same S inputs, as the host suite
// bounds it (gpt_kernels_test.cc, "Error model" and its whole-model Bf16 test): every rounding to
// S on an output's path adds at most u (|out| + rms(out)) and every fp32 sum of K terms K 2^-24
// of the same, times a gain margin of 2, so
//     |got - exact| <= k eps (|exact| + rms(exact)),   eps = u + K 2^-24,   k = 2 R,
// R the roundings to S on the longest path and K the longest fp32 sum (a weight gradient over
// N = B T rows, the MLP's 4C, the head's V). R as the host suite counts it per block: for the
// loss 1 (embedding) + 8 per layer forward + 2 (lnf, logits); for a gradient (every block's,
// and dx0) 6 (head backward with its forward) + 16 per layer backward (with its recomputed
// forward) + 1 (embedding). Measured on the host (gpt_model_test, WholeModelCases): the worst
// element uses 0.003 of it in fp32, 0.22 in bf16, 0.31 in fp16.
struct WholeModelBound {
  double eps;
  double loss_k;
  double grad_k;
};

template <typename S>
WholeModelBound WholeModelBoundFor(const GptShape& s, int B, int T) {
  const double u = std::is_same_v<S, Bf16> ? 0x1p-8 : std::is_same_v<S, Fp16> ? 0x1p-11 : 0x1p-24;
  const int64_t K = std::max({int64_t{B} * T, int64_t{4} * s.channels, int64_t{s.vocab_size}});
  const double loss_roundings = 1.0 + 8.0 * s.num_layers + 2.0;
  const double grad_roundings = 6.0 + 16.0 * s.num_layers + 1.0;
  return {u + static_cast<double>(K) * 0x1p-24, 2 * loss_roundings, 2 * grad_roundings};
}

// The whole-model cases of the host and the CUDA tests: the `tiny` preset (2 layers, C = 16,
// 2 heads) at T = 16 and 7; a 3-layer shape with C = 48 and 3 heads (head size 16) at T = 7, 67
// (not a multiple of any tile or row block) and 1.
struct WholeModelCase {
  GptShape shape;
  int B, T;
};
inline std::vector<WholeModelCase> WholeModelCases() {
  const StatusOr<GptShape> tiny = GptPreset("tiny");
  STRATA_CHECK(tiny.ok());
  const GptShape odd{256, 72, 3, 3, 48};
  return {{*tiny, 3, 16}, {*tiny, 5, 7}, {odd, 5, 7}, {odd, 2, 67}, {odd, 3, 1}};
}

}  // namespace strata::models::test_model
