// The row-major -> cuBLAS column-major argument mapping of gpu/cuda/cuda_gemm.cc
// (gpu/cuda/cuda_gemm_mapping.h), checked without a GPU: an emulation of cuBLAS' documented
// GEMM semantics (column-major storage, op(X) = X or X^T, leading dimensions with cuBLAS'
// lower bounds asserted) runs on the mapped arguments and must give the row-major product,
// element by element, on small integer matrices (exact in double).
#include "gpu/cuda/cuda_gemm_mapping.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::gpu::cuda {
namespace {

// cublasGemmStridedBatchedEx as its documentation defines it, in double:
//   C[b] = alpha op(A[b]) op(B[b]) + beta C[b], op(A) (m, k), op(B) (k, n), C (m, n),
// column-major: element (i, j) of a matrix with leading dimension ld is at i + j ld.
// A is stored (m, k) when !transa, (k, m) when transa; B (k, n) or (n, k).
// Fails the test when an argument breaks cuBLAS' rules (ld >= max(1, stored rows)).
// Out-of-range accesses throw (vector::at).
void EmulateCublasGemm(const ColumnMajorGemm& g, double alpha, const std::vector<double>& A,
                       int64_t stride_a, const std::vector<double>& B, int64_t stride_b,
                       double beta, std::vector<double>& C, int64_t stride_c, int64_t batch) {
  EXPECT_GE(g.lda, std::max<int64_t>(1, g.transa ? g.k : g.m)) << "cuBLAS rejects this lda";
  EXPECT_GE(g.ldb, std::max<int64_t>(1, g.transb ? g.n : g.k)) << "cuBLAS rejects this ldb";
  EXPECT_GE(g.ldc, std::max<int64_t>(1, g.m)) << "cuBLAS rejects this ldc";
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double dot = 0;
        for (int64_t l = 0; l < g.k; ++l) {
          const double a = A.at(b * stride_a + (g.transa ? l + i * g.lda : i + l * g.lda));
          const double x = B.at(b * stride_b + (g.transb ? j + l * g.ldb : l + j * g.ldb));
          dot += a * x;
        }
        double& c = C.at(b * stride_c + i + j * g.ldc);
        c = alpha * dot + (beta == 0 ? 0.0 : beta * c);
      }
    }
  }
}

// Small distinct integers: every product and sum is exact in double.
std::vector<double> Ints(size_t n, int seed) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<double>((seed * 7 + static_cast<int>(i) * 5) % 23 - 11);
  return v;
}

struct Case {
  bool trans_a, trans_b;
  int64_t M, N, K;
  int64_t pad = 0;  // added to every row stride
  int64_t batch = 1;
};

std::string Name(const Case& c) {
  return std::string(c.trans_a ? "A^T" : "A") + (c.trans_b ? " B^T" : " B") +
         " M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
         " pad=" + std::to_string(c.pad) + " batch=" + std::to_string(c.batch);
}

// Runs the row-major case through the mapping and the emulated cuBLAS and compares with
// the row-major definition; the padding of C (between rows, between batch entries) must
// be untouched.
void Check(const Case& c) {
  SCOPED_TRACE(Name(c));
  const LeadingDims min = RowMajorMinLeadingDims(c.trans_a, c.trans_b, c.M, c.N, c.K);
  const int64_t lda = min.lda + c.pad, ldb = min.ldb + c.pad, ldc = min.ldc + c.pad;
  const int64_t a_rows = c.trans_a ? c.K : c.M, b_rows = c.trans_b ? c.N : c.K;
  const int64_t sa = a_rows * lda + c.pad, sb = b_rows * ldb + c.pad, sc = c.M * ldc + c.pad;
  const std::vector<double> A = Ints(sa * c.batch, 1), B = Ints(sb * c.batch, 2);
  const std::vector<double> C0 = Ints(sc * c.batch, 3);
  const double alpha = 2, beta = -3;

  std::vector<double> want = C0;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.M; ++i) {
      for (int64_t j = 0; j < c.N; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < c.K; ++k) {
          dot += A[b * sa + (c.trans_a ? k * lda + i : i * lda + k)] *
                 B[b * sb + (c.trans_b ? j * ldb + k : k * ldb + j)];
        }
        want[b * sc + i * ldc + j] = alpha * dot + beta * C0[b * sc + i * ldc + j];
      }
    }
  }

  const ColumnMajorGemm g =
      RowMajorAsColumnMajor(c.trans_a, c.trans_b, c.M, c.N, c.K, lda, ldb, ldc);
  std::vector<double> got = C0;
  // cuBLAS' A pointer is the row-major B (with B's batch stride), its B pointer is A.
  EmulateCublasGemm(g, alpha, B, sb, A, sa, beta, got, sc, c.batch);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "C element " << i;
  }
}

