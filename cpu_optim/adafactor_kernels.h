// Internal to cpu_optim: Adafactor's per-call constants, buffers and the fixed
// partition of a factored tensor into tiles, shared by adafactor.cc, its scalar
// reference and the ISA variants (kernels_impl.inc). Not part of the public API.
//
// Summation order (fp64 additions of fp32 values; it depends on the shape alone, so
// results are bit-identical for any thread count and ISA variant). "Lanes" below are
// kAdafactorLanes fp64 partial sums, combined pairwise: ((l0 + l1) + (l2 + l3)) + ...
// (32 lanes, not sum_squares' 8: the additions of one lane form a dependency chain,
// and 8 chains cap an AVX-512 core at 2 elements per fp64 add latency).
//  - RMS(p): the order of KernelTable::sum_squares over master (kernels.h).
//  - Not factored, RMS(update): the chunks and leaves of sum_squares, element i of a
//    chunk in lane i % kAdafactorLanes.
//  - Factored: the (rows, cols) matrix is cut into tiles of tile_rows x tile_cols
//    (AdafactorTiling, the last row and column blocks shorter); tile (rb, cb) has
//    index rb * num_col_blocks + cb.
//    - Row sum of u over one tile: element (i, j) is added to lane
//      (j - col_begin) % kAdafactorLanes of row i, in index order from 0, lanes
//      combined at the row's end. Row i's sum is
//      0.0 + tile(rb, 0) + tile(rb, 1) + ... over its column blocks in order.
//    - Column sum of u over one tile: 0.0 + u[row_begin, j] + u[row_begin + 1, j] +
//      ...; column j's sum is 0.0 + tile(0, cb) + tile(1, cb) + ... in order.
//    - mean(R): 0.0 + R[0] + R[1] + ... in index order.
//    - RMS(update): per tile, element (i, j) is added to lane (j - col_begin) %
//      kAdafactorLanes, rows in order, lanes starting at 0 for the tile and combined
//      at its end; the tiles are combined pairwise by index (PairwiseLeafSum).
#pragma once

#include <cstdint>
#include <span>

#include "base/dtype.h"
#include "base/status.h"
#include "cpu_optim/adafactor.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim::internal {

// A tile holds about this many elements; narrow matrices get tiles of whole rows,
// wide ones tiles of kAdafactorMinTileCols columns or more.
inline constexpr int64_t kAdafactorTileElems = 65536;
inline constexpr int64_t kAdafactorMinTileCols = 1024;
inline constexpr int64_t kAdafactorLanes = 32;

// The partition of a (rows, cols) matrix, rows, cols >= 1:
//   tile_cols = min(cols, max(kAdafactorMinTileCols, ceil(kAdafactorTileElems / rows)))
//   tile_rows = min(rows, max(1, kAdafactorTileElems / tile_cols))
struct AdafactorTiling {
  int64_t rows = 0, cols = 0;
  int64_t tile_rows = 0, tile_cols = 0;
  int64_t num_row_blocks = 0, num_col_blocks = 0;

  int64_t num_tiles() const { return num_row_blocks * num_col_blocks; }
};

struct AdafactorTile {
  int64_t row_begin, row_end;  // rows [row_begin, row_end)
  int64_t col_begin, col_end;  // columns [col_begin, col_end)
};

AdafactorTiling MakeAdafactorTiling(int64_t rows, int64_t cols);
// Tile `index` (rb * num_col_blocks + cb) of the partition.
AdafactorTile AdafactorTileAt(const AdafactorTiling& tiling, int64_t index);

// Per-call constants, fp64 from the config and rounded to fp32 once.
struct AdafactorScalars {
  float grad_scale;  // negated when maximize
  float eps1;
  float beta2t;            // 1 - t^decay_rate
  float one_minus_beta2t;  // t^decay_rate
  float step_size;         // lr_t / max(1, RMS(update) / clip_threshold); set after RMS(update)
  float beta1, one_minus_beta1;
  float decay;  // 1 - weight_decay * lr_t
  bool has_first_moment;
  bool has_weight_decay;
};

// Base pointers of one Adafactor call. Factored tensors are row-major (rows, cols)
// matrices: element (i, j) is at i * cols + j of master, grad, out and exp_avg.
struct AdafactorBuffers {
  float* master;
  const void* grad;
  DType grad_dtype;
  void* out;  // nullptr: no copy-out
  DType out_dtype;
  float* exp_avg;     // nullptr unless beta1 > 0
  float* exp_avg_sq;  // not factored: V
  // Factored: rsqrt(R[i] / mean(R)) (rows) and rsqrt(C[j]) (cols), after this step's
  // update of R and C.
  const float* row_factor;
  const float* col_factor;
  int64_t cols;  // factored: the row stride
};

// The matrix a shape stands for: num_elems = prod(shape); factored: rows =
// prod(shape[:-1]), cols = shape[-1]; not factored: rows = 1, cols = num_elems.
struct AdafactorGeometry {
  int64_t num_elems = 0, rows = 0, cols = 0;
  bool factored = false;
};
// false when a dimension is negative or a product overflows int64_t.
bool MakeAdafactorGeometry(std::span<const int64_t> shape, AdafactorGeometry* geometry);

// Every check of adafactor.h (kInvalidArgument); fills *geometry when Ok.
Status ValidateAdafactor(const AdafactorConfig& config, const OptimStep& step,
                         std::span<const int64_t> shape, std::span<float> master,
                         const AdafactorState& state, GradView grad, CopyOut copy_out,
                         AdafactorGeometry* geometry);
// lr_t in fp64; sum_squares_p (sum of p^2 in the fixed order) is used only with
// scale_parameter.
double AdafactorLr(const AdafactorConfig& config, const OptimStep& step, double sum_squares_p,
                   int64_t num_elems);
// Every scalar but step_size.
AdafactorScalars PrepareAdafactor(const AdafactorConfig& config, const OptimStep& step, double lr);
// float(lr_t / max(1, RMS(update) / clip_threshold)), NaN kept as torch's clamp.
float AdafactorStepSize(const AdafactorConfig& config, double lr, double sum_squares_update,
                        int64_t num_elems);

}  // namespace strata::cpu_optim::internal
