// models/ops/layer_norm.h: LayerNorm forward and backward, the double instantiation against a
// scalar reference (and the backward against central differences), every storage type
// against double.
#include "models/ops/layer_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/models/ops/op_test_util.h"

namespace strata::models::ops {
namespace {

using testing::BoundEps;
using testing::Cast;
using testing::ExpectNearReference;
using testing::ExpectWithinBound;
using testing::Poisoned;
using testing::RandomDoubles;
using testing::Rounded;
using testing::SameBits;
using testing::ToDoubles;

// Odd sizes: C not a multiple of the column block (64), rows not of any grain.
constexpr int64_t kRows = 29, kC = 83;

struct Data {
  std::vector<double> x, w, b, dy, dres;
};

Data MakeData(uint64_t seed) {
  std::vector<double> x = RandomDoubles(kRows * kC, seed, 2.0);
  for (int64_t r = 0; r < kRows; ++r) {  // a mean away from zero per row
    for (int64_t c = 0; c < kC; ++c) x[r * kC + c] += 0.5 * static_cast<double>(r % 5);
  }
  std::vector<double> w = RandomDoubles(kC, seed + 1, 0.3);
  for (double& v : w) v += 1.0;
  return {x, w, RandomDoubles(kC, seed + 2, 0.2), RandomDoubles(kRows * kC, seed + 3),
          RandomDoubles(kRows * kC, seed + 4)};
}

std::vector<double> ForwardReference(const Data& d, double eps) {
  std::vector<double> y(kRows * kC);
  for (int64_t r = 0; r < kRows; ++r) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < kC; ++c) m += d.x[r * kC + c];
    m /= kC;
    for (int64_t c = 0; c < kC; ++c) v += (d.x[r * kC + c] - m) * (d.x[r * kC + c] - m);
    v /= kC;
    const double s = 1.0 / std::sqrt(v + eps);
    for (int64_t c = 0; c < kC; ++c) y[r * kC + c] = (d.x[r * kC + c] - m) * s * d.w[c] + d.b[c];
  }
  return y;
}

template <typename S>
struct Result {
  std::vector<double> y, dx, dw, db;
};

template <typename S>
Result<S> RunOp(const Data& d, double eps, bool residual) {
  using F = ComputeType<S>;
  const std::vector<S> x = Cast<S>(d.x), w = Cast<S>(d.w), b = Cast<S>(d.b), dy = Cast<S>(d.dy),
                       dres = Cast<S>(d.dres);
  std::vector<S> y = Poisoned<S>(kRows * kC), dx = Poisoned<S>(kRows * kC), dw = Poisoned<S>(kC),
                 db = Poisoned<S>(kC);
  std::vector<F> mean(kRows), rstd(kRows);
  LayerNormForward<S>(x.data(), w.data(), b.data(), eps, kRows, kC, y.data(), mean.data(),
                      rstd.data());
  LayerNormBackward<S>(x.data(), w.data(), mean.data(), rstd.data(), dy.data(),
                       residual ? dres.data() : nullptr, kRows, kC, dx.data(), dw.data(),
                       db.data());
  return {ToDoubles(y), ToDoubles(dx), ToDoubles(dw), ToDoubles(db)};
}

TEST(LayerNormOp, DoubleForwardMatchesTheScalarReferenceForTheGivenEps) {
  const Data d = MakeData(1);
  for (double eps : {1e-5, 0.5}) {
    ExpectNearReference("y eps=" + std::to_string(eps), RunOp<double>(d, eps, false).y,
                        ForwardReference(d, eps));
  }
  // eps is used: a large eps changes the result.
  EXPECT_NE(RunOp<double>(d, 1e-5, false).y, RunOp<double>(d, 0.5, false).y);
}

