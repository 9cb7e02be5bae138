// LayerNorm (Ba, Kiros & Hinton, "Layer Normalization", 2016) over the last dimension C of
// (rows, C), forward and backward.
//
// Storage and rounding: S in {float, double, Bf16, Fp16}; statistics (mean, rstd = 1 /
// sqrt(biased variance + eps)) in ComputeType<S> and never rounded to S; y rounded once. The
// backward runs in fp32 from the S inputs: the input gradient adds the residual gradient
// before its one rounding (dx = S(dresidual + LN'(dy))), the parameter gradients are fp32
// column sums, rows in order, rounded once.
//
// Deterministic (bit-identical across runs and thread counts), reentrant, oneTBB loops inside.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// y (rows, C) = S((x - mean) rstd w + b); mean, rstd (rows) ComputeType<S>. eps > 0 is rounded
// to ComputeType<S> once. y may not overlap x.
template <typename S>
void LayerNormForward(const S* x, const S* w, const S* b, double eps, int64_t rows, int64_t C, S* y,
                      ComputeType<S>* mean, ComputeType<S>* rstd);

// With xhat = (x - mean) rstd and g = dy w:
//   dx (rows, C) = S(dresidual + rstd (g - mean_c(g) - xhat mean_c(g xhat)))
//   dw (C) = S(sum_r dy xhat), db (C) = S(sum_r dy)
// dresidual nullable (nothing added); dw and db nullable (not computed); all OVERWRITTEN. dx may
// equal dy or dresidual (the parameter gradients are computed first, and dx row by row, each
// element read before it is written).
template <typename S>
void LayerNormBackward(const S* x, const S* w, const ComputeType<S>* mean,
                       const ComputeType<S>* rstd, const S* dy, const S* dresidual, int64_t rows,
                       int64_t C, S* dx, S* dw, S* db);

}  // namespace strata::models::ops
