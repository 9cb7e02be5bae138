// AdafactorUpdate: argument checks, per-call scalars, the fixed tiling and the
// passes over the tensor (ISA variants over oneTBB tasks).
#include "cpu_optim/adafactor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "cpu_optim/kernels.h"
#include "cpu_optim/parallel.h"

namespace strata::cpu_optim {
namespace internal {
namespace {

bool Finite(float x) { return std::isfinite(x); }

Status CheckNonNegative(const char* name, float x) {
  if (Finite(x) && x >= 0.0f) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("Adafactor: {} must be finite and >= 0, got {}", name, x));
}

Status ValidateParams(const AdafactorConfig& c, const OptimStep& step) {
  STRATA_RETURN_IF_ERROR(CheckNonNegative("lr", c.lr));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("eps1", c.eps1));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("eps2", c.eps2));
  STRATA_RETURN_IF_ERROR(CheckNonNegative("weight_decay", c.weight_decay));
  if (!Finite(c.clip_threshold) || c.clip_threshold <= 0.0f) {
    return InvalidArgumentError(
        fmt::format("Adafactor: clip_threshold must be finite and > 0, got {}", c.clip_threshold));
  }
  if (!Finite(c.decay_rate) || c.decay_rate > 0.0f) {
    return InvalidArgumentError(fmt::format(
        "Adafactor: decay_rate must be finite and <= 0 (beta2t = 1 - t^decay_rate), got {}",
        c.decay_rate));
  }
  if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: beta1 must lie in [0, 1), got {}", c.beta1));
  }
  if (c.warmup_init && !c.relative_step) {
    return InvalidArgumentError("Adafactor: warmup_init requires relative_step");
  }
  if (step.step < 1) {
    return InvalidArgumentError(fmt::format("Adafactor: step must be >= 1, got {}", step.step));
  }
  if (!Finite(step.grad_scale)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: grad_scale must be finite, got {}", step.grad_scale));
  }
  return Status::Ok();
}

}  // namespace

bool MakeAdafactorGeometry(std::span<const int64_t> shape, AdafactorGeometry* geometry) {
  AdafactorGeometry g;
  g.factored = AdafactorFactored(shape);
  int64_t n = 1, rows = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || __builtin_mul_overflow(n, shape[i], &n)) return false;
    if (i + 1 < shape.size() && __builtin_mul_overflow(rows, shape[i], &rows)) return false;
  }
  g.num_elems = n;
  g.rows = g.factored ? rows : 1;
  g.cols = g.factored ? shape.back() : n;
  *geometry = g;
  return true;
}

AdafactorTiling MakeAdafactorTiling(int64_t rows, int64_t cols) {
  AdafactorTiling t;
  t.rows = rows;
  t.cols = cols;
  const int64_t wide = (kAdafactorTileElems + rows - 1) / rows;
  t.tile_cols = std::min(cols, std::max(kAdafactorMinTileCols, wide));
  t.tile_rows = std::min(rows, std::max(int64_t{1}, kAdafactorTileElems / t.tile_cols));
  t.num_row_blocks = (rows + t.tile_rows - 1) / t.tile_rows;
  t.num_col_blocks = (cols + t.tile_cols - 1) / t.tile_cols;
  return t;
}

AdafactorTile AdafactorTileAt(const AdafactorTiling& t, int64_t index) {
  const int64_t rb = index / t.num_col_blocks, cb = index % t.num_col_blocks;
  return AdafactorTile{.row_begin = rb * t.tile_rows,
                       .row_end = std::min(t.rows, (rb + 1) * t.tile_rows),
                       .col_begin = cb * t.tile_cols,
                       .col_end = std::min(t.cols, (cb + 1) * t.tile_cols)};
}

