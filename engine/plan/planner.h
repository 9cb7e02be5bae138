// The placement planner: from the model's blocks, the budgets and the options,
// decides which blocks' working parameters stay resident on the device, how
// many streaming slots the rest share (prefetch depth = slots - 1), and every
// region of the device arena, pinned host memory, host memory and NVMe. The
// engine carves exactly the regions listed here, so the plan's device total is
// the device peak.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/plan/model.h"
#include "engine/plan/partition.h"

namespace strata::engine {

enum class ParamHome { kDevice, kHost, kNvme };  // where working params live between uses
// Where p32, m, v live. kDevice: in device memory, updated by fused kernels on the device
// (engine/device_optimizer.h); a split (PlacementOptions::optimizer_device_fraction) puts some
// blocks' state on the device and the rest in kHost or kNvme.
enum class OptimizerHome { kHost, kNvme, kDevice };
std::string_view ParamHomeName(ParamHome h);  // "device", "host", "nvme"
std::string_view OptimizerHomeName(OptimizerHome h);
StatusOr<ParamHome> ParseParamHome(std::string_view s);
StatusOr<OptimizerHome> ParseOptimizerHome(std::string_view s);

// The order a step with a micro-batches runs its blocks in (docs/ARCHITECTURE.md, "The
// layer-major schedule"). kMicroBatchMajor: each micro-batch's whole forward and backward in turn
// (a streamed block's params cross PCIe 2a times per step, its gradient a times). kLayerMajor:
// every micro-batch through block b before block b+1 runs (forward), and every micro-batch's
// backward of block b before block b-1's, after GreedySnake (arXiv 2512.17570): a block's params
// are loaded once per pass, its gradient summed over the micro-batches on the device in fp32 and
// sent D2H once per step; the device holds the boundary activations, activation gradients and
// tokens of all a micro-batches. With one micro-batch the two are the same.
enum class Schedule { kMicroBatchMajor, kLayerMajor };
// Pure; thread-safe.
std::string_view ScheduleName(Schedule s);  // "micro-batch-major", "layer-major"
// The inverse of ScheduleName; kInvalidArgument naming --schedule and the two values otherwise.
StatusOr<Schedule> ParseSchedule(std::string_view s);

// Activation checkpointing per block (Chen et al., "Training Deep Nets with Sublinear Memory
// Cost", 2016): whether a block's backward recomputes its forward from its boundary activation
// (the block is checkpointed) or reads the activations its forward kept in the block's activation
// store (Model::activation_store_bytes; one store per held micro-batch). Only blocks with a store
// (the decoder families' layers) can keep. kAll: every block recomputes. kNone: every block that
// can keeps (MakePlan refuses a budget that cannot hold the stores). kAuto: after everything else
// the plan puts on the device (resident params included), the stores of as many blocks as the
// rest of the budget holds, the last blocks of the forward first (their backward comes first).
// Kept and recomputed blocks give the same results bit for bit.
enum class ActivationCheckpointing { kAll, kNone, kAuto };
// Pure; thread-safe.
std::string_view ActivationCheckpointingName(ActivationCheckpointing a);  // "all", "none", "auto"
// The inverse; kInvalidArgument naming `activation_checkpointing` and the three values otherwise.
StatusOr<ActivationCheckpointing> ParseActivationCheckpointing(std::string_view s);

// What a sequence objective (engine/sequence_objective.h: preference training) adds to the
// device, per held micro-batch (Plan::held_micro_batches).
struct ObjectiveBuffers {
  // The head's per-target losses and their weights: two (B, T) fp32.
  bool target_weights = false;
  // The frozen reference's forward beside each block's (Model::has_frozen_reference: LoRA's base,
  // adapters off): its two boundary activations (B, T, C) in the working precision and its
  // per-target losses (B, T) fp32. Needs target_weights.
  bool reference_forward = false;
  bool any() const { return target_weights || reference_forward; }
};

struct PlacementOptions {
  uint64_t device_budget_bytes = 0;  // the whole device arena; must be > 0
  uint64_t pinned_budget_bytes = 64ull << 30;
  // Host memory for everything the plan keeps there, pinned included; 0 = not checked.
  uint64_t host_budget_bytes = 0;
  // Free bytes over all NVMe paths (distinct file systems summed); 0 = not checked.
  uint64_t nvme_capacity_bytes = 0;
  ParamHome param_home = ParamHome::kNvme;  // kDevice: every block must be resident
  // kDevice: every block's optimizer on the device. kHost or kNvme: the home of the blocks whose
  // optimizer is not on the device (all of them when optimizer_device_fraction is 0).
  OptimizerHome optimizer_home = OptimizerHome::kNvme;
  // The GPU/CPU split: the fraction (0..1) of the parameters whose master weights and optimizer
  // state live on the device, whole blocks in forward order from block 0 (their update runs on
  // the device while the CPU updates the others, and the next forward needs block 0 first).
  // Those blocks are resident. 1 with optimizer_home kDevice.
  double optimizer_device_fraction = 0;
  std::vector<std::string> nvme_paths;  // required when anything lives on NVMe
  // Device slots shared by the streamed blocks; prefetch depth = slots - 1. 0 = the planner
  // decides: 3 (prefetch two blocks ahead) when the budget holds them, else 2. Else >= 2.
  int streaming_slots = 0;
  // Keep only two boundary activations on the device and the rest in pinned host memory: each
  // block's output goes D2H after its forward and comes back H2D one block ahead of its
  // backward (activation checkpointing at block boundaries either way).
  bool offload_activations = false;
  // Which blocks recompute their forward in backward (above). kAll, today's engine, by default.
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kAll;
  // The step's order of blocks and micro-batches (PlanOptimizer::grad_accum_steps of them).
  Schedule schedule = Schedule::kMicroBatchMajor;
  // Pinned host gradient buckets (D2H landing, folded by a CPU worker); 0 = 3. Else >= 2.
  int host_grad_buckets = 0;
  // Pinned buffers cycling through the optimizer pipeline (read b+1, update b, write b-1);
  // 0 = 3 when optimizer state or params live on NVMe, else 1.
  int optimizer_buffers = 0;
  // Data parallelism (ZeRO): the plan is that of rank `rank` of `ranks`, which keeps only its
  // partition (Partition below) of every block's master weights, optimizer state, host gradient
  // and working-params home; the device holds whole (padded) blocks as one rank does.
  int ranks = 1;
  int rank = 0;
  // The engine has a communicator (EngineOptions::comm), with one rank or more: gradients are
  // widened to fp32 and reduce-scattered on the device, and the host keeps them in fp32.
  bool data_parallel = false;
  // A sequence objective's buffers (above); none by default.
  ObjectiveBuffers objective;
  // The CPU update during backward (EngineOptions::update_during_backward, engine/
  // update_speculation.h) will run: its backup area in host memory is part of the plan
  // (Plan::speculation_backup_bytes). speculation_backup_bytes: its size in bytes; 0 = the
  // default, max(64 MiB, an eighth of what every CPU-optimized block's backup would need).
  bool update_during_backward = false;
  uint64_t speculation_backup_bytes = 0;
};

// The optimizer a plan is made for: its state per block (engine/plan/optimizer_state.h) and how
// gradients accumulate on the host.
struct PlanOptimizer {
  cpu_optim::AnyOptimizer optimizer;  // AdamW by default
  int grad_accum_steps = 1;
};

// Whether block `block`'s gradient is kept in the working precision (2 B/param for fp16/bf16)
// instead of an fp32 accumulator, on the host or, for a block whose optimizer runs on the device,
// there: when a step has one micro-batch, the chunk gets one contribution (no other block ties
// it) and there is no data parallelism (a rank's reduce-scattered partition is fp32). The
// optimizer then reads the 16-bit gradient as it was written, which gives the same bits as
// widening it to fp32 first. fp32 runs keep fp32 either way. Pure; thread-safe.
bool GradInWorkingPrecision(const Model& model, int block, int grad_accum_steps,
                            bool data_parallel);

struct DeviceRegion {
  std::string label;  // "activations", "slot.layer3", ...
  uint64_t size_bytes;
  // The master weights and state ("optimizer state <block>") or the gradient ("gradient
  // <block>") of a block whose optimizer runs on the device.
  bool device_optimizer = false;
};

// A plan, its fields grouped by tier: the plan as a whole, per block, the device, pinned host
// memory, host memory, NVMe, and the optimizer.
struct Plan {
  // The plan as a whole.
  DType precision = DType::kBF16;
  MicroBatchShape shape;
  ParamHome param_home = ParamHome::kNvme;
  OptimizerHome optimizer_home = OptimizerHome::kNvme;
  Schedule schedule = Schedule::kMicroBatchMajor;  // PlacementOptions::schedule
  // Micro-batches whose boundary activations, activation gradients and tokens the device holds
  // at once: the step's micro-batches with the layer-major schedule, else 1.
  int held_micro_batches = 1;
  bool layer_major() const { return held_micro_batches > 1; }
  ObjectiveBuffers objective;  // PlacementOptions::objective: its regions are in device_regions
  int ranks = 1;               // data-parallel ranks; the host and NVMe figures are this rank's
  int rank = 0;
  bool data_parallel = false;  // PlacementOptions::data_parallel
  int64_t model_params = 0;    // trained (own chunks)
  int64_t frozen_params = 0;   // frozen chunks: working precision only, never written
  uint64_t frozen_bytes = 0;   // their bytes (Model::block_frozen_bytes: 4-bit when encoded)
  // Model::workspace_bytes' largest: a device region "block workspace" when > 0.
  uint64_t workspace_bytes = 0;
  uint64_t model_state_bytes = 0;  // p16 + g16 + p32 + optimizer state over the trained params

