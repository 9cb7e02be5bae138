#include "gpu/cuda/cuda_gemm.h"

#include <cublas_v2.h>
#include <fmt/format.h>

#include <cstdint>
#include <limits>

#include "gpu/cuda/cublas_loader.h"
#include "gpu/cuda/cuda_gemm_mapping.h"
#include "gpu/cuda/cuda_lt_matmul.h"  // CudaDataType
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"

namespace strata::gpu::cuda {
namespace {

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Everything cuBLAS would reject, or that would fault on the GPU, checked on the host.
Status CheckGemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
                 int64_t lda, const void* B, int64_t ldb, const void* C, int64_t ldc,
                 DType ab_dtype, DType c_dtype) {
  if (!FitsInt(M) || !FitsInt(N) || !FitsInt(K)) {
    return InvalidArgumentError(fmt::format("gemm: M={} N={} K={} must be in [0, 2^31)", M, N, K));
  }
  const bool pair_ok = ab_dtype == DType::kF32 ? c_dtype == DType::kF32
                                               : (c_dtype == ab_dtype || c_dtype == DType::kF32);
  if (!pair_ok) {
    return InvalidArgumentError(fmt::format(
        "gemm: {} inputs with a {} output is not supported (fp16->fp16|fp32, bf16->bf16|fp32, "
        "fp32->fp32)",
        DTypeName(ab_dtype), DTypeName(c_dtype)));
  }
  const LeadingDims min_ld = RowMajorMinLeadingDims(trans_a, trans_b, M, N, K);
  const int64_t a_row = min_ld.lda, b_row = min_ld.ldb;
  if (!FitsInt(lda) || !FitsInt(ldb) || !FitsInt(ldc) || lda < std::max<int64_t>(a_row, 1) ||
      ldb < std::max<int64_t>(b_row, 1) || ldc < std::max<int64_t>(N, 1)) {
    return InvalidArgumentError(fmt::format(
        "gemm: row strides lda={} ldb={} ldc={} must be at least the stored row lengths {}, {}, "
        "{} (and < 2^31)",
        lda, ldb, ldc, a_row, b_row, N));
  }
  if (M == 0 || N == 0) return Status::Ok();
  if (!C || !Aligned(C, SizeOf(c_dtype))) {
    return InvalidArgumentError("gemm: C is null or misaligned for its dtype");
  }
  if (K > 0 && (!A || !B || !Aligned(A, SizeOf(ab_dtype)) || !Aligned(B, SizeOf(ab_dtype)))) {
    return InvalidArgumentError("gemm: A or B is null or misaligned for its dtype");
  }
  return Status::Ok();
}

cublasComputeType_t ComputeType(DType ab_dtype, const GemmOptions& options) {
  return ab_dtype == DType::kF32 && options.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                       : CUBLAS_COMPUTE_32F;
}

}  // namespace

Status Gemm(Stream& stream, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
            float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, float beta,
            void* C, int64_t ldc, DType ab_dtype, DType c_dtype, const GemmOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckGemm(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, ab_dtype, c_dtype));
  if (M == 0 || N == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(cublasHandle_t handle, CublasHandle(stream));
  STRATA_ASSIGN_OR_RETURN(const CublasApi* blas, Cublas());  // loaded: the handle came from it
  const cudaDataType_t ab = CudaDataType(ab_dtype);
  // Column-major C^T(N, M) = op(B)^T(N, K) * op(A)^T(K, M): cuBLAS' A is B (cuda_gemm_mapping.h).
  const ColumnMajorGemm g = RowMajorAsColumnMajor(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  STRATA_CUBLAS_RETURN_IF_ERROR(blas->GemmEx(
      handle, g.transa ? CUBLAS_OP_T : CUBLAS_OP_N, g.transb ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), &alpha, B, ab,
      static_cast<int>(g.lda), A, ab, static_cast<int>(g.ldb), &beta, C, CudaDataType(c_dtype),
      static_cast<int>(g.ldc), ComputeType(ab_dtype, options), CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

Status GemmStridedBatched(Stream& stream, bool trans_a, bool trans_b, int64_t M, int64_t N,
                          int64_t K, float alpha, const void* A, int64_t lda, int64_t stride_a,
                          const void* B, int64_t ldb, int64_t stride_b, float beta, void* C,
                          int64_t ldc, int64_t stride_c, int64_t batch_count, DType ab_dtype,
                          DType c_dtype, const GemmOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckGemm(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, ab_dtype, c_dtype));
  if (!FitsInt(batch_count)) {
    return InvalidArgumentError(
        fmt::format("gemm: batch_count {} must be in [0, 2^31)", batch_count));
  }
  if (stride_a < 0 || stride_b < 0 || (batch_count > 1 && stride_c < M * ldc)) {
    return InvalidArgumentError(fmt::format(
        "gemm: strides a={} b={} c={} elements: a and b must be >= 0 and c >= M*ldc = {} (the "
        "outputs must not overlap)",
        stride_a, stride_b, stride_c, M * ldc));
  }
  if (M == 0 || N == 0 || batch_count == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(cublasHandle_t handle, CublasHandle(stream));
  STRATA_ASSIGN_OR_RETURN(const CublasApi* blas, Cublas());  // loaded: the handle came from it
  const cudaDataType_t ab = CudaDataType(ab_dtype);
  const ColumnMajorGemm g = RowMajorAsColumnMajor(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  STRATA_CUBLAS_RETURN_IF_ERROR(blas->GemmStridedBatchedEx(
      handle, g.transa ? CUBLAS_OP_T : CUBLAS_OP_N, g.transb ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), &alpha, B, ab,
      static_cast<int>(g.lda), stride_b, A, ab, static_cast<int>(g.ldb), stride_a, &beta, C,
      CudaDataType(c_dtype), static_cast<int>(g.ldc), stride_c, static_cast<int>(batch_count),
      ComputeType(ab_dtype, options), CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

}  // namespace strata::gpu::cuda
