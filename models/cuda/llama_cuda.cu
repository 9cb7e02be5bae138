// The Llama blocks on CUDA (llama_cuda.h): each a list of calls to the CUDA ops of
// models/ops/cuda/ops.cuh (products through its cuBLASLt wrapper) over all N = B T rows at once,
// with the rounding points of models/llama_kernels.h and the scratch layout of
// llama_cuda_layout.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "models/cuda/llama_cuda.h"
#include "models/cuda/llama_cuda_layout.h"
#include "models/cuda/lora_cuda.cuh"
#include "models/llama_kernels.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::cuda {
namespace {

namespace oc = ::strata::models::ops::cuda;

using oc::internal::At;
using oc::internal::CheckPointers;
using oc::internal::D;
using oc::internal::Dev;
using ops::WeightLayout;

// Llama's weights are (out, in), y = x W^T (torch.nn.Linear).
constexpr WeightLayout kOutIn = WeightLayout::kOutIn;

StatusOr<cudaStream_t> Prepare(const char* what, const LlamaConfig& c, gpu::Stream& stream, int B,
                               int T, const void* scratch) {
  STRATA_RETURN_IF_ERROR(ValidateLlamaConfig(c));
  if (c.head_dim > oc::kAttentionMaxHeadDim) {
    return InvalidArgumentError(std::string(what) +
                                ": the CUDA attention takes head_dim <= 128, got " +
                                std::to_string(c.head_dim));
  }
  return oc::internal::PrepareBlockCall(what, stream, B, T, c.max_seq_len, scratch);
}

template <typename S>
using Products = oc::Products<S>;

template <typename S>
StatusOr<Products<S>> MakeProducts(gpu::Stream& stream, cudaStream_t cs) {
  return Products<S>::Make(stream, cs);
}

// The sizes of a block call.
struct Sizes {
  int64_t N, C, I, H, Hkv, hs, Dq, Dkv, Dqkv, V;
  Sizes(const LlamaConfig& c, int B, int T)
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

// The tensors of a layer chunk (llama_config.h LlamaLayerTensors: input_layernorm, q, k, v,
// o, post_attention_layernorm, gate, up, down).
template <typename P>
struct LayerParams {
  P w_in, wqkv, wo, w_post, wgu, wd;
  // base null (a backward that computes no weight gradient: LoRA's frozen layer): all null.
  LayerParams(const LlamaConfig& c, P base) {
    if (base == nullptr) {
      w_in = wqkv = wo = w_post = wgu = wd = nullptr;
      return;
    }
    const std::vector<LlamaTensor> t = LlamaLayerTensors(c, 0);
    w_in = base + t[0].offset;
    wqkv = base + t[1].offset;
    wo = base + t[4].offset;
    w_post = base + t[5].offset;
    wgu = base + t[6].offset;
    wd = base + t[8].offset;
  }
};

template <typename S>
struct LayerBuffers {
  S *xn, *qkv, *att, *x2, *xn2, *gu, *h, *grad, *dqkv;
  float *rstd1, *rstd2, *lse, *delta, *cos, *sin, *partials;
  LayerBuffers(const LlamaCudaLayerScratchLayout& l, void* s)
      : xn(At<S>(s, l.xn)),
        qkv(At<S>(s, l.qkv)),
        att(At<S>(s, l.att)),
        x2(At<S>(s, l.x2)),
        xn2(At<S>(s, l.xn2)),
        gu(At<S>(s, l.gu)),
        h(At<S>(s, l.h)),
        grad(At<S>(s, l.grad)),
        dqkv(At<S>(s, l.dqkv)),
        rstd1(At<float>(s, l.rstd1)),
        rstd2(At<float>(s, l.rstd2)),
        lse(At<float>(s, l.lse)),
        delta(At<float>(s, l.delta)),
        cos(At<float>(s, l.cos)),
        sin(At<float>(s, l.sin)),
        partials(At<float>(s, l.partials)) {}
};

// position_ids (B, T) or null (packed sequences).
ops::AttentionDims AttentionDimsOf(const Sizes& z, int B, int T, const int32_t* position_ids) {
  ops::AttentionDims d{
      B, T, static_cast<int>(z.H), static_cast<int>(z.Hkv), static_cast<int>(z.hs), z.Dqkv};
  d.position_ids = position_ids;
  return d;
}

// The layer forward into the scratch: xn, qkv (rotated), att, lse, x2, xn2, gu, h; with x_out
// non-null also the layer output. The adapters of `lora` add to each targeted product's output.
template <typename S>
Status LayerForwardInto(const LlamaConfig& c, cudaStream_t cs, const Products<S>& mm,
                        const LayerParams<const S*>& p, const S* x, int B, int T,
                        const int32_t* position_ids, const LayerBuffers<S>& w, S* x_out,
                        const LoraLayerArgs<S>& lora) {
  const Sizes z(c, B, T);
  const float eps = static_cast<float>(c.rms_norm_eps);
  STRATA_RETURN_IF_ERROR(
      oc::LaunchRmsNormForward(cs, D(x), D(p.w_in), eps, z.N, z.C, D(w.xn), w.rstd1));
  STRATA_RETURN_IF_ERROR(
      mm.Forward(kOutIn, z.N, z.C, z.Dqkv, w.xn, p.wqkv, nullptr, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kQkvProduct, w.xn, z.N, w.qkv, z.Dqkv));
  STRATA_RETURN_IF_ERROR(oc::LaunchRopeTable(cs, LlamaRopeParams(c), T, w.cos, w.sin));
  STRATA_RETURN_IF_ERROR(oc::LaunchRope(cs, D(w.qkv), z.N, z.Dqkv, static_cast<int>(z.H + z.Hkv),
                                        static_cast<int>(z.hs), T, w.cos, w.sin, false,
                                        position_ids));
  const Dev<S>* qkv = D(w.qkv);
  STRATA_RETURN_IF_ERROR(oc::LaunchAttentionForward(cs, AttentionDimsOf(z, B, T, position_ids), qkv,
                                                    qkv + z.Dq, qkv + z.Dq + z.Dkv, D(w.att),
                                                    w.lse));
  STRATA_RETURN_IF_ERROR(mm.Forward(kOutIn, z.N, z.Dq, z.C, w.att, p.wo, nullptr, x, w.x2));
  STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kOutProduct, w.att, z.N, w.x2, z.C));
  STRATA_RETURN_IF_ERROR(
      oc::LaunchRmsNormForward(cs, D(w.x2), D(p.w_post), eps, z.N, z.C, D(w.xn2), w.rstd2));
  STRATA_RETURN_IF_ERROR(
      mm.Forward(kOutIn, z.N, z.C, 2 * z.I, w.xn2, p.wgu, nullptr, nullptr, w.gu));
  STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kGateUpProduct, w.xn2, z.N, w.gu, 2 * z.I));
  STRATA_RETURN_IF_ERROR(oc::LaunchSwigluForward(cs, D(w.gu), z.N, z.I, D(w.h)));
  if (x_out == nullptr) return Status::Ok();
  STRATA_RETURN_IF_ERROR(mm.Forward(kOutIn, z.N, z.I, z.C, w.h, p.wd, nullptr, w.x2, x_out));
  return LoraCudaForward(mm, lora, kDownProduct, w.h, z.N, x_out, z.C);
}

