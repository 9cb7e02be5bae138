// RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019) over the last
// dimension of a row-major (rows, C) activation, with Hugging Face LlamaRMSNorm's fp32 math:
//   rstd = 1 / sqrt(mean over c of x^2 + eps),  y = x * rstd * w.
// With unit_offset the multiplier is (1 + w) instead of w, added in ComputeType<S> (Gemma 2/3,
// Hugging Face Gemma3RMSNorm: x.float() rsqrt(mean(x^2) + eps) (1.0 + w.float()), one rounding
// to the input dtype at the end, the rounding point Strata keeps for every RMSNorm): w below
// becomes (1 + w) in y and in g = dy (1 + w); dw is unchanged (d(1 + w)/dw = 1).
// unit_offset false computes bit for bit what the op computed before the option existed.
//
// Storage and rounding (models/gpt_kernels.h, "Storage and rounding"): templates on the storage
// type S in {float, double, Bf16, Fp16}; x, w, y, dy, dx, dw are S; the arithmetic is in
// ComputeType<S> (fp32; double for the reference); rstd is kept in ComputeType<S> and never
// rounded. The rounding points, one rounding of a ComputeType value each:
//   forward    y = S(x * rstd * w)   (Hugging Face rounds x * rstd to the input dtype before
//                                     the weight; here the one rounding is the output's)
//   backward   dx = S(dresidual + RMS'(dy)) with RMS'(dy) = rstd (g - xhat mean(g xhat)),
//              g = dy w, xhat = x rstd;  dw = S(column sums of dy xhat, rows in order)
//
// Deterministic (bit-identical across runs and thread counts); reentrant; parallel with oneTBB.
// rows >= 0, C >= 1 (STRATA_CHECK).
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// x: (rows, C); w: (C), the multiplier (w, or 1 + w with unit_offset); y: (rows, C) OVERWRITTEN;
// rstd: (rows) ComputeType<S> OVERWRITTEN, kept for the backward. eps > 0 (rms_norm_eps). y must
// not overlap x.
template <typename S>
void RmsNormForward(const S* x, const S* w, double eps, int64_t rows, int64_t C, S* y,
                    ComputeType<S>* rstd, bool unit_offset = false);

// x, w, rstd as given to (or written by) the forward; dy: (rows, C) the gradient of y;
// dresidual: (rows, C) or nullptr, added to the input gradient before its one rounding (the
// residual stream's gradient). dx: (rows, C) OVERWRITTEN; dw: (C) OVERWRITTEN, or nullptr (not
// computed). dw is computed before dx is written, and dx row by row reads each row before it
// writes it, so dx may alias dy or dresidual (not x). unit_offset as given to the forward.
template <typename S>
void RmsNormBackward(const S* x, const S* w, const ComputeType<S>* rstd, const S* dy,
                     const S* dresidual, int64_t rows, int64_t C, S* dx, S* dw,
                     bool unit_offset = false);

}  // namespace strata::models::ops
