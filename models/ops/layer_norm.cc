#include "models/ops/layer_norm.h"

#include <cmath>

#include "models/ops/parallel.h"

namespace strata::models::ops {
namespace {

// dw = S(sum_r dy * xhat), db = S(sum_r dy), xhat = (x - mean) * rstd; rows in order.
template <typename S>
void LayerNormParamGrads(const S* x, const S* dy, const ComputeType<S>* mean,
                         const ComputeType<S>* rstd, int64_t rows, int64_t C, S* dw, S* db) {
  using F = ComputeType<S>;
  ParallelColumnBlocks(C, [&](int64_t c0, int64_t c1) {
    F acc_w[kColBlock] = {};
    F acc_b[kColBlock] = {};
    const int64_t w = c1 - c0;
    for (int64_t r = 0; r < rows; ++r) {
      const S* xr = x + r * C + c0;
      const S* dr = dy + r * C + c0;
      const F m = mean[r], s = rstd[r];
      for (int64_t j = 0; j < w; ++j) {
        const F d = ToFloat(dr[j]);
        acc_w[j] += d * ((ToFloat(xr[j]) - m) * s);
        acc_b[j] += d;
      }
    }
    for (int64_t j = 0; j < w; ++j) {
      if (dw != nullptr) dw[c0 + j] = FromFloat<S>(acc_w[j]);
      if (db != nullptr) db[c0 + j] = FromFloat<S>(acc_b[j]);
    }
  });
}

// dx = S((residual ? residual : 0) + LayerNorm input gradient), in ComputeType:
//   g = dy * w;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// Row-local and element-by-element read-before-write, so dx may equal dy or residual.
template <typename S>
void LayerNormInputGrad(const S* x, const S* w, const S* dy, const ComputeType<S>* mean,
                        const ComputeType<S>* rstd, const S* residual, int64_t rows, int64_t C,
                        S* dx) {
  using F = ComputeType<S>;
  ParallelRows(rows, 2 * C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* xr = x + r * C;
      const S* dr = dy + r * C;
      const F m = mean[r], s = rstd[r];
      F g_mean = 0, gx_mean = 0;
      for (int64_t c = 0; c < C; ++c) {
        const F g = ToFloat(dr[c]) * ToFloat(w[c]);
        g_mean += g;
        gx_mean += g * ((ToFloat(xr[c]) - m) * s);
      }
      g_mean /= F(C);
      gx_mean /= F(C);
      S* out = dx + r * C;
      const S* res = residual != nullptr ? residual + r * C : nullptr;
      for (int64_t c = 0; c < C; ++c) {
        const F xhat = (ToFloat(xr[c]) - m) * s;
        F v = s * (ToFloat(dr[c]) * ToFloat(w[c]) - g_mean - xhat * gx_mean);
        if (res != nullptr) v = ToFloat(res[c]) + v;
        out[c] = FromFloat<S>(v);
      }
    }
  });
}

}  // namespace

template <typename S>
void LayerNormForward(const S* x, const S* w, const S* b, double eps, int64_t rows, int64_t C, S* y,
                      ComputeType<S>* mean, ComputeType<S>* rstd) {
  using F = ComputeType<S>;
  const F eps_f = static_cast<F>(eps);
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* xr = x + r * C;
      F sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += ToFloat(xr[c]);
      const F m = sum / F(C);
      F var = 0;
      for (int64_t c = 0; c < C; ++c) var += (ToFloat(xr[c]) - m) * (ToFloat(xr[c]) - m);
      var /= F(C);
      const F s = F(1) / std::sqrt(var + eps_f);
      mean[r] = m;
      rstd[r] = s;
      S* yr = y + r * C;
      for (int64_t c = 0; c < C; ++c) {
        yr[c] = FromFloat<S>((ToFloat(xr[c]) - m) * s * ToFloat(w[c]) + ToFloat(b[c]));
      }
    }
  });
}

template <typename S>
void LayerNormBackward(const S* x, const S* w, const ComputeType<S>* mean,
                       const ComputeType<S>* rstd, const S* dy, const S* dresidual, int64_t rows,
                       int64_t C, S* dx, S* dw, S* db) {
  if (dw != nullptr || db != nullptr) LayerNormParamGrads(x, dy, mean, rstd, rows, C, dw, db);
  LayerNormInputGrad(x, w, dy, mean, rstd, dresidual, rows, C, dx);
}

#define STRATA_INSTANTIATE_LAYER_NORM(S)                                                          \
  template void LayerNormForward<S>(const S*, const S*, const S*, double, int64_t, int64_t, S*,   \
                                    ComputeType<S>*, ComputeType<S>*);                            \
  template void LayerNormBackward<S>(const S*, const S*, const ComputeType<S>*,                   \
                                     const ComputeType<S>*, const S*, const S*, int64_t, int64_t, \
                                     S*, S*, S*);

STRATA_INSTANTIATE_LAYER_NORM(float)
STRATA_INSTANTIATE_LAYER_NORM(double)
STRATA_INSTANTIATE_LAYER_NORM(Bf16)
STRATA_INSTANTIATE_LAYER_NORM(Fp16)

#undef STRATA_INSTANTIATE_LAYER_NORM

}  // namespace strata::models::ops