// The chunked head's part of the head scratch.
template <typename S>
oc::HeadScratch<S> HeadScratchOf(const LlamaCudaHeadScratchLayout& l, void* scratch) {
  return {l.chunk_rows, At<S>(scratch, l.chunk), At<float>(scratch, l.losses),
          At<S>(scratch, l.xn_last), At<void>(scratch, l.dw_acc)};
}

}  // namespace

Status LlamaCudaPrepareStream(gpu::Stream& stream) { return oc::PrepareStream(stream); }

template <typename S>
Status LlamaCudaEmbeddingForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                                 const int32_t* tokens, int B, int T, S* x_out) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaEmbeddingForward", c, stream, B, T, nullptr));
  STRATA_RETURN_IF_ERROR(CheckPointers("LlamaCudaEmbeddingForward", {params, tokens, x_out}));
  return oc::LaunchEmbeddingForward<Dev<S>>(cs, D(params), nullptr, tokens, int64_t{B} * T, T,
                                            c.hidden_size, c.vocab_size, D(x_out));
}

template <typename S>
Status LlamaCudaEmbeddingBackward(const LlamaConfig& c, gpu::Stream& stream, const int32_t* tokens,
                                  const S* dx_out, int B, int T, S* dparams, void* scratch) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaEmbeddingBackward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LlamaCudaEmbeddingBackward", {tokens, dx_out, dparams, scratch}));
  const CudaEmbeddingScratchLayout l = LlamaCudaEmbeddingScratchLayoutFor(c, B, T);
  const oc::CountingSortScratch by_token{
      At<int32_t>(scratch, l.counts), At<int32_t>(scratch, l.offsets),
      At<int32_t>(scratch, l.cursor), At<int32_t>(scratch, l.order)};
  return oc::LaunchEmbeddingBackward<Dev<S>>(cs, tokens, D(dx_out), int64_t{B} * T, T,
                                             c.hidden_size, c.vocab_size, c.max_seq_len, D(dparams),
                                             nullptr, by_token);
}

