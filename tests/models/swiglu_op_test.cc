// models/ops/swiglu.h: the double instantiation against the formula written here, its backward
// against central finite differences, every storage type against the double instantiation, and
// the in-place backward.
#include <gtest/gtest.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "models/ops/swiglu.h"
#include "tests/models/llama_op_test_util.h"

namespace strata::models::ops {
namespace {

using op_test::Cast;
using op_test::Close;
using op_test::Eps;
using op_test::ExpectWithinBound;
using op_test::Poisoned;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;

struct Dims {
  int64_t rows, I;
};
// I = 1, below / at / above the vector width (16), and wide rows for the parallel split.
const Dims kDims[] = {{3, 1}, {7, 15}, {5, 16}, {13, 17}, {9, 33}, {301, 96}};

double Silu(double g) { return g / (1 + std::exp(-g)); }

TEST(SwigluOp, DoubleForwardIsSiluOfGateTimesUp) {
  for (const Dims& d : kDims) {
    // Gates up to +-12: both tails of the sigmoid.
    const std::vector<double> gu = RandomValues(d.rows * 2 * d.I, 12.0, 1);
    std::vector<double> h = Poisoned<double>(d.rows * d.I);
    SwigluForward<double>(gu.data(), d.rows, d.I, h.data());
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.I; ++c) {
        const double want = Silu(gu[r * 2 * d.I + c]) * gu[r * 2 * d.I + d.I + c];
        ASSERT_TRUE(Close(h[r * d.I + c], want, 1e-15, 1e-13)) << r << " " << c;
      }
    }
  }
}

TEST(SwigluOp, DoubleBackwardMatchesCentralFiniteDifferences) {
  for (const Dims& d : kDims) {
    if (d.rows * d.I > 2000) continue;
    std::vector<double> gu = RandomValues(d.rows * 2 * d.I, 6.0, 2);
    const std::vector<double> dh = RandomValues(d.rows * d.I, 1.0, 3);
    std::vector<double> dgu = Poisoned<double>(gu.size());
    SwigluBackward<double>(gu.data(), dh.data(), d.rows, d.I, dgu.data());
    constexpr double kH = 1e-6;
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < 2 * d.I; ++c) {
        double& v = gu[r * 2 * d.I + c];
        const int64_t col = c % d.I;
        // Only h[r, col] depends on this input.
        auto h = [&] { return Silu(gu[r * 2 * d.I + col]) * gu[r * 2 * d.I + d.I + col]; };
        const double saved = v;
        v = saved + kH;
        const double up = h();
        v = saved - kH;
        const double down = h();
        v = saved;
        const double want = dh[r * d.I + col] * (up - down) / (2 * kH);
        EXPECT_TRUE(Close(dgu[r * 2 * d.I + c], want, 1e-8, 1e-6))
            << r << " " << c << ": " << dgu[r * 2 * d.I + c] << " vs " << want;
      }
    }
  }
}

template <typename S>
class SwigluTypedTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(SwigluTypedTest, StorageTypes);

TYPED_TEST(SwigluTypedTest, AgreesWithTheDoubleInstantiationElementByElement) {
  using S = TypeParam;
  for (const Dims& d : kDims) {
    const std::vector<double> gu = Rounded<S>(RandomValues(d.rows * 2 * d.I, 6.0, 4));
    const std::vector<double> dh = Rounded<S>(RandomValues(d.rows * d.I, 1.0, 5));
    std::vector<double> h(d.rows * d.I), dgu(gu.size());
    SwigluForward<double>(gu.data(), d.rows, d.I, h.data());
    SwigluBackward<double>(gu.data(), dh.data(), d.rows, d.I, dgu.data());
    const std::vector<S> gus = Cast<S>(gu), dhs = Cast<S>(dh);
    std::vector<S> hs = Poisoned<S>(h.size()), dgus = Poisoned<S>(gu.size());
    SwigluForward<S>(gus.data(), d.rows, d.I, hs.data());
    SwigluBackward<S>(gus.data(), dhs.data(), d.rows, d.I, dgus.data());
    // Elementwise fp32 (exp within a few ulp), one rounding per output.
    const std::string tag = " I=" + std::to_string(d.I);
    ExpectWithinBound("h" + tag, ToDoubles(hs), h, 2, Eps<S>(8));
    ExpectWithinBound("dgate_up" + tag, ToDoubles(dgus), dgu, 2, Eps<S>(16));
  }
}

TEST(SwigluOp, BackwardInPlaceOverGateUpGivesTheSameBits) {
  const Dims d{29, 37};
  const std::vector<Fp16> gu = Cast<Fp16>(RandomValues(d.rows * 2 * d.I, 4.0, 6));
  const std::vector<Fp16> dh = Cast<Fp16>(RandomValues(d.rows * d.I, 1.0, 7));
  std::vector<Fp16> out(gu.size());
  SwigluBackward<Fp16>(gu.data(), dh.data(), d.rows, d.I, out.data());
  std::vector<Fp16> in_place = gu;
  SwigluBackward<Fp16>(in_place.data(), dh.data(), d.rows, d.I, in_place.data());
  EXPECT_EQ(std::memcmp(in_place.data(), out.data(), out.size() * sizeof(Fp16)), 0);
}

TEST(SwigluOp, ResultsAreBitIdenticalOnOneThreadAndOnAll) {
  const Dims d{1001, 67};
  const std::vector<float> gu = Cast<float>(RandomValues(d.rows * 2 * d.I, 6.0, 8));
  const std::vector<float> dh = Cast<float>(RandomValues(d.rows * d.I, 1.0, 9));
  auto run = [&] {
    std::vector<float> out(d.rows * d.I + gu.size());
    SwigluForward<float>(gu.data(), d.rows, d.I, out.data());
    SwigluBackward<float>(gu.data(), dh.data(), d.rows, d.I, out.data() + d.rows * d.I);
    return out;
  };
  std::vector<float> one, all;
  tbb::task_arena(1).execute([&] { one = run(); });
  tbb::task_arena(tbb::info::default_concurrency()).execute([&] { all = run(); });
  EXPECT_EQ(std::memcmp(one.data(), all.data(), one.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace strata::models::ops
