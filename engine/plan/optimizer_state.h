// The optimizer state of one engine block: which optimizer updates the block, the sections of
// its state, and where each lies in the block's state region.
//
// A block's state region is [fp32 master weights | section 0 | section 1 | ...], each part
// padded to kStateAlign bytes, the same in host memory and in the block's swap-store extent
// (so one NVMe read brings in the whole state of a block). The sections come from
// cpu_optim::StateLayout (any_optimizer.h) for the block's tensor shapes
// (Model::block_tensor_shapes): fp32 exp_avg and exp_avg_sq for AdamW (8 B/param), 8-bit codes
// and block-wise absmax for AdamW8bit (about 2 B/param), factored row and column statistics for
// Adafactor (a few bytes per row and column), ...
//
// AdamW8bit keeps fp32 state for the embedding block, as Dettmers et al. (2022) recommend for
// the embedding layer (their "stable embedding" keeps its optimizer state in 32 bits): tokens
// seen rarely have tiny, badly quantized moments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "cpu_optim/any_optimizer.h"
#include "engine/plan/model.h"

namespace strata::engine {

struct Partition;  // engine/plan/partition.h

inline constexpr uint64_t kStateAlign = 4096;

struct BlockState {
  // The kind that updates the block (the run's, or AdamW/Adam for AdamW8bit's embedding block);
  // the hyper-parameters are always the run's.
  cpu_optim::OptimizerKind kind = cpu_optim::OptimizerKind::kAdamW;
  std::vector<std::vector<int64_t>> shapes;  // Model::block_tensor_shapes
  // Model::block_no_decay_ranges, in the elements of this state's buffer (with a partition:
  // intersected with the rank's own elements and counted from their first).
  std::vector<cpu_optim::ElemRange> no_decay;
  std::vector<cpu_optim::StateSpec> sections;
  std::vector<uint64_t> offsets;  // byte offset of each section in the region
  uint64_t master_bytes = 0;      // padded fp32 master weights (the region starts with them)
  uint64_t region_bytes = 0;      // master + sections, padded
  uint64_t state_bytes() const { return region_bytes - master_bytes; }
};

// The layout of block `block` of `model` for the run's optimizer. Pure; thread-safe.
// With `partition` (planner.h) of a data-parallel rank, the state of that rank's own elements
// only, as one flat tensor: only optimizers whose state is element-wise may be partitioned
// (PartitionableOptimizer).
BlockState LayoutBlockState(const Model& model, int block, const cpu_optim::AnyOptimizer& optimizer,
                            const Partition* partition = nullptr);
// Whether an optimizer's state is element-wise (AdamW, Adam, Lion, SGD, Adagrad), so that a
// block's state splits into partitions and a checkpoint's state re-splits for another number of
// ranks. AdamW8bit (absmax per 2048 values) and Adafactor (row and column statistics) are not.
bool PartitionableOptimizer(const cpu_optim::AnyOptimizer& optimizer);

// The optimizer that updates a block: `optimizer` with the block's kind.
cpu_optim::AnyOptimizer BlockOptimizer(const cpu_optim::AnyOptimizer& optimizer,
                                       const BlockState& state);

// "adamw", "adam", "adamw8bit", "adafactor", "lion", "sgd", "adagrad": the names of
// `strata train --optimizer` and of checkpoint manifests.
std::string OptimizerFlagName(const cpu_optim::AnyOptimizer& optimizer);

// The size of the statistics record of a gradient of num_elems elements (num_elems >= 0) whose
// optimizer runs on the device (engine/device_optimizer.h writes it): a 16-byte header and one
// fp64 partial sum per leaf of cpu_optim's fixed reduction order (cpu_optim/kernels.h: 64Ki
// elements per leaf), at most 16 + 8 * ceil(num_elems / 65536) bytes. Here because the plan lays
// it out in the device arena. Pure; thread-safe.
inline constexpr size_t kDeviceGradStatsHeaderBytes = 16;
size_t DeviceGradStatsBytes(int64_t num_elems);

// OK when `optimizer` is valid (cpu_optim::Validate) and its kind runs on the device: AdamW and
// Adam (amsgrad, L2 or decoupled decay, maximize), Lion, SGD (momentum, dampening, nesterov),
// Adagrad. kInvalidArgument naming the kind for AdamW8bit and Adafactor, e.g. "adamw8bit runs on
// the CPU only: use --offload-optimizer host or nvme". Pure; thread-safe.
Status CheckDeviceOptimizer(const cpu_optim::AnyOptimizer& optimizer);

}  // namespace strata::engine
