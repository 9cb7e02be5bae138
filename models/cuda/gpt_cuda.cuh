// The GPT's per-op CUDA kernels, the pieces of the blocks in gpt_cuda.h, each the GPU
// counterpart of a host helper of models/gpt_kernels.cc with the rounding points of
// models/gpt_kernels.h ("Storage and rounding"). Templates on the device storage type D:
// float, __half or __nv_bfloat16 (instantiated for those three); arithmetic in fp32, each
// output rounded once (round to nearest even).
//
// Every entry point takes an explicit cudaStream_t, allocates nothing, checks its arguments
// before launching (kInvalidArgument), and returns the launch error (cudaGetLastError) as a
// Status; faults of the running kernel surface at the stream's next synchronization.
// Pointers are device memory; sizes in ELEMENTS; matrices row-major; N = B T rows. The caller
// makes the stream's device current. Tokens or targets outside [0, V) trap (__trap).
//
// Determinism: no floating-point atomics; every reduction has a fixed order for a given shape,
// so results are bit-identical from run to run. Built without --use_fast_math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/cuda/gpt_attention_tiles.h"

namespace strata::models::cuda {

// x_out[r] = D(wte[tokens[r]] + wpe[r % T]); wte (V, C), wpe (>= T, C), x_out (N, C). wpe may be
// null (no position table, the Llama family): x_out[r] = wte[tokens[r]], an exact copy.
template <typename D>
Status LaunchEmbeddingForward(cudaStream_t stream, const D* wte, const D* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V, D* x_out);

// dwte (V, C), dwpe (max_seq_len, C) OVERWRITTEN: a stable counting sort of the N positions by
// token (counts, offsets, cursor: V, V + 1, V int32; order: N int32, all device scratch), then
// dwte[v] = D(sum of dx_out rows of token v in increasing row order, fp32), and
// dwpe[t] = D(sum over b of dx_out[b T + t]) for t < T, 0 beyond (dwpe null: not computed).
template <typename D>
Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const D* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, D* dwte,
                               D* dwpe, int32_t* counts, int32_t* offsets, int32_t* cursor,
                               int32_t* order);

// LayerNorm (Ba et al. 2016, biased variance, eps 1e-5) of each row of x (rows, C):
// y = D((x - mean) rstd w + b); mean, rstd (rows) fp32. One warp per row, two passes.
template <typename D>
Status LaunchLayerNormForward(cudaStream_t stream, const D* x, const D* w, const D* b, int64_t rows,
                              int64_t C, D* y, float* mean, float* rstd);

// dx = D((residual ? residual : 0) + rstd (g - mean(g) - xhat mean(g xhat))), g = dy w, xhat
// = (x - mean) rstd, all in fp32 from the D inputs (the one rounding after the residual is
// added). dx may equal residual (row-local, read before write); not x or dy.
template <typename D>
Status LaunchLayerNormBackward(cudaStream_t stream, const D* x, const D* w, const D* dy,
                               const float* mean, const float* rstd, const D* residual,
                               int64_t rows, int64_t C, D* dx);

// dw = D(sum_r dy xhat), db = D(sum_r dy), deterministic two-pass column reduction: pass 1
// sums blocks of kLnRowsPerPartial rows into partials ((LnPartials(rows), 2 C) fp32), pass 2
// adds the partials of each column in order.
template <typename D>
Status LaunchLayerNormParamGrads(cudaStream_t stream, const D* x, const D* dy, const float* mean,
                                 const float* rstd, int64_t rows, int64_t C, float* partials, D* dw,
                                 D* db);

// out[c] = D(sum over rows of x[r, c]) (a bias gradient), the same two passes;
// partials: (LnPartials(rows), cols) fp32.
template <typename D>
Status LaunchColumnSums(cudaStream_t stream, const D* x, int64_t rows, int64_t cols,
                        float* partials, D* out);

// Per row of logits (N, V): losses[r] = logsumexp - logits[r, targets[r]] in fp32 from the D
// logits; with write_grad the row is then OVERWRITTEN in place with
// D(grad_scale (softmax - onehot(target))). One block per row.
template <typename D>
Status LaunchCrossEntropy(cudaStream_t stream, D* logits, const int32_t* targets, int64_t N, int V,
                          float* losses, bool write_grad, float grad_scale);

// *loss = float(sum of losses (N) in double, fixed order, / N). One block. N >= 1.
Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, float* loss);

// Causal multi-head self-attention, fused in the manner of FlashAttention-2 (Dao,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023).
// qkv (B, T, 3C): head h of q at column h hs, of k at C + h hs, of v at 2C + h hs.
// out (B, T, C): head h at column h hs. lse (B, H, T) fp32: log-sum-exp of each query's
// scaled scores (the backward recomputes the probabilities from it). Scores scaled by
// 1 / sqrt(hs) in fp32; softmax in fp32 (a first pass over the keys for each row's
// log-sum-exp); the normalized probabilities D(exp(s - lse)) rounded to D before the product
// with V (the host's rounding point, models/ops/attention.cc); output accumulated in fp32 and
// rounded once. hs <= 128.
// Two implementations with these rounding points, chosen by `path` (gpt_attention_tiles.h):
// tensor cores (mma.sync m16n8k16, gpt_attention_tc.cu) for bf16 and fp16 with hs 64 or 128
// and qkv, out (and dout, dqkv) 16-byte aligned; CUDA cores (fp32 FMAs on values converted
// from D) for everything, the fallback and the reference. kAuto picks the tensor cores where
// they apply; kTensorCores where they do not is kInvalidArgument.
template <typename D>
Status LaunchAttentionForward(cudaStream_t stream, const D* qkv, int B, int T, int C, int H, D* out,
                              float* lse, AttentionPath path = AttentionPath::kAuto);

// dqkv (B, T, 3C) from dout (B, T, C), the forward's out and lse: delta = rowsum(dout out)
// (fp32, (B, H, T) scratch), P recomputed and rounded to D, dS = D(D(P) (dP - delta)) (the
// host's rounding points), dq, dk, dv accumulated in
// fp32 and rounded once. No atomics: one block per (b, h, key tile) owns its dk, dv and loops
// over the query tiles; a separate pass writes dq. dqkv must not overlap the inputs. `path` as
// for the forward (the two need not match: both recompute from the same lse contract).
template <typename D>
Status LaunchAttentionBackward(cudaStream_t stream, const D* qkv, const D* out, const D* dout,
                               const float* lse, int B, int T, int C, int H, float* delta, D* dqkv,
                               AttentionPath path = AttentionPath::kAuto);

}  // namespace strata::models::cuda
