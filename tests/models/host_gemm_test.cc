#include "gpu/host/host_gemm.h"

#include <gtest/gtest.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace strata::gpu::host {
namespace {

// Row-major operand with a padded row stride, so strides are exercised.
template <typename Real>
struct Operand {
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<Real> data;
  Real at(int64_t r, int64_t c) const { return data[r * ld + c]; }
};

template <typename Real>
Operand<Real> RandomOperand(int64_t rows, int64_t cols, int64_t pad, std::mt19937_64& gen) {
  Operand<Real> m{rows, cols, cols + pad, {}};
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  m.data.resize(std::max<int64_t>(1, rows * m.ld));
  for (Real& v : m.data) v = static_cast<Real>(dist(gen));
  return m;
}

// op(A)(i, k) and op(B)(k, j) as stored.
template <typename Real>
double OpA(const Operand<Real>& a, bool trans, int64_t i, int64_t k) {
  return trans ? a.at(k, i) : a.at(i, k);
}
template <typename Real>
double OpB(const Operand<Real>& b, bool trans, int64_t k, int64_t j) {
  return trans ? b.at(j, k) : b.at(k, j);
}

// Every implementation this CPU can run.
std::vector<GemmIsa> Isas() {
  std::vector<GemmIsa> isas = {GemmIsa::kGeneric};
  if (BestGemmIsa() == GemmIsa::kAvx2Fma) isas.push_back(GemmIsa::kAvx2Fma);
  return isas;
}

template <typename Real>
void CheckAgainstNaive(GemmIsa isa, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Real alpha,
                       Real beta, std::mt19937_64& gen) {
  const Operand<Real> a =
      ta ? RandomOperand<Real>(K, M, 3, gen) : RandomOperand<Real>(M, K, 3, gen);
  const Operand<Real> b =
      tb ? RandomOperand<Real>(N, K, 5, gen) : RandomOperand<Real>(K, N, 5, gen);
  Operand<Real> c = RandomOperand<Real>(M, N, 2, gen);
  if (beta == Real(0)) {
    std::fill(c.data.begin(), c.data.end(), std::numeric_limits<Real>::quiet_NaN());
  }
  const Operand<Real> c0 = c;

  GemmWithIsa<Real>(isa, ta, tb, M, N, K, alpha, a.data.data(), a.ld, b.data.data(), b.ld, beta,
                    c.data.data(), c.ld);

  const double eps = std::numeric_limits<Real>::epsilon();
  int failures = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = OpA(a, ta, i, k) * OpB(b, tb, k, j);
        ref += p;
        mag += std::abs(p);
      }
      ref *= alpha;
      mag *= std::abs(alpha);
      if (beta != Real(0)) {
        ref += beta * c0.at(i, j);
        mag += std::abs(beta * c0.at(i, j));
      }
      // Error bound of a length-K dot product in Real, with headroom.
      const double tol = 2.0 * (K + 2) * eps * mag + std::numeric_limits<Real>::min();
      const double got = c.at(i, j);
      if (!(std::abs(got - ref) <= tol) && ++failures <= 5) {
        ADD_FAILURE() << GemmIsaName(isa) << " trans_a=" << ta << " trans_b=" << tb << " M=" << M
                      << " N=" << N << " K=" << K << " C(" << i << "," << j << ")=" << got
                      << " want " << ref << " tol " << tol;
      }
    }
  }
  // Padding between rows of C is never written.
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = N; j < c.ld; ++j) {
      const Real before = c0.at(i, j), after = c.at(i, j);
      ASSERT_EQ(0, std::memcmp(&before, &after, sizeof(Real))) << "padding written at " << i;
    }
  }
}

template <typename Real>
class GemmTest : public ::testing::Test {};
using RealTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GemmTest, RealTypes);

TYPED_TEST(GemmTest, MatchesNaiveProductForAllTransposesAndOddSizes) {
  using Real = TypeParam;
  std::mt19937_64 gen(42);
  const int64_t sizes[] = {1, 7, 33, 130};
  for (GemmIsa isa : Isas()) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (int64_t M : sizes) {
          for (int64_t N : sizes) {
            for (int64_t K : sizes) {
              CheckAgainstNaive<Real>(isa, ta, tb, M, N, K, Real(0.75), Real(-1.25), gen);
            }
          }
        }
      }
    }
  }
}

