// Internal to models/ops/: the RMSNorm of ONE row, forward and backward, with the rounding points
// of models/ops/rms_norm.h. RmsNormForward/RmsNormBackward (rms_norm.cc) run it on every row of
// an activation, HeadRmsNormForward/HeadRmsNormBackward (head_rms_norm.cc) on every head of the
// q and k columns, so the two ops round identically: a head normalised by one is bit for bit the
// row normalised by the other. Header-only; scalar, no threads, no allocation.
#pragma once

#include <cmath>
#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// The multiplier of column c in ComputeType<S>: w[c], or 1 + w[c] with unit_offset (Gemma's
// (1 + w), added in F, not rounded to S). With unit_offset false it is ToFloat(w[c]) itself, so
// the row functions compute what they computed before the option existed, bit for bit.
template <typename S>
ComputeType<S> RmsNormGain(const S* w, int64_t c, bool unit_offset) {
  using F = ComputeType<S>;
  const F v = ToFloat(w[c]);
  return unit_offset ? F(1) + v : v;
}

// y (C) = S((x rstd) g), g = RmsNormGain (w or 1 + w), rstd = 1 / sqrt(fp32 sum over c of x^2 (in
// order) / C + eps); returns rstd (ComputeType<S>, not rounded). x, w, y: (C) S. y must not overlap
// x.
template <typename S>
ComputeType<S> RmsNormRowForward(const S* x, const S* w, double eps, int64_t C, S* y,
                                 bool unit_offset) {
  using F = ComputeType<S>;
  F sum_sq = 0;
  for (int64_t c = 0; c < C; ++c) {
    const F v = ToFloat(x[c]);
    sum_sq += v * v;
  }
  const F s = F(1) / std::sqrt(sum_sq / F(C) + F(eps));
  for (int64_t c = 0; c < C; ++c) {
    y[c] = FromFloat<S>((ToFloat(x[c]) * s) * RmsNormGain(w, c, unit_offset));
  }
  return s;
}

// dx (C) = S(dres + s (g - xhat mean(g xhat))), g = dy RmsNormGain (w or 1 + w), xhat = x s, with
// dres (C) or nullptr (0). x, w, dy as given to the forward; s its rstd. Every dy element is read
// (the mean) before the first dx element is written, and dx[c] after dy[c] and dres[c]: dx may
// equal dy or dres (not x).
template <typename S>
void RmsNormRowBackward(const S* x, const S* w, ComputeType<S> s, const S* dy, const S* dres,
                        int64_t C, S* dx, bool unit_offset) {
  using F = ComputeType<S>;
  F gx_mean = 0;
  for (int64_t c = 0; c < C; ++c) {
    gx_mean += ToFloat(dy[c]) * RmsNormGain(w, c, unit_offset) * (ToFloat(x[c]) * s);
  }
  gx_mean /= F(C);
  for (int64_t c = 0; c < C; ++c) {
    const F xhat = ToFloat(x[c]) * s;
    F v = s * (ToFloat(dy[c]) * RmsNormGain(w, c, unit_offset) - xhat * gx_mean);
    if (dres != nullptr) v = ToFloat(dres[c]) + v;
    dx[c] = FromFloat<S>(v);
  }
}

}  // namespace strata::models::ops