  // Per block.
  struct Block {
    std::string name;
    int64_t num_params = 0;
    bool resident = false;
    Partition partition;  // this rank's (PlacementOptions::ranks)
    // Master weights, optimizer state and a gradient region in device memory; the update runs
    // on the device. Implies resident.
    bool optimizer_on_device = false;
    // The block's frozen chunk (Model::block_frozen_params; LoRA's base weights): its elements
    // and whether it has a device region of its own (else it streams through the slots from
    // param_home). A block with no own params (num_params 0) is `resident` with no region.
    int64_t frozen_params = 0;
    uint64_t frozen_bytes = 0;  // Model::block_frozen_bytes in the plan's precision
    bool frozen_resident = false;
    // Model::activation_store_bytes for one micro-batch (0: the block cannot keep its
    // activations), and whether it keeps them: then it has a device region of
    // held_micro_batches stores ("kept activations <block>") and its backward skips the
    // recomputed forward.
    uint64_t activation_store_bytes = 0;
    bool keeps_activations = false;
  };
  std::vector<Block> blocks;
  int64_t max_block_params = 0;  // the largest block's own params
  int num_resident() const;
  int num_frozen_resident() const;
  // Activation checkpointing: as asked (kAuto stays kAuto; the blocks say what it chose), the
  // blocks that keep their activations, those that could but recompute, and the device bytes of
  // the kept stores (every held micro-batch's).
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kAll;
  int num_keeping_activations() const;
  int num_recomputing() const;
  uint64_t kept_activation_bytes() const;

