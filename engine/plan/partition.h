// Block partitions for data parallelism: which elements of a block's chunk a rank owns. A
// header of its own so that the state layout (engine/plan/optimizer_state.h) and the planner
// (engine/plan/planner.h) both use it without including each other.
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>

namespace strata::engine {

// Block partitions for data parallelism, after ZeRO (Rajbhandari et al., SC 2020): a chunk of
// num_params is split into `ranks` contiguous partitions of part_elems each (num_params / ranks
// rounded up to kPartitionAlign elements, so a partition starts 128-byte aligned in 16 bits and
// 256-byte aligned in fp32); rank r owns elements [offset_elems, offset_elems + own_elems), the
// real (unpadded) part of partition r: the last ranks may own fewer, or none. The device copy of
// a block is padded to padded_elems = ranks * part_elems. One rank: one partition of num_params,
// no padding.
inline constexpr int64_t kPartitionAlign = 64;
struct Partition {
  int64_t part_elems = 0;
  int64_t offset_elems = 0;
  int64_t own_elems = 0;
  int64_t padded_elems = 0;
};
// Pure; ranks >= 1, 0 <= rank < ranks.
Partition PartitionOf(int64_t num_params, int ranks, int rank);

}  // namespace strata::engine
