// The GPT's blocks on CUDA (gpt_cuda.h): each a list of calls to the CUDA ops of
// models/ops/cuda/ops.cuh (products through its cuBLASLt wrapper) over all N = B T rows at once,
// with the rounding points of models/gpt_kernels.h and the scratch layout of gpt_cuda_layout.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "base/dtype.h"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "models/cuda/gpt_cuda.h"
#include "models/cuda/gpt_cuda_layout.h"
#include "models/cuda/lora_cuda.cuh"
#include "models/gpt_layout.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::cuda {
namespace {

namespace oc = ::strata::models::ops::cuda;

using gpu::cuda::RowEpilogue;
using oc::internal::At;
using oc::internal::CheckPointers;
using oc::internal::D;
using oc::internal::Dev;
using ops::WeightLayout;

// The GPT's weights are (in, out), y = x W (Hugging Face GPT-2's Conv1D).
constexpr WeightLayout kInOut = WeightLayout::kInOut;

StatusOr<cudaStream_t> Prepare(const char* what, const GptShape& s, gpu::Stream& stream, int B,
                               int T, const void* scratch) {
  STRATA_RETURN_IF_ERROR(ValidateShape(s));
  return oc::internal::PrepareBlockCall(what, stream, B, T, s.max_seq_len, scratch);
}

template <typename S>
using Products = oc::Products<S>;

template <typename S>
StatusOr<Products<S>> MakeProducts(gpu::Stream& stream, cudaStream_t cs, float* partials,
                                   const GptCudaOptions& o) {
  return Products<S>::Make(stream, cs, o.allow_tf32, partials);
}

// Attention over the fused qkv (N, 3C): q, k, v its column blocks, H = Hkv heads of C / H;
// position_ids (B, T) or null (packed sequences).
ops::AttentionDims AttentionDimsOf(const GptShape& s, int B, int T, const int32_t* position_ids) {
  const int C = static_cast<int>(s.channels);
  return {B, T, s.num_heads, s.num_heads, C / s.num_heads, 3 * int64_t{C}, position_ids};
}

// The layer scratch (gpt_cuda_layout.h) as typed pointers.
template <typename S>
struct LayerBuffers {
  S *ln1, *qkv, *att, *x2, *ln2, *h, *g, *dln;
  float *mean1, *rstd1, *mean2, *rstd2, *lse, *delta, *partials;
  LayerBuffers(const GptCudaLayerScratchLayout& l, void* scratch)
      : ln1(At<S>(scratch, l.ln1)),
        qkv(At<S>(scratch, l.qkv)),
        att(At<S>(scratch, l.att)),
        x2(At<S>(scratch, l.x2)),
        ln2(At<S>(scratch, l.ln2)),
        h(At<S>(scratch, l.h)),
        g(At<S>(scratch, l.g)),
        dln(At<S>(scratch, l.dln)),
        mean1(At<float>(scratch, l.mean1)),
        rstd1(At<float>(scratch, l.rstd1)),
        mean2(At<float>(scratch, l.mean2)),
        rstd2(At<float>(scratch, l.rstd2)),
        lse(At<float>(scratch, l.lse)),
        delta(At<float>(scratch, l.delta)),
        partials(At<float>(scratch, l.ln_partials)) {}
};

// The layer forward into the scratch regions: ln1, qkv, att, lse, x2, ln2, h, g; with x_out
// non-null also the layer output. The adapters of `lora` add to each targeted product's output.
template <typename S>
Status LayerForwardInto(const GptShape& shape, cudaStream_t cs, const Products<S>& mm,
                        const LayerParams<const S*>& p, const S* x, int B, int T,
                        const int32_t* position_ids, const LayerBuffers<S>& w, S* x_out,
                        const LoraLayerArgs<S>& lora) {
  const int64_t C = shape.channels, N = int64_t{B} * T;
  STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormForward(cs, D(x), D(p.ln1_w), D(p.ln1_b), N, C,
                                                    D(w.ln1), w.mean1, w.rstd1));
  STRATA_RETURN_IF_ERROR(mm.Forward(kInOut, N, C, 3 * C, w.ln1, p.qkv_w, p.qkv_b, nullptr, w.qkv));
  STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kGptAttnProduct, w.ln1, N, w.qkv, 3 * C));
  const Dev<S>* qkv = D(w.qkv);
  STRATA_RETURN_IF_ERROR(oc::LaunchAttentionForward(cs, AttentionDimsOf(shape, B, T, position_ids),
                                                    qkv, qkv + C, qkv + 2 * C, D(w.att), w.lse));
  STRATA_RETURN_IF_ERROR(mm.Forward(kInOut, N, C, C, w.att, p.attn_proj_w, p.attn_proj_b, x, w.x2));
  STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kGptAttnProjProduct, w.att, N, w.x2, C));
  STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormForward(cs, D(w.x2), D(p.ln2_w), D(p.ln2_b), N, C,
                                                    D(w.ln2), w.mean2, w.rstd2));
  if (LoraAddsTo(lora, kGptFcProduct)) {
    // The adapter adds to the pre-activation: h = D(D(P) + adapter), then g = D(gelu(h)).
    STRATA_RETURN_IF_ERROR(mm.Forward(kInOut, N, C, 4 * C, w.ln2, p.fc_w, p.fc_b, nullptr, w.h));
    STRATA_RETURN_IF_ERROR(LoraCudaForward(mm, lora, kGptFcProduct, w.ln2, N, w.h, 4 * C));
    STRATA_RETURN_IF_ERROR(oc::LaunchGeluForward(cs, D(w.h), N * 4 * C, D(w.g)));
  } else {
    // g = D(gelu(P)), h = D(P), P = ln2 Wfc + bfc in fp32 (the GELU_AUX_BIAS epilogue).
    STRATA_RETURN_IF_ERROR(mm.Run(false, false, N, 4 * C, C, w.ln2, C, p.fc_w, 4 * C, w.g, 4 * C,
                                  RowEpilogue::kGeluAuxBias, p.fc_b, nullptr, w.h, 4 * C));
  }
  if (x_out == nullptr) return Status::Ok();
  STRATA_RETURN_IF_ERROR(
      mm.Forward(kInOut, N, 4 * C, C, w.g, p.mlp_proj_w, p.mlp_proj_b, w.x2, x_out));
  return LoraCudaForward(mm, lora, kGptMlpProjProduct, w.g, N, x_out, C);
}

