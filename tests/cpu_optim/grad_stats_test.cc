#include "cpu_optim/grad_stats.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/kernels.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

using testing::Bits;
using testing::GradData;
using testing::Mix;

constexpr DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
// Smaller than, equal to and larger than a chunk and a leaf, with odd remainders.
constexpr int64_t kLengths[] = {1,
                                7,
                                internal::kStatsChunkElems - 1,
                                internal::kStatsChunkElems,
                                internal::kStatsChunkElems + 1,
                                internal::kStatsLeafElems + 3,
                                100003,
                                (int64_t{1} << 20) + 5};

// Sum of (scale * x)^2 in long double: each product scale * x is exact in double.
long double ReferenceSumSquares(const GradData& g, float scale) {
  long double sum = 0;
  for (int64_t i = 0; i < g.size(); ++i) {
    const long double y = static_cast<double>(g.value(i)) * static_cast<double>(scale);
    sum += y * y;
  }
  return sum;
}

TEST(GradStats, SumOfSquaresMatchesFloat64ReferenceForEveryDTypeAndLength) {
  std::mt19937 rng(11);
  for (DType dtype : kDTypes) {
    for (int64_t n : kLengths) {
      const GradData g = GradData::Random(dtype, n, rng, Mix::kFinite);
      for (float scale : {1.0f, 1.0f / 1024.0f, 3.5f, -0.75f}) {
        SCOPED_TRACE(fmt::format("{} n={} scale={}", DTypeName(dtype), n, scale));
        const StatusOr<GradStats> stats = ComputeGradStats(g.view(), n, scale);
        ASSERT_TRUE(stats.ok()) << stats.status().ToString();
        const long double ref = ReferenceSumSquares(g, scale);
        ASSERT_GT(ref, 0.0L);
        EXPECT_LE(std::abs(static_cast<long double>(stats->sum_squares) - ref) / ref, 1e-12L)
            << stats->sum_squares << " vs " << static_cast<double>(ref);
        EXPECT_FALSE(stats->nonfinite);
        EXPECT_EQ(stats->num_elems, n);
      }
    }
  }
}

TEST(GradStats, HugeAndDenormalValuesKeepFullPrecision) {
  // fp32 max squared overflows fp32 but not fp64; denormals square to ~1e-90.
  GradData g(DType::kF32, 5);
  g.Set(0, FLT_MAX);
  g.Set(1, -FLT_MAX);
  g.Set(2, FLT_TRUE_MIN);
  g.Set(3, 1.0f);
  g.Set(4, -3.0e-39f);
  const StatusOr<GradStats> stats = ComputeGradStats(g.view(), 5, 0.5f);
  ASSERT_TRUE(stats.ok());
  const double big = 0.5 * static_cast<double>(FLT_MAX);
  EXPECT_DOUBLE_EQ(stats->sum_squares, 2 * big * big);
  EXPECT_FALSE(stats->nonfinite);

  GradData tiny(DType::kF32, 3);
  tiny.Set(0, FLT_TRUE_MIN);
  tiny.Set(1, -FLT_TRUE_MIN);
  tiny.Set(2, 1e-40f);
  const StatusOr<GradStats> t = ComputeGradStats(tiny.view(), 3);
  ASSERT_TRUE(t.ok());
  const double d = FLT_TRUE_MIN, e = 1e-40f;
  EXPECT_DOUBLE_EQ(t->sum_squares, 2 * d * d + e * e);
  EXPECT_GT(t->sum_squares, 0.0);
}

TEST(GradStats, SingleInfOrNanIsDetectedAtFirstMiddleAndLastElement) {
  std::mt19937 rng(12);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : kDTypes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
      const GradData clean = GradData::Random(dtype, n, rng, Mix::kFinite);
      const StatusOr<GradStats> base = ComputeGradStats(clean.view(), n);
      ASSERT_TRUE(base.ok());
      EXPECT_FALSE(base->nonfinite) << DTypeName(dtype) << " n=" << n;
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        for (float bad : {inf, -inf, nan, -nan}) {
          SCOPED_TRACE(fmt::format("{} n={} pos={} value={}", DTypeName(dtype), n, pos, bad));
          GradData g = clean;
          g.Set(pos, bad);
          for (float scale : {1.0f, 0.0f}) {
            const StatusOr<GradStats> stats = ComputeGradStats(g.view(), n, scale);
            ASSERT_TRUE(stats.ok());
            EXPECT_TRUE(stats->nonfinite) << "scale " << scale;
            EXPECT_FALSE(std::isfinite(stats->sum_squares));
          }
          std::vector<float> accum(n, 1.0f);
          const StatusOr<GradStats> acc = AccumulateGrad(accum, g.view(), false, true);
          ASSERT_TRUE(acc.ok());
          EXPECT_TRUE(acc->nonfinite);
        }
      }
    }
  }
}

