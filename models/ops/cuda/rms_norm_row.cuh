// Internal to models/ops/cuda/ (.cu files only): the RMSNorm of ONE row by one warp, forward and
// backward, and the ordered second pass of the weight gradients' two-pass column sums. The RMSNorm
// kernels (rms_norm.cu) run the row functions on every row of an activation, the per-head
// RMSNorm kernels (head_rms_norm.cu) on every q and k head, so both round at the points of
// ops.cuh / ops/rms_norm.h in the same way: arithmetic in fp32 from the stored values, one
// rounding per output.
//
// Lane mapping: lane l of the warp handles the elements c = l, l + 32, ... of the row in every
// loop, so an element a lane wrote before the call is read back by that same lane.
#pragma once

#include <cstdint>

#include "models/ops/cuda/common.cuh"

namespace strata::models::ops::cuda::internal {

// The multiplier of column c in fp32: w[c], or 1 + w[c] with unit_offset (Gemma's (1 + w), added
// in fp32, not rounded to D). With unit_offset false it is ToF(w[c]) itself, so the row functions
// compute what they computed before the option existed, bit for bit.
template <typename D>
__device__ __forceinline__ float RmsNormGain(const D* w, int64_t c, bool unit_offset) {
  const float v = ToF(w[c]);
  return unit_offset ? 1.0f + v : v;
}

// y (C) = D((x rstd) g), g = RmsNormGain (w or 1 + w), rstd = 1 / sqrt(fp32 sum of x^2 / C + eps)
// (lanes' sums, then the warp's xor-shuffle sum); returns rstd on every lane. All 32 lanes must
// call. y must not overlap x.
template <typename D>
__device__ __forceinline__ float RmsNormWarpRowForward(const D* x, const D* w, float eps, int64_t C,
                                                       D* y, int lane, bool unit_offset) {
  float sum_sq = 0.0f;
  for (int64_t c = lane; c < C; c += kWarp) {
    const float v = ToF(x[c]);
    sum_sq += v * v;
  }
  sum_sq = WarpSum(sum_sq);
  const float s = 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
  for (int64_t c = lane; c < C; c += kWarp) {
    y[c] = FromF<D>((ToF(x[c]) * s) * RmsNormGain(w, c, unit_offset));
  }
  return s;
}

// dx (C) = D(dres + s (g - xhat mean(g xhat))), g = dy RmsNormGain (w or 1 + w), xhat = x s, dres
// (C) or null (0). All 32 lanes must call. Every lane has read its dy elements before any lane
// writes (the warp sum is a barrier for the dy reads), and dx[c] is written by the lane that reads
// dy[c] and dres[c]: dx may equal dy or dres (not x).
template <typename D>
__device__ __forceinline__ void RmsNormWarpRowBackward(const D* x, const D* w, float s, const D* dy,
                                                       const D* dres, int64_t C, D* dx, int lane,
                                                       bool unit_offset) {
  float gx = 0.0f;
  for (int64_t c = lane; c < C; c += kWarp) {
    gx += ToF(dy[c]) * RmsNormGain(w, c, unit_offset) * (ToF(x[c]) * s);
  }
  const float gx_mean = WarpSum(gx) / static_cast<float>(C);
  for (int64_t c = lane; c < C; c += kWarp) {
    const float xhat = ToF(x[c]) * s;
    float v = s * (ToF(dy[c]) * RmsNormGain(w, c, unit_offset) - xhat * gx_mean);
    if (dres != nullptr) v = ToF(dres[c]) + v;
    dx[c] = FromF<D>(v);
  }
}

// Pass 2 of a two-pass column sum: out[c] = D(sum over p in order of partials[p, c]), partials
// (num_partials, C) fp32; 0 when num_partials is 0.
template <typename D>
__global__ void SumPartialsKernel(const float* partials, int64_t num_partials, int64_t C, D* out) {
  STRATA_FOR_EACH_INDEX(c, C) {
    float acc = 0.0f;
    for (int64_t p = 0; p < num_partials; ++p) acc += partials[p * C + c];
    out[c] = FromF<D>(acc);
  }
}

}  // namespace strata::models::ops::cuda::internal
