// The GPT's host blocks: the layer is the one body of models/gpt_block.h over the host ops
// adapter (ops::HostOps); the embedding and the head are compositions of the shared host ops
// (models/ops/). The rounding points of gpt_kernels.h are those of the ops.
#include "models/gpt_kernels.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>

#include "models/gpt_block.h"
#include "models/gpt_layout.h"
#include "models/init.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/embedding.h"
#include "models/ops/host_ops.h"
#include "models/ops/layer_norm.h"
#include "models/ops/parallel.h"

namespace strata::models {
namespace {

using ops::Carver;
using ops::WeightLayout;

void CheckBatch(const GptShape& s, int B, int T) {
  STRATA_CHECK_MSG(B >= 1 && T >= 1 && T <= s.max_seq_len,
                   "B=" + std::to_string(B) + " T=" + std::to_string(T) +
                       " max_seq_len=" + std::to_string(s.max_seq_len));
}

// ---------------------------------------------------------------------------
// Parameter layout: the one table every offset comes from.

struct TensorSpec {
  const char* name;
  std::vector<int64_t> shape;
};

std::vector<TensorInfo> Lay(const std::vector<TensorSpec>& specs) {
  std::vector<TensorInfo> out;
  int64_t offset = 0;
  for (const TensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    out.push_back(TensorInfo{s.name, offset, s.shape, n});
    offset += n;
  }
  return out;
}

int64_t Total(const std::vector<TensorInfo>& tensors) {
  return tensors.empty() ? 0 : tensors.back().offset + tensors.back().num_elems;
}

// ---------------------------------------------------------------------------
// Scratch layouts (see the header's scratch sizes).

template <typename S>
struct HeadScratch {
  S* lnf;                      // (N, C)
  ComputeType<S>*mean, *rstd;  // (N)
  void* lm_head;               // ops::LmHeadScratchBytes<S>(B, T, C, V, chunk_rows)
  int64_t size_bytes;
};

template <typename S>
HeadScratch<S> CarveHeadScratch(const GptShape& s, int B, int T, int64_t chunk_rows,
                                void* scratch) {
  using F = ComputeType<S>;
  const int64_t N = int64_t{B} * T, C = s.channels;
  STRATA_CHECK_MSG(chunk_rows >= 1 && chunk_rows <= N,
                   "chunk_rows=" + std::to_string(chunk_rows) + " N=" + std::to_string(N));
  Carver c(scratch);
  HeadScratch<S> sc;
  sc.lnf = c.Take<S>(N * C);
  sc.mean = c.Take<F>(N);
  sc.rstd = c.Take<F>(N);
  sc.lm_head = c.Here();
  c.Skip(ops::LmHeadScratchBytes<S>(B, T, s.channels, s.vocab_size, chunk_rows));
  sc.size_bytes = c.size_bytes();
  return sc;
}

// ---------------------------------------------------------------------------
// Initialisation.

using init::FillNormal;
using init::kEmbeddingTag;
using init::kHeadTag;
using init::LayerTag;
using init::NormalSampler;

constexpr double kInitStd = 0.02;

double ResidualInitStd(const GptShape& s) {
  return kInitStd / std::sqrt(2.0 * static_cast<double>(s.num_layers));
}

}  // namespace

std::vector<LoraModule> GptLoraModules(const GptShape& s) {
  // Offsets in the layer chunk (models/gpt_layout.h's order): ln1 (2C), qkv_w (C, 3C), qkv_b
  // (3C), attn_proj_w (C, C), attn_proj_b, ln2 (2C), fc_w (C, 4C), fc_b (4C), mlp_proj_w (4C, C).
  const int64_t C = s.channels;
  const int64_t qkv = 2 * C, attn_proj = qkv + 3 * C * C + 3 * C;
  const int64_t fc = attn_proj + C * C + 3 * C, mlp_proj = fc + 4 * C * C + 4 * C;
  return {{"c_attn", "attn.c_attn", kGptAttnProduct, C, 3 * C, 0, qkv, true, 3 * C},
          {"c_proj", "attn.c_proj", kGptAttnProjProduct, C, C, 0, attn_proj, true, C},
          {"c_fc", "mlp.c_fc", kGptFcProduct, C, 4 * C, 0, fc, true, 4 * C},
          {"c_proj", "mlp.c_proj", kGptMlpProjProduct, 4 * C, C, 0, mlp_proj, true, C}};
}

// ---------------------------------------------------------------------------
// Shapes and layouts.

Status ValidateShape(const GptShape& s) {
  if (s.vocab_size <= 0 || s.max_seq_len <= 0 || s.num_layers <= 0 || s.num_heads <= 0 ||
      s.channels <= 0) {
    return InvalidArgumentError(
        "GPT shape fields must be positive: vocab_size=" + std::to_string(s.vocab_size) +
        " max_seq_len=" + std::to_string(s.max_seq_len) +
        " num_layers=" + std::to_string(s.num_layers) +
        " num_heads=" + std::to_string(s.num_heads) + " channels=" + std::to_string(s.channels));
  }
  if (s.channels % s.num_heads != 0) {
    return InvalidArgumentError("channels (" + std::to_string(s.channels) +
                                ") must be a multiple of num_heads (" +
                                std::to_string(s.num_heads) + ")");
  }
  if (!(s.layer_norm_eps > 0 && std::isfinite(s.layer_norm_eps))) {
    return InvalidArgumentError("layer_norm_eps (" + std::to_string(s.layer_norm_eps) +
                                ") must be positive and finite");
  }
  return Status::Ok();
}

std::vector<TensorInfo> EmbeddingTensors(const GptShape& s) {
  const int64_t C = s.channels;
  return Lay({{"wte", {s.vocab_size, C}}, {"wpe", {s.max_seq_len, C}}});
}

std::vector<TensorInfo> LayerTensors(const GptShape& s) {
  const int64_t C = s.channels;
  return Lay({{"ln1_w", {C}},
              {"ln1_b", {C}},
              {"attn_qkv_w", {C, 3 * C}},
              {"attn_qkv_b", {3 * C}},
              {"attn_proj_w", {C, C}},
              {"attn_proj_b", {C}},
              {"ln2_w", {C}},
              {"ln2_b", {C}},
              {"mlp_fc_w", {C, 4 * C}},
              {"mlp_fc_b", {4 * C}},
              {"mlp_proj_w", {4 * C, C}},
              {"mlp_proj_b", {C}}});
}

std::vector<TensorInfo> HeadTensors(const GptShape& s) {
  const int64_t C = s.channels;
  if (s.tie_embeddings) return Lay({{"lnf_w", {C}}, {"lnf_b", {C}}});
  return Lay({{"lnf_w", {C}}, {"lnf_b", {C}}, {"lm_head_w", {C, s.vocab_size}}});
}

int64_t EmbeddingNumParams(const GptShape& s) { return Total(EmbeddingTensors(s)); }
int64_t LayerNumParams(const GptShape& s) { return Total(LayerTensors(s)); }
int64_t HeadNumParams(const GptShape& s) { return Total(HeadTensors(s)); }

// ---------------------------------------------------------------------------
// Scratch sizes.

template <typename S>
int64_t GptEmbeddingScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return ops::EmbeddingBackwardScratchBytes(int64_t{B} * T, s.vocab_size);
}

