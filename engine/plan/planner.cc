#include "engine/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "base/units.h"
#include "engine/plan/optimizer_state.h"
#include "gpu/device.h"

namespace strata::engine {

std::string_view ParamHomeName(ParamHome h) {
  switch (h) {
    case ParamHome::kDevice:
      return "device";
    case ParamHome::kHost:
      return "host";
    case ParamHome::kNvme:
      return "nvme";
  }
  return "?";
}
std::string_view OptimizerHomeName(OptimizerHome h) {
  switch (h) {
    case OptimizerHome::kHost:
      return "host";
    case OptimizerHome::kNvme:
      return "nvme";
    case OptimizerHome::kDevice:
      return "device";
  }
  return "?";
}
StatusOr<ParamHome> ParseParamHome(std::string_view s) {
  if (s == "device") return ParamHome::kDevice;
  if (s == "host") return ParamHome::kHost;
  if (s == "nvme") return ParamHome::kNvme;
  return InvalidArgumentError(fmt::format("`param_home` '{}' is not one of device, host, nvme", s));
}
StatusOr<OptimizerHome> ParseOptimizerHome(std::string_view s) {
  if (s == "host") return OptimizerHome::kHost;
  if (s == "nvme") return OptimizerHome::kNvme;
  if (s == "device") return OptimizerHome::kDevice;
  return InvalidArgumentError(
      fmt::format("`optimizer_home` '{}' is not one of device, host, nvme", s));
}

std::string_view ScheduleName(Schedule s) {
  return s == Schedule::kLayerMajor ? "layer-major" : "micro-batch-major";
}
StatusOr<Schedule> ParseSchedule(std::string_view s) {
  if (s == "micro-batch-major") return Schedule::kMicroBatchMajor;
  if (s == "layer-major") return Schedule::kLayerMajor;
  return InvalidArgumentError(
      fmt::format("`schedule` '{}' is not one of layer-major, micro-batch-major", s));
}

std::string_view ActivationCheckpointingName(ActivationCheckpointing a) {
  switch (a) {
    case ActivationCheckpointing::kAll:
      return "all";
    case ActivationCheckpointing::kNone:
      return "none";
    case ActivationCheckpointing::kAuto:
      return "auto";
  }
  return "?";
}
StatusOr<ActivationCheckpointing> ParseActivationCheckpointing(std::string_view s) {
  if (s == "all") return ActivationCheckpointing::kAll;
  if (s == "none") return ActivationCheckpointing::kNone;
  if (s == "auto") return ActivationCheckpointing::kAuto;
  return InvalidArgumentError(
      fmt::format("`activation_checkpointing` '{}' is not one of auto, all, none", s));
}

int Plan::num_keeping_activations() const {
  return static_cast<int>(std::count_if(blocks.begin(), blocks.end(),
                                        [](const Block& b) { return b.keeps_activations; }));
}
int Plan::num_recomputing() const {
  return static_cast<int>(std::count_if(blocks.begin(), blocks.end(), [](const Block& b) {
    return b.activation_store_bytes > 0 && !b.keeps_activations;
  }));
}
uint64_t Plan::kept_activation_bytes() const {
  uint64_t total = 0;
  for (const Block& b : blocks) {
    if (b.keeps_activations) {
      total += AlignUp(b.activation_store_bytes, gpu::DeviceArena::kAlignment) * held_micro_batches;
    }
  }
  return total;
}

int Plan::num_resident() const {
  return static_cast<int>(
      std::count_if(blocks.begin(), blocks.end(), [](const Block& b) { return b.resident; }));
}
int Plan::num_frozen_resident() const {
  return static_cast<int>(std::count_if(blocks.begin(), blocks.end(),
                                        [](const Block& b) { return b.frozen_resident; }));
}

namespace {
uint64_t Aligned(uint64_t n) { return AlignUp(n, gpu::DeviceArena::kAlignment); }

// What the swap store pads each extent to (io::SwapStore::kAlignment, PaddedSize; the plan is
// below io/ and states it; engine checkpoint_test checks the plan against the swap file).
constexpr uint64_t kSwapExtentAlignment = 4096;

// A block's elements on the device: padded to whole partitions with ranks > 1.
int64_t DeviceElems(const Model& model, int b, int ranks) {
  return PartitionOf(model.block_num_params(b), ranks, 0).padded_elems;
}
// The largest chunk a streaming slot holds, bytes: a block's own (padded) or its frozen chunk
// (Model::block_frozen_bytes: an encoded chunk's own size).
uint64_t MaxChunkBytes(const Model& model, int ranks, DType precision) {
  uint64_t m = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    m = std::max({m, static_cast<uint64_t>(DeviceElems(model, b, ranks)) * SizeOf(precision),
                  static_cast<uint64_t>(model.block_frozen_bytes(b, precision))});
  }
  return m;
}
uint64_t FrozenBytes(const Model& model, DType precision) {
  uint64_t n = 0;
  for (int b = 0; b < model.num_blocks(); ++b) n += model.block_frozen_bytes(b, precision);
  return n;
}
// With frozen chunks every own chunk is resident (planner.h): their device bytes (padded to
// whole partitions with ranks > 1, which the all-gather fills in place). Frozen chunks are whole
// on every rank: never partitioned, never gathered.
uint64_t ForcedResidentBytes(const Model& model, DType precision, int ranks) {
  if (model.frozen_params() == 0) return 0;
  uint64_t total = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    total += Aligned(static_cast<uint64_t>(DeviceElems(model, b, ranks)) * SizeOf(precision));
  }
  return total;
}

