// The GPT layer's layouts, shared by the host and the CUDA backends: its parameter chunk
// (models/gpt_kernels.h, "Chunk layouts") and its scratch. Plain C++, always built.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "models/gpt_kernels.h"
#include "models/ops/cuda/partials.h"
#include "models/scratch_layout.h"

namespace strata::models {

// Pointers into a layer chunk of a model with C channels, in layout order. P is a (const)
// S* for a storage type S (float, double, Bf16, Fp16); the pointers are computed, never
// dereferenced, here.
template <typename P>
struct LayerParams {
  P ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w,
      mlp_proj_b;
  // base null (a backward that computes no weight gradient: LoRA's frozen layer): all null.
  LayerParams(P base, int64_t C) {
    if (base == nullptr) {
      ln1_w = ln1_b = qkv_w = qkv_b = attn_proj_w = attn_proj_b = ln2_w = ln2_b = fc_w = fc_b =
          mlp_proj_w = mlp_proj_b = nullptr;
      return;
    }
    P p = base;
    auto take = [&p](int64_t n) {
      P r = p;
      p += n;
      return r;
    };
    ln1_w = take(C);
    ln1_b = take(C);
    qkv_w = take(C * 3 * C);
    qkv_b = take(3 * C);
    attn_proj_w = take(C * C);
    attn_proj_b = take(C);
    ln2_w = take(C);
    ln2_b = take(C);
    fc_w = take(C * 4 * C);
    fc_b = take(4 * C);
    mlp_proj_w = take(4 * C * C);
    mlp_proj_b = take(C);
  }
};

// ---------------------------------------------------------------------------
// The layer's scratch: ONE layout, used by the host and the CUDA backends (the body of
// models/gpt_block.h), for storage type S and F = ComputeType<S> statistics (fp32; double for
// the host's double reference). Notation of gpt_kernels.h: N = B T rows, C channels, H heads;
// e = sizeof(S), f = sizeof(F). Forward: ln1 -> qkv -> att (+ lse) -> x2 -> ln2 -> h (the
// GELU's pre-activation) / g -> x_out. The backward recomputes that forward into the same regions
// (x_out is not written), then reuses dead ones:
//   dh   over g    (g is dead once mlp_proj_w's gradient is taken)
//   dqkv over h    (h is dead once the GELU's input gradient is written)
//   dln  holds dln2, then datt, then dln1 (each dead before the next is written); before dln2,
//        the CUDA backend's fp32 product of the GELU input gradient, GeluAccRows rows at a time
// dx2 lives in the caller's dx_in, and LayerNorm 1's backward adds to it in place. delta and
// ln_partials are the CUDA ops' (the attention backward's rowsum(dO * O), the two-pass column
// sums); the host ops leave them unused.
struct GptLayerScratchLayout {
  Region mean1, rstd1, mean2, rstd2;  // (N) F LayerNorm statistics
  Region lse;                         // (B, H, T) F attention log-sum-exp
  Region delta;                       // (B, H, T) F rowsum(dO * O) of the backward (CUDA)
  Region ln_partials;                 // (LnPartials(N), 4 C) fp32 column-sum partials (CUDA)
  Region ln1;                         // (N, C) S
  Region qkv;                         // (N, 3C) S
  Region att;                         // (N, C) S attention output
  Region x2;                          // (N, C) S residual after attention
  Region ln2;                         // (N, C) S
  Region h;                           // (N, 4C) S fc pre-activation (GELU aux); then dqkv (N, 3C)
  Region g;                           // (N, 4C) S GELU output; then dh (N, 4C)
  Region dln;                         // (N, C) S dln2, datt, dln1 in turn; first the DGELU
                                      // product (GeluAccRows, 4C) fp32 (CUDA)
  int64_t total = 0;
};

// Rows of the CUDA DGELU product per pass (ops.cuh Products::GeluInputGrad): its fp32 (rows, 4C)
// fits in the (N, C) S of dln, so the backward needs no more scratch than the fused epilogue.
inline int64_t GeluAccRows(int64_t N, int64_t e) { return std::max<int64_t>(1, N * e / 16); }

template <typename S>
GptLayerScratchLayout GptLayerScratchLayoutFor(const GptShape& s, int B, int T) {
  const int64_t N = int64_t{B} * T, C = s.channels, e = sizeof(S), f = sizeof(ComputeType<S>);
  const int64_t stats = int64_t{B} * s.num_heads * T * f;
  RegionCarver c;
  GptLayerScratchLayout l;
  l.mean1 = c.Take(N * f);
  l.rstd1 = c.Take(N * f);
  l.mean2 = c.Take(N * f);
  l.rstd2 = c.Take(N * f);
  l.lse = c.Take(stats);
  l.delta = c.Take(stats);
  l.ln_partials = c.Take(ops::cuda::LnPartials(N) * 4 * C * 4);
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
std::vector<std::pair<std::string, std::vector<NamedRegion>>> GptLayerLivePhases(const GptShape& s,
                                                                                 int B, int T) {
  const GptLayerScratchLayout l = GptLayerScratchLayoutFor<S>(s, B, T);
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

}  // namespace strata::models
