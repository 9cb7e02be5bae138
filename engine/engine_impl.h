// Engine::Impl, the engine's step schedule and the state it keeps (engine/engine.h's Engine is
// its handle). Internal to the engine target: included by the engine's own sources only (the
// schedule's member functions live in engine.cc; a schedule of its own can live in a file of its
// own), never installed with the public headers.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_checkpoint.h"
#include "engine/grad_streamer.h"
#include "engine/param_cache.h"
#include "engine/state_store.h"
#include "engine/update_speculation.h"

namespace strata::engine {

// The step schedule: which block runs when, on which buffers, and what waits for what. The parts
// of a step are their own classes: the working params on the device (ParamCache), the gradients'
// trip to the host (GradStreamer), the master weights, optimizer state and the update
// (StateStore), checkpoints (EngineCheckpoint). Impl keeps the streams the parts share (compute,
// h2d, d2h), the token and activation buffers, and the step's counters and loss scaler.
class Engine::Impl {
 public:
  Impl(Model* model, gpu::Device* device, const EngineOptions& options, Plan plan)
      : model_(model),
        device_(device),
        o_(options),
        plan_(std::move(plan)),
        n_(model->num_blocks()),
        w_(SizeOf(options.precision)),
        scaler_(ScalerOptions(options)) {}

  ~Impl() {
    // Drain the host queues, then every stream, before the memory they use goes away (the parts'
    // own streams, reduce-scatter and all-gather, in their destructors).
    if (params_) params_->Drain().IgnoreError();
    if (grads_) grads_->Drain().IgnoreError();
    if (store_) store_->Drain().IgnoreError();
    for (auto* s : {compute_.get(), h2d_.get(), d2h_.get()}) {
      if (s) s->Synchronize().IgnoreError();
    }
  }

  static LossScalerOptions ScalerOptions(const EngineOptions& o) {
    LossScalerOptions s = o.loss_scaler;
    if (o.precision != DType::kF16) {  // bf16/fp32 need no scaling; overflow still skips
      s.dynamic = false;
      s.initial_scale = 1.0f;
    }
    return s;
  }