// `held`: Plan::held_micro_batches.
std::vector<DeviceRegion> FixedRegions(const Model& model, DType precision, MicroBatchShape shape,
                                       bool offload_activations, int ranks, bool data_parallel,
                                       int held, ObjectiveBuffers objective) {
  const int n = model.num_blocks();
  int64_t max_block_params = 0, max_part = 0;
  uint64_t max_scratch = 0, max_workspace = 0;
  for (int b = 0; b < n; ++b) {
    max_block_params = std::max(max_block_params, DeviceElems(model, b, ranks));
    max_part = std::max(max_part, PartitionOf(model.block_num_params(b), ranks, 0).part_elems);
    max_scratch = std::max<uint64_t>(max_scratch, model.scratch_bytes(b, shape, precision));
    max_workspace = std::max<uint64_t>(max_workspace, model.workspace_bytes(b, shape, precision));
  }
  // Blocks compute in the working precision: activations, their gradients, the logits and the
  // gradients (written straight into the buckets) are all of it; params are read in place.
  const size_t w = SizeOf(precision);
  const std::string_view dt = DTypeName(precision);
  const uint64_t act = static_cast<uint64_t>(model.activation_elems(shape)) * w;
  // Layer-major: every micro-batch's tokens, boundary activations and activation gradients.
  const std::string per = held > 1 ? fmt::format(" for each of {} micro-batches", held) : "";
  std::vector<DeviceRegion> fixed = {
      {"tokens+targets+position ids" + per, static_cast<uint64_t>(shape.tokens()) * 12 * held},
      {"loss", 4},
      offload_activations
          ? DeviceRegion{fmt::format("boundary activations (2 x (B,T,C) {}{}; the rest offloaded "
                                     "to pinned)",
                                     dt, per),
                         act * 2 * held}
          : DeviceRegion{fmt::format("boundary activations ({} x (B,T,C) {}{})", n - 1, dt, per),
                         act * (n - 1) * held},
      {fmt::format("activation gradients (2 x (B,T,C) {}{})", dt, per), act * 2 * held},
      {fmt::format("last-position logits (B,V) {}", dt),
       static_cast<uint64_t>(model.logits_elems(shape)) * w},
      {fmt::format("block scratch ({} compute)", dt), max_scratch},
  };
  // Model::workspace_bytes (a 4-bit base's dequantized layer), after the scratch when there is
  // one (the engine carves it when Plan::workspace_bytes > 0).
  if (max_workspace > 0) {
    fixed.push_back(
        {fmt::format("block workspace (a layer's frozen weights dequantized to {})", dt),
         max_workspace});
  }
  fixed.insert(
      fixed.end(),
      {
          {fmt::format("gradient buckets (2 x one block, {}; blocks write their gradients here)",
                       dt),
           2 * Aligned(static_cast<uint64_t>(max_block_params) * w)},
      });
  if (held > 1 && !(ranks > 1 || data_parallel)) {
    fixed.push_back(
        {"gradient accumulators (2 x one block, fp32: a block's gradient summed over the "
         "micro-batches)",
         2 * Aligned(static_cast<uint64_t>(max_block_params) * 4)});
  }
  if (ranks > 1 || data_parallel) {
    // Gradients are reduced in fp32: a bucket widened on the device, reduce-scattered into one
    // of two partition buffers (one being copied D2H while the next block's is reduced).
    fixed.push_back(
        {fmt::format("gradient reduce-scatter (fp32: one block + 2 partitions of {} ranks)", ranks),
         Aligned(static_cast<uint64_t>(max_block_params) * 4) +
             2 * Aligned(static_cast<uint64_t>(max_part) * 4)});
  }
  // A sequence objective's per-target buffers, then the reference forward's (the engine carves
  // them last, in this order).
  const uint64_t per_target = static_cast<uint64_t>(shape.tokens()) * 4;
  if (objective.target_weights) {
    fixed.push_back(
        {"per-target losses and weights (2 x (B,T) fp32" + per + ")", 2 * per_target * held});
  }
  if (objective.reference_forward) {
    fixed.push_back({fmt::format("reference forward (2 x (B,T,C) {} + (B,T) fp32 per-target "
                                 "losses{})",
                                 dt, per),
                     (2 * act + per_target) * held});
  }
  return fixed;
}

// Which blocks keep their optimizer on the device (optimizer_home kDevice: all; else a fraction f
// = optimizer_device_fraction of the parameters): whole
// blocks in forward order from block 0, while the running total stays within f of the model's
// (nearest block boundary: a block is taken when at least half of it fits). f >= 1: all.
int HeldMicroBatches(const PlacementOptions& o, const PlanOptimizer& optimizer) {
  return o.schedule == Schedule::kLayerMajor ? std::max(1, optimizer.grad_accum_steps) : 1;
}

std::vector<bool> DeviceOptimizerBlocks(const Model& model, const PlacementOptions& o) {
  const double fraction =
      o.optimizer_home == OptimizerHome::kDevice ? 1.0 : o.optimizer_device_fraction;
  const int n = model.num_blocks();
  std::vector<bool> on(n, false);
  if (!(fraction > 0)) return on;
  const double target = fraction * static_cast<double>(model.num_params());
  double taken = 0;
  for (int b = 0; b < n; ++b) {
    const double np = static_cast<double>(model.block_num_params(b));
    if (np == 0) continue;  // a wholly frozen block has nothing to update
    if (fraction < 1 && taken + np / 2 > target) break;
    on[b] = true;
    taken += np;
  }
  return on;
}

// A device-optimized block's "gradient" region: the gradient (GradInWorkingPrecision: the working
// precision, else an fp32 accumulator), then its statistics record (engine/device_optimizer.h).
uint64_t DeviceGradientBytes(int64_t elems, bool grad16, size_t w) {
  return Aligned(static_cast<uint64_t>(elems) * (grad16 ? w : 4)) + DeviceGradStatsBytes(elems);
}
// Device bytes of a block whose optimizer runs there, besides its working params: its state
// region (master weights and optimizer state) and its gradient region.
uint64_t DeviceOptimizerBytes(const BlockState& state, int64_t elems, bool grad16, size_t w) {
  return Aligned(state.region_bytes) + Aligned(DeviceGradientBytes(elems, grad16, w));
}

Status CheckDeviceOptimizerPlacement(const PlacementOptions& o, const PlanOptimizer& optimizer) {
  if (!(o.optimizer_device_fraction >= 0 && o.optimizer_device_fraction <= 1)) {
    return InvalidArgumentError(fmt::format("`optimizer_device_fraction` {} is not in [0, 1]",
                                            o.optimizer_device_fraction));
  }
  const bool device = o.optimizer_home == OptimizerHome::kDevice || o.optimizer_device_fraction > 0;
  if (!device) return Status::Ok();
  return CheckDeviceOptimizer(optimizer.optimizer);  // the kinds the device update runs
}

}  // namespace

uint64_t StreamingMinimumBytes(const Model& model, DType precision, MicroBatchShape shape,
                               int streaming_slots, bool offload_activations, int ranks,
                               bool data_parallel, int held_micro_batches,
                               ObjectiveBuffers objective) {
  uint64_t total = 0;
  for (const auto& r : FixedRegions(model, precision, shape, offload_activations, ranks,
                                    data_parallel, held_micro_batches, objective)) {
    total += Aligned(r.size_bytes);
  }
  const uint64_t slot = AlignUp(MaxChunkBytes(model, ranks, precision), 4096);
  return total + streaming_slots * Aligned(slot) + ForcedResidentBytes(model, precision, ranks);
}

