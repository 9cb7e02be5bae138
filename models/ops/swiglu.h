// The gated MLP activations on the output of the fused gate/up projection, a (rows, 2I) buffer
// holding [gate (I) | up (I)] in each row: h = act(gate) * up (Shazeer, "GLU Variants Improve
// Transformer", 2020), with act one of
//   kSilu      SwiGLU, Llama's MLP: silu(g) = g sigmoid(g) (Elfwing et al., 2018)
//   kGeluTanh  GeGLU, Gemma's MLP (gelu_pytorch_tanh): gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi)
//              (g + 0.044715 g^3))) (Hendrycks & Gimpel, 2016), the code of models/ops/gelu.h
//
// Storage and rounding (models/gpt_kernels.h): S in {float, double, Bf16, Fp16}; arithmetic in
// ComputeType<S>; one rounding per output:
//   forward    h = S(act(g) u)
//   backward   dg = S(dh u act'(g)), du = S(dh act(g));
//              silu'(g) = sig(g) (1 + g (1 - sig(g))), gelu'(g) as models/ops/gelu.h GeluBackward
// The exponential and tanh go through the fixed-width vector path of models/ops/parallel.h for
// every element, so results do not depend on where a range is split. kSilu computes what the op
// computed before the activation became a parameter, bit for bit.
//
// Deterministic, reentrant, parallel with oneTBB.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// The gate's activation of the gated MLP (above). Host and CUDA ops take it last, default kSilu.
enum class GatedActivation { kSilu, kGeluTanh };

// gate_up: (rows, 2I); h: (rows, I) OVERWRITTEN, must not overlap gate_up.
template <typename S>
void SwigluForward(const S* gate_up, int64_t rows, int64_t I, S* h,
                   GatedActivation act = GatedActivation::kSilu);

// gate_up as given to the forward; dh: (rows, I); dgate_up: (rows, 2I) OVERWRITTEN with
// [dgate | dup]. dgate_up may alias gate_up (each element pair is read before it is written);
// dh must not overlap either.
template <typename S>
void SwigluBackward(const S* gate_up, const S* dh, int64_t rows, int64_t I, S* dgate_up,
                    GatedActivation act = GatedActivation::kSilu);

}  // namespace strata::models::ops