template <typename S>
int64_t GptLayerScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return GptLayerScratchLayoutFor<S>(s, B, T).total;
}

template <typename S>
int64_t GptHeadScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return internal::GptHeadScratchBytesWithChunkRows<S>(s, B, T,
                                                       HeadChunkRows(int64_t{B} * T, s.vocab_size));
}

template <typename S>
int64_t internal::GptHeadScratchBytesWithChunkRows(const GptShape& s, int B, int T,
                                                   int64_t chunk_rows) {
  CheckBatch(s, B, T);
  return CarveHeadScratch<S>(s, B, T, chunk_rows, nullptr).size_bytes;
}

// ---------------------------------------------------------------------------
// Initialisation.

void InitGptEmbeddingParams(const GptShape& s, uint64_t seed, float* params) {
  NormalSampler rng(seed, kEmbeddingTag);
  FillNormal(rng, kInitStd, EmbeddingNumParams(s), params);
}

void InitGptLayerParams(const GptShape& s, int layer_index, uint64_t seed, float* params) {
  STRATA_CHECK(layer_index >= 0 && layer_index < s.num_layers);
  const int64_t C = s.channels;
  const LayerParams<float*> p(params, C);
  NormalSampler rng(seed, LayerTag(layer_index));
  std::fill(p.ln1_w, p.ln1_w + C, 1.0f);
  std::fill(p.ln1_b, p.ln1_b + C, 0.0f);
  FillNormal(rng, kInitStd, C * 3 * C, p.qkv_w);
  std::fill(p.qkv_b, p.qkv_b + 3 * C, 0.0f);
  FillNormal(rng, ResidualInitStd(s), C * C, p.attn_proj_w);
  std::fill(p.attn_proj_b, p.attn_proj_b + C, 0.0f);
  std::fill(p.ln2_w, p.ln2_w + C, 1.0f);
  std::fill(p.ln2_b, p.ln2_b + C, 0.0f);
  FillNormal(rng, kInitStd, C * 4 * C, p.fc_w);
  std::fill(p.fc_b, p.fc_b + 4 * C, 0.0f);
  FillNormal(rng, ResidualInitStd(s), 4 * C * C, p.mlp_proj_w);
  std::fill(p.mlp_proj_b, p.mlp_proj_b + C, 0.0f);
}

