#include "engine/plan/optimizer_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/units.h"
#include "cpu_optim/kernels.h"
#include "engine/plan/partition.h"

namespace strata::engine {

BlockState LayoutBlockState(const Model& model, int block, const cpu_optim::AnyOptimizer& optimizer,
                            const Partition* partition) {
  BlockState s;
  s.kind = optimizer.kind;
  const auto* adamw = std::get_if<cpu_optim::AdamWConfig>(&optimizer.config);
  if (optimizer.kind == cpu_optim::OptimizerKind::kAdamW8bit && adamw != nullptr &&
      model.block_name(block) == "embedding") {
    s.kind = adamw->decoupled_weight_decay ? cpu_optim::OptimizerKind::kAdamW
                                           : cpu_optim::OptimizerKind::kAdam;
  }
  int64_t elems = model.block_num_params(block);
  s.no_decay = model.block_no_decay_ranges(block);
  if (partition != nullptr && partition->part_elems != elems) {
    elems = partition->own_elems;
    s.shapes = {{elems}};
    const int64_t begin = partition->offset_elems, end = begin + elems;
    std::vector<cpu_optim::ElemRange> own;
    for (const cpu_optim::ElemRange& r : s.no_decay) {
      if (r.end > begin && r.begin < end) {
        own.push_back({std::max(r.begin, begin) - begin, std::min(r.end, end) - begin});
      }
    }
    s.no_decay = std::move(own);
  } else {
    s.shapes = model.block_tensor_shapes(block);
  }
  s.sections = cpu_optim::StateLayout(BlockOptimizer(optimizer, s), s.shapes);
  s.master_bytes = AlignUp(static_cast<uint64_t>(elems) * 4, kStateAlign);
  uint64_t offset = s.master_bytes;
  for (const auto& section : s.sections) {
    s.offsets.push_back(offset);
    offset += AlignUp(section.size_bytes(), kStateAlign);
  }
  s.region_bytes = offset;
  return s;
}

cpu_optim::AnyOptimizer BlockOptimizer(const cpu_optim::AnyOptimizer& optimizer,
                                       const BlockState& state) {
  cpu_optim::AnyOptimizer o = optimizer;
  o.kind = state.kind;
  return o;
}

bool PartitionableOptimizer(const cpu_optim::AnyOptimizer& optimizer) {
  return optimizer.kind != cpu_optim::OptimizerKind::kAdamW8bit &&
         optimizer.kind != cpu_optim::OptimizerKind::kAdafactor;
}

std::string OptimizerFlagName(const cpu_optim::AnyOptimizer& optimizer) {
  switch (optimizer.kind) {
    case cpu_optim::OptimizerKind::kAdamW:
      return "adamw";
    case cpu_optim::OptimizerKind::kAdam:
      return "adam";
    case cpu_optim::OptimizerKind::kAdamW8bit:
      return "adamw8bit";
    case cpu_optim::OptimizerKind::kAdafactor:
      return "adafactor";
    case cpu_optim::OptimizerKind::kLion:
      return "lion";
    case cpu_optim::OptimizerKind::kSgd:
      return "sgd";
    case cpu_optim::OptimizerKind::kAdagrad:
      return "adagrad";
  }
  return "unknown";
}

size_t DeviceGradStatsBytes(int64_t num_elems) {
  constexpr int64_t kLeaf = cpu_optim::internal::kStatsLeafElems;
  const int64_t leaves = num_elems <= 0 ? 0 : (num_elems + kLeaf - 1) / kLeaf;
  return kDeviceGradStatsHeaderBytes + sizeof(double) * static_cast<size_t>(leaves);
}

Status CheckDeviceOptimizer(const cpu_optim::AnyOptimizer& optimizer) {
  STRATA_RETURN_IF_ERROR(cpu_optim::Validate(optimizer));
  switch (optimizer.kind) {
    case cpu_optim::OptimizerKind::kAdamW:
    case cpu_optim::OptimizerKind::kAdam:
    case cpu_optim::OptimizerKind::kAdagrad:
    case cpu_optim::OptimizerKind::kLion:
    case cpu_optim::OptimizerKind::kSgd:
      return Status::Ok();
    case cpu_optim::OptimizerKind::kAdamW8bit:
      return InvalidArgumentError(
          "adamw8bit runs on the CPU only: use `optimizer_home host` or `optimizer_home nvme`");
    case cpu_optim::OptimizerKind::kAdafactor:
      return InvalidArgumentError(
          "adafactor runs on the CPU only: use `optimizer_home host` or `optimizer_home nvme`");
  }
  return InvalidArgumentError(fmt::format("optimizer kind {} does not run on the device",
                                          static_cast<int>(optimizer.kind)));
}

}  // namespace strata::engine
