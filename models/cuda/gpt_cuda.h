// The GPT's blocks on the CUDA backend: the same forward and backward as the host
// kernels of models/gpt_kernels.h (same model, same chunk layouts, same shapes, same
// recompute-from-x_in activation checkpointing), launched on a CUDA stream. The layer is the
// family's one body (models/gpt_block.h) over the CUDA ops adapter (ops::cuda::CudaOps,
// models/ops/cuda/cuda_ops.cuh), with the family's one layer scratch layout (models/gpt_layout.h).
//
// This header is plain C++ (no CUDA headers), so models/gpt.cc includes it in every
// build; the scratch sizes (gpt_cuda_layout.h, gpt_layout.h) are always available, the block
// functions are defined only when the binary has the CUDA backend (STRATA_HAVE_CUDA). The ops
// behind them are the CUDA ops library, models/ops/cuda/ops.cuh.
//
// Conventions for every block function:
//   - `stream` is a CUDA backend stream (gpu::NativeStream STRATA_CHECKs it); all work
//     is enqueued on it in order and runs asynchronously. The call makes the stream's
//     device current on the calling thread (through gpu::CublasHandle).
//   - Every pointer is DEVICE memory of that device, of the storage type S (tokens/targets
//     int32), 16-byte aligned; shapes as in gpt_kernels.h: activations (B, T, C) row-major,
//     last-position logits (B, V), chunks in the layout of EmbeddingTensors/LayerTensors/
//     HeadTensors.
//   - Arguments are checked before anything is launched: kInvalidArgument naming the
//     problem (B < 1, T outside [1, max_seq_len], a null pointer that is needed).
//     cuBLAS/launch failures come back as Status (gpu/cuda/cuda_status.h); faults of
//     running kernels surface at the stream's next synchronization.
//   - Packed sequences: position_ids (B, T) int32 (device memory, or null: one sequence per
//     row, position t), as engine::BlockBuffers::position_ids: token t of row b has position
//     position_ids[b, t] (the learned position embedding it adds) and attends to tokens
//     t - position_ids[b, t] .. t of its row only. Targets of engine::kIgnoreTarget (-1) are
//     not counted by the loss, whose mean is over loss_tokens, the number of counted targets
//     (0: B T).
//   - Token and target values cannot be checked on the host (they are in device
//     memory): a value outside [0, V) (a target other than -1; a position id outside
//     [0, T) or past its token) stops the kernel that reads it with a device
//     trap, never an out-of-bounds access. A trap is a kernel fault: the next
//     synchronization reports it (cudaErrorLaunchFailure), and the CUDA context of the
//     whole process is then unusable (every later CUDA call fails; only a new process
//     recovers), as with any fault. So the caller validates data, as for the host
//     kernels (whose check is a STRATA_CHECK).
//   - Nothing is allocated: intermediate values live in `scratch` (sizes and layout in
//     gpt_layout.h for the layer, gpt_cuda_layout.h for the embedding and head; 16-byte aligned,
//     256 for the fastest products); the cuBLASLt products use the stream's cuBLAS workspace
//     (gpu::CublasWorkspace, 32 MiB outside the arena, taken by GptCudaPrepareStream). All N = B T
//     rows are computed at once (the head's logits in chunks of rows); matrix products go through
//     cuBLASLt with fused epilogues (gpu/cuda/cuda_lt_matmul.h; algorithm chosen once per shape and
//     cached); attention is fused (FlashAttention-2 style, no T x T matrix). GptCudaPrepareStream
//     loads cuBLAS and cuBLASLt and makes the device's Lt handle before the first step:
//     kUnavailable when either library is absent.
//   - Products take S inputs and outputs with fp32 accumulation (CUBLAS_COMPUTE_32F; TF32 for
//     the fp32 path only with GptCudaOptions::allow_tf32). Reductions use a fixed order and a
//     fixed launch shape for a given problem, and there are no floating-point atomics (the
//     embedding's counting sort counts with integer atomics, whose result does not depend on
//     their order): results are bit-identical from run to run on one GPU and cuBLAS version.
//     They are NOT bit-identical to the host kernels (other summation orders, the GPU's
//     expf/tanhf, cuBLASLt's GELU): they agree to the rounding of S, which
//     tests/models/gpt_cuda_test.cc checks element by element.
//   - Thread-safety: calls on one stream from one thread at a time (cuBLAS rule);
//     concurrent calls must not share output or scratch buffers.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "gpu/device.h"
#include "models/cuda/gpt_cuda_layout.h"
#include "models/gpt_kernels.h"

namespace strata::models::cuda {

// How the layer and head blocks compute their matrix products.
struct GptCudaOptions {
  // fp32 products on TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded to a
  // 10-bit mantissa, fp32 accumulation; on Hopper several times the fp32 rate). Off: exact fp32
  // products, the results tests compare with the host kernels at fp32 rounding.
  bool allow_tf32 = false;
};

// Scratch of the block functions below in bytes, for storage type S (float, Bf16, Fp16) and a
// micro-batch of B sequences of T tokens: GptCudaEmbeddingScratchBytes, GptCudaLayerScratchBytes
// and GptCudaHeadScratchBytes are in models/cuda/gpt_cuda_layout.h (plain C++, always built), with
// the layouts behind them (the layer's: GptLayerScratchLayout, models/gpt_layout.h, the host's
// too).

// Takes what the blocks need from `stream` beyond their scratch, once, before any block
// runs: the stream's cuBLAS handle with its workspace (gpu::CublasHandle). Errors as
// CublasHandle's (kUnavailable when cuBLAS cannot be loaded, kResourceExhausted for the
// workspace).
Status GptCudaPrepareStream(gpu::Stream& stream);

// Every block function is a template on the storage type S of its typed buffers: float (the
// fp32 path), Bf16 or Fp16 (base/dtype.h; __nv_bfloat16 / __half in device code), with the
// rounding points of models/gpt_kernels.h ("Storage and rounding"). Instantiated for those
// three.

// x_out[b, t] = S(wte[tokens[b, t]] + wpe[p]), p = position_ids[b, t] (packed) or t.
// params: embedding chunk; tokens (B, T); x_out (B, T, C).
template <typename S>
Status GptCudaEmbeddingForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                               const int32_t* tokens, int B, int T, S* x_out,
                               const int32_t* position_ids = nullptr);

