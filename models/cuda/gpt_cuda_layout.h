// Host-callable layout of the CUDA layer (models/cuda/gpt_cuda.cu): where its scratch
// regions lie, where each intermediate buffer of a group lives inside the work area, and
// the argument lists of the attention's strided-batched GEMMs. Plain C++ (no CUDA
// headers): gpt_cuda.cu takes every offset, leading dimension and stride from here, and
// tests/models/gpt_cuda_layout_test.cc checks them without a GPU (scratch bounds, buffers
// that are live at the same time do not overlap, and the attention GEMMs run through a
// row-major GEMM emulation reproduce a naive causal attention forward and backward).
//
// All sizes and offsets are in fp32 ELEMENTS. Notation as in models/gpt_kernels.h: C
// channels, H heads, hs = C / H, G = CudaLayerGroupSeqs(B, T) sequences per group,
// R = G T rows; a group of `seqs` <= G sequences has r = seqs T rows. Pure functions,
// thread-safe.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "models/gpt_kernels.h"

namespace strata::models::cuda {

// Sequences per group of the CUDA layer (as the host's: whole sequences, at least 256
// rows per matrix product when B allows): min(B, ceil(256 / T)). B, T >= 1.
inline int64_t CudaLayerGroupSeqs(int B, int T) {
  return std::min<int64_t>(B, std::max<int64_t>(1, (256 + int64_t{T} - 1) / T));
}

// [offset, offset + elems) of a buffer.
struct Region {
  int64_t offset = 0;
  int64_t elems = 0;
  int64_t end() const { return offset + elems; }
};

// The layer scratch, in this order:
//   mean1, rstd1, mean2, rstd2 (R each)   LayerNorm statistics, forward to backward
//   qkv (R, 3C)                           forward to backward
//   probs (G, H, T, T)                    attention probabilities, forward to backward
//   work  max(8 R C, 5 R C + G H T^2)     intermediates (CudaLayerWorkLayout)
// The backward keeps the full T x T probability gradients of a group in the work area
// (the host keeps row blocks of rb = min(T, 64) rows), so the total is never smaller
// than the host's LayerScratchElems.
struct CudaLayerScratchLayout {
  int64_t group_seqs = 0;  // G
  Region mean1, rstd1, mean2, rstd2, qkv, probs, work;
  int64_t total() const { return work.end(); }
};

inline CudaLayerScratchLayout CudaLayerScratchLayoutFor(const GptShape& s, int B, int T) {
  const int64_t G = CudaLayerGroupSeqs(B, T), R = G * T, C = s.channels;
  const int64_t probs = G * s.num_heads * int64_t{T} * T;
  CudaLayerScratchLayout l;
  l.group_seqs = G;
  int64_t at = 0;
  auto take = [&at](int64_t n) {
    const Region r{at, n};
    at += n;
    return r;
  };
  l.mean1 = take(R);
  l.rstd1 = take(R);
  l.mean2 = take(R);
  l.rstd2 = take(R);
  l.qkv = take(3 * R * C);
  l.probs = take(probs);
  l.work = take(std::max(8 * R * C, 5 * R * C + probs));
  return l;
}

// Scratch of CudaLayerForward / CudaLayerBackward in fp32 elements (the layout above).
// B >= 1, 1 <= T <= max_seq_len.
inline int64_t CudaLayerScratchElems(const GptShape& s, int B, int T) {
  return CudaLayerScratchLayoutFor(s, B, T).total();
}

// Scratch of CudaHeadForward / CudaHeadBackward in fp32 elements: the host's
// HeadScratchElems, B T C (final LayerNorm output) + 3 B T (mean, rstd, per-token loss).
inline int64_t CudaHeadScratchElems(const GptShape& s, int B, int T) {
  const int64_t N = int64_t{B} * T;
  return N * s.channels + 3 * N;
}

// Scratch of the typed block functions of models/cuda/gpt_cuda.h, in bytes, for storage type
// S (float, Bf16, Fp16). Until the typed CUDA kernels define their own layout these are the fp32
// layout's sizes (an upper bound for 16-bit storage). B >= 1, 1 <= T <= max_seq_len.
template <typename S>
int64_t CudaEmbeddingScratchBytes(const GptShape& s, int B, int T) {
  return 0;
}
template <typename S>
int64_t CudaLayerScratchBytes(const GptShape& s, int B, int T) {
  return CudaLayerScratchElems(s, B, T) * 4;
}
template <typename S>
int64_t CudaHeadScratchBytes(const GptShape& s, int B, int T) {
  return CudaHeadScratchElems(s, B, T) * 4;
}

// Buffers of one group of `seqs` sequences inside the work area, relative to its start,
// in the order the layer uses them (r = seqs T rows).
struct CudaLayerWorkLayout {
  // Forward (and the backward's recomputation of it, which stops after the GELU).
  Region ln1;   // (r, C) LayerNorm 1 output, until the qkv product
  Region atty;  // (r, C) attention output, until the projection
  Region fch;   // (r, 4C) fc pre-activation; alive into the backward's GELU backward
  Region ln2;   // (r, C) LayerNorm 2 output, until the fc product
  Region gelu;  // (r, 4C) GELU output; alive into the backward's mlp_proj_w gradient
  // Backward.
  Region dfch;        // (r, 4C) over gelu (dead once mlp_proj_w's gradient is taken)
  Region ln2_again;   // (r, C) LayerNorm 2 recomputed, over the dead fch
  Region dln2;        // (r, C)
  Region atty_again;  // (r, C) attention output recomputed
  Region datty;       // (r, C)
  Region dqkv;        // (r, 3C)
  Region dprobs;      // (seqs, H, T, T) probability gradients
  Region ln1_again;   // (r, C) LayerNorm 1 recomputed
  Region dln1;        // (r, C)
};

inline CudaLayerWorkLayout CudaLayerWorkLayoutFor(const GptShape& s, int64_t seqs, int T) {
  const int64_t r = seqs * T, rC = r * s.channels;
  CudaLayerWorkLayout w;
  w.ln1 = {0, rC};
  w.atty = {0, rC};
  w.fch = {0, 4 * rC};
  w.ln2 = {4 * rC, rC};
  w.gelu = {4 * rC, 4 * rC};
  w.dfch = {4 * rC, 4 * rC};
  w.ln2_again = {0, rC};
  w.dln2 = {rC, rC};
  w.atty_again = {0, rC};
  w.datty = {rC, rC};
  w.dqkv = {2 * rC, 3 * rC};
  w.dprobs = {5 * rC, seqs * s.num_heads * int64_t{T} * T};
  w.ln1_again = {0, rC};
  w.dln1 = {rC, rC};
  return w;
}

// ---------------------------------------------------------------------------
// Attention (Vaswani et al. 2017, causal, multi-head) of one group as strided-batched
// GEMMs, one per head, batched over the group's sequences. Layouts (row-major):
//   qkv   (seqs, T, 3C): row t of sequence b at (b T + t) 3C; head h of q at column
//          h hs, of k at C + h hs, of v at 2C + h hs (as the host's qkv).
//   probs, dprobs (seqs, H, T, T): matrix (b, h) at (b H + h) T T.
//   out   (seqs, T, C): the attention output y (forward) or its gradient dy
//          (backward); head h at column h hs.
//   dqkv  (seqs, T, 3C): like qkv.

struct AttnShape {
  int64_t seqs = 0, T = 0, C = 0, H = 0;
  int64_t hs() const { return C / H; }
  // 1 / sqrt(hs) in fp32, as the host's AttnScale<float>.
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(hs())); }
};

