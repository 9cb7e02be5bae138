// Host matrix product of a linear layer, forward and backward: y = x W (+ b) (+ residual).
//
// Storage and rounding (the contract shared with the CUDA kernels, models/gpt_kernels.h
// "Storage and rounding"): S is float, Bf16 or Fp16 (the working precision) or double (the
// tests' reference). The product accumulates in ComputeType<S> (fp32; double for the
// reference) from the exact fp32 values of the S operands; the bias and the residual are added
// to the fp32 sum (a cuBLASLt bias epilogue and beta = 1), and the result is rounded to S once.
// The weight gradient is one product rounded once; the bias gradient is the fp32 column sum of
// dout, rows in order, rounded once (the BGRADB epilogue).
//
// Determinism: bit-identical across runs and thread counts for one binary on one CPU (products
// through gpu::host::Gemm, fixed blocking everywhere).
// Thread-safety: reentrant, no state; runs oneTBB loops inside (may be called from a oneTBB
// task). Concurrent calls must not share outputs. Buffers must not overlap unless a comment
// says so. Memory: no allocation beyond the per-thread widening buffers (grown once) and
// oneTBB's own.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace strata::models::ops {

// How a weight matrix of a layer with in_dim inputs and out_dim outputs is stored, row-major:
// kInOut (in_dim, out_dim), y = x W, like Hugging Face GPT-2's Conv1D; kOutIn (out_dim,
// in_dim), y = x W^T, like torch.nn.Linear.
enum class WeightLayout { kInOut, kOutIn };

// out (rows, out_dim) = S(in (rows, in_dim) W (+ bias (out_dim)) (+ residual (rows, out_dim))),
// fp32 (ComputeType<S>) accumulation, one rounding. bias and residual nullable; residual may
// be out itself (the same pointer; no other overlap). rows, in_dim, out_dim >= 1.
template <typename S>
void MatmulForward(const S* in, const S* w, WeightLayout layout, const S* bias, S* out,
                   int64_t rows, int64_t in_dim, int64_t out_dim, const S* residual = nullptr);

// The gradients of MatmulForward (without the residual, whose gradient is dout itself):
//   din (rows, in_dim) = S(dout W^T); dw (the layout of w) = S(in^T dout);
//   db (out_dim) = S(fp32 column sums of dout, rows in order).
// Each OVERWRITTEN and nullable (not computed when null). in is read only for dw, w only for
// din.
template <typename S>
void MatmulBackward(const S* in, const S* w, WeightLayout layout, const S* dout, S* din, S* dw,
                    S* db, int64_t rows, int64_t in_dim, int64_t out_dim);

// out (cols) = S(fp32 sum over the rows of x (rows, cols), rows in order): the bias gradient.
template <typename S>
void ColumnSums(const S* x, int64_t rows, int64_t cols, S* out);

}  // namespace strata::models::ops
