// models/ops/rms_norm.h: the double instantiation against the formula written here, its
// backward against central finite differences, and every storage type against the double
// instantiation on the same rounded inputs. unit_offset (Gemma's multiplier 1 + w): every storage
// type against a double reference written here (y, rstd, dx with and without the residual, dw),
// and bit for bit the op without the option given the weights 1 + w where those are exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "models/ops/host_ops.h"
#include "models/ops/rms_norm.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/terms_bound.h"

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

// y = x / sqrt(mean(x^2) + eps) * m, straight from the definition; the multiplier m = w, or
// 1 + w with unit_offset.
std::vector<double> Reference(const std::vector<double>& x, const std::vector<double>& w,
                              int64_t rows, int64_t C, bool unit_offset = false) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[r * C + c] * x[r * C + c] / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double m = unit_offset ? 1.0 + w[c] : w[c];
      y[r * C + c] = x[r * C + c] / std::sqrt(ms + kEpsRms) * m;
    }
  }
  return y;
}

// Around 1 as trained norms are; with unit_offset (Gemma, whose stored weight is the
// multiplier's offset from 1) around 0, in [-0.5, 0.5].
std::vector<double> Weights(int64_t C, uint64_t seed, bool unit_offset = false) {
  if (unit_offset) return RandomValues(C, 0.5, seed);
  std::vector<double> w = RandomValues(C, 0.3, seed);
  for (double& v : w) v += 1.0;
  return w;
}

// Gemma's RMSNorm (Hugging Face Gemma3RMSNorm) forward and backward in double from the
// definition, with the magnitudes of the terms that cancel (tests/models/terms_bound.h):
//   rstd = 1 / sqrt(mean(x^2) + eps), xhat = x rstd, y = xhat (1 + w),
//   dx = dres + rstd (g - xhat mean(g xhat)), g = dy (1 + w),  dw = sum over rows of dy xhat.
// dres empty: no residual gradient.
struct OffsetRef {
  std::vector<double> y, rstd, dx, dx_terms, dw, dw_terms;
};
OffsetRef UnitOffsetReference(const std::vector<double>& x, const std::vector<double>& w,
                              const std::vector<double>& dy, const std::vector<double>& dres,
                              int64_t rows, int64_t C) {
  OffsetRef ref;
  ref.y.assign(rows * C, 0.0);
  ref.rstd.assign(rows, 0.0);
  ref.dx.assign(rows * C, 0.0);
  ref.dx_terms.assign(rows * C, 0.0);
  ref.dw.assign(C, 0.0);
  ref.dw_terms.assign(C, 0.0);
  const double n = static_cast<double>(C);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * C;
    const double* dyr = dy.data() + r * C;
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += xr[c] * xr[c] / n;
    const double s = 1.0 / std::sqrt(ms + kEpsRms);
    ref.rstd[r] = s;
    double mean_gx = 0, mean_abs_gx = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double gx = dyr[c] * (1.0 + w[c]) * xr[c] * s;
      mean_gx += gx / n;
      mean_abs_gx += std::abs(gx) / n;
    }
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = r * C + c;
      const double xhat = xr[c] * s, g = dyr[c] * (1.0 + w[c]);
      const double res = dres.empty() ? 0.0 : dres[i];
      ref.y[i] = xhat * (1.0 + w[c]);
      ref.dx[i] = res + s * (g - xhat * mean_gx);
      ref.dx_terms[i] = std::abs(res) + s * (std::abs(g) + std::abs(xhat) * mean_abs_gx);
      ref.dw[c] += dyr[c] * xhat;
      ref.dw_terms[c] += std::abs(dyr[c] * xhat);
    }
  }
  return ref;
}

template <typename S>
std::vector<uint8_t> Bits(const std::vector<S>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(S));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
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

