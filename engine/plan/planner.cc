#include "engine/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>

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
  return InvalidArgumentError(
      fmt::format("--offload-params '{}' is not one of device, host, nvme", s));
}
StatusOr<OptimizerHome> ParseOptimizerHome(std::string_view s) {
  if (s == "host") return OptimizerHome::kHost;
  if (s == "nvme") return OptimizerHome::kNvme;
  if (s == "device") return OptimizerHome::kDevice;
  return InvalidArgumentError(
      fmt::format("--offload-optimizer '{}' is not one of device, host, nvme", s));
}

std::string_view ScheduleName(Schedule s) {
  return s == Schedule::kLayerMajor ? "layer-major" : "micro-batch-major";
}
StatusOr<Schedule> ParseSchedule(std::string_view s) {
  if (s == "micro-batch-major") return Schedule::kMicroBatchMajor;
  if (s == "layer-major") return Schedule::kLayerMajor;
  return InvalidArgumentError(
      fmt::format("--schedule '{}' is not one of layer-major, micro-batch-major", s));
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

// A block's elements on the device: padded to whole partitions with ranks > 1.
int64_t DeviceElems(const Model& model, int b, int ranks) {
  return PartitionOf(model.block_num_params(b), ranks, 0).padded_elems;
}
// The largest chunk a streaming slot holds: a block's own (padded) or its frozen chunk.
int64_t MaxChunkElems(const Model& model, int ranks) {
  int64_t m = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    m = std::max({m, DeviceElems(model, b, ranks), model.block_frozen_params(b)});
  }
  return m;
}
// With frozen chunks every own chunk is resident (planner.h): their device bytes.
uint64_t ForcedResidentBytes(const Model& model, DType precision) {
  if (model.frozen_params() == 0) return 0;
  uint64_t total = 0;
  for (int b = 0; b < model.num_blocks(); ++b) {
    total += Aligned(static_cast<uint64_t>(model.block_num_params(b)) * SizeOf(precision));
  }
  return total;
}

// `held`: Plan::held_micro_batches.
std::vector<DeviceRegion> FixedRegions(const Model& model, DType precision, MicroBatchShape shape,
                                       bool offload_activations, int ranks, bool data_parallel,
                                       int held) {
  const int n = model.num_blocks();
  int64_t max_block_params = 0, max_part = 0;
  uint64_t max_scratch = 0;
  for (int b = 0; b < n; ++b) {
    max_block_params = std::max(max_block_params, DeviceElems(model, b, ranks));
    max_part = std::max(max_part, PartitionOf(model.block_num_params(b), ranks, 0).part_elems);
    max_scratch = std::max<uint64_t>(max_scratch, model.scratch_bytes(b, shape, precision));
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
      {fmt::format("gradient buckets (2 x one block, {}; blocks write their gradients here)", dt),
       2 * Aligned(static_cast<uint64_t>(max_block_params) * w)},
  };
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
    return InvalidArgumentError(fmt::format("--optimizer-device-fraction {} is not in [0, 1]",
                                            o.optimizer_device_fraction));
  }
  const bool device = o.optimizer_home == OptimizerHome::kDevice || o.optimizer_device_fraction > 0;
  if (!device) return Status::Ok();
  return CheckDeviceOptimizer(optimizer.optimizer);  // the kinds the device update runs
}

}  // namespace

uint64_t StreamingMinimumBytes(const Model& model, DType precision, MicroBatchShape shape,
                               int streaming_slots, bool offload_activations, int ranks,
                               bool data_parallel, int held_micro_batches) {
  uint64_t total = 0;
  for (const auto& r : FixedRegions(model, precision, shape, offload_activations, ranks,
                                    data_parallel, held_micro_batches)) {
    total += Aligned(r.size_bytes);
  }
  const uint64_t slot =
      AlignUp(static_cast<uint64_t>(MaxChunkElems(model, ranks)) * SizeOf(precision), 4096);
  return total + streaming_slots * Aligned(slot) + ForcedResidentBytes(model, precision);
}

