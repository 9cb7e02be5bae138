// The offload engine: trains a Model whose state does not fit in device memory.
//
// Placement (docs/ARCHITECTURE.md, "Where each tensor lives"):
//   working params p16 (fp16/bf16, or fp32)  device if resident, else streamed per
//                                            block from pinned host or NVMe
//   gradients g16                            device -> D2H -> pinned host bucket ->
//                                            fp32 accumulators on the host, or kept 16-bit
//                                            when a step has one micro-batch (planner.h)
//   master params p32, optimizer state       host memory or the NVMe swap store
//                                            (optimizer_state.h: AdamW's fp32 m and v, 8-bit
//                                            AdamW, Adafactor, ...)
//
// One optimizer step = grad_accum_steps micro-batches of forward (blocks 0..N-1,
// keeping only block-boundary activations) and backward (N-1..0, recomputing
// each block's forward), then a CPU optimizer step over every block with the global
// gradient norm and the overflow flag known: fused unscale (1/loss scale) and
// clipping, fused copy-out of the new working params. An fp16 overflow skips
// the update of every block and lowers the loss scale; master weights are never
// touched by a non-finite value.
//
// Results do not depend on placement: the same seed trained with everything
// resident or with params streamed and optimizer state on NVMe gives
// bit-identical master weights.
//
// Overlap (docs/ARCHITECTURE.md, "One training step"). The driving thread only enqueues; the
// work runs on
//   - the device's compute, H2D and D2H streams;
//   - a prefetch thread that loads the working params of the next prefetch_depth blocks
//     (NVMe -> pinned -> device, reverse order in backward) while a block computes;
//   - a gradient-fold thread: as each block's backward ends, its 16-bit gradients go D2H into a
//     pinned bucket, and this thread folds the landed bucket into the fp32 accumulators and the
//     running statistics (sum of squares, inf/nan) while backward goes on; a bucket returns to
//     its pool only after its copy landed and its fold finished;
//   - the CPU-optimizer pipeline (engine/optimizer_pipeline.h, run by engine/state_store.h):
//     with the global norm and the
//     overflow flag known when backward ends, blocks update in forward order (read state of
//     b+1, update b, write b-1 for state on NVMe) while Step returns; the next forward of block
//     b waits only on block b's update. No stale update: the numbers are those of a sequential
//     step, bit for bit.
// With update_during_backward (engine/update_speculation.h) a CPU-optimized block's update
// starts as soon as its gradient is complete, during backward, speculatively, and stands or is
// redone when backward ends: the same numbers, bit for bit.
//
// Thread-safety: an Engine is driven by one host thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "base/trace.h"
#include "comm/communicator.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/checkpoint.h"
#include "engine/loss_scaler.h"
#include "engine/micro_batch.h"
#include "engine/plan/model.h"
#include "engine/plan/planner.h"
#include "engine/sequence_objective.h"
#include "gpu/device.h"
#include "io/io_backend.h"

