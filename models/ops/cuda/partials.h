// The fp32 scratch of the CUDA ops' two-pass column reductions (LayerNorm parameter gradients,
// column sums, RMSNorm and per-head RMSNorm weight gradients): pass 1 sums blocks of rows into
// partials, pass 2 adds the partials of each column in order. Plain C++ (no CUDA headers), so the
// blocks' scratch layouts (models/cuda/*_layout.h) size their regions from it in every build.
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

// Rows per partial sum of the per-head RMSNorm weight gradient (LaunchHeadRmsNormBackward): each
// partial sums its rows' q and k heads, so a partial covers rows x heads products per column.
inline constexpr int64_t kHeadRmsRowsPerPartial = 16;
inline int64_t HeadRmsPartials(int64_t rows) {
  return (rows + kHeadRmsRowsPerPartial - 1) / kHeadRmsRowsPerPartial;
}
// The size in bytes of LaunchHeadRmsNormBackward's fp32 workspace for `rows` rows of heads of hs
// columns: (HeadRmsPartials(rows), 2, hs) fp32 (the q and k weight rows). It depends on rows and
// hs, not on the number of heads (a partial sums all of its rows' heads).
inline int64_t HeadRmsNormWorkspaceBytes(int64_t rows, int64_t hs) {
  return HeadRmsPartials(rows) * 2 * hs * static_cast<int64_t>(sizeof(float));
}

}  // namespace strata::models::ops::cuda