// The gradient of sum(y * dy) by central differences, in double.
TEST(LayerNormOp, DoubleBackwardMatchesCentralDifferences) {
  const double eps = 1e-5, h = 1e-5;
  Data d = MakeData(2);
  const Result<double> r = RunOp<double>(d, eps, /*residual=*/true);
  auto objective = [&](const Data& dd) {
    const std::vector<double> y = ForwardReference(dd, eps);
    double sum = 0;
    for (size_t i = 0; i < y.size(); ++i) sum += y[i] * dd.dy[i];
    return sum;
  };
  auto numeric = [&](std::vector<double>& v, size_t i) {
    const double saved = v[i];
    v[i] = saved + h;
    const double up = objective(d);
    v[i] = saved - h;
    const double down = objective(d);
    v[i] = saved;
    return (up - down) / (2 * h);
  };
  std::vector<double> dx_num(kRows * kC), dw_num(kC), db_num(kC);
  for (size_t i = 0; i < dx_num.size(); ++i) dx_num[i] = numeric(d.x, i) + d.dres[i];
  for (size_t i = 0; i < dw_num.size(); ++i) dw_num[i] = numeric(d.w, i);
  for (size_t i = 0; i < db_num.size(); ++i) db_num[i] = numeric(d.b, i);
  ExpectWithinBound("dx", r.dx, dx_num, 1, 1e-7);
  ExpectWithinBound("dw", r.dw, dw_num, 1, 1e-7);
  ExpectWithinBound("db", r.db, db_num, 1, 1e-7);
}

template <typename S>
class LayerNormOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(LayerNormOpTest, StorageTypes);

// y: one rounding after fp32 statistics over C; dx: one rounding after fp32 row sums over C;
// dw, db: one rounding after fp32 column sums over the rows.
TYPED_TEST(LayerNormOpTest, ForwardAndBackwardAreWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const Data d = MakeData(3);
  const Data rd{Rounded<S>(d.x), Rounded<S>(d.w), Rounded<S>(d.b), Rounded<S>(d.dy),
                Rounded<S>(d.dres)};
  for (bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "with residual gradient" : "without residual gradient");
    const Result<S> got = RunOp<S>(d, 1e-5, residual);
    const Result<double> ref = RunOp<double>(rd, 1e-5, residual);
    ExpectWithinBound("y", got.y, ref.y, 2, BoundEps<S>(kC));
    ExpectWithinBound("dx", got.dx, ref.dx, 2, BoundEps<S>(2 * kC));
    ExpectWithinBound("dw", got.dw, ref.dw, 2, BoundEps<S>(kRows));
    ExpectWithinBound("db", got.db, ref.db, 2, BoundEps<S>(kRows));
  }
}

// dx may be dy's or dresidual's buffer; null dw/db leave dx unchanged.
TYPED_TEST(LayerNormOpTest, InPlaceInputGradientEqualsTheSeparateOne) {
  using S = TypeParam;
  using F = ComputeType<S>;
  const Data d = MakeData(4);
  const std::vector<S> x = Cast<S>(d.x), w = Cast<S>(d.w), b = Cast<S>(d.b), dy = Cast<S>(d.dy),
                       dres = Cast<S>(d.dres);
  std::vector<S> y(kRows * kC);
  std::vector<F> mean(kRows), rstd(kRows);
  LayerNormForward<S>(x.data(), w.data(), b.data(), 1e-5, kRows, kC, y.data(), mean.data(),
                      rstd.data());
  std::vector<S> dx = Poisoned<S>(kRows * kC), dw(kC), db(kC);
  LayerNormBackward<S>(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), dres.data(), kRows,
                       kC, dx.data(), dw.data(), db.data());
  std::vector<S> in_dy = dy, in_dw(kC), in_db(kC);
  LayerNormBackward<S>(x.data(), w.data(), mean.data(), rstd.data(), in_dy.data(), dres.data(),
                       kRows, kC, in_dy.data(), in_dw.data(), in_db.data());
  EXPECT_TRUE(SameBits(in_dy, dx));
  EXPECT_TRUE(SameBits(in_dw, dw));
  EXPECT_TRUE(SameBits(in_db, db));
  std::vector<S> in_res = dres;
  LayerNormBackward<S>(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), in_res.data(),
                       kRows, kC, in_res.data(), nullptr, nullptr);
  EXPECT_TRUE(SameBits(in_res, dx));
}

}  // namespace
}  // namespace strata::models::ops
