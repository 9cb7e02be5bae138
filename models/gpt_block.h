// The GPT layer's forward and backward, written ONCE over an ops backend (the ggml lesson: a
// model is written once, backends implement ops): `ops` is ops::HostOps<S> (models/ops/
// host_ops.h; models/gpt_kernels.cc) or ops::cuda::CudaOps<S> (models/ops/cuda/cuda_ops.cuh;
// models/cuda/gpt_cuda.cu), whose member functions have one signature. Each function reads as
// the list of op calls with their shapes; the rounding points are the ops' (models/
// gpt_kernels.h, "Storage and rounding"), and the buffers those of the one scratch layout
// (GptLayerScratchLayout, models/gpt_layout.h). Plain C++: nvcc compiles it too.
//
// Shapes as gpt_kernels.h: N = B T rows, C channels; params a layer chunk; x (N, C). Returns the
// first error of an op (the host ops return Ok and STRATA_CHECK instead). With `lora` active
// every targeted product adds its adapter's output, and the backward takes the adapters'
// gradients and their share of dx (models/lora.h).
#pragma once

#include <cstdint>

#include "base/status.h"
#include "models/gpt_kernels.h"
#include "models/gpt_layout.h"
#include "models/lora.h"
#include "models/ops/attention.h"
#include "models/ops/matmul.h"
#include "models/scratch_layout.h"

namespace strata::models {

// The GPT's weights are (in, out), y = x W (Hugging Face GPT-2's Conv1D).
inline constexpr ops::WeightLayout kGptWeights = ops::WeightLayout::kInOut;

// The layer scratch (GptLayerScratchLayout) at `scratch` as typed pointers; F the ops'
// statistics type (Ops::F).
template <typename S, typename F>
struct GptLayerBuffers {
  F *mean1, *rstd1, *mean2, *rstd2, *lse, *delta;
  S *ln1, *qkv, *att, *x2, *ln2, *h, *g, *dln;
  GptLayerBuffers(const GptLayerScratchLayout& l, void* scratch)
      : mean1(RegionAt<F>(scratch, l.mean1)),
        rstd1(RegionAt<F>(scratch, l.rstd1)),
        mean2(RegionAt<F>(scratch, l.mean2)),
        rstd2(RegionAt<F>(scratch, l.rstd2)),
        lse(RegionAt<F>(scratch, l.lse)),
        delta(RegionAt<F>(scratch, l.delta)),
        ln1(RegionAt<S>(scratch, l.ln1)),
        qkv(RegionAt<S>(scratch, l.qkv)),
        att(RegionAt<S>(scratch, l.att)),
        x2(RegionAt<S>(scratch, l.x2)),
        ln2(RegionAt<S>(scratch, l.ln2)),
        h(RegionAt<S>(scratch, l.h)),
        g(RegionAt<S>(scratch, l.g)),
        dln(RegionAt<S>(scratch, l.dln)) {}
};

// Attention over the fused qkv (N, 3C): q, k, v its column blocks, H = Hkv heads of C / H;
// position_ids (B, T) or null (packed sequences).
inline ops::AttentionDims GptAttentionDims(const GptShape& s, int B, int T,
                                           const int32_t* position_ids) {
  return {
      B,           T, s.num_heads, s.num_heads, s.channels / s.num_heads, 3 * int64_t{s.channels},
      position_ids};
}

// The forward up to the GELU output g (all the backward needs), every value in the scratch:
//   ln1 = LN1(x); qkv = ln1 Wqkv + bqkv; att = attention(q, k, v) (+ lse); x2 = x + att Wo + bo;
//   ln2 = LN2(x2); h = ln2 Wfc + bfc, g = gelu(h) (one fused product without an adapter on c_fc;
//   with one, the adapter adds to h and the GELU runs on its rounded value).
template <typename S, typename Ops>
Status GptLayerForwardToGelu(const Ops& ops, const GptShape& s, const LayerParams<const S*>& p,
                             const S* x, int B, int T, const GptLayerBuffers<S, typename Ops::F>& w,
                             const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  const int64_t C = s.channels, N = int64_t{B} * T;
  const double eps = s.layer_norm_eps;
  STRATA_RETURN_IF_ERROR(
      ops.LayerNormForward(x, p.ln1_w, p.ln1_b, eps, N, C, w.ln1, w.mean1, w.rstd1));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kGptWeights, N, C, 3 * C, w.ln1, p.qkv_w, p.qkv_b, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kGptAttnProduct, w.ln1, N, w.qkv, 3 * C));
  STRATA_RETURN_IF_ERROR(ops.Attention(GptAttentionDims(s, B, T, position_ids), w.qkv, w.qkv + C,
                                       w.qkv + 2 * C, w.att, w.lse));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kGptWeights, N, C, C, w.att, p.attn_proj_w, p.attn_proj_b, x, w.x2));
  STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kGptAttnProjProduct, w.att, N, w.x2, C));
  STRATA_RETURN_IF_ERROR(
      ops.LayerNormForward(w.x2, p.ln2_w, p.ln2_b, eps, N, C, w.ln2, w.mean2, w.rstd2));
  if (LoraAddsTo(lora, kGptFcProduct)) {
    STRATA_RETURN_IF_ERROR(
        ops.Matmul(kGptWeights, N, C, 4 * C, w.ln2, p.fc_w, p.fc_b, nullptr, w.h));
    STRATA_RETURN_IF_ERROR(ops.LoraForward(lora, kGptFcProduct, w.ln2, N, w.h, 4 * C));
    return ops.Gelu(w.h, N * 4 * C, w.g);
  }
  return ops.MatmulGelu(kGptWeights, N, C, 4 * C, w.ln2, p.fc_w, p.fc_b, w.h, w.g);
}

