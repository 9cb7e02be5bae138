#include "gpu/host/host_gemm.h"

// Eigen must not parallelize inside a tile: determinism comes from the fixed
// tiling below, and the parallelism from oneTBB.
#define EIGEN_DONT_PARALLELIZE

#include <immintrin.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <vector>

#include "base/status.h"

namespace strata::gpu::host {
namespace {

// ---------------------------------------------------------------------------
// Tiling of C: a function of the problem shape only.

// Below this many multiply-adds a product runs as one tile on the calling thread.
constexpr int64_t kSerialMacs = int64_t{1} << 18;
// Tiles start at kMaxTileRows x kMaxTileCols and are halved (the side longer
// relative to its minimum first) until there are at least kMinTiles of them,
// but not below kMinTileMacs multiply-adds per tile.
constexpr int64_t kMaxTileRows = 128;
constexpr int64_t kMaxTileCols = 256;
constexpr int64_t kMinTileRows = 32;
constexpr int64_t kMinTileCols = 64;
constexpr int64_t kMinTiles = 8;
constexpr int64_t kMinTileMacs = int64_t{1} << 19;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Tiling {
  int64_t rows;
  int64_t cols;
};

Tiling ChooseTiling(int64_t M, int64_t N, int64_t K) {
  if (M * N * K <= kSerialMacs) return {M, N};
  int64_t mb = std::min(M, kMaxTileRows);
  int64_t nb = std::min(N, kMaxTileCols);
  while (CeilDiv(M, mb) * CeilDiv(N, nb) < kMinTiles) {
    const bool can_rows = mb > kMinTileRows;
    const bool can_cols = nb > kMinTileCols;
    if (!can_rows && !can_cols) break;
    int64_t next_mb = mb, next_nb = nb;
    if (can_rows && (!can_cols || mb * kMinTileCols >= nb * kMinTileRows)) {
      next_mb = std::max(kMinTileRows, mb / 2);
    } else {
      next_nb = std::max(kMinTileCols, nb / 2);
    }
    if (next_mb * next_nb * K < kMinTileMacs) break;
    mb = next_mb;
    nb = next_nb;
  }
  return {mb, nb};
}

// The operands of one call. op(A)(i, k) and op(B)(k, j) in stored terms.
template <typename Real>
struct Operands {
  bool trans_a, trans_b;
  int64_t M, N, K;
  Real alpha;
  const Real* A;
  int64_t lda;
  const Real* B;
  int64_t ldb;
  Real beta;
  Real* C;
  int64_t ldc;
};

// ---------------------------------------------------------------------------
// Generic tile: Eigen on strided Maps (SSE2 in a baseline x86-64 build).

template <typename Real>
using RowMajorMap =
    Eigen::Map<const Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
               Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename Real>
using MutRowMajorMap =
    Eigen::Map<Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
               Eigen::Unaligned, Eigen::OuterStride<>>;

template <typename Real, typename OpA, typename OpB, typename OutC>
void EigenProduct(const OpA& a, const OpB& b, Real alpha, Real beta, OutC&& c) {
  if (beta == Real(0)) {
    c.noalias() = alpha * a * b;
  } else {
    if (beta != Real(1)) c *= beta;
    c.noalias() += alpha * a * b;
  }
}

template <typename Real>
void GenericTile(const Operands<Real>& o, int64_t i0, int64_t mb, int64_t j0, int64_t nb) {
  const RowMajorMap<Real> a(o.A, o.trans_a ? o.K : o.M, o.trans_a ? o.M : o.K,
                            Eigen::OuterStride<>(o.lda));
  const RowMajorMap<Real> b(o.B, o.trans_b ? o.N : o.K, o.trans_b ? o.K : o.N,
                            Eigen::OuterStride<>(o.ldb));
  MutRowMajorMap<Real> c_full(o.C, o.M, o.N, Eigen::OuterStride<>(o.ldc));
  auto c = c_full.block(i0, j0, mb, nb);
  if (!o.trans_a && !o.trans_b) {
    EigenProduct(a.middleRows(i0, mb), b.middleCols(j0, nb), o.alpha, o.beta, c);
  } else if (!o.trans_a && o.trans_b) {
    EigenProduct(a.middleRows(i0, mb), b.middleRows(j0, nb).transpose(), o.alpha, o.beta, c);
  } else if (o.trans_a && !o.trans_b) {
    EigenProduct(a.middleCols(i0, mb).transpose(), b.middleCols(j0, nb), o.alpha, o.beta, c);
  } else {
    EigenProduct(a.middleCols(i0, mb).transpose(), b.middleRows(j0, nb).transpose(), o.alpha,
                 o.beta, c);
  }
}

// ---------------------------------------------------------------------------
// AVX2/FMA tile: packed panels and an MR x NR register-blocked micro-kernel
// (the BLIS/GotoBLAS structure). Only the functions marked
// STRATA_TARGET_AVX2 use AVX2; they run only after BestGemmIsa() said so.

#define STRATA_TARGET_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t kMr = 6;    // rows of the micro-tile
constexpr int64_t kKc = 128;  // depth of one packed block

// Columns of the micro-tile: two 256-bit vectors, 16 floats or 8 doubles.
template <typename Real>
constexpr int64_t kNr = 64 / static_cast<int64_t>(sizeof(Real));

// Packs the block X(k0 .. k0+kc, x0 .. x0+width) of a row-major matrix X whose
// rows are indexed by k (stride ld) as panels of kPanel columns: panel p holds,
// for each k, the values X(k0 + k, x0 + p*kPanel + c), c < kPanel; columns
// beyond width are zero. Walks X row by row, so the reads are contiguous.
template <int64_t kPanel, typename Real>
void PackRowsByK(const Real* X, int64_t ld, int64_t k0, int64_t kc, int64_t x0, int64_t width,
                 Real* out) {
  const int64_t full = width / kPanel, rest = width % kPanel;
  // Eight rows at a time: contiguous reads, and short contiguous runs of writes.
  constexpr int64_t kRows = 8;
  for (int64_t kb = 0; kb < kc; kb += kRows) {
    const int64_t ke = std::min(kc, kb + kRows);
    for (int64_t p = 0; p < full; ++p) {
      for (int64_t k = kb; k < ke; ++k) {
        std::memcpy(out + (p * kc + k) * kPanel, X + (k0 + k) * ld + x0 + p * kPanel,
                    kPanel * sizeof(Real));
      }
    }
    if (rest != 0) {
      for (int64_t k = kb; k < ke; ++k) {
        const Real* src = X + (k0 + k) * ld + x0 + full * kPanel;
        Real* dst = out + (full * kc + k) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) dst[c] = c < rest ? src[c] : Real(0);
      }
    }
  }
}

// The same panels from a matrix whose rows are indexed by x: X(x, k) at
// X[x * ld + k]. Each panel reads kPanel rows of X side by side.
template <int64_t kPanel, typename Real>
void PackRowsByX(const Real* X, int64_t ld, int64_t k0, int64_t kc, int64_t x0, int64_t width,
                 Real* out) {
  for (int64_t p = 0; p * kPanel < width; ++p) {
    const int64_t n = std::min(kPanel, width - p * kPanel);
    Real* dst = out + p * kc * kPanel;
    const Real* src = X + (x0 + p * kPanel) * ld + k0;
    if (n == kPanel) {
      for (int64_t k = 0; k < kc; ++k) {
        for (int64_t c = 0; c < kPanel; ++c) dst[k * kPanel + c] = src[c * ld + k];
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        for (int64_t c = 0; c < kPanel; ++c)
          dst[k * kPanel + c] = c < n ? src[c * ld + k] : Real(0);
      }
    }
  }
}

// op(A)(i0 .. i0+mb, k0 .. k0+kc) as panels of kMr rows.
template <typename Real>
void PackA(const Operands<Real>& o, int64_t i0, int64_t mb, int64_t k0, int64_t kc, Real* out) {
  if (o.trans_a) {  // A is (K, M)
    PackRowsByK<kMr>(o.A, o.lda, k0, kc, i0, mb, out);
  } else {  // A is (M, K)
    PackRowsByX<kMr>(o.A, o.lda, k0, kc, i0, mb, out);
  }
}

// op(B)(k0 .. k0+kc, j0 .. j0+nb) as panels of kNr columns.
template <typename Real>
void PackB(const Operands<Real>& o, int64_t k0, int64_t kc, int64_t j0, int64_t nb, Real* out) {
  if (o.trans_b) {  // B is (N, K)
    PackRowsByX<kNr<Real>>(o.B, o.ldb, k0, kc, j0, nb, out);
  } else {  // B is (K, N)
    PackRowsByK<kNr<Real>>(o.B, o.ldb, k0, kc, j0, nb, out);
  }
}

// c (kMr x kNr, row stride ldc) = alpha * sum_k a[k] b[k]^T + (load_c ? beta * c : 0).
// The sum over k runs in order, one FMA per k, in each lane. The twelve
// accumulators are named variables so that they stay in registers.
#define STRATA_MICRO_KERNEL(Real, Vec, W, SET0, LOAD, STORE, BCAST, SET1, MUL, FMA)                \
  STRATA_TARGET_AVX2 void MicroKernel(int64_t kc, const Real* a, const Real* b, Real alpha,        \
                                      Real beta, bool load_c, Real* c, int64_t ldc) {              \
    Vec c00 = SET0(), c01 = SET0(), c10 = SET0(), c11 = SET0(), c20 = SET0(), c21 = SET0();        \
    Vec c30 = SET0(), c31 = SET0(), c40 = SET0(), c41 = SET0(), c50 = SET0(), c51 = SET0();        \
    for (int64_t k = 0; k < kc; ++k, a += kMr, b += 2 * W) {                                       \
      const Vec b0 = LOAD(b), b1 = LOAD(b + W);                                                    \
      Vec av = BCAST(a + 0);                                                                       \
      c00 = FMA(av, b0, c00), c01 = FMA(av, b1, c01);                                              \
      av = BCAST(a + 1);                                                                           \
      c10 = FMA(av, b0, c10), c11 = FMA(av, b1, c11);                                              \
      av = BCAST(a + 2);                                                                           \
      c20 = FMA(av, b0, c20), c21 = FMA(av, b1, c21);                                              \
      av = BCAST(a + 3);                                                                           \
      c30 = FMA(av, b0, c30), c31 = FMA(av, b1, c31);                                              \
      av = BCAST(a + 4);                                                                           \
      c40 = FMA(av, b0, c40), c41 = FMA(av, b1, c41);                                              \
      av = BCAST(a + 5);                                                                           \
      c50 = FMA(av, b0, c50), c51 = FMA(av, b1, c51);                                              \
    }                                                                                              \
    const Vec va = SET1(alpha), vb = SET1(beta);                                                   \
    Vec* accs[2 * kMr] = {&c00, &c01, &c10, &c11, &c20, &c21, &c30, &c31, &c40, &c41, &c50, &c51}; \
    for (int64_t r = 0; r < kMr; ++r) {                                                            \
      for (int64_t h = 0; h < 2; ++h) {                                                            \
        Real* dst = c + r * ldc + h * W;                                                           \
        Vec out = MUL(va, *accs[2 * r + h]);                                                       \
        if (load_c) out = FMA(vb, LOAD(dst), out);                                                 \
        STORE(dst, out);                                                                           \
      }                                                                                            \
    }                                                                                              \
  }

STRATA_MICRO_KERNEL(float, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps,
                    _mm256_broadcast_ss, _mm256_set1_ps, _mm256_mul_ps, _mm256_fmadd_ps)
STRATA_MICRO_KERNEL(double, __m256d, 4, _mm256_setzero_pd, _mm256_loadu_pd, _mm256_storeu_pd,
                    _mm256_broadcast_sd, _mm256_set1_pd, _mm256_mul_pd, _mm256_fmadd_pd)
#undef STRATA_MICRO_KERNEL

// Per-thread packing buffers: a tile runs start to end on one thread and never
// waits on oneTBB inside, so a thread never uses its buffers twice at once.
template <typename Real>
struct PackBuffers {
  std::vector<Real> a, b;
};
template <typename Real>
PackBuffers<Real>& ThreadPackBuffers() {
  thread_local PackBuffers<Real> buffers;
  return buffers;
}

template <typename Real>
void Avx2Tile(const Operands<Real>& o, int64_t i0, int64_t mb, int64_t j0, int64_t nb) {
  constexpr int64_t nr = kNr<Real>;
  PackBuffers<Real>& buf = ThreadPackBuffers<Real>();
  const int64_t a_panels = CeilDiv(mb, kMr), b_panels = CeilDiv(nb, nr);
  const int64_t kc_max = std::min(kKc, o.K);
  buf.a.resize(std::max<size_t>(buf.a.size(), a_panels * kMr * kc_max));
  buf.b.resize(std::max<size_t>(buf.b.size(), b_panels * nr * kc_max));
  alignas(64) Real edge[kMr * nr] = {};

  for (int64_t k0 = 0; k0 < o.K; k0 += kKc) {
    const int64_t kc = std::min(kKc, o.K - k0);
    // The first depth block applies beta (not reading C when beta is 0);
    // later blocks add to what the earlier ones wrote.
    const bool first = k0 == 0;
    const Real beta = first ? o.beta : Real(1);
    const bool load_c = !first || o.beta != Real(0);
    PackB(o, k0, kc, j0, nb, buf.b.data());
    PackA(o, i0, mb, k0, kc, buf.a.data());
    for (int64_t q = 0; q < b_panels; ++q) {
      const int64_t j = q * nr, cols = std::min(nr, nb - j);
      const Real* bp = buf.b.data() + q * nr * kc;
      for (int64_t p = 0; p < a_panels; ++p) {
        const int64_t i = p * kMr, rows = std::min(kMr, mb - i);
        const Real* ap = buf.a.data() + p * kMr * kc;
        Real* c = o.C + (i0 + i) * o.ldc + j0 + j;
        if (rows == kMr && cols == nr) {
          MicroKernel(kc, ap, bp, o.alpha, beta, load_c, c, o.ldc);
          continue;
        }
        // Partial micro-tile: the same arithmetic on a copy.
        for (int64_t r = 0; r < rows; ++r) {
          if (load_c) std::copy(c + r * o.ldc, c + r * o.ldc + cols, edge + r * nr);
        }
        MicroKernel(kc, ap, bp, o.alpha, beta, load_c, edge, nr);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy(edge + r * nr, edge + r * nr + cols, c + r * o.ldc);
        }
      }
    }
  }
}

bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

GemmIsa BestGemmIsa() { return CpuHasAvx2Fma() ? GemmIsa::kAvx2Fma : GemmIsa::kGeneric; }

const char* GemmIsaName(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kGeneric:
      return "generic";
    case GemmIsa::kAvx2Fma:
      return "avx2_fma";
  }
  return "unknown";
}

template <typename Real>
void GemmWithIsa(GemmIsa isa, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 Real alpha, const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta,
                 Real* C, int64_t ldc) {
  STRATA_CHECK(M >= 0 && N >= 0 && K >= 0);
  STRATA_CHECK(isa == GemmIsa::kGeneric || CpuHasAvx2Fma());
  if (M == 0 || N == 0) return;
  STRATA_CHECK(ldc >= N);
  STRATA_CHECK(K == 0 || lda >= (trans_a ? M : K));
  STRATA_CHECK(K == 0 || ldb >= (trans_b ? K : N));
  const Operands<Real> o{trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};

  auto run_tile = [&](int64_t i0, int64_t mb, int64_t j0, int64_t nb) {
    if (K == 0) {  // C = beta * C
      for (int64_t i = i0; i < i0 + mb; ++i) {
        Real* c = C + i * ldc;
        for (int64_t j = j0; j < j0 + nb; ++j) c[j] = beta == Real(0) ? Real(0) : beta * c[j];
      }
    } else if (isa == GemmIsa::kAvx2Fma) {
      Avx2Tile(o, i0, mb, j0, nb);
    } else {
      GenericTile(o, i0, mb, j0, nb);
    }
  };

  const Tiling t = ChooseTiling(M, N, K);
  const int64_t tiles_n = CeilDiv(N, t.cols);
  const int64_t num_tiles = CeilDiv(M, t.rows) * tiles_n;
  auto tile = [&](int64_t index) {
    const int64_t i0 = (index / tiles_n) * t.rows;
    const int64_t j0 = (index % tiles_n) * t.cols;
    run_tile(i0, std::min(t.rows, M - i0), j0, std::min(t.cols, N - j0));
  };
  if (num_tiles == 1) {
    tile(0);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, num_tiles, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i != r.end(); ++i) tile(i);
      },
      tbb::simple_partitioner());
}

template <typename Real>
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha, const Real* A,
          int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc) {
  GemmWithIsa(BestGemmIsa(), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template void Gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void Gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);
template void GemmWithIsa<float>(GemmIsa, bool, bool, int64_t, int64_t, int64_t, float,
                                 const float*, int64_t, const float*, int64_t, float, float*,
                                 int64_t);
template void GemmWithIsa<double>(GemmIsa, bool, bool, int64_t, int64_t, int64_t, double,
                                  const double*, int64_t, const double*, int64_t, double, double*,
                                  int64_t);

}  // namespace strata::gpu::host
