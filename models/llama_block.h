// The Llama layer's forward and backward, written ONCE over an ops backend: `ops` is
// ops::HostOps<S> (models/ops/host_ops.h; models/llama_kernels.cc) or ops::cuda::CudaOps<S>
// (models/ops/cuda/cuda_ops.cuh; models/cuda/llama_cuda.cu), whose member functions have one
// signature. Each function reads as the list of op calls with their shapes (models/
// llama_kernels.h); the rounding points are the ops', the buffers those of the one scratch
// layout (LlamaLayerScratchLayout, models/llama_layout.h). Plain C++: nvcc compiles it too.
//
// q/k/v are one (Dqkv, C) product, gate/up one (2I, C), o_proj and down_proj with the residual
// added by the product; the family options of LlamaConfig (q/k/v and o biases, Qwen3's per-head
// q/k norms, the layer's sliding window) are op arguments or extra ops here, nowhere else. Returns
// the first error of an op (the host ops return Ok and STRATA_CHECK instead). With `lora` active
// every targeted product adds its adapter's output (q/k/v: before RoPE), and the backward takes the
// adapters' gradients and their share of dx (models/lora.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "base/status.h"
#include "models/llama_config.h"
#include "models/llama_kernels.h"
#include "models/llama_layout.h"
#include "models/lora.h"
#include "models/ops/attention.h"
#include "models/ops/matmul.h"
#include "models/ops/swiglu.h"
#include "models/scratch_layout.h"