uint64_t AllResidentBytes(const Model& model, DType precision, MicroBatchShape shape,
                          bool offload_activations, int ranks, bool data_parallel,
                          int held_micro_batches) {
  uint64_t total = 0;
  for (const auto& r : FixedRegions(model, precision, shape, offload_activations, ranks,
                                    data_parallel, held_micro_batches)) {
    total += Aligned(r.size_bytes);
  }
  for (int b = 0; b < model.num_blocks(); ++b) {
    total += Aligned(static_cast<uint64_t>(DeviceElems(model, b, ranks)) * SizeOf(precision));
    total += Aligned(static_cast<uint64_t>(model.block_frozen_params(b)) * SizeOf(precision));
  }
  return total;
}

uint64_t AutoDeviceBudgetBytes(const Model& model, DType precision, MicroBatchShape shape,
                               const PlacementOptions& options, const PlanOptimizer& optimizer) {
  const PlacementOptions& o = options;
  const int held = HeldMicroBatches(o, optimizer);
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
                            o.data_parallel, held) +
           device_optimizer_bytes;
  }
  const int slots = o.streaming_slots > 0 ? o.streaming_slots : 2;
  const uint64_t minimum = StreamingMinimumBytes(
      model, precision, shape, slots, o.offload_activations, o.ranks, o.data_parallel, held);
  const uint64_t working =
      static_cast<uint64_t>(model.num_params() + model.frozen_params()) * SizeOf(precision);
  return (working > minimum ? minimum + (working - minimum) / 2 : minimum) +
         device_optimizer_params_bytes + device_optimizer_bytes;
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

