// Host (CPU) forward and backward kernels of a GPT-2 style model, per engine block. The layer is
// written once, over an ops backend (models/gpt_block.h): these functions run it over the host
// ops (ops::HostOps, models/ops/host_ops.h), models/cuda/gpt_cuda.h over the CUDA ops, with one
// scratch layout (models/gpt_layout.h).
//
// Model: GPT-2 (Radford et al., "Language Models are Unsupervised Multitask
// Learners", 2019) with pre-LayerNorm blocks: token + learned position
// embeddings; num_layers blocks of
//   x2 = x + Proj(CausalSelfAttention(LayerNorm1(x)))
//   y  = x2 + Proj(GELU(Fc(LayerNorm2(x2))))
// a final LayerNorm, an LM head without bias (untied, or tied to wte), and cross-entropy.
// LayerNorm as in Ba, Kiros & Hinton, "Layer Normalization", 2016 (eps GptShape::layer_norm_eps);
// GELU with the tanh approximation of Hendrycks & Gimpel, "Gaussian Error
// Linear Units (GELUs)", 2016.
//
// The engine sees an ordered list of blocks, each with ONE contiguous parameter
// chunk: block 0 = embedding, blocks 1..L = transformer layers, block L+1 = head.
// Chunk layouts (element offsets in this order; weights are (in, out) row-major
// and y = x W + b, like Hugging Face GPT-2's Conv1D):
//   Embedding: wte (V, C), wpe (max_seq_len, C)
//   Layer:     ln1_w (C), ln1_b (C), attn_qkv_w (C, 3C), attn_qkv_b (3C),
//              attn_proj_w (C, C), attn_proj_b (C), ln2_w (C), ln2_b (C),
//              mlp_fc_w (C, 4C), mlp_fc_b (4C), mlp_proj_w (4C, C), mlp_proj_b (C)
//   Head:      lnf_w (C), lnf_b (C), lm_head_w (C, V); tied: lnf_w (C), lnf_b (C) (the head reads
//              wte of the embedding chunk as its (V, C) weight)
// qkv columns are [q (C) | k (C) | v (C)]; head h uses columns h*hs..(h+1)*hs of
// each, hs = C / H.
//
// Notation: V vocab_size, C channels, H num_heads, hs = C / H, B sequences of
// T tokens per micro-batch (1 <= T <= max_seq_len), N = B T rows; activations (B, T, C) are
// row-major with N rows of C. Tokens and targets are int32 in [0, V) (the caller validates
// data; a value outside the range is a STRATA_CHECK failure, never an out-of-bounds read).
//
// Storage and rounding (issue 13: compute in 16 bits). Every kernel is a template on its
// storage type S: float, Bf16 or Fp16 (base/dtype.h) for the engine's working precision, and
// double for the tests' reference. Parameters, activations, activation gradients, logits and
// weight gradients are stored as S; arithmetic is in ComputeType<S> (fp32, or double for the
// reference); LayerNorm statistics, softmax statistics and the loss are never rounded to S.
// A value is rounded to S exactly where a GPU kernel keeps it in 16-bit memory, so the host
// backend produces the numbers the CUDA kernels of models/cuda/ produce (up to summation
// order) and CI tests them. The rounding points, each one rounding of an fp32 value:
//   embedding   x = S(wte[tok] + wpe[t])
//               dwte[v] = S(sum of dx rows with token v), dwpe[t] = S(sum over b of dx[b, t])
//   matmul      out = S(in W (+ bias) (+ residual)): fp32 accumulation, the bias and the
//               residual added to the fp32 sum (a cuBLASLt bias epilogue and beta = 1)
//               dW = S(in^T dout), db = S(column sums of dout) (the BGRADB epilogue)
//   layer fwd   ln1 = S(LN(x));  qkv = S(ln1 Wqkv + bqkv);  att = S(attention(qkv));
//               x2 = S(x + att Wo + bo);  ln2 = S(LN(x2));  h = S(ln2 Wfc + bfc) (the
//               pre-activation kept for the backward, the GELU_AUX epilogue's aux);
//               g = S(gelu(fp32 h before rounding));  y = S(x2 + g Wp + bp)
//   attention   FlashAttention-2 semantics (Dao, 2023): scores and softmax in fp32
//               (row max and log-sum-exp kept in fp32), probabilities rounded to S before
//               the product with V, the output accumulated in fp32 and rounded once.
//               Backward: D = rowsum(dO * O) fp32, probabilities recomputed from q, k and
//               the log-sum-exp, dS = P (dP - D) rounded to S before its products,
//               dq, dk, dv accumulated in fp32 and rounded once each.
//   layer bwd   dh = S((dy Wp^T) * gelu'(h)) (the DGELU epilogue); dln = S(dout W^T);
//               LayerNorm backward in fp32 from S inputs, the residual gradient added before
//               the one rounding: dx2 = S(dy + LN2'(dln2)), dx = S(dx2 + LN1'(dln1));
//               dln_w, dln_b = S(fp32 column sums)
//   head        lnf = S(LN(x)); then in chunks of R = HeadChunkRows(N, V) rows (the (N, V)
//               logits never exist; chunks in row order): logits = S(lnf Wlm) (fp32
//               accumulation) in a (R, V) chunk buffer; loss per row in fp32 from the S
//               logits; the mean over N summed in double in token order. The (B, V) logits
//               the head returns are those of the last position of each sequence, their own
//               product: S(lnf[b, T-1] Wlm). Backward, per chunk: dlogits =
//               S(dloss / N (softmax - onehot)) in place in the chunk buffer; dlnf rows =
//               S(dlogits Wlm^T) (each row from its own dlogits row, as unchunked);
//               lnf^T dlogits added into an fp32 (C, V) accumulator (fp32 GEMM, beta = 1; for
//               S = float the accumulator is dWlm itself), rounded once at the end: dWlm =
//               S(sum over chunks in chunk order); then dx = S(LNf'(dlnf)). The accumulator,
//               4 C V bytes, is smaller than the (N, V) logits in S whenever N > 2 C.
// With tied embeddings Wlm is wte^T (read in place from the embedding chunk), dWlm is dwte.
// For S = float every S(.) is the identity and the kernels are the fp32 path.
// Every block is a composition of the shared ops of models/ops/ (embedding, layer_norm,
// matmul, attention, gelu, cross_entropy), whose headers state these rounding points op by op.
//
// Determinism: every function gives bit-identical results across runs and
// independent of the number of threads, for one binary on one CPU (fixed
// blocking everywhere; sums over rows run in a fixed order; transcendental
// functions take the same vector code path for every element; matrix products
// go through gpu::host::Gemm, deterministic in the same sense).
//
// Memory: no allocation inside the kernels beyond oneTBB's own, the GEMM's per-thread packing
// buffers and per-thread attention tiles (grown once); activations live in the caller's
// buffers and scratch (sizes below, in bytes, for storage type S).
//
// Thread-safety: all functions are reentrant and keep no state; they run
// oneTBB parallel loops internally (and may be called from inside oneTBB
// tasks). Concurrent calls must not share output or scratch buffers. Unless a
// comment says otherwise, input and output buffers must not overlap.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "models/lora.h"
#include "models/ops/cross_entropy.h"

