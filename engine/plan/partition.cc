#include "engine/plan/partition.h"

#include <algorithm>

#include "base/units.h"

namespace strata::engine {

Partition PartitionOf(int64_t num_params, int ranks, int rank) {
  Partition p;
  if (ranks <= 1) {
    p.part_elems = p.own_elems = p.padded_elems = num_params;
    return p;
  }
  p.part_elems = AlignUp((num_params + ranks - 1) / ranks, kPartitionAlign);
  p.offset_elems = p.part_elems * rank;
  p.own_elems = std::clamp<int64_t>(num_params - p.offset_elems, 0, p.part_elems);
  p.padded_elems = p.part_elems * ranks;
  return p;
}

}  // namespace strata::engine
