// models/ops/rms_norm.h: the double instantiation against the formula written here, its
// backward against central finite differences, and every storage type against the double
// instantiation on the same rounded inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "models/ops/rms_norm.h"
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
  int64_t rows, C;
};
// C = 1, below, at and above a column block (64), and an odd width past two blocks.
const Dims kDims[] = {{5, 1}, {37, 7}, {3, 64}, {19, 67}, {11, 130}};
constexpr double kEpsRms = 1e-5;

// y = x / sqrt(mean(x^2) + eps) * w, straight from the definition.
std::vector<double> Reference(const std::vector<double>& x, const std::vector<double>& w,
                              int64_t rows, int64_t C) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[r * C + c] * x[r * C + c] / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = x[r * C + c] / std::sqrt(ms + kEpsRms) * w[c];
  }
  return y;
}

std::vector<double> Weights(int64_t C, uint64_t seed) {
  std::vector<double> w = RandomValues(C, 0.3, seed);
  for (double& v : w) v += 1.0;
  return w;
}

TEST(RmsNormOp, DoubleForwardMatchesTheDefinition) {
  for (const Dims& d : kDims) {
    const std::vector<double> x = RandomValues(d.rows * d.C, 2.0, 1);
    const std::vector<double> w = Weights(d.C, 2);
    std::vector<double> y = Poisoned<double>(x.size()), rstd(d.rows);
    RmsNormForward<double>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data());
    const std::vector<double> want = Reference(x, w, d.rows, d.C);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_TRUE(Close(y[i], want[i], 1e-14, 1e-13)) << d.C << " " << i;
    }
  }
}

// L = sum(dy * y(x, w)) + sum(dres * x): dL/dx = RMS'(dy) + dres, dL/dw = sum dy xhat.
TEST(RmsNormOp, DoubleBackwardMatchesCentralFiniteDifferences) {
  for (const Dims& d : kDims) {
    const int64_t n = d.rows * d.C;
    std::vector<double> x = RandomValues(n, 2.0, 3);
    std::vector<double> w = Weights(d.C, 4);
    const std::vector<double> dy = RandomValues(n, 1.0, 5);
    const std::vector<double> dres = RandomValues(n, 1.0, 6);
    auto loss = [&] {
      const std::vector<double> y = Reference(x, w, d.rows, d.C);
      double l = 0;
      for (int64_t i = 0; i < n; ++i) l += dy[i] * y[i] + dres[i] * x[i];
      return l;
    };
    std::vector<double> y(n), rstd(d.rows), dx = Poisoned<double>(n), dw = Poisoned<double>(d.C);
    RmsNormForward<double>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data());
    RmsNormBackward<double>(x.data(), w.data(), rstd.data(), dy.data(), dres.data(), d.rows, d.C,
                            dx.data(), dw.data());
    constexpr double kH = 1e-6;
    auto numeric = [&](double& p) {
      const double saved = p;
      p = saved + kH;
      const double up = loss();
      p = saved - kH;
      const double down = loss();
      p = saved;
      return (up - down) / (2 * kH);
    };
    for (int64_t i = 0; i < n; ++i) {
      const double want = numeric(x[i]);
      EXPECT_TRUE(Close(dx[i], want, 1e-7, 1e-6)) << "dx[" << i << "] " << dx[i] << " " << want;
    }
    for (int64_t c = 0; c < d.C; ++c) {
      const double want = numeric(w[c]);
      EXPECT_TRUE(Close(dw[c], want, 1e-7, 1e-6)) << "dw[" << c << "] " << dw[c] << " " << want;
    }
  }
}

TEST(RmsNormOp, BackwardWithoutResidualOrWeightGradientWritesOnlyDx) {
  const Dims d{9, 13};
  const std::vector<double> x = RandomValues(d.rows * d.C, 1.0, 7);
  const std::vector<double> w = Weights(d.C, 8);
  const std::vector<double> dy = RandomValues(d.rows * d.C, 1.0, 9);
  const std::vector<double> zero(d.rows * d.C, 0.0);
  std::vector<double> y(x.size()), rstd(d.rows);
  RmsNormForward<double>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data());
  std::vector<double> dx_none(x.size()), dx_zero(x.size());
  RmsNormBackward<double>(x.data(), w.data(), rstd.data(), dy.data(), nullptr, d.rows, d.C,
                          dx_none.data(), nullptr);
  RmsNormBackward<double>(x.data(), w.data(), rstd.data(), dy.data(), zero.data(), d.rows, d.C,
                          dx_zero.data(), nullptr);
  EXPECT_EQ(dx_none, dx_zero);
}