  // Device.
  std::vector<DeviceRegion> device_regions;
  uint64_t device_budget_bytes = 0;
  uint64_t device_total_bytes = 0;  // sum of regions (each aligned to 256 B)
  int streaming_slots = 0;
  int prefetch_depth = 0;   // blocks loaded ahead of the one computing: slots - 1
  uint64_t slot_bytes = 0;  // one block's working params, padded
  bool offload_activations = false;
  // Layer-major with more than one micro-batch and one rank: two fp32 device accumulators of one
  // block each, in which a block's gradient is summed over the micro-batches before its one D2H
  // (the pinned landing buckets then hold fp32). Data-parallel ranks reduce-scatter every
  // micro-batch's gradient, as the micro-batch-major schedule does, and have none.
  bool device_grad_accumulators = false;
  int device_grad_buckets = 2;  // 16-bit gradient buckets on the device (one copying, one filling)

  // Pinned host memory.
  uint64_t pinned_bytes = 0;  // param home or NVMe staging, gradient buckets
  int host_grad_buckets = 3;  // pinned landing buckets
  // One block's 16-bit gradients, padded; with ranks > 1 one partition's fp32 reduce-scattered
  // gradients.
  uint64_t grad_bucket_bytes = 0;
  int optimizer_buffers = 1;            // pinned buffers of the optimizer pipeline
  uint64_t optimizer_buffer_bytes = 0;  // NVMe: the largest block's state region (+ p16)
  // The largest partition's working params (pinned home, NVMe staging, copy-out), padded to
  // 4 KiB; slot_bytes with one rank.
  uint64_t partition_bytes = 0;

