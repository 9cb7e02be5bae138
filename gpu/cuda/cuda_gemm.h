// GEMM on the CUDA backend through cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx),
// with the row-major signature style of gpu/host/host_gemm.h so models/ can call either.
//
// Row-major: C(M,N) = alpha * op(A) * op(B) + beta * C, where op(X) is X or X^T.
//   A is (M, K), or (K, M) when trans_a;  B is (K, N), or (N, K) when trans_b.
//   lda, ldb, ldc are row strides in ELEMENTS (lda >= the stored row length, etc.).
//   beta == 0 means C is not read (it may hold NaN or garbage).
//   M, N, K >= 0 and each of M, N, K, lda, ldb, ldc < 2^31 (cuBLAS' int).
// A and B have dtype ab_dtype, C has c_dtype; the pairs cuBLAS supports are
//   ab fp16 -> c fp16 or fp32,  ab bf16 -> c bf16 or fp32,  ab fp32 -> c fp32.
// Products accumulate in fp32 (CUBLAS_COMPUTE_32F); for fp32 inputs TF32 tensor cores
// are used only when options.allow_tf32 (CUBLAS_COMPUTE_32F_FAST_TF32, ~10 mantissa bits).
// alpha and beta are fp32 host scalars. Pointers are device memory of the stream's
// device, aligned to their element size (16 bytes gives the fastest kernels).
// C must not alias A or B.
//
// The row-major product is computed as the column-major C^T = op(B)^T op(A)^T, so
// cuBLAS sees (m, n, k) = (N, M, K) with A and B swapped; no data is transposed.
//
// The work is enqueued on `stream` (a CUDA backend stream: STRATA_CHECK) through its
// cuBLAS handle (CublasHandle in cuda_native.h, with a workspace the stream owns, so
// nothing is allocated here) and runs asynchronously; errors in arguments come back
// before anything is enqueued (kInvalidArgument naming the problem), cuBLAS errors as
// Status (cuda_status.h). The cuBLAS algorithm is CUBLAS_GEMM_DEFAULT (cuBLAS' own
// heuristic). Thread-safety: calls on one stream from one thread at a time.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "base/status.h"
#include "gpu/device.h"

namespace strata::gpu::cuda {

struct GemmOptions {
  bool allow_tf32 = false;  // fp32 inputs only: TF32 tensor cores (faster, ~1e-3 relative error)
};

Status Gemm(Stream& stream, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
            float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, float beta,
            void* C, int64_t ldc, DType ab_dtype, DType c_dtype, const GemmOptions& options = {});

// batch_count independent GEMMs of the same shape (e.g. attention's per-head Q K^T and
// P V): matrix i of A starts at A + i * stride_a ELEMENTS, likewise B and C. A stride
// of 0 reuses one matrix for every batch entry (not allowed for C). batch_count >= 0.
Status GemmStridedBatched(Stream& stream, bool trans_a, bool trans_b, int64_t M, int64_t N,
                          int64_t K, float alpha, const void* A, int64_t lda, int64_t stride_a,
                          const void* B, int64_t ldb, int64_t stride_b, float beta, void* C,
                          int64_t ldc, int64_t stride_c, int64_t batch_count, DType ab_dtype,
                          DType c_dtype, const GemmOptions& options = {});

}  // namespace strata::gpu::cuda
