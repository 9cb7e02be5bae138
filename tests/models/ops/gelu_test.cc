// models/ops/gelu.h: GELU (tanh approximation) and its fusions with the matrix product, the
// double instantiation against std::tanh and every storage type against double.
#include "models/ops/gelu.h"

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

double GeluRef(double v) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
}

double GeluGradRef(double v) {
  const double k = std::sqrt(2.0 / M_PI);
  const double th = std::tanh(k * (v + 0.044715 * v * v * v));
  return 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * v * v);
}

// Odd length: the last vector group is partial.
constexpr int64_t kN = 1237;

template <typename S>
std::vector<double> Forward(const std::vector<double>& h) {
  const std::vector<S> hs = Cast<S>(h);
  std::vector<S> g = Poisoned<S>(h.size());
  GeluForward<S>(hs.data(), static_cast<int64_t>(h.size()), g.data());
  return ToDoubles(g);
}

template <typename S>
std::vector<double> Backward(const std::vector<double>& h, const std::vector<double>& dg) {
  const std::vector<S> hs = Cast<S>(h), dgs = Cast<S>(dg);
  std::vector<S> dh = Poisoned<S>(h.size());
  GeluBackward<S>(hs.data(), dgs.data(), static_cast<int64_t>(h.size()), dh.data());
  return ToDoubles(dh);
}

TEST(GeluOp, DoubleMatchesTheFormulaForwardAndBackward) {
  const std::vector<double> h = RandomDoubles(kN, 1, 4.0), dg = RandomDoubles(kN, 2);
  std::vector<double> g_ref(kN), dh_ref(kN);
  for (int64_t i = 0; i < kN; ++i) {
    g_ref[i] = GeluRef(h[i]);
    dh_ref[i] = dg[i] * GeluGradRef(h[i]);
  }
  ExpectNearReference("gelu", Forward<double>(h), g_ref);
  ExpectNearReference("gelu'", Backward<double>(h, dg), dh_ref);
}

template <typename S>
class GeluOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(GeluOpTest, StorageTypes);

// One rounding of an fp32 value computed with fp32 tanh (a few ulps) and, in gelu', the
// cancellation of 0.5 (1 + th) against 0.5 v (1 - th^2) du near gelu''s zero, whose terms are
// O(1) while the result is small: an fp32 budget of 64 ulps of the tensor's scale.
TYPED_TEST(GeluOpTest, ForwardAndBackwardAreWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const std::vector<double> h = RandomDoubles(kN, 3, 4.0), dg = RandomDoubles(kN, 4);
  const std::vector<double> hr = Rounded<S>(h), dgr = Rounded<S>(dg);
  ExpectWithinBound("gelu", Forward<S>(h), Forward<double>(hr), 2, BoundEps<S>(16));
  ExpectWithinBound("gelu'", Backward<S>(h, dg), Backward<double>(hr, dgr), 2, BoundEps<S>(64));
}

// An element's result does not depend on where it sits in the range (the same vector code
// path for every element), nor does the in-place form differ.
TYPED_TEST(GeluOpTest, ResultOfAnElementDoesNotDependOnItsOffsetOrOnAliasing) {
  using S = TypeParam;
  const std::vector<S> h = Cast<S>(RandomDoubles(kN, 5, 4.0));
  std::vector<S> whole = Poisoned<S>(kN), shifted = Poisoned<S>(kN - 3);
  GeluForward<S>(h.data(), kN, whole.data());
  GeluForward<S>(h.data() + 3, kN - 3, shifted.data());
  EXPECT_TRUE(SameBits(shifted, std::vector<S>(whole.begin() + 3, whole.end())));
  std::vector<S> in_place = h;
  GeluForward<S>(in_place.data(), kN, in_place.data());
  EXPECT_TRUE(SameBits(in_place, whole));
}

constexpr int64_t kRows = 23, kIn = 19, kOut = 45;

template <typename S>
struct FusedResult {
  std::vector<S> pre, g, dpre, dw, db;
};

