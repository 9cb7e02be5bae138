// models/ops/swiglu.h: for both gate activations (SwiGLU's silu, GeGLU's tanh GELU) the double
// instantiation against the formula written here, its backward against central finite differences
// and (GeGLU) the derivative written here, every storage type against the double instantiation,
// and the in-place backward.
#include <gtest/gtest.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
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
using terms_bound::ExpectWithinTermsBound;

struct Dims {
  int64_t rows, I;
};
// I = 1, below / at / above the vector width (16), and wide rows for the parallel split.
const Dims kDims[] = {{3, 1}, {7, 15}, {5, 16}, {13, 17}, {9, 33}, {301, 96}};

double Silu(double g) { return g / (1 + std::exp(-g)); }

// Gemma's gelu_pytorch_tanh and its derivative, in double.
constexpr double kSqrt2OverPi = 0.7978845608028654;
double GeluTanh(double g) {
  return 0.5 * g * (1 + std::tanh(kSqrt2OverPi * (g + 0.044715 * g * g * g)));
}
double GeluTanhGrad(double g) {
  const double a = kSqrt2OverPi * (g + 0.044715 * g * g * g);
  const double sech = 1 / std::cosh(a);
  return 0.5 * (1 + std::tanh(a)) +
         0.5 * g * sech * sech * kSqrt2OverPi * (1 + 3 * 0.044715 * g * g);
}

// Random gates of amplitude `amplitude`, and in the first columns of each row the gates GeGLU's
// tails and its centre meet: huge (+-300, where tanh saturates and gelu(g) is g or 0), large
// (+-30, +-8), the zero of gelu' (-0.7518), and near 0 (+-1e-3, +-1e-7: subnormal in fp16, 0).
std::vector<double> GeGluInputs(const Dims& d, double amplitude, uint64_t seed) {
  std::vector<double> gu = RandomValues(d.rows * 2 * d.I, amplitude, seed);
  const double special[] = {300, -300, 30, -30, 8, -8, -0.7518, 1e-3, -1e-3, 1e-7, -1e-7, 0};
  int next = static_cast<int>(seed % 12);
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(d.I, 5); ++c)
      gu[r * 2 * d.I + c] = special[next++ % 12];
  }
  return gu;
}

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

TEST(GegluOp, DoubleForwardIsGeluTanhOfGateTimesUp) {
  for (const Dims& d : kDims) {
    const std::vector<double> gu = GeGluInputs(d, 12.0, 11);
    std::vector<double> h = Poisoned<double>(d.rows * d.I);
    SwigluForward<double>(gu.data(), d.rows, d.I, h.data(), GatedActivation::kGeluTanh);
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.I; ++c) {
        const double g = gu[r * 2 * d.I + c], u = gu[r * 2 * d.I + d.I + c];
        // 1 + tanh(.) cancels for negative gates: an absolute error of a few ulp of 1, times g u.
        ASSERT_TRUE(Close(h[r * d.I + c], GeluTanh(g) * u, 1e-15 * (1 + std::abs(g * u)), 1e-13))
            << r << " " << c << " g=" << g << ": " << h[r * d.I + c] << " vs " << GeluTanh(g) * u;
      }
    }
  }
}

