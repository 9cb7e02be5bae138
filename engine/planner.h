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
#include "engine/model.h"

namespace strata::engine {

enum class ParamHome { kDevice, kHost, kNvme };  // where working params live between uses
enum class OptimizerHome { kHost, kNvme };       // where p32, m, v live
std::string_view ParamHomeName(ParamHome h);     // "device", "host", "nvme"
std::string_view OptimizerHomeName(OptimizerHome h);
StatusOr<ParamHome> ParseParamHome(std::string_view s);
StatusOr<OptimizerHome> ParseOptimizerHome(std::string_view s);

struct PlacementOptions {
  uint64_t device_budget_bytes = 0;  // the whole device arena; must be > 0
  uint64_t pinned_budget_bytes = 64ull << 30;
  // Host memory for everything the plan keeps there, pinned included; 0 = not checked.
  uint64_t host_budget_bytes = 0;
  // Free bytes over all NVMe paths (distinct file systems summed); 0 = not checked.
  uint64_t nvme_capacity_bytes = 0;
  ParamHome param_home = ParamHome::kNvme;  // kDevice: every block must be resident
  OptimizerHome optimizer_home = OptimizerHome::kNvme;
  std::vector<std::string> nvme_paths;  // required when anything lives on NVMe
  int streaming_slots = 2;              // >= 2 when any block streams
};

struct DeviceRegion {
  std::string label;  // "activations", "slot.layer3", ...
  uint64_t size_bytes;
};

struct Plan {
  struct Block {
    std::string name;
    int64_t num_params = 0;
    bool resident = false;
  };
  std::vector<Block> blocks;
  DType precision = DType::kBF16;
  MicroBatchShape shape;
  ParamHome param_home = ParamHome::kNvme;
  OptimizerHome optimizer_home = OptimizerHome::kNvme;
  int streaming_slots = 0;
  int64_t model_params = 0;
  int64_t max_block_params = 0;
  uint64_t slot_bytes = 0;  // one block's working params, padded
  std::vector<DeviceRegion> device_regions;
  uint64_t device_budget_bytes = 0;
  uint64_t device_total_bytes = 0;  // sum of regions (each aligned to 256 B)
  uint64_t pinned_bytes = 0;        // param home or NVMe staging, gradient buckets
  uint64_t host_bytes = 0;          // fp32 gradient accumulators (+ optimizer state if on host)
  uint64_t nvme_bytes = 0;          // swap store payload
  uint64_t model_state_bytes = 0;   // p16 + g16 + p32 + m + v over all params

  int num_resident() const;
  // The plan in plain words, one tier per line.
  std::string Describe() const;
};

// The smallest device budget that trains with every block streamed through
// `streaming_slots` slots: activations, gradients, scratch and the slots.
uint64_t StreamingMinimumBytes(const Model& model, DType precision, MicroBatchShape shape,
                               int streaming_slots = 2);

// Errors: kInvalidArgument (zero budget, no NVMe path for NVMe placement,
// streaming_slots < 2); kResourceExhausted when the device budget cannot hold
// the minimum (what is short and by how much, and what the minimum is made of),
// or when the pinned, host or NVMe needs exceed their budgets (which, by how much).
StatusOr<Plan> MakePlan(const Model& model, DType precision, MicroBatchShape shape,
                        const PlacementOptions& options);

}  // namespace strata::engine