TEST(RmsNormOp, DxMayAliasDyOrTheResidualGradient) {
  const Dims d{21, 70};
  const std::vector<Bf16> x = Cast<Bf16>(RandomValues(d.rows * d.C, 1.0, 10));
  const std::vector<Bf16> w = Cast<Bf16>(Weights(d.C, 11));
  const std::vector<Bf16> dy = Cast<Bf16>(RandomValues(x.size(), 1.0, 12));
  const std::vector<Bf16> dres = Cast<Bf16>(RandomValues(x.size(), 1.0, 13));
  std::vector<Bf16> y(x.size());
  std::vector<float> rstd(d.rows);
  RmsNormForward<Bf16>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data());
  std::vector<Bf16> dx(x.size()), dw(d.C), dw2(d.C);
  RmsNormBackward<Bf16>(x.data(), w.data(), rstd.data(), dy.data(), dres.data(), d.rows, d.C,
                        dx.data(), dw.data());
  std::vector<Bf16> in_dy = dy, in_res = dres;
  RmsNormBackward<Bf16>(x.data(), w.data(), rstd.data(), in_dy.data(), dres.data(), d.rows, d.C,
                        in_dy.data(), dw2.data());
  RmsNormBackward<Bf16>(x.data(), w.data(), rstd.data(), dy.data(), in_res.data(), d.rows, d.C,
                        in_res.data(), nullptr);
  EXPECT_EQ(ToDoubles(in_dy), ToDoubles(dx));
  EXPECT_EQ(ToDoubles(in_res), ToDoubles(dx));
  EXPECT_EQ(ToDoubles(dw2), ToDoubles(dw));
}

template <typename S>
class RmsNormTypedTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(RmsNormTypedTest, StorageTypes);

TYPED_TEST(RmsNormTypedTest, AgreesWithTheDoubleInstantiationElementByElement) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const Dims& d : kDims) {
    const int64_t n = d.rows * d.C;
    const std::vector<double> x = Rounded<S>(RandomValues(n, 2.0, 20));
    const std::vector<double> w = Rounded<S>(Weights(d.C, 21));
    const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 22));
    const std::vector<double> dres = Rounded<S>(RandomValues(n, 1.0, 23));
    const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy), dress = Cast<S>(dres);

    std::vector<double> y(n), rstd(d.rows), dx(n), dw(d.C);
    RmsNormForward<double>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data());
    RmsNormBackward<double>(x.data(), w.data(), rstd.data(), dy.data(), dres.data(), d.rows, d.C,
                            dx.data(), dw.data());
    std::vector<S> ys = Poisoned<S>(n), dxs = Poisoned<S>(n), dws = Poisoned<S>(d.C);
    std::vector<F> rstds(d.rows);
    RmsNormForward<S>(xs.data(), ws.data(), kEpsRms, d.rows, d.C, ys.data(), rstds.data());
    RmsNormBackward<S>(xs.data(), ws.data(), rstds.data(), dys.data(), dress.data(), d.rows, d.C,
                       dxs.data(), dws.data());
    const std::string tag = " C=" + std::to_string(d.C);
    // rstd: an fp32 sum of C squares, never rounded to S.
    ExpectWithinBound("rstd" + tag, ToDoubles(rstds), rstd, 2, Eps<float>(d.C));
    // y: rstd's error and one rounding.
    ExpectWithinBound("y" + tag, ToDoubles(ys), y, 2, Eps<S>(d.C));
    // dx: two fp32 sums of C terms, the residual added, one rounding.
    ExpectWithinBound("dx" + tag, ToDoubles(dxs), dx, 4, Eps<S>(2 * d.C));
    // dw: an fp32 sum over the rows, one rounding.
    ExpectWithinBound("dw" + tag, ToDoubles(dws), dw, 2, Eps<S>(d.rows + d.C));
  }
}

}  // namespace
}  // namespace strata::models::ops