enum class AttnBuffer { kQkv, kProbs, kOut, kDqkv, kDprobs };
inline constexpr int kNumAttnBuffers = 5;

// One GEMM operand: matrix i of the batch starts at element offset + i stride of the
// buffer; ld is its row stride.
struct AttnOperand {
  AttnBuffer buffer = AttnBuffer::kQkv;
  int64_t offset = 0, ld = 0, stride = 0;
};

// C = alpha op(A) op(B) with beta 0 (gpu::cuda::GemmStridedBatched argument order), over
// `batch` matrices.
struct AttnGemm {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
  float alpha = 1.0f;
  AttnOperand a, b, c;
  int64_t batch = 0;
};

namespace attn_internal {
inline AttnOperand Qkv(const AttnShape& d, int64_t col) {
  return {AttnBuffer::kQkv, col, 3 * d.C, d.T * 3 * d.C};
}
inline AttnOperand Dqkv(const AttnShape& d, int64_t col) {
  return {AttnBuffer::kDqkv, col, 3 * d.C, d.T * 3 * d.C};
}
inline AttnOperand Out(const AttnShape& d, int64_t h) {
  return {AttnBuffer::kOut, h * d.hs(), d.C, d.T * d.C};
}
inline AttnOperand Square(AttnBuffer buffer, const AttnShape& d, int64_t h) {
  return {buffer, h * d.T * d.T, d.T, d.H * d.T * d.T};
}
inline AttnGemm Make(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     AttnOperand a, AttnOperand b, AttnOperand c, int64_t batch) {
  return {trans_a, trans_b, M, N, K, alpha, a, b, c, batch};
}
}  // namespace attn_internal

