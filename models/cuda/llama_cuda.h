// The Llama family's blocks on the CUDA backend: the same forward and backward as the host
// kernels of models/llama_kernels.h (same chunk layouts, shapes, rounding points and
// recompute-from-x_in activation checkpointing). The layer is the family's one body
// (models/llama_block.h) over the CUDA ops adapter (ops::cuda::CudaOps, models/ops/cuda/
// cuda_ops.cuh), with the family's one layer scratch layout (models/llama_layout.h); the blocks
// are composed from the CUDA ops of
// models/ops/cuda/ops.cuh (RMSNorm, RoPE, SwiGLU, the grouped-query attention on tensor cores
// where it applies, the embedding, the chunked head) and its cuBLASLt products: q/k/v as one
// (Dqkv, C) kOutIn product (a transposed-B GEMM), gate/up as one (2I, C), o_proj and down_proj
// with the residual added by the product (beta = 1).
//
// Plain C++ header (no CUDA headers), so models/llama.cc includes it in every build; the block
// functions are defined only when the binary has the CUDA backend (STRATA_HAVE_CUDA). The
// scratch sizes and layouts are in models/cuda/llama_cuda_layout.h and, the layer's,
// models/llama_layout.h (always built).
//
// Conventions (as models/cuda/gpt_cuda.h): `stream` is a CUDA backend stream, all work enqueued
// on it in order; every pointer is DEVICE memory of its device, of storage type S (tokens and
// targets int32), 16-byte aligned, scratch kScratchAlign-aligned and at least the layout's
// bytes; arguments checked before anything is launched (kInvalidArgument naming the problem:
// an invalid config, B < 1, T outside [1, max_seq_len], head_dim > 256, a required pointer
// null); cuBLAS and launch failures come back as Status; token and target values outside
// [0, V) (a target other than engine::kIgnoreTarget, -1, which the loss does not count) and
// position ids outside [0, T) or past their token trap on the device. Packed sequences:
// position_ids (B, T) int32 (device memory, or null: one sequence per row, position t), as
// engine::BlockBuffers::position_ids: the rotary position of token t of row b is
// position_ids[b, t], and it attends to tokens t - position_ids[b, t] .. t of its row only. Nothing
// is allocated. Products take S inputs and outputs with fp32 accumulation (no TF32: the fp32 path
// is exact fp32). Deterministic: bit-identical from run to run on one GPU and cuBLAS version; NOT
// bit-identical to the host kernels (summation order, the GPU's expf and sqrtf): they agree to the
// rounding of S, which tests/models/llama_cuda_test.cc checks element by element. Thread-safety:
// calls on one stream from one thread at a time; concurrent calls must not share output or scratch
// buffers.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "gpu/device.h"
#include "models/cuda/llama_cuda_layout.h"
#include "models/llama_config.h"
#include "models/lora.h"

namespace strata::models::cuda {

// The largest head_dim the CUDA blocks take (the attention kernels' ops::cuda::
// kAttentionMaxHeadDim, Gemma 3's 256); the host blocks take any. LlamaFamily::CudaSupports
// refuses a larger one when the engine prepares its CUDA stream, before the first step.
inline constexpr int kLlamaCudaMaxHeadDim = 256;

// Takes the stream's cuBLAS handle and workspace and makes the device's cuBLASLt handle, once,
// before any block runs (ops::cuda::PrepareStream, as GptCudaPrepareStream of gpt_cuda.h).
Status LlamaCudaPrepareStream(gpu::Stream& stream);

// Templates on S in {float, Bf16, Fp16} (instantiated for those three).

// x_out (B, T, C) = embed_tokens[tokens] (an exact copy). params: embedding chunk (V, C).
template <typename S>
Status LlamaCudaEmbeddingForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                                 const int32_t* tokens, int B, int T, S* x_out);