// The head's LayerNorm: lnf = D(LN(x)) with its statistics into the scratch.
template <typename S>
Status HeadLayerNorm(const GptShape& shape, cudaStream_t cs, const S* params, const S* x, int64_t N,
                     const GptCudaHeadScratchLayout& l, void* scratch) {
  const int64_t C = shape.channels;
  return oc::LaunchLayerNormForward(cs, D(x), D(params), D(params + C), N, C,
                                    D(At<S>(scratch, l.lnf)), At<float>(scratch, l.mean),
                                    At<float>(scratch, l.rstd));
}

// The chunked head's part of the head scratch.
template <typename S>
oc::HeadScratch<S> HeadScratchOf(const GptCudaHeadScratchLayout& l, void* scratch) {
  return {l.chunk_rows, At<S>(scratch, l.chunk), At<float>(scratch, l.losses),
          At<S>(scratch, l.lnf_last), At<void>(scratch, l.dwlm_acc)};
}

}  // namespace

Status GptCudaPrepareStream(gpu::Stream& stream) { return oc::PrepareStream(stream); }

template <typename S>
Status GptCudaEmbeddingForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                               const int32_t* tokens, int B, int T, S* x_out,
                               const int32_t* position_ids) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaEmbeddingForward", shape, stream, B, T, nullptr));
  STRATA_RETURN_IF_ERROR(CheckPointers("GptCudaEmbeddingForward", {params, tokens, x_out}));
  const int64_t C = shape.channels;
  return oc::LaunchEmbeddingForward(cs, D(params), D(params + int64_t{shape.vocab_size} * C),
                                    tokens, int64_t{B} * T, T, C, shape.vocab_size, D(x_out),
                                    position_ids);
}

