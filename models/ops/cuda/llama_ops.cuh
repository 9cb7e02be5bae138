// CUDA implementations of the Llama family's ops, the device counterparts of the host ops
// models/ops/rms_norm.h, models/ops/rope.h, models/ops/swiglu.h and models/ops/attention.h (the
// grouped-query, strided-row case), with the same rounding points: arithmetic in fp32 from the
// stored values, each output rounded once (round to nearest even). They agree with the host ops
// up to summation order and the GPU's expf/sqrtf, not bit for bit.
//
// Templates on the device storage type D: float, __half or __nv_bfloat16 (instantiated for those
// three). Every entry point takes an explicit cudaStream_t, allocates nothing, checks its
// arguments before launching (kInvalidArgument naming the op), and returns the launch error as a
// Status; faults of a running kernel surface at the stream's next synchronization. Pointers are
// device memory; sizes in ELEMENTS; matrices row-major. The caller makes the stream's device
// current.
//
// Determinism: no floating-point atomics; every reduction has a fixed order for a given shape,
// so results are bit-identical from run to run on one GPU. Built without --use_fast_math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/status.h"
#include "models/ops/rope.h"

namespace strata::models::ops::cuda {

// Rows per partial sum of the RMSNorm weight gradient (two-pass column reduction).
inline constexpr int64_t kRmsRowsPerPartial = 64;
inline int64_t RmsPartials(int64_t rows) {
  return (rows + kRmsRowsPerPartial - 1) / kRmsRowsPerPartial;
}

// ---------------------------------------------------------------------------
// RMSNorm (ops/rms_norm.h). One warp per row.

// x: (rows, C); w: (C); y: (rows, C) OVERWRITTEN = D((x rstd) w); rstd: (rows) fp32 OVERWRITTEN
// = 1 / sqrt(mean(x^2) + eps). eps > 0, C >= 1. y must not overlap x.
template <typename D>
Status LaunchRmsNormForward(cudaStream_t stream, const D* x, const D* w, float eps, int64_t rows,
                            int64_t C, D* y, float* rstd);

// dx: (rows, C) OVERWRITTEN = D(dresidual + rstd (g - xhat mean(g xhat))), g = dy w, xhat = x
// rstd, with dresidual (rows, C) or null (0). Row-local, each row read before it is written, so
// dx may equal dy or dresidual (not x).
template <typename D>
Status LaunchRmsNormBackward(cudaStream_t stream, const D* x, const D* w, const float* rstd,
                             const D* dy, const D* dresidual, int64_t rows, int64_t C, D* dx);

// dw: (C) OVERWRITTEN = D(sum over rows of dy xhat) in fp32, two passes in a fixed order: pass 1
// sums blocks of kRmsRowsPerPartial rows into partials ((RmsPartials(rows), C) fp32 scratch),
// pass 2 adds the partials of each column in order. Must run before a backward that overwrites
// dy in place.
template <typename D>
Status LaunchRmsNormWeightGrad(cudaStream_t stream, const D* x, const float* rstd, const D* dy,
                               int64_t rows, int64_t C, float* partials, D* dw);

// ---------------------------------------------------------------------------
// Rotary embeddings (ops/rope.h).

// The largest head_dim the table kernel takes (its inverse frequencies travel as a kernel
// argument).
inline constexpr int kRopeMaxHeadDim = 256;

// cos, sin: (seq_len, head_dim / 2) fp32 OVERWRITTEN, the table of ops::RopeTable<float>: the
// inverse frequencies come from ops::RopeInverseFrequencies (host, double) and each entry is
// float(cos(double(t) * inv_freq[i])) evaluated in double on the device, so it matches the host
// table except where the device's double cos/sin (within 2 ulp of double) round to the other
// float. head_dim even, 2 <= head_dim <= kRopeMaxHeadDim, seq_len >= 1.
Status LaunchRopeTable(cudaStream_t stream, const RopeParams& p, int seq_len, float* cos,
                       float* sin);

// In place on num_heads consecutive heads of head_dim columns at the start of each of `rows`
// rows of row_stride elements; row r is position r % seq_len; cos/sin from LaunchRopeTable for
// at least seq_len positions. inverse = false: the forward rotation; true: its transpose (the
// backward on the gradient). Each output rounded once.
template <typename D>
Status LaunchRope(cudaStream_t stream, D* x, int64_t rows, int64_t row_stride, int num_heads,
                  int head_dim, int seq_len, const float* cos, const float* sin, bool inverse);

// ---------------------------------------------------------------------------
// SwiGLU (ops/swiglu.h) on rows of [gate (I) | up (I)].

// h: (rows, I) OVERWRITTEN = D(silu(g) u); must not overlap gate_up.
template <typename D>
Status LaunchSwigluForward(cudaStream_t stream, const D* gate_up, int64_t rows, int64_t I, D* h);

// dgate_up: (rows, 2I) OVERWRITTEN with [D(dh u silu'(g)) | D(dh silu(g))]; may equal gate_up
// (each pair is read before it is written); dh must not overlap either.
template <typename D>
Status LaunchSwigluBackward(cudaStream_t stream, const D* gate_up, const D* dh, int64_t rows,
                            int64_t I, D* dgate_up);

// ---------------------------------------------------------------------------
// Causal grouped-query attention (ops/attention.h) on CUDA cores, FlashAttention-2 style (no
// T x T matrix). Query head h reads kv head h / (H / Hkv).

struct GqaDims {
  int batch_size, seq_len, num_heads, num_kv_heads, head_dim;
  int64_t row_stride;  // elements between consecutive token rows of q, k, v (and dq, dk, dv)
};

// The largest head_dim of the attention kernels.
inline constexpr int kGqaMaxHeadDim = 128;

// q: (B, T, H, hs) rows of row_stride; k, v: (B, T, Hkv, hs) rows of row_stride; out: (B, T, H hs)
// contiguous, OVERWRITTEN; lse: (B, H, T) fp32 OVERWRITTEN. Scores scaled by 1 / sqrt(hs) in
// fp32, softmax in fp32 (a first pass over the keys for each row's log-sum-exp), the normalised
// probabilities D(exp(s - lse)) rounded to D before the product with V (the host op's rounding
// point), output accumulated in fp32 and rounded once. Requirements: all dims >= 1, H % Hkv == 0,
// hs <= kGqaMaxHeadDim, row_stride >= H hs. out must not overlap q, k, v.
template <typename D>
Status LaunchGqaAttentionForward(cudaStream_t stream, const GqaDims& d, const D* q, const D* k,
                                 const D* v, D* out, float* lse);

// dq, dk, dv OVERWRITTEN (strides of q, k, v); delta: (B, H, T) fp32 scratch (rowsum(dout out)).
// P recomputed from lse and rounded to D, dS = D(D(P) (dP - delta)) (as the host op); dq = D(scale
// sum dS k); dk, dv of a kv head accumulated in fp32 over the query heads of its group (in head
// order) and rounded once. No atomics: one block per (sequence, kv head, key tile) owns its dk, dv.
// dq, dk, dv may be column blocks of one buffer; they must not overlap the inputs.
template <typename D>
Status LaunchGqaAttentionBackward(cudaStream_t stream, const GqaDims& d, const D* q, const D* k,
                                  const D* v, const D* out, const D* dout, const float* lse,
                                  float* delta, D* dq, D* dk, D* dv);

}  // namespace strata::models::ops::cuda