uint64_t AllResidentBytes(const Model& model, DType precision, MicroBatchShape shape,
                          bool offload_activations, int ranks, bool data_parallel,
                          int held_micro_batches, ObjectiveBuffers objective) {
  uint64_t total = 0;
  for (const auto& r : FixedRegions(model, precision, shape, offload_activations, ranks,
                                    data_parallel, held_micro_batches, objective)) {
    total += Aligned(r.size_bytes);
  }
  for (int b = 0; b < model.num_blocks(); ++b) {
    total += Aligned(static_cast<uint64_t>(DeviceElems(model, b, ranks)) * SizeOf(precision));
    total += Aligned(static_cast<uint64_t>(model.block_frozen_bytes(b, precision)));
  }
  return total;
}

namespace {
// The device bytes of every held micro-batch's activation store of every block that can keep its
// activations: what ActivationCheckpointing::kNone adds.
uint64_t AllKeptActivationBytes(const Model& model, DType precision, MicroBatchShape shape,
                                int held) {
  uint64_t total = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    total +=
        Aligned(static_cast<uint64_t>(model.activation_store_bytes(b, shape, precision))) * held;
  }
  return total;
}
}  // namespace

uint64_t AutoDeviceBudgetBytes(const Model& model, DType precision, MicroBatchShape shape,
                               const PlacementOptions& options, const PlanOptimizer& optimizer) {
  const PlacementOptions& o = options;
  const int held = HeldMicroBatches(o, optimizer);
  const uint64_t kept = o.activation_checkpointing == ActivationCheckpointing::kNone
                            ? AllKeptActivationBytes(model, precision, shape, held)
                            : 0;
  // The blocks whose optimizer runs on the device: their master weights, state and gradients,
  // and (when the rest streams) their resident params.
  const std::vector<bool> device_optimizer = DeviceOptimizerBlocks(model, o);
  const bool all_device =
      std::all_of(device_optimizer.begin(), device_optimizer.end(), [](bool on) { return on; });
  uint64_t device_optimizer_bytes = 0, device_optimizer_params_bytes = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    if (!device_optimizer[b]) continue;
    const Partition part = PartitionOf(model.block_num_params(b), o.ranks, o.rank);
    device_optimizer_bytes +=
        DeviceOptimizerBytes(LayoutBlockState(model, b, optimizer.optimizer, &part), part.own_elems,
                             GradInWorkingPrecision(model, b, optimizer.grad_accum_steps,
                                                    o.ranks > 1 || o.data_parallel),
                             SizeOf(precision));
    device_optimizer_params_bytes +=
        Aligned(static_cast<uint64_t>(DeviceElems(model, b, o.ranks)) * SizeOf(precision));
  }
  if (o.param_home == ParamHome::kDevice || all_device) {
    return AllResidentBytes(model, precision, shape, o.offload_activations, o.ranks,
                            o.data_parallel, held, o.objective) +
           device_optimizer_bytes + kept;
  }
  const int slots = o.streaming_slots > 0 ? o.streaming_slots : 2;
  const uint64_t minimum =
      StreamingMinimumBytes(model, precision, shape, slots, o.offload_activations, o.ranks,
                            o.data_parallel, held, o.objective);
  const uint64_t working =
      static_cast<uint64_t>(model.num_params()) * SizeOf(precision) + FrozenBytes(model, precision);
  return (working > minimum ? minimum + (working - minimum) / 2 : minimum) +
         device_optimizer_params_bytes + device_optimizer_bytes + kept;
}

bool GradInWorkingPrecision(const Model& model, int block, int grad_accum_steps,
                            bool data_parallel) {
  if (data_parallel) return false;
  if (grad_accum_steps != 1) return false;
  for (int b = 0; b < model.num_blocks(); ++b) {
    if (model.tied_block(b) == block) return false;
  }
  return true;
}

namespace {
std::atomic<int64_t> g_choices{0};
std::atomic<int64_t> g_plans_built{0};
std::atomic<int64_t> g_plans_built_in_choices{0};
thread_local int64_t t_plans_built = 0;
}  // namespace

PlanningCounts PlanningCountsSoFar() {
  return {g_choices.load(), g_plans_built.load(), g_plans_built_in_choices.load()};
}

namespace internal {
int64_t PlansBuiltOnThisThread() { return t_plans_built; }
void CountChoice(int64_t plans_built) {
  g_choices.fetch_add(1);
  g_plans_built_in_choices.fetch_add(plans_built);
}
}  // namespace internal

