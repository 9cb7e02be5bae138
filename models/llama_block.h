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

#include <cstdint>

#include "base/status.h"
#include "models/llama_config.h"
#include "models/llama_kernels.h"
#include "models/llama_layout.h"
#include "models/lora.h"
#include "models/ops/attention.h"
#include "models/ops/matmul.h"
#include "models/scratch_layout.h"

namespace strata::models {

// Llama's weights are (out, in), y = x W^T (torch.nn.Linear).
inline constexpr ops::WeightLayout kLlamaWeights = ops::WeightLayout::kOutIn;

// The layer scratch (LlamaLayerScratchLayout) at `scratch` as typed pointers; F the ops'
// statistics type (Ops::F).
template <typename S, typename F>
struct LlamaLayerBuffers {
  F *rstd1, *rstd2, *lse, *delta, *cos, *sin, *qk_rstd;
  S *xn, *qkv, *att, *x2, *xn2, *gu, *h, *grad, *dqkv, *qk_raw;
  LlamaLayerBuffers(const LlamaLayerScratchLayout& l, void* s)
      : rstd1(RegionAt<F>(s, l.rstd1)),
        rstd2(RegionAt<F>(s, l.rstd2)),
        lse(RegionAt<F>(s, l.lse)),
        delta(RegionAt<F>(s, l.delta)),
        cos(RegionAt<F>(s, l.cos)),
        sin(RegionAt<F>(s, l.sin)),
        qk_rstd(RegionAt<F>(s, l.qk_rstd)),
        xn(RegionAt<S>(s, l.xn)),
        qkv(RegionAt<S>(s, l.qkv)),
        att(RegionAt<S>(s, l.att)),
        x2(RegionAt<S>(s, l.x2)),
        xn2(RegionAt<S>(s, l.xn2)),
        gu(RegionAt<S>(s, l.gu)),
        h(RegionAt<S>(s, l.h)),
        grad(RegionAt<S>(s, l.grad)),
        dqkv(RegionAt<S>(s, l.dqkv)),
        qk_raw(RegionAt<S>(s, l.qk_raw)) {}
};

// Grouped-query attention of `layer` over the rows [q | k | v] of qkv (N, Dqkv); position_ids
// (B, T) or null (packed sequences); the layer's sliding window where it is shorter than T (a
// window of T or more masks nothing).
inline ops::AttentionDims LlamaAttentionDims(const LlamaConfig& c, int layer, int B, int T,
                                             const int32_t* position_ids) {
  ops::AttentionDims a{
      B, T, c.num_heads, c.num_kv_heads, c.head_dim, LlamaDims(c, B, T).Dqkv, position_ids};
  const int window = LlamaLayerWindow(c, layer);
  a.window = window < T ? window : 0;
  return a;
}

// The forward up to the SwiGLU output h (all the backward needs), every value in the scratch:
//   xn = RMS1(x); qkv = xn Wqkv^T (+ bqkv); [qk_norm: each q and k head RMS-normalised, the
//   inputs kept in qk_raw]; RoPE on q and k; att = attention (+ lse; the layer's window);
//   x2 = x + att Wo^T (+ bo); xn2 = RMS2(x2); gu = xn2 Wgu^T; h = SwiGLU(gu).
template <typename S, typename Ops>
Status LlamaLayerForwardToSwiglu(const Ops& ops, const LlamaConfig& c, int layer,
                                 const LlamaLayerParams<const S*>& p, const S* x, int B, int T,
                                 const LlamaLayerBuffers<S, typename Ops::F>& w,
                                 const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  const LlamaDims d(c, B, T);
  const int rope_heads = c.num_heads + c.num_kv_heads;
  STRATA_RETURN_IF_ERROR(ops.RmsNormForward(x, p.w_in, c.rms_norm_eps, d.N, d.C, w.xn, w.rstd1));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kLlamaWeights, d.N, d.C, d.Dqkv, w.xn, p.wqkv, p.bqkv, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kQkvProduct, w.xn, d.N, w.qkv, d.Dqkv));
  if (c.qk_norm) {
    STRATA_RETURN_IF_ERROR(ops.HeadRmsNormForward(w.qkv, d.Dqkv, d.N, rope_heads, c.num_heads, d.hs,
                                                  p.qk_norm, c.rms_norm_eps, w.qk_raw, w.qk_rstd));
  }
  STRATA_RETURN_IF_ERROR(ops.RopeTable(LlamaRopeParams(c), T, w.cos, w.sin));
  STRATA_RETURN_IF_ERROR(ops.Rope(w.qkv, d.N, d.Dqkv, rope_heads, c.head_dim, T, w.cos, w.sin,
                                  /*inverse=*/false, position_ids));
  STRATA_RETURN_IF_ERROR(ops.Attention(LlamaAttentionDims(c, layer, B, T, position_ids), w.qkv,
                                       w.qkv + d.Dq, w.qkv + d.Dq + d.Dkv, w.att, w.lse));
  STRATA_RETURN_IF_ERROR(ops.Matmul(kLlamaWeights, d.N, d.Dq, d.C, w.att, p.wo, p.bo, x, w.x2));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kOutProduct, w.att, d.N, w.x2, d.C));
  STRATA_RETURN_IF_ERROR(
      ops.RmsNormForward(w.x2, p.w_post, c.rms_norm_eps, d.N, d.C, w.xn2, w.rstd2));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kLlamaWeights, d.N, d.C, 2 * d.I, w.xn2, p.wgu, nullptr, nullptr, w.gu));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kGateUpProduct, w.xn2, d.N, w.gu, 2 * d.I));
  return ops.Swiglu(w.gu, d.N, d.I, w.h);
}