namespace strata::engine {

// Test seams: production code leaves them at their defaults (EngineOptions::test_hooks).
struct EngineTestHooks {
  // Keep fp32 gradient accumulators for every block even where the host would keep the 16-bit
  // gradient (planner.h, GradInWorkingPrecision), to compare the two paths.
  bool fp32_host_grads = false;
  // Fill each pinned gradient bucket with NaN bytes when it returns to its pool, so a bucket
  // read before its copy landed, or reused while still being read, makes the step's gradient
  // non-finite (EngineCounters::buckets_poisoned counts them).
  bool poison_released_buckets = false;
  // When set, the swap store's I/O backend is made by this function (called once, from Create,
  // with EngineOptions::io) instead of io::CreateIoBackend; tests pass one that returns an
  // io::FaultInjectingBackend to inject ENOSPC, EIO or short transfers during training.
  std::function<StatusOr<std::unique_ptr<io::IoBackend>>(const io::IoBackendOptions&)>
      io_backend_factory;
  // The update during backward speculates on every block, ignoring its prediction of clipping
  // (SpeculationPolicy): a step that clips then always rolls back.
  bool always_speculate = false;
  // The verdict waits until every speculative update submitted so far has run (its write-back
  // still waits for the verdict; with a write stage, NVMe state or params, only the first
  // num_buffers submissions can run), so which blocks ran before it does not depend on timing.
  // With a backup area that holds them all only (an update waiting for space would wait
  // forever).
  bool finish_speculation_before_verdict = false;
};

struct EngineOptions {
  DType precision = DType::kBF16;  // working params and gradients
  MicroBatchShape micro_batch;     // shape of every training micro-batch
  int grad_accum_steps = 1;
  // The CPU optimizer and its hyper-parameters (cpu_optim/any_optimizer.h): AdamW by default;
  // every kind there, with its state laid out per block as engine/plan/optimizer_state.h says.
  cpu_optim::AnyOptimizer optimizer;
  // Weight decay groups: false (the default) steps the elements the model names in
  // Model::block_no_decay_ranges (the decoder families' biases and norm weights) with
  // weight_decay 0, as transformers' Trainer does; true decays every trained element, as one
  // torch.optim parameter group over model.parameters() does.
  bool decay_norms_and_biases = false;
  float grad_clip_norm = 1.0f;    // clip by global L2 norm; 0 = off
  LossScalerOptions loss_scaler;  // used when precision is fp16
  PlacementOptions placement;     // budgets, homes, NVMe paths
  io::IoBackendOptions io;
  uint64_t seed = 1337;  // parameter initialisation
  // May be empty. Called by Create on its calling thread while it initialises the model's state
  // (master weights, optimizer state, working params in their homes; blocks run in parallel on
  // oneTBB, each from its own sampler, so the values do not depend on the thread count): once with
  // 0 done when the memory is allocated and pinned, then after each block: blocks and parameters
  // done so far and in all. `strata train` turns it into a
  // progress line for a large model.
  std::function<void(int blocks_done, int num_blocks, int64_t params_done, int64_t num_params)>
      init_progress;
  // May be empty. Polled on the calling thread between blocks while Create initialises the
  // state (frozen base, master weights, optimizer state, working params) and while
  // LoadCheckpoint verifies and reads a checkpoint (between files, then between blocks): once it
  // returns true the call stops and returns kCancelled ("cancelled while ..., block B of N").
  // A cancelled Create destroys what it made (its swap files and their directories are
  // removed); a load cancelled while verifying changes nothing, one cancelled while reading
  // leaves the engine partially loaded, as an I/O error there does. `strata train` sets it to
  // "SIGINT or SIGTERM arrived", so that a signal during a long start ends the run cleanly.
  std::function<bool()> cancel_requested;
  // Not owned, may be null: the engine's host threads record their work on tracks "host:
  // prefetch (nvme read)", "host: gradient fold", "host: optimizer state read", "host: cpu
  // optimizer" and "host: optimizer state write" (the device records its streams itself when
  // given the same recorder in its options).
  trace::TraceRecorder* trace = nullptr;
  // false: the sequential pipeline, for comparison and debugging: every load, kernel, copy,
  // fold and block update completes before the next starts, nothing is prefetched, and Step
  // returns with its update applied. Results are bit-identical either way.
  bool overlap = true;
  // The CPU update during backward (engine/update_speculation.h): each CPU-optimized block's
  // update starts as soon as its gradient is complete, during the last micro-batch's backward,
  // speculatively (no clipping, no overflow), and is validated when backward ends: it stands, or
  // the blocks already updated are restored and updated again with the clip coefficient (or left
  // restored on an fp16 overflow). Bit-identical to the update after backward in every case; a
  // block is speculated only while the step is predicted not to clip. Ignored without overlap
  // and when no block's optimizer runs on the CPU; one rank only (kInvalidArgument with comm).
  bool update_during_backward = false;
  // Its backup area in host memory (what speculative updates overwrite, for a rollback); 0: the
  // default, max(64 MiB, 1/8 of what all CPU-optimized blocks would need). Updates that would not
  // fit wait for the verdict. The plan holds it in its host total (Plan::speculation_backup_bytes,
  // from PlacementOptions::update_during_backward and speculation_backup_bytes, which Create sets
  // from these two).
  uint64_t speculation_backup_bytes = 0;
  // Inference only (`strata eval`, `strata generate`): no optimizer state, no gradient
  // accumulators and no NVMe; the working params live in their device or pinned host home,
  // made from the model's InitParams (or a checkpoint's master weights, converted) through one
  // block-sized fp32 buffer. Step, MasterWeights*, and SaveCheckpoint return
  // kFailedPrecondition; LoadCheckpoint accepts a checkpoint of any precision. Needs
  // placement.param_home device or host and optimizer_home host (kInvalidArgument otherwise).
  bool inference_only = false;
  // Data parallelism, after ZeRO stage 2 with CPU offload (Rajbhandari et al., SC 2020; Ren et
  // al., "ZeRO-Offload", USENIX ATC 2021). Not owned, may be null: one rank, as without it.
  // With a communicator of N ranks (N = 1 allowed; one engine per rank, each with its own
  // device), every block's chunk is split into N partitions (planner.h, Partition; the plan's
  // placement.ranks and rank come from it) and this rank keeps only its partition of the fp32
  // master weights, the optimizer state and the host gradient, in its host memory or its own
  // NVMe paths, and of the working params' pinned or NVMe home. Per block in backward: the 16-bit
  // gradients are widened to fp32 and reduce-scattered on the device (stream "reduce-scatter",
  // overlapped with the next block's backward), this rank's partition goes D2H and is folded;
  // the update runs on the partition; before a block's next use its updated partition goes H2D
  // and is all-gathered on the device (stream "all-gather"). The gradient norm, the overflow flag
  // and the loss are all-reduced, so every rank clips, skips and reports alike; each
  // micro-batch's gradient is weighted 1 / (micro-batches x N), so N ranks with A micro-batches
  // each give the update of one rank with N x A micro-batches (within fp32 summation order).
  // The engine duplicates the communicator twice (one for gradients, one for params) in Create;
  // it uses `comm` itself only from the driving thread, inside Step, Flush's callers
  // (MasterWeights*, AccumulatedGradient) and checkpoints, which are then collective: every rank
  // calls them in the same order. Needs an optimizer with element-wise state for N > 1
  // (PartitionableOptimizer), no update_during_backward and no inference_only.
  comm::Communicator* comm = nullptr;
  // With comm, the ranks of one machine map one copy of the frozen chunks' pinned homes (LoRA's
  // base: the same on every rank, never written) instead of each pinning its own
  // (engine/shared_frozen_base.h); when /dev/shm cannot hold it, a warning and a copy each.
  // The plan's host figures still count a copy per rank. Results are the same either way.
  bool share_frozen_base = true;
  // Tests only; production code never sets them.
  EngineTestHooks test_hooks;
};

struct SaveCheckpointOptions {
  // > 0: after the save, keep only the newest keep_last complete checkpoints in the save
  // directory (never the one `latest` names). 0 keeps all.
  int keep_last = 0;
};

struct StepResult {
  float loss = 0;        // mean over the micro-batches
  double grad_norm = 0;  // global L2 norm of the unscaled gradient (before clipping)
  bool skipped = false;  // fp16 overflow: no parameter changed
  float loss_scale = 1;  // the scale used for this step
  // The update during backward: parameters whose CPU update ran during this step's backward and
  // stood, and whether speculative updates were rolled back (restored, then redone or skipped).
  int64_t params_updated_during_backward = 0;
  bool rolled_back = false;
};

struct EngineCounters {
  uint64_t bytes_h2d = 0;
  uint64_t bytes_d2h = 0;
  // Of bytes_d2h, the gradients the gradient streamer sent to the host (zero when every block's
  // optimizer runs on the device: only their statistics records, DeviceGradStatsBytes a block,
  // cross).
  uint64_t grad_bytes_d2h = 0;
  uint64_t nvme_bytes_read = 0;
  uint64_t nvme_bytes_written = 0;
  uint64_t device_peak_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint64_t buckets_poisoned = 0;  // EngineTestHooks::poison_released_buckets
  // The update during backward, over all steps: parameters updated on the CPU, of them those
  // whose update ran during backward and stood, and the steps that rolled back.
  uint64_t params_updated_on_cpu = 0;
  uint64_t params_updated_during_backward = 0;
  uint64_t rollback_steps = 0;
};

class Engine {
 public:
  // Runs `plan`, the one engine::ChoosePlan chose (engine/plan/plan_choice.h) for these options
  // (options.placement and options.update_during_backward as the choice resolved them): takes
  // the device arena and pinned memory the plan lists, lays out the swap store, initialises
  // master weights from options.seed. Plans nothing itself. Errors: a plan made for other
  // options (kInvalidArgument naming the difference: precision, micro-batch, ranks, blocks, the
  // update during backward, whose backup area the plan holds),
  // bad options (kInvalidArgument), an unusable NVMe path (its Status, naming the path). model
  // and device are not owned and must outlive the engine.
  static StatusOr<std::unique_ptr<Engine>> Create(Model* model, gpu::Device* device,
                                                  const EngineOptions& options, Plan plan);
  // The same with the plan MakePlan makes of options as given (nothing auto): for callers that
  // fix every placement choice themselves (tests, examples). Errors: MakePlan's (an infeasible
  // budget is kResourceExhausted naming what is short and by how much) and Create's above.
  static StatusOr<std::unique_ptr<Engine>> Create(Model* model, gpu::Device* device,
                                                  const EngineOptions& options);
  ~Engine();