namespace {

// MakePlan's phases, in the order it runs them. Each decides its part of the plan from MakePlan's
// inputs and from what the phases before it decided; what a later phase needs and the plan does
// not keep comes back in a small struct.

// What MakePlan was asked for, read by every phase.
struct PlanInputs {
  const Model& model;
  DType precision;
  MicroBatchShape shape;
  const PlacementOptions& o;
  const PlanOptimizer& optimizer;
  size_t w;  // SizeOf(precision)
  bool dp;   // data parallel: PlacementOptions::data_parallel, or more than one rank
};

// Whether anything (params or optimizer state) has its home on NVMe.
bool UsesNvme(const PlacementOptions& o) {
  return o.param_home == ParamHome::kNvme || o.optimizer_home == OptimizerHome::kNvme;
}

// Block b's params on the device (padded to whole partitions), this rank's partition of them at
// home, and its frozen chunk, in bytes of the working precision.
uint64_t DeviceBlockBytes(const Plan& p, int b) {
  return static_cast<uint64_t>(p.blocks[b].partition.padded_elems) * SizeOf(p.precision);
}
uint64_t HomeBlockBytes(const Plan& p, int b) {
  return static_cast<uint64_t>(p.blocks[b].partition.part_elems) * SizeOf(p.precision);
}
uint64_t FrozenChunkBytes(const Plan& p, int b) { return p.blocks[b].frozen_bytes; }

// Validate: the inputs as a whole, before any block is looked at: a device budget, a
// micro-batch the model takes, a rank among the ranks, an optimizer the device runs where it is
// to run there, and a path wherever NVMe is a home.
Status ValidateInputs(const PlanInputs& r) {
  const PlacementOptions& o = r.o;
  if (o.device_budget_bytes == 0) {
    return InvalidArgumentError("device budget is zero; give one with units, e.g. 64MiB");
  }
  if (r.shape.batch_size <= 0 || r.shape.seq_len <= 0 || r.shape.seq_len > r.model.max_seq_len()) {
    return InvalidArgumentError(
        fmt::format("micro-batch {}x{} is invalid: need batch >= 1 and 1 <= seq_len <= {}",
                    r.shape.batch_size, r.shape.seq_len, r.model.max_seq_len()));
  }
  if (o.ranks < 1 || o.rank < 0 || o.rank >= o.ranks) {
    return InvalidArgumentError(fmt::format("rank {} of {} ranks is not a rank", o.rank, o.ranks));
  }
  STRATA_RETURN_IF_ERROR(CheckDeviceOptimizerPlacement(o, r.optimizer));
  if (UsesNvme(o) && o.nvme_paths.empty()) {
    return InvalidArgumentError("state is placed on NVMe but no `nvme_paths` given");
  }
  if (o.objective.reference_forward &&
      !(o.objective.target_weights && r.model.has_frozen_reference())) {
    return InvalidArgumentError(
        "objective.reference_forward needs objective.target_weights and a model with a frozen "
        "reference (LoRA)");
  }
  return Status::Ok();
}

// The plan as a whole: what was asked for, before any block is placed.
Plan NewPlan(const PlanInputs& r) {
  Plan p;
  p.precision = r.precision;
  p.shape = r.shape;
  p.param_home = r.o.param_home;
  p.optimizer_home = r.o.optimizer_home;
  p.device_budget_bytes = r.o.device_budget_bytes;
  p.ranks = r.o.ranks;
  p.rank = r.o.rank;
  p.data_parallel = r.dp;
  return p;
}

// The largest chunks, in elements, and the buffers sized for own chunks only.
struct ChunkSizes {
  int64_t max_padded = 0;            // a block's own params, padded to whole partitions
  int64_t max_part = 0;              // this rank's partition of a block's own params
  uint64_t max_frozen = 0;           // a frozen chunk's bytes (Plan::Block::frozen_bytes)
  int64_t max_frozen_params = 0;     // that chunk's params
  uint64_t own_slot_bytes = 0;       // max_padded in the working precision, 4 KiB aligned
  uint64_t own_partition_bytes = 0;  // max_part likewise
};

// Per-block partitions: every block's params, frozen chunk and this rank's partition, the
// model's totals, and the size of a streaming slot and of a partition's pinned home. Errors: a
// block with neither own nor frozen params.
StatusOr<ChunkSizes> PartitionBlocks(const PlanInputs& r, Plan* p) {
  ChunkSizes c;
  for (int b = 0; b < r.model.num_blocks(); ++b) {
    const int64_t np = r.model.block_num_params(b);
    const int64_t frozen = r.model.block_frozen_params(b);
    if (np == 0 && frozen == 0) {
      return InvalidArgumentError(
          fmt::format("block {} ('{}') has no parameters, neither trained nor frozen", b,
                      r.model.block_name(b)));
    }
    p->blocks.push_back({r.model.block_name(b), np, false, PartitionOf(np, r.o.ranks, r.o.rank)});
    p->blocks.back().frozen_params = frozen;
    p->blocks.back().frozen_bytes =
        frozen > 0 ? static_cast<uint64_t>(r.model.block_frozen_bytes(b, r.precision)) : 0;
    p->frozen_bytes += p->blocks.back().frozen_bytes;
    p->model_params += np;
    p->frozen_params += frozen;
    p->max_block_params = std::max(p->max_block_params, np);
    c.max_padded = std::max(c.max_padded, p->blocks.back().partition.padded_elems);
    c.max_part = std::max(c.max_part, p->blocks.back().partition.part_elems);
    if (p->blocks.back().frozen_bytes > c.max_frozen) {
      c.max_frozen = p->blocks.back().frozen_bytes;
      c.max_frozen_params = frozen;
    }
  }
  // A slot and its NVMe staging hold any chunk; the gradient buckets and the pipeline's copy-out
  // only own ones.
  const size_t w = r.w;
  p->slot_bytes = AlignUp(std::max(static_cast<uint64_t>(c.max_padded) * w, c.max_frozen), 4096);
  p->partition_bytes = AlignUp(std::max(static_cast<uint64_t>(c.max_part) * w, c.max_frozen), 4096);
  c.own_slot_bytes = AlignUp(static_cast<uint64_t>(c.max_padded) * w, 4096);
  c.own_partition_bytes = AlignUp(static_cast<uint64_t>(c.max_part) * w, 4096);
  return c;
}

// The optimizer's state, block by block as the engine lays it out (this rank's partitions), and
// its totals.
struct StateLayout {
  std::vector<BlockState> states;  // every block's
  // Blocks whose optimizer runs on the host or NVMe: the largest state region, and their master
  // weights and state over this rank's partitions (the whole with one rank).
  uint64_t max_region = 0;
  uint64_t master_bytes = 0;
  uint64_t rank_state_bytes = 0;
  // Their state regions as extents of an NVMe optimizer home, one per block: each padded as the
  // swap store pads an extent (io::SwapStore::PaddedSize).
  std::vector<uint64_t> nvme_region_extents;
  // Blocks whose optimizer runs on the device: master weights, state and gradients there.
  uint64_t device_optimizer_bytes = 0;
};

// State layout: which blocks' optimizer runs on the device, and every block's optimizer state
// (the whole model's, also with ranks > 1, in the plan; this rank's in the layout).
StateLayout LayOutOptimizerState(const PlanInputs& r, Plan* p) {
  StateLayout s;
  const std::vector<bool> device_optimizer = DeviceOptimizerBlocks(r.model, r.o);
  for (int b = 0; b < r.model.num_blocks(); ++b) {
    s.states.push_back(
        LayoutBlockState(r.model, b, r.optimizer.optimizer, &p->blocks[b].partition));
    const BlockState& state = s.states.back();
    p->optimizer_state_bytes +=
        r.o.ranks > 1 ? LayoutBlockState(r.model, b, r.optimizer.optimizer).state_bytes()
                      : state.state_bytes();
    if (device_optimizer[b]) {
      p->blocks[b].optimizer_on_device = true;
      p->device_optimizer_params += p->blocks[b].num_params;
      s.device_optimizer_bytes += DeviceOptimizerBytes(
          state, p->blocks[b].partition.own_elems,
          GradInWorkingPrecision(r.model, b, r.optimizer.grad_accum_steps, r.dp), r.w);
      continue;
    }
    s.rank_state_bytes += state.state_bytes();
    s.master_bytes += state.master_bytes;
    if (state.region_bytes > 0) {
      s.nvme_region_extents.push_back(AlignUp(state.region_bytes, kSwapExtentAlignment));
    }
    s.max_region = std::max(s.max_region, state.region_bytes);
  }
  p->optimizer_name = OptimizerFlagName(r.optimizer.optimizer);
  p->model_state_bytes =
      static_cast<uint64_t>(p->model_params) * (2 * r.w + 4) + p->optimizer_state_bytes;
  return s;
}

// The device regions every plan has, whatever streams: everything but the parameter slots.
struct FixedLayout {
  std::vector<DeviceRegion> regions;
  uint64_t total_bytes = 0;  // each region aligned as the arena aligns it
};

// Fixed regions: the schedule's micro-batches held on the device, and what they and the
// gradients' way off the device take there.
FixedLayout LayOutFixedRegions(const PlanInputs& r, Plan* p) {
  p->schedule = r.o.schedule;
  p->held_micro_batches = HeldMicroBatches(r.o, r.optimizer);
  p->device_grad_accumulators = p->held_micro_batches > 1 && !r.dp;
  FixedLayout f;
  f.regions = FixedRegions(r.model, r.precision, r.shape, r.o.offload_activations, r.o.ranks, r.dp,
                           p->held_micro_batches, r.o.objective);
  p->objective = r.o.objective;
  p->offload_activations = r.o.offload_activations;
  for (int b = 0; b < r.model.num_blocks(); ++b) {
    p->workspace_bytes = std::max<uint64_t>(
        p->workspace_bytes, std::max<int64_t>(0, r.model.workspace_bytes(b, r.shape, r.precision)));
  }
  for (const auto& region : f.regions) f.total_bytes += Aligned(region.size_bytes);
  return f;
}

// Activation stores: every block's store size; with kNone every block that can keep does, and its
// stores are reserved before residency is chosen (MakePlan adds them to the fixed bytes).
void SizeActivationStores(const PlanInputs& r, Plan* p) {
  p->activation_checkpointing = r.o.activation_checkpointing;
  for (int b = 0; b < r.model.num_blocks(); ++b) {
    Plan::Block& blk = p->blocks[b];
    blk.activation_store_bytes = static_cast<uint64_t>(
        std::max<int64_t>(0, r.model.activation_store_bytes(b, r.shape, r.precision)));
    blk.keeps_activations = r.o.activation_checkpointing == ActivationCheckpointing::kNone &&
                            blk.activation_store_bytes > 0;
  }
}

// kAuto: the stores of as many blocks as the budget left after every other region holds, the
// last blocks of the forward first. Then every keeping block's region, in block order, after all
// the others (the engine carves them last).
void KeepActivations(const PlanInputs& r, Plan* p) {
  const int n = static_cast<int>(p->blocks.size());
  if (r.o.activation_checkpointing == ActivationCheckpointing::kAuto) {
    uint64_t left = r.o.device_budget_bytes > p->device_total_bytes
                        ? r.o.device_budget_bytes - p->device_total_bytes
                        : 0;
    for (int b = n - 1; b >= 0; --b) {
      Plan::Block& blk = p->blocks[b];
      const uint64_t bytes = Aligned(blk.activation_store_bytes) * p->held_micro_batches;
      if (blk.activation_store_bytes > 0 && bytes <= left) {
        blk.keeps_activations = true;
        left -= bytes;
      }
    }
  }
  for (int b = 0; b < n; ++b) {
    const Plan::Block& blk = p->blocks[b];
    if (!blk.keeps_activations) continue;
    const uint64_t bytes = Aligned(blk.activation_store_bytes) * p->held_micro_batches;
    p->device_regions.push_back({p->held_micro_batches > 1
                                     ? fmt::format("kept activations {} ({} micro-batches)",
                                                   blk.name, p->held_micro_batches)
                                     : "kept activations " + blk.name,
                                 bytes});
    p->device_total_bytes += bytes;
  }
}

// Residency, when the budget (or the options) keep every block resident: no slots. Error: the
// budget cannot hold them all, with the device home or every optimizer on the device.
Status KeepEveryBlockResident(const PlacementOptions& o, uint64_t all_resident,
                              uint64_t device_optimizer_bytes, Plan* p) {
  // activation_checkpointing none: the kept activations are needed too.
  const uint64_t kept = p->kept_activation_bytes();
  if (all_resident + device_optimizer_bytes + kept > o.device_budget_bytes) {
    if (kept > 0 && all_resident + device_optimizer_bytes <= o.device_budget_bytes) {
      return ResourceExhaustedError(fmt::format(
          "device budget {} is {} short of keeping the activations of all {} layers "
          "(`activation_checkpointing none`: {} beside the {} of resident params and the rest); "
          "use `activation_checkpointing auto` (as many as fit) or `all`, or raise "
          "`device_budget`",
          FormatBytes(o.device_budget_bytes),
          FormatBytes(all_resident + device_optimizer_bytes + kept - o.device_budget_bytes),
          p->num_keeping_activations(), FormatBytes(kept),
          FormatBytes(all_resident + device_optimizer_bytes)));
    }
    return ResourceExhaustedError(fmt::format(
        "device budget {} is {} short of keeping every block resident{} ({} needed); raise "
        "`device_budget`{}",
        FormatBytes(o.device_budget_bytes),
        FormatBytes(all_resident + device_optimizer_bytes - o.device_budget_bytes),
        device_optimizer_bytes > 0
            ? fmt::format(" with the optimizer of {} params on the device ({} of master "
                          "weights, state and gradients)",
                          p->device_optimizer_params, FormatBytes(device_optimizer_bytes))
            : std::string(" (`param_home device`)"),
        FormatBytes(all_resident + device_optimizer_bytes),
        device_optimizer_bytes > 0
            ? ", lower `optimizer_device_fraction` or use `optimizer_home host|nvme`"
            : " or use `param_home host|nvme`"));
  }
  for (auto& b : p->blocks) {
    b.resident = true;
    b.frozen_resident = b.frozen_params > 0;
  }
  p->streaming_slots = 0;
  return Status::Ok();
}

// What streaming needs on the device before any chunk is resident by choice.
struct StreamingNeeds {
  int slots = 0;
  uint64_t fixed_bytes = 0;  // FixedLayout::total_bytes
  // Resident whatever streams: blocks whose optimizer runs on the device (their params, and
  // their master weights, state and gradients) and, with frozen chunks, every other block's own
  // params (the adapters).
  uint64_t device_optimizer_params_bytes = 0;
  uint64_t device_optimizer_bytes = 0;
  uint64_t forced_resident_bytes = 0;
  uint64_t minimum_bytes = 0;  // all of it and the slots
};

// The streaming slots (the options', or 3 when the budget holds the third, else 2) and the
// minimum they set.
StreamingNeeds StreamingNeedsOf(const PlanInputs& r, const StateLayout& s, uint64_t fixed_bytes,
                                const Plan& p) {
  StreamingNeeds need;
  need.fixed_bytes = fixed_bytes;
  need.device_optimizer_bytes = s.device_optimizer_bytes;
  for (int b = 0; b < r.model.num_blocks(); ++b) {
    if (p.blocks[b].optimizer_on_device) {
      need.device_optimizer_params_bytes += Aligned(DeviceBlockBytes(p, b));
    } else if (p.frozen_params > 0) {
      need.forced_resident_bytes += Aligned(DeviceBlockBytes(p, b));
    }
  }
  const uint64_t unslotted = need.fixed_bytes + need.device_optimizer_params_bytes +
                             need.device_optimizer_bytes + need.forced_resident_bytes;
  // Auto: a third slot lets the prefetch run two blocks ahead, when the budget holds it.
  need.slots = r.o.streaming_slots;
  if (need.slots == 0) {
    need.slots = unslotted + 3 * Aligned(p.slot_bytes) <= r.o.device_budget_bytes ? 3 : 2;
  }
  need.minimum_bytes = unslotted + need.slots * Aligned(p.slot_bytes);
  return need;
}

// The error of a device budget below the streaming minimum: what is short, by how much, and what
// the minimum is made of.
Status StreamingBudgetShort(const PlanInputs& r, const ChunkSizes& c, const StreamingNeeds& need,
                            const Plan& p) {
  const PlacementOptions& o = r.o;
  return ResourceExhaustedError(fmt::format(
      "device budget {} is {} short: streaming needs {} slots of {} (the largest {}'s "
      "{} params) plus {} of activations, gradients and scratch for a {}x{} micro-batch{}{}{}; "
      "raise `device_budget` to at least {} or lower `micro_batch`{}",
      FormatBytes(o.device_budget_bytes), FormatBytesUp(need.minimum_bytes - o.device_budget_bytes),
      need.slots, FormatBytes(p.slot_bytes),
      c.max_frozen > static_cast<uint64_t>(c.max_padded) * r.w ? "frozen chunk" : "block",
      c.max_frozen > static_cast<uint64_t>(c.max_padded) * r.w ? c.max_frozen_params : c.max_padded,
      FormatBytes(need.fixed_bytes), r.shape.batch_size, r.shape.seq_len,
      need.forced_resident_bytes > 0
          ? fmt::format(", plus {} of resident trained params (the adapters)",
                        FormatBytes(need.forced_resident_bytes))
          : std::string(),
      need.device_optimizer_bytes > 0
          ? fmt::format(
                ", plus {} for the {} params whose optimizer runs on the device",
                FormatBytes(need.device_optimizer_params_bytes + need.device_optimizer_bytes),
                p.device_optimizer_params)
          : std::string(),
      p.kept_activation_bytes() > 0
          ? fmt::format(" (of which {} keep the activations of all {} layers: "
                        "`activation_checkpointing none`; `auto` keeps as many as fit, `all` none)",
                        FormatBytes(p.kept_activation_bytes()), p.num_keeping_activations())
          : std::string(),
      FormatBytesUp(need.minimum_bytes),
      need.device_optimizer_bytes > 0 ? " or `optimizer_device_fraction`" : ""));
}

// Spends `left` device bytes on resident chunks, largest first: all chunks are used equally
// often, so the largest first is simply the fewest copies per step. Chunk c < n is block c's
// own, c >= n block c - n's frozen one.
void KeepLargestChunksResident(uint64_t left, Plan* p) {
  const int n = static_cast<int>(p->blocks.size());
  const auto chunk_bytes = [&](int c) {
    return c < n ? DeviceBlockBytes(*p, c) : FrozenChunkBytes(*p, c - n);
  };
  std::vector<int> order(2 * n);
  for (int c = 0; c < 2 * n; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return chunk_bytes(a) > chunk_bytes(b); });
  for (int c : order) {
    Plan::Block& blk = p->blocks[c % n];
    bool& resident = c < n ? blk.resident : blk.frozen_resident;
    if (!resident && chunk_bytes(c) > 0 && Aligned(chunk_bytes(c)) <= left) {
      left -= Aligned(chunk_bytes(c));
      resident = true;
    }
  }
}

