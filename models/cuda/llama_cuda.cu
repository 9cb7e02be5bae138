// The Llama blocks on CUDA (llama_cuda.h) over all N = B T rows at once: the layer is the one body
// of models/llama_block.h over the CUDA ops adapter (ops::cuda::CudaOps, models/ops/cuda/
// cuda_ops.cuh) with the family's one scratch layout (models/llama_layout.h); the embedding and
// the head are calls to the CUDA ops of models/ops/cuda/ops.cuh with the layouts of
// llama_cuda_layout.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "models/cuda/llama_cuda.h"
#include "models/cuda/llama_cuda_layout.h"
#include "models/llama_block.h"
#include "models/llama_kernels.h"
#include "models/llama_layout.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/cuda_ops.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::cuda {
namespace {

namespace oc = ::strata::models::ops::cuda;

using oc::internal::At;
using oc::internal::CheckPointers;
using oc::internal::D;
using oc::internal::Dev;
using ops::WeightLayout;

constexpr WeightLayout kOutIn = kLlamaWeights;
static_assert(kLlamaCudaMaxHeadDim == oc::kAttentionMaxHeadDim);

StatusOr<cudaStream_t> Prepare(const char* what, const LlamaConfig& c, gpu::Stream& stream, int B,
                               int T, const void* scratch) {
  STRATA_RETURN_IF_ERROR(ValidateLlamaConfig(c));
  if (c.head_dim > oc::kAttentionMaxHeadDim) {
    return InvalidArgumentError(std::string(what) + ": the CUDA attention takes head_dim <= " +
                                std::to_string(oc::kAttentionMaxHeadDim) + ", got " +
                                std::to_string(c.head_dim));
  }
  return oc::internal::PrepareBlockCall(what, stream, B, T, c.max_seq_len, scratch);
}

template <typename S>
using Products = oc::Products<S>;

template <typename S>
StatusOr<Products<S>> MakeProducts(gpu::Stream& stream, cudaStream_t cs,
                                   float* partials = nullptr) {
  return Products<S>::Make(stream, cs, /*allow_tf32=*/false, partials);
}

// LlamaConfig::final_logit_softcapping as the chunked head's fp32 softcap (0: none); a cap whose
// fp32 rounding is 0 or inf (the host op's fp32 instantiation would divide by it) is refused.
StatusOr<float> HeadSoftcap(const char* what, const LlamaConfig& c) {
  const double cap = c.final_logit_softcapping;
  const float f = static_cast<float>(cap);
  if (cap == 0 || (std::isfinite(cap) && cap > 0 && std::isfinite(f) && f > 0)) return f;
  return InvalidArgumentError(std::string(what) +
                              ": final_logit_softcapping must be 0 (none) or finite, > 0 and "
                              "neither 0 nor inf in fp32, got " +
                              std::to_string(cap));
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
                                            c.hidden_size, c.vocab_size, D(x_out),
                                            /*position_ids=*/nullptr, c.embed_scale);
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
                                             nullptr, by_token, /*position_ids=*/nullptr,
                                             /*by_position=*/{}, c.embed_scale);
}

template <typename S>
Status LlamaCudaLayerForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* x_in, S* x_out, int B, int T, void* scratch,
                             const int32_t* position_ids, const LoraLayerArgs<S>& lora, int layer,
                             int max_positions) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaLayerForward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("LlamaCudaLayerForward", {params, x_in, x_out, scratch}));
  const LlamaLayerScratchLayout l = LlamaLayerScratchLayoutFor<S>(c, B, T);
  float* partials = RegionAt<float>(scratch, l.partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials));
  // The norms' weight gradients and the bias gradients use the layout's partials.
  return LlamaLayerForwardBody(
      oc::CudaOps<S>(mm, partials), c, layer, LlamaLayerParams<const S*>(c, params), x_in, x_out, B,
      T, LlamaLayerBuffers<S, float>(l, scratch), lora, position_ids, max_positions);
}

template <typename S>
Status LlamaCudaLayerBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                              const S* x_in, const S* dx_out, S* dx_in, S* dparams, int B, int T,
                              void* scratch, const int32_t* position_ids,
                              const LoraLayerArgs<S>& lora, bool forward_kept, int layer,
                              int max_positions) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaLayerBackward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LlamaCudaLayerBackward", {params, x_in, dx_out, dx_in, scratch}));
  if (dparams == nullptr && !lora.active()) {
    return InvalidArgumentError("LlamaCudaLayerBackward: dparams is null and no adapters train");
  }
  const LlamaLayerScratchLayout l = LlamaLayerScratchLayoutFor<S>(c, B, T);
  float* partials = RegionAt<float>(scratch, l.partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials));
  // dparams null: every gradient pointer null, the frozen base of a LoRA run.
  return LlamaLayerBackwardBody(
      oc::CudaOps<S>(mm, partials), c, layer, LlamaLayerParams<const S*>(c, params), x_in, dx_out,
      dx_in, LlamaLayerParams<S*>(c, dparams), B, T, LlamaLayerBuffers<S, float>(l, scratch), lora,
      position_ids, forward_kept, max_positions);
}