// x_out (N, C) = x2 + g Wp + bp after GptLayerForwardToGelu.
template <typename S, typename Ops>
Status GptLayerForwardBody(const Ops& ops, const GptShape& s, const LayerParams<const S*>& p,
                           const S* x_in, S* x_out, int B, int T,
                           const GptLayerBuffers<S, typename Ops::F>& w,
                           const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  const int64_t C = s.channels, N = int64_t{B} * T;
  STRATA_RETURN_IF_ERROR(GptLayerForwardToGelu(ops, s, p, x_in, B, T, w, lora, position_ids));
  STRATA_RETURN_IF_ERROR(
      ops.Matmul(kGptWeights, N, 4 * C, C, w.g, p.mlp_proj_w, p.mlp_proj_b, w.x2, x_out));
  return ops.LoraForward(lora, kGptMlpProjProduct, w.g, N, x_out, C);
}

// Recomputes the forward from x_in (unless forward_kept: `w` still holds what
// GptLayerForwardBody on the same inputs left there, activation checkpointing's kept layer), then
// dx_in (N, C) and dp (all null: no weight gradient, the frozen base of a LoRA run) from dx_out.
// The gradients overwrite dead activations as GptLayerScratchLayout says; dx2 lives in dx_in (so
// dx_in must not overlap x_in or dx_out).
template <typename S, typename Ops>
Status GptLayerBackwardBody(const Ops& ops, const GptShape& s, const LayerParams<const S*>& p,
                            const S* x_in, const S* dx_out, S* dx_in, const LayerParams<S*>& dp,
                            int B, int T, const GptLayerBuffers<S, typename Ops::F>& w,
                            const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                            bool forward_kept) {
  const int64_t C = s.channels, N = int64_t{B} * T;
  if (!forward_kept) {
    STRATA_RETURN_IF_ERROR(GptLayerForwardToGelu(ops, s, p, x_in, B, T, w, lora, position_ids));
  }
  const S* dy = dx_out;
  S* dh = w.g;    // over g, dead after the mlp_proj_w gradient
  S* dqkv = w.h;  // over h, dead after the GELU's input gradient
  S* dln = w.dln;

  // MLP projection y = x2 + g Wp + bp through g = gelu(h): dh = S((dy Wp^T) gelu'(h)).
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kGptWeights, N, 4 * C, C, w.g, dy, dp.mlp_proj_w, dp.mlp_proj_b));
  if (LoraAddsTo(lora, kGptMlpProjProduct)) {
    // The adapter's share of dg joins before GELU's derivative: dg in the adapters' scratch.
    S* dg = LoraGradBuffer(lora, N);
    STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kGptWeights, N, 4 * C, C, dy, p.mlp_proj_w, dg));
    STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGptMlpProjProduct, w.g, dy, N, C, dg));
    STRATA_RETURN_IF_ERROR(ops.GeluBackward(w.h, dg, N * 4 * C, dh));
  } else {
    STRATA_RETURN_IF_ERROR(ops.MatmulGeluInputGrad(kGptWeights, N, 4 * C, C, dy, p.mlp_proj_w, w.h,
                                                   reinterpret_cast<float*>(dln),
                                                   GeluAccRows(N, sizeof(S)), dh));
  }
  // MLP fc h = ln2 Wfc + bfc: dln2.
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kGptWeights, N, C, 4 * C, w.ln2, dh, dp.fc_w, dp.fc_b));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kGptWeights, N, C, 4 * C, dh, p.fc_w, dln));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGptFcProduct, w.ln2, dh, N, 4 * C, dln));
  // LayerNorm 2 and the MLP residual: dx2 = S(dy + LN2'(dln2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(ops.LayerNormBackward(w.x2, p.ln2_w, w.mean2, w.rstd2, dln, dy, N, C,
                                               dx_in, dp.ln2_w, dp.ln2_b));
  const S* dx2 = dx_in;

  // Attention projection x2 = x + att Wo + bo: datt.
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kGptWeights, N, C, C, w.att, dx2, dp.attn_proj_w, dp.attn_proj_b));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kGptWeights, N, C, C, dx2, p.attn_proj_w, dln));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGptAttnProjProduct, w.att, dx2, N, C, dln));
  // Attention core: dq, dk, dv as the column blocks of dqkv.
  STRATA_RETURN_IF_ERROR(ops.AttentionBackward(GptAttentionDims(s, B, T, position_ids), w.qkv,
                                               w.qkv + C, w.qkv + 2 * C, w.att, dln, w.lse, w.delta,
                                               dqkv, dqkv + C, dqkv + 2 * C));
  // qkv = ln1 Wqkv + bqkv: dln1.
  STRATA_RETURN_IF_ERROR(
      ops.MatmulWeightGrad(kGptWeights, N, C, 3 * C, w.ln1, dqkv, dp.qkv_w, dp.qkv_b));
  STRATA_RETURN_IF_ERROR(ops.MatmulInputGrad(kGptWeights, N, C, 3 * C, dqkv, p.qkv_w, dln));
  STRATA_RETURN_IF_ERROR(ops.LoraBackward(lora, kGptAttnProduct, w.ln1, dqkv, N, 3 * C, dln));
  // LayerNorm 1 and the attention residual: dx = S(dx2 + LN1'(dln1)), in place over dx2.
  return ops.LayerNormBackward(x_in, p.ln1_w, w.mean1, w.rstd1, dln, dx2, N, C, dx_in, dp.ln1_w,
                               dp.ln1_b);
}

}  // namespace strata::models