template <typename S>
Status GptCudaEmbeddingBackward(const GptShape& shape, gpu::Stream& stream, const int32_t* tokens,
                                const S* dx_out, int B, int T, S* dparams, void* scratch,
                                const int32_t* position_ids) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaEmbeddingBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("GptCudaEmbeddingBackward", {tokens, dx_out, dparams, scratch}));
  const CudaEmbeddingScratchLayout l = CudaEmbeddingScratchLayoutFor(shape, B, T);
  const int64_t C = shape.channels;
  const oc::CountingSortScratch by_token{
      At<int32_t>(scratch, l.counts), At<int32_t>(scratch, l.offsets),
      At<int32_t>(scratch, l.cursor), At<int32_t>(scratch, l.order)};
  const oc::CountingSortScratch by_position{
      At<int32_t>(scratch, l.pos_counts), At<int32_t>(scratch, l.pos_offsets),
      At<int32_t>(scratch, l.pos_cursor), At<int32_t>(scratch, l.pos_order)};
  return oc::LaunchEmbeddingBackward(
      cs, tokens, D(dx_out), int64_t{B} * T, T, C, shape.vocab_size, shape.max_seq_len, D(dparams),
      D(dparams + int64_t{shape.vocab_size} * C), by_token, position_ids, by_position);
}

template <typename S>
Status GptCudaLayerForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                           const S* x_in, S* x_out, int B, int T, void* scratch,
                           const GptCudaOptions& options, const int32_t* position_ids,
                           const LoraLayerArgs<S>& lora) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaLayerForward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("GptCudaLayerForward", {params, x_in, x_out, scratch}));
  const LayerBuffers<S> w(GptCudaLayerScratchLayoutFor<S>(shape, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, w.partials, options));
  const LayerParams<const S*> p(params, shape.channels);
  return LayerForwardInto<S>(shape, cs, mm, p, x_in, B, T, position_ids, w, x_out, lora);
}

