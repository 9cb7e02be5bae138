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
};

// inv_freq (head_dim / 2), in double. STRATA_CHECKs head_dim even and positive.
std::vector<double> RopeInverseFrequencies(const RopeParams& p);

// cos, sin: (seq_len, head_dim / 2), OVERWRITTEN: cos(t inv_freq[i]), sin(t inv_freq[i]) for
// positions t in [0, seq_len), evaluated in double and rounded once to F (float or double).
template <typename F>
void RopeTable(const RopeParams& p, int seq_len, F* cos, F* sin);

// Rotates, in place, num_heads consecutive heads of head_dim columns starting at column 0 of x,
// in each of `rows` rows of row_stride elements; row r is position t = position_ids[r] when
// position_ids ((rows) int32, packed sequences: each in [0, seq_len)) is given, else r % seq_len
// (rows are (B, T) token rows). cos, sin: the table of RopeTable<ComputeType<S>> for at least
// seq_len positions. The q and k column blocks of a fused [q | k | v] projection are consecutive,
// so one call with num_heads = H + Hkv rotates both. row_stride >= num_heads * head_dim.
template <typename S>
void RopeForward(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                 const ComputeType<S>* cos, const ComputeType<S>* sin,
                 const int32_t* position_ids = nullptr);

// The gradient through RopeForward, in place on dx (same layout): dx <- R(t)^T dx.
template <typename S>
void RopeBackward(S* dx, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                  const ComputeType<S>* cos, const ComputeType<S>* sin,
                  const int32_t* position_ids = nullptr);

}  // namespace strata::models::ops