TEST(GradStats, LargestFiniteValuesAreNotNonfinite) {
  GradData h(DType::kF16, 3), b(DType::kBF16, 3), f(DType::kF32, 3);
  h.SetBits(0, 0x7bff);  // 65504
  h.SetBits(1, 0xfbff);
  h.SetBits(2, 0x0001);
  b.SetBits(0, 0x7f7f);  // ~3.39e38
  b.SetBits(1, 0xff7f);
  b.SetBits(2, 0x0001);
  f.Set(0, FLT_MAX);
  f.Set(1, -FLT_MAX);
  f.Set(2, FLT_TRUE_MIN);
  for (const GradData* g : {&h, &b, &f}) {
    const StatusOr<GradStats> stats = ComputeGradStats(g->view(), 3, FLT_MAX);
    ASSERT_TRUE(stats.ok());
    EXPECT_FALSE(stats->nonfinite) << DTypeName(g->dtype());
    EXPECT_TRUE(std::isfinite(stats->sum_squares));
  }
}

// The order of fp64 additions documented in cpu_optim/kernels.h, written out
// sequentially: 8 lanes per chunk, chunks in order per leaf, leaves pairwise.
double DocumentedOrderSum(int64_t n, const std::function<double(int64_t)>& term) {
  using internal::kStatsChunkElems;
  using internal::kStatsLeafElems;
  auto chunk = [&](int64_t begin, int64_t end) {
    double lane[8] = {};
    for (int64_t i = begin; i < end; ++i) lane[(i - begin) % 8] += term(i);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
           ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  };
  auto leaf = [&](int64_t l) {
    double sum = 0.0;
    const int64_t end = std::min(n, (l + 1) * kStatsLeafElems);
    for (int64_t c = l * kStatsLeafElems; c < end; c += kStatsChunkElems) {
      sum += chunk(c, std::min(end, c + kStatsChunkElems));
    }
    return sum;
  };
  std::function<double(int64_t, int64_t)> pairwise = [&](int64_t first, int64_t last) {
    if (last - first == 1) return leaf(first);
    const int64_t mid = first + (last - first) / 2;
    return pairwise(first, mid) + pairwise(mid, last);
  };
  return n == 0 ? 0.0 : pairwise(0, (n + kStatsLeafElems - 1) / kStatsLeafElems);
}

// Thread counts to try: one, two, and all the machine offers (no oversubscription).
std::vector<int> ThreadCounts() {
  std::vector<int> t = {1, 2};
  if (tbb::info::default_concurrency() > 2) t.push_back(tbb::info::default_concurrency());
  return t;
}

// Pins the exact order of additions, so that a change of order is caught even on
// one thread (thread-count comparisons alone catch it only when stealing happens
// to split the range differently). Values of one magnitude range, so that every
// term moves the low bits of the sum.
TEST(GradStats, SumOfSquaresFollowsTheDocumentedOrderBitForBit) {
  std::mt19937 rng(13);
  const int64_t lengths[] = {1,
                             7,
                             4097,
                             internal::kStatsLeafElems + 3,
                             5 * internal::kStatsLeafElems + 17,
                             24 * internal::kStatsLeafElems + 1001};
  for (DType dtype : kDTypes) {
    for (int64_t n : lengths) {
      GradData g(dtype, n);
      std::vector<float> accum0(n);
      for (int64_t i = 0; i < n; ++i) {
        g.Set(i, testing::RandomFloat(rng, -3, 3));
        accum0[i] = testing::RandomFloat(rng, -3, 3);
      }
      const double scale = 0.375;
      const double expected = DocumentedOrderSum(n, [&](int64_t i) {
        const double y = static_cast<double>(g.value(i)) * scale;
        return y * y;
      });
      const double expected_accum = DocumentedOrderSum(n, [&](int64_t i) {
        const double y = static_cast<float>(accum0[i] + g.value(i));
        return y * y;
      });
      for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
        for (int threads : ThreadCounts()) {
          SCOPED_TRACE(
              fmt::format("{} n={} {} threads={}", DTypeName(dtype), n, kernels->name, threads));
          tbb::task_arena arena(threads);
          double sum = 0, acc_sum = 0;
          std::vector<float> accum = accum0;
          arena.execute([&] {
            sum = internal::ComputeGradStatsWith(*kernels, g.view(), n, scale)->sum_squares;
            acc_sum =
                internal::AccumulateGradWith(*kernels, accum, g.view(), false, true)->sum_squares;
          });
          EXPECT_EQ(std::bit_cast<uint64_t>(sum), std::bit_cast<uint64_t>(expected))
              << sum << " vs " << expected;
          EXPECT_EQ(std::bit_cast<uint64_t>(acc_sum), std::bit_cast<uint64_t>(expected_accum))
              << acc_sum << " vs " << expected_accum;
        }
      }
    }
  }
}