namespace strata::models {

struct GptShape {
  int vocab_size = 256;
  int max_seq_len = 0;
  int num_layers = 0;
  int num_heads = 0;
  int channels = 0;
  // Tied embeddings (Hugging Face GPT2LMHeadModel): the head chunk is lnf_w, lnf_b only and the
  // logits are lnf wte^T with wte (V, C) read from the embedding chunk (BlockBuffers::
  // tied_params); its gradient goes to tied_grads. false: the untied (C, V) lm_head_w.
  bool tie_embeddings = false;
  double layer_norm_eps = 1e-5;  // every LayerNorm (Hugging Face layer_norm_epsilon)
};

// kInvalidArgument unless every field is positive (layer_norm_eps finite) and
// channels % num_heads == 0.
Status ValidateShape(const GptShape& shape);

// One tensor of a block's chunk; offset and num_elems in elements from the
// start of the chunk.
struct TensorInfo {
  std::string name;
  int64_t offset = 0;
  std::vector<int64_t> shape;
  int64_t num_elems = 0;
};

std::vector<TensorInfo> EmbeddingTensors(const GptShape& shape);  // "wte", "wpe"
std::vector<TensorInfo> LayerTensors(const GptShape& shape);      // "ln1_w", ..., "mlp_proj_b"
// "lnf_w", "lnf_b", "lm_head_w"; without "lm_head_w" when tie_embeddings.
std::vector<TensorInfo> HeadTensors(const GptShape& shape);

// Chunk sizes in elements.
int64_t EmbeddingNumParams(const GptShape& shape);  // (V + max_seq_len) * C
int64_t LayerNumParams(const GptShape& shape);      // 12 C^2 + 13 C
int64_t HeadNumParams(const GptShape& shape);       // 2 C + C V (2 C when tied)

// GPT-2 initialisation of a chunk (fp32): embedding and linear weights
// N(0, 0.02), residual projections (attn_proj_w, mlp_proj_w)
// N(0, 0.02 / sqrt(2 * num_layers)), LayerNorm weights 1, biases 0.
// Deterministic: a function of (shape, seed, block) only — std::mt19937_64
// seeded per block from (seed, block) and our own Box-Muller transform (not
// std::normal_distribution, whose output is implementation-defined). Every
// element of the chunk is written. layer_index in [0, num_layers).
void InitGptEmbeddingParams(const GptShape& shape, uint64_t seed, float* params);
void InitGptLayerParams(const GptShape& shape, int layer_index, uint64_t seed, float* params);
void InitGptHeadParams(const GptShape& shape, uint64_t seed, float* params);

// Scratch in bytes of each block function for storage type S and a micro-batch of B
// sequences of T tokens; forward and backward of a block share one scratch (the backward
// recomputes the forward from x_in: activation checkpointing at block boundaries). B >= 1,
// 1 <= T <= max_seq_len (STRATA_CHECK). Pure, thread-safe. The scratch is a sequence of
// sub-buffers, each starting at a multiple of 64 bytes (the layer's: 256) from the scratch's
// start (the scratch itself must be aligned to at least alignof(ComputeType<S>));
// F = ComputeType<S>, N = B T:
//   Embedding: first (V + 1) int32, order (N) int32 (a counting sort of positions by token).
//   Layer:     GptLayerScratchLayout (models/gpt_layout.h), the one layout of the host and CUDA
//              layers: mean1, rstd1, mean2, rstd2 (N) F; lse, delta (B, H, T) F; the CUDA ops'
//              column-sum partials; ln1 (N, C), qkv (N, 3C), att (N, C), x2 (N, C), ln2 (N, C),
//              h (N, 4C), g (N, 4C), dln (N, C) in S (16 N C elements; the backward reuses them
//              for the gradients). No T x T buffer: attention works on per-thread tiles.
//   Head:      lnf (N, C) S; mean, rstd (N) F; then the LM head's scratch
//              (ops::LmHeadScratchBytes: loss (N) F; logits chunk (R, V) S with
//              R = HeadChunkRows(N, V); dWlm accumulator (C, V) fp32 for 16-bit S, none for
//              S = float or double: the accumulator is the output).
template <typename S>
int64_t GptEmbeddingScratchBytes(const GptShape& shape, int B, int T);
template <typename S>
int64_t GptLayerScratchBytes(const GptShape& shape, int B, int T);
template <typename S>
int64_t GptHeadScratchBytes(const GptShape& shape, int B, int T);

// x_out[b, t] = S(wte[tokens[b, t]] + wpe[p]), p = position_ids[b, t] (packed sequences,
// engine::BlockBuffers) or t when position_ids is null.
//   params: embedding chunk; tokens: (B, T) int32; x_out: (B, T, C).
template <typename S>
void GptEmbeddingForward(const GptShape& shape, const S* params, const int32_t* tokens, int B,
                         int T, S* x_out, const int32_t* position_ids = nullptr);

// dparams (embedding chunk, OVERWRITTEN; rows of wpe at positions >= T and of
// wte for tokens not present are zero) from dx_out: (B, T, C); each row summed in fp32 in token
// order and rounded once (a wpe row: its positions' rows in token order). scratch:
// GptEmbeddingScratchBytes<S>. position_ids as for GptEmbeddingForward.
template <typename S>
void GptEmbeddingBackward(const GptShape& shape, const int32_t* tokens, const S* dx_out, int B,
                          int T, S* dparams, void* scratch, const int32_t* position_ids = nullptr);

// One transformer layer. params: layer chunk; x_in, x_out: (B, T, C);
// scratch: GptLayerScratchBytes<S>, contents undefined after. position_ids: (B, T) or null, the
// attention's (ops::AttentionDims: packed examples do not attend to each other).
template <typename S>
void GptLayerForward(const GptShape& shape, const S* params, const S* x_in, S* x_out, int B, int T,
                     void* scratch, const LoraLayerArgs<S>& lora = {},
                     const int32_t* position_ids = nullptr);

// Recomputes the forward from x_in, then writes dx_in: (B, T, C) and dparams
// (the whole layer chunk, OVERWRITTEN, not accumulated; null: no weight gradient, LoRA's
// frozen base) from dx_out: (B, T, C). scratch as for GptLayerForward. forward_kept: the scratch
// holds what GptLayerForward on the same inputs left there; the recomputation is skipped (the
// same activations, bit for bit). dx_in must not overlap
// x_in or dx_out. With `lora` active (models/lora.h) every targeted product adds its adapter's
// output (the MLP's first product before GELU, which is then not fused with it), and the
// backward writes the adapters' gradients and their share of dx_in.
template <typename S>
void GptLayerBackward(const GptShape& shape, const S* params, const S* x_in, const S* dx_out,
                      S* dx_in, S* dparams, int B, int T, void* scratch,
                      const LoraLayerArgs<S>& lora = {}, const int32_t* position_ids = nullptr,
                      bool forward_kept = false);

// The layer's products as LoRA sites name them: c_attn (the fused q/k/v), the attention's
// c_proj, the MLP's c_fc and c_proj.
inline constexpr int kGptAttnProduct = 0, kGptAttnProjProduct = 1, kGptFcProduct = 2,
                     kGptMlpProjProduct = 3;
// The modules LoRA may target, Hugging Face names: c_attn (attn.c_attn), c_proj (attn.c_proj and
// mlp.c_proj: PEFT targets both by the one name), c_fc (mlp.c_fc). Base weights (in, out).
std::vector<LoraModule> GptLoraModules(const GptShape& shape);

// The head computes its logits and the cross-entropy in chunks of rows, so that no (N, V)
// logits buffer exists: R = HeadChunkRows(N, V) (models/ops/cross_entropy.h: the largest R <= N
// with R V <= kHeadChunkElems = 2^22, at least 1), a function of (N, V) only, so the chunking,
// and with it every result, is fixed for a given problem.
using ops::HeadChunkRows;
using ops::kHeadChunkElems;

// Final LayerNorm and LM head. params: head chunk; x_in: (B, T, C);
// targets: (B, T) int32 or nullptr; logits: (B, V) written, the logits of the last position
// (t = T - 1) of each sequence (what generation needs); scratch: GptHeadScratchBytes<S>.
// Returns the mean cross-entropy over the loss_tokens counted targets (those not
// engine::kIgnoreTarget; 0: all B*T) summed in double in token order, or 0 when targets is null
// (then no chunk is computed: only the B last-position rows).
// tied_params: with shape.tie_embeddings the embedding chunk (its first V C elements are wte
// (V, C), the LM head's weight: logits = lnf wte^T), required (STRATA_CHECK); else unused.
// target_losses: (B, T) fp32 or null; with targets, each position's cross-entropy (0 where
// ignored), the values the mean sums (ops::LmHeadForward's row_losses).
template <typename S>
ComputeType<S> GptHeadForward(const GptShape& shape, const S* params, const S* x_in,
                              const int32_t* targets, int B, int T, S* logits, void* scratch,
                              const S* tied_params = nullptr, int64_t loss_tokens = 0,
                              float* target_losses = nullptr);

// Gradient of dloss * (mean cross-entropy): recomputes the forward from x_in chunk by chunk,
// writes dx_in: (B, T, C) and dparams (head chunk, OVERWRITTEN). targets must not be null.
// No logits are written. scratch: GptHeadScratchBytes<S>. With shape.tie_embeddings, tied_params
// as for GptHeadForward and tied_grads (EmbeddingNumParams elements, OVERWRITTEN): dwte in its
// first V C elements (rounded once, as dWlm), zero in the rest (the wpe part); both required.
// target_weights: (B, T) fp32 or null; when set the objective is dloss * sum_t w_t CE_t
// (ops::LmHeadBackward's row_weights; loss_tokens is not read).
template <typename S>
void GptHeadBackward(const GptShape& shape, const S* params, const S* x_in, const int32_t* targets,
                     ComputeType<S> dloss, int B, int T, S* dx_in, S* dparams, void* scratch,
                     const S* tied_params = nullptr, S* tied_grads = nullptr,
                     int64_t loss_tokens = 0, const float* target_weights = nullptr);

// The head with an explicit number of rows per chunk (chunk_rows in [1, N], STRATA_CHECK), for
// tests that compare chunkings; scratch: GptHeadScratchBytesWithChunkRows<S>. The functions
// above are these with chunk_rows = HeadChunkRows(N, V).
namespace internal {
template <typename S>
int64_t GptHeadScratchBytesWithChunkRows(const GptShape& shape, int B, int T, int64_t chunk_rows);
template <typename S>
ComputeType<S> GptHeadForwardWithChunkRows(const GptShape& shape, const S* params, const S* x_in,
                                           const int32_t* targets, int B, int T, S* logits,
                                           void* scratch, int64_t chunk_rows,
                                           const S* tied_params = nullptr, int64_t loss_tokens = 0,
                                           float* target_losses = nullptr);
template <typename S>
void GptHeadBackwardWithChunkRows(const GptShape& shape, const S* params, const S* x_in,
                                  const int32_t* targets, ComputeType<S> dloss, int B, int T,
                                  S* dx_in, S* dparams, void* scratch, int64_t chunk_rows,
                                  const S* tied_params = nullptr, S* tied_grads = nullptr,
                                  int64_t loss_tokens = 0, const float* target_weights = nullptr);
}  // namespace internal

}  // namespace strata::models