  const Plan& plan() const;
  // The ranks whose frozen base this rank's is (EngineOptions::share_frozen_base): this
  // machine's data-parallel ranks when they share one copy, else 1.
  int frozen_base_shared_by() const;
  // The bytes of that one shared copy (the frozen chunks' pinned homes, each 4 KiB-aligned); 0
  // when not shared.
  uint64_t frozen_base_shared_bytes() const;
  std::string_view io_backend_name() const;  // "uring", "posix" or "memory"; "" without NVMe

  // One optimizer step over micro_batches.size() == grad_accum_steps
  // micro-batches of the configured shape. Token ids must be < vocab size. The micro-batches
  // run in the plan's schedule (PlacementOptions::schedule: each one's forward and backward in
  // turn, or layer-major: all of them through a block before the next), with the same result
  // (bit for bit for untied models; a tied chunk's fp32 sum differs in rounding only).
  // Returns when backward has finished and the update is known (loss, norm, skipped); the
  // update itself runs on the CPU pipeline behind the return and the next call's forward pass.
  // An error of that update (an NVMe write failing, say) comes back from the next call that
  // needs its result: Step, EvaluateLoss, NextTokenLogits, Flush, MasterWeights* or a
  // checkpoint save. After an error the engine's state is unknown: recreate it and resume from
  // a checkpoint.
  // A failure of the step's own work (a block's forward or backward, a copy, a fold: anything
  // after the checks of the arguments) is returned naming the op where the device layer can tell
  // ("backward of block 3 ('layer 2') failed on stream 'compute': ..."; gpu::Stream::SetWorkLabel)
  // and is sticky: every later Step returns the same error, and nothing waits for work that can
  // no longer complete. With the update after backward such a step updated nothing, so master
  // weights in host memory or on NVMe stay those of the last good step (MasterWeights* still read
  // them); with the update during backward its speculative updates get the verdict "roll back"
  // (StateStore::AbandonSpeculativeRound).
  //
  // With `objective` (not owned; engine/sequence_objective.h) the step's objective is its
  // instead of the mean cross-entropy: each micro-batch's gradient is that of sum_t w_t CE_t with
  // the weights it gives after the micro-batch's forward (the loss scale and 1 / ranks
  // multiplied in), and StepResult::loss is the sum of its Weigh results. With data parallelism
  // the weights are the whole job's (each rank weighs its own micro-batches as a share of every
  // rank's: the ranks' gradients are summed) and the loss is summed over the ranks. Needs a plan
  // with PlacementOptions::objective.target_weights, and .reference_forward when the objective
  // wants the reference (kFailedPrecondition otherwise).
  StatusOr<StepResult> Step(std::span<const MicroBatch> micro_batches,
                            SequenceObjective* objective = nullptr);