// dparams (embedding chunk, OVERWRITTEN) from dx_out (B, T, C), deterministic without
// atomics: each wte row sums the rows of its tokens in token order in fp32 and rounds once;
// each wpe row p sums the rows at position p (over b without position_ids; with them, in row
// order after a counting sort by position), zero for a position no row has.
// scratch: GptCudaEmbeddingScratchBytes<S>.
template <typename S>
Status GptCudaEmbeddingBackward(const GptShape& shape, gpu::Stream& stream, const int32_t* tokens,
                                const S* dx_out, int B, int T, S* dparams, void* scratch,
                                const int32_t* position_ids = nullptr);

// One transformer layer, x_in -> x_out (B, T, C); scratch: GptCudaLayerScratchBytes<S>.
// x_out must not overlap x_in. position_ids: the attention's blocks (packed sequences).
// lora: the layer's adapters (models/lora.h; device pointers, its scratch LoraScratchBytes<S>
// for B T rows, apart from `scratch`), added to the targeted products as
// models/cuda/lora_cuda.cuh computes them (an adapter on c_fc adds to the pre-activation, and
// the GELU then runs unfused on its rounded value, as on the host); inactive: the plain layer.
template <typename S>
Status GptCudaLayerForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                           const S* x_in, S* x_out, int B, int T, void* scratch,
                           const GptCudaOptions& options = {},
                           const int32_t* position_ids = nullptr,
                           const LoraLayerArgs<S>& lora = {});

// Recomputes the forward from x_in, then writes dx_in (B, T, C) and dparams (layer
// chunk, OVERWRITTEN) from dx_out. dx_in must not overlap x_in or dx_out. position_ids and lora:
// those of the forward; with active adapters their gradients go to lora.dadapters (OVERWRITTEN)
// and dparams may be null (LoRA's frozen base: no weight gradient is computed). forward_kept: the
// scratch holds what GptCudaLayerForward on the same inputs left there; the recomputation is
// skipped.
template <typename S>
Status GptCudaLayerBackward(const GptShape& shape, gpu::Stream& stream, const S* params,
                            const S* x_in, const S* dx_out, S* dx_in, S* dparams, int B, int T,
                            void* scratch, const GptCudaOptions& options = {},
                            const int32_t* position_ids = nullptr,
                            const LoraLayerArgs<S>& lora = {}, bool forward_kept = false);

// Final LayerNorm and LM head: logits (B, V) written, those of the last position (t = T - 1)
// of each sequence. With targets (B, T) non-null and loss non-null, *loss (one fp32 in device
// memory) receives the sum of the tokens' cross-entropy (summed in double, fixed order; 0 for
// an ignored target) / loss_tokens (0: B T, the mean), computed in chunks of HeadChunkRows(N, V)
// rows in the scratch (no (N, V) logits).
// scratch: GptCudaHeadScratchBytes<S>. With shape.tie_embeddings, tied_params is the embedding
// chunk (its first V C elements: wte (V, C), the head's weight, read transposed; null is
// kInvalidArgument); else unused. target_losses: (B, T) fp32 device memory or null; with targets,
// each position's cross-entropy (0 where ignored), the values the loss sums
// (ops::cuda::ChunkedHeadForward's row_losses).
template <typename S>
Status GptCudaHeadForward(const GptShape& shape, gpu::Stream& stream, const S* params,
                          const S* x_in, const int32_t* targets, int B, int T, S* logits,
                          void* scratch, float* loss, const GptCudaOptions& options = {},
                          const S* tied_params = nullptr, int64_t loss_tokens = 0,
                          float* target_losses = nullptr);

// Gradient of dloss * (the forward's loss): recomputes the forward chunk by chunk, writes
// dx_in (B, T, C) and dparams (head chunk, OVERWRITTEN); the logits' gradient is dloss /
// loss_tokens (0: B T) (softmax - onehot), zero in the rows of ignored targets; dWlm accumulated
// over the chunks in fp32 (cuBLASLt with 16-bit A and B, fp32 C and D, beta = 1), rounded once,
// as on the host. targets must not be null. Tied (shape.tie_embeddings): tied_params as for
// GptCudaHeadForward and tied_grads (EmbeddingNumParams elements, OVERWRITTEN): dwte (V, C) in
// its first V C elements, accumulated and rounded as dWlm, zeros in the rest (wpe); both
// required. dparams null: dx_in only (LoRA's frozen head; tied_grads is not read).
// target_weights: (B, T) fp32 device memory or null; when set the logits' gradient is
// dloss w_t (softmax - onehot) (ops::cuda::ChunkedHeadBackward's row_weights; loss_tokens is not
// read).
template <typename S>
Status GptCudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const S* params,
                           const S* x_in, const int32_t* targets, float dloss, int B, int T,
                           S* dx_in, S* dparams, void* scratch, const GptCudaOptions& options = {},
                           const S* tied_params = nullptr, S* tied_grads = nullptr,
                           int64_t loss_tokens = 0, const float* target_weights = nullptr);

}  // namespace strata::models::cuda