namespace strata::models {

// Llama's weights are (out, in), y = x W^T (torch.nn.Linear).
inline constexpr ops::WeightLayout kLlamaWeights = ops::WeightLayout::kOutIn;

// The layer scratch (LlamaLayerScratchLayout) at `scratch` as typed pointers; F the ops'
// statistics type (Ops::F).
template <typename S, typename F>
struct LlamaLayerBuffers {
  F *rstd1, *rstd2, *lse, *delta, *cos, *sin, *qk_rstd, *rstd3, *rstd4;
  S *xn, *qkv, *att, *x2, *xn2, *gu, *h, *grad, *dqkv, *qk_raw, *o, *d, *side;
  LlamaLayerBuffers(const LlamaLayerScratchLayout& l, void* s)
      : rstd1(RegionAt<F>(s, l.rstd1)),
        rstd2(RegionAt<F>(s, l.rstd2)),
        lse(RegionAt<F>(s, l.lse)),
        delta(RegionAt<F>(s, l.delta)),
        cos(RegionAt<F>(s, l.cos)),
        sin(RegionAt<F>(s, l.sin)),
        qk_rstd(RegionAt<F>(s, l.qk_rstd)),
        rstd3(RegionAt<F>(s, l.rstd3)),
        rstd4(RegionAt<F>(s, l.rstd4)),
        xn(RegionAt<S>(s, l.xn)),
        qkv(RegionAt<S>(s, l.qkv)),
        att(RegionAt<S>(s, l.att)),
        x2(RegionAt<S>(s, l.x2)),
        xn2(RegionAt<S>(s, l.xn2)),
        gu(RegionAt<S>(s, l.gu)),
        h(RegionAt<S>(s, l.h)),
        grad(RegionAt<S>(s, l.grad)),
        dqkv(RegionAt<S>(s, l.dqkv)),
        qk_raw(RegionAt<S>(s, l.qk_raw)),
        o(RegionAt<S>(s, l.o)),
        d(RegionAt<S>(s, l.d)),
        side(RegionAt<S>(s, l.side)) {}
};

// Grouped-query attention of `layer` over the rows [q | k | v] of qkv (N, Dqkv); position_ids
// (B, T) or null (packed sequences); the layer's sliding window (the op itself treats a window of
// T or more as none); the config's query scale.
inline ops::AttentionDims LlamaAttentionDims(const LlamaConfig& c, int layer, int B, int T,
                                             const int32_t* position_ids) {
  ops::AttentionDims a{
      B, T, c.num_heads, c.num_kv_heads, c.head_dim, LlamaDims(c, B, T).Dqkv, position_ids};
  a.window = LlamaLayerWindow(c, layer);
  a.scale = c.query_pre_attn_scalar > 0 ? 1.0 / std::sqrt(c.query_pre_attn_scalar) : 0.0;
  a.softcap = c.attn_logit_softcapping;
  return a;
}

// The MLP's gated activation: SwiGLU, or Gemma's GeGLU with the tanh GELU.
inline ops::GatedActivation LlamaMlpActivation(const LlamaConfig& c) {
  return c.gelu_tanh_mlp ? ops::GatedActivation::kGeluTanh : ops::GatedActivation::kSilu;
}

// The forward up to what the backward needs, every value in the scratch:
//   xn = RMS1(x); qkv = xn Wqkv^T (+ bqkv); [qk_norm: each q and k head RMS-normalised, the
//   inputs kept in qk_raw]; RoPE on q and k (the layer's base); att = attention (+ lse; the
//   layer's window and the query scale);
//   x2 = x + att Wo^T (+ bo)   [sandwich norms: o = att Wo^T, x2 = x + RMS3(o)];
//   xn2 = RMS2(x2); gu = xn2 Wgu^T; h = SwiGLU(gu) (or GeGLU)
//   [sandwich norms: d = h Wd^T, side = RMS4(d)].
// Every RMSNorm multiplies by (1 + w) with norm_unit_offset.
template <typename S, typename Ops>
Status LlamaLayerForwardToSwiglu(const Ops& ops, const LlamaConfig& c, int layer,
                                 const LlamaLayerParams<const S*>& p, const S* x, int B, int T,
                                 const LlamaLayerBuffers<S, typename Ops::F>& w,
                                 const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                                 int max_positions) {
  const LlamaDims d(c, B, T);
  const int rope_heads = c.num_heads + c.num_kv_heads;
  const bool one = c.norm_unit_offset;
  const double eps = c.rms_norm_eps;
  STRATA_RETURN_IF_ERROR(ops.RmsNormForward(x, p.w_in, eps, d.N, d.C, w.xn, w.rstd1, one));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kLlamaWeights, d.N, d.C, d.Dqkv, w.xn, p.wqkv, p.bqkv, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kQkvProduct, w.xn, d.N, w.qkv, d.Dqkv));
  if (c.qk_norm) {
    STRATA_RETURN_IF_ERROR(ops.HeadRmsNormForward(w.qkv, d.Dqkv, d.N, rope_heads, c.num_heads, d.hs,
                                                  p.qk_norm, eps, w.qk_raw, w.qk_rstd, one));
  }
  // LongRoPE's factors by the longest sequence's positions (transformers' max(position_ids) + 1).
  const int positions = max_positions > 0 ? max_positions : T;
  STRATA_RETURN_IF_ERROR(ops.RopeTable(LlamaLayerRopeParams(c, layer, positions), T, w.cos, w.sin));
  STRATA_RETURN_IF_ERROR(ops.Rope(w.qkv, d.N, d.Dqkv, rope_heads, c.head_dim, T, w.cos, w.sin,
                                  /*inverse=*/false, position_ids, LlamaRotaryDim(c)));
  STRATA_RETURN_IF_ERROR(ops.Attention(LlamaAttentionDims(c, layer, B, T, position_ids), w.qkv,
                                       w.qkv + d.Dq, w.qkv + d.Dq + d.Dkv, w.att, w.lse));
  if (c.sandwich_norms) {
    // o = att Wo^T; x2 = x + RMS3(o), the norm's output rounded before the residual add.
    STRATA_RETURN_IF_ERROR(
        ops.Matmul(kLlamaWeights, d.N, d.Dq, d.C, w.att, p.wo, p.bo, nullptr, w.o));
    STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kOutProduct, w.att, d.N, w.o, d.C));
    STRATA_RETURN_IF_ERROR(
        ops.RmsNormForward(w.o, p.w_attn_out, eps, d.N, d.C, w.x2, w.rstd3, one));
    STRATA_RETURN_IF_ERROR(ops.Add(x, w.x2, d.N * d.C, w.x2));
  } else {
    STRATA_RETURN_IF_ERROR(ops.Matmul(kLlamaWeights, d.N, d.Dq, d.C, w.att, p.wo, p.bo, x, w.x2));
    STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kOutProduct, w.att, d.N, w.x2, d.C));
  }
  STRATA_RETURN_IF_ERROR(ops.RmsNormForward(w.x2, p.w_post, eps, d.N, d.C, w.xn2, w.rstd2, one));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kLlamaWeights, d.N, d.C, 2 * d.I, w.xn2, p.wgu, nullptr, nullptr, w.gu));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kGateUpProduct, w.xn2, d.N, w.gu, 2 * d.I));
  STRATA_RETURN_IF_ERROR(ops.Swiglu(w.gu, d.N, d.I, w.h, LlamaMlpActivation(c)));
  if (c.sandwich_norms) {
    // d = h Wd^T and its norm, side = RMS4(d): the backward needs d and rstd4.
    STRATA_RETURN_IF_ERROR(
        ops.Matmul(kLlamaWeights, d.N, d.I, d.C, w.h, p.wd, nullptr, nullptr, w.d));
    STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kDownProduct, w.h, d.N, w.d, d.C));
    STRATA_RETURN_IF_ERROR(
        ops.RmsNormForward(w.d, p.w_mlp_out, eps, d.N, d.C, w.side, w.rstd4, one));
  }
  return Status::Ok();
}