void InitGptHeadParams(const GptShape& s, uint64_t seed, float* params) {
  const int64_t C = s.channels;
  NormalSampler rng(seed, kHeadTag);
  std::fill(params, params + C, 1.0f);
  std::fill(params + C, params + 2 * C, 0.0f);
  if (!s.tie_embeddings) FillNormal(rng, kInitStd, C * s.vocab_size, params + 2 * C);
}

// ---------------------------------------------------------------------------
// Embedding.

template <typename S>
void GptEmbeddingForward(const GptShape& s, const S* params, const int32_t* tokens, int B, int T,
                         S* x_out, const int32_t* position_ids) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels;
  const S* wte = params;
  const S* wpe = params + int64_t{s.vocab_size} * C;
  ops::EmbeddingForward(wte, tokens, int64_t{B} * T, C, s.vocab_size, x_out, wpe, T, position_ids);
}

template <typename S>
void GptEmbeddingBackward(const GptShape& s, const int32_t* tokens, const S* dx_out, int B, int T,
                          S* dparams, void* scratch, const int32_t* position_ids) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, V = s.vocab_size;
  S* dwte = dparams;
  S* dwpe = dparams + V * C;
  ops::EmbeddingBackward(tokens, dx_out, int64_t{B} * T, C, s.vocab_size, dwte, scratch, dwpe, T,
                         position_ids);
  std::fill(dwpe + int64_t{T} * C, dwpe + int64_t{s.max_seq_len} * C, FromFloat<S>(0));
}

// ---------------------------------------------------------------------------
// Layer.

template <typename S>
void GptLayerForward(const GptShape& s, const S* params, const S* x_in, S* x_out, int B, int T,
                     void* scratch, const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  CheckBatch(s, B, T);
  const GptLayerBuffers<S, ComputeType<S>> w(GptLayerScratchLayoutFor<S>(s, B, T), scratch);
  STRATA_CHECK(GptLayerForwardBody(ops::HostOps<S>(), s, LayerParams<const S*>(params, s.channels),
                                   x_in, x_out, B, T, w, lora, position_ids)
                   .ok());
}

