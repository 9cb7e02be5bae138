// The GPT's per-op CUDA kernels (fp32), the pieces of the blocks in gpt_cuda.h.
// Each one is the GPU counterpart of a host helper in models/gpt_kernels.cc, with the
// same formula (see the comments there and in gpt_kernels.h for the papers).
//
// Every entry point takes an explicit cudaStream_t, allocates nothing, checks its
// arguments before launching (kInvalidArgument naming the problem: negative sizes,
// null pointers when there is work), and returns the launch error (cudaGetLastError)
// as a Status; faults of the running kernel surface at the stream's next
// synchronization. Pointers are device memory, fp32 (int32 for tokens/targets),
// 4-byte aligned; sizes are in ELEMENTS; matrices are row-major. Zero rows launch
// nothing. The caller makes the stream's device current. Launches touch no shared
// host state (thread-safe); concurrent kernels must not share outputs.
//
// Determinism: no atomics; every reduction has a fixed order for a given shape
// (warp butterflies, fixed shared-memory trees, sequential loops), so results are
// bit-identical from run to run. Not bit-identical to the host (other orders, the
// GPU's expf/tanhf), except where noted. Built without --use_fast_math: expf, tanhf,
// logf and sqrtf are the accurate (few-ulp) CUDA versions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"

namespace strata::models::cuda {

// x_out[r, :] = wte[tokens[r], :] + wpe[r % T, :] for r in [0, N), N = B T.
// wte (V, C), wpe (>= T, C), tokens (N), x_out (N, C). Bit-identical to the host.
// A token outside [0, V) traps (see gpt_cuda.h).
Status LaunchEmbeddingForward(cudaStream_t stream, const float* wte, const float* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V,
                              float* x_out);

// dwte (V, C) and dwpe (max_seq_len, C) OVERWRITTEN with the sums of dx_out (N, C)
// rows by token and by position (positions >= T and absent tokens get zeros). Each
// thread owns its output elements and adds rows in row order: bit-identical to the
// host. A token outside [0, V) traps.
Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const float* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, float* dwte,
                               float* dwpe);

// LayerNorm (Ba et al. 2016, biased variance, eps 1e-5) of each row of x (rows, C):
// y = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps); mean, rstd (rows) saved.
// Two passes over the row (mean, then the centred variance), one warp per row.
Status LaunchLayerNormForward(cudaStream_t stream, const float* x, const float* w, const float* b,
                              int64_t rows, int64_t C, float* y, float* mean, float* rstd);

// y = (x - mean) rstd w + b from saved statistics (bit-identical to the forward's y).
Status LaunchLayerNormApply(cudaStream_t stream, const float* x, const float* w, const float* b,
                            const float* mean, const float* rstd, int64_t rows, int64_t C,
                            float* y);

// dw (+)= sum_r dy xhat and db (+)= sum_r dy, xhat = (x - mean) rstd, over rows
// (accumulate: added to the old values, else overwritten).
Status LaunchLayerNormParamGrads(cudaStream_t stream, const float* x, const float* dy,
                                 const float* mean, const float* rstd, int64_t rows, int64_t C,
                                 float* dw, float* db, bool accumulate);

// dx = (residual ? residual : 0) + rstd (g - mean(g) - xhat mean(g xhat)), g = dy w.
// Row-local and read-before-write per element, so dx may equal x, dy or residual
// (residual may be null).
Status LaunchLayerNormInputGrad(cudaStream_t stream, const float* x, const float* w,
                                const float* dy, const float* mean, const float* rstd,
                                const float* residual, int64_t rows, int64_t C, float* dx);

// out[r, :] = (x ? x[r, :] : 0) + bias (cols). out may equal x. Bit-identical to the host.
Status LaunchRowsPlusBias(cudaStream_t stream, const float* x, const float* bias, int64_t rows,
                          int64_t cols, float* out);

// out[c] (+)= sum over rows of x[r, c] (the bias gradient). Each column is summed by
// 8 threads over interleaved rows, then their partial sums in a fixed order.
Status LaunchColumnSums(cudaStream_t stream, const float* x, int64_t rows, int64_t cols, float* out,
                        bool accumulate);

// GELU, tanh approximation (Hendrycks & Gimpel 2016):
// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), n elements; y may equal x.
Status LaunchGeluForward(cudaStream_t stream, const float* x, int64_t n, float* y);

// dx = dy gelu'(x), n elements; dx may equal dy.
Status LaunchGeluBackward(cudaStream_t stream, const float* x, const float* dy, int64_t n,
                          float* dx);

// In place on num_mats (T, T) row-major score matrices (already scaled by
// 1/sqrt(head size)): row t becomes softmax over its columns 0..t (max-shifted),
// columns > t become 0 (the causal mask). One warp per row.
Status LaunchCausalSoftmaxForward(cudaStream_t stream, float* scores, int64_t num_mats, int T);

// Softmax backward in place: probs[t, s] <- probs[t, s] (dprobs[t, s] - sum_s'
// probs[t, s'] dprobs[t, s']) for s <= t, 0 for s > t, on num_mats (T, T) matrices.
Status LaunchCausalSoftmaxBackward(cudaStream_t stream, float* probs, const float* dprobs,
                                   int64_t num_mats, int T);

// losses[r] = logsumexp(logits[r, :]) - logits[r, targets[r]], logits (N, V).
// A target outside [0, V) traps.
Status LaunchCrossEntropyForward(cudaStream_t stream, const float* logits, const int32_t* targets,
                                 int64_t N, int V, float* losses);

// *loss = float(sum of losses (N), in double, fixed order / N), one block. N >= 1.
Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, float* loss);

// In place: logits[r, :] <- scale (softmax(logits[r, :]) - onehot(targets[r])), the
// gradient of scale * sum_r cross-entropy_r (scale = dloss / N for the mean).
Status LaunchCrossEntropyBackward(cudaStream_t stream, float* logits, const int32_t* targets,
                                  int64_t N, int V, float scale);

}  // namespace strata::models::cuda