// Residency when blocks stream: the slots, the blocks that are resident whatever streams, and
// then the largest chunks the rest of the budget holds; no slots when that is every chunk.
// Errors: fewer than two slots asked for; a budget below the streaming minimum.
Status StreamBlocks(const PlanInputs& r, const ChunkSizes& c, const StateLayout& s,
                    uint64_t fixed_bytes, Plan* p) {
  if (r.o.streaming_slots != 0 && r.o.streaming_slots < 2) {
    return InvalidArgumentError("streaming needs at least 2 slots (one computing, one loading)");
  }
  const StreamingNeeds need = StreamingNeedsOf(r, s, fixed_bytes, *p);
  if (need.minimum_bytes > r.o.device_budget_bytes) return StreamingBudgetShort(r, c, need, *p);
  const int n = static_cast<int>(p->blocks.size());
  for (int b = 0; b < n; ++b) {
    p->blocks[b].resident =
        p->blocks[b].optimizer_on_device || p->frozen_params > 0 || p->blocks[b].num_params == 0;
  }
  p->streaming_slots = need.slots;
  KeepLargestChunksResident(r.o.device_budget_bytes - need.minimum_bytes, p);
  const int frozen_chunks =
      static_cast<int>(std::count_if(p->blocks.begin(), p->blocks.end(),
                                     [](const Plan::Block& b) { return b.frozen_params > 0; }));
  if (p->num_resident() == n && p->num_frozen_resident() == frozen_chunks) p->streaming_slots = 0;
  return Status::Ok();
}

