// Tensor-core causal attention (internal to models/cuda/): the kernels that
// LaunchAttentionForward / LaunchAttentionBackward (gpt_cuda.cuh) run for bf16 and fp16 storage
// and head dims 64 and 128. Same contract and rounding points as the CUDA-core kernels; the
// caller (gpt_attention.cu) has checked the arguments, that TensorCoreAttentionSupports(hs, 2)
// holds and that qkv, out, dout and dqkv are 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include "base/status.h"

namespace strata::models::cuda::internal {

// out (B, T, C) and lse (B, H, T) from qkv (B, T, 3C). D: __half or __nv_bfloat16.
template <typename D>
Status LaunchAttentionForwardTc(cudaStream_t stream, const D* qkv, int B, int T, int C, int H,
                                D* out, float* lse);

// dq, dk, dv into dqkv (B, T, 3C), given delta = rowsum(dout out) (B, H, T) fp32, already
// computed on `stream`.
template <typename D>
Status LaunchAttentionBackwardTc(cudaStream_t stream, const D* qkv, const D* dout, const float* lse,
                                 const float* delta, int B, int T, int C, int H, D* dqkv);

}  // namespace strata::models::cuda::internal
