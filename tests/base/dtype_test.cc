#include "base/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

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

// Independent references for the exhaustive checks below: each 16-bit format's value computed
// from its fields, and the nearest 16-bit value of an fp32 found in double arithmetic (exact:
// the scaling is by a power of two, the rounded result an integer of at most 12 bits).
double Fp16Value(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  const double magnitude = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return (h & 0x8000u) ? -magnitude : magnitude;
}

double Bf16Value(uint16_t h) {
  const int exp = (h >> 7) & 0xff;
  const int mant = h & 0x7f;
  const double magnitude = exp == 0 ? std::ldexp(mant, -133) : std::ldexp(128 + mant, exp - 134);
  return (h & 0x8000u) ? -magnitude : magnitude;
}

// The bits of the 16-bit format (mantissa_bits, min_normal_exp) nearest to the finite value |x|,
// ties to the even mantissa, values that round past the largest finite one to infinity
// (inf_bits). Denormals: below 2^min_normal_exp the spacing stays that of the smallest binade.
uint16_t NearestMagnitudeBits(float x, int mantissa_bits, int min_normal_exp, uint16_t inf_bits) {
  const double a = std::abs(static_cast<double>(x));
  if (a == 0) return 0;
  const int e = std::ilogb(a);
  const int quantum_exp = std::max(e, min_normal_exp) - mantissa_bits;
  const auto n = static_cast<int64_t>(std::nearbyint(std::ldexp(a, -quantum_exp)));
  // Encodings are monotonic: the denormal count runs on into the smallest normal binade, and a
  // mantissa that rounds up to the next power of two carries into the exponent.
  const int64_t bits = e < min_normal_exp ? n
                                          : (int64_t{e - min_normal_exp + 1} << mantissa_bits) +
                                                (n - (int64_t{1} << mantissa_bits));
  return static_cast<uint16_t>(std::min<int64_t>(bits, inf_bits));
}

// fp32 -> fp16 by the rules of base/dtype.h: NaN stays a quiet NaN with its sign and the top
// payload bits, the rest rounds to nearest even.
uint16_t ReferenceFloatToHalf(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u | static_cast<uint16_t>((u >> 13) & 0x3ffu);
  if (std::isinf(f)) return sign | 0x7c00u;
  return sign | NearestMagnitudeBits(f, 10, -14, 0x7c00u);
}

// fp32 -> bf16: NaN keeps its sign and top payload bits and becomes quiet.
uint16_t ReferenceFloatToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  if (std::isinf(f)) return sign | 0x7f80u;
  return sign | NearestMagnitudeBits(f, 7, -126, 0x7f80u);
}

// Every 16-bit pattern, both formats: the value of its fields; inf stays inf; NaN stays NaN with
// its sign and payload (fp16's made quiet, bf16's bits kept as they are).
TEST(DType, EverySixteenBitPatternWidensExactly) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto x = static_cast<uint16_t>(h);
    const uint32_t sign = (h & 0x8000u) << 16;
    uint32_t want_half;
    if ((h & 0x7c00u) == 0x7c00u) {  // inf or NaN
      const uint32_t mant = h & 0x3ffu;
      want_half = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
    } else {
      want_half = sign | std::bit_cast<uint32_t>(static_cast<float>(std::abs(Fp16Value(x))));
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(HalfToFloat(x)), want_half) << "fp16 0x" << std::hex << h;
    const uint32_t want_bf16 =
        (h & 0x7f80u) == 0x7f80u
            ? h << 16
            : sign | std::bit_cast<uint32_t>(static_cast<float>(std::abs(Bf16Value(x))));
    ASSERT_EQ(std::bit_cast<uint32_t>(Bf16ToFloat(x)), want_bf16) << "bf16 0x" << std::hex << h;
  }
}

// Every 61st fp32 bit pattern (70 million, all exponents, both signs, NaN payloads) plus every
// pattern next to the fp16 rounding boundaries, against the references above. These are the
// conversions the CUDA kernels run too (host and device code: gpu/cuda/cuda_kernels.cu).
TEST(DType, Fp32NarrowsToTheNearestSixteenBitValue) {
  auto check = [](uint32_t u) {
    const float f = std::bit_cast<float>(u);
    if (FloatToHalf(f) != ReferenceFloatToHalf(f)) {
      ADD_FAILURE() << "fp16 of 0x" << std::hex << u << ": " << FloatToHalf(f) << " vs "
                    << ReferenceFloatToHalf(f);
      return false;
    }
    if (FloatToBf16(f) != ReferenceFloatToBf16(f)) {
      ADD_FAILURE() << "bf16 of 0x" << std::hex << u << ": " << FloatToBf16(f) << " vs "
                    << ReferenceFloatToBf16(f);
      return false;
    }
    return true;
  };
  for (uint64_t u = 0; u <= 0xffffffffu; u += 61) {
    if (!check(static_cast<uint32_t>(u))) return;
  }
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t edge : {0x33000000u, 0x38800000u, 0x477ff000u, 0x7f800000u}) {
      for (uint32_t d = 0; d < 4096; ++d) {
        if (!check(sign | (edge - 2048 + d))) return;
      }
    }
  }
}

}  // namespace
}  // namespace strata
