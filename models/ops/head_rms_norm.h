// Per-head RMSNorm of the queries and keys: Qwen3's q_norm and k_norm (Hugging Face transformers
// models/qwen3/modeling_qwen3.py, Qwen3Attention: q_norm(q_proj(x).view(..., heads, head_dim)),
// the same for k, after the projections and before the rotary embedding), an RMSNorm (Zhang &
// Sennrich 2019) over each head's hs columns with its own (hs) weight, q heads sharing
// q_norm.weight and k heads sharing k_norm.weight.
//
// Layout. The fused projection output qkv (rows, ld), ld >= num_heads hs: each row is
// [q heads (num_q_heads hs) | k heads ((num_heads - num_q_heads) hs) | v heads ... ]. The op
// touches only the first num_heads hs columns of each row (the q and k heads); the v heads and
// any padding up to ld are neither read nor written. For Qwen3: num_heads = H + Hkv,
// num_q_heads = H, ld = (H + 2 Hkv) hs. w: (2, hs) S contiguous, row 0 q_norm.weight (heads h <
// num_q_heads), row 1 k_norm.weight (the others).
//
// Rounding: each head row is normalised by the row function of ops/rms_norm.h
// (ops/rms_norm_row.h), so it rounds where RmsNormForward/RmsNormBackward round and a head's
// result is bit for bit RmsNormForward on that head's hs values with that head's weight:
//   rstd = 1 / sqrt(ComputeType sum of x^2 (in order) / hs + eps), never rounded to S;
//   y = S((x rstd) w), one rounding. (Hugging Face's Qwen3RMSNorm rounds x rstd to the input
//   dtype and multiplies by the weight in that dtype, a second rounding; Strata's RMSNorm keeps
//   one, as for Llama.)
//   dx = S(rstd (g - xhat mean(g xhat))), g = dy w, xhat = x rstd, one rounding;
//   dw[part, c] = S(sum of dy xhat over the part's (row, head) pairs), ComputeType accumulation,
//   one rounding: rows in fixed blocks of kHeadRmsRowsPerBlock, within a block rows in order and
//   heads in order; then the blocks' sums in order. The order depends on the shape only, so dw is
//   bit-identical across runs and thread counts.
//
// unit_offset (Gemma 3's q_norm / k_norm, Hugging Face Gemma3RMSNorm): the multiplier is
// (1 + w), added in F, in place of w, in y and in g = dy (1 + w), as for ops/rms_norm.h's
// unit_offset; dw is unchanged (d(1 + w)/dw = 1). false: bit for bit the op without the option.
//
// S in {float, double, Bf16, Fp16}, F = ComputeType<S> (fp32; double for the reference). Host
// memory; sizes in elements. Reentrant; parallel with oneTBB; no allocation beyond the weight
// gradient's (blocks, 2, hs) F partial sums. Argument errors are broken invariants (STRATA_CHECK):
// rows >= 0, hs >= 1, 0 <= num_q_heads <= num_heads, num_heads >= 1, ld >= num_heads hs, eps > 0.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// Rows per block of the host weight gradient's fixed summation order (see the top).
inline constexpr int64_t kHeadRmsRowsPerBlock = 64;

// qk: (rows, ld) S, IN PLACE: the first num_heads hs columns of each row replaced by their
// per-head RMSNorm; the rest of the row untouched. raw: (rows, num_heads hs) S contiguous,
// OVERWRITTEN with a copy of the pre-norm q and k columns (the backward's input values); rstd:
// (rows num_heads) F OVERWRITTEN, rstd[r num_heads + h] that of head h of row r. w: (2, hs).
// raw and rstd must not overlap qk.
template <typename S>
void HeadRmsNormForward(S* qk, int64_t ld, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                        const S* w, double eps, S* raw, ComputeType<S>* rstd,
                        bool unit_offset = false);

// raw, w, rstd as written by (given to) the forward. dqk: (rows, ld) S, IN PLACE: on entry the
// gradient of the normalised q and k columns, on exit the gradient of the pre-norm columns; the
// rest of each row untouched. dw: (2, hs) S OVERWRITTEN with the weight gradients (row 0 summed
// over every row and q head, row 1 over every row and k head; a part with no heads is 0), or
// nullptr (a frozen weight: not computed). dw is accumulated from dqk's entry values before they
// are overwritten. dqk and dw must not overlap raw, w or rstd. unit_offset as given to the forward.
template <typename S>
void HeadRmsNormBackward(const S* raw, int64_t rows, int num_heads, int num_q_heads, int64_t hs,
                         const S* w, const ComputeType<S>* rstd, S* dqk, int64_t ld, S* dw,
                         bool unit_offset = false);

}  // namespace strata::models::ops