template <typename S>
Status LlamaCudaHeadForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                            const S* tied_params, const S* x_in, const int32_t* targets, int B,
                            int T, S* logits, void* scratch, float* loss, int64_t loss_tokens,
                            float* target_losses) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaHeadForward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(CheckPointers("LlamaCudaHeadForward", {params, x_in, logits, scratch}));
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("LlamaCudaHeadForward", c.tie_embeddings,
                                                 tied_params, nullptr, false));
  STRATA_ASSIGN_OR_RETURN(const float softcap, HeadSoftcap("LlamaCudaHeadForward", c));
  const LlamaDims z(c, B, T);
  const LlamaCudaHeadScratchLayout l = LlamaCudaHeadScratchLayoutFor<S>(c, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const S* wlm = c.tie_embeddings ? tied_params : params + z.C;  // (V, C)
  S* xn = At<S>(scratch, l.xn);
  STRATA_RETURN_IF_ERROR(
      oc::LaunchRmsNormForward(cs, D(x_in), D(params), static_cast<float>(c.rms_norm_eps), z.N, z.C,
                               D(xn), At<float>(scratch, l.rstd), c.norm_unit_offset));
  return oc::ChunkedHeadForward<S>(mm, xn, wlm, kOutIn, B, T, z.C, z.V,
                                   HeadScratchOf<S>(l, scratch), logits, targets, loss, loss_tokens,
                                   softcap, target_losses);
}

template <typename S>
Status LlamaCudaHeadBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* tied_params, const S* x_in, const int32_t* targets,
                             float dloss, int B, int T, S* dx_in, S* dparams, S* tied_grads,
                             void* scratch, int64_t loss_tokens, const float* target_weights) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs,
                          Prepare("LlamaCudaHeadBackward", c, stream, B, T, scratch));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LlamaCudaHeadBackward", {params, x_in, targets, dx_in, scratch}));
  const bool weight_grads = dparams != nullptr;  // null: the frozen head of a LoRA run
  STRATA_RETURN_IF_ERROR(oc::internal::CheckTied("LlamaCudaHeadBackward", c.tie_embeddings,
                                                 tied_params, tied_grads, weight_grads));
  STRATA_ASSIGN_OR_RETURN(const float softcap, HeadSoftcap("LlamaCudaHeadBackward", c));
  const LlamaDims z(c, B, T);
  const LlamaCudaHeadScratchLayout l = LlamaCudaHeadScratchLayoutFor<S>(c, B, T);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs));
  const bool tied = c.tie_embeddings;
  const S* wlm = tied ? tied_params : params + z.C;                       // (V, C)
  S* dwlm = !weight_grads ? nullptr : tied ? tied_grads : dparams + z.C;  // (V, C)
  const float* rstd = At<float>(scratch, l.rstd);
  S* xn = At<S>(scratch, l.xn);
  S* dxn = At<S>(scratch, l.dxn);
  STRATA_RETURN_IF_ERROR(
      oc::LaunchRmsNormForward(cs, D(x_in), D(params), static_cast<float>(c.rms_norm_eps), z.N, z.C,
                               D(xn), At<float>(scratch, l.rstd), c.norm_unit_offset));
  STRATA_RETURN_IF_ERROR(oc::ChunkedHeadBackward<S>(mm, xn, wlm, kOutIn, targets, dloss, z.N, z.C,
                                                    z.V, HeadScratchOf<S>(l, scratch), dwlm, dxn,
                                                    loss_tokens, softcap, target_weights));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchRmsNormWeightGrad(cs, D(x_in), rstd, D(dxn), z.N, z.C,
                                                       At<float>(scratch, l.partials), D(dparams)));
  }
  return oc::LaunchRmsNormBackward(cs, D(x_in), D(params), rstd, D(dxn),
                                   static_cast<const Dev<S>*>(nullptr), z.N, z.C, D(dx_in),
                                   c.norm_unit_offset);
}

#define STRATA_INSTANTIATE_LLAMA_CUDA(S)                                                          \
  template Status LlamaCudaEmbeddingForward<S>(const LlamaConfig&, gpu::Stream&, const S*,        \
                                               const int32_t*, int, int, S*);                     \
  template Status LlamaCudaEmbeddingBackward<S>(const LlamaConfig&, gpu::Stream&, const int32_t*, \
                                                const S*, int, int, S*, void*);                   \
  template Status LlamaCudaLayerForward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,  \
                                           S*, int, int, void*, const int32_t*,                   \
                                           const LoraLayerArgs<S>&, int, int);                    \
  template Status LlamaCudaLayerBackward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*, \
                                            const S*, S*, S*, int, int, void*, const int32_t*,    \
                                            const LoraLayerArgs<S>&, bool, int, int);             \
  template Status LlamaCudaHeadForward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,   \
                                          const S*, const int32_t*, int, int, S*, void*, float*,  \
                                          int64_t, float*);                                       \
  template Status LlamaCudaHeadBackward<S>(const LlamaConfig&, gpu::Stream&, const S*, const S*,  \
                                           const S*, const int32_t*, float, int, int, S*, S*, S*, \
                                           void*, int64_t, const float*);
STRATA_INSTANTIATE_LLAMA_CUDA(float)
STRATA_INSTANTIATE_LLAMA_CUDA(Bf16)
STRATA_INSTANTIATE_LLAMA_CUDA(Fp16)
#undef STRATA_INSTANTIATE_LLAMA_CUDA

}  // namespace strata::models::cuda
