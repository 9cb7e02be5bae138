// Host-callable layouts of the Llama family's CUDA embedding and head blocks (models/cuda/
// llama_cuda.cu): where each buffer of a block's scratch lies. The layer's scratch is the
// family's one layout, LlamaLayerScratchLayout (models/llama_layout.h), which the host and CUDA
// layers share. Plain C++ (no CUDA headers): llama_cuda.cu takes every offset from here,
// models/llama.cc sizes the scratch with it, and tests/models/llama_cuda_layout_test.cc checks it
// without a GPU (every region inside the scratch, aligned, and the buffers live at the same time
// disjoint).
//
// All sizes and offsets in BYTES; every region starts at a multiple of kScratchAlign
// (models/scratch_layout.h; the scratch itself must be so aligned: the engine's arena slots are).
// Notation as in models/llama_kernels.h: N = B T rows, C hidden, I intermediate, H heads, Hkv
// key/value heads, hs head_dim, Dq = H hs, Dqkv = (H + 2 Hkv) hs, V vocabulary, S the storage
// type (e bytes: 4 for float, 2 for Bf16 / Fp16). Pure, thread-safe.
#pragma once

#include <cstdint>

#include "models/cuda/gpt_cuda_layout.h"
#include "models/llama_config.h"
#include "models/llama_layout.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/cuda/partials.h"

namespace strata::models::cuda {

// Rows per partial sum of the RMSNorm weight gradients (models/ops/cuda/partials.h).
inline int64_t LlamaRmsPartials(int64_t N) { return ops::cuda::RmsPartials(N); }

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
  RegionCarver k;
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
  return LlamaLayerScratchLayoutFor<S>(c, B, T).total;  // the family's one layer layout
}
template <typename S>
int64_t LlamaCudaHeadScratchBytes(const LlamaConfig& c, int B, int T) {
  return LlamaCudaHeadScratchLayoutFor<S>(c, B, T).total;
}

}  // namespace strata::models::cuda
