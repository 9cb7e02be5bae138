// Host (CPU) forward and backward of the Llama family's blocks (LlamaForCausalLM semantics;
// models/llama_config.h), each a list of shared op calls (models/ops/) with their shapes. The
// layer is written once, over an ops backend (models/llama_block.h): these functions run it over
// the host ops (ops::HostOps, models/ops/host_ops.h), models/cuda/llama_cuda.h over the CUDA ops,
// with one scratch layout (models/llama_layout.h).
//
// Blocks and chunks (the layouts of llama_config.h, Hugging Face tensor order, nn.Linear weights
// (out, in), kOutIn): block 0 = embedding (embed_tokens (V, C)); blocks 1..L = decoder layers;
// block L+1 = head (final RMSNorm and the LM head: the untied lm_head.weight (V, C) in the head
// chunk, or, tied, embed_tokens read from the embedding chunk). In a layer chunk q_proj, k_proj,
// v_proj are consecutive rows, so they are used as ONE (Dqkv, C) matrix, Dqkv = (H + 2 Hkv) hs,
// and gate_proj, up_proj as ONE (2I, C) matrix: one product each.
//
// Notation: V vocab, C hidden_size, I intermediate_size, H heads, Hkv key/value heads,
// hs head_dim, Dq = H hs, B sequences of T tokens, N = B T rows; activations (N, C) row-major.
//
// Layer forward (x: (N, C)):
//   xn   = RmsNorm(x; w_in)                      (N, C)       rstd1 (N) fp32
//   qkv  = xn Wqkv^T                             (N, Dqkv)    [q (Dq) | k (Hkv hs) | v (Hkv hs)]
//   RoPE in place on the H + Hkv heads of q and k, position t = row % T
//   att  = Attention(q, k, v; GQA, causal)       (N, Dq)      lse (B, H, T) fp32
//   x2   = x + att Wo^T                          (N, C)       (residual fused into the product)
//   xn2  = RmsNorm(x2; w_post)                   (N, C)       rstd2 (N) fp32
//   gu   = xn2 Wgu^T                             (N, 2I)      [gate | up]
//   h    = SwiGLU(gu)                            (N, I)
//   y    = x2 + h Wd^T                           (N, C)
// Head: xn = RmsNorm(x; w_norm); loss and last-position logits from the fused LM head
// (models/ops/cross_entropy.h) on xn with the (V, C) weight.
//
// Storage and rounding: templates on S in {float, double, Bf16, Fp16}; every op rounds where its
// header says (models/gpt_kernels.h "Storage and rounding"; ops/rms_norm.h, ops/rope.h,
// ops/swiglu.h, ops/matmul.h, ops/attention.h, ops/cross_entropy.h, ops/embedding.h). The
// backward of a layer recomputes the forward from x_in (activation checkpointing at block
// boundaries), then: dx2 = S(dy + RMS2'(dxn2)), dx = S(dx2 + RMS1'(dxn)) (residual gradients
// added before the one rounding), RoPE's backward on dq and dk, and every weight gradient one
// rounded product (the q/k/v and gate/up gradients one product each).
//
// Determinism, memory and thread-safety: as models/gpt_kernels.h (bit-identical across runs and
// thread counts; no allocation beyond the ops' per-thread buffers; reentrant, oneTBB inside;
// concurrent calls must not share outputs or scratch). B >= 1, 1 <= T <= max_seq_len and token /
// target ids in [0, V) are STRATA_CHECKed. Inputs and outputs must not overlap.
#pragma once

#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "models/llama_config.h"
#include "models/lora.h"
#include "models/ops/rope.h"

