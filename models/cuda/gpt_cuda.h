// The GPT's blocks on the CUDA backend: the same forward and backward as the host
// kernels of models/gpt_kernels.h (same model, same chunk layouts, same shapes, same
// recompute-from-x_in activation checkpointing), launched on a CUDA stream.
//
// This header is plain C++ (no CUDA headers), so models/gpt.cc includes it in every
// build; the scratch sizes below are always available, the block functions are
// defined only when the binary has the CUDA backend (STRATA_HAVE_CUDA). The per-op
// kernels behind them are in models/cuda/gpt_cuda.cuh.
//
// Conventions for every block function:
//   - `stream` is a CUDA backend stream (gpu::NativeStream STRATA_CHECKs it); all work
//     is enqueued on it in order and runs asynchronously. The call makes the stream's
//     device current on the calling thread (through gpu::CublasHandle).
//   - Every pointer is DEVICE memory of that device, fp32 (tokens/targets int32),
//     4-byte aligned; shapes as in gpt_kernels.h: activations (B, T, C) row-major,
//     logits (B, T, V), chunks in the layout of EmbeddingTensors/LayerTensors/
//     HeadTensors.
//   - Arguments are checked before anything is launched: kInvalidArgument naming the
//     problem (B < 1, T outside [1, max_seq_len], a null pointer that is needed).
//     cuBLAS/launch failures come back as Status (gpu/cuda/cuda_status.h); faults of
//     running kernels surface at the stream's next synchronization.
//   - Token and target values cannot be checked on the host (they are in device
//     memory): a value outside [0, V) stops the kernel that reads it with a device
//     trap (the stream then reports cudaErrorLaunchFailure), never an out-of-bounds
//     access. The caller validates data, as for the host kernels.
//   - Nothing is allocated: intermediate values live in `scratch` (sizes below) and
//     cuBLAS uses the stream's own workspace (gpu/cuda/cuda_native.h).
//   - Matrix products go through gpu::cuda::Gemm / GemmStridedBatched with fp32 inputs,
//     fp32 accumulation and TF32 off. Reductions use a fixed order and a fixed launch
//     shape for a given problem, and there are no atomics: results are bit-identical
//     from run to run on one GPU and cuBLAS version (cuBLAS's default algorithms are
//     deterministic for a fixed stream/workspace). They are NOT bit-identical to the
//     host kernels (other summation orders, the GPU's expf/tanhf): they agree to fp32
//     rounding, which tests/models/gpt_cuda_test.cc checks element by element.
//   - Thread-safety: calls on one stream from one thread at a time (cuBLAS rule);
//     concurrent calls must not share output or scratch buffers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "base/status.h"
#include "gpu/device.h"
#include "models/gpt_kernels.h"

namespace strata::models::cuda {

// Sequences per group of the CUDA layer (as the host's: whole sequences, at least 256
// rows per matrix product when B allows): min(B, ceil(256 / T)). B, T >= 1.
inline int64_t CudaLayerGroupSeqs(int B, int T) {
  return std::min<int64_t>(B, std::max<int64_t>(1, (256 + T - 1) / T));
}

// Scratch of CudaLayerForward / CudaLayerBackward in fp32 elements. With G =
// CudaLayerGroupSeqs(B, T), R = G T rows, H heads:
//   4 R (LayerNorm mean, rstd x2) + 3 R C (qkv) + G H T^2 (attention probabilities)
//   + max(8 R C, 5 R C + G H T^2) (work area; the backward keeps the full T x T
//     probability gradients of the group there, where the host keeps row blocks).
// Not smaller than the host's LayerScratchElems for any shape (the host's work area
// is max(8 R C, 5 R C + G H min(T, 64) T)). B >= 1, 1 <= T <= max_seq_len.
inline int64_t CudaLayerScratchElems(const GptShape& s, int B, int T) {
  const int64_t G = CudaLayerGroupSeqs(B, T), R = G * T, C = s.channels;
  const int64_t probs = G * s.num_heads * int64_t{T} * T;
  return 4 * R + 3 * R * C + probs + std::max(8 * R * C, 5 * R * C + probs);
}

// Scratch of CudaHeadForward / CudaHeadBackward in fp32 elements: the host's
// HeadScratchElems, B T C (final LayerNorm output) + 3 B T (mean, rstd, per-token loss).
inline int64_t CudaHeadScratchElems(const GptShape& s, int B, int T) {
  const int64_t N = int64_t{B} * T;
  return N * s.channels + 3 * N;
}

// x_out[b, t] = wte[tokens[b, t]] + wpe[t]. params: embedding chunk; tokens (B, T);
// x_out (B, T, C). Bit-identical to the host's EmbeddingForward.
Status CudaEmbeddingForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                            const int32_t* tokens, int B, int T, float* x_out);

// dparams (embedding chunk, OVERWRITTEN) from dx_out (B, T, C). Deterministic without
// atomics: each thread owns one column of a slice of wte rows (and one element of
// wpe) and adds the token rows in token order, exactly the host's order, so the result
// is bit-identical to the host's EmbeddingBackward.
Status CudaEmbeddingBackward(const GptShape& shape, gpu::Stream& stream, const int32_t* tokens,
                             const float* dx_out, int B, int T, float* dparams);

// One transformer layer, x_in -> x_out (B, T, C); scratch: CudaLayerScratchElems.
// x_out must not overlap x_in.
Status CudaLayerForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                        const float* x_in, float* x_out, int B, int T, float* scratch);

// Recomputes the forward from x_in, then writes dx_in (B, T, C) and dparams (layer
// chunk, OVERWRITTEN) from dx_out. dx_in must not overlap x_in or dx_out.
Status CudaLayerBackward(const GptShape& shape, gpu::Stream& stream, const float* params,
                         const float* x_in, const float* dx_out, float* dx_in, float* dparams,
                         int B, int T, float* scratch);

// Final LayerNorm and LM head: logits (B, T, V) written. With targets (B, T) non-null
// and loss non-null, *loss (one fp32 in device memory) receives the mean cross-entropy
// over the B T tokens (summed in double, fixed order). scratch: CudaHeadScratchElems.
Status CudaHeadForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                       const float* x_in, const int32_t* targets, int B, int T, float* logits,
                       float* scratch, float* loss);

// Gradient of dloss * (mean cross-entropy): recomputes the forward, writes dx_in
// (B, T, C) and dparams (head chunk, OVERWRITTEN). targets must not be null. logits
// (B, T, V) is scratch (holds the logit gradients on return), as on the host.
Status CudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const float* params,
                        const float* x_in, const int32_t* targets, float dloss, int B, int T,
                        float* dx_in, float* dparams, float* logits, float* scratch);

}  // namespace strata::models::cuda
