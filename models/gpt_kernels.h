// Host (CPU) forward and backward kernels of a GPT-2 style model, per engine block.
//
// Model: GPT-2 (Radford et al., "Language Models are Unsupervised Multitask
// Learners", 2019) with pre-LayerNorm blocks: token + learned position
// embeddings; num_layers blocks of
//   x2 = x + Proj(CausalSelfAttention(LayerNorm1(x)))
//   y  = x2 + Proj(GELU(Fc(LayerNorm2(x2))))
// a final LayerNorm, an untied LM head without bias, and cross-entropy.
// LayerNorm as in Ba, Kiros & Hinton, "Layer Normalization", 2016 (eps 1e-5);
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
//   Head:      lnf_w (C), lnf_b (C), lm_head_w (C, V)
// qkv columns are [q (C) | k (C) | v (C)]; head h uses columns h*hs..(h+1)*hs of
// each, hs = C / H.
//
// Notation: V vocab_size, C channels, H num_heads, hs = C / H, B sequences of
// T tokens per micro-batch (1 <= T <= max_seq_len), activations (B, T, C) are
// row-major with B*T rows of C. Real is the compute type, float or double;
// tokens and targets are int32 in [0, V) (the caller validates data; a value
// outside the range is a STRATA_CHECK failure, never an out-of-bounds read).
//
// Determinism: every function gives bit-identical results across runs and
// independent of the number of threads, for one binary on one CPU (fixed
// blocking everywhere; sums over rows run in a fixed order; transcendental
// functions take the same vector code path for every element; matrix products
// go through gpu::host::Gemm, deterministic in the same sense).
//
// Memory: no allocation inside the kernels beyond oneTBB's own and the GEMM's
// per-thread packing buffers (grown once); all activations live in the
// caller's buffers and scratch.
//
// Thread-safety: all functions are reentrant and keep no state; they run
// oneTBB parallel loops internally (and may be called from inside oneTBB
// tasks). Concurrent calls must not share output or scratch buffers. Unless a
// comment says otherwise, input and output buffers must not overlap.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace strata::models {

struct GptShape {
  int vocab_size = 256;
  int max_seq_len = 0;
  int num_layers = 0;
  int num_heads = 0;
  int channels = 0;
};

// kInvalidArgument unless every field is positive and channels % num_heads == 0.
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
std::vector<TensorInfo> HeadTensors(const GptShape& shape);       // "lnf_w", "lnf_b", "lm_head_w"

// Chunk sizes in elements.
int64_t EmbeddingNumParams(const GptShape& shape);  // (V + max_seq_len) * C
int64_t LayerNumParams(const GptShape& shape);      // 12 C^2 + 13 C
int64_t HeadNumParams(const GptShape& shape);       // 2 C + C V

// GPT-2 initialisation of a chunk (fp32): embedding and linear weights
// N(0, 0.02), residual projections (attn_proj_w, mlp_proj_w)
// N(0, 0.02 / sqrt(2 * num_layers)), LayerNorm weights 1, biases 0.
// Deterministic: a function of (shape, seed, block) only — std::mt19937_64
// seeded per block from (seed, block) and our own Box-Muller transform (not
// std::normal_distribution, whose output is implementation-defined). Every
// element of the chunk is written. layer_index in [0, num_layers).
void InitEmbeddingParams(const GptShape& shape, uint64_t seed, float* params);
void InitLayerParams(const GptShape& shape, int layer_index, uint64_t seed, float* params);
void InitHeadParams(const GptShape& shape, uint64_t seed, float* params);

// Scratch, in elements of Real, that LayerForward / LayerBackward need for a
// micro-batch of B sequences of T tokens (forward and backward share one
// scratch: the backward recomputes the forward from x_in, i.e. activation
// checkpointing at block boundaries). The layer works on groups of G whole
// sequences at a time, G = min(B, ceil(256 / T)) (at least 256 rows per
// matrix product when B allows), so the scratch does not grow with B beyond G.
// With R = G*T rows and rb = min(T, 64) (the attention row block):
//   LayerScratchElems = 4 R                            LayerNorm mean, rstd x2
//                     + 3 R C                          qkv
//                     + G H T^2                        attention probabilities
//                     + max(8 R C, 5 R C + G H rb T)   work area
// The work area holds, at different times, ln1 / attention output / ln2 /
// fc pre-activation (4 R C) / GELU output (4 R C), and in the backward their
// gradients; LayerNorm outputs and the attention output are recomputed in the
// backward instead of being kept.
int64_t LayerScratchElems(const GptShape& shape, int B, int T);
// HeadScratchElems = B T C (final LayerNorm output) + 3 B T (mean, rstd,
// per-token loss); the (B, T, V) logits buffer is separate.
int64_t HeadScratchElems(const GptShape& shape, int B, int T);

// x_out[b, t] = wte[tokens[b, t]] + wpe[t].
//   params: embedding chunk; tokens: (B, T) int32; x_out: (B, T, C).
template <typename Real>
void EmbeddingForward(const GptShape& shape, const Real* params, const int32_t* tokens, int B,
                      int T, Real* x_out);

// dparams (embedding chunk, OVERWRITTEN; rows of wpe at positions >= T and of
// wte for tokens not present are zero) from dx_out: (B, T, C).
template <typename Real>
void EmbeddingBackward(const GptShape& shape, const int32_t* tokens, const Real* dx_out, int B,
                       int T, Real* dparams);

// One transformer layer. params: layer chunk; x_in, x_out: (B, T, C);
// scratch: LayerScratchElems(shape, B, T) elements, contents undefined after.
template <typename Real>
void LayerForward(const GptShape& shape, const Real* params, const Real* x_in, Real* x_out, int B,
                  int T, Real* scratch);

// Recomputes the forward from x_in, then writes dx_in: (B, T, C) and dparams
// (the whole layer chunk, OVERWRITTEN, not accumulated) from dx_out: (B, T, C).
// scratch as for LayerForward. dx_in must not overlap x_in or dx_out.
template <typename Real>
void LayerBackward(const GptShape& shape, const Real* params, const Real* x_in, const Real* dx_out,
                   Real* dx_in, Real* dparams, int B, int T, Real* scratch);

// Final LayerNorm and LM head. params: head chunk; x_in: (B, T, C);
// targets: (B, T) int32 or nullptr; logits: (B, T, V) written;
// scratch: HeadScratchElems(shape, B, T) elements.
// Returns the mean cross-entropy over the B*T tokens, or 0 when targets is null.
template <typename Real>
Real HeadForward(const GptShape& shape, const Real* params, const Real* x_in,
                 const int32_t* targets, int B, int T, Real* logits, Real* scratch);

// Gradient of dloss * (mean cross-entropy): recomputes the forward from x_in,
// writes dx_in: (B, T, C) and dparams (head chunk, OVERWRITTEN). targets must
// not be null. logits: (B, T, V) is used as scratch (its contents on return
// are the logit gradients). scratch: HeadScratchElems(shape, B, T) elements.
template <typename Real>
void HeadBackward(const GptShape& shape, const Real* params, const Real* x_in,
                  const int32_t* targets, Real dloss, int B, int T, Real* dx_in, Real* dparams,
                  Real* logits, Real* scratch);

}  // namespace strata::models