TEST(GradStats, SumOfSquaresIsTheSameUnderGlobalControlOfOneThread) {
  constexpr int64_t n = 7 * internal::kStatsLeafElems + 5;
  std::mt19937 rng(16);
  const GradData g = GradData::Random(DType::kBF16, n, rng, Mix::kFinite);
  const double free_sum = ComputeGradStats(g.view(), n)->sum_squares;
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
  EXPECT_EQ(std::bit_cast<uint64_t>(ComputeGradStats(g.view(), n)->sum_squares),
            std::bit_cast<uint64_t>(free_sum));
}

TEST(AccumulateGrad, AddsOrOverwritesElementByElementAndReportsStatsOfTheResult) {
  std::mt19937 rng(14);
  for (DType dtype : kDTypes) {
    for (int64_t n : kLengths) {
      if (n > 200000) continue;
      const GradData g = GradData::Random(dtype, n, rng, Mix::kFinite);
      std::vector<float> accum0(n);
      for (auto& x : accum0) x = testing::RandomValue(rng, Mix::kFinite);
      for (bool overwrite : {false, true}) {
        for (bool want_stats : {false, true}) {
          SCOPED_TRACE(fmt::format("{} n={} overwrite={} stats={}", DTypeName(dtype), n, overwrite,
                                   want_stats));
          std::vector<float> accum = accum0;
          const StatusOr<GradStats> stats = AccumulateGrad(accum, g.view(), overwrite, want_stats);
          ASSERT_TRUE(stats.ok()) << stats.status().ToString();
          long double ref = 0;
          int64_t bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const float expected = overwrite ? g.value(i) : accum0[i] + g.value(i);
            if (Bits(accum[i]) != Bits(expected) && bad++ < 3) {
              ADD_FAILURE() << "[" << i << "] " << accum[i] << " != " << expected;
            }
            ref += static_cast<long double>(expected) * expected;
          }
          EXPECT_EQ(bad, 0);
          if (want_stats) {
            EXPECT_EQ(stats->num_elems, n);
            EXPECT_FALSE(stats->nonfinite);
            EXPECT_LE(std::abs(stats->sum_squares - ref) / ref, 1e-12L);
          } else {
            EXPECT_EQ(stats->sum_squares, 0.0);
            EXPECT_EQ(stats->num_elems, 0);
            EXPECT_FALSE(stats->nonfinite);
          }
        }
      }
    }
  }
}

TEST(AccumulateGrad, OverwriteCopiesBitsIncludingNegativeZeroAndNan) {
  constexpr int64_t n = 5000;
  std::mt19937 rng(15);
  for (DType dtype : kDTypes) {
    const GradData g = GradData::Random(dtype, n, rng, Mix::kAnyBits);
    std::vector<float> accum(n, 7.0f);
    ASSERT_TRUE(AccumulateGrad(accum, g.view(), true, false).ok());
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += Bits(accum[i]) != Bits(g.value(i));
    EXPECT_EQ(bad, 0) << DTypeName(dtype);
  }
}