// The MLP's pair: [pre, g] = gelu-fused product of in (rows, in) with W (in, out) (layout given),
// then the backward of a second product out2 = g W2 (+ b2), W2 (out, in) in layout terms of a
// layer with kOut inputs and kIn outputs, through the fused DGELU.
template <typename S>
FusedResult<S> Fused(WeightLayout layout, uint64_t seed) {
  const std::vector<S> in = Cast<S>(RandomDoubles(kRows * kIn, seed)),
                       w = Cast<S>(RandomDoubles(kIn * kOut, seed + 1, 0.4)),
                       b = Cast<S>(RandomDoubles(kOut, seed + 2)),
                       w2 = Cast<S>(RandomDoubles(kOut * kIn, seed + 3, 0.3)),
                       dout = Cast<S>(RandomDoubles(kRows * kIn, seed + 4));
  FusedResult<S> r{Poisoned<S>(kRows * kOut), Poisoned<S>(kRows * kOut), Poisoned<S>(kRows * kOut),
                   Poisoned<S>(kOut * kIn), Poisoned<S>(kIn)};
  MatmulGeluForward<S>(in.data(), w.data(), layout, b.data(), r.pre.data(), r.g.data(), kRows, kIn,
                       kOut);
  MatmulGeluBackward<S>(r.g.data(), w2.data(), layout, dout.data(), r.pre.data(), r.dpre.data(),
                        r.dw.data(), r.db.data(), kRows, kOut, kIn);
  return r;
}

// pre is MatmulForward's result bit for bit; g = S(gelu(fp32 pre before rounding)); dpre =
// S((dout W2^T) gelu'(pre)); dW2, db2 are MatmulBackward's bit for bit.
TYPED_TEST(GeluOpTest, FusedProductsAgreeWithTheUnfusedOpsAndWithDouble) {
  using S = TypeParam;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    SCOPED_TRACE(layout == WeightLayout::kInOut ? "in_out" : "out_in");
    const uint64_t seed = 7;
    const std::vector<S> in = Cast<S>(RandomDoubles(kRows * kIn, seed)),
                         w = Cast<S>(RandomDoubles(kIn * kOut, seed + 1, 0.4)),
                         b = Cast<S>(RandomDoubles(kOut, seed + 2)),
                         w2 = Cast<S>(RandomDoubles(kOut * kIn, seed + 3, 0.3)),
                         dout = Cast<S>(RandomDoubles(kRows * kIn, seed + 4));
    const FusedResult<S> f = Fused<S>(layout, seed);
    std::vector<S> pre = Poisoned<S>(kRows * kOut);
    MatmulForward<S>(in.data(), w.data(), layout, b.data(), pre.data(), kRows, kIn, kOut);
    EXPECT_TRUE(SameBits(f.pre, pre));
    std::vector<S> dg = Poisoned<S>(kRows * kOut), dw = Poisoned<S>(kOut * kIn),
                   db = Poisoned<S>(kIn);
    MatmulBackward<S>(f.g.data(), w2.data(), layout, dout.data(), dg.data(), dw.data(), db.data(),
                      kRows, kOut, kIn);
    EXPECT_TRUE(SameBits(f.dw, dw));
    EXPECT_TRUE(SameBits(f.db, db));

    // Against double on the same S inputs: g from the unrounded pre-activation (the double
    // reference of pre, before rounding), dpre from the S pre.
    const std::vector<double> ind = ToDoubles(in), wd = ToDoubles(w), bd = ToDoubles(b),
                              w2d = ToDoubles(w2), doutd = ToDoubles(dout);
    std::vector<double> pre_d(kRows * kOut), g_d(kRows * kOut);
    MatmulGeluForward<double>(ind.data(), wd.data(), layout, bd.data(), pre_d.data(), g_d.data(),
                              kRows, kIn, kOut);
    ExpectWithinBound("g", ToDoubles(f.g), g_d, 2, BoundEps<S>(kIn + 16));
    const std::vector<double> pre_s = ToDoubles(f.pre), g_s = ToDoubles(f.g);
    std::vector<double> dpre_d(kRows * kOut);
    MatmulGeluBackward<double>(g_s.data(), w2d.data(), layout, doutd.data(), pre_s.data(),
                               dpre_d.data(), nullptr, nullptr, kRows, kOut, kIn);
    ExpectWithinBound("dpre", ToDoubles(f.dpre), dpre_d, 2, BoundEps<S>(kIn + 64));
    // The double fusion itself: g = gelu(pre) exactly as the formula.
    std::vector<double> g_formula(kRows * kOut);
    for (size_t i = 0; i < g_formula.size(); ++i) g_formula[i] = GeluRef(pre_d[i]);
    ExpectNearReference("double g", g_d, g_formula);
  }
}

}  // namespace
}  // namespace strata::models::ops
