// Causal self-attention (Vaswani et al., "Attention Is All You Need", 2017) with
// grouped-query attention (Ainslie et al., "GQA", 2023: query head h reads kv head
// h / (H / Hkv), as Hugging Face's repeat_kv) and the storage and rounding of FlashAttention-2
// (Dao, 2023). Scores scale q k^T with scale 1 / sqrt(head_dim), or AttentionDims::scale where
// given (Gemma's query_pre_attn_scalar^-0.5). Optionally packed sequences and a sliding window
// (AttentionDims::position_ids, AttentionDims::window): each bounds a query's first key.
//
// Storage and rounding: S in {float, double, Bf16, Fp16}. Scores and softmax in ComputeType<S>
// (row max and log-sum-exp kept in fp32, never rounded to S). Forward, FlashAttention-2's online
// softmax (Dao, 2023, Algorithm 1) with its rounding points: the keys in tiles of
// kAttentionKeyTile; the probabilities of a tile's keys exp(s - m) with m the row's running max
// (the max of the scores it sees in that tile and the ones before), rounded to S before their
// product with V; the products rescaled to the row's final max and divided by its sum in fp32,
// the output rounded once. For S = float and double nothing is rounded there and the op computes
// exp(s - lse) directly (the same values up to fp32 / fp64 rounding). Backward:
// D = rowsum(dO * O) in fp32; probabilities recomputed from q, k and the log-sum-exp (the
// forward's scores bit for bit); dS = P (dP - D) rounded to S before its products; dq, dk, dv
// accumulated in fp32 and rounded once each (dk, dv summed over the query heads of their group
// in head order before that rounding).
//
// Strided rows: q, k and v (and dq, dk, dv) are rows of row_stride elements, so they may be
// column blocks of one fused projection output (the GPT's qkv (B, T, 3C): q = qkv, k = qkv + C,
// v = qkv + 2C, row_stride 3C). Head h of q uses columns h hs .. (h + 1) hs of its row.
//
// Work: one task per (sequence, kv head) ((sequence, head) in the forward), per-thread compute
// tiles grown once; no T x T buffer. Deterministic (bit-identical across runs and thread
// counts), reentrant, oneTBB loops inside.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// The key tile of the forward's online softmax: tile i holds keys [64 i, 64 i + 64) of the
// sequence row (positions in the row, also for packed sequences), and within query row t the
// probabilities of tile i's keys are rounded to S as exp(s - m_i), m_i the max of the scores row
// t sees in tiles 0..i. Where the tiles fall is a rounding point: every backend uses this one
// (the host op, and the CUDA kernels, attention_tiles.h and attention.cu), so that they round
// where each other round. One pass over the keys, as FlashAttention-2's forward.
inline constexpr int kAttentionKeyTile = 64;

struct AttentionDims {
  int batch_size, seq_len, num_heads, num_kv_heads, head_dim;
  int64_t row_stride;  // elements between consecutive token rows of q, k, v (and dq, dk, dv)
  // (B, T) int32 or null (memory of the op's backend): packed sequences. Query t of row b attends
  // to keys t - position_ids[b, t] .. t only (block-diagonal causal attention; position_ids
  // restarts at 0 where an example starts, see engine::BlockBuffers). Null: keys 0 .. t.
  const int32_t* position_ids = nullptr;
  // Sliding-window attention (Beltagy et al., "Longformer", 2020, as Mistral, Qwen2 and Phi-3
  // use it): 0 = no window (the bound above alone); w >= 1: query t sees key j only when
  // t - w < j <= t, so with position_ids its first key is max(t - position_ids[b, t], t - w + 1)
  // (the mask of Hugging Face's create_sliding_window_causal_mask). A window of T or more masks
  // nothing more (results bit-identical to 0). Negative: rejected.
  int window = 0;
  // The scores' scale: scores = scale q k^T, forward and backward (Gemma's
  // query_pre_attn_scalar^-0.5). 0 = 1 / sqrt(head_dim) computed in ComputeType<S> (fp32 on
  // CUDA), the default, bit-identical to the op before this field. Otherwise rounded once to
  // ComputeType<S> (fp32 on CUDA): 1 / sqrt(head_dim) given here equals 0 bit for bit wherever
  // its rounding to fp32 is the fp32 quotient 1.0f / sqrtf(head_dim) (head_dim 1 .. 5, 8, 64,
  // 128, 256, ...; not 6 or 7), and always for double. Must be finite and >= 0 (else rejected).
  double scale = 0;
  // Attention logit soft-capping (Gemma 2; Gemma Team, "Gemma 2", 2024): each scaled score s
  // becomes softcap tanh(s / softcap) before the mask and the softmax (transformers'
  // eager_attention_forward with attn_logit_softcapping), and the backward multiplies the
  // score gradient by the derivative 1 - tanh^2(s / softcap) before the scale. Computed in
  // ComputeType<S> (fp32 on CUDA); 0 = none, the default (results bit-identical to the op before
  // this field). Must be finite and >= 0 (else rejected).
  double softcap = 0;
  // window, scale and softcap are last in the struct, so the aggregate initialisations {B, T, H,
  // Hkv, hs, row_stride, position_ids} keep their meaning.
};

// q: (B, T, H, hs) rows of row_stride; k, v: (B, T, Hkv, hs) rows of row_stride;
// out: (B, T, H hs) contiguous; lse: (B, H, T) ComputeType<S> (log-sum-exp, kept for backward).
// Requirements (STRATA_CHECK): all dims >= 1, H % Hkv == 0, row_stride >= H hs, window >= 0,
// scale and softcap finite and >= 0. out must not overlap q, k or v.
template <typename S>
void AttentionForward(const AttentionDims& d, const S* q, const S* k, const S* v, S* out,
                      ComputeType<S>* lse);

// dq, dk, dv OVERWRITTEN (same strides as q, k, v; dk/dv summed in fp32 over the query heads of
// their group, rounded once); out and lse from AttentionForward on the same q, k, v; dout
// (B, T, H hs) contiguous. dq, dk, dv may be column blocks of one buffer (the columns each
// writes are disjoint); they must not overlap the inputs.
template <typename S>
void AttentionBackward(const AttentionDims& d, const S* q, const S* k, const S* v, const S* out,
                       const S* dout, const ComputeType<S>* lse, S* dq, S* dk, S* dv);

}  // namespace strata::models::ops
