// Host-callable layouts of the GPT's CUDA embedding and head blocks (models/cuda/gpt_cuda.cu):
// where each buffer of a block's scratch lies. The layer's scratch is the family's one layout,
// GptLayerScratchLayout (models/gpt_layout.h), which the host and CUDA layers share. Plain C++
// (no CUDA headers): gpt_cuda.cu takes every offset from here, and tests/models/
// gpt_cuda_layout_test.cc checks it without a GPU (every region inside the scratch, aligned, and
// the buffers that are live at the same time disjoint).
//
// All sizes and offsets are in BYTES; every region starts at a multiple of kScratchAlign
// (models/scratch_layout.h; scratch itself must be kScratchAlign-aligned: the engine's arena
// slots are). Notation as in models/gpt_kernels.h: N = B T rows, C channels, V vocabulary, S the
// storage type (e bytes per element: 4 for float, 2 for Bf16 / Fp16). No (N, V) logits (the head
// works in chunks of rows, plus an fp32 (C, V) weight-gradient accumulator for 16-bit S). Pure,
// thread-safe.
#pragma once

#include <cstdint>

#include "models/gpt_kernels.h"
#include "models/gpt_layout.h"
#include "models/ops/cuda/partials.h"
#include "models/scratch_layout.h"

namespace strata::models::cuda {

// Rows per partial sum of the LayerNorm parameter gradients and column sums (the ops' two-pass
// column reduction, models/ops/cuda/partials.h).
using ops::cuda::kLnRowsPerPartial;
using ops::cuda::LnPartials;

// ---------------------------------------------------------------------------
// Head: lnf = S(LN(x)); the forward's (B, V) last-position logits come from lnf_last (the B
// rows t = T - 1 of lnf, gathered); the loss and the backward run over chunks of R =
// HeadChunkRows(N, V) rows (models/gpt_kernels.h): the chunk's logits, then its logit gradients,
// in `chunk`; the backward writes dlnf = S(dlogits Wlm^T) chunk by chunk and adds
// lnf^T dlogits into dwlm_acc (fp32; for S = float the accumulator is the head's dWlm itself,
// and the region is empty) before the LayerNorm backward writes dx_in.
struct GptCudaHeadScratchLayout {
  Region mean, rstd;       // (N) fp32
  Region losses;           // (N) fp32 per-row cross-entropy
  Region ln_partials;      // (LnPartials(N), 4 C) fp32 (2 C used)
  Region lnf;              // (N, C) S
  Region dlnf;             // (N, C) S
  Region lnf_last;         // (B, C) S
  Region chunk;            // (R, V) S logits of one chunk, then their gradients
  Region dwlm_acc;         // (C, V) fp32 for 16-bit S; 0 bytes for float
  int64_t chunk_rows = 0;  // R
  int64_t total = 0;
};

template <typename S>
GptCudaHeadScratchLayout GptCudaHeadScratchLayoutFor(const GptShape& s, int B, int T) {
  const int64_t N = int64_t{B} * T, C = s.channels, V = s.vocab_size, e = sizeof(S);
  RegionCarver c;
  GptCudaHeadScratchLayout l;
  l.chunk_rows = HeadChunkRows(N, V);
  l.mean = c.Take(N * 4);
  l.rstd = c.Take(N * 4);
  l.losses = c.Take(N * 4);
  l.ln_partials = c.Take(LnPartials(N) * 4 * C * 4);
  l.lnf = c.Take(N * C * e);
  l.dlnf = c.Take(N * C * e);
  l.lnf_last = c.Take(int64_t{B} * C * e);
  l.chunk = c.Take(l.chunk_rows * V * e);
  l.dwlm_acc = c.Take(e == 4 ? 0 : C * V * 4);
  l.total = c.total();
  return l;
}

// ---------------------------------------------------------------------------
// Embedding backward: a counting sort of the N positions by token (stable: positions of one
// token in increasing order), then each wte row sums its positions in that order. Packed
// sequences (position_ids): a second counting sort, of the N rows by position (keys in [0, T)),
// then each wpe row sums its rows in that order (the Llama family has no position table: those
// regions are empty there).
struct CudaEmbeddingScratchLayout {
  Region counts;       // (V) int32 positions per token
  Region offsets;      // (V + 1) int32 exclusive prefix sums of counts
  Region cursor;       // (V) int32 next free slot per token while placing
  Region order;        // (N) int32 positions sorted by token
  Region pos_counts;   // (T) int32 rows per position
  Region pos_offsets;  // (T + 1) int32 exclusive prefix sums of pos_counts
  Region pos_cursor;   // (T) int32 next free slot per position while placing
  Region pos_order;    // (N) int32 rows sorted by position
  int64_t total = 0;
};

namespace layout_internal {
// The token sort's regions for V tokens, then (positions) the position sort's for T positions.
inline CudaEmbeddingScratchLayout CarveEmbeddingScratch(int64_t N, int64_t V, int64_t T,
                                                        bool positions) {
  RegionCarver c;
  CudaEmbeddingScratchLayout l;
  l.counts = c.Take(V * 4);
  l.offsets = c.Take((V + 1) * 4);
  l.cursor = c.Take(V * 4);
  l.order = c.Take(N * 4);
  if (positions) {
    l.pos_counts = c.Take(T * 4);
    l.pos_offsets = c.Take((T + 1) * 4);
    l.pos_cursor = c.Take(T * 4);
    l.pos_order = c.Take(N * 4);
  }
  l.total = c.total();
  return l;
}
}  // namespace layout_internal

inline CudaEmbeddingScratchLayout CudaEmbeddingScratchLayoutFor(const GptShape& s, int B, int T) {
  return layout_internal::CarveEmbeddingScratch(int64_t{B} * T, s.vocab_size, T, true);
}

// Scratch of the typed block functions of models/cuda/gpt_cuda.h, in bytes, for storage type
// S (float, Bf16, Fp16). B >= 1, 1 <= T <= max_seq_len.
template <typename S>
int64_t GptCudaEmbeddingScratchBytes(const GptShape& s, int B, int T) {
  return CudaEmbeddingScratchLayoutFor(s, B, T).total;
}
template <typename S>
int64_t GptCudaLayerScratchBytes(const GptShape& s, int B, int T) {
  return GptLayerScratchLayoutFor<S>(s, B, T).total;  // the family's one layer layout
}
template <typename S>
int64_t GptCudaHeadScratchBytes(const GptShape& s, int B, int T) {
  return GptCudaHeadScratchLayoutFor<S>(s, B, T).total;
}

}  // namespace strata::models::cuda
