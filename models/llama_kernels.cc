#include "models/llama_kernels.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "base/status.h"
#include "models/init.h"
#include "models/ops/attention.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/embedding.h"
#include "models/ops/matmul.h"
#include "models/ops/parallel.h"
#include "models/ops/rms_norm.h"
#include "models/ops/swiglu.h"

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

// The sizes every block function works with.
struct Dims {
  int64_t N, C, I, H, Hkv, hs, Dq, Dkv, Dqkv, V;
  Dims(const LlamaConfig& c, int B, int T)
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

// The tensors of a layer chunk, from the one layout table (llama_config.h).
template <typename P>
struct LayerParams {
  P w_in;    // input_layernorm (C)
  P wqkv;    // q_proj, k_proj, v_proj: (Dqkv, C)
  P wo;      // o_proj (C, Dq)
  P w_post;  // post_attention_layernorm (C)
  P wgu;     // gate_proj, up_proj: (2I, C)
  P wd;      // down_proj (C, I)
  // base null (a backward that computes no weight gradient: LoRA's frozen layer): every
  // pointer null.
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

// The layer scratch (LlamaLayerScratchBytes in the header), carved in one walk.
template <typename S>
struct LayerScratch {
  using F = ComputeType<S>;
  F *rstd1, *rstd2, *lse, *cos, *sin;
  S *xn, *qkv, *att, *x2, *xn2, *gu, *h, *grad, *dqkv;
  int64_t size_bytes;
  LayerScratch(const LlamaConfig& c, int B, int T, void* base) {
    const Dims d(c, B, T);
    ops::Carver k(base);
    rstd1 = k.Take<F>(d.N);
    rstd2 = k.Take<F>(d.N);
    lse = k.Take<F>(d.N * d.H);
    cos = k.Take<F>(int64_t{T} * d.hs / 2);
    sin = k.Take<F>(int64_t{T} * d.hs / 2);
    xn = k.Take<S>(d.N * d.C);
    qkv = k.Take<S>(d.N * d.Dqkv);
    att = k.Take<S>(d.N * d.Dq);
    x2 = k.Take<S>(d.N * d.C);
    xn2 = k.Take<S>(d.N * d.C);
    gu = k.Take<S>(d.N * 2 * d.I);
    h = k.Take<S>(d.N * d.I);
    grad = k.Take<S>(d.N * std::max({d.C, d.I, d.Dq}));
    dqkv = k.Take<S>(d.N * d.Dqkv);
    size_bytes = k.size_bytes();
  }
};

template <typename S>
struct HeadScratch {
  using F = ComputeType<S>;
  F* rstd;
  S* xn;
  void* lm_head;
  int64_t size_bytes;
  HeadScratch(const LlamaConfig& c, int B, int T, void* base) {
    const Dims d(c, B, T);
    ops::Carver k(base);
    rstd = k.Take<F>(d.N);
    xn = k.Take<S>(d.N * d.C);
    lm_head = k.Here();
    k.Skip(ops::LmHeadScratchBytes<S>(B, T, c.hidden_size, c.vocab_size));
    size_bytes = k.size_bytes();
  }
};

// The forward of a layer up to the SwiGLU output h, every intermediate in scratch.
template <typename S>
void LayerForwardToSwiglu(const LlamaConfig& c, const LayerParams<const S*>& p, const S* x, int B,
                          int T, const LayerScratch<S>& sc, const LoraLayerArgs<S>& lora,
                          const int32_t* position_ids) {
  const Dims d(c, B, T);
  ops::RmsNormForward(x, p.w_in, c.rms_norm_eps, d.N, d.C, sc.xn, sc.rstd1);
  ops::MatmulForward<S>(sc.xn, p.wqkv, WeightLayout::kOutIn, nullptr, sc.qkv, d.N, d.C, d.Dqkv);
  LoraForward(lora, kQkvProduct, sc.xn, d.N, sc.qkv, d.Dqkv);
  ops::RopeTable(LlamaRopeParams(c), T, sc.cos, sc.sin);
  ops::RopeForward(sc.qkv, d.N, d.Dqkv, c.num_heads + c.num_kv_heads, c.head_dim, T, sc.cos, sc.sin,
                   position_ids);
  const ops::AttentionDims ad{B, T, c.num_heads, c.num_kv_heads, c.head_dim, d.Dqkv, position_ids};
  ops::AttentionForward(ad, sc.qkv, sc.qkv + d.Dq, sc.qkv + d.Dq + d.Dkv, sc.att, sc.lse);
  ops::MatmulForward<S>(sc.att, p.wo, WeightLayout::kOutIn, nullptr, sc.x2, d.N, d.Dq, d.C, x);
  LoraForward(lora, kOutProduct, sc.att, d.N, sc.x2, d.C);
  ops::RmsNormForward(sc.x2, p.w_post, c.rms_norm_eps, d.N, d.C, sc.xn2, sc.rstd2);
  ops::MatmulForward<S>(sc.xn2, p.wgu, WeightLayout::kOutIn, nullptr, sc.gu, d.N, d.C, 2 * d.I);
  LoraForward(lora, kGateUpProduct, sc.xn2, d.N, sc.gu, 2 * d.I);
  ops::SwigluForward(sc.gu, d.N, d.I, sc.h);
}

// ---------------------------------------------------------------------------
// Initialisation.

using init::kEmbeddingTag;
using init::kHeadTag;
using init::LayerTag;
using init::NormalSampler;

constexpr double kInitializerRange = 0.02;

// Norm weights (names ending in "norm.weight") 1, everything else N(0, 0.02), in chunk order.
void InitChunk(const std::vector<LlamaTensor>& tensors, uint64_t seed, uint64_t tag,
               float* params) {
  NormalSampler rng(seed, tag);
  for (const LlamaTensor& t : tensors) {
    float* out = params + t.offset;
    const bool is_norm = t.name.ends_with("norm.weight");
    for (int64_t i = 0; i < t.num_elems; ++i) {
      out[i] = is_norm ? 1.0f : static_cast<float>(kInitializerRange * rng.Next());
    }
  }
}

}  // namespace

std::vector<LoraModule> LlamaLoraModules(const LlamaConfig& c) {
  const Dims d(c, 1, 1);
  const std::vector<LlamaTensor> t = LlamaLayerTensors(c, 0);
  const int64_t qkv = t[1].offset, o = t[4].offset, gu = t[6].offset, down = t[8].offset;
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

ops::RopeParams LlamaRopeParams(const LlamaConfig& c) {
  ops::RopeParams p;
  p.head_dim = c.head_dim;
  p.theta = c.rope_theta;
  p.llama3 = c.rope_llama3;
  p.factor = c.rope_factor;
  p.low_freq_factor = c.rope_low_freq_factor;
  p.high_freq_factor = c.rope_high_freq_factor;
  p.original_max_position = c.rope_original_max_position;
  return p;
}

void InitLlamaEmbeddingParams(const LlamaConfig& c, uint64_t seed, float* params) {
  InitChunk(LlamaEmbeddingTensors(c), seed, kEmbeddingTag, params);
}
void InitLlamaLayerParams(const LlamaConfig& c, int layer, uint64_t seed, float* params) {
  STRATA_CHECK(layer >= 0 && layer < c.num_layers);
  InitChunk(LlamaLayerTensors(c, layer), seed, LayerTag(layer), params);
}
void InitLlamaHeadParams(const LlamaConfig& c, uint64_t seed, float* params) {
  InitChunk(LlamaHeadTensors(c), seed, kHeadTag, params);
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
  return LayerScratch<S>(c, B, T, nullptr).size_bytes;
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
  ops::EmbeddingForward(params, tokens, int64_t{B} * T, c.hidden_size, c.vocab_size, x_out);
}

template <typename S>
void LlamaEmbeddingBackward(const LlamaConfig& c, const int32_t* tokens, const S* dx_out, int B,
                            int T, S* dparams, void* scratch) {
  CheckBatch(c, B, T);
  ops::EmbeddingBackward(tokens, dx_out, int64_t{B} * T, c.hidden_size, c.vocab_size, dparams,
                         scratch);
}

// ---------------------------------------------------------------------------
// Decoder layer.

template <typename S>
void LlamaLayerForward(const LlamaConfig& c, const S* params, const S* x_in, S* x_out, int B, int T,
                       void* scratch, const LoraLayerArgs<S>& lora, const int32_t* position_ids) {
  CheckBatch(c, B, T);
  const Dims d(c, B, T);
  const LayerParams<const S*> p(c, params);
  const LayerScratch<S> sc(c, B, T, scratch);
  LayerForwardToSwiglu(c, p, x_in, B, T, sc, lora, position_ids);
  ops::MatmulForward<S>(sc.h, p.wd, WeightLayout::kOutIn, nullptr, x_out, d.N, d.I, d.C, sc.x2);
  LoraForward(lora, kDownProduct, sc.h, d.N, x_out, d.C);
}

template <typename S>
void LlamaLayerBackward(const LlamaConfig& c, const S* params, const S* x_in, const S* dx_out,
                        S* dx_in, S* dparams, int B, int T, void* scratch,
                        const LoraLayerArgs<S>& lora, const int32_t* position_ids,
                        bool forward_kept) {
  CheckBatch(c, B, T);
  const Dims d(c, B, T);
  const LayerParams<const S*> p(c, params);
  const LayerParams<S*> dp(c, dparams);
  const LayerScratch<S> sc(c, B, T, scratch);
  if (!forward_kept) LayerForwardToSwiglu(c, p, x_in, B, T, sc, lora, position_ids);
  const S* dy = dx_out;

  // Down projection y = x2 + h Wd^T: dh (N, I) into the gradient buffer.
  S* dh = sc.grad;
  ops::MatmulBackward<S>(sc.h, p.wd, WeightLayout::kOutIn, dy, dh, dp.wd, nullptr, d.N, d.I, d.C);
  LoraBackward(lora, kDownProduct, sc.h, dy, d.N, d.C, dh);
  // SwiGLU: [dgate | dup] in place over gu.
  S* dgu = sc.gu;
  ops::SwigluBackward(sc.gu, dh, d.N, d.I, dgu);
  // Gate/up projection gu = xn2 Wgu^T: dxn2 (N, C) into the gradient buffer (dh is dead).
  S* dxn2 = sc.grad;
  ops::MatmulBackward<S>(sc.xn2, p.wgu, WeightLayout::kOutIn, dgu, dxn2, dp.wgu, nullptr, d.N, d.C,
                         2 * d.I);
  LoraBackward(lora, kGateUpProduct, sc.xn2, dgu, d.N, 2 * d.I, dxn2);
  // Post-attention RMSNorm and the MLP residual: dx2 = S(dy + RMS2'(dxn2)), over xn2 (dead).
  S* dx2 = sc.xn2;
  ops::RmsNormBackward(sc.x2, p.w_post, sc.rstd2, dxn2, dy, d.N, d.C, dx2, dp.w_post);
  // Output projection x2 = x + att Wo^T: datt (N, Dq) into the gradient buffer.
  S* datt = sc.grad;
  ops::MatmulBackward<S>(sc.att, p.wo, WeightLayout::kOutIn, dx2, datt, dp.wo, nullptr, d.N, d.Dq,
                         d.C);
  LoraBackward(lora, kOutProduct, sc.att, dx2, d.N, d.C, datt);
  // Attention: [dq | dk | dv] (N, Dqkv), then RoPE's inverse rotation of dq and dk.
  const ops::AttentionDims ad{B, T, c.num_heads, c.num_kv_heads, c.head_dim, d.Dqkv, position_ids};
  ops::AttentionBackward(ad, sc.qkv, sc.qkv + d.Dq, sc.qkv + d.Dq + d.Dkv, sc.att, datt, sc.lse,
                         sc.dqkv, sc.dqkv + d.Dq, sc.dqkv + d.Dq + d.Dkv);
  ops::RopeBackward(sc.dqkv, d.N, d.Dqkv, c.num_heads + c.num_kv_heads, c.head_dim, T, sc.cos,
                    sc.sin, position_ids);
  // q/k/v projection qkv = xn Wqkv^T: dxn (N, C) into the gradient buffer (datt is dead).
  S* dxn = sc.grad;
  ops::MatmulBackward<S>(sc.xn, p.wqkv, WeightLayout::kOutIn, sc.dqkv, dxn, dp.wqkv, nullptr, d.N,
                         d.C, d.Dqkv);
  LoraBackward(lora, kQkvProduct, sc.xn, sc.dqkv, d.N, d.Dqkv, dxn);
  // Input RMSNorm and the attention residual: dx = S(dx2 + RMS1'(dxn)).
  ops::RmsNormBackward(x_in, p.w_in, sc.rstd1, dxn, dx2, d.N, d.C, dx_in, dp.w_in);
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
                                void* scratch, int64_t loss_tokens) {
  CheckBatch(c, B, T);
  const Dims d(c, B, T);
  const HeadScratch<S> sc(c, B, T, scratch);
  STRATA_CHECK_MSG(HeadWeight(c, params, tied_embed) != nullptr,
                   "Llama head without its weight (tied: the embedding chunk)");
  ops::RmsNormForward(x_in, params, c.rms_norm_eps, d.N, d.C, sc.xn, sc.rstd);
  return ops::LmHeadForward<S>(sc.xn, HeadWeight(c, params, tied_embed), WeightLayout::kOutIn,
                               targets, B, T, c.hidden_size, c.vocab_size, logits, sc.lm_head,
                               /*chunk_rows=*/0, loss_tokens);
}

template <typename S>
void LlamaHeadBackward(const LlamaConfig& c, const S* params, const S* tied_embed, const S* x_in,
                       const int32_t* targets, ComputeType<S> dloss, int B, int T, S* dx_in,
                       S* dparams, S* tied_dembed, void* scratch, int64_t loss_tokens) {
  CheckBatch(c, B, T);
  STRATA_CHECK(targets != nullptr);
  const Dims d(c, B, T);
  const HeadScratch<S> sc(c, B, T, scratch);
  STRATA_CHECK_MSG(HeadWeight(c, params, tied_embed) != nullptr,
                   "Llama head without its weight (tied: the embedding chunk)");
  ops::RmsNormForward(x_in, params, c.rms_norm_eps, d.N, d.C, sc.xn, sc.rstd);
  // dxn into dx_in, then the norm's backward in place (dx may alias dy).
  ops::LmHeadBackward<S>(sc.xn, HeadWeight(c, params, tied_embed), WeightLayout::kOutIn, targets,
                         dloss, B, T, c.hidden_size, c.vocab_size, dx_in,
                         HeadWeight<S*>(c, dparams, tied_dembed), sc.lm_head, /*chunk_rows=*/0,
                         loss_tokens);
  ops::RmsNormBackward<S>(x_in, params, sc.rstd, dx_in, nullptr, d.N, d.C, dx_in, dparams);
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
                                     const LoraLayerArgs<S>&, const int32_t*);                    \
  template void LlamaLayerBackward<S>(const LlamaConfig&, const S*, const S*, const S*, S*, S*,   \
                                      int, int, void*, const LoraLayerArgs<S>&, const int32_t*,   \
                                      bool);                                                      \
  template ComputeType<S> LlamaHeadForward<S>(const LlamaConfig&, const S*, const S*, const S*,   \
                                              const int32_t*, int, int, S*, void*, int64_t);      \
  template void LlamaHeadBackward<S>(const LlamaConfig&, const S*, const S*, const S*,            \
                                     const int32_t*, ComputeType<S>, int, int, S*, S*, S*, void*, \
                                     int64_t);
STRATA_INSTANTIATE_LLAMA_KERNELS(float)
STRATA_INSTANTIATE_LLAMA_KERNELS(double)
STRATA_INSTANTIATE_LLAMA_KERNELS(Bf16)
STRATA_INSTANTIATE_LLAMA_KERNELS(Fp16)
#undef STRATA_INSTANTIATE_LLAMA_KERNELS

}  // namespace strata::models