  // Of pinned_bytes, the frozen chunks' pinned homes: the one copy of the frozen base that the
  // data-parallel ranks of one machine share (engine/shared_frozen_base.h), each counting it.
  uint64_t pinned_frozen_bytes = 0;

  // Host memory.
  uint64_t host_bytes = 0;  // host gradients (+ master weights and state if on host)
  // Of host_bytes, the update during backward's backup area (PlacementOptions::
  // update_during_backward; 0 without it or without a CPU-optimized block): what a speculative
  // update overwrites, copied aside for a rollback (a block's state region unless on NVMe, and
  // its working params unless streamed from NVMe), never more than all the blocks' backups.
  uint64_t speculation_backup_bytes = 0;
  bool update_during_backward = false;  // PlacementOptions::update_during_backward
  uint64_t host_grad_bytes = 0;         // of which host gradients (fp32 or working precision)
  int64_t host_grad16_params = 0;       // params whose host gradient stays 16-bit

  // NVMe.
  uint64_t nvme_bytes = 0;  // swap store payload
  // The extents that payload is made of (streamed params, frozen chunks, optimizer state regions),
  // each padded as the swap store pads it; they sum to nvme_bytes. The swap store stripes each
  // one over the NVMe paths on its own (io::SwapStore::StripeShareBytes), so what each path must
  // hold depends on them, not on the sum alone.
  std::vector<uint64_t> nvme_extent_bytes;

  // Optimizer.
  std::string optimizer_name;  // "adamw", "adamw8bit", ... (OptimizerFlagName)
  // The optimizer's state over all blocks, padded: the whole model's, also with ranks > 1 (a
  // rank's share is in host_bytes or nvme_bytes).
  uint64_t optimizer_state_bytes = 0;
  // Parameters whose optimizer runs on the device (Block::optimizer_on_device), and their
  // fraction of the model's.
  int64_t device_optimizer_params = 0;
  double optimizer_device_fraction() const {
    return model_params > 0
               ? static_cast<double>(device_optimizer_params) / static_cast<double>(model_params)
               : 0;
  }
  // Whether any block's optimizer runs on the host or NVMe (the CPU pipeline has work).
  bool has_cpu_optimizer() const { return device_optimizer_params < model_params; }