Status ValidateAdafactor(const AdafactorConfig& config, const OptimStep& step,
                         std::span<const int64_t> shape, std::span<float> master,
                         const AdafactorState& state, GradView grad, CopyOut copy_out,
                         AdafactorGeometry* geometry) {
  STRATA_RETURN_IF_ERROR(ValidateParams(config, step));
  AdafactorGeometry g;
  if (!MakeAdafactorGeometry(shape, &g)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: shape ({}) has a negative dimension or too many elements",
                    fmt::join(shape, ", ")));
  }
  const int64_t n = g.num_elems;
  if (n != static_cast<int64_t>(master.size())) {
    return InvalidArgumentError(
        fmt::format("Adafactor: shape ({}) has {} elements but master has {}",
                    fmt::join(shape, ", "), n, master.size()));
  }
  struct Want {
    std::span<float> span;
    int64_t size;
    const char* name;
  };
  const int64_t unused = 0;
  const Want wants[] = {
      {state.exp_avg_sq_row, g.factored ? g.rows : unused, "exp_avg_sq_row"},
      {state.exp_avg_sq_col, g.factored ? g.cols : unused, "exp_avg_sq_col"},
      {state.exp_avg_sq, g.factored ? unused : n, "exp_avg_sq"},
      {state.exp_avg, config.beta1 > 0.0f ? n : unused, "exp_avg"},
  };
  for (const Want& w : wants) {
    if (static_cast<int64_t>(w.span.size()) != w.size) {
      return InvalidArgumentError(fmt::format(
          "Adafactor: {} has {} elements but needs {} for shape ({}){}", w.name, w.span.size(),
          w.size, fmt::join(shape, ", "), w.size == 0 ? " (unused by this configuration)" : ""));
    }
    if (w.size > 0 && w.span.data() == nullptr) {
      return InvalidArgumentError(fmt::format("Adafactor: null {} pointer", w.name));
    }
  }
  if (!IsValidDType(grad.dtype)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: unknown gradient dtype {}", static_cast<int>(grad.dtype)));
  }
  if (copy_out.data != nullptr && !IsValidDType(copy_out.dtype)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: unknown copy-out dtype {}", static_cast<int>(copy_out.dtype)));
  }
  if (n > 0 && (master.data() == nullptr || grad.data == nullptr)) {
    return InvalidArgumentError(
        fmt::format("Adafactor: null master or gradient pointer with num_elems {}", n));
  }
  struct Range {
    const void* p;
    size_t size_bytes;
    const char* name;
  };
  const auto un = static_cast<size_t>(n);
  const Range ranges[] = {
      {master.data(), master.size_bytes(), "master"},
      {grad.data, un * SizeOf(grad.dtype), "grad"},
      {copy_out.data, copy_out.data ? un * SizeOf(copy_out.dtype) : 0, "copy_out"},
      {state.exp_avg_sq_row.data(), state.exp_avg_sq_row.size_bytes(), "exp_avg_sq_row"},
      {state.exp_avg_sq_col.data(), state.exp_avg_sq_col.size_bytes(), "exp_avg_sq_col"},
      {state.exp_avg_sq.data(), state.exp_avg_sq.size_bytes(), "exp_avg_sq"},
      {state.exp_avg.data(), state.exp_avg.size_bytes(), "exp_avg"},
  };
  for (size_t i = 0; i < std::size(ranges); ++i) {
    for (size_t j = i + 1; j < std::size(ranges); ++j) {
      if (Overlaps(ranges[i].p, ranges[i].size_bytes, ranges[j].p, ranges[j].size_bytes)) {
        return InvalidArgumentError(
            fmt::format("Adafactor: buffers {} and {} overlap", ranges[i].name, ranges[j].name));
      }
    }
  }
  *geometry = g;
  return Status::Ok();
}

double AdafactorLr(const AdafactorConfig& c, const OptimStep& step, double sum_squares_p,
                   int64_t num_elems) {
  const double t = static_cast<double>(step.step);
  double lr = c.lr;
  if (c.relative_step) {
    lr = std::min(c.warmup_init ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
  }
  if (c.scale_parameter) {
    const double rms = std::sqrt(sum_squares_p / static_cast<double>(num_elems));
    lr *= std::max(static_cast<double>(c.eps2), rms);
  }
  return lr;
}

AdafactorScalars PrepareAdafactor(const AdafactorConfig& c, const OptimStep& step, double lr) {
  AdafactorScalars s{};
  s.grad_scale = c.maximize ? -step.grad_scale : step.grad_scale;
  s.eps1 = c.eps1;
  const double decay_pow =
      std::pow(static_cast<double>(step.step), static_cast<double>(c.decay_rate));
  s.beta2t = static_cast<float>(1.0 - decay_pow);
  s.one_minus_beta2t = static_cast<float>(decay_pow);
  s.beta1 = c.beta1;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(c.beta1));
  s.decay = static_cast<float>(1.0 - static_cast<double>(c.weight_decay) * lr);
  s.has_first_moment = c.beta1 > 0.0f;
  s.has_weight_decay = c.weight_decay != 0.0f;
  return s;
}

