// The elementwise sum of two activations: Gemma 2/3's residual add of a normalised sublayer
// output (Hugging Face transformers modeling_gemma3.py, Gemma3DecoderLayer: hidden = residual +
// post_attention_layernorm(attn_out), the same after the MLP), which the Llama family instead
// fuses into the product's residual epilogue. With the norm's own rounding that is two roundings
// to the storage type, as in transformers.
//
// Storage and rounding (models/gpt_kernels.h): S in {float, double, Bf16, Fp16}; out = S(a + b)
// with the sum in ComputeType<S> (fp32; double for the reference) from the stored values, one
// rounding. The backward needs no op: both inputs' gradients are the output's.
//
// Host memory; sizes in elements. Deterministic (each element on its own), reentrant, parallel
// with oneTBB. n >= 0 (STRATA_CHECK).
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// a, b: (n); out: (n) OVERWRITTEN. out may equal a or b (the same pointer: in place on either
// operand); any other overlap is not allowed.
template <typename S>
void AddForward(const S* a, const S* b, int64_t n, S* out);

}  // namespace strata::models::ops