TEST(CudaGemmMapping, WorkedExampleTwoByThreeByFourInAllFourTransposes) {
  for (int t = 0; t < 4; ++t) Check({(t & 1) != 0, (t & 2) != 0, 2, 3, 4});
  // The worked example of cuda_gemm_mapping.h, field by field.
  const ColumnMajorGemm g = RowMajorAsColumnMajor(false, false, 2, 3, 4, 4, 3, 3);
  EXPECT_FALSE(g.transa);
  EXPECT_FALSE(g.transb);
  EXPECT_EQ(g.m, 3);
  EXPECT_EQ(g.n, 2);
  EXPECT_EQ(g.k, 4);
  EXPECT_EQ(g.lda, 3);  // B's row stride
  EXPECT_EQ(g.ldb, 4);  // A's row stride
  EXPECT_EQ(g.ldc, 3);
  const ColumnMajorGemm t = RowMajorAsColumnMajor(true, false, 2, 3, 4, 2, 3, 3);
  EXPECT_FALSE(t.transa);  // op on cuBLAS' A = the row-major B
  EXPECT_TRUE(t.transb);   // op on cuBLAS' B = the row-major A
}

TEST(CudaGemmMapping, OddShapesPaddedStridesAndDegenerateDimensions) {
  const int64_t shapes[][3] = {{1, 1, 1}, {1, 5, 3}, {5, 1, 3}, {3, 5, 1}, {7, 3, 5}, {3, 7, 9}};
  for (const auto& s : shapes) {
    for (int t = 0; t < 4; ++t) {
      for (int64_t pad : {0, 3}) Check({(t & 1) != 0, (t & 2) != 0, s[0], s[1], s[2], pad});
    }
  }
}

// Attention's shapes in gpt_cuda.cu: per-head products with row strides 3C and C over a
// batch of sequences, all four transposes.
TEST(CudaGemmMapping, StridedBatchedKeepsEachStrideWithItsMatrix) {
  for (int t = 0; t < 4; ++t) {
    Check({(t & 1) != 0, (t & 2) != 0, 5, 4, 3, /*pad=*/2, /*batch=*/3});
    Check({(t & 1) != 0, (t & 2) != 0, 4, 6, 5, /*pad=*/0, /*batch=*/4});
  }
}

// Tight strides are exactly cuBLAS' lower bounds: the mapping never asks cuBLAS for less.
TEST(CudaGemmMapping, MinimumRowStridesAreCublasMinimumLeadingDimensions) {
  for (int64_t M : {1, 2, 9}) {
    for (int64_t N : {1, 3, 8}) {
      for (int64_t K : {1, 4, 7}) {
        for (int t = 0; t < 4; ++t) {
          const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
          const LeadingDims min = RowMajorMinLeadingDims(ta, tb, M, N, K);
          const ColumnMajorGemm g =
              RowMajorAsColumnMajor(ta, tb, M, N, K, min.lda, min.ldb, min.ldc);
          EXPECT_EQ(g.lda, g.transa ? g.k : g.m);
          EXPECT_EQ(g.ldb, g.transb ? g.n : g.k);
          EXPECT_EQ(g.ldc, g.m);
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::gpu::cuda