  // Waits until the last Step's update has been applied everywhere (master weights, optimizer
  // state and working params in their homes, NVMe included); its error, if any.
  Status Flush();

  // Mean loss of a forward pass (no gradients); shape may be smaller than the
  // training micro-batch.
  StatusOr<float> EvaluateLoss(const MicroBatch& batch, MicroBatchShape shape);

  // A forward pass's per-target cross-entropy, (B, T) fp32 (0 where the target is
  // kIgnoreTarget), under the trained model or, with `reference`, its frozen reference
  // (Model::has_frozen_reference: LoRA's base with the adapters off): what a sequence objective's
  // Weigh gets, for evaluation and for the reference log-probabilities of full fine-tuning
  // computed before training. Needs a plan with PlacementOptions::objective.target_weights
  // (kFailedPrecondition otherwise); `reference` on a model without one is kInvalidArgument;
  // batch errors as EvaluateLoss's.
  StatusOr<std::vector<float>> EvaluateTargetLosses(const MicroBatch& batch, MicroBatchShape shape,
                                                    bool reference = false);
  // Both of EvaluateTargetLosses' results, the trained model's and its frozen reference's, from
  // one pass over the blocks: each block's reference forward (on the reference's own
  // activations) just before its forward, as a training step with the reference runs them, so
  // that a streamed base is read once for both. Bit for bit the two EvaluateTargetLosses calls.
  // Needs a model with a frozen reference (kInvalidArgument) and a plan with
  // PlacementOptions::objective.reference_forward (kFailedPrecondition); batch errors as
  // EvaluateLoss's.
  struct PolicyAndReferenceLosses {
    std::vector<float> policy, reference;  // (B, T) fp32 each
  };
  StatusOr<PolicyAndReferenceLosses> EvaluatePolicyAndReference(const MicroBatch& batch,
                                                                MicroBatchShape shape);

