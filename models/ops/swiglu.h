// The SwiGLU gate (Shazeer, "GLU Variants Improve Transformer", 2020) of Llama's MLP:
// h = silu(gate) * up, silu(g) = g sigmoid(g) (Elfwing et al., 2018), on the output of the fused
// gate/up projection: a (rows, 2I) buffer holding [gate (I) | up (I)] in each row.
//
// Storage and rounding (models/gpt_kernels.h): S in {float, double, Bf16, Fp16}; arithmetic in
// ComputeType<S>; one rounding per output:
//   forward    h = S(silu(g) u)
//   backward   dg = S(dh u silu'(g)), silu'(g) = sig(g) (1 + g (1 - sig(g)));  du = S(dh silu(g))
// The exponential goes through the fixed-width vector path of models/ops/parallel.h for every
// element, so results do not depend on where a range is split.
//
// Deterministic, reentrant, parallel with oneTBB.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// gate_up: (rows, 2I); h: (rows, I) OVERWRITTEN, must not overlap gate_up.
template <typename S>
void SwigluForward(const S* gate_up, int64_t rows, int64_t I, S* h);

// gate_up as given to the forward; dh: (rows, I); dgate_up: (rows, 2I) OVERWRITTEN with
// [dgate | dup]. dgate_up may alias gate_up (each element pair is read before it is written);
// dh must not overlap either.
template <typename S>
void SwigluBackward(const S* gate_up, const S* dh, int64_t rows, int64_t I, S* dgate_up);

}  // namespace strata::models::ops
