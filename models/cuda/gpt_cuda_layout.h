// Host-callable layout of the CUDA blocks (models/cuda/gpt_cuda.cu): where each buffer of a
// block's scratch lies. Plain C++ (no CUDA headers): gpt_cuda.cu takes every offset from
// here, and tests/models/gpt_cuda_layout_test.cc checks it without a GPU (every region inside
// the scratch, aligned, and the buffers that are live at the same time disjoint).
//
// All sizes and offsets are in BYTES; every region starts at a multiple of kScratchAlign
// (scratch itself must be kScratchAlign-aligned: the engine's arena slots are). Notation as in
// models/gpt_kernels.h: N = B T rows, C channels, H heads, V vocabulary, S the storage type
// (e bytes per element: 4 for float, 2 for Bf16 / Fp16). Only O(N C) buffers of S plus fp32
// statistics: no T x T matrix (attention is fused, FlashAttention-2 style) and no (N, V) logits
// (the head works in chunks of rows, plus an fp32 (C, V) weight-gradient accumulator for 16-bit
// S). Pure, thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "models/gpt_kernels.h"
#include "models/ops/cuda/partials.h"

namespace strata::models::cuda {

inline constexpr int64_t kScratchAlign = 256;
// Rows per partial sum of the LayerNorm parameter gradients and column sums (the ops' two-pass
// column reduction, models/ops/cuda/partials.h).
using ops::cuda::kLnRowsPerPartial;
using ops::cuda::LnPartials;

// [offset, offset + bytes) of a buffer.
struct Region {
  int64_t offset = 0;
  int64_t bytes = 0;
  int64_t end() const { return offset + bytes; }
};

// A region with its name, for the tests' overlap messages.
struct NamedRegion {
  std::string name;
  Region region;
};

namespace layout_internal {
class Carver {
 public:
  Region Take(int64_t bytes) {
    at_ = (at_ + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
    const Region r{at_, bytes};
    at_ += bytes;
    return r;
  }
  int64_t total() const { return (at_ + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

 private:
  int64_t at_ = 0;
};
}  // namespace layout_internal

// ---------------------------------------------------------------------------
// Layer. Forward: ln1 -> qkv -> att (+ lse) -> x2 -> ln2 -> h (aux) / g -> x_out. The backward
// recomputes that forward into the same regions (x_out is not written), then reuses dead ones:
//   dh   over g    (g is dead once mlp_proj_w's gradient is taken)
//   dqkv over h    (h is dead once the DGELU product has run)
//   dln  holds dln2, then datt, then dln1 (each dead before the next is written); before dln2,
//        the fp32 product of the DGELU input gradient, GeluAccRows rows at a time
// dx2 lives in the caller's dx_in, and LayerNorm 1's backward adds to it in place.
struct GptCudaLayerScratchLayout {
  Region mean1, rstd1, mean2, rstd2;  // (N) fp32 LayerNorm statistics
  Region lse;                         // (B, H, T) fp32 attention log-sum-exp
  Region delta;                       // (B, H, T) fp32 rowsum(dO * O) of the backward
  Region ln_partials;                 // (LnPartials(N), 4 C) fp32 column-sum partials
  Region ln1;                         // (N, C) S
  Region qkv;                         // (N, 3C) S
  Region att;                         // (N, C) S attention output
  Region x2;                          // (N, C) S residual after attention
  Region ln2;                         // (N, C) S
  Region h;                           // (N, 4C) S fc pre-activation (GELU aux); then dqkv (N, 3C)
  Region g;                           // (N, 4C) S GELU output; then dh (N, 4C)
  Region dln;                         // (N, C) S dln2, datt, dln1 in turn; first the DGELU
                                      // product (GeluAccRows, 4C) fp32
  int64_t total = 0;
};

// Rows of the DGELU product per pass (ops.cuh Products::GeluInputGrad): its fp32 (rows, 4C)
// fits in the (N, C) S of dln, so the backward needs no more scratch than the fused epilogue.
inline int64_t GeluAccRows(int64_t N, int64_t e) { return std::max<int64_t>(1, N * e / 16); }

template <typename S>
GptCudaLayerScratchLayout GptCudaLayerScratchLayoutFor(const GptShape& s, int B, int T) {
  const int64_t N = int64_t{B} * T, C = s.channels, e = sizeof(S);
  const int64_t stats = int64_t{B} * s.num_heads * T * 4;
  layout_internal::Carver c;
  GptCudaLayerScratchLayout l;
  l.mean1 = c.Take(N * 4);
  l.rstd1 = c.Take(N * 4);
  l.mean2 = c.Take(N * 4);
  l.rstd2 = c.Take(N * 4);
  l.lse = c.Take(stats);
  l.delta = c.Take(stats);
  l.ln_partials = c.Take(LnPartials(N) * 4 * C * 4);
  l.ln1 = c.Take(N * C * e);
  l.qkv = c.Take(3 * N * C * e);
  l.att = c.Take(N * C * e);
  l.x2 = c.Take(N * C * e);
  l.ln2 = c.Take(N * C * e);
  l.h = c.Take(4 * N * C * e);
  l.g = c.Take(4 * N * C * e);
  l.dln = c.Take(std::max(N * C * e, GeluAccRows(N, e) * 4 * C * 4));
  l.total = c.total();
  return l;
}

// The buffers live at the same time in each phase of the layer backward (the forward's
// phases are subsets of the first). Each entry: (phase name, regions).
template <typename S>
std::vector<std::pair<std::string, std::vector<NamedRegion>>> CudaLayerLivePhases(const GptShape& s,
                                                                                  int B, int T) {
  const GptCudaLayerScratchLayout l = GptCudaLayerScratchLayoutFor<S>(s, B, T);
  const int64_t N = int64_t{B} * T, e = sizeof(S), C = s.channels;
  const NamedRegion m1{"mean1", l.mean1}, r1{"rstd1", l.rstd1}, m2{"mean2", l.mean2},
      r2{"rstd2", l.rstd2}, lse{"lse", l.lse}, delta{"delta", l.delta},
      part{"ln_partials", l.ln_partials}, ln1{"ln1", l.ln1}, qkv{"qkv", l.qkv}, att{"att", l.att},
      x2{"x2", l.x2}, ln2{"ln2", l.ln2}, h{"h", l.h}, g{"g", l.g}, dh{"dh", l.g},
      dqkv{"dqkv", {l.h.offset, 3 * N * C * e}}, dln2{"dln2", l.dln}, datt{"datt", l.dln},
      dln1{"dln1", l.dln}, acc{"dgelu_acc", {l.dln.offset, GeluAccRows(N, e) * 4 * C * 4}};
  return {
      {"forward", {m1, r1, m2, r2, lse, ln1, qkv, att, x2, ln2, h, g}},
      {"dgelu product", {m1, r1, m2, r2, lse, ln1, qkv, att, x2, ln2, h, dh, acc}},
      {"mlp backward", {m1, r1, m2, r2, lse, ln1, qkv, att, x2, ln2, h, dh, dln2, part}},
      {"attention backward", {m1, r1, lse, delta, ln1, qkv, att, datt, dqkv}},
      {"qkv backward", {m1, r1, ln1, dqkv, dln1, part}},
  };
}

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
  layout_internal::Carver c;
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
  Carver c;
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
  return GptCudaLayerScratchLayoutFor<S>(s, B, T).total;
}
template <typename S>
int64_t GptCudaHeadScratchBytes(const GptShape& s, int B, int T) {
  return GptCudaHeadScratchLayoutFor<S>(s, B, T).total;
}

}  // namespace strata::models::cuda
