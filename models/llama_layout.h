// The Llama layer's geometry and layouts, shared by the host and the CUDA backends: its sizes,
// its parameter chunk (llama_config.h LlamaLayerTensors) and its scratch. Plain C++, always built.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "models/llama_config.h"
#include "models/ops/cuda/partials.h"
#include "models/scratch_layout.h"

namespace strata::models {

// The sizes of a block call (notation of models/llama_kernels.h).
struct LlamaDims {
  int64_t N, C, I, H, Hkv, hs, Dq, Dkv, Dqkv, V;
  LlamaDims(const LlamaConfig& c, int B, int T)
      : N(int64_t{B} * T),
        C(c.hidden_size),
        I(c.intermediate_size),
        H(c.num_heads),
        Hkv(c.num_kv_heads),
        hs(c.head_dim),
        Dq(H * hs),
        Dkv(Hkv * hs),
        Dqkv(Dq + 2 * Dkv),
        V(c.vocab_size) {}
};

// The tensors of a layer chunk, from the one layout table (llama_config.h LlamaLayerOffsetsOf).
// P is a (const) S*; pointers are computed, never dereferenced, here. The optional parts (biases,
// q/k norms) are null when the config has none.
template <typename P>
struct LlamaLayerParams {
  P w_in;        // input_layernorm (C)
  P wqkv;        // q_proj, k_proj, v_proj: (Dqkv, C)
  P bqkv;        // their biases (Dqkv) or null
  P qk_norm;     // q_norm then k_norm (2, hs) or null
  P wo;          // o_proj (C, Dq)
  P bo;          // its bias (C) or null
  P w_attn_out;  // sandwich norms: the attention output's norm (C) or null
  P w_post;      // the MLP's input norm (C): post_attention_layernorm (Gemma: pre_feedforward_)
  P w_mlp_out;   // sandwich norms: the MLP output's norm (C) or null
  P wgu;         // gate_proj, up_proj: (2I, C)
  P wd;          // down_proj (C, I)
  // base null (a backward that computes no weight gradient: LoRA's frozen layer): all null.
  LlamaLayerParams(const LlamaConfig& c, P base) {
    const LlamaLayerOffsets o = LlamaLayerOffsetsOf(c);
    auto at = [base](int64_t offset) -> P {
      return base == nullptr || offset < 0 ? nullptr : base + offset;
    };
    w_in = at(o.w_in);
    wqkv = at(o.wqkv);
    bqkv = at(o.bqkv);
    qk_norm = at(o.qk_norm);
    wo = at(o.wo);
    bo = at(o.bo);
    w_attn_out = at(o.w_attn_out);
    w_post = at(o.w_post);
    w_mlp_out = at(o.w_mlp_out);
    wgu = at(o.wgu);
    wd = at(o.wd);
  }
};

// ---------------------------------------------------------------------------
// The layer's scratch: ONE layout, used by the host and the CUDA backends (the body of
// models/llama_block.h), for storage type S and F = ComputeType<S> statistics (fp32; double for
// the host's double reference); e = sizeof(S), f = sizeof(F). Forward: xn -> qkv (RoPE in place)
// -> att (+ lse) -> x2 (= x + att Wo^T) -> xn2 -> gu -> h -> x_out (= x2 + h Wd^T). The backward
// recomputes the forward into the same regions (x_out not written), then:
//   grad holds dh (N, I), then dxn2 (N, C), then datt (N, Dq), then dxn (N, C), each dead before
//        the next is written;
//   gu   is overwritten in place by dgu = [dgate | dup] (SwiGLU's backward reads each pair
//        before writing it; gu is dead after);
//   dqkv (N, Dqkv) is written by the attention backward and rotated back in place;
// dx2 lives in the caller's dx_in and RMSNorm 1's backward adds to it in place. delta and
// partials are the CUDA ops' (the attention backward's rowsum(dO * O), the two-pass RMSNorm
// weight gradient, and the column sums of the bias gradients); the host ops leave them unused.
// With qk_norm (Qwen3) the forward keeps the pre-norm q and k heads in qk_raw and their rstd in
// qk_rstd for the backward (empty regions otherwise). With sandwich norms (Gemma) o holds the
// attention's projection (N, C) and d the MLP's (N, C) before their norms (rstd3, rstd4), and
// side the normalised MLP output in the forward, then the backward's dd and do (N, C) in turn
// (empty regions otherwise).
struct LlamaLayerScratchLayout {
  Region rstd1, rstd2;  // (N) F RMSNorm statistics
  Region lse;           // (B, H, T) F attention log-sum-exp
  Region delta;         // (B, H, T) F rowsum(dO * O) of the backward (CUDA)
  Region cos, sin;      // (T, hs / 2) F rotary table
  Region partials;      // fp32 two-pass reduction partials (CUDA): LlamaLayerPartialsBytes
  Region qk_rstd;       // (N (H + Hkv)) F per-head RMSNorm statistics (qk_norm)
  Region qk_raw;        // (N, (H + Hkv) hs) S the q and k heads before their norm (qk_norm)
  Region rstd3, rstd4;  // (N) F the sandwich norms' statistics
  Region o, d, side;    // (N, C) S the sandwich norms' inputs, and dn / dd / do
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

// Bytes of the CUDA ops' fp32 reduction partials of a layer: the RMSNorm weight gradients
// ((RmsPartials(N), C)), with biases the column sums of the bias gradients ((LnPartials(N),
// max(Dqkv, C))), with qk_norm the per-head norms' weight gradient
// (ops::cuda::HeadRmsNormPartialsBytes).
inline int64_t LlamaLayerPartialsBytes(const LlamaConfig& c, int B, int T) {
  const LlamaDims d(c, B, T);
  int64_t bytes = ops::cuda::RmsPartials(d.N) * d.C * 4;
  if (c.qkv_bias || c.o_bias) {
    bytes = std::max(bytes, ops::cuda::LnPartials(d.N) * std::max(d.Dqkv, d.C) * 4);
  }
  if (c.qk_norm) {
    bytes = std::max(bytes, ops::cuda::HeadRmsNormWorkspaceBytes(d.N, d.hs));
  }
  return bytes;
}

template <typename S>
LlamaLayerScratchLayout LlamaLayerScratchLayoutFor(const LlamaConfig& c, int B, int T) {
  const LlamaDims d(c, B, T);
  const int64_t e = sizeof(S), f = sizeof(ComputeType<S>);
  const int64_t stats = int64_t{B} * c.num_heads * T * f;
  RegionCarver k;
  LlamaLayerScratchLayout l;
  l.rstd1 = k.Take(d.N * f);
  l.rstd2 = k.Take(d.N * f);
  l.lse = k.Take(stats);
  l.delta = k.Take(stats);
  l.cos = k.Take(int64_t{T} * (d.hs / 2) * f);
  l.sin = k.Take(int64_t{T} * (d.hs / 2) * f);
  l.partials = k.Take(LlamaLayerPartialsBytes(c, B, T));
  const int64_t qk_heads = c.qk_norm ? int64_t{c.num_heads} + c.num_kv_heads : 0;
  l.qk_rstd = k.Take(d.N * qk_heads * f);
  l.qk_raw = k.Take(d.N * qk_heads * d.hs * e);
  const int64_t sandwich = c.sandwich_norms ? 1 : 0;
  l.rstd3 = k.Take(sandwich * d.N * f);
  l.rstd4 = k.Take(sandwich * d.N * f);
  l.o = k.Take(sandwich * d.N * d.C * e);
  l.d = k.Take(sandwich * d.N * d.C * e);
  l.side = k.Take(sandwich * d.N * d.C * e);
  l.xn = k.Take(d.N * d.C * e);
  l.qkv = k.Take(d.N * d.Dqkv * e);
  l.att = k.Take(d.N * d.Dq * e);
  l.x2 = k.Take(d.N * d.C * e);
  l.xn2 = k.Take(d.N * d.C * e);
  l.gu = k.Take(d.N * 2 * d.I * e);
  l.h = k.Take(d.N * d.I * e);
  l.grad = k.Take(d.N * std::max({d.C, d.I, d.Dq}) * e);
  l.dqkv = k.Take(d.N * d.Dqkv * e);
  l.total = k.total();
  return l;
}

// The buffers live at the same time in each phase of the layer backward (the forward's phases
// are subsets of the first). Each entry: (phase name, regions), the regions of one phase
// pairwise disjoint.
template <typename S>
std::vector<std::pair<std::string, std::vector<NamedRegion>>> LlamaLayerLivePhases(
    const LlamaConfig& c, int B, int T) {
  const LlamaLayerScratchLayout l = LlamaLayerScratchLayoutFor<S>(c, B, T);
  const NamedRegion r1{"rstd1", l.rstd1}, r2{"rstd2", l.rstd2}, lse{"lse", l.lse},
      delta{"delta", l.delta}, cos{"cos", l.cos}, sin{"sin", l.sin}, part{"partials", l.partials},
      xn{"xn", l.xn}, qkv{"qkv", l.qkv}, att{"att", l.att}, x2{"x2", l.x2}, xn2{"xn2", l.xn2},
      gu{"gu", l.gu}, h{"h", l.h}, grad{"grad", l.grad}, dqkv{"dqkv", l.dqkv},
      qr{"qk_rstd", l.qk_rstd}, qraw{"qk_raw", l.qk_raw}, r3{"rstd3", l.rstd3},
      r4{"rstd4", l.rstd4}, o{"o", l.o}, dd{"d", l.d}, side{"side", l.side};
  return {
      {"forward",
       {r1, r2, lse, cos, sin, xn, qkv, att, x2, xn2, gu, h, qr, qraw, r3, r4, o, dd, side}},
      {"mlp backward", {r1, r2,   lse,  cos, sin,  xn, qkv, att, x2, xn2, gu,
                        h,  grad, part, qr,  qraw, r3, r4,  o,   dd, side}},
      {"attention backward",
       {r1, lse, delta, cos, sin, xn, qkv, att, grad, dqkv, qr, qraw, r3, o, side}},
      {"qkv backward", {r1, cos, sin, xn, dqkv, grad, part, qr, qraw}},
  };
}

}  // namespace strata::models