template <typename S>
Status LlamaCudaLayerForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* x_in, S* x_out, int B, int T, void* scratch,
                             const int32_t* position_ids, const LoraLayerArgs<S>& lora) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaLayerForward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("LlamaCudaLayerForward", {params, x_in, x_out, scratch}));
  const LayerBuffers<S> w(LlamaCudaLayerScratchLayoutFor<S>(c, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const LayerParams<const S*> p(c, params);
  return LayerForwardInto<S>(c, cs, mm, p, x_in, B, T, position_ids, w, x_out, lora);
}

template <typename S>
Status LlamaCudaLayerBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                              const S* x_in, const S* dx_out, S* dx_in, S* dparams, int B, int T,
                              void* scratch, const int32_t* position_ids,
                              const LoraLayerArgs<S>& lora, bool forward_kept) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaLayerBackward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LlamaCudaLayerBackward", {params, x_in, dx_out, dx_in, scratch}));
  if (dparams == nullptr && !lora.active()) {
    return InvalidArgumentError("LlamaCudaLayerBackward: dparams is null and no adapters train");
  }
  const Sizes z(c, B, T);
  const LayerBuffers<S> w(LlamaCudaLayerScratchLayoutFor<S>(c, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const LayerParams<const S*> p(c, params);
  const LayerParams<S*> dp(c, dparams);
  if (!forward_kept) {
    STRATA_RETURN_IF_ERROR(
        LayerForwardInto<S>(c, cs, mm, p, x_in, B, T, position_ids, w, nullptr, lora));
  }
  const S* dy = dx_out;
  const bool weight_grads = dparams != nullptr;  // null: the frozen base of a LoRA run

  // MLP: y = x2 + h Wd^T, h = SwiGLU(gu), gu = xn2 Wgu^T.
  if (weight_grads) STRATA_RETURN_IF_ERROR(mm.WeightGrad(kOutIn, z.N, z.I, z.C, w.h, dy, dp.wd));
  S* dh = w.grad;
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, z.N, z.I, z.C, dy, p.wd, dh));
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kDownProduct, w.h, dy, z.N, z.C, dh));
  S* dgu = w.gu;  // in place over gu
  STRATA_RETURN_IF_ERROR(oc::LaunchSwigluBackward(cs, D(w.gu), D(dh), z.N, z.I, D(dgu)));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kOutIn, z.N, z.C, 2 * z.I, w.xn2, dgu, dp.wgu));
  }
  S* dxn2 = w.grad;  // dh is dead
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, z.N, z.C, 2 * z.I, dgu, p.wgu, dxn2));
  STRATA_RETURN_IF_ERROR(
      LoraCudaBackward(mm, lora, kGateUpProduct, w.xn2, dgu, z.N, 2 * z.I, dxn2));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormWeightGrad(cs, D(w.x2), w.rstd2, D(dxn2), z.N, z.C,
                                                       w.partials, D(dp.w_post)));
  }
  // dx2 = S(dy + RMS2'(dxn2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormBackward(cs, D(w.x2), D(p.w_post), w.rstd2, D(dxn2),
                                                   D(dy), z.N, z.C, D(dx_in)));
  const S* dx2 = dx_in;

  // Attention: x2 = x + att Wo^T.
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kOutIn, z.N, z.Dq, z.C, w.att, dx2, dp.wo));
  }
  S* datt = w.grad;  // dxn2 is dead
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, z.N, z.Dq, z.C, dx2, p.wo, datt));
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kOutProduct, w.att, dx2, z.N, z.C, datt));
  const Dev<S>* qkv = D(w.qkv);
  Dev<S>* dqkv = D(w.dqkv);
  STRATA_RETURN_IF_ERROR(oc::LaunchAttentionBackward(
      cs, AttentionDimsOf(z, B, T, position_ids), qkv, qkv + z.Dq, qkv + z.Dq + z.Dkv, D(w.att),
      D(datt), w.lse, w.delta, dqkv, dqkv + z.Dq, dqkv + z.Dq + z.Dkv));
  STRATA_RETURN_IF_ERROR(oc::LaunchRope(cs, dqkv, z.N, z.Dqkv, static_cast<int>(z.H + z.Hkv),
                                        static_cast<int>(z.hs), T, w.cos, w.sin, true,
                                        position_ids));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kOutIn, z.N, z.C, z.Dqkv, w.xn, w.dqkv, dp.wqkv));
  }
  S* dxn = w.grad;  // datt is dead
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kOutIn, z.N, z.C, z.Dqkv, w.dqkv, p.wqkv, dxn));
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kQkvProduct, w.xn, w.dqkv, z.N, z.Dqkv, dxn));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormWeightGrad(cs, D(x_in), w.rstd1, D(dxn), z.N, z.C,
                                                       w.partials, D(dp.w_in)));
  }
  // dx = S(dx2 + RMS1'(dxn)), in place over dx2.
  return oc::LaunchRmsNormBackward(cs, D(x_in), D(p.w_in), w.rstd1, D(dxn), D(dx2), z.N, z.C,
                                   D(dx_in));
}

