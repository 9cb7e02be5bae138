// Internal to cpu_optim: the oneTBB loops shared by the public entry points. Only
// generic-ISA translation units include this (never a kernels_<isa>.cc), so no
// oneTBB template is ever compiled with ISA flags.
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_invoke.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "base/status.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim::internal {

// Runs fn; an exception from oneTBB (it throws, the library API does not) becomes
// a Status.
template <typename F>
Status RunGuarded(const F& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("cpu_optim: oneTBB could not allocate its tasks");
  } catch (const std::exception& e) {
    return InternalError(std::string("cpu_optim: oneTBB failed: ") + e.what());
  }
  return Status::Ok();
}

// Calls f(begin, end) over [0, num_elems) in ranges made of whole tiles of
// tile_elems elements (the last one shorter), in parallel. For element-wise
// kernels: the result does not depend on how the ranges fall.
template <typename F>
Status ParallelForTiles(int64_t num_elems, int64_t tile_elems, const F& f) {
  if (num_elems <= tile_elems) {
    if (num_elems > 0) f(int64_t{0}, num_elems);
    return Status::Ok();
  }
  const int64_t num_tiles = (num_elems + tile_elems - 1) / tile_elems;
  return RunGuarded([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_tiles),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        f(r.begin() * tile_elems, std::min(num_elems, r.end() * tile_elems));
                      });
  });
}

// Pairwise sum of leaf(l) over leaves [first, last): split at the midpoint
// first + (last - first) / 2, left + right. The two halves run as oneTBB tasks; the
// order of the additions is fixed by the leaf count alone, so the result is the
// same for any thread count.
template <typename LeafFn>
double PairwiseLeafSum(int64_t first, int64_t last, const LeafFn& leaf) {
  if (last - first == 1) return leaf(first);
  const int64_t mid = first + (last - first) / 2;
  double left = 0.0, right = 0.0;
  tbb::parallel_invoke([&] { left = PairwiseLeafSum(first, mid, leaf); },
                       [&] { right = PairwiseLeafSum(mid, last, leaf); });
  return left + right;
}

// Sum over the fixed leaves of kStatsLeafElems elements (the last one shorter):
// leaf(begin, end) -> double, combined by PairwiseLeafSum.
template <typename LeafFn>
Status DeterministicLeafSum(int64_t num_elems, const LeafFn& leaf, double* sum) {
  *sum = 0.0;
  if (num_elems <= 0) return Status::Ok();
  const int64_t num_leaves = (num_elems + kStatsLeafElems - 1) / kStatsLeafElems;
  auto leaf_at = [&](int64_t l) {
    return leaf(l * kStatsLeafElems, std::min(num_elems, (l + 1) * kStatsLeafElems));
  };
  if (num_leaves == 1) {
    *sum = leaf_at(0);
    return Status::Ok();
  }
  return RunGuarded([&] { *sum = PairwiseLeafSum(0, num_leaves, leaf_at); });
}

}  // namespace strata::cpu_optim::internal
