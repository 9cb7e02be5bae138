// models/ops/matmul.h: the linear layer's product and gradients in both weight layouts, the
// double instantiation against a scalar reference and every storage type against double.
#include "models/ops/matmul.h"

#include <gtest/gtest.h>

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
using testing::ToDoubles;

// Odd sizes: no dimension a multiple of any GEMM tile or column block.
constexpr int64_t kRows = 37, kIn = 29, kOut = 67;

// W[i][o] of a weight stored in `layout`.
double WeightAt(const std::vector<double>& w, WeightLayout layout, int64_t i, int64_t o) {
  return layout == WeightLayout::kInOut ? w[i * kOut + o] : w[o * kIn + i];
}

std::string LayoutName(WeightLayout l) { return l == WeightLayout::kInOut ? "in_out" : "out_in"; }

struct Data {
  std::vector<double> in, w, bias, residual, dout;
};

Data MakeData(uint64_t seed) {
  // Weights scaled to unit-variance outputs.
  return {RandomDoubles(kRows * kIn, seed), RandomDoubles(kIn * kOut, seed + 1, 0.3),
          RandomDoubles(kOut, seed + 2), RandomDoubles(kRows * kOut, seed + 3),
          RandomDoubles(kRows * kOut, seed + 4)};
}

std::vector<double> ForwardReference(const Data& d, WeightLayout layout, bool bias, bool residual) {
  std::vector<double> out(kRows * kOut);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t o = 0; o < kOut; ++o) {
      double v = 0;
      for (int64_t i = 0; i < kIn; ++i) v += d.in[r * kIn + i] * WeightAt(d.w, layout, i, o);
      if (bias) v += d.bias[o];
      if (residual) v += d.residual[r * kOut + o];
      out[r * kOut + o] = v;
    }
  }
  return out;
}

template <typename S>
std::vector<double> Forward(const Data& d, WeightLayout layout, bool bias, bool residual) {
  const std::vector<S> in = Cast<S>(d.in), w = Cast<S>(d.w), b = Cast<S>(d.bias),
                       res = Cast<S>(d.residual);
  std::vector<S> out = Poisoned<S>(kRows * kOut);
  MatmulForward<S>(in.data(), w.data(), layout, bias ? b.data() : nullptr, out.data(), kRows, kIn,
                   kOut, residual ? res.data() : nullptr);
  return ToDoubles(out);
}

template <typename S>
class MatmulOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(MatmulOpTest, StorageTypes);

TEST(MatmulOp, DoubleForwardMatchesTheScalarReferenceInBothLayouts) {
  const Data d = MakeData(1);
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    for (int mask = 0; mask < 4; ++mask) {
      const bool bias = mask & 1, residual = mask & 2;
      ExpectNearReference(LayoutName(layout) + " bias=" + std::to_string(bias) +
                              " residual=" + std::to_string(residual),
                          Forward<double>(d, layout, bias, residual),
                          ForwardReference(d, layout, bias, residual));
    }
  }
}

TYPED_TEST(MatmulOpTest, ForwardIsWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const Data d = MakeData(2);
  // The double reference on the S-rounded inputs; one rounding, an fp32 sum of kIn + 2 terms.
  Data rd{Rounded<S>(d.in), Rounded<S>(d.w), Rounded<S>(d.bias), Rounded<S>(d.residual), {}};
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    for (int mask = 0; mask < 4; ++mask) {
      const bool bias = mask & 1, residual = mask & 2;
      ExpectWithinBound(LayoutName(layout) + " mask=" + std::to_string(mask),
                        Forward<S>(d, layout, bias, residual),
                        Forward<double>(rd, layout, bias, residual), 2, BoundEps<S>(kIn + 2));
    }
  }
}

TYPED_TEST(MatmulOpTest, ResidualMayAliasTheOutput) {
  using S = TypeParam;
  const Data d = MakeData(3);
  const std::vector<S> in = Cast<S>(d.in), w = Cast<S>(d.w), b = Cast<S>(d.bias);
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    std::vector<S> separate = Poisoned<S>(kRows * kOut);
    const std::vector<S> res = Cast<S>(d.residual);
    MatmulForward<S>(in.data(), w.data(), layout, b.data(), separate.data(), kRows, kIn, kOut,
                     res.data());
    std::vector<S> aliased = res;
    MatmulForward<S>(in.data(), w.data(), layout, b.data(), aliased.data(), kRows, kIn, kOut,
                     aliased.data());
    EXPECT_TRUE(testing::SameBits(aliased, separate)) << LayoutName(layout);
  }
}