// Residency: every block resident with the device as the params' home, with every block's
// optimizer on the device (and no frozen chunks: those may still stream), or when the budget
// holds them all; else some blocks stream through the slots.
Status ChooseResidency(const PlanInputs& r, const ChunkSizes& c, const StateLayout& s,
                       uint64_t fixed_bytes, Plan* p) {
  const uint64_t all_resident =
      AllResidentBytes(r.model, r.precision, r.shape, r.o.offload_activations, r.o.ranks, r.dp,
                       p->held_micro_batches, r.o.objective);
  const bool all_device_optimizer = p->device_optimizer_params == p->model_params;
  if (r.o.param_home == ParamHome::kDevice || (all_device_optimizer && p->frozen_params == 0) ||
      all_resident + s.device_optimizer_bytes + p->kept_activation_bytes() <=
          r.o.device_budget_bytes) {
    return KeepEveryBlockResident(r.o, all_resident, s.device_optimizer_bytes, p);
  }
  return StreamBlocks(r, c, s, fixed_bytes, p);
}

// Device regions, in the order the engine carves them: the fixed regions, resident params,
// resident frozen chunks, the state and gradient of each block optimized on the device, the
// slots; their total and the prefetch depth.
void ListDeviceRegions(const PlanInputs& r, const StateLayout& s, std::vector<DeviceRegion> fixed,
                       Plan* p) {
  const int n = static_cast<int>(p->blocks.size());
  p->device_regions = std::move(fixed);
  for (int b = 0; b < n; ++b) {
    if (p->blocks[b].resident && DeviceBlockBytes(*p, b) > 0) {
      p->device_regions.push_back(
          {"resident params " + p->blocks[b].name, DeviceBlockBytes(*p, b)});
    }
  }
  for (int b = 0; b < n; ++b) {
    if (p->blocks[b].frozen_resident) {
      p->device_regions.push_back(
          {"resident frozen params " + p->blocks[b].name, FrozenChunkBytes(*p, b)});
    }
  }
  for (int b = 0; b < n; ++b) {
    if (!p->blocks[b].optimizer_on_device) continue;
    // Data parallel: this rank's reduce-scattered fp32 partition.
    const int64_t elems = p->blocks[b].partition.own_elems;
    const bool grad16 = GradInWorkingPrecision(r.model, b, r.optimizer.grad_accum_steps, r.dp);
    p->device_regions.push_back(
        {"optimizer state " + p->blocks[b].name, s.states[b].region_bytes, true});
    p->device_regions.push_back(
        {"gradient " + p->blocks[b].name, DeviceGradientBytes(elems, grad16, r.w), true});
  }
  for (int i = 0; i < p->streaming_slots; ++i) {
    p->device_regions.push_back({fmt::format("streaming slot {}", i), p->slot_bytes});
  }
  for (const auto& region : p->device_regions) p->device_total_bytes += Aligned(region.size_bytes);
  p->prefetch_depth = std::max(0, p->streaming_slots - 1);
}

