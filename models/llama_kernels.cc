// The Llama family's host blocks: the layer is the one body of models/llama_block.h over the host
// ops adapter (ops::HostOps); the embedding and the head are compositions of the shared host ops
// (models/ops/).
#include "models/llama_kernels.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/init.h"
#include "models/llama_block.h"
#include "models/llama_layout.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/embedding.h"
#include "models/ops/host_ops.h"
#include "models/ops/matmul.h"
#include "models/ops/parallel.h"
#include "models/ops/rms_norm.h"

namespace strata::models {
namespace {

using ops::WeightLayout;

void CheckBatch(const LlamaConfig& c, int B, int T) {
  STRATA_CHECK_MSG(B >= 1 && T >= 1 && T <= c.max_seq_len,
                   "B=" + std::to_string(B) + " T=" + std::to_string(T) +
                       " max_seq_len=" + std::to_string(c.max_seq_len));
}

int64_t Total(const std::vector<LlamaTensor>& t) {
  return t.empty() ? 0 : t.back().offset + t.back().num_elems;
}

template <typename S>
struct HeadScratch {
  using F = ComputeType<S>;
  F* rstd;
  S* xn;
  void* lm_head;
  int64_t size_bytes;
  HeadScratch(const LlamaConfig& c, int B, int T, void* base) {
    const LlamaDims d(c, B, T);
    ops::Carver k(base);
    rstd = k.Take<F>(d.N);
    xn = k.Take<S>(d.N * d.C);
    lm_head = k.Here();
    k.Skip(ops::LmHeadScratchBytes<S>(B, T, c.hidden_size, c.vocab_size));
    size_bytes = k.size_bytes();
  }
};

// ---------------------------------------------------------------------------
// Initialisation.

using init::kEmbeddingTag;
using init::kHeadTag;
using init::LayerTag;
using init::NormalSampler;

constexpr double kInitializerRange = 0.02;

// Norm weights (names ending in "norm.weight") 1 (0 with (1 + w) norms: the same function),
// biases 0, everything else N(0, 0.02), in chunk order.
void InitChunk(const LlamaConfig& c, const std::vector<LlamaTensor>& tensors, uint64_t seed,
               uint64_t tag, float* params) {
  const float norm = c.norm_unit_offset ? 0.0f : 1.0f;
  NormalSampler rng(seed, tag);
  for (const LlamaTensor& t : tensors) {
    float* out = params + t.offset;
    const bool is_norm = t.name.ends_with("norm.weight");
    if (t.name.ends_with(".bias")) {
      std::fill(out, out + t.num_elems, 0.0f);
      continue;
    }
    for (int64_t i = 0; i < t.num_elems; ++i) {
      out[i] = is_norm ? norm : static_cast<float>(kInitializerRange * rng.Next());
    }
  }
}

}  // namespace

std::vector<LoraModule> LlamaLoraModules(const LlamaConfig& c) {
  const LlamaDims d(c, 1, 1);
  const LlamaLayerOffsets off = LlamaLayerOffsetsOf(c);
  const int64_t qkv = off.wqkv, o = off.wo, gu = off.wgu, down = off.wd;
  if (c.arch == LlamaArch::kPhi3) {
    return {{"qkv_proj", "self_attn.qkv_proj", kQkvProduct, d.C, d.Dqkv, 0, qkv},
            {"o_proj", "self_attn.o_proj", kOutProduct, d.Dq, d.C, 0, o},
            {"gate_up_proj", "mlp.gate_up_proj", kGateUpProduct, d.C, 2 * d.I, 0, gu},
            {"down_proj", "mlp.down_proj", kDownProduct, d.I, d.C, 0, down}};
  }
  return {{"q_proj", "self_attn.q_proj", kQkvProduct, d.C, d.Dq, 0, qkv},
          {"k_proj", "self_attn.k_proj", kQkvProduct, d.C, d.Dkv, d.Dq, qkv},
          {"v_proj", "self_attn.v_proj", kQkvProduct, d.C, d.Dkv, d.Dq + d.Dkv, qkv},
          {"o_proj", "self_attn.o_proj", kOutProduct, d.Dq, d.C, 0, o},
          {"gate_proj", "mlp.gate_proj", kGateUpProduct, d.C, d.I, 0, gu},
          {"up_proj", "mlp.up_proj", kGateUpProduct, d.C, d.I, d.I, gu},
          {"down_proj", "mlp.down_proj", kDownProduct, d.I, d.C, 0, down}};
}

int64_t LlamaEmbeddingNumParams(const LlamaConfig& c) { return Total(LlamaEmbeddingTensors(c)); }
int64_t LlamaLayerNumParams(const LlamaConfig& c) { return Total(LlamaLayerTensors(c, 0)); }
int64_t LlamaHeadNumParams(const LlamaConfig& c) { return Total(LlamaHeadTensors(c)); }

ops::RopeParams LlamaRopeParams(const LlamaConfig& c) { return LlamaLayerRopeParams(c, -1); }

void InitLlamaEmbeddingParams(const LlamaConfig& c, uint64_t seed, float* params) {
  InitChunk(c, LlamaEmbeddingTensors(c), seed, kEmbeddingTag, params);
}
void InitLlamaLayerParams(const LlamaConfig& c, int layer, uint64_t seed, float* params) {
  STRATA_CHECK(layer >= 0 && layer < c.num_layers);
  InitChunk(c, LlamaLayerTensors(c, layer), seed, LayerTag(layer), params);
}
void InitLlamaHeadParams(const LlamaConfig& c, uint64_t seed, float* params) {
  InitChunk(c, LlamaHeadTensors(c), seed, kHeadTag, params);
}

// ---------------------------------------------------------------------------
// Scratch sizes.

template <typename S>
int64_t LlamaEmbeddingScratchBytes(const LlamaConfig& c, int B, int T) {
  CheckBatch(c, B, T);
  return ops::EmbeddingBackwardScratchBytes(int64_t{B} * T, c.vocab_size);
}

template <typename S>
int64_t LlamaLayerScratchBytes(const LlamaConfig& c, int B, int T) {
  CheckBatch(c, B, T);
  return LlamaLayerScratchLayoutFor<S>(c, B, T).total;
}

template <typename S>
int64_t LlamaHeadScratchBytes(const LlamaConfig& c, int B, int T) {
  CheckBatch(c, B, T);
  return HeadScratch<S>(c, B, T, nullptr).size_bytes;
}

// ---------------------------------------------------------------------------
// Embedding.

template <typename S>
void LlamaEmbeddingForward(const LlamaConfig& c, const S* params, const int32_t* tokens, int B,
                           int T, S* x_out) {
  CheckBatch(c, B, T);
  ops::EmbeddingForward<S>(params, tokens, int64_t{B} * T, c.hidden_size, c.vocab_size, x_out,
                           /*positions=*/nullptr, /*seq_len=*/0, /*position_ids=*/nullptr,
                           c.embed_scale);
}

template <typename S>
void LlamaEmbeddingBackward(const LlamaConfig& c, const int32_t* tokens, const S* dx_out, int B,
                            int T, S* dparams, void* scratch) {
  CheckBatch(c, B, T);
  ops::EmbeddingBackward<S>(tokens, dx_out, int64_t{B} * T, c.hidden_size, c.vocab_size, dparams,
                            scratch, /*dpositions=*/nullptr, /*seq_len=*/0,
                            /*position_ids=*/nullptr, c.embed_scale);
}

// ---------------------------------------------------------------------------
// Decoder layer.

template <typename S>
void LlamaLayerForward(const LlamaConfig& c, const S* params, const S* x_in, S* x_out, int B, int T,
                       void* scratch, const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                       int layer, int max_positions) {
  CheckBatch(c, B, T);
  const LlamaLayerBuffers<S, ComputeType<S>> w(LlamaLayerScratchLayoutFor<S>(c, B, T), scratch);
  STRATA_CHECK(LlamaLayerForwardBody(ops::HostOps<S>(), c, layer,
                                     LlamaLayerParams<const S*>(c, params), x_in, x_out, B, T, w,
                                     lora, position_ids, max_positions)
                   .ok());
}

template <typename S>
void LlamaLayerBackward(const LlamaConfig& c, const S* params, const S* x_in, const S* dx_out,
                        S* dx_in, S* dparams, int B, int T, void* scratch,
                        const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                        bool forward_kept, int layer, int max_positions) {
  CheckBatch(c, B, T);
  const LlamaLayerBuffers<S, ComputeType<S>> w(LlamaLayerScratchLayoutFor<S>(c, B, T), scratch);
  STRATA_CHECK(LlamaLayerBackwardBody(ops::HostOps<S>(), c, layer,
                                      LlamaLayerParams<const S*>(c, params), x_in, dx_out, dx_in,
                                      LlamaLayerParams<S*>(c, dparams), B, T, w, lora, position_ids,
                                      forward_kept, max_positions)
                   .ok());
}

// ---------------------------------------------------------------------------
// Head.

namespace {

// The (V, C) LM head weight: the head chunk's lm_head.weight, or the tied embed_tokens.
template <typename P>
P HeadWeight(const LlamaConfig& c, P params, P tied) {
  if (c.tie_embeddings) return tied;
  return params == nullptr ? nullptr : params + LlamaHeadTensors(c)[1].offset;
}

}  // namespace

template <typename S>
ComputeType<S> LlamaHeadForward(const LlamaConfig& c, const S* params, const S* tied_embed,
                                const S* x_in, const int32_t* targets, int B, int T, S* logits,
                                void* scratch, int64_t loss_tokens, float* target_losses) {
  CheckBatch(c, B, T);
  const LlamaDims d(c, B, T);
  const HeadScratch<S> sc(c, B, T, scratch);
  STRATA_CHECK_MSG(HeadWeight(c, params, tied_embed) != nullptr,
                   "Llama head without its weight (tied: the embedding chunk)");
  ops::RmsNormForward(x_in, params, c.rms_norm_eps, d.N, d.C, sc.xn, sc.rstd, c.norm_unit_offset);
  return ops::LmHeadForward<S>(sc.xn, HeadWeight(c, params, tied_embed), WeightLayout::kOutIn,
                               targets, B, T, c.hidden_size, c.vocab_size, logits, sc.lm_head,
                               /*chunk_rows=*/0, loss_tokens, c.final_logit_softcapping,
                               target_losses);
}

template <typename S>
void LlamaHeadBackward(const LlamaConfig& c, const S* params, const S* tied_embed, const S* x_in,
                       const int32_t* targets, ComputeType<S> dloss, int B, int T, S* dx_in,
                       S* dparams, S* tied_dembed, void* scratch, int64_t loss_tokens,
                       const float* target_weights) {
  CheckBatch(c, B, T);
  STRATA_CHECK(targets != nullptr);
  const LlamaDims d(c, B, T);
  const HeadScratch<S> sc(c, B, T, scratch);
  STRATA_CHECK_MSG(HeadWeight(c, params, tied_embed) != nullptr,
                   "Llama head without its weight (tied: the embedding chunk)");
  ops::RmsNormForward(x_in, params, c.rms_norm_eps, d.N, d.C, sc.xn, sc.rstd, c.norm_unit_offset);
  // dxn into dx_in, then the norm's backward in place (dx may alias dy).
  ops::LmHeadBackward<S>(sc.xn, HeadWeight(c, params, tied_embed), WeightLayout::kOutIn, targets,
                         dloss, B, T, c.hidden_size, c.vocab_size, dx_in,
                         HeadWeight<S*>(c, dparams, tied_dembed), sc.lm_head, /*chunk_rows=*/0,
                         loss_tokens, c.final_logit_softcapping, target_weights);
  ops::RmsNormBackward<S>(x_in, params, sc.rstd, dx_in, nullptr, d.N, d.C, dx_in, dparams,
                          c.norm_unit_offset);
}

#define STRATA_INSTANTIATE_LLAMA_KERNELS(S)                                                       \
  template int64_t LlamaEmbeddingScratchBytes<S>(const LlamaConfig&, int, int);                   \
  template int64_t LlamaLayerScratchBytes<S>(const LlamaConfig&, int, int);                       \
  template int64_t LlamaHeadScratchBytes<S>(const LlamaConfig&, int, int);                        \
  template void LlamaEmbeddingForward<S>(const LlamaConfig&, const S*, const int32_t*, int, int,  \
                                         S*);                                                     \
  template void LlamaEmbeddingBackward<S>(const LlamaConfig&, const int32_t*, const S*, int, int, \
                                          S*, void*);                                             \
  template void LlamaLayerForward<S>(const LlamaConfig&, const S*, const S*, S*, int, int, void*, \
                                     const LoraLayerArgs<S>&, const int32_t*, int, int);          \
  template void LlamaLayerBackward<S>(const LlamaConfig&, const S*, const S*, const S*, S*, S*,   \
                                      int, int, void*, const LoraLayerArgs<S>&, const int32_t*,   \
                                      bool, int, int);                                            \
  template ComputeType<S> LlamaHeadForward<S>(const LlamaConfig&, const S*, const S*, const S*,   \
                                              const int32_t*, int, int, S*, void*, int64_t,       \
                                              float*);                                            \
  template void LlamaHeadBackward<S>(const LlamaConfig&, const S*, const S*, const S*,            \
                                     const int32_t*, ComputeType<S>, int, int, S*, S*, S*, void*, \
                                     int64_t, const float*);
STRATA_INSTANTIATE_LLAMA_KERNELS(float)
STRATA_INSTANTIATE_LLAMA_KERNELS(double)
STRATA_INSTANTIATE_LLAMA_KERNELS(Bf16)
STRATA_INSTANTIATE_LLAMA_KERNELS(Fp16)
#undef STRATA_INSTANTIATE_LLAMA_KERNELS

}  // namespace strata::models