struct Grads {
  std::vector<double> din, dw, db;
};

Grads BackwardReference(const Data& d, WeightLayout layout) {
  Grads g{std::vector<double>(kRows * kIn, 0.0), std::vector<double>(kIn * kOut, 0.0),
          std::vector<double>(kOut, 0.0)};
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t o = 0; o < kOut; ++o) {
      const double dy = d.dout[r * kOut + o];
      g.db[o] += dy;
      for (int64_t i = 0; i < kIn; ++i) {
        g.din[r * kIn + i] += dy * WeightAt(d.w, layout, i, o);
        const int64_t wi = layout == WeightLayout::kInOut ? i * kOut + o : o * kIn + i;
        g.dw[wi] += d.in[r * kIn + i] * dy;
      }
    }
  }
  return g;
}

template <typename S>
Grads Backward(const Data& d, WeightLayout layout) {
  const std::vector<S> in = Cast<S>(d.in), w = Cast<S>(d.w), dout = Cast<S>(d.dout);
  std::vector<S> din = Poisoned<S>(kRows * kIn), dw = Poisoned<S>(kIn * kOut),
                 db = Poisoned<S>(kOut);
  MatmulBackward<S>(in.data(), w.data(), layout, dout.data(), din.data(), dw.data(), db.data(),
                    kRows, kIn, kOut);
  return {ToDoubles(din), ToDoubles(dw), ToDoubles(db)};
}

TEST(MatmulOp, DoubleBackwardMatchesTheScalarReferenceInBothLayouts) {
  const Data d = MakeData(4);
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    const Grads got = Backward<double>(d, layout), ref = BackwardReference(d, layout);
    ExpectNearReference(LayoutName(layout) + " din", got.din, ref.din);
    ExpectNearReference(LayoutName(layout) + " dw", got.dw, ref.dw);
    ExpectNearReference(LayoutName(layout) + " db", got.db, ref.db);
  }
}

TYPED_TEST(MatmulOpTest, BackwardIsWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const Data d = MakeData(5);
  const Data rd{Rounded<S>(d.in), Rounded<S>(d.w), {}, {}, Rounded<S>(d.dout)};
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    const Grads got = Backward<S>(d, layout), ref = Backward<double>(rd, layout);
    ExpectWithinBound(LayoutName(layout) + " din", got.din, ref.din, 2, BoundEps<S>(kOut));
    ExpectWithinBound(LayoutName(layout) + " dw", got.dw, ref.dw, 2, BoundEps<S>(kRows));
    ExpectWithinBound(LayoutName(layout) + " db", got.db, ref.db, 2, BoundEps<S>(kRows));
  }
}

TYPED_TEST(MatmulOpTest, NullGradientsAreNotComputedAndTheOthersDoNotChange) {
  using S = TypeParam;
  const Data d = MakeData(6);
  const std::vector<S> in = Cast<S>(d.in), w = Cast<S>(d.w), dout = Cast<S>(d.dout);
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    std::vector<S> din = Poisoned<S>(kRows * kIn), dw = Poisoned<S>(kIn * kOut),
                   db = Poisoned<S>(kOut);
    MatmulBackward<S>(in.data(), w.data(), layout, dout.data(), din.data(), dw.data(), db.data(),
                      kRows, kIn, kOut);
    std::vector<S> din_only = Poisoned<S>(kRows * kIn);
    // Only din: in is not read (null).
    MatmulBackward<S>(nullptr, w.data(), layout, dout.data(), din_only.data(), nullptr, nullptr,
                      kRows, kIn, kOut);
    EXPECT_TRUE(testing::SameBits(din_only, din)) << LayoutName(layout);
    std::vector<S> dw_only = Poisoned<S>(kIn * kOut);
    // Only dw: w is not read (null).
    MatmulBackward<S>(in.data(), nullptr, layout, dout.data(), nullptr, dw_only.data(), nullptr,
                      kRows, kIn, kOut);
    EXPECT_TRUE(testing::SameBits(dw_only, dw)) << LayoutName(layout);
  }
}

}  // namespace
}  // namespace strata::models::ops
