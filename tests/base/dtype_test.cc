#include "base/dtype.h"

#include <cmath>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace strata {
namespace {

// Reference rounding in double: the representable 16-bit neighbours of x, nearest,
// ties to even mantissa.
template <typename ToF, typename FromF>
uint16_t NearestByScan(float x, ToF to_float, FromF from_float) {
  const uint16_t guess = from_float(x);
  uint16_t best = guess;
  double best_err = std::abs(static_cast<double>(to_float(guess)) - x);
  for (int d = -2; d <= 2; ++d) {
    const uint16_t c = static_cast<uint16_t>(guess + d);
    const float cf = to_float(c);
    if (std::isnan(cf) || std::isinf(cf) || std::signbit(cf) != std::signbit(x)) continue;
    const double err = std::abs(static_cast<double>(cf) - x);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

TEST(DType, Bf16RoundsToNearestEvenOnRandomValues) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(bits(rng));
    if (!std::isfinite(x) || std::abs(x) > 3.0e38f) continue;
    EXPECT_EQ(FloatToBf16(x), NearestByScan(x, Bf16ToFloat, FloatToBf16)) << x;
  }
}

TEST(DType, HalfRoundTripsEveryFiniteHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

TEST(DType, HalfRoundsToNearestEvenIncludingDenormals) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> mag(-30.f, 16.f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(mag(rng)) * ((i & 1) ? -1.f : 1.f);
    EXPECT_EQ(FloatToHalf(x), NearestByScan(x, HalfToFloat, FloatToHalf)) << x;
  }
  EXPECT_EQ(FloatToHalf(65504.f), 0x7bffu);
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00u);  // ties away from max round to inf
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00u);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00u);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
}

}  // namespace
}  // namespace strata
