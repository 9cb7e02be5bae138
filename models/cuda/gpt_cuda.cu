// The GPT's blocks on CUDA (gpt_cuda.h) over all N = B T rows at once: the layer is the one body
// of models/gpt_block.h over the CUDA ops adapter (ops::cuda::CudaOps, models/ops/cuda/
// cuda_ops.cuh) with the family's one scratch layout (models/gpt_layout.h); the embedding and the
// head are calls to the CUDA ops of models/ops/cuda/ops.cuh with the layouts of gpt_cuda_layout.h.
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
#include "models/gpt_block.h"
#include "models/gpt_layout.h"
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

constexpr WeightLayout kInOut = kGptWeights;

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
  const GptLayerScratchLayout l = GptLayerScratchLayoutFor<S>(shape, B, T);
  float* partials = RegionAt<float>(scratch, l.ln_partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials, options));
  // The products' unfused bias gradients and the LayerNorm parameter gradients use ln_partials.
  return GptLayerForwardBody(oc::CudaOps<S>(mm, partials), shape,
                             LayerParams<const S*>(params, shape.channels), x_in, x_out, B, T,
                             GptLayerBuffers<S, float>(l, scratch), lora, position_ids);
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
  const GptLayerScratchLayout l = GptLayerScratchLayoutFor<S>(shape, B, T);
  float* partials = RegionAt<float>(scratch, l.ln_partials);
  STRATA_ASSIGN_OR_RETURN(const auto mm, MakeProducts<S>(stream, cs, partials, options));
  // dparams null: every gradient pointer null, the frozen base of a LoRA run.
  return GptLayerBackwardBody(
      oc::CudaOps<S>(mm, partials), shape, LayerParams<const S*>(params, shape.channels), x_in,
      dx_out, dx_in, LayerParams<S*>(dparams, shape.channels), B, T,
      GptLayerBuffers<S, float>(l, scratch), lora, position_ids, forward_kept);
}

template <typename S>
Status GptCudaHeadForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                          const S* x_in, const int32_t* targets, int B, int T, S* logits,
                          void* scratch, float* loss, const GptCudaOptions& options,
                          const S* tied_params, int64_t loss_tokens, float* target_losses) {
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
  return oc::ChunkedHeadForward<S>(mm, At<S>(scratch, l.lnf), wlm,
                                   tied ? WeightLayout::kOutIn : kInOut, B, T, C, V,
                                   HeadScratchOf<S>(l, scratch), logits, targets, loss, loss_tokens,
                                   /*softcap=*/0.0f, target_losses);
}

template <typename S>
Status GptCudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const S* params,
                           const S* x_in, const int32_t* targets, float dloss, int B, int T,
                           S* dx_in, S* dparams, void* scratch, const GptCudaOptions& options,
                           const S* tied_params, S* tied_grads, int64_t loss_tokens,
                           const float* target_weights) {
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
  STRATA_RETURN_IF_ERROR(oc::ChunkedHeadBackward<S>(
      mm, lnf, wlm, tied ? WeightLayout::kOutIn : kInOut, targets, dloss, N, C, V,
      HeadScratchOf<S>(l, scratch), dwlm, dlnf, loss_tokens, /*softcap=*/0.0f, target_weights));
  if (weight_grads) {
    STRATA_RETURN_IF_ERROR(oc::LaunchLayerNormParamGrads(cs, D(x_in), D(dlnf), mean, rstd, N, C,
                                                         partials, D(dparams), D(dparams + C)));
  }
  return oc::LaunchLayerNormBackward(cs, D(x_in), D(params), D(dlnf), mean, rstd,
                                     static_cast<const Dev<S>*>(nullptr), N, C, D(dx_in));
}

#define STRATA_INSTANTIATE_GPT_CUDA(S)                                                            \
  template Status GptCudaEmbeddingForward<S>(const GptShape&, gpu::Stream&, const S*,             \
                                             const int32_t*, int, int, S*, const int32_t*);       \
  template Status GptCudaEmbeddingBackward<S>(const GptShape&, gpu::Stream&, const int32_t*,      \
                                              const S*, int, int, S*, void*, const int32_t*);     \
  template Status GptCudaLayerForward<S>(const GptShape&, gpu::Stream&, const S*, const S*, S*,   \
                                         int, int, void*, const GptCudaOptions&, const int32_t*,  \
                                         const LoraLayerArgs<S>&);                                \
  template Status GptCudaLayerBackward<S>(                                                        \
      const GptShape&, gpu::Stream&, const S*, const S*, const S*, S*, S*, int, int, void*,       \
      const GptCudaOptions&, const int32_t*, const LoraLayerArgs<S>&, bool);                      \
  template Status GptCudaHeadForward<S>(const GptShape&, gpu::Stream&, const S*, const S*,        \
                                        const int32_t*, int, int, S*, void*, float*,              \
                                        const GptCudaOptions&, const S*, int64_t, float*);        \
  template Status GptCudaHeadBackward<S>(                                                         \
      const GptShape&, gpu::Stream&, const S*, const S*, const int32_t*, float, int, int, S*, S*, \
      void*, const GptCudaOptions&, const S*, S*, int64_t, const float*);
STRATA_INSTANTIATE_GPT_CUDA(float)
STRATA_INSTANTIATE_GPT_CUDA(Bf16)
STRATA_INSTANTIATE_GPT_CUDA(Fp16)
#undef STRATA_INSTANTIATE_GPT_CUDA

}  // namespace strata::models::cuda