template <typename S>
Status GptCudaLayerBackward(const GptShape& shape, gpu::Stream& stream, const S* params,
                            const S* x_in, const S* dx_out, S* dx_in, S* dparams, int B, int T,
                            void* scratch, const GptCudaOptions& options,
                            const int32_t* position_ids, const LoraLayerArgs<S>& lora,
                            bool forward_kept) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaLayerBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("GptCudaLayerBackward", {params, x_in, dx_out, dx_in, scratch}));
  if (dparams == nullptr && !lora.active()) {
    return InvalidArgumentError("GptCudaLayerBackward: dparams is null and no adapters train");
  }
  const int64_t C = shape.channels, N = int64_t{B} * T;
  const LayerBuffers<S> w(GptCudaLayerScratchLayoutFor<S>(shape, B, T), scratch);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, w.partials, options));
  const LayerParams<const S*> p(params, C);
  const LayerParams<S*> dp(dparams, C);  // all null: the frozen base of a LoRA run
  const bool weight_grads = dparams != nullptr;
  if (!forward_kept) {
    STRATA_RETURN_IF_ERROR(
        LayerForwardInto<S>(shape, cs, mm, p, x_in, B, T, position_ids, w, nullptr, lora));
  }
  const S* dy = dx_out;
  S *ln1 = w.ln1, *qkv = w.qkv, *att = w.att, *x2 = w.x2, *ln2 = w.ln2, *h = w.h, *g = w.g;
  S* dh = g;    // over g, dead after the mlp_proj_w gradient
  S* dqkv = h;  // over h, dead after the DGELU product
  S* dln = w.dln;
  float* partials = w.partials;
  const float *mean1 = w.mean1, *rstd1 = w.rstd1, *mean2 = w.mean2, *rstd2 = w.rstd2;

  // MLP: y = x2 + g Wp + bp, g = gelu(h).
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kInOut, N, 4 * C, C, g, dy, dp.mlp_proj_w, dp.mlp_proj_b));
  }
  if (LoraAddsTo(lora, kGptMlpProjProduct)) {
    // The adapter's share of dg joins before GELU's derivative: dg in the adapters' scratch.
    S* dg = LoraGradBuffer(lora, N);
    STRATA_RETURN_IF_ERROR(mm.InputGrad(kInOut, N, 4 * C, C, dy, p.mlp_proj_w, dg));
    STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kGptMlpProjProduct, g, dy, N, C, dg));
    STRATA_RETURN_IF_ERROR(oc::LaunchGeluBackward(cs, D(h), D(dg), N * 4 * C, D(dh)));
  } else {
    STRATA_RETURN_IF_ERROR(mm.GeluInputGrad(kInOut, N, 4 * C, C, dy, p.mlp_proj_w, h,
                                            reinterpret_cast<float*>(dln),
                                            GeluAccRows(N, sizeof(S)), dh));
  }
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kInOut, N, C, 4 * C, ln2, dh, dp.fc_w, dp.fc_b));
  }
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kInOut, N, C, 4 * C, dh, p.fc_w, dln));  // dln2
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kGptFcProduct, ln2, dh, N, 4 * C, dln));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormParamGrads(cs, D(x2), D(dln), mean2, rstd2, N, C,
                                                         partials, D(dp.ln2_w), D(dp.ln2_b)));
  }
  // dx2 = D(dy + LN2'(dln2)), kept in dx_in.
  STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormBackward(cs, D(x2), D(p.ln2_w), D(dln), mean2, rstd2,
                                                     D(dy), N, C, D(dx_in)));
  const S* dx2 = dx_in;

  // Attention: x2 = x + att Wo + bo.
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(
        mm.WeightGrad(kInOut, N, C, C, att, dx2, dp.attn_proj_w, dp.attn_proj_b));
  }
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kInOut, N, C, C, dx2, p.attn_proj_w, dln));  // datt
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kGptAttnProjProduct, att, dx2, N, C, dln));
  const Dev<S>* dq_in = D(qkv);
  Dev<S>* dq_out = D(dqkv);
  STRATA_RETURN_IF_ERROR(oc::LaunchAttentionBackward(
      cs, AttentionDimsOf(shape, B, T, position_ids), dq_in, dq_in + C, dq_in + 2 * C, D(att),
      D(dln), w.lse, w.delta, dq_out, dq_out + C, dq_out + 2 * C));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(mm.WeightGrad(kInOut, N, C, 3 * C, ln1, dqkv, dp.qkv_w, dp.qkv_b));
  }
  STRATA_RETURN_IF_ERROR(mm.InputGrad(kInOut, N, C, 3 * C, dqkv, p.qkv_w, dln));  // dln1
  STRATA_RETURN_IF_ERROR(LoraCudaBackward(mm, lora, kGptAttnProduct, ln1, dqkv, N, 3 * C, dln));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormParamGrads(cs, D(x_in), D(dln), mean1, rstd1, N, C,
                                                         partials, D(dp.ln1_w), D(dp.ln1_b)));
  }
  // dx = D(dx2 + LN1'(dln1)), in place over dx2.
  return oc::LaunchLayerNormBackward(cs, D(x_in), D(p.ln1_w), D(dln), mean1, rstd1, D(dx2), N, C,
                                     D(dx_in));
}

template <typename S>
Status GptCudaHeadForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                          const S* x_in, const int32_t* targets, int B, int T, S* logits,
                          void* scratch, float* loss, const GptCudaOptions& options,
                          const S* tied_params, int64_t loss_tokens) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaHeadForward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("GptCudaHeadForward", {params, x_in, logits, scratch}));
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  const GptCudaHeadScratchLayout l = GptCudaHeadScratchLayoutFor<S>(shape, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm,
                          MakeProducts<S>(stream, cs, At<float>(scratch, l.ln_partials), options));
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("GptCudaHeadForward", shape.tie_embeddings,
                                                 tied_params, nullptr, false));
  // Untied: Wlm (C, V) from the chunk; tied: wte (V, C), read transposed.
  const bool tied = shape.tie_embeddings;
  const S* wlm = tied ? tied_params : params + 2 * C;
  STRATA_RETURN_IF_ERROR(HeadLayerNorm<S>(shape, cs, params, x_in, N, l, scratch));
  return oc::ChunkedHeadForward<S>(
      mm, At<S>(scratch, l.lnf), wlm, tied ? WeightLayout::kOutIn : kInOut, B, T, C, V,
      HeadScratchOf<S>(l, scratch), logits, targets, loss, loss_tokens);
}