StatusOr<Plan> MakePlan(const Model& model, DType precision, MicroBatchShape shape,
                        const PlacementOptions& o, const PlanOptimizer& optimizer) {
  g_plans_built.fetch_add(1);
  ++t_plans_built;
  if (o.device_budget_bytes == 0) {
    return InvalidArgumentError("device budget is zero; give one with units, e.g. 64MiB");
  }
  if (shape.batch_size <= 0 || shape.seq_len <= 0 || shape.seq_len > model.max_seq_len()) {
    return InvalidArgumentError(
        fmt::format("micro-batch {}x{} is invalid: need batch >= 1 and 1 <= seq_len <= {}",
                    shape.batch_size, shape.seq_len, model.max_seq_len()));
  }
  if (o.ranks < 1 || o.rank < 0 || o.rank >= o.ranks) {
    return InvalidArgumentError(fmt::format("rank {} of {} ranks is not a rank", o.rank, o.ranks));
  }
  STRATA_RETURN_IF_ERROR(CheckDeviceOptimizerPlacement(o, optimizer));
  const int ranks = o.ranks;
  const bool dp = o.data_parallel || ranks > 1;
  const bool nvme = o.param_home == ParamHome::kNvme || o.optimizer_home == OptimizerHome::kNvme;
  if (nvme && o.nvme_paths.empty()) {
    return InvalidArgumentError("state is placed on NVMe but no --nvme-path was given");
  }
  Plan p;
  p.precision = precision;
  p.shape = shape;
  p.param_home = o.param_home;
  p.optimizer_home = o.optimizer_home;
  p.device_budget_bytes = o.device_budget_bytes;
  const int n = model.num_blocks();
  const size_t w = SizeOf(precision);
  p.ranks = ranks;
  p.rank = o.rank;
  p.data_parallel = dp;
  int64_t max_padded = 0, max_part = 0, max_frozen = 0;
  for (int b = 0; b < n; ++b) {
    const int64_t np = model.block_num_params(b);
    const int64_t frozen = model.block_frozen_params(b);
    if (np == 0 && frozen == 0) {
      return InvalidArgumentError(fmt::format(
          "block {} ('{}') has no parameters, neither trained nor frozen", b, model.block_name(b)));
    }
    if (frozen > 0 && dp) {
      return InvalidArgumentError(
          "frozen parameters (LoRA's base weights) are not supported with data parallelism yet: "
          "train on one rank");
    }
    p.blocks.push_back({model.block_name(b), np, false, PartitionOf(np, ranks, o.rank)});
    p.blocks.back().frozen_params = frozen;
    p.model_params += np;
    p.frozen_params += frozen;
    p.max_block_params = std::max(p.max_block_params, np);
    max_padded = std::max(max_padded, p.blocks.back().partition.padded_elems);
    max_part = std::max(max_part, p.blocks.back().partition.part_elems);
    max_frozen = std::max(max_frozen, frozen);
  }
  // A slot and its NVMe staging hold any chunk; the gradient buckets and the pipeline's copy-out
  // only own ones.
  p.slot_bytes = AlignUp(static_cast<uint64_t>(std::max(max_padded, max_frozen)) * w, 4096);
  p.partition_bytes = AlignUp(static_cast<uint64_t>(std::max(max_part, max_frozen)) * w, 4096);
  const uint64_t own_slot_bytes = AlignUp(static_cast<uint64_t>(max_padded) * w, 4096);
  const uint64_t own_partition_bytes = AlignUp(static_cast<uint64_t>(max_part) * w, 4096);
  const bool has_frozen = p.frozen_params > 0;
  // The optimizer's state, block by block as the engine lays it out (this rank's partitions).
  std::vector<BlockState> states;
  uint64_t max_region = 0, master_bytes = 0;
  uint64_t rank_state_bytes = 0;  // this rank's partitions (the whole with one rank)
  const std::vector<bool> device_optimizer = DeviceOptimizerBlocks(model, o);
  uint64_t device_optimizer_bytes = 0;  // master weights, state and gradients on the device
  for (int b = 0; b < n; ++b) {
    states.push_back(LayoutBlockState(model, b, optimizer.optimizer, &p.blocks[b].partition));
    p.optimizer_state_bytes += ranks > 1
                                   ? LayoutBlockState(model, b, optimizer.optimizer).state_bytes()
                                   : states.back().state_bytes();
    if (device_optimizer[b]) {
      p.blocks[b].optimizer_on_device = true;
      p.device_optimizer_params += p.blocks[b].num_params;
      device_optimizer_bytes +=
          DeviceOptimizerBytes(states.back(), p.blocks[b].partition.own_elems,
                               GradInWorkingPrecision(model, b, optimizer.grad_accum_steps, dp), w);
      continue;
    }
    rank_state_bytes += states.back().state_bytes();
    master_bytes += states.back().master_bytes;
    max_region = std::max(max_region, states.back().region_bytes);
  }
  p.optimizer_name = OptimizerFlagName(optimizer.optimizer);
  p.model_state_bytes =
      static_cast<uint64_t>(p.model_params) * (2 * w + 4) + p.optimizer_state_bytes;

  // Fixed regions: everything but the parameter slots.
  p.schedule = o.schedule;
  p.held_micro_batches = HeldMicroBatches(o, optimizer);
  p.device_grad_accumulators = p.held_micro_batches > 1 && !dp;
  const std::vector<DeviceRegion> fixed =
      FixedRegions(model, precision, shape, o.offload_activations, ranks, dp, p.held_micro_batches);
  p.offload_activations = o.offload_activations;
  uint64_t fixed_total = 0;
  for (const auto& r : fixed) fixed_total += Aligned(r.size_bytes);

  // A block on the device (padded to whole partitions) and this rank's partition of it at home.
  const auto block_bytes = [&](int b) {
    return static_cast<uint64_t>(p.blocks[b].partition.padded_elems) * w;
  };
  const auto home_bytes = [&](int b) {
    return static_cast<uint64_t>(p.blocks[b].partition.part_elems) * w;
  };
  const auto frozen_bytes = [&](int b) {
    return static_cast<uint64_t>(p.blocks[b].frozen_params) * w;
  };
  const uint64_t all_resident = AllResidentBytes(model, precision, shape, o.offload_activations,
                                                 ranks, dp, p.held_micro_batches);

  // Blocks whose optimizer runs on the device are resident, with their state beside them.
  // With frozen chunks every own chunk is resident too (planner.h).
  uint64_t device_optimizer_params_bytes = 0, forced_resident_bytes = 0;
  for (int b = 0; b < n; ++b) {
    if (device_optimizer[b]) {
      device_optimizer_params_bytes += Aligned(block_bytes(b));
    } else if (has_frozen) {
      forced_resident_bytes += Aligned(block_bytes(b));
    }
  }
  const bool all_device_optimizer = p.device_optimizer_params == p.model_params;
  // Every block optimized on the device is resident; with frozen chunks those may still stream.
  if (o.param_home == ParamHome::kDevice || (all_device_optimizer && !has_frozen) ||
      all_resident + device_optimizer_bytes <= o.device_budget_bytes) {
    if (all_resident + device_optimizer_bytes > o.device_budget_bytes) {
      return ResourceExhaustedError(fmt::format(
          "device budget {} is {} short of keeping every block resident{} ({} needed); raise "
          "--device-budget{}",
          FormatBytes(o.device_budget_bytes),
          FormatBytes(all_resident + device_optimizer_bytes - o.device_budget_bytes),
          device_optimizer_bytes > 0
              ? fmt::format(" with the optimizer of {} params on the device ({} of master "
                            "weights, state and gradients)",
                            p.device_optimizer_params, FormatBytes(device_optimizer_bytes))
              : std::string(" (--offload-params device)"),
          FormatBytes(all_resident + device_optimizer_bytes),
          device_optimizer_bytes > 0
              ? ", lower --optimizer-device-fraction or use --offload-optimizer host|nvme"
              : " or use --offload-params host|nvme"));
    }
    for (auto& b : p.blocks) {
      b.resident = true;
      b.frozen_resident = b.frozen_params > 0;
    }
    p.streaming_slots = 0;
  } else {
    if (o.streaming_slots != 0 && o.streaming_slots < 2) {
      return InvalidArgumentError("streaming needs at least 2 slots (one computing, one loading)");
    }
    // Auto: a third slot lets the prefetch run two blocks ahead, when the budget holds it.
    int slots = o.streaming_slots;
    if (slots == 0) {
      slots = fixed_total + 3 * Aligned(p.slot_bytes) + device_optimizer_params_bytes +
                          device_optimizer_bytes + forced_resident_bytes <=
                      o.device_budget_bytes
                  ? 3
                  : 2;
    }
    const uint64_t minimum = fixed_total + slots * Aligned(p.slot_bytes) +
                             device_optimizer_params_bytes + device_optimizer_bytes +
                             forced_resident_bytes;
    if (minimum > o.device_budget_bytes) {
      return ResourceExhaustedError(fmt::format(
          "device budget {} is {} short: streaming needs {} slots of {} (the largest {}'s "
          "{} params) plus {} of activations, gradients and scratch for a {}x{} micro-batch{}{}; "
          "raise --device-budget to at least {} or lower --micro-batch-size/--seq-len{}",
          FormatBytes(o.device_budget_bytes), FormatBytes(minimum - o.device_budget_bytes), slots,
          FormatBytes(p.slot_bytes), max_frozen > max_padded ? "frozen chunk" : "block",
          std::max(max_frozen, max_padded), FormatBytes(fixed_total), shape.batch_size,
          shape.seq_len,
          forced_resident_bytes > 0
              ? fmt::format(", plus {} of resident trained params (the adapters)",
                            FormatBytes(forced_resident_bytes))
              : std::string(),
          device_optimizer_bytes > 0
              ? fmt::format(", plus {} for the {} params whose optimizer runs on the device",
                            FormatBytes(device_optimizer_params_bytes + device_optimizer_bytes),
                            p.device_optimizer_params)
              : std::string(),
          FormatBytes(minimum),
          device_optimizer_bytes > 0 ? " or --optimizer-device-fraction" : ""));
    }
    for (int b = 0; b < n; ++b) {
      p.blocks[b].resident = device_optimizer[b] || has_frozen || p.blocks[b].num_params == 0;
    }
    p.streaming_slots = slots;
    // Spend what is left on resident chunks, largest first (each saves the most
    // traffic per byte... all chunks are used equally often, so largest first
    // is simply the fewest copies per step). Chunk c < n is block c's own, c >= n block
    // c - n's frozen one.
    uint64_t left = o.device_budget_bytes - minimum;
    const auto chunk_bytes = [&](int c) { return c < n ? block_bytes(c) : frozen_bytes(c - n); };
    std::vector<int> order(2 * n);
    for (int c = 0; c < 2 * n; ++c) order[c] = c;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return chunk_bytes(a) > chunk_bytes(b); });
    for (int c : order) {
      Plan::Block& blk = p.blocks[c % n];
      bool& resident = c < n ? blk.resident : blk.frozen_resident;
      if (!resident && chunk_bytes(c) > 0 && Aligned(chunk_bytes(c)) <= left) {
        left -= Aligned(chunk_bytes(c));
        resident = true;
      }
    }
    const int frozen_chunks =
        static_cast<int>(std::count_if(p.blocks.begin(), p.blocks.end(),
                                       [](const Plan::Block& b) { return b.frozen_params > 0; }));
    if (p.num_resident() == n && p.num_frozen_resident() == frozen_chunks) p.streaming_slots = 0;
  }

  p.device_regions = fixed;
  for (int b = 0; b < n; ++b) {
    if (p.blocks[b].resident && block_bytes(b) > 0) {
      p.device_regions.push_back({"resident params " + p.blocks[b].name, block_bytes(b)});
    }
  }
  for (int b = 0; b < n; ++b) {
    if (p.blocks[b].frozen_resident) {
      p.device_regions.push_back({"resident frozen params " + p.blocks[b].name, frozen_bytes(b)});
    }
  }
  for (int b = 0; b < n; ++b) {
    if (!device_optimizer[b]) continue;
    // Data parallel: this rank's reduce-scattered fp32 partition.
    const int64_t elems = p.blocks[b].partition.own_elems;
    const bool grad16 = GradInWorkingPrecision(model, b, optimizer.grad_accum_steps, dp);
    p.device_regions.push_back(
        {"optimizer state " + p.blocks[b].name, states[b].region_bytes, true});
    p.device_regions.push_back(
        {"gradient " + p.blocks[b].name, DeviceGradientBytes(elems, grad16, w), true});
  }
  for (int s = 0; s < p.streaming_slots; ++s) {
    p.device_regions.push_back({fmt::format("streaming slot {}", s), p.slot_bytes});
  }
  for (const auto& r : p.device_regions) p.device_total_bytes += Aligned(r.size_bytes);
  p.prefetch_depth = std::max(0, p.streaming_slots - 1);

  // Pipelines.
  if (o.host_grad_buckets != 0 && o.host_grad_buckets < 2) {
    return InvalidArgumentError("host_grad_buckets must be >= 2 (one landing, one folding)");
  }
  if (o.optimizer_buffers < 0) return InvalidArgumentError("optimizer_buffers must be >= 0");
  p.host_grad_buckets = o.host_grad_buckets != 0 ? o.host_grad_buckets : 3;
  p.optimizer_buffers = o.optimizer_buffers != 0 ? o.optimizer_buffers : (nvme ? 3 : 1);
  // Data parallel: a reduce-scattered fp32 partition; layer-major: a block's fp32 sum over the
  // micro-batches.
  p.grad_bucket_bytes = dp ? AlignUp(static_cast<uint64_t>(max_part) * 4, 4096)
                        : p.device_grad_accumulators
                            ? AlignUp(static_cast<uint64_t>(max_padded) * 4, 4096)
                            : own_slot_bytes;

  // Host tiers: this rank's partitions.
  uint64_t params_w = 0;  // streamed blocks' working params (an NVMe home's extents)
  for (int b = 0; b < n; ++b) {
    if (!p.blocks[b].resident) params_w += AlignUp(home_bytes(b), ranks > 1 ? 4096 : 1);
  }
  p.pinned_bytes = p.host_grad_buckets * p.grad_bucket_bytes;  // gradient landing buckets
  if (o.offload_activations) {
    p.pinned_bytes += AlignUp(static_cast<uint64_t>(model.activation_elems(shape)) * w, 4096) *
                      (n - 1) * p.held_micro_batches;
  }
  uint64_t frozen_w = 0;  // frozen chunks streamed from NVMe have an extent there
  for (int b = 0; b < n; ++b) {
    if (!p.blocks[b].frozen_resident) frozen_w += frozen_bytes(b);
  }
  if (o.param_home == ParamHome::kHost || o.param_home == ParamHome::kDevice) {
    for (int b = 0; b < n; ++b) {
      p.pinned_bytes += AlignUp(home_bytes(b), 4096) + AlignUp(frozen_bytes(b), 4096);
    }
  } else {
    // Resident chunks keep a pinned copy (an own one refreshed after each update); streamed ones
    // have the slots' NVMe staging and (own chunks) the pipeline's copy-out.
    for (int b = 0; b < n; ++b) {
      if (p.blocks[b].resident) p.pinned_bytes += AlignUp(home_bytes(b), 4096);
      if (p.blocks[b].frozen_resident) p.pinned_bytes += AlignUp(frozen_bytes(b), 4096);
    }
    p.pinned_bytes += p.streaming_slots * p.partition_bytes;
  }
  if (o.optimizer_home == OptimizerHome::kNvme) p.optimizer_buffer_bytes += max_region;
  if (o.param_home == ParamHome::kNvme) p.optimizer_buffer_bytes += own_partition_bytes;
  p.pinned_bytes += p.optimizer_buffers * p.optimizer_buffer_bytes;
  for (int b = 0; b < n; ++b) {
    if (device_optimizer[b]) continue;  // its gradient stays on the device
    // With ranks > 1 the reduced gradient is fp32.
    const bool grad16 = GradInWorkingPrecision(model, b, optimizer.grad_accum_steps, dp);
    p.host_grad_bytes += static_cast<uint64_t>(p.blocks[b].partition.own_elems) * (grad16 ? w : 4);
    if (grad16 && w < 4) p.host_grad16_params += p.blocks[b].num_params;
  }
  p.host_bytes = p.host_grad_bytes;
  if (o.optimizer_home == OptimizerHome::kHost) p.host_bytes += master_bytes + rank_state_bytes;
  if (o.param_home == ParamHome::kNvme) p.nvme_bytes += params_w + frozen_w;
  if (o.optimizer_home == OptimizerHome::kNvme) {
    p.nvme_bytes += master_bytes + rank_state_bytes;
  }
  if (p.pinned_bytes > o.pinned_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "pinned host budget {} is {} short: the plan pins {}", FormatBytes(o.pinned_budget_bytes),
        FormatBytes(p.pinned_bytes - o.pinned_budget_bytes), FormatBytes(p.pinned_bytes)));
  }
  const uint64_t host_total = p.host_bytes + p.pinned_bytes;
  if (o.host_budget_bytes > 0 && host_total > o.host_budget_bytes) {
    return ResourceExhaustedError(fmt::format(
        "host budget {} is {} short: the plan needs {} ({} pinned + {} of host gradients{}); "
        "raise --host-budget{}",
        FormatBytes(o.host_budget_bytes), FormatBytes(host_total - o.host_budget_bytes),
        FormatBytes(host_total), FormatBytes(p.pinned_bytes), FormatBytes(p.host_bytes),
        o.optimizer_home == OptimizerHome::kHost ? " and optimizer state" : "",
        o.optimizer_home == OptimizerHome::kHost ? " or use --offload-optimizer nvme" : ""));
  }
  if (o.nvme_capacity_bytes > 0 && p.nvme_bytes > o.nvme_capacity_bytes) {
    return ResourceExhaustedError(fmt::format(
        "NVMe paths have {} free, {} short of the {} the plan swaps there; add a --nvme-path on "
        "another drive or free space",
        FormatBytes(o.nvme_capacity_bytes), FormatBytes(p.nvme_bytes - o.nvme_capacity_bytes),
        FormatBytes(p.nvme_bytes)));
  }
  return p;
}

}  // namespace strata::engine