template <typename S>
void GptLayerBackward(const GptShape& s, const S* params, const S* x_in, const S* dx_out, S* dx_in,
                      S* dparams, int B, int T, void* scratch, const LoraLayerArgs<S>& lora,
                      const int32_t* position_ids, bool forward_kept) {
  CheckBatch(s, B, T);
  const GptLayerBuffers<S, ComputeType<S>> w(GptLayerScratchLayoutFor<S>(s, B, T), scratch);
  STRATA_CHECK(GptLayerBackwardBody(ops::HostOps<S>(), s, LayerParams<const S*>(params, s.channels),
                                    x_in, dx_out, dx_in, LayerParams<S*>(dparams, s.channels), B, T,
                                    w, lora, position_ids, forward_kept)
                   .ok());
}

// ---------------------------------------------------------------------------
// Head: lnf = LNf(x), then the fused LM head on lnf with Wlm (C, V), or with the tied wte
// (V, C).

namespace {

// The LM head's weight and its layout: the chunk's lm_head_w, or the tied wte (the first V C
// elements of the embedding chunk).
template <typename P>
struct LmWeight {
  P w;
  WeightLayout layout;
};

template <typename P>
LmWeight<P> LmWeightOf(const GptShape& s, P params, P tied) {
  if (s.tie_embeddings) {
    STRATA_CHECK_MSG(tied != nullptr, "a tied GPT head needs the embedding chunk");
    return {tied, WeightLayout::kOutIn};
  }
  return {params + 2 * int64_t{s.channels}, WeightLayout::kInOut};
}

}  // namespace

template <typename S>
ComputeType<S> GptHeadForward(const GptShape& s, const S* params, const S* x_in,
                              const int32_t* targets, int B, int T, S* logits, void* scratch,
                              const S* tied_params, int64_t loss_tokens, float* target_losses) {
  CheckBatch(s, B, T);
  return internal::GptHeadForwardWithChunkRows(s, params, x_in, targets, B, T, logits, scratch,
                                               HeadChunkRows(int64_t{B} * T, s.vocab_size),
                                               tied_params, loss_tokens, target_losses);
}

template <typename S>
void GptHeadBackward(const GptShape& s, const S* params, const S* x_in, const int32_t* targets,
                     ComputeType<S> dloss, int B, int T, S* dx_in, S* dparams, void* scratch,
                     const S* tied_params, S* tied_grads, int64_t loss_tokens,
                     const float* target_weights) {
  CheckBatch(s, B, T);
  internal::GptHeadBackwardWithChunkRows(s, params, x_in, targets, dloss, B, T, dx_in, dparams,
                                         scratch, HeadChunkRows(int64_t{B} * T, s.vocab_size),
                                         tied_params, tied_grads, loss_tokens, target_weights);
}

template <typename S>
ComputeType<S> internal::GptHeadForwardWithChunkRows(const GptShape& s, const S* params,
                                                     const S* x_in, const int32_t* targets, int B,
                                                     int T, S* logits, void* scratch,
                                                     int64_t chunk_rows, const S* tied_params,
                                                     int64_t loss_tokens, float* target_losses) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, N = int64_t{B} * T;
  const S* lnf_w = params;
  const S* lnf_b = params + C;
  const LmWeight<const S*> lm = LmWeightOf(s, params, tied_params);
  const HeadScratch<S> sc = CarveHeadScratch<S>(s, B, T, chunk_rows, scratch);
  ops::LayerNormForward(x_in, lnf_w, lnf_b, s.layer_norm_eps, N, C, sc.lnf, sc.mean, sc.rstd);
  return ops::LmHeadForward(sc.lnf, lm.w, lm.layout, targets, B, T, s.channels, s.vocab_size,
                            logits, sc.lm_head, chunk_rows, loss_tokens, /*softcap=*/0,
                            target_losses);
}

