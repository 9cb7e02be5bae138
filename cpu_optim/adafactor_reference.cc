// The scalar reference of AdafactorUpdate: plain loops on the calling thread, one
// element at a time, base/dtype.h conversions, the formulas of adafactor.h and the
// summation order of adafactor_kernels.h written out serially.
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "cpu_optim/adafactor.h"
#include "cpu_optim/kernels.h"

namespace strata::cpu_optim {
namespace {

using internal::kAdafactorLanes;
using internal::kStatsLanes;

// Lanes summed pairwise: sum(first, last) = sum(first, mid) + sum(mid, last).
double CombineLanes(const double* acc, int64_t first, int64_t last) {
  if (last - first == 1) return acc[first];
  const int64_t mid = first + (last - first) / 2;
  return CombineLanes(acc, first, mid) + CombineLanes(acc, mid, last);
}

// PairwiseLeafSum of parallel.h, serially.
template <typename LeafFn>
double Pairwise(int64_t first, int64_t last, const LeafFn& leaf) {
  if (last - first == 1) return leaf(first);
  const int64_t mid = first + (last - first) / 2;
  const double left = Pairwise(first, mid, leaf);
  const double right = Pairwise(mid, last, leaf);
  return left + right;
}

// sum_squares' order over [0, n): chunks of kStatsChunkElems in kLanes lanes,
// leaves of kStatsChunksPerLeaf chunks, leaves pairwise. term(i) is element i's term.
template <int64_t kLanes, typename TermFn>
double ChunkedSum(int64_t n, const TermFn& term) {
  if (n == 0) return 0.0;
  auto leaf = [&](int64_t l) {
    const int64_t begin = l * internal::kStatsLeafElems;
    const int64_t end = std::min(n, begin + internal::kStatsLeafElems);
    double sum = 0.0;
    for (int64_t c = begin; c < end; c += internal::kStatsChunkElems) {
      double acc[kLanes] = {};
      const int64_t chunk_end = std::min(end, c + internal::kStatsChunkElems);
      for (int64_t i = c; i < chunk_end; ++i) acc[(i - c) % kLanes] += term(i);
      sum += CombineLanes(acc, 0, kLanes);
    }
    return sum;
  };
  return Pairwise(0, (n + internal::kStatsLeafElems - 1) / internal::kStatsLeafElems, leaf);
}

float Rsqrt(float x) { return 1.0f / std::sqrt(x); }

// p (and exp_avg) from the unclipped update u of element i; copy-out.
void Apply(const internal::AdafactorScalars& s, std::span<float> master,
           const AdafactorState& state, CopyOut copy_out, size_t i, float u) {
  float upd = u * s.step_size;
  if (s.has_first_moment) {
    upd = s.beta1 * state.exp_avg[i] + s.one_minus_beta1 * upd;
    state.exp_avg[i] = upd;
  }
  float p = master[i];
  if (s.has_weight_decay) p = p * s.decay;
  p = p - upd;
  master[i] = p;
  if (copy_out.data != nullptr) internal::ReferenceStore(copy_out, i, p);
}

}  // namespace

Status AdafactorUpdateReference(const AdafactorConfig& config, const OptimStep& step,
                                std::span<const int64_t> shape, std::span<float> master,
                                const AdafactorState& state, GradView grad, CopyOut copy_out) {
  internal::AdafactorGeometry geo;
  STRATA_RETURN_IF_ERROR(
      internal::ValidateAdafactor(config, step, shape, master, state, grad, copy_out, &geo));
  const int64_t n = geo.num_elems;
  if (n == 0) return Status::Ok();
  double sum_squares_p = 0.0;
  if (config.scale_parameter) {
    sum_squares_p = ChunkedSum<kStatsLanes>(n, [&](int64_t i) {
      const double p = master[i];
      return p * p;
    });
  }
  const double lr = internal::AdafactorLr(config, step, sum_squares_p, n);
  internal::AdafactorScalars s = internal::PrepareAdafactor(config, step, lr);
  auto g_at = [&](int64_t i) { return internal::ReferenceLoad(grad, i) * s.grad_scale; };
  auto u_at = [&](int64_t i) {
    const float g = g_at(i);
    return g * g + s.eps1;
  };

  if (!geo.factored) {
    std::span<float> v = state.exp_avg_sq;
    const double sum_u = ChunkedSum<kAdafactorLanes>(n, [&](int64_t i) {
      v[i] = s.beta2t * v[i] + s.one_minus_beta2t * u_at(i);
      const double y = Rsqrt(v[i]) * g_at(i);
      return y * y;
    });
    s.step_size = internal::AdafactorStepSize(config, lr, sum_u, n);
    for (int64_t i = 0; i < n; ++i) Apply(s, master, state, copy_out, i, Rsqrt(v[i]) * g_at(i));
    return Status::Ok();
  }

  const int64_t rows = geo.rows, cols = geo.cols;
  const internal::AdafactorTiling tiling = internal::MakeAdafactorTiling(rows, cols);
  std::vector<double> row_sum, col_sum;
  std::vector<float> row_factor, col_factor;
  try {
    row_sum.assign(rows, 0.0);
    col_sum.assign(cols, 0.0);
    row_factor.resize(rows);
    col_factor.resize(cols);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("AdafactorUpdateReference: out of memory");
  }
  // Row sums: column blocks in order; column sums: row blocks in order.
  for (int64_t rb = 0; rb < tiling.num_row_blocks; ++rb) {
    for (int64_t cb = 0; cb < tiling.num_col_blocks; ++cb) {
      const internal::AdafactorTile t =
          internal::AdafactorTileAt(tiling, rb * tiling.num_col_blocks + cb);
      for (int64_t i = t.row_begin; i < t.row_end; ++i) {
        double acc[kAdafactorLanes] = {};
        for (int64_t j = t.col_begin; j < t.col_end; ++j) {
          acc[(j - t.col_begin) % kAdafactorLanes] += u_at(i * cols + j);
        }
        row_sum[i] += CombineLanes(acc, 0, kAdafactorLanes);
      }
      for (int64_t j = t.col_begin; j < t.col_end; ++j) {
        double tile = 0.0;
        for (int64_t i = t.row_begin; i < t.row_end; ++i) tile += u_at(i * cols + j);
        col_sum[j] += tile;
      }
    }
  }
  std::span<float> r = state.exp_avg_sq_row, c = state.exp_avg_sq_col;
  double sum_r = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const auto mean = static_cast<float>(row_sum[i] / static_cast<double>(cols));
    r[i] = s.beta2t * r[i] + s.one_minus_beta2t * mean;
    sum_r += r[i];
  }
  for (int64_t j = 0; j < cols; ++j) {
    const auto mean = static_cast<float>(col_sum[j] / static_cast<double>(rows));
    c[j] = s.beta2t * c[j] + s.one_minus_beta2t * mean;
    col_factor[j] = Rsqrt(c[j]);
  }
  const auto mean_r = static_cast<float>(sum_r / static_cast<double>(rows));
  for (int64_t i = 0; i < rows; ++i) row_factor[i] = Rsqrt(r[i] / mean_r);
  auto update_at = [&](int64_t i, int64_t j) {
    return (row_factor[i] * col_factor[j]) * g_at(i * cols + j);
  };
  const double sum_u = Pairwise(0, tiling.num_tiles(), [&](int64_t k) {
    const internal::AdafactorTile t = internal::AdafactorTileAt(tiling, k);
    double acc[kAdafactorLanes] = {};
    for (int64_t i = t.row_begin; i < t.row_end; ++i) {
      for (int64_t j = t.col_begin; j < t.col_end; ++j) {
        const double y = update_at(i, j);
        acc[(j - t.col_begin) % kAdafactorLanes] += y * y;
      }
    }
    return CombineLanes(acc, 0, kAdafactorLanes);
  });
  s.step_size = internal::AdafactorStepSize(config, lr, sum_u, n);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j)
      Apply(s, master, state, copy_out, i * cols + j, update_at(i, j));
  }
  return Status::Ok();
}

}  // namespace strata::cpu_optim
