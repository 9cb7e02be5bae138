// The argument mapping of gpu/cuda/cuda_gemm.cc: a row-major GEMM expressed as the
// column-major GEMM that cuBLAS computes. Plain C++ (no CUDA or cuBLAS headers), so
// tests/gpu/cuda_gemm_mapping_test.cc checks it on any machine against an emulation of
// cuBLAS' documented column-major semantics.
//
// A row-major (rows, cols) matrix with row stride ld is, read column-major with leading
// dimension ld, its (cols, rows) transpose. So the row-major
//   C(M, N) = alpha op(A) op(B) + beta C
// is the column-major
//   C^T(N, M) = alpha op(B)^T op(A)^T + beta C^T,
// a cuBLAS GEMM with (m, n, k) = (N, M, K) whose first operand is B (op T when trans_b)
// and whose second is A (op T when trans_a); lda, ldb, ldc keep their values. Nothing is
// transposed in memory. Strides of a strided-batched GEMM stay with their matrices.
//
// Worked example, M=2, N=3, K=4, no transposes, A (2,4) lda 4, B (4,3) ldb 3, C (2,3)
// ldc 3: cuBLAS gets m=3, n=2, k=4, its A = our B with lda 3 (column-major 3 x 4, i.e.
// B^T), its B = our A with ldb 4 (column-major 4 x 2, i.e. A^T), and writes the
// column-major 3 x 2 matrix B^T A^T = (A B)^T with ldc 3, which is C row-major.
// cuBLAS' rule lda >= max(1, rows of its stored A) becomes ldb >= (trans_b ? K : N), and
// likewise ldb >= (trans_a ? M : K) and ldc >= N: the stored row lengths of row-major
// B, A and C (RowMajorMinLeadingDims).
#pragma once

#include <cstdint>

namespace strata::gpu::cuda {

// The arguments of cublasGemmEx / cublasGemmStridedBatchedEx, in cuBLAS' names. cuBLAS'
// A pointer is the row-major B (stride_b with it), its B pointer the row-major A.
struct ColumnMajorGemm {
  bool transa = false;  // cuBLAS' op on its A, which is the row-major B
  bool transb = false;  // cuBLAS' op on its B, which is the row-major A
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // cuBLAS' leading dimensions, in elements
};

// The column-major GEMM that computes the row-major C(M,N) = op(A) op(B) (see above).
// Pure function of its arguments; does not validate them (cuda_gemm.cc does).
constexpr ColumnMajorGemm RowMajorAsColumnMajor(bool trans_a, bool trans_b, int64_t M, int64_t N,
                                                int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  ColumnMajorGemm g;
  g.transa = trans_b;
  g.transb = trans_a;
  g.m = N;
  g.n = M;
  g.k = K;
  g.lda = ldb;
  g.ldb = lda;
  g.ldc = ldc;
  return g;
}

// Shortest legal row strides (elements) of the row-major operands: the stored row
// lengths of A ((M,K), or (K,M) when trans_a), B ((K,N), or (N,K) when trans_b) and C.
struct LeadingDims {
  int64_t lda = 0, ldb = 0, ldc = 0;
};
constexpr LeadingDims RowMajorMinLeadingDims(bool trans_a, bool trans_b, int64_t M, int64_t N,
                                             int64_t K) {
  return {trans_a ? M : K, trans_b ? K : N, N};
}

}  // namespace strata::gpu::cuda