template <typename S>
Status LlamaCudaHeadForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                            const S* tied_params, const S* x_in, const int32_t* targets, int B,
                            int T, S* logits, void* scratch, float* loss, int64_t loss_tokens) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaHeadForward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("LlamaCudaHeadForward", {params, x_in, logits, scratch}));
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("LlamaCudaHeadForward", c.tie_embeddings,
                                                 tied_params, nullptr, false));
  const Sizes z(c, B, T);
  const LlamaCudaHeadScratchLayout l = LlamaCudaHeadScratchLayoutFor<S>(c, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const S* wlm = c.tie_embeddings ? tied_params : params + z.C;  // (V, C)
  S* xn = At<S>(scratch, l.xn);
  STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormForward(cs, D(x_in), D(params),
                                                  static_cast<float>(c.rms_norm_eps), z.N, z.C,
                                                  D(xn), At<float>(scratch, l.rstd)));
  return oc::ChunkedHeadForward<S>(mm, xn, wlm, kOutIn, B, T, z.C, z.V,
                                   HeadScratchOf<S>(l, scratch), logits, targets, loss,
                                   loss_tokens);
}

template <typename S>
Status LlamaCudaHeadBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* tied_params, const S* x_in, const int32_t* targets,
                             float dloss, int B, int T, S* dx_in, S* dparams, S* tied_grads,
                             void* scratch, int64_t loss_tokens) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaHeadBackward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LlamaCudaHeadBackward", {params, x_in, targets, dx_in, scratch}));
  const bool weight_grads = dparams != nullptr;  // null: the frozen head of a LoRA run
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("LlamaCudaHeadBackward", c.tie_embeddings,
                                                 tied_params, tied_grads, weight_grads));
  const Sizes z(c, B, T);
  const LlamaCudaHeadScratchLayout l = LlamaCudaHeadScratchLayoutFor<S>(c, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const bool tied = c.tie_embeddings;
  const S* wlm = tied ? tied_params : params + z.C;                       // (V, C)
  S* dwlm = !weight_grads ? nullptr : tied ? tied_grads : dparams + z.C;  // (V, C)
  const float* rstd = At<float>(scratch, l.rstd);
  S* xn = At<S>(scratch, l.xn);
  S* dxn = At<S>(scratch, l.dxn);
  STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormForward(cs, D(x_in), D(params),
                                                  static_cast<float>(c.rms_norm_eps), z.N, z.C,
                                                  D(xn), At<float>(scratch, l.rstd)));
  STRATA_RETURN_IF_ERROR(oc::ChunkedHeadBackward<S>(mm, xn, wlm, kOutIn, targets, dloss, z.N, z.C,
                                                    z.V, HeadScratchOf<S>(l, scratch), dwlm, dxn,
                                                    loss_tokens));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormWeightGrad(cs, D(x_in), rstd, D(dxn), z.N, z.C,
                                                       At<float>(scratch, l.partials), D(dparams)));
  }
  return oc::LaunchRmsNormBackward(cs, D(x_in), D(params), rstd, D(dxn),
                                   static_cast<const Dev<S>*>(nullptr), z.N, z.C, D(dx_in));
}

#define STRATA_INSTANTIATE_LLAMA_CUDA(S)                                                          \
  template Status LlamaCudaEmbeddingForward<S>(const LlamaConfig&, gpu::Stream&, const S*,        \
                                               const int32_t*, int, int, S*);                     \
  template Status LlamaCudaEmbeddingBackward<S>(const LlamaConfig&, gpu::Stream&, const int32_t*, \
                                                const S*, int, int, S*, void*);                   \
  template Status LlamaCudaLayerForward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,  \
                                           S*, int, int, void*, const int32_t*,                   \
                                           const LoraLayerArgs<S>&);                              \
  template Status LlamaCudaLayerBackward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*, \
                                            const S*, S*, S*, int, int, void*, const int32_t*,    \
                                            const LoraLayerArgs<S>&, bool);                       \
  template Status LlamaCudaHeadForward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,   \
                                          const S*, const int32_t*, int, int, S*, void*, float*,  \
                                          int64_t);                                               \
  template Status LlamaCudaHeadBackward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,  \
                                           const S*, const int32_t*, float, int, int, S*, S*, S*, \
                                           void*, int64_t);
STRATA_INSTANTIATE_LLAMA_CUDA(float)
STRATA_INSTANTIATE_LLAMA_CUDA(Bf16)
STRATA_INSTANTIATE_LLAMA_CUDA(Fp16)
#undef STRATA_INSTANTIATE_LLAMA_CUDA

}  // namespace strata::models::cuda