template <typename S>
Status GptCudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const S* params,
                           const S* x_in, const int32_t* targets, float dloss, int B, int T,
                           S* dx_in, S* dparams, void* scratch, const GptCudaOptions& options,
                           const S* tied_params, S* tied_grads, int64_t loss_tokens) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("GptCudaHeadBackward", shape, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("GptCudaHeadBackward", {params, x_in, targets, dx_in, scratch}));
  const bool weight_grads = dparams != nullptr;  // null: the frozen head of a LoRA run
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  const GptCudaHeadScratchLayout l = GptCudaHeadScratchLayoutFor<S>(shape, B, T);
  float* partials = At<float>(scratch, l.ln_partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials, options));
  const float* mean = At<float>(scratch, l.mean);
  const float* rstd = At<float>(scratch, l.rstd);
  S* lnf = At<S>(scratch, l.lnf);
  S* dlnf = At<S>(scratch, l.dlnf);
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("GptCudaHeadBackward", shape.tie_embeddings,
                                                 tied_params, tied_grads, weight_grads));
  // Untied: Wlm (C, V) and dWlm in the chunk; tied: wte (V, C) read transposed, dwte (V, C) into
  // the first V C elements of tied_grads, whose wpe part gets zeros.
  const bool tied = shape.tie_embeddings;
  const S* wlm = tied ? tied_params : params + 2 * C;
  S* dwlm = !weight_grads ? nullptr : tied ? tied_grads : dparams + 2 * C;
  if (tied && weight_grads) {
    STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
        cudaMemsetAsync(tied_grads + V * C, 0,
                        static_cast<size_t>(shape.max_seq_len) * C * sizeof(S), cs),
        "cudaMemsetAsync"));
  }
  STRATA_RETURN_IF_ERROR(HeadLayerNorm<S>(shape, cs, params, x_in, N, l, scratch));
  STRATA_RETURN_IF_ERROR(
      oc::ChunkedHeadBackward<S>(mm, lnf, wlm, tied ? WeightLayout::kOutIn : kInOut, targets, dloss,
                                 N, C, V, HeadScratchOf<S>(l, scratch), dwlm, dlnf, loss_tokens));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormParamGrads(cs, D(x_in), D(dlnf), mean, rstd, N, C,
                                                         partials, D(dparams), D(dparams + C)));
  }
  return oc::LaunchLayerNormBackward(cs, D(x_in), D(params), D(dlnf), mean, rstd,
                                     static_cast<const Dev<S>*>(nullptr), N, C, D(dx_in));
}

#define STRATA_INSTANTIATE_GPT_CUDA(S)                                                           \
  template Status GptCudaEmbeddingForward<S>(const GptShape&, gpu::Stream&, const S*,            \
                                             const int32_t*, int, int, S*, const int32_t*);      \
  template Status GptCudaEmbeddingBackward<S>(const GptShape&, gpu::Stream&, const int32_t*,     \
                                              const S*, int, int, S*, void*, const int32_t*);    \
  template Status GptCudaLayerForward<S>(const GptShape&, gpu::Stream&, const S*, const S*, S*,  \
                                         int, int, void*, const GptCudaOptions&, const int32_t*, \
                                         const LoraLayerArgs<S>&);                               \
  template Status GptCudaLayerBackward<S>(                                                       \
      const GptShape&, gpu::Stream&, const S*, const S*, const S*, S*, S*, int, int, void*,      \
      const GptCudaOptions&, const int32_t*, const LoraLayerArgs<S>&, bool);                     \
  template Status GptCudaHeadForward<S>(const GptShape&, gpu::Stream&, const S*, const S*,       \
                                        const int32_t*, int, int, S*, void*, float*,             \
                                        const GptCudaOptions&, const S*, int64_t);               \
  template Status GptCudaHeadBackward<S>(const GptShape&, gpu::Stream&, const S*, const S*,      \
                                         const int32_t*, float, int, int, S*, S*, void*,         \
                                         const GptCudaOptions&, const S*, S*, int64_t);
STRATA_INSTANTIATE_GPT_CUDA(float)
STRATA_INSTANTIATE_GPT_CUDA(Bf16)
STRATA_INSTANTIATE_GPT_CUDA(Fp16)
#undef STRATA_INSTANTIATE_GPT_CUDA

}  // namespace strata::models::cuda