// dparams (V, C) OVERWRITTEN: each row the sum of the dx_out rows of its token in row order
// (fp32, rounded once; zero for absent tokens). scratch: LlamaCudaEmbeddingScratchBytes<S>.
template <typename S>
Status LlamaCudaEmbeddingBackward(const LlamaConfig& c, gpu::Stream& stream, const int32_t* tokens,
                                  const S* dx_out, int B, int T, S* dparams, void* scratch);

// One decoder layer x_in -> x_out (B, T, C). scratch: LlamaCudaLayerScratchBytes<S>. x_out must
// not overlap x_in. position_ids: the rotary positions and the attention's blocks (packed).
// lora: the layer's adapters (models/lora.h; device pointers, its scratch LoraScratchBytes<S>
// for B T rows, apart from `scratch`), added to the targeted products as
// models/cuda/lora_cuda.cuh computes them; inactive (the default): the plain layer.
template <typename S>
Status LlamaCudaLayerForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* x_in, S* x_out, int B, int T, void* scratch,
                             const int32_t* position_ids = nullptr,
                             const LoraLayerArgs<S>& lora = {}, int layer = 0,
                             int max_positions = 0);

// Recomputes the forward from x_in, then writes dx_in (B, T, C) and dparams (the layer chunk,
// OVERWRITTEN) from dx_out. dx_in must not overlap x_in or dx_out. position_ids and lora: the
// forward's; with active adapters their gradients go to lora.dadapters (OVERWRITTEN) and dparams
// may be null (LoRA's frozen base: no weight gradient is computed). forward_kept: the scratch
// holds what LlamaCudaLayerForward on the same inputs left there; the recomputation is skipped.
template <typename S>
Status LlamaCudaLayerBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                              const S* x_in, const S* dx_out, S* dx_in, S* dparams, int B, int T,
                              void* scratch, const int32_t* position_ids = nullptr,
                              const LoraLayerArgs<S>& lora = {}, bool forward_kept = false,
                              int layer = 0, int max_positions = 0);

// Final RMSNorm and LM head with the (V, C) weight (the head chunk's lm_head, or, tied,
// tied_params = the embedding chunk; null then is kInvalidArgument). logits (B, V): the last
// position of each sequence. With targets (B, T) and loss non-null, *loss (one fp32 in device
// memory) = the sum of the tokens' cross-entropy (0 for an ignored target) / loss_tokens (0:
// B T, the mean) (chunks of HeadChunkRows(N, V) rows; no (N, V) logits). scratch:
// LlamaCudaHeadScratchBytes<S>. target_losses: (B, T) fp32 device memory or null; with targets,
// each position's cross-entropy (0 where ignored), the values the loss sums
// (ops::cuda::ChunkedHeadForward's row_losses).
template <typename S>
Status LlamaCudaHeadForward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                            const S* tied_params, const S* x_in, const int32_t* targets, int B,
                            int T, S* logits, void* scratch, float* loss, int64_t loss_tokens = 0,
                            float* target_losses = nullptr);

// Gradient of dloss * (the forward's loss over loss_tokens counted targets; 0: B T): dx_in
// (B, T, C) and dparams (head chunk) OVERWRITTEN; the rows of ignored targets add nothing; the
// (V, C) weight gradient accumulated over the chunks in fp32 and rounded once, into the head
// chunk (untied) or tied_grads (tied: the whole embedding chunk, OVERWRITTEN; required then).
// dparams null: dx_in only (LoRA's frozen head; tied_grads is not read). targets must not be
// null. target_weights: (B, T) fp32 device memory or null; when set the logits' gradient is
// dloss w_t (softmax - onehot) (ops::cuda::ChunkedHeadBackward's row_weights; loss_tokens is not
// read).
template <typename S>
Status LlamaCudaHeadBackward(const LlamaConfig& c, gpu::Stream& stream, const S* params,
                             const S* tied_params, const S* x_in, const int32_t* targets,
                             float dloss, int B, int T, S* dx_in, S* dparams, S* tied_grads,
                             void* scratch, int64_t loss_tokens = 0,
                             const float* target_weights = nullptr);

}  // namespace strata::models::cuda