// x_out (N, C) = x2 + h Wd^T after LlamaLayerForwardToSwiglu.
template <typename S, typename Ops>
Status LlamaLayerForwardBody(const Ops& ops, const LlamaConfig& c, int layer,
                             const LlamaLayerParams<const S*>& p, const S* x_in, S* x_out, int B,
                             int T, const LlamaLayerBuffers<S, typename Ops::F>& w,
                             const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  const LlamaDims d(c, B, T);
  STRATA_RETURN_IF_ERROR(
      LlamaLayerForwardToSwiglu(ops, c, layer, p, x_in, B, T, w, lora, position_ids));
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
                              bool forward_kept) {
  const LlamaDims d(c, B, T);
  if (!forward_kept) {
    STRATA_RETURN_IF_ERROR(
        LlamaLayerForwardToSwiglu(ops, c, layer, p, x_in, B, T, w, lora, position_ids));
  }
  const S* dy = dx_out;

  // Down projection y = x2 + h Wd^T: dh (N, I) into the gradient buffer.
  S* dh = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.I, d.C, w.h, dy, dp.wd, nullptr));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.I, d.C, dy, p.wd, dh));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kDownProduct, w.h, dy, d.N, d.C, dh));
  // SwiGLU: [dgate | dup] in place over gu.
  S* dgu = w.gu;
  STRATA_RETURN_IF_ERROR(ops.SwigluBackward(w.gu, dh, d.N, d.I, dgu));
  // Gate/up projection gu = xn2 Wgu^T: dxn2 (N, C) into the gradient buffer (dh is dead).
  S* dxn2 = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.C, 2 * d.I, w.xn2, dgu, dp.wgu, nullptr));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.C, 2 * d.I, dgu, p.wgu, dxn2));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGateUpProduct, w.xn2, dgu, d.N, 2 * d.I, dxn2));
  // Post-attention RMSNorm and the MLP residual: dx2 = S(dy + RMS2'(dxn2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(
      ops.RmsNormBackward(w.x2, p.w_post, w.rstd2, dxn2, dy, d.N, d.C, dx_in, dp.w_post));
  const S* dx2 = dx_in;
  // Output projection x2 = x + att Wo^T: datt (N, Dq) into the gradient buffer (dxn2 is dead).
  S* datt = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.Dq, d.C, w.att, dx2, dp.wo, dp.bo));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.Dq, d.C, dx2, p.wo, datt));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kOutProduct, w.att, dx2, d.N, d.C, datt));
  // Attention: [dq | dk | dv] (N, Dqkv), then RoPE's inverse rotation of dq and dk.
  STRATA_RETURN_IF_ERROR(ops.AttentionBackward(
      LlamaAttentionDims(c, layer, B, T, position_ids), w.qkv, w.qkv + d.Dq, w.qkv + d.Dq + d.Dkv,
      w.att, datt, w.lse, w.delta, w.dqkv, w.dqkv + d.Dq, w.dqkv + d.Dq + d.Dkv));
  STRATA_RETURN_IF_ERROR(ops.Rope(w.dqkv, d.N, d.Dqkv, c.num_heads + c.num_kv_heads, c.head_dim, T,
                                  w.cos, w.sin, /*inverse=*/true, position_ids));
  // The per-head q/k norms: dq and dk through them, in place, and their weights' gradient.
  if (c.qk_norm) {
    STRATA_RETURN_IF_ERROR(ops.HeadRmsNormBackward(w.qk_raw, d.N, c.num_heads + c.num_kv_heads,
                                                   c.num_heads, d.hs, p.qk_norm, w.qk_rstd, w.dqkv,
                                                   d.Dqkv, dp.qk_norm));
  }
  // q/k/v projection qkv = xn Wqkv^T (+ bqkv): dxn (N, C) into the gradient buffer (datt is dead).
  S* dxn = w.grad;
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kLlamaWeights, d.N, d.C, d.Dqkv, w.xn, w.dqkv, dp.wqkv, dp.bqkv));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kLlamaWeights, d.N, d.C, d.Dqkv, w.dqkv, p.wqkv, dxn));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kQkvProduct, w.xn, w.dqkv, d.N, d.Dqkv, dxn));
  // Input RMSNorm and the attention residual: dx = S(dx2 + RMS1'(dxn)), in place over dx2.
  return ops.RmsNormBackward(x_in, p.w_in, w.rstd1, dxn, dx2, d.N, d.C, dx_in, dp.w_in);
}

}  // namespace strata::models