// dgate = dh u gelu'(g) and dup = dh gelu(g) against the derivative written above, and against
// central finite differences of the formula (gates within +-6 and the special ones up to 30).
TEST(GegluOp, DoubleBackwardMatchesTheDerivativeAndCentralFiniteDifferences) {
  for (const Dims& d : kDims) {
    std::vector<double> gu = GeGluInputs(d, 6.0, 12);
    for (double& x : gu) x = std::clamp(x, -30.0, 30.0);
    const std::vector<double> dh = RandomValues(d.rows * d.I, 1.0, 13);
    std::vector<double> dgu = Poisoned<double>(gu.size());
    SwigluBackward<double>(gu.data(), dh.data(), d.rows, d.I, dgu.data(),
                           GatedActivation::kGeluTanh);
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.I; ++c) {
        const double g = gu[r * 2 * d.I + c], u = gu[r * 2 * d.I + d.I + c];
        const double dhv = dh[r * d.I + c];
        const double atol = 1e-15 * (1 + std::abs(g * u * dhv));
        ASSERT_TRUE(Close(dgu[r * 2 * d.I + c], dhv * u * GeluTanhGrad(g), atol, 1e-13))
            << "dgate " << r << " " << c << " g=" << g;
        ASSERT_TRUE(Close(dgu[r * 2 * d.I + d.I + c], dhv * GeluTanh(g), atol, 1e-13))
            << "dup " << r << " " << c << " g=" << g;
      }
    }
    if (d.rows * d.I > 2000) continue;
    constexpr double kH = 1e-6;
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < 2 * d.I; ++c) {
        double& v = gu[r * 2 * d.I + c];
        const int64_t col = c % d.I;
        auto h = [&] { return GeluTanh(gu[r * 2 * d.I + col]) * gu[r * 2 * d.I + d.I + col]; };
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

// The activation is read: the same gates give other results under kGeluTanh, and the default is
// kSilu, bit for bit.
TEST(GegluOp, TheDefaultIsSiluAndGeluTanhDiffers) {
  const Dims d{7, 15};
  const std::vector<float> gu = Cast<float>(RandomValues(d.rows * 2 * d.I, 4.0, 14));
  const std::vector<float> dh = Cast<float>(RandomValues(d.rows * d.I, 1.0, 15));
  auto run = [&](const GatedActivation* act) {
    std::vector<float> out(d.rows * d.I + gu.size());
    if (act == nullptr) {
      SwigluForward<float>(gu.data(), d.rows, d.I, out.data());
      SwigluBackward<float>(gu.data(), dh.data(), d.rows, d.I, out.data() + d.rows * d.I);
    } else {
      SwigluForward<float>(gu.data(), d.rows, d.I, out.data(), *act);
      SwigluBackward<float>(gu.data(), dh.data(), d.rows, d.I, out.data() + d.rows * d.I, *act);
    }
    return out;
  };
  const GatedActivation silu = GatedActivation::kSilu, gelu = GatedActivation::kGeluTanh;
  const std::vector<float> plain = run(nullptr), s = run(&silu), g = run(&gelu);
  EXPECT_EQ(std::memcmp(plain.data(), s.data(), s.size() * sizeof(float)), 0);
  int64_t differ = 0;
  for (size_t i = 0; i < s.size(); ++i) differ += s[i] != g[i];
  EXPECT_GT(differ, static_cast<int64_t>(s.size()) / 2);
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

// GeGLU: the same k and eps (one rounding per output, tanh within a few fp32 ulp), on gates with
// the huge, large and near-zero values of GeGluInputs, plus the magnitude of the terms that cancel
// in 1 + tanh and 1 - tanh^2 for negative gates (op_test::GegluTermsOf): there Eigen's fp32 tanh,
// which saturates to -1 below about -7.9, leaves gelu'(g) ~ 1e-6 absolute from the double's.
TYPED_TEST(SwigluTypedTest, GegluAgreesWithTheDoubleInstantiationElementByElement) {
  using S = TypeParam;
  constexpr GatedActivation kGelu = GatedActivation::kGeluTanh;
  for (const Dims& d : kDims) {
    const std::vector<double> gu = Rounded<S>(GeGluInputs(d, 6.0, 16));
    const std::vector<double> dh = Rounded<S>(RandomValues(d.rows * d.I, 1.0, 17));
    std::vector<double> h(d.rows * d.I), dgu(gu.size());
    SwigluForward<double>(gu.data(), d.rows, d.I, h.data(), kGelu);
    SwigluBackward<double>(gu.data(), dh.data(), d.rows, d.I, dgu.data(), kGelu);
    const std::vector<S> gus = Cast<S>(gu), dhs = Cast<S>(dh);
    std::vector<S> hs = Poisoned<S>(h.size()), dgus = Poisoned<S>(gu.size());
    SwigluForward<S>(gus.data(), d.rows, d.I, hs.data(), kGelu);
    SwigluBackward<S>(gus.data(), dhs.data(), d.rows, d.I, dgus.data(), kGelu);
    const std::string tag = " I=" + std::to_string(d.I);
    const op_test::GegluTerms terms = op_test::GegluTermsOf(gu, dh, d.rows, d.I);
    ExpectWithinTermsBound("h" + tag, ToDoubles(hs), h, terms.h, 2, Eps<S>(8));
    ExpectWithinTermsBound("dgate_up" + tag, ToDoubles(dgus), dgu, terms.dgate_up, 2, Eps<S>(16));
    EXPECT_GT(op_test::ExpectSaturatedGegluIsExact<S>(tag, gu, dh, d.rows, d.I, ToDoubles(hs),
                                                      ToDoubles(dgus)),
              0);
  }
}

TEST(SwigluOp, BackwardInPlaceOverGateUpGivesTheSameBits) {
  const Dims d{29, 37};
  const std::vector<Fp16> gu = Cast<Fp16>(RandomValues(d.rows * 2 * d.I, 4.0, 6));
  const std::vector<Fp16> dh = Cast<Fp16>(RandomValues(d.rows * d.I, 1.0, 7));
  for (const GatedActivation act : {GatedActivation::kSilu, GatedActivation::kGeluTanh}) {
    std::vector<Fp16> out(gu.size());
    SwigluBackward<Fp16>(gu.data(), dh.data(), d.rows, d.I, out.data(), act);
    std::vector<Fp16> in_place = gu;
    SwigluBackward<Fp16>(in_place.data(), dh.data(), d.rows, d.I, in_place.data(), act);
    EXPECT_EQ(std::memcmp(in_place.data(), out.data(), out.size() * sizeof(Fp16)), 0);
  }
}

TEST(SwigluOp, ResultsAreBitIdenticalOnOneThreadAndOnAll) {
  const Dims d{1001, 67};
  const std::vector<float> gu = Cast<float>(RandomValues(d.rows * 2 * d.I, 6.0, 8));
  const std::vector<float> dh = Cast<float>(RandomValues(d.rows * d.I, 1.0, 9));
  for (const GatedActivation act : {GatedActivation::kSilu, GatedActivation::kGeluTanh}) {
    auto run = [&] {
      std::vector<float> out(d.rows * d.I + gu.size());
      SwigluForward<float>(gu.data(), d.rows, d.I, out.data(), act);
      SwigluBackward<float>(gu.data(), dh.data(), d.rows, d.I, out.data() + d.rows * d.I, act);
      return out;
    };
    std::vector<float> one, all;
    tbb::task_arena(1).execute([&] { one = run(); });
    tbb::task_arena(tbb::info::default_concurrency()).execute([&] { all = run(); });
    EXPECT_EQ(std::memcmp(one.data(), all.data(), one.size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace strata::models::ops
