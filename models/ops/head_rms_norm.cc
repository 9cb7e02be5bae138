#include "models/ops/head_rms_norm.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <vector>

#include "base/status.h"
#include "models/ops/parallel.h"
#include "models/ops/rms_norm_row.h"

namespace strata::models::ops {
namespace {

void CheckHeadArgs(int64_t ld, int64_t rows, int num_heads, int num_q_heads, int64_t hs) {
  STRATA_CHECK(rows >= 0 && hs >= 1 && num_heads >= 1);
  STRATA_CHECK(num_q_heads >= 0 && num_q_heads <= num_heads);
  STRATA_CHECK(ld >= num_heads * hs);
}

}  // namespace

template <typename S>
void HeadRmsNormForward(S* qk, int64_t ld, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                        const S* w, double eps, S* raw, ComputeType<S>* rstd, bool unit_offset) {
  CheckHeadArgs(ld, rows, num_heads, num_q_heads, hs);
  STRATA_CHECK(eps > 0);
  const int64_t width = num_heads * hs;
  ParallelRows(rows, width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      S* row = qk + r * ld;
      S* raw_row = raw + r * width;
      std::copy(row, row + width, raw_row);
      for (int h = 0; h < num_heads; ++h) {
        const S* wh = h < num_q_heads ? w : w + hs;
        rstd[r * num_heads + h] =
            RmsNormRowForward(raw_row + h * hs, wh, eps, hs, row + h * hs, unit_offset);
      }
    }
  });
}

template <typename S>
void HeadRmsNormBackward(const S* raw, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                         const S* w, const ComputeType<S>* rstd, S* dqk, int64_t ld, S* dw,
                         bool unit_offset) {
  using F = ComputeType<S>;
  CheckHeadArgs(ld, rows, num_heads, num_q_heads, hs);
  const int64_t width = num_heads * hs;
  const int64_t blocks = CeilDiv(rows, kHeadRmsRowsPerBlock);
  // partial[b, part, c]: block b's sum of dy xhat (rows in order, heads in order) for the weight
  // row `part` (0: q, 1: k).
  std::vector<F> partial(dw != nullptr ? static_cast<size_t>(blocks * 2 * hs) : 0, F(0));
  auto run_block = [&](int64_t b) {
    const int64_t r1 = std::min(rows, (b + 1) * kHeadRmsRowsPerBlock);
    for (int64_t r = b * kHeadRmsRowsPerBlock; r < r1; ++r) {
      for (int h = 0; h < num_heads; ++h) {
        const bool is_q = h < num_q_heads;
        const S* x = raw + r * width + h * hs;
        const F s = rstd[r * num_heads + h];
        S* dy = dqk + r * ld + h * hs;
        if (dw != nullptr) {
          F* acc = partial.data() + (b * 2 + (is_q ? 0 : 1)) * hs;
          for (int64_t c = 0; c < hs; ++c) acc[c] += ToFloat(dy[c]) * (ToFloat(x[c]) * s);
        }
        RmsNormRowBackward(x, is_q ? w : w + hs, s, dy, static_cast<const S*>(nullptr), hs, dy,
                           unit_offset);
      }
    }
  };
  if (blocks == 1) {
    run_block(0);
  } else if (blocks > 1) {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1),
                      [&](const tbb::blocked_range<int64_t>& range) {
                        for (int64_t b = range.begin(); b != range.end(); ++b) run_block(b);
                      });
  }
  if (dw == nullptr) return;
  for (int64_t i = 0; i < 2 * hs; ++i) {
    F acc = 0;
    for (int64_t b = 0; b < blocks; ++b) acc += partial[b * 2 * hs + i];
    dw[i] = FromFloat<S>(acc);
  }
}

#define STRATA_INSTANTIATE_HEAD_RMS_NORM(S)                                                      \
  template void HeadRmsNormForward<S>(S*, int64_t, int64_t, int, int, int64_t, const S*, double, \
                                      S*, ComputeType<S>*, bool);                                \
  template void HeadRmsNormBackward<S>(const S*, int64_t, int, int, int64_t, const S*,           \
                                       const ComputeType<S>*, S*, int64_t, S*, bool);
STRATA_INSTANTIATE_HEAD_RMS_NORM(float)
STRATA_INSTANTIATE_HEAD_RMS_NORM(double)
STRATA_INSTANTIATE_HEAD_RMS_NORM(Bf16)
STRATA_INSTANTIATE_HEAD_RMS_NORM(Fp16)
#undef STRATA_INSTANTIATE_HEAD_RMS_NORM

}  // namespace strata::models::ops