  Status Init();
  StatusOr<StepResult> Step(std::span<const MicroBatch> mbs) {
    StatusOr<StepResult> result = RunStep(mbs);
    if (speculating_) {  // failed with the round open: no pipeline stage may wait for a verdict
      store_->AbandonSpeculativeRound();
      speculating_ = false;
    }
    return result;
  }
  StatusOr<StepResult> RunStep(std::span<const MicroBatch> mbs);
  Status Flush();
  StatusOr<float> EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape);
  StatusOr<std::vector<float>> NextTokenLogits(std::span<const int32_t> tokens);
  StatusOr<uint64_t> MasterWeightsXxh3();
  StatusOr<std::vector<float>> MasterWeights(int block);
  StatusOr<std::vector<float>> AccumulatedGradient(int block);
  Status SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                        const SaveCheckpointOptions& options, std::string* checkpoint_dir);
  Status LoadCheckpoint(const std::string& path, TrainerState* trainer);

  const Plan& plan() const { return plan_; }
  std::string_view io_backend_name() const { return store_->io_backend_name(); }
  EngineCounters counters() const {
    EngineCounters c;
    const auto d = device_->counters();
    c.bytes_h2d = d.bytes_h2d;
    c.bytes_d2h = d.bytes_d2h;
    c.grad_bytes_d2h = grads_->grad_bytes_d2h();
    c.nvme_bytes_read = store_->nvme_bytes_read();
    c.nvme_bytes_written = store_->nvme_bytes_written();
    c.device_peak_bytes = arena_ ? arena_->used_bytes() : 0;
    c.pinned_bytes = device_->pinned_used_bytes();
    c.buckets_poisoned = grads_->buckets_poisoned();
    c.params_updated_on_cpu = cpu_params_updated_;
    c.params_updated_during_backward = store_->params_updated_during_backward();
    c.rollback_steps = store_->rollback_steps();
    return c;
  }
  int64_t steps_taken() const { return step_; }
  void SetLearningRate(float lr) { cpu_optim::SetLearningRate(o_.optimizer, lr); }
  float loss_scale() const { return scaler_.scale(); }
  int64_t skipped_steps() const { return scaler_.overflows(); }

 private:
  int64_t np(int b) const { return model_->block_num_params(b); }
  // Data parallelism (EngineOptions::comm). Block b's partition for this rank; with one rank and
  // no communicator the whole chunk: own(b) = home_elems(b) = np(b).
  bool dp() const { return o_.comm != nullptr; }
  int world() const { return dp() ? o_.comm->world_size() : 1; }
  int64_t own(int b) const { return plan_.blocks[b].partition.own_elems; }
  int64_t home_elems(int b) const { return plan_.blocks[b].partition.part_elems; }
  // The whole block from every rank's partition (`mine`: own(b) values): collective.
  int tied(int b) const { return tied_[b]; }
  bool nvme_params() const { return plan_.param_home == ParamHome::kNvme; }
  bool nvme_optim() const { return plan_.optimizer_home == OptimizerHome::kNvme; }

  // Uploads mb, checked by CheckMicroBatch (which gave loss_tokens); sets the blocks' inputs.
  Status UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets,
                      int64_t loss_tokens);
  // The uploaded micro-batch's inputs of block b: its tokens (first block), position ids (every
  // block) and counted targets (last block).
  void SetBatchInputs(int b, BlockBuffers* buf) const;
  // save_acts: offloaded activations are copied out for a backward pass to come.
  Status ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                     std::span<const int> seq, size_t* cursor, bool save_acts = false);
  // The manifest of this engine's training state (files not listed yet).
  Manifest TrainingManifest(const TrainerState& trainer) const;

  Model* model_;
  gpu::Device* device_;
  EngineOptions o_;
  Plan plan_;
  const int n_;
  const size_t w_;
  std::vector<int> tied_;       // Model::tied_block per block
  std::vector<int> tied_user_;  // the block that ties chunk b, or -1
  DynamicLossScaler scaler_;
  int64_t step_ = 0;  // optimizer steps attempted
  // The micro-batch being trained's BlockBuffers::dropout_seed (0 outside RunStep).
  uint64_t dropout_seed_ = 0;
  int64_t adam_t_ = 0;  // updates applied (Adam's t)
  // The update during backward (EngineOptions::update_during_backward, with overlap and a block
  // optimized on the CPU): its backups and verdict, its prediction, and whether this step's
  // speculation is open (from the last micro-batch's backward to the verdict).
  std::unique_ptr<SpeculationPolicy> policy_;
  bool speculating_ = false;
  uint64_t cpu_params_updated_ = 0;
  // Set while a checkpoint load copies validated data into the stores; stays set if that fails.
  bool partially_loaded_ = false;

  std::unique_ptr<gpu::DeviceArena> arena_;
  std::unique_ptr<gpu::Stream> compute_, h2d_, d2h_;
  gpu::DeviceSpan tokens_, targets_, position_ids_, loss_, logits_, scratch_;
  // The uploaded micro-batch: whether it has position ids, and its counted targets.
  bool with_position_ids_ = false;
  int64_t loss_tokens_ = 0;
  // A (B, T, C) activation-sized buffer, or the logits, as the typed view a block sees.
  TensorRef Typed(gpu::DeviceSpan span) const {
    return TensorRef(span.data, o_.precision, static_cast<int64_t>(span.size_bytes / w_));
  }
  // Boundary activations. Resident: acts_[b] = output of block b, b < n-1. Offloaded: two
  // device buffers, block b's output in acts_[b % 2] and D2H into host_acts_[b]; act_saved_[i]
  // (d2h) after the copy out of buffer i, act_free_[i] (compute) after the last op reading it,
  // act_ready_[i] (h2d) after a load back into it.
  std::vector<gpu::DeviceSpan> acts_;
  std::vector<gpu::PinnedBuffer> host_acts_;
  std::unique_ptr<gpu::Event> act_written_, act_saved_[2], act_free_[2], act_ready_[2];
  gpu::DeviceSpan Act(int b) const { return acts_[plan_.offload_activations ? b % 2 : b]; }
  // Offloaded activations: the forward's copy out of block b's output, and the load of act k
  // back into its device buffer (issued after backward k+3, the buffer's last reader).
  Status SaveActivation(int b);
  Status LoadActivation(int k);
  gpu::DeviceSpan dx_[2];

  // Tokens, targets, losses, the logits row, position ids.
  gpu::PinnedBuffer io_pinned_;
  size_t PositionIdsStaging() const {
    return o_.micro_batch.tokens() * 8 + o_.grad_accum_steps * 4 + 4 +
           static_cast<size_t>(model_->vocab_size()) * 4;
  }
  std::unique_ptr<gpu::Event> io_done_;

  // The parts of a step; declared last, so destroyed (their threads joined) first: the cache's
  // loads wait on the store's updates and the fold submits them during backward.
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<GradStreamer> grads_;
  std::unique_ptr<ParamCache> params_;
  std::unique_ptr<EngineCheckpoint> checkpoint_;
};

}  // namespace strata::engine