// Forward, head h: probs[:, h] = scale q_h k_h^T (the full T x T scores; the causal
// softmax then masks and normalizes them in place).
inline AttnGemm AttnScoresGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t q = h * d.hs(), k = d.C + h * d.hs();
  return Make(false, true, d.T, d.T, d.hs(), d.scale(), Qkv(d, q), Qkv(d, k),
              Square(AttnBuffer::kProbs, d, h), d.seqs);
}

// Forward (and the backward's recomputation), head h: out[:, :, h] = probs[:, h] v_h.
inline AttnGemm AttnValuesGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t v = 2 * d.C + h * d.hs();
  return Make(false, false, d.T, d.hs(), d.T, 1.0f, Square(AttnBuffer::kProbs, d, h), Qkv(d, v),
              Out(d, h), d.seqs);
}

// Backward, head h: dv_h = probs[:, h]^T dy_h (probs is zero above the diagonal).
inline AttnGemm AttnGradValuesGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t v = 2 * d.C + h * d.hs();
  return Make(true, false, d.T, d.hs(), d.T, 1.0f, Square(AttnBuffer::kProbs, d, h), Out(d, h),
              Dqkv(d, v), d.seqs);
}

// Backward, head h: dprobs[:, h] = dy_h v_h^T.
inline AttnGemm AttnGradProbsGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t v = 2 * d.C + h * d.hs();
  return Make(false, true, d.T, d.T, d.hs(), 1.0f, Out(d, h), Qkv(d, v),
              Square(AttnBuffer::kDprobs, d, h), d.seqs);
}

// Backward, head h, after the softmax backward turned probs into the score gradients
// ds: dq_h = scale ds k_h.
inline AttnGemm AttnGradQueriesGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t q = h * d.hs(), k = d.C + h * d.hs();
  return Make(false, false, d.T, d.hs(), d.T, d.scale(), Square(AttnBuffer::kProbs, d, h),
              Qkv(d, k), Dqkv(d, q), d.seqs);
}

// Backward, head h: dk_h = scale ds^T q_h.
inline AttnGemm AttnGradKeysGemm(const AttnShape& d, int64_t h) {
  using namespace attn_internal;
  const int64_t q = h * d.hs(), k = d.C + h * d.hs();
  return Make(true, false, d.T, d.hs(), d.T, d.scale(), Square(AttnBuffer::kProbs, d, h), Qkv(d, q),
              Dqkv(d, k), d.seqs);
}

}  // namespace strata::models::cuda