  // The plan in plain words, one tier per line.
  std::string Describe() const;
};

// The smallest device budget, in bytes, that trains with every block streamed through
// `streaming_slots` slots: boundary activations (all n-1, or 2 with offload_activations),
// activation gradients, logits, gradient buckets and scratch, all in the working precision
// (blocks read their params in place and write their gradients into the buckets: no fp32
// staging and no fp32 gradient region), and the slots. Pure; thread-safe.
// With ranks > 1 blocks are padded to whole partitions and the device also holds the fp32
// reduce-scatter buffers (one block and two partitions). `held_micro_batches` (Plan's: the
// layer-major schedule's micro-batches, else 1) multiplies the activations, their gradients and
// the tokens, and above 1 with one rank adds the two fp32 gradient accumulators.
uint64_t StreamingMinimumBytes(const Model& model, DType precision, MicroBatchShape shape,
                               int streaming_slots = 2, bool offload_activations = false,
                               int ranks = 1, bool data_parallel = false,
                               int held_micro_batches = 1, ObjectiveBuffers objective = {});

// The device budget, in bytes, that keeps every block resident (ParamHome::kDevice): the same
// fixed regions plus every block's working params, each region aligned as the arena aligns it.
// Pure; thread-safe.
uint64_t AllResidentBytes(const Model& model, DType precision, MicroBatchShape shape,
                          bool offload_activations = false, int ranks = 1,
                          bool data_parallel = false, int held_micro_batches = 1,
                          ObjectiveBuffers objective = {});

// The device budget, in bytes, of `--device-budget auto` (strata train, estimate, eval and
// generate take this one): with ParamHome::kDevice, AllResidentBytes (every block resident:
// exactly what that takes); otherwise midway between StreamingMinimumBytes with
// options.streaming_slots (2 when 0) and the working params alone (num_params x
// SizeOf(precision)), so that some blocks stay resident and the rest really stream, or the
// minimum itself when the working params are smaller than it. Reads param_home,
// streaming_slots, offload_activations, ranks, data_parallel and schedule of `options` (and
// `optimizer`'s grad_accum_steps) and none of its budgets. The result always holds the streaming
// minimum; MakePlan may still refuse it for a short pinned, host or NVMe budget. Pure; thread-safe.
// Blocks whose optimizer runs on the device (optimizer_home kDevice, or
// optimizer_device_fraction > 0) add their master weights, state and gradients (and, when the
// rest streams, their resident params), laid out for `optimizer`. With activation_checkpointing
// kNone the kept activations of every block that can keep are added (StreamingMinimumBytes and
// AllResidentBytes count none: every block recomputes); kAuto adds nothing (it keeps what the
// budget leaves).
uint64_t AutoDeviceBudgetBytes(const Model& model, DType precision, MicroBatchShape shape,
                               const PlacementOptions& options,
                               const PlanOptimizer& optimizer = {});

// Frozen chunks (Model::block_frozen_params): every block's own chunk is resident when the model
// has any (they are LoRA's adapters: small, and updated in place on the device when the optimizer
// runs there); the frozen chunks are resident while the budget lasts, largest first, and the rest
// stream through the slots from param_home; nothing of theirs is on the host but their home.
// With ranks > 1 (data parallelism) the own chunks are partitioned as any block's, and the frozen
// chunks are whole on every rank (each rank holds, streams and reads its own copy of the base).
// Errors: kInvalidArgument (zero budget, no NVMe path for NVMe placement,
// streaming_slots, host_grad_buckets or optimizer_buffers given but too small); kResourceExhausted
// when the device budget cannot hold the minimum (what is short and by how much, and what the
// minimum is made of), or when the pinned, host or NVMe needs exceed their budgets (which, by how
// much; a block with neither own nor frozen params), or when
// activation_checkpointing kNone's stores do not fit beside the rest (how much they take, and to
// use `activation_checkpointing auto` or `all`).
StatusOr<Plan> MakePlan(const Model& model, DType precision, MicroBatchShape shape,
                        const PlacementOptions& options, const PlanOptimizer& optimizer = {});

// The bytes the update during backward backs up before it updates block b of `plan` while the
// step's verdict is pending (engine/update_speculation.h): the block's master weights and
// optimizer state (`state_region_bytes`: its BlockState::region_bytes, optimizer_state.h) unless
// their home is NVMe, and its own working params unless their home is NVMe and the block
// streams. Unaligned; for a block whose optimizer runs on the host. The planner sizes the backup
// area from it and StateStore backs up exactly this much. Pure; thread-safe.
uint64_t SpeculationBackupBytes(const Plan& plan, int b, uint64_t state_region_bytes);

// The planning calls made in this process so far: ChoosePlan calls (engine/plan/plan_choice.h),
// MakePlan calls, and of them those made inside a ChoosePlan. A front end that plans once makes
// one choice and no plan outside it (tests check that nothing re-plans after the choice).
// Process-wide atomic counters; thread-safe.
struct PlanningCounts {
  int64_t choices = 0;
  int64_t plans_built = 0;
  int64_t plans_built_in_choices = 0;
};
PlanningCounts PlanningCountsSoFar();

namespace internal {
// ChoosePlan's bookkeeping: MakePlan calls made on the calling thread so far, and the choice's
// own count once it returns. Thread-safe.
int64_t PlansBuiltOnThisThread();
void CountChoice(int64_t plans_built);
}  // namespace internal

}  // namespace strata::engine