// Pipelines: the pinned gradient landing buckets and the optimizer pipeline's buffers, and a
// landing bucket's size. Errors: fewer buckets than one landing and one folding; a negative
// number of buffers.
Status SizePipelines(const PlanInputs& r, const ChunkSizes& c, Plan* p) {
  const PlacementOptions& o = r.o;
  if (o.host_grad_buckets != 0 && o.host_grad_buckets < 2) {
    return InvalidArgumentError("host_grad_buckets must be >= 2 (one landing, one folding)");
  }
  if (o.optimizer_buffers < 0) return InvalidArgumentError("optimizer_buffers must be >= 0");
  p->host_grad_buckets = o.host_grad_buckets != 0 ? o.host_grad_buckets : 3;
  p->optimizer_buffers = o.optimizer_buffers != 0 ? o.optimizer_buffers : (UsesNvme(o) ? 3 : 1);
  // Data parallel: a reduce-scattered fp32 partition; layer-major: a block's fp32 sum over the
  // micro-batches.
  p->grad_bucket_bytes = r.dp ? AlignUp(static_cast<uint64_t>(c.max_part) * 4, 4096)
                         : p->device_grad_accumulators
                             ? AlignUp(static_cast<uint64_t>(c.max_padded) * 4, 4096)
                             : c.own_slot_bytes;
  return Status::Ok();
}

// Pinned host tier (this rank's partitions): the gradient landing buckets, offloaded
// activations, the working params' home (host or device home) or, with an NVMe home, pinned
// copies of resident chunks and the slots' staging, and the optimizer pipeline's buffers.
void SizePinnedTier(const PlanInputs& r, const ChunkSizes& c, const StateLayout& s, Plan* p) {
  const PlacementOptions& o = r.o;
  const int n = static_cast<int>(p->blocks.size());
  p->pinned_bytes = p->host_grad_buckets * p->grad_bucket_bytes;  // gradient landing buckets
  if (o.offload_activations) {
    p->pinned_bytes +=
        AlignUp(static_cast<uint64_t>(r.model.activation_elems(r.shape)) * r.w, 4096) * (n - 1) *
        p->held_micro_batches;
  }
  p->pinned_frozen_bytes = 0;
  if (o.param_home == ParamHome::kHost || o.param_home == ParamHome::kDevice) {
    for (int b = 0; b < n; ++b) {
      p->pinned_bytes += AlignUp(HomeBlockBytes(*p, b), 4096);
      p->pinned_frozen_bytes += AlignUp(FrozenChunkBytes(*p, b), 4096);
    }
  } else {
    // Resident chunks keep a pinned copy (an own one refreshed after each update); streamed ones
    // have the slots' NVMe staging and (own chunks) the pipeline's copy-out.
    for (int b = 0; b < n; ++b) {
      if (p->blocks[b].resident) p->pinned_bytes += AlignUp(HomeBlockBytes(*p, b), 4096);
      if (p->blocks[b].frozen_resident) {
        p->pinned_frozen_bytes += AlignUp(FrozenChunkBytes(*p, b), 4096);
      }
    }
    p->pinned_bytes += p->streaming_slots * p->partition_bytes;
  }
  p->pinned_bytes += p->pinned_frozen_bytes;
  if (o.optimizer_home == OptimizerHome::kNvme) p->optimizer_buffer_bytes += s.max_region;
  if (o.param_home == ParamHome::kNvme) p->optimizer_buffer_bytes += c.own_partition_bytes;
  p->pinned_bytes += p->optimizer_buffers * p->optimizer_buffer_bytes;
  // The device optimizer's state staging (StateStore: one pinned region of its largest block's
  // master weights and state, through which checkpoints save and load them) and its gradient
  // statistics records (GradStreamer: one per block, read back each step).
  uint64_t device_region = 0, stats = 0;
  for (int b = 0; b < n; ++b) {
    if (p->blocks[b].optimizer_on_device) {
      device_region = std::max(device_region, s.states[b].region_bytes);
      stats += AlignUp(DeviceGradStatsBytes(p->blocks[b].partition.own_elems), 64);
    }
  }
  p->pinned_bytes += AlignUp(device_region, 4096) + AlignUp(stats, 4096);
}

