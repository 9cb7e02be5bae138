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
#include "engine/micro_batch.h"
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
  // A step whose work failed (a block's op, a copy, a fold, a collective: anything after the
  // checks of its arguments) leaves the engine failed: that error is sticky, every later Step
  // returns it, as a device stream's first error is sticky. With the update after backward the
  // failed step updated nothing (the update starts only after its backward succeeded), so the
  // master weights are those of the last good step (MasterWeights / MasterWeightsXxh3 still read
  // them when they live in host memory or on NVMe).
  StatusOr<StepResult> Step(std::span<const MicroBatch> mbs, SequenceObjective* objective) {
    if (!failed_.ok()) return failed_;
    step_work_started_ = false;
    objective_ = objective;
    StatusOr<StepResult> result = RunStep(mbs);
    objective_ = nullptr;
    if (speculating_) {  // failed with the round open: no pipeline stage may wait for a verdict
      store_->AbandonSpeculativeRound();
      speculating_ = false;
    }
    if (!result.ok() && step_work_started_) failed_ = result.status();
    return result;
  }
  StatusOr<StepResult> RunStep(std::span<const MicroBatch> mbs);
  // A step's forward and backward passes over its micro-batches, in the plan's schedule: each
  // micro-batch's passes in turn (engine.cc), or every micro-batch through a block before the
  // next (layer_major_step.cc). `loss_tokens` and `dloss`: per micro-batch (CheckMicroBatches,
  // MicroBatchLossWeights); `scale`: the step's loss scale. On return every block's backward and
  // gradient stream is enqueued; the folds may still run.
  Status MicroBatchMajorPasses(std::span<const MicroBatch> mbs,
                               std::span<const int64_t> loss_tokens, std::span<const float> dloss,
                               float scale);
  Status LayerMajorPasses(std::span<const MicroBatch> mbs, std::span<const int64_t> loss_tokens,
                          std::span<const float> dloss, float scale);
  Status Flush();
  StatusOr<float> EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape);
  StatusOr<std::vector<float>> EvaluateTargetLosses(const MicroBatch& batch, MicroBatchShape shape,
                                                    bool reference);
  StatusOr<Engine::PolicyAndReferenceLosses> EvaluatePolicyAndReference(const MicroBatch& batch,
                                                                        MicroBatchShape shape);
  StatusOr<std::vector<float>> NextTokenLogits(std::span<const int32_t> tokens);
  StatusOr<uint64_t> MasterWeightsXxh3();
  StatusOr<std::vector<float>> MasterWeights(int block);
  StatusOr<std::vector<float>> AccumulatedGradient(int block);
  Status SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                        const SaveCheckpointOptions& options, std::string* checkpoint_dir);
  Status LoadCheckpoint(const std::string& path, TrainerState* trainer);

  const Plan& plan() const { return plan_; }
  int frozen_base_shared_by() const {
    return shared_frozen_ != nullptr ? shared_frozen_->ranks() : 1;
  }
  uint64_t frozen_base_shared_bytes() const {
    return shared_frozen_ != nullptr ? shared_frozen_->span().size_bytes : 0;
  }
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
  // Init's steps, in the order it takes them. CheckBlocks: at least two blocks, each tie to an
  // earlier block with params (fills tied_ and tied_user_); CheckOptions: the options the engine
  // itself rejects; kInvalidArgument from either.
  Status CheckBlocks();
  Status CheckOptions() const;
  // The master weights, optimizer state and their homes (StateStore), with its speculation when
  // policy_ is set.
  Status CreateStateStore();
  // The host threads' trace tracks (0 without EngineOptions::trace); the store gets its three.
  struct TraceTracks {
    int load = 0, fold = 0, read = 0, update = 0, write = 0;
  };
  TraceTracks RegisterTraceTracks();
  Status CreateStreams();  // compute (prepared for the model's kernels), h2d, d2h
  // The arena regions Init hands to the parts. GradStreamer: the device gradient buckets, the
  // layer-major accumulators, the reduce-scatter buffers and the gradients of blocks optimized
  // on the device (per block). ParamCache: resident params and frozen chunks (per block) and the
  // streaming slots. Empty spans where the plan has no such region.
  struct PartRegions {
    gpu::DeviceSpan grad_buckets, grad_accumulators, reduce_region;
    std::vector<gpu::DeviceSpan> resident, frozen, slots, device_grads;
  };
  // Carves exactly the plan's device regions, in its order: Impl's own (tokens, loss,
  // activations, their gradients, logits, scratch), then the parts'; hands the device-optimized
  // blocks' state regions to the store.
  StatusOr<PartRegions> CarveDeviceRegions();
  // Offloaded activations: the copy events and a pinned buffer per boundary activation.
  Status CreateActivationOffload(uint64_t act_bytes);
  Status CreateGradStreamer(const PartRegions& regions, int fold_track);
  Status CreateParamCache(const PartRegions& regions, int load_track);
  // The token staging and its event, and the store's host and pinned memory.
  Status AllocateHostMemory();

  int64_t np(int b) const { return model_->block_num_params(b); }
  // Data parallelism (EngineOptions::comm). Block b's partition for this rank; with one rank and
  // no communicator the whole chunk: own(b) = home_elems(b) = np(b).
  bool dp() const { return o_.comm != nullptr; }
  int world() const { return dp() ? o_.comm->world_size() : 1; }
  // BlockBuffers::dropout_seed of this rank's micro-batch i of `per_rank` this step: that of its
  // index in the global batch (rank r trains micro-batches r per_rank ... r per_rank + per_rank
  // - 1 of it), so that N ranks draw the masks one rank accumulating them all would.
  uint64_t DropoutSeedOf(size_t i, size_t per_rank) const {
    const size_t rank = dp() ? static_cast<size_t>(o_.comm->rank()) : 0;
    return MicroBatchDropoutSeed(o_.seed, step_, rank * per_rank + i);
  }
  int64_t own(int b) const { return plan_.blocks[b].partition.own_elems; }
  int64_t home_elems(int b) const { return plan_.blocks[b].partition.part_elems; }
  // The whole block from every rank's partition (`mine`: own(b) values): collective.
  int tied(int b) const { return tied_[b]; }
  bool nvme_params() const { return plan_.param_home == ParamHome::kNvme; }
  bool nvme_optim() const { return plan_.optimizer_home == OptimizerHome::kNvme; }

  // Uploads mb, checked by CheckMicroBatch (which gave loss_tokens), into the device's batch
  // slot `slot` (0, or the micro-batch's index with the layer-major schedule); sets the blocks'
  // inputs. Slot 0 first waits until the previous uploads' copies are done.
  Status UploadTokens(const MicroBatch& mb, MicroBatchShape shape, bool with_targets,
                      int64_t loss_tokens, int slot = 0);
  // Slot `slot`'s micro-batch's inputs of block b: its tokens (first block), position ids (every
  // block) and counted targets (last block).
  void SetBatchInputs(int b, int slot, BlockBuffers* buf) const;
  // The buffers of block b's forward or backward for the micro-batch in slot `slot` (its
  // boundary activation, activation gradients and inputs), with the chunks' params; the backward
  // takes its gradient buckets (GradStreamer::NextBucket) and the head's d(loss) `dloss`. A block
  // that keeps its activations (Plan::Block::keeps_activations) gets its store of the slot as its
  // scratch in a training forward (`training`: a backward of this micro-batch follows) and in its
  // backward, which is then told the forward is kept (BlockBuffers::forward_kept).
  BlockBuffers ForwardBuffers(int b, const ParamCache::BlockChunks& chunks, int slot,
                              bool with_targets, MicroBatchShape shape,
                              bool training = false) const;
  StatusOr<BlockBuffers> BackwardBuffers(int b, const ParamCache::BlockChunks& chunks, int slot,
                                         float dloss);
  // The update during backward opens the step's speculative round (after the last forward).
  void OpenSpeculation(float scale);
  // Enqueues block b's forward (backward: false) or backward on the compute stream, its work
  // labelled "forward of block 3 ('layer 2')" (gpu::Stream::SetWorkLabel): a failure at the call
  // or later on the stream names the op and the block.
  Status RunBlock(bool backward, int b, const BlockBuffers& buf);
  // Before reading the master weights: Flush, or after a failed step only the CPU pipeline's
  // updates (the failed step started none; its stream's error says nothing about them).
  Status SettleUpdates() { return failed_.ok() ? Flush() : store_->Drain(); }
  // save_acts: a training forward: offloaded activations are copied out and kept activations
  // stay in their stores for the backward pass to come.
  // In a training step with objective_: the reference forward of each block before its own
  // (when the objective wants it), and WeighMicroBatch(loss_index) after the head.
  // Evaluation: frozen_reference, every block computes the frozen reference instead
  // (BlockBuffers::frozen_reference); target_losses, the head writes slot 0's per-target losses;
  // with_reference, each block's reference forward runs before its own (the reference's
  // per-target losses into slot 0's ref_losses).
  struct ForwardExtras {  // no member initialisers: {} (the default argument) zeroes them all
    bool frozen_reference;
    bool target_losses;
    bool with_reference;
  };
  Status ForwardPass(MicroBatchShape shape, bool with_targets, int loss_index,
                     std::span<const int> seq, size_t* cursor, bool save_acts = false,
                     ForwardExtras extras = {});
  // EvaluateLoss's, EvaluateTargetLosses' and EvaluatePolicyAndReference's forward pass of `batch`
  // (checked against `shape`, its tokens uploaded, no dropout), the loss into slot loss_index (-1:
  // none) as ForwardPass does; enqueued on the compute stream, not waited for. Errors: the batch's
  // (kInvalidArgument) and the pass's.
  Status EvaluationForward(const MicroBatch& batch, MicroBatchShape shape, int loss_index,
                           ForwardExtras extras);
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
  // The first failed step's error (see Step), and whether this step's work has begun.
  Status failed_;
  bool step_work_started_ = false;
  uint64_t cpu_params_updated_ = 0;
  // Set while a checkpoint load copies validated data into the stores; stays set if that fails.
  bool partially_loaded_ = false;
  // The step's sequence objective (Step's argument; null outside a Step and for the mean
  // cross-entropy) and the sum of its micro-batches' shares of the step's objective.
  SequenceObjective* objective_ = nullptr;
  double objective_value_ = 0;

  std::unique_ptr<gpu::DeviceArena> arena_;
  std::unique_ptr<gpu::Stream> compute_, h2d_, d2h_;
  gpu::DeviceSpan loss_, logits_, scratch_, workspace_;  // workspace_: Plan::workspace_bytes
  // Micro-batches held on the device at once: Plan::held_micro_batches (the layer-major
  // schedule's micro-batches, else 1), each in its batch slot: device tokens, targets and
  // position ids, whether it has position ids, and its counted targets.
  int held() const { return plan_.held_micro_batches; }
  struct BatchSlot {
    gpu::DeviceSpan tokens, targets, position_ids;
    bool with_position_ids = false;
    int max_positions = 0;  // BlockBuffers::max_positions of the slot's micro-batch
    int64_t loss_tokens = 0;
  };
  std::vector<BatchSlot> batch_;
  // Plan::objective's buffers per held micro-batch (empty without them): the head's per-target
  // losses and weights, (B, T) fp32 each; with the reference forward its per-target losses and
  // two (B, T, C) boundary activations, block b's reference output in ref_acts[b % 2].
  struct ObjectiveSlot {
    gpu::DeviceSpan losses, weights, ref_losses, ref_acts[2];
  };
  std::vector<ObjectiveSlot> objective_slots_;
  // Block b's reference forward (BlockBuffers::frozen_reference) of held micro-batch `slot`, on
  // the reference's own activations and the shared scratch, before the block's training forward
  // (or, in evaluation, its forward of `shape`).
  Status ReferenceForward(int b, const ParamCache::BlockChunks& chunks, int slot,
                          MicroBatchShape shape);
  // After the head's training forward of micro-batch i (in batch slot `slot`): its per-target
  // losses to the host, objective_->Weigh, the weights back to the device (the head's backward
  // reads them in stream order). Synchronizes the compute stream.
  Status WeighMicroBatch(size_t i, int slot);
  // Step's conditions on objective_: the plan's buffers for it (kFailedPrecondition).
  Status CheckObjective() const;
  // A (B, T, C) activation-sized buffer, or the logits, as the typed view a block sees.
  TensorRef Typed(gpu::DeviceSpan span) const {
    return TensorRef(span.data, o_.precision, static_cast<int64_t>(span.size_bytes / w_));
  }
  // Boundary activations, one per held micro-batch i. Resident: Act(b, i) = output of block b,
  // b < n-1. Offloaded: two sets of device buffers, block b's outputs in set b % 2 and D2H into
  // host_acts_[b * held + i]; act_saved_[s] (d2h) after the latest copy out of set s,
  // act_free_[s] (compute) after the last op reading it, act_ready_[s] (h2d) after a load back
  // into it.
  std::vector<gpu::DeviceSpan> acts_;
  std::vector<gpu::PinnedBuffer> host_acts_;
  std::unique_ptr<gpu::Event> act_written_, act_saved_[2], act_free_[2], act_ready_[2];
  gpu::DeviceSpan Act(int b, int i = 0) const {
    return acts_[(plan_.offload_activations ? b % 2 : b) * held() + i];
  }
  // Offloaded activations: the forward's copy out of block b's output of micro-batch i, and the
  // load of block k's outputs back into their device set (issued after backward k+3, the set's
  // last reader).
  Status SaveActivation(int b, int i = 0);
  Status LoadActivation(int k);
  // Activation gradients: two sets of held buffers; block b's backward reads set b % 2 and
  // writes set (b+1) % 2.
  std::vector<gpu::DeviceSpan> dx_;
  gpu::DeviceSpan Dx(int set, int i) const { return dx_[set * held() + i]; }
  // Activation stores (activation checkpointing, Plan::Block::keeps_activations): block b's for
  // held micro-batch i at act_stores_[b * held + i], empty for a block that recomputes. Written
  // by the block's training forward and read by its backward of the same micro-batch only, both
  // on the compute stream: stream order is their only ordering.
  std::vector<gpu::DeviceSpan> act_stores_;

  // Per batch slot tokens, targets and position ids; then the step's losses and the logits row.
  gpu::PinnedBuffer io_pinned_;
  size_t StagingOffset(int slot) const { return o_.micro_batch.tokens() * 12 * slot; }
  size_t LossesOffset() const { return StagingOffset(held()); }
  size_t LogitsRowOffset() const { return LossesOffset() + o_.grad_accum_steps * 4 + 4; }
  // With Plan::objective: the policy's and the reference's per-target losses and the weights,
  // (B, T) fp32 each, after the logits row.
  size_t ObjectiveStagingOffset() const {
    return LogitsRowOffset() + static_cast<size_t>(model_->vocab_size()) * 4;
  }
  std::unique_ptr<gpu::Event> io_done_;

  // The parts of a step; declared last, so destroyed (their threads joined) first: the cache's
  // loads wait on the store's updates and the fold submits them during backward.
  // The frozen homes shared by this machine's ranks (null: each rank's own). Destroyed after the
  // store and the caches that read it.
  std::unique_ptr<SharedFrozenBase> shared_frozen_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<GradStreamer> grads_;
  std::unique_ptr<ParamCache> params_;
  std::unique_ptr<EngineCheckpoint> checkpoint_;
};

}  // namespace strata::engine
