// GELU with the tanh approximation (Hendrycks & Gimpel, "Gaussian Error Linear Units
// (GELUs)", 2016): gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), elementwise, and
// its fusions with the matrix product that feeds it (matmul.h) — the cuBLASLt GELU_AUX and DGELU
// epilogues — which round where a GPU kernel with those epilogues rounds.
//
// Storage and rounding: S in {float, double, Bf16, Fp16} (see matmul.h); arithmetic in
// ComputeType<S>; each output rounded to S once. Every element goes through the same fixed-width
// vector code path, so an element's result never depends on its index or on how a range was
// split. Deterministic, reentrant, oneTBB loops inside; outputs must not overlap inputs unless
// a comment says so.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "models/ops/matmul.h"

namespace strata::models::ops {

// g (n) = S(gelu(h)) elementwise. g may equal h.
template <typename S>
void GeluForward(const S* h, int64_t n, S* g);

// dh (n) = S(dg * gelu'(h)) elementwise. dh may equal dg.
template <typename S>
void GeluBackward(const S* h, const S* dg, int64_t n, S* dh);

// The MLP's first product with its activation (GELU_AUX): with z = in W + bias in fp32
// (MatmulForward's accumulation, bias nullable),
//   pre (rows, out_dim) = S(z)          (the pre-activation the backward reads)
//   g   (rows, out_dim) = S(gelu(z))    (from the fp32 z, not from the rounded pre)
template <typename S>
void MatmulGeluForward(const S* in, const S* w, WeightLayout layout, const S* bias, S* pre, S* g,
                       int64_t rows, int64_t in_dim, int64_t out_dim);

// The backward of out = g W (+ b) with g = gelu(pre) (DGELU): dpre (rows, in_dim) =
// S((dout W^T) * gelu'(pre)) from the fp32 product and the S pre (rows, in_dim); dw and db as
// MatmulBackward (nullable). dpre may equal in (g's buffer: dw and db are computed first).
template <typename S>
void MatmulGeluBackward(const S* in, const S* w, WeightLayout layout, const S* dout, const S* pre,
                        S* dpre, S* dw, S* db, int64_t rows, int64_t in_dim, int64_t out_dim);

}  // namespace strata::models::ops
