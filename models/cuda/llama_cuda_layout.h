// Host-callable layout of the Llama family's CUDA blocks (models/cuda/llama_cuda.cu): where each
// buffer of a block's scratch lies. Plain C++ (no CUDA headers): llama_cuda.cu takes every offset
// from here, models/llama.cc sizes the scratch with it, and tests/models/llama_cuda_layout_test.cc
// checks it without a GPU (every region inside the scratch, aligned, and the buffers live at the
// same time disjoint).
//
// All sizes and offsets in BYTES; every region starts at a multiple of kScratchAlign
// (gpt_cuda_layout.h; the scratch itself must be so aligned: the engine's arena slots are).
// Notation as in models/llama_kernels.h: N = B T rows, C hidden, I intermediate, H heads, Hkv
// key/value heads, hs head_dim, Dq = H hs, Dqkv = (H + 2 Hkv) hs, V vocabulary, S the storage
// type (e bytes: 4 for float, 2 for Bf16 / Fp16). Pure, thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/cuda/gpt_cuda_layout.h"
#include "models/llama_config.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/cuda/partials.h"

namespace strata::models::cuda {

// Rows per partial sum of the RMSNorm weight gradients (models/ops/cuda/partials.h).
inline int64_t LlamaRmsPartials(int64_t N) { return ops::cuda::RmsPartials(N); }

// ---------------------------------------------------------------------------
// Layer. Forward: xn -> qkv (RoPE in place) -> att (+ lse) -> x2 (= x + att Wo^T) -> xn2 -> gu
// -> h -> x_out (= x2 + h Wd^T). The backward recomputes the forward into the same regions
// (x_out not written), then:
//   grad holds dh (N, I), then dxn2 (N, C), then datt (N, Dq), then dxn (N, C), each dead before
//        the next is written;
//   gu   is overwritten in place by dgu = [dgate | dup] (SwiGLU's backward reads each pair
//        before writing it; gu is dead after);
//   dqkv (N, Dqkv) is written by the attention backward and rotated back in place;
// dx2 lives in the caller's dx_in and RMSNorm 1's backward adds to it in place.
struct LlamaCudaLayerScratchLayout {
  Region rstd1, rstd2;  // (N) fp32 RMSNorm statistics
  Region lse;           // (B, H, T) fp32 attention log-sum-exp
  Region delta;         // (B, H, T) fp32 rowsum(dO * O) of the backward
  Region cos, sin;      // (T, hs / 2) fp32 rotary table
  Region partials;      // (LlamaRmsPartials(N), C) fp32 RMSNorm weight-gradient partials
  Region xn;            // (N, C) S
  Region qkv;           // (N, Dqkv) S, q and k rotated
  Region att;           // (N, Dq) S attention output
  Region x2;            // (N, C) S residual after attention
  Region xn2;           // (N, C) S
  Region gu;            // (N, 2I) S [gate | up]; then dgu
  Region h;             // (N, I) S SwiGLU output
  Region grad;          // (N, max(C, I, Dq)) S: dh, dxn2, datt, dxn in turn
  Region dqkv;          // (N, Dqkv) S
  int64_t total = 0;
};

template <typename S>
LlamaCudaLayerScratchLayout LlamaCudaLayerScratchLayoutFor(const LlamaConfig& c, int B, int T) {
  const int64_t N = int64_t{B} * T, C = c.hidden_size, I = c.intermediate_size, hs = c.head_dim,
                Dq = int64_t{c.num_heads} * hs,
                Dqkv = (int64_t{c.num_heads} + 2 * int64_t{c.num_kv_heads}) * hs, e = sizeof(S);
  const int64_t stats = int64_t{B} * c.num_heads * T * 4;
  layout_internal::Carver k;
  LlamaCudaLayerScratchLayout l;
  l.rstd1 = k.Take(N * 4);
  l.rstd2 = k.Take(N * 4);
  l.lse = k.Take(stats);
  l.delta = k.Take(stats);
  l.cos = k.Take(int64_t{T} * (hs / 2) * 4);
  l.sin = k.Take(int64_t{T} * (hs / 2) * 4);
  l.partials = k.Take(LlamaRmsPartials(N) * C * 4);
  l.xn = k.Take(N * C * e);
  l.qkv = k.Take(N * Dqkv * e);
  l.att = k.Take(N * Dq * e);
  l.x2 = k.Take(N * C * e);
  l.xn2 = k.Take(N * C * e);
  l.gu = k.Take(N * 2 * I * e);
  l.h = k.Take(N * I * e);
  l.grad = k.Take(N * std::max({C, I, Dq}) * e);
  l.dqkv = k.Take(N * Dqkv * e);
  l.total = k.total();
  return l;
}

// The buffers live at the same time in each phase of the layer backward (the forward's phases
// are subsets of the first). Each entry: (phase name, regions), the regions of one phase
// pairwise disjoint.
template <typename S>
std::vector<std::pair<std::string, std::vector<NamedRegion>>> LlamaCudaLayerLivePhases(
    const LlamaConfig& c, int B, int T) {
  const LlamaCudaLayerScratchLayout l = LlamaCudaLayerScratchLayoutFor<S>(c, B, T);
  const NamedRegion r1{"rstd1", l.rstd1}, r2{"rstd2", l.rstd2}, lse{"lse", l.lse},
      delta{"delta", l.delta}, cos{"cos", l.cos}, sin{"sin", l.sin}, part{"partials", l.partials},
      xn{"xn", l.xn}, qkv{"qkv", l.qkv}, att{"att", l.att}, x2{"x2", l.x2}, xn2{"xn2", l.xn2},
      gu{"gu", l.gu}, h{"h", l.h}, grad{"grad", l.grad}, dqkv{"dqkv", l.dqkv};
  return {
      {"forward", {r1, r2, lse, cos, sin, xn, qkv, att, x2, xn2, gu, h}},
      {"mlp backward", {r1, r2, lse, cos, sin, xn, qkv, att, x2, xn2, gu, h, grad, part}},
      {"attention backward", {r1, lse, delta, cos, sin, xn, qkv, att, grad, dqkv}},
      {"qkv backward", {r1, cos, sin, xn, dqkv, grad, part}},
  };
}

// ---------------------------------------------------------------------------
// Head: xn = S(RmsNorm(x)); the forward's (B, V) last-position logits from xn_last (the B rows
// t = T - 1 of xn, gathered) against the (V, C) weight; the loss and the backward run over
// chunks of R = ops::HeadChunkRows(N, V) rows: the chunk's logits, then their gradients, in
// `chunk`; the backward writes dxn = S(dlogits W) chunk by chunk and adds dlogits^T xn into
// dw_acc ((V, C) fp32 for 16-bit S; for S = float the accumulator is the weight gradient itself
// and the region is empty) before the RMSNorm backward writes dx_in.
struct LlamaCudaHeadScratchLayout {
  Region rstd;             // (N) fp32
  Region losses;           // (N) fp32 per-row cross-entropy
  Region partials;         // (LlamaRmsPartials(N), C) fp32
  Region xn;               // (N, C) S
  Region dxn;              // (N, C) S
  Region xn_last;          // (B, C) S
  Region chunk;            // (R, V) S
  Region dw_acc;           // (V, C) fp32 for 16-bit S; 0 bytes for float
  int64_t chunk_rows = 0;  // R
  int64_t total = 0;
};

template <typename S>
LlamaCudaHeadScratchLayout LlamaCudaHeadScratchLayoutFor(const LlamaConfig& c, int B, int T) {
  const int64_t N = int64_t{B} * T, C = c.hidden_size, V = c.vocab_size, e = sizeof(S);
  layout_internal::Carver k;
  LlamaCudaHeadScratchLayout l;
  l.chunk_rows = ops::HeadChunkRows(N, V);
  l.rstd = k.Take(N * 4);
  l.losses = k.Take(N * 4);
  l.partials = k.Take(LlamaRmsPartials(N) * C * 4);
  l.xn = k.Take(N * C * e);
  l.dxn = k.Take(N * C * e);
  l.xn_last = k.Take(int64_t{B} * C * e);
  l.chunk = k.Take(l.chunk_rows * V * e);
  l.dw_acc = k.Take(e == 4 ? 0 : V * C * 4);
  l.total = k.total();
  return l;
}

// ---------------------------------------------------------------------------
// Embedding backward: the GPT's counting sort of the N positions by token
// (CudaEmbeddingScratchLayout, gpt_cuda_layout.h), with this config's V; no position table, so
// no sort by position (those regions empty).
inline CudaEmbeddingScratchLayout LlamaCudaEmbeddingScratchLayoutFor(const LlamaConfig& c, int B,
                                                                     int T) {
  return layout_internal::CarveEmbeddingScratch(int64_t{B} * T, c.vocab_size, T, false);
}

// Scratch of the block functions of models/cuda/llama_cuda.h in bytes, for storage type S
// (float, Bf16, Fp16). B >= 1, 1 <= T <= max_seq_len.
template <typename S>
int64_t LlamaCudaEmbeddingScratchBytes(const LlamaConfig& c, int B, int T) {
  return LlamaCudaEmbeddingScratchLayoutFor(c, B, T).total;
}
template <typename S>
int64_t LlamaCudaLayerScratchBytes(const LlamaConfig& c, int B, int T) {
  return LlamaCudaLayerScratchLayoutFor<S>(c, B, T).total;
}
template <typename S>
int64_t LlamaCudaHeadScratchBytes(const LlamaConfig& c, int B, int T) {
  return LlamaCudaHeadScratchLayoutFor<S>(c, B, T).total;
}

}  // namespace strata::models::cuda
