// The fused LM head: logits x W and the cross-entropy against the next tokens, forward and
// backward, in chunks of rows, so that the (N, V) logits never exist.
//
// x is the ALREADY NORMALISED activation (B T rows of C); w is the (C, V) output matrix for
// WeightLayout::kInOut or (V, C) for kOutIn (a tied token embedding, or nn.Linear's
// lm_head.weight).
//
// Storage and rounding: S in {float, double, Bf16, Fp16}. In chunks of R = chunk rows (row
// order; R = HeadChunkRows(N, V) unless given): logits = S(x W) (fp32 accumulation) in an
// (R, V) chunk buffer; each row's loss in fp32 from the S logits; the mean over N tokens summed
// in double in token order. The (B, V) logits of the last position of each sequence are their
// own product: S(x[b, T-1] W). Backward, per chunk: dlogits = S(dloss / N (softmax - onehot))
// in place in the chunk buffer; dx rows = S(dlogits W^T) (each row from its own dlogits row,
// as unchunked); x^T dlogits added into an fp32 accumulator of w's shape (fp32 GEMM, beta = 1;
// for S = float or double the accumulator is dw itself), rounded once at the end: dw = S(sum
// over chunks in chunk order). The accumulator, 4 C V bytes, is smaller than the (N, V) logits
// in S whenever N > 2 C. Results depend on the chunking only through that fp32 sum order.
//
// Ignored targets: a target of -1 (engine::kIgnoreTarget) is a row the loss does not count: its
// loss is 0 and its dlogits row 0. The mean is then over loss_tokens (the number of counted
// targets, which the caller knows from the data: B T when none is ignored) instead of N, and
// the backward scales by dloss / loss_tokens.
//
// Per-row losses and weights (sequence objectives, preference training: engine::BlockBuffers::
// target_losses and target_weights). row_losses (N) fp32, nullable: the forward writes each row's
// cross-entropy there, the same ComputeType<S> value the mean sums (fp32 for float and the 16-bit
// types; for S = double its rounding to fp32), 0 for an ignored row. row_weights (N) fp32,
// nullable: the backward's objective is sum_t w_t CE_t instead of the mean, loss_tokens is not
// read, and each counted row's dlogits are S(scale_t (softmax - onehot)) with scale_t = dloss w_t
// rounded to ComputeType<S> once, in place of the mean's scale dloss / N (soft-capped: times
// 1 - u^2 as below); ignored rows stay 0, whatever their weight. Weights may be zero or negative.
// Without them the results are bit-identical to the op before the parameters.
//
// Final-logit soft-capping (Gemma 2's final_logit_softcapping; softcap c > 0, 0 = none): every
// logit the head produces (the chunks and last_logits) is S(c tanh(l / c)) of the product's
// S logit l, u = tanh(l / c) in ComputeType<S>; the loss is the cross-entropy of those capped
// logits, and the backward multiplies each dlogit by 1 - u^2 (u recomputed from l, not from the
// rounded capped value) before rounding it to S: dlogits = S(dloss / N (softmax - onehot)
// (1 - u^2)). Without it the results are bit-identical to the op before the parameter.
//
// Deterministic (bit-identical across runs and thread counts), reentrant, oneTBB loops inside.
// Targets are int32 in [0, V) or -1 (STRATA_CHECK).
#pragma once

#include <algorithm>
#include <cstdint>

#include "base/dtype.h"
#include "models/ops/matmul.h"

namespace strata::models::ops {

// R = HeadChunkRows(N, V) is the largest R <= N with R V <= kHeadChunkElems (2^22 elements:
// 8 MiB in bf16, 16 MiB in fp32; 83 rows at V = 50257, so that each chunk's product has more
// than a handful of rows), and at least 1. A function of (N, V) only, so the chunking, and with
// it every result, is fixed for a given problem. Inline: the CUDA layout is header-only.
inline constexpr int64_t kHeadChunkElems = int64_t{1} << 22;
constexpr int64_t HeadChunkRows(int64_t N, int64_t V) {
  return std::clamp<int64_t>(kHeadChunkElems / std::max<int64_t>(V, 1), 1, std::max<int64_t>(N, 1));
}

// Scratch in bytes for storage type S, N = B T, R = chunk_rows (0: HeadChunkRows(N, V); else in
// [1, N], STRATA_CHECK), F = ComputeType<S>, each part 64-byte aligned from the scratch's start
// (which must be aligned to alignof(F)): losses (N) F; the logits chunk (R, V) S; the dw
// accumulator C V fp32 for 16-bit S (none for float and double). Pure.
template <typename S>
int64_t LmHeadScratchBytes(int B, int T, int C, int V, int64_t chunk_rows = 0);

// Returns the mean cross-entropy over the loss_tokens counted tokens (summed in double in token
// order; loss_tokens 0: B T; 0 when every target is ignored) or 0 when targets is null (then
// no chunk is computed); last_logits (B, V) = S(x[b, T-1] W), the logits
// of position T-1 of each sequence. x (B T, C); targets (B, T) int32 or null. scratch:
// LmHeadScratchBytes with the same chunk_rows, contents undefined after.
// row_losses (B T) fp32 or null: each row's loss (see above), written when targets is not null.
template <typename S>
ComputeType<S> LmHeadForward(const S* x, const S* w, WeightLayout layout, const int32_t* targets,
                             int B, int T, int C, int V, S* last_logits, void* scratch,
                             int64_t chunk_rows = 0, int64_t loss_tokens = 0, double softcap = 0,
                             float* row_losses = nullptr);

// Gradient of dloss * mean cross-entropy (over loss_tokens counted tokens; 0: B T), or with
// row_weights ((B T) fp32) of dloss * sum_t row_weights[t] CE_t: dx (B T, C) and dw (the layout
// of w; nullable: not computed, a frozen weight) OVERWRITTEN. targets must not be null. No logits
// are written. dx must not overlap x.
template <typename S>
void LmHeadBackward(const S* x, const S* w, WeightLayout layout, const int32_t* targets,
                    ComputeType<S> dloss, int B, int T, int C, int V, S* dx, S* dw, void* scratch,
                    int64_t chunk_rows = 0, int64_t loss_tokens = 0, double softcap = 0,
                    const float* row_weights = nullptr);

}  // namespace strata::models::ops
