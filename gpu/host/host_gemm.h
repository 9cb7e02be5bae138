// Host GEMM for the host device backend and the host GPT kernels.
//
// Row-major: C(M,N) = alpha * op(A) * op(B) + beta * C, where op(X) is X or X^T.
//   A is (M, K), or (K, M) when trans_a;  B is (K, N), or (N, K) when trans_b.
//   lda, ldb, ldc are row strides in elements (lda >= the stored row length, etc.).
//   beta == 0 means C is not read (it may hold NaN or garbage).
//   M, N, K >= 0; with K == 0 the product is zero and C becomes beta * C.
//
// Parallel over tiles of C with oneTBB. The tiling is a function of (M, N, K)
// only, never of the thread count; each tile of C is computed start to end by
// one task, with a fixed summation order over K. So results are bit-identical
// across runs and across thread counts, for one binary on one CPU.
//
// Inside a tile the product runs on a packed, register-blocked AVX2/FMA
// micro-kernel (the GotoBLAS/BLIS structure) when the CPU has AVX2 and FMA,
// chosen once at run time (the binary stays x86-64 baseline); otherwise
// through Eigen on strided Maps (single-threaded inside the tile). The two
// implementations agree to rounding, not bit for bit.
//
// Thread-safety: reentrant; concurrent calls on disjoint C are safe, including
// calls from inside oneTBB tasks (nested parallelism). C must not alias A or B.
#pragma once

#include <cstdint>

namespace strata::gpu::host {

template <typename Real>
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha, const Real* A,
          int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc);

// The implementations, for tests and benchmarks. kGeneric (Eigen) runs
// everywhere; kAvx2Fma only where BestGemmIsa() says so (STRATA_CHECK).
enum class GemmIsa { kGeneric, kAvx2Fma };
GemmIsa BestGemmIsa();
const char* GemmIsaName(GemmIsa isa);  // "generic", "avx2_fma"

template <typename Real>
void GemmWithIsa(GemmIsa isa, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 Real alpha, const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta,
                 Real* C, int64_t ldc);

extern template void Gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                 int64_t, const float*, int64_t, float, float*, int64_t);
extern template void Gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                  int64_t, const double*, int64_t, double, double*, int64_t);
extern template void GemmWithIsa<float>(GemmIsa, bool, bool, int64_t, int64_t, int64_t, float,
                                        const float*, int64_t, const float*, int64_t, float, float*,
                                        int64_t);
extern template void GemmWithIsa<double>(GemmIsa, bool, bool, int64_t, int64_t, int64_t, double,
                                         const double*, int64_t, const double*, int64_t, double,
                                         double*, int64_t);

}  // namespace strata::gpu::host