// Host and NVMe tiers (this rank's partitions): the host gradients of the blocks the CPU
// updates, in the working precision or fp32 (GradInWorkingPrecision), and the master weights and
// optimizer state in their home; on NVMe the streamed chunks of an NVMe params home.
void SizeHostAndNvmeTiers(const PlanInputs& r, const StateLayout& s, Plan* p) {
  const PlacementOptions& o = r.o;
  const int n = static_cast<int>(p->blocks.size());
  for (int b = 0; b < n; ++b) {
    if (p->blocks[b].optimizer_on_device) continue;  // its gradient stays on the device
    // With ranks > 1 the reduced gradient is fp32.
    const bool grad16 = GradInWorkingPrecision(r.model, b, r.optimizer.grad_accum_steps, r.dp);
    p->host_grad_bytes +=
        static_cast<uint64_t>(p->blocks[b].partition.own_elems) * (grad16 ? r.w : 4);
    if (grad16 && r.w < 4) p->host_grad16_params += p->blocks[b].num_params;
  }
  p->host_bytes = p->host_grad_bytes;
  if (o.optimizer_home == OptimizerHome::kHost) {
    p->host_bytes += s.master_bytes + s.rank_state_bytes;
  }
  // An NVMe home's extents, each padded as the swap store pads it (a plan that counted them
  // unpadded passed `strata estimate`'s free-space check and failed in `strata train`).
  p->nvme_extent_bytes.clear();
  if (o.param_home == ParamHome::kNvme) {
    for (int b = 0; b < n; ++b) {
      if (!p->blocks[b].resident && HomeBlockBytes(*p, b) > 0) {
        p->nvme_extent_bytes.push_back(AlignUp(HomeBlockBytes(*p, b), kSwapExtentAlignment));
      }
      if (!p->blocks[b].frozen_resident && FrozenChunkBytes(*p, b) > 0) {
        p->nvme_extent_bytes.push_back(AlignUp(FrozenChunkBytes(*p, b), kSwapExtentAlignment));
      }
    }
  }
  if (o.optimizer_home == OptimizerHome::kNvme) {
    p->nvme_extent_bytes.insert(p->nvme_extent_bytes.end(), s.nvme_region_extents.begin(),
                                s.nvme_region_extents.end());
  }
  for (uint64_t e : p->nvme_extent_bytes) p->nvme_bytes += e;
  p->update_during_backward = o.update_during_backward;
  if (o.update_during_backward) {
    uint64_t all = 0;  // every CPU-optimized block's backup, each 64-byte aligned
    for (int b = 0; b < n; ++b) {
      if (p->blocks[b].optimizer_on_device) continue;
      all += AlignUp(SpeculationBackupBytes(*p, b, s.states[b].region_bytes), 64);
    }
    const uint64_t asked = o.speculation_backup_bytes > 0 ? o.speculation_backup_bytes
                                                          : std::max<uint64_t>(64 << 20, all / 8);
    p->speculation_backup_bytes = std::min(asked, all);
    p->host_bytes += p->speculation_backup_bytes;
  }
}

// Budget checks: the pinned, host (pinned included) and NVMe needs against their budgets (a
// zero host budget or NVMe capacity is not checked).
Status CheckHostBudgets(const PlacementOptions& o, const Plan& p) {
  if (p.pinned_bytes > o.pinned_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "pinned host budget {} is {} short: the plan pins {}", FormatBytes(o.pinned_budget_bytes),
        FormatBytesUp(p.pinned_bytes - o.pinned_budget_bytes), FormatBytesUp(p.pinned_bytes)));
  }
  const uint64_t host_total = p.host_bytes + p.pinned_bytes;
  if (o.host_budget_bytes > 0 && host_total > o.host_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "host budget {} is {} short: the plan needs {} ({} pinned + {} of host gradients{}{}); "
        "raise `host_budget`{}{}",
        FormatBytes(o.host_budget_bytes), FormatBytesUp(host_total - o.host_budget_bytes),
        FormatBytesUp(host_total), FormatBytes(p.pinned_bytes), FormatBytes(p.host_bytes),
        o.optimizer_home == OptimizerHome::kHost ? " and optimizer state" : "",
        p.speculation_backup_bytes > 0
            ? fmt::format(", {} of it the update during backward's backup",
                          FormatBytes(p.speculation_backup_bytes))
            : "",
        o.optimizer_home == OptimizerHome::kHost ? " or use `optimizer_home nvme`" : "",
        p.speculation_backup_bytes > 0 ? " or turn off `update_during_backward`" : ""));
  }
  if (o.nvme_capacity_bytes > 0 && p.nvme_bytes > o.nvme_capacity_bytes) {
    return ResourceExhaustedError(
        fmt::format("NVMe paths have {} free, {} short of the {} the plan swaps there; add a path "
                    "on another drive "
                    "to `nvme_paths` or free space",
                    FormatBytes(o.nvme_capacity_bytes),
                    FormatBytes(p.nvme_bytes - o.nvme_capacity_bytes), FormatBytes(p.nvme_bytes)));
  }
  return Status::Ok();
}

}  // namespace

uint64_t SpeculationBackupBytes(const Plan& plan, int b, uint64_t state_region_bytes) {
  uint64_t bytes = plan.optimizer_home == OptimizerHome::kNvme ? 0 : state_region_bytes;
  if (plan.param_home != ParamHome::kNvme || plan.blocks[b].resident) {
    bytes += static_cast<uint64_t>(plan.blocks[b].partition.own_elems) * SizeOf(plan.precision);
  }
  return bytes;
}

StatusOr<Plan> MakePlan(const Model& model, DType precision, MicroBatchShape shape,
                        const PlacementOptions& o, const PlanOptimizer& optimizer) {
  g_plans_built.fetch_add(1);
  ++t_plans_built;
  const PlanInputs r{
      model, precision, shape, o, optimizer, SizeOf(precision), o.data_parallel || o.ranks > 1};
  STRATA_RETURN_IF_ERROR(ValidateInputs(r));
  Plan p = NewPlan(r);
  STRATA_ASSIGN_OR_RETURN(const ChunkSizes chunks, PartitionBlocks(r, &p));
  const StateLayout state = LayOutOptimizerState(r, &p);
  FixedLayout fixed = LayOutFixedRegions(r, &p);
  SizeActivationStores(r, &p);
  STRATA_RETURN_IF_ERROR(
      ChooseResidency(r, chunks, state, fixed.total_bytes + p.kept_activation_bytes(), &p));
  ListDeviceRegions(r, state, std::move(fixed.regions), &p);
  KeepActivations(r, &p);
  STRATA_RETURN_IF_ERROR(SizePipelines(r, chunks, &p));
  SizePinnedTier(r, chunks, state, &p);
  SizeHostAndNvmeTiers(r, state, &p);
  STRATA_RETURN_IF_ERROR(CheckHostBudgets(o, p));
  return p;
}

}  // namespace strata::engine