// x_out (N, C) = x2 + h Wd^T (sandwich norms: x2 + RMS4(h Wd^T)) after LlamaLayerForwardToSwiglu.
template <typename S, typename Ops>
Status LlamaLayerForwardBody(const Ops& ops, const LlamaConfig& c, int layer,
                             const LlamaLayerParams<const S*>& p, const S* x_in, S* x_out, int B,
                             int T, const LlamaLayerBuffers<S, typename Ops::F>& w,
                             const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                             int max_positions) {
  const LlamaDims d(c, B, T);
  STRATA_RETURN_IF_ERROR(LlamaLayerForwardToSwiglu(ops, c, layer, p, x_in, B, T, w, lora,
                                                   position_ids, max_positions));
  if (c.sandwich_norms) return ops.Add(w.x2, w.side, d.N * d.C, x_out);
  STRATA_RETURN_IF_ERROR(ops.Matmul(kLlamaWeights, d.N, d.I, d.C, w.h, p.wd, nullptr, w.x2, x_out));
  return ops.LoraForward(lora, kDownProduct, w.h, d.N, x_out, d.C);
}

// Recomputes the forward from x_in (unless forward_kept: `w` still holds what
// LlamaLayerForwardBody on the same inputs left there, activation checkpointing's kept layer),
// then dx_in (N, C) and dp (all null: no weight gradient, the frozen base of a LoRA run) from
// dx_out. The gradients overwrite dead activations as
// LlamaLayerScratchLayout says; dx2 lives in dx_in (so dx_in must not overlap x_in or dx_out).
template <typename S, typename Ops>
Status LlamaLayerBackwardBody(const Ops& ops, const LlamaConfig& c, int layer,
                              const LlamaLayerParams<const S*>& p, const S* x_in, const S* dx_out,
                              S* dx_in, const LlamaLayerParams<S*>& dp, int B, int T,
                              const LlamaLayerBuffers<S, typename Ops::F>& w,
                              const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                              bool forward_kept, int max_positions) {
  const LlamaDims d(c, B, T);
  const bool one = c.norm_unit_offset;
  if (!forward_kept) {
    STRATA_RETURN_IF_ERROR(LlamaLayerForwardToSwiglu(ops, c, layer, p, x_in, B, T, w, lora,
                                                     position_ids, max_positions));
  }
  const S* dy = dx_out;

  // Sandwich norms: y = x2 + RMS4(d), dd = RMS4'(dy) (N, C) into side (dead after the forward).
  const S* d_down = dy;
  if (c.sandwich_norms) {
    STRATA_RETURN_IF_ERROR(ops.RmsNormBackward(w.d, p.w_mlp_out, w.rstd4, dy, nullptr, d.N, d.C,
                                               w.side, dp.w_mlp_out, one));
    d_down = w.side;
  }
  // Down projection (x2 +) h Wd^T: dh (N, I) into the gradient buffer.
  S* dh = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.I, d.C, w.h, d_down, dp.wd, nullptr));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.I, d.C, d_down, p.wd, dh));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kDownProduct, w.h, d_down, d.N, d.C, dh));
  // SwiGLU (GeGLU): [dgate | dup] in place over gu.
  S* dgu = w.gu;
  STRATA_RETURN_IF_ERROR(ops.SwigluBackward(w.gu, dh, d.N, d.I, dgu, LlamaMlpActivation(c)));
  // Gate/up projection gu = xn2 Wgu^T: dxn2 (N, C) into the gradient buffer (dh is dead).
  S* dxn2 = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.C, 2 * d.I, w.xn2, dgu, dp.wgu, nullptr));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.C, 2 * d.I, dgu, p.wgu, dxn2));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGateUpProduct, w.xn2, dgu, d.N, 2 * d.I, dxn2));
  // The MLP's input RMSNorm and the MLP residual: dx2 = S(dy + RMS2'(dxn2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(
      ops.RmsNormBackward(w.x2, p.w_post, w.rstd2, dxn2, dy, d.N, d.C, dx_in, dp.w_post, one));
  const S* dx2 = dx_in;
  // Sandwich norms: x2 = x + RMS3(o), do = RMS3'(dx2) (N, C) into side (dd is dead).
  const S* d_out_proj = dx2;
  if (c.sandwich_norms) {
    STRATA_RETURN_IF_ERROR(ops.RmsNormBackward(w.o, p.w_attn_out, w.rstd3, dx2, nullptr, d.N, d.C,
                                               w.side, dp.w_attn_out, one));
    d_out_proj = w.side;
  }
  // Output projection (x +) att Wo^T (+ bo): datt (N, Dq) into the gradient buffer (dxn2 is
  // dead).
  S* datt = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.Dq, d.C, w.att, d_out_proj, dp.wo, dp.bo));
  STRATA_RETURN_IF_ERROR(
      ops.MatmulInputGrad(kLlamaWeights, d.N, d.Dq, d.C, d_out_proj, p.wo, datt));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kOutProduct, w.att, d_out_proj, d.N, d.C, datt));
  // Attention: [dq | dk | dv] (N, Dqkv), then RoPE's inverse rotation of dq and dk.
  STRATA_RETURN_IF_ERROR(ops.AttentionBackward(
      LlamaAttentionDims(c, layer, B, T, position_ids), w.qkv, w.qkv + d.Dq, w.qkv + d.Dq + d.Dkv,
      w.att, datt, w.lse, w.delta, w.dqkv, w.dqkv + d.Dq, w.dqkv + d.Dq + d.Dkv));
  STRATA_RETURN_IF_ERROR(ops.Rope(w.dqkv, d.N, d.Dqkv, c.num_heads + c.num_kv_heads, c.head_dim, T,
                                  w.cos, w.sin, /*inverse=*/true, position_ids, LlamaRotaryDim(c)));
  // The per-head q/k norms: dq and dk through them, in place, and their weights' gradient.
  if (c.qk_norm) {
    STRATA_RETURN_IF_ERROR(ops.HeadRmsNormBackward(w.qk_raw, d.N, c.num_heads + c.num_kv_heads,
                                                   c.num_heads, d.hs, p.qk_norm, w.qk_rstd, w.dqkv,
                                                   d.Dqkv, dp.qk_norm, one));
  }
  // q/k/v projection qkv = xn Wqkv^T (+ bqkv): dxn (N, C) into the gradient buffer (datt is dead).
  S* dxn = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.C, d.Dqkv, w.xn, w.dqkv, dp.wqkv, dp.bqkv));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.C, d.Dqkv, w.dqkv, p.wqkv, dxn));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kQkvProduct, w.xn, w.dqkv, d.N, d.Dqkv, dxn));
  // Input RMSNorm and the attention residual: dx = S(dx2 + RMS1'(dxn)), in place over dx2.
  return ops.RmsNormBackward(x_in, p.w_in, w.rstd1, dxn, dx2, d.N, d.C, dx_in, dp.w_in, one);
}

}  // namespace strata::models
