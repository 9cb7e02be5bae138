#include "models/ops/rms_norm.h"

#include "base/status.h"
#include "models/ops/parallel.h"
#include "models/ops/rms_norm_row.h"

namespace strata::models::ops {

template <typename S>
void RmsNormForward(const S* x, const S* w, double eps, int64_t rows, int64_t C, S* y,
                    ComputeType<S>* rstd, bool unit_offset) {
  STRATA_CHECK(rows >= 0 && C >= 1);
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rstd[r] = RmsNormRowForward(x + r * C, w, eps, C, y + r * C, unit_offset);
    }
  });
}

template <typename S>
void RmsNormBackward(const S* x, const S* w, const ComputeType<S>* rstd, const S* dy,
                     const S* dresidual, int64_t rows, int64_t C, S* dx, S* dw, bool unit_offset) {
  using F = ComputeType<S>;
  STRATA_CHECK(rows >= 0 && C >= 1);
  if (dw != nullptr) {
    // dw[c] = sum over rows (in order) of dy xhat (with unit_offset too: d(1 + w)/dw = 1).
    ParallelColumnBlocks(C, [&](int64_t c0, int64_t c1) {
      F acc[kColBlock] = {};
      const int64_t width = c1 - c0;
      for (int64_t r = 0; r < rows; ++r) {
        const S* xr = x + r * C + c0;
        const S* dr = dy + r * C + c0;
        const F s = rstd[r];
        for (int64_t j = 0; j < width; ++j) acc[j] += ToFloat(dr[j]) * (ToFloat(xr[j]) * s);
      }
      for (int64_t j = 0; j < width; ++j) dw[c0 + j] = FromFloat<S>(acc[j]);
    });
  }
  ParallelRows(rows, 2 * C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      RmsNormRowBackward(x + r * C, w, rstd[r], dy + r * C,
                         dresidual != nullptr ? dresidual + r * C : nullptr, C, dx + r * C,
                         unit_offset);
    }
  });
}

#define STRATA_INSTANTIATE_RMS_NORM(S)                                                            \
  template void RmsNormForward<S>(const S*, const S*, double, int64_t, int64_t, S*,               \
                                  ComputeType<S>*, bool);                                         \
  template void RmsNormBackward<S>(const S*, const S*, const ComputeType<S>*, const S*, const S*, \
                                   int64_t, int64_t, S*, S*, bool);
STRATA_INSTANTIATE_RMS_NORM(float)
STRATA_INSTANTIATE_RMS_NORM(double)
STRATA_INSTANTIATE_RMS_NORM(Bf16)
STRATA_INSTANTIATE_RMS_NORM(Fp16)
#undef STRATA_INSTANTIATE_RMS_NORM

}  // namespace strata::models::ops