// L = sum(dy * y(x, w)) + sum(dres * x): dL/dx = RMS'(dy) + dres, dL/dw = sum dy xhat; with and
// without unit_offset (the multiplier 1 + w).
TEST(RmsNormOp, DoubleBackwardMatchesCentralFiniteDifferences) {
  for (const bool unit_offset : {false, true}) {
    for (const Dims& d : kDims) {
      SCOPED_TRACE(unit_offset ? "unit_offset" : "plain");
      const int64_t n = d.rows * d.C;
      std::vector<double> x = RandomValues(n, 2.0, 3);
      std::vector<double> w = Weights(d.C, 4, unit_offset);
      const std::vector<double> dy = RandomValues(n, 1.0, 5);
      const std::vector<double> dres = RandomValues(n, 1.0, 6);
      auto loss = [&] {
        const std::vector<double> y = Reference(x, w, d.rows, d.C, unit_offset);
        double l = 0;
        for (int64_t i = 0; i < n; ++i) l += dy[i] * y[i] + dres[i] * x[i];
        return l;
      };
      std::vector<double> y(n), rstd(d.rows), dx = Poisoned<double>(n), dw = Poisoned<double>(d.C);
      RmsNormForward<double>(x.data(), w.data(), kEpsRms, d.rows, d.C, y.data(), rstd.data(),
                             unit_offset);
      RmsNormBackward<double>(x.data(), w.data(), rstd.data(), dy.data(), dres.data(), d.rows, d.C,
                              dx.data(), dw.data(), unit_offset);
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

// unit_offset (Gemma): each storage type against the double reference on the same S-rounded
// inputs, the backward with and without the residual gradient. Bounds as above: rstd an F sum of
// C squares, never rounded; y rstd's error and one rounding; dx two F sums of C terms, the
// residual added and one rounding, relative to the terms that cancel in g - xhat mean(g xhat);
// dw an F sum over the rows and one rounding, relative to the sum of |dy xhat|.
template <typename S>
class RmsNormUnitOffsetTest : public ::testing::Test {};
using AllStorageTypes = ::testing::Types<float, double, Bf16, Fp16>;
TYPED_TEST_SUITE(RmsNormUnitOffsetTest, AllStorageTypes);

TYPED_TEST(RmsNormUnitOffsetTest, AgreesWithTheDoubleReferenceElementByElement) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const Dims& d : kDims) {
    for (const bool with_residual : {false, true}) {
      const std::string tag =
          " C=" + std::to_string(d.C) + (with_residual ? " with dres" : " without dres");
      const int64_t n = d.rows * d.C;
      const std::vector<double> x = Rounded<S>(RandomValues(n, 2.0, 30));
      const std::vector<double> w = Rounded<S>(Weights(d.C, 31, /*unit_offset=*/true));
      const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 32));
      const std::vector<double> dres =
          with_residual ? Rounded<S>(RandomValues(n, 1.0, 33)) : std::vector<double>{};
      const OffsetRef ref = UnitOffsetReference(x, w, dy, dres, d.rows, d.C);

      const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy);
      const std::vector<S> dress = Cast<S>(dres);
      std::vector<S> ys = Poisoned<S>(n), dxs = Poisoned<S>(n), dws = Poisoned<S>(d.C);
      std::vector<F> rstds(d.rows);
      RmsNormForward<S>(xs.data(), ws.data(), kEpsRms, d.rows, d.C, ys.data(), rstds.data(),
                        /*unit_offset=*/true);
      RmsNormBackward<S>(xs.data(), ws.data(), rstds.data(), dys.data(),
                         with_residual ? dress.data() : nullptr, d.rows, d.C, dxs.data(),
                         dws.data(), /*unit_offset=*/true);
      ExpectWithinBound("rstd" + tag, ToDoubles(rstds), ref.rstd, 2, Eps<F>(d.C));
      ExpectWithinBound("y" + tag, ToDoubles(ys), ref.y, 2, Eps<S>(d.C));
      terms_bound::ExpectWithinTermsBound("dx" + tag, ToDoubles(dxs), ref.dx, ref.dx_terms, 4,
                                          Eps<S>(2 * d.C));
      terms_bound::ExpectWithinTermsBound("dw" + tag, ToDoubles(dws), ref.dw, ref.dw_terms, 2,
                                          Eps<S>(d.rows + d.C));
    }
  }
}