float AdafactorStepSize(const AdafactorConfig& c, double lr, double sum_squares_update,
                        int64_t num_elems) {
  const double rms = std::sqrt(sum_squares_update / static_cast<double>(num_elems));
  const double ratio = rms / static_cast<double>(c.clip_threshold);
  // max(1, ratio), NaN kept as torch's clamp keeps it.
  const double denom = std::isnan(ratio) ? ratio : std::max(1.0, ratio);
  return static_cast<float>(lr / denom);
}

namespace {

// fp64 partial sums and fp32 factors of one factored step.
struct Scratch {
  std::vector<double> row_partial;  // (num_col_blocks, rows)
  std::vector<double> col_partial;  // (num_row_blocks, cols)
  std::vector<float> row_factor, col_factor;
};

Status FactoredStep(const KernelTable& kernels, const AdafactorConfig& config,
                    const AdafactorGeometry& geo, double lr, const AdafactorState& state,
                    AdafactorScalars& s, AdafactorBuffers& b) {
  const AdafactorTiling tiling = MakeAdafactorTiling(geo.rows, geo.cols);
  const int64_t rows = geo.rows, cols = geo.cols;
  Scratch scratch;
  try {
    scratch.row_partial.resize(static_cast<size_t>(tiling.num_col_blocks * rows));
    scratch.col_partial.resize(static_cast<size_t>(tiling.num_row_blocks * cols));
    scratch.row_factor.resize(static_cast<size_t>(rows));
    scratch.col_factor.resize(static_cast<size_t>(cols));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(fmt::format(
        "Adafactor: cannot allocate the partial sums of a ({}, {}) matrix", rows, cols));
  }
  double* row_partial = scratch.row_partial.data();
  double* col_partial = scratch.col_partial.data();
  const int64_t num_tiles = tiling.num_tiles();
  // Pass 1: partial row and column sums of u, one tile per task.
  STRATA_RETURN_IF_ERROR(ParallelForTiles(num_tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const AdafactorTile t = AdafactorTileAt(tiling, k);
      const int64_t rb = k / tiling.num_col_blocks, cb = k % tiling.num_col_blocks;
      kernels.adafactor_sums(s, b, t, row_partial + cb * rows + t.row_begin,
                             col_partial + rb * cols + t.col_begin);
    }
  }));
  // R and C, then the factors (element-wise over rows and columns).
  float* row_state = state.exp_avg_sq_row.data();
  float* col_state = state.exp_avg_sq_col.data();
  const float beta2t = s.beta2t, one_minus_beta2t = s.one_minus_beta2t;
  STRATA_RETURN_IF_ERROR(ParallelForTiles(rows, kOptimTileElems, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      double sum = 0.0;
      for (int64_t cb = 0; cb < tiling.num_col_blocks; ++cb) sum += row_partial[cb * rows + i];
      const auto mean = static_cast<float>(sum / static_cast<double>(cols));
      row_state[i] = beta2t * row_state[i] + one_minus_beta2t * mean;
    }
  }));
  STRATA_RETURN_IF_ERROR(ParallelForTiles(cols, kOptimTileElems, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      double sum = 0.0;
      for (int64_t rb = 0; rb < tiling.num_row_blocks; ++rb) sum += col_partial[rb * cols + j];
      const auto mean = static_cast<float>(sum / static_cast<double>(rows));
      const float c = beta2t * col_state[j] + one_minus_beta2t * mean;
      col_state[j] = c;
      scratch.col_factor[j] = 1.0f / std::sqrt(c);
    }
  }));
  double sum_r = 0.0;
  for (int64_t i = 0; i < rows; ++i) sum_r += row_state[i];
  const auto mean_r = static_cast<float>(sum_r / static_cast<double>(rows));
  STRATA_RETURN_IF_ERROR(ParallelForTiles(rows, kOptimTileElems, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      scratch.row_factor[i] = 1.0f / std::sqrt(row_state[i] / mean_r);
    }
  }));
  b.row_factor = scratch.row_factor.data();
  b.col_factor = scratch.col_factor.data();
  // Pass 2: RMS(update), tiles combined pairwise.
  auto tile_sum = [&](int64_t k) {
    return kernels.adafactor_update_sq(s, b, AdafactorTileAt(tiling, k));
  };
  double sum_u = 0.0;
  if (num_tiles == 1) {
    sum_u = tile_sum(0);
  } else {
    STRATA_RETURN_IF_ERROR(RunGuarded([&] { sum_u = PairwiseLeafSum(0, num_tiles, tile_sum); }));
  }
  s.step_size = AdafactorStepSize(config, lr, sum_u, geo.num_elems);
  // Pass 3: the update.
  return ParallelForTiles(num_tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      kernels.adafactor_apply(s, b, AdafactorTileAt(tiling, k));
    }
  });
}