  // Logits (V floats) of the last position of one sequence of up to seq_len tokens.
  StatusOr<std::vector<float>> NextTokenLogits(std::span<const int32_t> tokens);

  // xxh3-64 of the fp32 master weights, block after block.
  StatusOr<uint64_t> MasterWeightsXxh3();
  // Copies the fp32 master weights of a block (for tests and export).
  StatusOr<std::vector<float>> MasterWeights(int block);
  // The gradient the last Step accumulated for a block's chunk (tied contributions included), as
  // the optimizer read it: fp32, the mean over the step's micro-batches times the loss scale
  // (1 unless fp16). For tests and gradient checks. kFailedPrecondition before any step or on an
  // inference-only engine.
  StatusOr<std::vector<float>> AccumulatedGradient(int block);

  // Learning rate of the following steps (a schedule is the caller's).
  void SetLearningRate(float lr);

  // Writes a checkpoint of the whole training state (engine/checkpoint.h: directory layout and
  // the crash-safe protocol) as save_dir/step-{trainer.step} and points save_dir/latest at it.
  // Tensors stream block by block out of the engine's stores (host memory, or the swap store
  // through the I/O engine): host memory use is one block's state, never a whole-model copy.
  // Call between steps. On success *checkpoint_dir (if not null) is the new directory.
  // Errors: file-system errors naming the path and the cause (kResourceExhausted for ENOSPC,
  // kDataLoss for EIO, ...), swap store read errors. A failed save removes its temporary
  // directory and leaves the previous checkpoints and `latest` as they were; the engine's state
  // is not changed by a save.
  Status SaveCheckpoint(const std::string& save_dir, const TrainerState& trainer,
                        const SaveCheckpointOptions& options = {},
                        std::string* checkpoint_dir = nullptr);

  // Restores the training state from `path`: a checkpoint directory, or a save directory whose
  // `latest` file names one. Everything is validated BEFORE any engine state changes: manifest
  // syntax and format version (kFailedPrecondition for another version), every file's size and
  // xxh3 (kDataLoss naming the file), the model structure (block names and sizes, vocabulary,
  // context) and precision against this engine (kInvalidArgument naming the difference), and
  // every tensor's name, dtype, shape and offsets (kDataLoss). A load that fails validation leaves
  // the engine exactly as it was. Only an I/O error while copying validated data into the stores
  // (a failing disk) leaves the engine partially loaded; it then refuses to Step
  // (kFailedPrecondition) until a later LoadCheckpoint succeeds; so does a load that
  // EngineOptions::cancel_requested stopped while copying (kCancelled; one stopped while
  // validating leaves the engine as it was). Each file is read once to validate it.
  // On success the engine continues bit-identically to the run that saved (step counter, Adam's
  // t, loss scaler state; the learning rate is that of the saved step until SetLearningRate) and
  // *trainer receives the trainer's state.
  Status LoadCheckpoint(const std::string& path, TrainerState* trainer);

  EngineCounters counters() const;
  int64_t steps_taken() const;
  float loss_scale() const;
  // Steps skipped for a non-finite gradient since the run began (restored by LoadCheckpoint):
  // a DeepSpeed-style learning-rate schedule does not advance on them.
  int64_t skipped_steps() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::engine