namespace strata::models {

// Chunk sizes in elements (the totals of LlamaEmbeddingTensors / LlamaLayerTensors /
// LlamaHeadTensors).
int64_t LlamaEmbeddingNumParams(const LlamaConfig& c);  // V C
int64_t LlamaLayerNumParams(const LlamaConfig& c);      // 2 C + (Dqkv + 2 I) C + C Dq + I C
int64_t LlamaHeadNumParams(const LlamaConfig& c);       // C (+ V C untied)

// The rotary embedding of a config's full-attention layers (head_dim, rope_theta, rope_scaling);
// LlamaLayerRopeParams (llama_config.h) gives each layer's.
ops::RopeParams LlamaRopeParams(const LlamaConfig& c);

// Random initialisation of a chunk (fp32), Hugging Face's _init_weights with initializer_range
// 0.02: every weight matrix and the embedding N(0, 0.02), RMSNorm weights 1. Deterministic: a
// function of (config, seed, block) only (std::mt19937_64 seeded from (seed, block) and our own
// Box-Muller transform). Every element is written. layer in [0, num_layers).
void InitLlamaEmbeddingParams(const LlamaConfig& c, uint64_t seed, float* params);
void InitLlamaLayerParams(const LlamaConfig& c, int layer, uint64_t seed, float* params);
void InitLlamaHeadParams(const LlamaConfig& c, uint64_t seed, float* params);

// Scratch in bytes of each block for storage type S and B sequences of T tokens; forward and
// backward of a block share one scratch. Pure. The scratch must be aligned to 64 bytes; it is
// carved (one walk, each part 64-byte aligned, the layer's 256; F = ComputeType<S>) as
//   Embedding: ops::EmbeddingBackwardScratchBytes(N, V).
//   Layer:     LlamaLayerScratchLayout (models/llama_layout.h), the one layout of the host and
//              CUDA layers: rstd1, rstd2 (N) F; lse, delta (B, H, T) F; cos, sin (T, hs/2) F;
//              the CUDA ops' RMSNorm partials; then in S: xn (N, C), qkv (N, Dqkv), att (N, Dq),
//              x2 (N, C), xn2 (N, C), gu (N, 2I), h (N, I), a gradient buffer (N, max(C, I, Dq))
//              and dqkv (N, Dqkv).
//   Head:      rstd (N) F; xn (N, C) S; ops::LmHeadScratchBytes<S>(B, T, C, V).
template <typename S>
int64_t LlamaEmbeddingScratchBytes(const LlamaConfig& c, int B, int T);
template <typename S>
int64_t LlamaLayerScratchBytes(const LlamaConfig& c, int B, int T);
template <typename S>
int64_t LlamaHeadScratchBytes(const LlamaConfig& c, int B, int T);

// x_out (B, T, C) = S(embed_tokens[tokens]) (an exact copy). params: embedding chunk; tokens
// (B, T).
template <typename S>
void LlamaEmbeddingForward(const LlamaConfig& c, const S* params, const int32_t* tokens, int B,
                           int T, S* x_out);

// dparams (embedding chunk, OVERWRITTEN; rows of absent tokens zero) from dx_out (B, T, C).
template <typename S>
void LlamaEmbeddingBackward(const LlamaConfig& c, const int32_t* tokens, const S* dx_out, int B,
                            int T, S* dparams, void* scratch);

// The layer's products, in order, as LoRA sites name them (models/lora.h): the fused q/k/v
// projection, o_proj, the fused gate/up projection, down_proj.
inline constexpr int kQkvProduct = 0, kOutProduct = 1, kGateUpProduct = 2, kDownProduct = 3;
// The modules LoRA may target, Hugging Face names: q_proj, k_proj, v_proj (columns of the q/k/v
// product), o_proj, gate_proj, up_proj (columns of the gate/up product), down_proj; Phi-3's
// qkv_proj (the whole q/k/v product), o_proj, gate_up_proj (the whole gate/up product),
// down_proj.
std::vector<LoraModule> LlamaLoraModules(const LlamaConfig& c);

// One decoder layer. params: layer chunk; x_in, x_out (B, T, C). With `lora` active every
// targeted product adds its adapter's output (models/lora.h) before what follows it (q/k/v:
// before RoPE). position_ids: (B, T) or null, packed examples (engine::BlockBuffers): RoPE
// turns token t by position_ids[t] and attention stays inside each example.
// layer: the layer's index (its sliding window, LlamaLayerWindow). max_positions: the positions
// the longest sequence spans (engine::BlockBuffers::max_positions; 0: T), which of LongRoPE's
// factors apply.
template <typename S>
void LlamaLayerForward(const LlamaConfig& c, const S* params, const S* x_in, S* x_out, int B, int T,
                       void* scratch, const LoraLayerArgs<S>& lora = {},
                       const int32_t* position_ids = nullptr, int layer = 0, int max_positions = 0);

// Recomputes the forward from x_in, then writes dx_in (B, T, C) and dparams (the whole layer
// chunk, OVERWRITTEN; null: no weight gradient, LoRA's frozen base) from dx_out (B, T, C); with
// `lora` active the adapters' gradients into lora.dadapters and their share of dx_in.
// forward_kept: the scratch holds what LlamaLayerForward on the same inputs left there; the
// recomputation is skipped (the same activations, bit for bit).
template <typename S>
void LlamaLayerBackward(const LlamaConfig& c, const S* params, const S* x_in, const S* dx_out,
                        S* dx_in, S* dparams, int B, int T, void* scratch,
                        const LoraLayerArgs<S>& lora = {}, const int32_t* position_ids = nullptr,
                        bool forward_kept = false, int layer = 0, int max_positions = 0);

// Final RMSNorm and LM head. params: head chunk; tied_embed: the embedding chunk (embed_tokens
// (V, C)) when c.tie_embeddings, else ignored (may be null); x_in (B, T, C); targets (B, T) or
// null; logits (B, V): the last position's logits of each sequence. Returns the mean
// cross-entropy over the loss_tokens counted targets (not engine::kIgnoreTarget; 0: all B T),
// or 0 when targets is null. target_losses: (B, T) fp32 or null; with targets, each position's
// cross-entropy (0 where ignored), the values the mean sums (ops::LmHeadForward's row_losses).
template <typename S>
ComputeType<S> LlamaHeadForward(const LlamaConfig& c, const S* params, const S* tied_embed,
                                const S* x_in, const int32_t* targets, int B, int T, S* logits,
                                void* scratch, int64_t loss_tokens = 0,
                                float* target_losses = nullptr);

// Gradient of dloss * mean cross-entropy: dx_in (B, T, C) and dparams (head chunk) OVERWRITTEN;
// tied: tied_dembed (V, C), the gradient of embed_tokens through the head, OVERWRITTEN (untied:
// ignored, may be null). targets must not be null. target_weights: (B, T) fp32 or null; when set
// the objective is dloss * sum_t w_t CE_t (ops::LmHeadBackward's row_weights; loss_tokens is not
// read).
template <typename S>
void LlamaHeadBackward(const LlamaConfig& c, const S* params, const S* tied_embed, const S* x_in,
                       const int32_t* targets, ComputeType<S> dloss, int B, int T, S* dx_in,
                       S* dparams, S* tied_dembed, void* scratch, int64_t loss_tokens = 0,
                       const float* target_weights = nullptr);

}  // namespace strata::models
