// Rotary position embeddings (Su et al., "RoFormer: Enhanced Transformer with Rotary Position
// Embedding", 2021) in Hugging Face's rotate-half convention: within each head of hs = head_dim
// columns, column i < hs/2 pairs with column i + hs/2 and the pair at position t turns by the
// angle t * inv_freq[i]:
//   y[i]        = x[i] cos - x[i + hs/2] sin
//   y[i + hs/2] = x[i + hs/2] cos + x[i] sin
// (x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] and cos = [cos, cos]).
// inv_freq[i] = theta^(-2i/hs), optionally rescaled as Llama 3.1's `rope_type: llama3`
// (transformers modeling_rope_utils._compute_llama3_parameters, from its formula): with
// wavelen = 2 pi / inv_freq, low = original_max_position / low_freq_factor and high =
// original_max_position / high_freq_factor,
//   wavelen < high:          inv_freq unchanged
//   wavelen > low:           inv_freq / factor
//   otherwise (the band):    (1 - s) inv_freq / factor + s inv_freq,
//                            s = (original_max_position / wavelen - low_freq_factor) /
//                                (high_freq_factor - low_freq_factor)
// and no attention scaling (cos and sin are not multiplied).
//
// Two options of Phi-3 and Phi-4 (transformers modeling_rope_utils._compute_longrope_parameters
// and modeling_phi3.apply_rotary_pos_emb):
//   - partial rotary (partial_rotary_factor, Phi-4-mini): only the first rotary_dim columns of
//     each head turn, column i < rotary_dim/2 paired with i + rotary_dim/2, with
//     inv_freq[i] = theta^(-2i/rotary_dim); columns rotary_dim .. hs pass through unchanged.
//   - LongRoPE (Ding et al., "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens",
//     2024; rope_scaling type longrope): inv_freq[i] = 1 / (ext_factors[i] theta^(2i/rotary_dim))
//     with per-frequency factors (the config's short_factor or long_factor), and cos and sin
//     both multiplied by an attention factor (so q k^T by its square).
//
// Storage and rounding (models/gpt_kernels.h): the cos/sin table is evaluated in double and
// rounded once to ComputeType<S> (fp32; double for the reference); the rotation is computed in
// ComputeType<S> from the S inputs and each output rounded once to S. The backward is the
// inverse rotation of the gradient (the rotation is orthogonal), rounded once per output.
//
// Deterministic, reentrant, parallel with oneTBB; in place.
#pragma once

#include <cstdint>
#include <vector>

#include "base/dtype.h"

namespace strata::models::ops {

struct RopeParams {
  int head_dim = 0;  // hs, even
  double theta = 10000.0;
  bool llama3 = false;  // the Llama-3 rescaling below; false = plain theta^(-2i/hs)
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position = 8192;
  // rope_scaling {"rope_type": "linear", "factor": f} (position interpolation, Chen et al.,
  // "Extending Context Window of Large Language Models via Positional Interpolation", 2023; Gemma
  // 3's global layers): every inverse frequency divided by f. 1: none.
  double linear_factor = 1.0;
  // The columns of each head that turn (partial rotary); 0 = all head_dim. Even, <= head_dim.
  int rotary_dim = 0;
  // LongRoPE's per-frequency divisors (rotary_dim / 2 of them, each > 0); empty = none.
  std::vector<double> ext_factors;
  // cos and sin times this (LongRoPE's attention factor); 1 = none.
  double attention_factor = 1.0;
};

// The rotated columns of each head: p.rotary_dim, or p.head_dim when it is 0.
inline int RopeRotaryDim(const RopeParams& p) {
  return p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
}

// inv_freq (rotary_dim / 2), in double. STRATA_CHECKs head_dim and the rotary dim even and
// positive, the rotary dim <= head_dim, and ext_factors empty or one positive factor a frequency.
std::vector<double> RopeInverseFrequencies(const RopeParams& p);

// cos, sin: (seq_len, rotary_dim / 2), OVERWRITTEN: a cos(t inv_freq[i]), a sin(t inv_freq[i])
// with a = p.attention_factor, for positions t in [0, seq_len), evaluated in double and rounded
// once to F (float or double).
template <typename F>
void RopeTable(const RopeParams& p, int seq_len, F* cos, F* sin);

// Rotates, in place, num_heads consecutive heads of head_dim columns starting at column 0 of x,
// in each of `rows` rows of row_stride elements; row r is position t = position_ids[r] when
// position_ids ((rows) int32, packed sequences: each in [0, seq_len)) is given, else r % seq_len
// (rows are (B, T) token rows). cos, sin: the table of RopeTable<ComputeType<S>> for at least
// seq_len positions, with rotary_dim / 2 entries a position. The q and k column blocks of a fused
// [q | k | v] projection are consecutive, so one call with num_heads = H + Hkv rotates both.
// row_stride >= num_heads * head_dim. rotary_dim: the columns of each head that turn (even,
// <= head_dim; 0 = head_dim); the others are not touched.
template <typename S>
void RopeForward(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                 const ComputeType<S>* cos, const ComputeType<S>* sin,
                 const int32_t* position_ids = nullptr, int rotary_dim = 0);

// The gradient through RopeForward, in place on dx (same layout): dx <- R(t)^T dx (with an
// attention factor a, R(t) is a times a rotation and its transpose is what this applies).
template <typename S>
void RopeBackward(S* dx, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                  const ComputeType<S>* cos, const ComputeType<S>* sin,
                  const int32_t* position_ids = nullptr, int rotary_dim = 0);

}  // namespace strata::models::ops