Status VectorStep(const KernelTable& kernels, const AdafactorConfig& config,
                  const AdafactorGeometry& geo, double lr, AdafactorScalars& s,
                  AdafactorBuffers& b) {
  double sum_u = 0.0;
  STRATA_RETURN_IF_ERROR(DeterministicLeafSum(
      geo.num_elems,
      [&](int64_t begin, int64_t end) { return kernels.adafactor_vector_sq(s, b, begin, end); },
      &sum_u));
  s.step_size = AdafactorStepSize(config, lr, sum_u, geo.num_elems);
  return ParallelForTiles(geo.num_elems, kOptimTileElems, [&](int64_t begin, int64_t end) {
    kernels.adafactor_vector_apply(s, b, begin, end);
  });
}

}  // namespace

Status AdafactorUpdateWith(const KernelTable& kernels, const AdafactorConfig& config,
                           const OptimStep& step, std::span<const int64_t> shape,
                           std::span<float> master, const AdafactorState& state, GradView grad,
                           CopyOut copy_out) {
  AdafactorGeometry geo;
  STRATA_RETURN_IF_ERROR(
      ValidateAdafactor(config, step, shape, master, state, grad, copy_out, &geo));
  if (geo.num_elems == 0) return Status::Ok();
  double sum_squares_p = 0.0;
  if (config.scale_parameter) {
    STRATA_RETURN_IF_ERROR(DeterministicLeafSum(
        geo.num_elems,
        [&](int64_t begin, int64_t end) {
          return kernels.sum_squares(master.data(), DType::kF32, 1.0, begin, end);
        },
        &sum_squares_p));
  }
  const double lr = AdafactorLr(config, step, sum_squares_p, geo.num_elems);
  AdafactorScalars s = PrepareAdafactor(config, step, lr);
  AdafactorBuffers b{.master = master.data(),
                     .grad = grad.data,
                     .grad_dtype = grad.dtype,
                     .out = copy_out.data,
                     .out_dtype = copy_out.dtype,
                     .exp_avg = s.has_first_moment ? state.exp_avg.data() : nullptr,
                     .exp_avg_sq = state.exp_avg_sq.data(),
                     .row_factor = nullptr,
                     .col_factor = nullptr,
                     .cols = geo.cols};
  return geo.factored ? FactoredStep(kernels, config, geo, lr, state, s, b)
                      : VectorStep(kernels, config, geo, lr, s, b);
}

}  // namespace internal

bool AdafactorFactored(std::span<const int64_t> shape) { return shape.size() >= 2; }

int64_t AdafactorStateElems(const AdafactorConfig& config, std::span<const int64_t> shape) {
  internal::AdafactorGeometry g;
  if (!internal::MakeAdafactorGeometry(shape, &g)) return 0;
  const int64_t second_moment = g.factored ? g.rows + g.cols : g.num_elems;
  return second_moment + (config.beta1 > 0.0f ? g.num_elems : 0);
}

Status AdafactorUpdate(const AdafactorConfig& config, const OptimStep& step,
                       std::span<const int64_t> shape, std::span<float> master,
                       const AdafactorState& state, GradView grad, CopyOut copy_out) {
  return internal::AdafactorUpdateWith(internal::BestKernelTable(), config, step, shape, master,
                                       state, grad, copy_out);
}

}  // namespace strata::cpu_optim