// The offset is added in the compute type: with w a multiple of 1/64 in [-0.5, 0.5], 1 + w is
// exact in every storage type (at most 7 significant bits), so unit_offset with w and the plain
// op with the stored weights 1 + w compute the same values in the same order: y, rstd, dx and dw
// bit for bit (dw never reads w).
TYPED_TEST(RmsNormUnitOffsetTest, EqualsThePlainOpWithWeightsOnePlusWBitForBit) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const Dims& d : kDims) {
    SCOPED_TRACE("C=" + std::to_string(d.C));
    const int64_t n = d.rows * d.C;
    std::vector<double> w = RandomValues(d.C, 32.0, 40);
    for (double& v : w) v = std::round(v) / 64.0;
    std::vector<double> one_plus_w = w;
    for (double& v : one_plus_w) v += 1.0;
    const std::vector<S> ws = Cast<S>(w), ws1 = Cast<S>(one_plus_w);
    ASSERT_EQ(ToDoubles(ws), w) << "w is exact in S";
    ASSERT_EQ(ToDoubles(ws1), one_plus_w) << "1 + w is exact in S";
    const std::vector<S> xs = Cast<S>(RandomValues(n, 2.0, 41));
    const std::vector<S> dys = Cast<S>(RandomValues(n, 1.0, 42));
    const std::vector<S> dress = Cast<S>(RandomValues(n, 1.0, 43));

    auto run = [&](const std::vector<S>& weights, bool unit_offset) {
      struct Out {
        std::vector<S> y, dx, dw;
        std::vector<F> rstd;
      } o{std::vector<S>(n), std::vector<S>(n), std::vector<S>(d.C), std::vector<F>(d.rows)};
      RmsNormForward<S>(xs.data(), weights.data(), kEpsRms, d.rows, d.C, o.y.data(), o.rstd.data(),
                        unit_offset);
      RmsNormBackward<S>(xs.data(), weights.data(), o.rstd.data(), dys.data(), dress.data(), d.rows,
                         d.C, o.dx.data(), o.dw.data(), unit_offset);
      return o;
    };
    const auto offset = run(ws, true);
    const auto plain = run(ws1, false);
    EXPECT_EQ(Bits(offset.y), Bits(plain.y));
    EXPECT_EQ(Bits(offset.rstd), Bits(plain.rstd));
    EXPECT_EQ(Bits(offset.dx), Bits(plain.dx));
    EXPECT_EQ(Bits(offset.dw), Bits(plain.dw));
  }
}

// HostOps<S> passes unit_offset through to the op.
TEST(RmsNormOp, HostOpsAdapterPassesUnitOffset) {
  const Dims d{19, 67};
  const int64_t n = d.rows * d.C;
  const std::vector<Bf16> xs = Cast<Bf16>(RandomValues(n, 2.0, 50));
  const std::vector<Bf16> ws = Cast<Bf16>(Weights(d.C, 51, /*unit_offset=*/true));
  const std::vector<Bf16> dys = Cast<Bf16>(RandomValues(n, 1.0, 52));
  const std::vector<Bf16> dress = Cast<Bf16>(RandomValues(n, 1.0, 53));
  std::vector<Bf16> y_op(n), y_ad(n), dx_op(n), dx_ad(n), dw_op(d.C), dw_ad(d.C);
  std::vector<float> rstd_op(d.rows), rstd_ad(d.rows);
  RmsNormForward<Bf16>(xs.data(), ws.data(), kEpsRms, d.rows, d.C, y_op.data(), rstd_op.data(),
                       true);
  RmsNormBackward<Bf16>(xs.data(), ws.data(), rstd_op.data(), dys.data(), dress.data(), d.rows, d.C,
                        dx_op.data(), dw_op.data(), true);
  const HostOps<Bf16> host;
  ASSERT_TRUE(host.RmsNormForward(xs.data(), ws.data(), kEpsRms, d.rows, d.C, y_ad.data(),
                                  rstd_ad.data(), true)
                  .ok());
  ASSERT_TRUE(host.RmsNormBackward(xs.data(), ws.data(), rstd_ad.data(), dys.data(), dress.data(),
                                   d.rows, d.C, dx_ad.data(), dw_ad.data(), true)
                  .ok());
  EXPECT_EQ(Bits(y_ad), Bits(y_op));
  EXPECT_EQ(Bits(rstd_ad), Bits(rstd_op));
  EXPECT_EQ(Bits(dx_ad), Bits(dx_op));
  EXPECT_EQ(Bits(dw_ad), Bits(dw_op));
  // And the offset matters: the plain op on the same weights differs.
  std::vector<Bf16> y_plain(n);
  ASSERT_TRUE(host.RmsNormForward(xs.data(), ws.data(), kEpsRms, d.rows, d.C, y_plain.data(),
                                  rstd_ad.data())
                  .ok());
  EXPECT_NE(Bits(y_plain), Bits(y_op));
}

}  // namespace
}  // namespace strata::models::ops