TYPED_TEST(GemmTest, BetaZeroDoesNotReadC) {
  using Real = TypeParam;
  std::mt19937_64 gen(7);
  for (GemmIsa isa : Isas()) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        CheckAgainstNaive<Real>(isa, ta, tb, 130, 33, 130, Real(1.5), Real(0), gen);  // tiled
        CheckAgainstNaive<Real>(isa, ta, tb, 7, 7, 7, Real(1), Real(0), gen);         // one tile
      }
    }
  }
}

TYPED_TEST(GemmTest, BetaOneAccumulatesAndLargeTiledShapesMatch) {
  using Real = TypeParam;
  std::mt19937_64 gen(9);
  for (GemmIsa isa : Isas()) {
    // K above the packed depth block (256): later blocks add to C.
    CheckAgainstNaive<Real>(isa, false, false, 300, 257, 590, Real(1), Real(1), gen);
    CheckAgainstNaive<Real>(isa, true, true, 129, 513, 260, Real(-2), Real(1), gen);
    CheckAgainstNaive<Real>(isa, false, true, 1000, 8, 64, Real(1), Real(0.5), gen);
  }
}

TYPED_TEST(GemmTest, EmptyInnerDimensionScalesC) {
  using Real = TypeParam;
  for (GemmIsa isa : Isas()) {
    std::vector<Real> c = {1, 2, 3, 4, 5, 6};
    GemmWithIsa<Real>(isa, false, false, 2, 3, 0, Real(1), nullptr, 1, nullptr, 3, Real(2),
                      c.data(), 3);
    EXPECT_EQ(c, (std::vector<Real>{2, 4, 6, 8, 10, 12}));
    c.assign(6, std::numeric_limits<Real>::quiet_NaN());
    GemmWithIsa<Real>(isa, true, true, 2, 3, 0, Real(1), nullptr, 1, nullptr, 1, Real(0), c.data(),
                      3);
    EXPECT_EQ(c, (std::vector<Real>(6, Real(0))));
  }
}

TEST(Gemm, UsesAvx2FmaWhereTheCpuHasIt) {
  const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(BestGemmIsa(), has ? GemmIsa::kAvx2Fma : GemmIsa::kGeneric);
  if (!has) GTEST_SKIP() << "CPU without AVX2/FMA: only the generic GEMM is tested";
}

TYPED_TEST(GemmTest, BitIdenticalAcrossRunsAndThreadCounts) {
  using Real = TypeParam;
  std::mt19937_64 gen(11);
  for (GemmIsa isa : Isas()) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const int64_t M = 300, N = 257, K = 190;
        const Operand<Real> a =
            ta ? RandomOperand<Real>(K, M, 1, gen) : RandomOperand<Real>(M, K, 1, gen);
        const Operand<Real> b =
            tb ? RandomOperand<Real>(N, K, 0, gen) : RandomOperand<Real>(K, N, 0, gen);
        const Operand<Real> c0 = RandomOperand<Real>(M, N, 0, gen);
        auto run = [&] {
          std::vector<Real> c = c0.data;
          GemmWithIsa<Real>(isa, ta, tb, M, N, K, Real(0.5), a.data.data(), a.ld, b.data.data(),
                            b.ld, Real(0.25), c.data(), c0.ld);
          return c;
        };
        const std::vector<Real> first = run();
        const std::vector<Real> second = run();
        std::vector<Real> one_thread;
        tbb::task_arena(1).execute([&] { one_thread = run(); });
        std::vector<Real> all_threads;
        tbb::task_arena(tbb::info::default_concurrency()).execute([&] { all_threads = run(); });
        const size_t bytes = first.size() * sizeof(Real);
        EXPECT_EQ(0, std::memcmp(first.data(), second.data(), bytes));
        EXPECT_EQ(0, std::memcmp(first.data(), one_thread.data(), bytes));
        EXPECT_EQ(0, std::memcmp(first.data(), all_threads.data(), bytes));
      }
    }
  }
}

}  // namespace
}  // namespace strata::gpu::host