TEST(CopyGradWithStats, CopiesEveryBitAndGivesComputeGradStatsBitForBit) {
  // Any bits (NaN, inf, -0, denormals) in every dtype, at every length around a chunk and a leaf:
  // the copy is the bytes, the statistics those of ComputeGradStats on the source.
  std::mt19937 rng(29);
  for (DType dtype : kDTypes) {
    for (int64_t n : kLengths) {
      for (Mix mix : {Mix::kAnyBits, Mix::kFinite}) {
        SCOPED_TRACE(fmt::format("{} n {} mix {}", DTypeName(dtype), n, static_cast<int>(mix)));
        const GradData g = GradData::Random(dtype, n, rng, mix);
        const size_t bytes = static_cast<size_t>(n) * SizeOf(dtype);
        std::vector<std::byte> dst(bytes, std::byte{0x5a});
        auto copied = CopyGradWithStats(g.view(), dst.data(), n);
        auto want = ComputeGradStats(g.view(), n);
        ASSERT_TRUE(copied.ok() && want.ok()) << copied.status().ToString();
        EXPECT_EQ(std::memcmp(dst.data(), g.view().data, bytes), 0);
        EXPECT_EQ(std::bit_cast<uint64_t>(copied->sum_squares),
                  std::bit_cast<uint64_t>(want->sum_squares));
        EXPECT_EQ(copied->nonfinite, want->nonfinite);
        EXPECT_EQ(copied->num_elems, n);
      }
    }
  }
  std::vector<float> x(16, 1.0f);
  EXPECT_FALSE(CopyGradWithStats({x.data(), DType::kF32}, x.data() + 1, 8).ok());  // overlap
  EXPECT_FALSE(CopyGradWithStats({x.data(), DType::kF32}, nullptr, 8).ok());
}

TEST(AccumulateGrad, OverflowOfTheSumIsReportedAsNonfinite) {
  GradData g(DType::kF32, 3);
  g.Set(0, 1.0f);
  g.Set(1, FLT_MAX);
  g.Set(2, 2.0f);
  std::vector<float> accum = {1.0f, FLT_MAX, 3.0f};
  const StatusOr<GradStats> stats = AccumulateGrad(accum, g.view(), false, true);
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(stats->nonfinite);
  EXPECT_EQ(accum[1], std::numeric_limits<float>::infinity());
}

TEST(GradStats, MergeAddsSumsAndCountsAndOrsNonfinite) {
  GradStats a{.sum_squares = 1.5, .nonfinite = false, .num_elems = 3};
  Merge(a, GradStats{.sum_squares = 2.25, .nonfinite = false, .num_elems = 4});
  EXPECT_EQ(a.sum_squares, 3.75);
  EXPECT_FALSE(a.nonfinite);
  EXPECT_EQ(a.num_elems, 7);
  Merge(a, GradStats{.sum_squares = 0, .nonfinite = true, .num_elems = 1});
  EXPECT_TRUE(a.nonfinite);
  Merge(a, GradStats{});
  EXPECT_TRUE(a.nonfinite);
  EXPECT_EQ(a.num_elems, 8);
}

TEST(GradStats, EmptyBucketGivesZeroStats) {
  const StatusOr<GradStats> stats = ComputeGradStats(GradView{nullptr, DType::kF16}, 0);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sum_squares, 0.0);
  EXPECT_FALSE(stats->nonfinite);
  EXPECT_EQ(stats->num_elems, 0);
  EXPECT_TRUE(AccumulateGrad({}, GradView{nullptr, DType::kF32}, false, true).ok());
}

TEST(GradStats, InvalidArgumentsAreRejected) {
  std::vector<uint16_t> g(16, 0x3c00);
  std::vector<float> accum(16, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  auto code = [](const auto& s) { return s.status().code(); };
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  EXPECT_EQ(code(ComputeGradStats(GradView{nullptr, DType::kF16}, 16)), kInvalid);
  EXPECT_EQ(code(ComputeGradStats(GradView{g.data(), DType::kF16}, -1)), kInvalid);
  EXPECT_EQ(code(ComputeGradStats(GradView{g.data(), DType{5}}, 16)), kInvalid);
  EXPECT_EQ(code(ComputeGradStats(GradView{g.data(), DType::kF16}, 16, inf)), kInvalid);
  EXPECT_EQ(code(ComputeGradStats(GradView{g.data(), DType::kF16}, 16,
                                  std::numeric_limits<float>::quiet_NaN())),
            kInvalid);
  EXPECT_EQ(code(AccumulateGrad(accum, GradView{nullptr, DType::kF16}, false, true)), kInvalid);
  EXPECT_EQ(code(AccumulateGrad(accum, GradView{g.data(), DType{3}}, false, true)), kInvalid);
  EXPECT_EQ(code(AccumulateGrad(accum, GradView{accum.data() + 2, DType::kBF16}, true, false)),
            kInvalid);
  EXPECT_TRUE(std::all_of(accum.begin(), accum.end(), [](float x) { return x == 1.0f; }));
}

}  // namespace
}  // namespace strata::cpu_optim