template <typename S>
void internal::GptHeadBackwardWithChunkRows(const GptShape& s, const S* params, const S* x_in,
                                            const int32_t* targets, ComputeType<S> dloss, int B,
                                            int T, S* dx_in, S* dparams, void* scratch,
                                            int64_t chunk_rows, const S* tied_params, S* tied_grads,
                                            int64_t loss_tokens, const float* target_weights) {
  CheckBatch(s, B, T);
  STRATA_CHECK(targets != nullptr);
  const int64_t C = s.channels, V = s.vocab_size, N = int64_t{B} * T;
  const S* lnf_w = params;
  const S* lnf_b = params + C;
  const LmWeight<const S*> lm = LmWeightOf(s, params, tied_params);
  // dparams null (and tied_grads null when tied): a frozen head, no weight gradient.
  S* dlnf_w = dparams;
  S* dlnf_b = dparams == nullptr ? nullptr : dparams + C;
  S* dw = dparams == nullptr ? nullptr : dparams + 2 * C;
  if (s.tie_embeddings) {
    dw = tied_grads;  // dwte: the first V C elements; the wpe part gets no gradient here
    if (tied_grads != nullptr) {
      std::fill(tied_grads + V * C, tied_grads + EmbeddingNumParams(s), FromFloat<S>(0));
    }
  }
  const HeadScratch<S> sc = CarveHeadScratch<S>(s, B, T, chunk_rows, scratch);
  ops::LayerNormForward(x_in, lnf_w, lnf_b, s.layer_norm_eps, N, C, sc.lnf, sc.mean, sc.rstd);
  S* dlnf = dx_in;  // then LNf's backward in place
  ops::LmHeadBackward(sc.lnf, lm.w, lm.layout, targets, dloss, B, T, s.channels, s.vocab_size, dlnf,
                      dw, sc.lm_head, chunk_rows, loss_tokens, /*softcap=*/0, target_weights);
  ops::LayerNormBackward(x_in, lnf_w, sc.mean, sc.rstd, dlnf, static_cast<const S*>(nullptr), N, C,
                         dx_in, dlnf_w, dlnf_b);
}

#define STRATA_INSTANTIATE_GPT_KERNELS(S)                                                          \
  template int64_t GptEmbeddingScratchBytes<S>(const GptShape&, int, int);                         \
  template int64_t GptLayerScratchBytes<S>(const GptShape&, int, int);                             \
  template int64_t GptHeadScratchBytes<S>(const GptShape&, int, int);                              \
  template void GptEmbeddingForward<S>(const GptShape&, const S*, const int32_t*, int, int, S*,    \
                                       const int32_t*);                                            \
  template void GptEmbeddingBackward<S>(const GptShape&, const int32_t*, const S*, int, int, S*,   \
                                        void*, const int32_t*);                                    \
  template void GptLayerForward<S>(const GptShape&, const S*, const S*, S*, int, int, void*,       \
                                   const LoraLayerArgs<S>&, const int32_t*);                       \
  template void GptLayerBackward<S>(const GptShape&, const S*, const S*, const S*, S*, S*, int,    \
                                    int, void*, const LoraLayerArgs<S>&, const int32_t*, bool);    \
  template ComputeType<S> GptHeadForward<S>(const GptShape&, const S*, const S*, const int32_t*,   \
                                            int, int, S*, void*, const S*, int64_t, float*);       \
  template void GptHeadBackward<S>(const GptShape&, const S*, const S*, const int32_t*,            \
                                   ComputeType<S>, int, int, S*, S*, void*, const S*, S*, int64_t, \
                                   const float*);                                                  \
  template int64_t internal::GptHeadScratchBytesWithChunkRows<S>(const GptShape&, int, int,        \
                                                                 int64_t);                         \
  template ComputeType<S> internal::GptHeadForwardWithChunkRows<S>(                                \
      const GptShape&, const S*, const S*, const int32_t*, int, int, S*, void*, int64_t, const S*, \
      int64_t, float*);                                                                            \
  template void internal::GptHeadBackwardWithChunkRows<S>(                                         \
      const GptShape&, const S*, const S*, const int32_t*, ComputeType<S>, int, int, S*, S*,       \
      void*, int64_t, const S*, S*, int64_t, const float*);

STRATA_INSTANTIATE_GPT_KERNELS(float)
STRATA_INSTANTIATE_GPT_KERNELS(double)
STRATA_INSTANTIATE_GPT_KERNELS(Bf16)
STRATA_INSTANTIATE_GPT_KERNELS(Fp16)

#undef STRATA_INSTANTIATE_GPT_KERNELS

}  // namespace strata::models
