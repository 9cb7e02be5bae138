// The fp32 scratch of the CUDA ops' two-pass column reductions (LayerNorm parameter gradients,
// column sums, RMSNorm weight gradient): pass 1 sums blocks of rows into partials, pass 2 adds
// the partials of each column in order. Plain C++ (no CUDA headers), so the blocks' scratch
// layouts (models/cuda/*_layout.h) size their regions from it in every build.
#pragma once

#include <cstdint>

namespace strata::models::ops::cuda {

// Rows per partial sum of the LayerNorm parameter gradients and the column sums.
inline constexpr int64_t kLnRowsPerPartial = 64;
inline int64_t LnPartials(int64_t rows) {
  return (rows + kLnRowsPerPartial - 1) / kLnRowsPerPartial;
}

// Rows per partial sum of the RMSNorm weight gradient.
inline constexpr int64_t kRmsRowsPerPartial = 64;
inline int64_t RmsPartials(int64_t rows) {
  return (rows + kRmsRowsPerPartial - 1) / kRmsRowsPerPartial;
}

}  // namespace strata::models::ops::cuda
