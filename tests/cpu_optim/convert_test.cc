#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/grad_stats.h"
#include "cpu_optim/kernels.h"
#include "tests/cpu_optim/test_data.h"

namespace strata::cpu_optim {
namespace {

using testing::Bits;

// Floats that exercise every rounding decision of fp32 -> fp16/bf16: for each
// 16-bit value, itself, the midpoint to its successor (a tie) and the floats next
// to that midpoint, with both signs; plus random bit patterns, inf and NaN.
std::vector<float> RoundingProbes(uint16_t (*to16)(float), float (*from16)(uint16_t)) {
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x7f80u; ++h) {
    const float lo = from16(static_cast<uint16_t>(h));
    const float hi = from16(static_cast<uint16_t>(h + 1));
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    const float mid = lo + (hi - lo) * 0.5f;  // exact: 16-bit formats have spare bits in fp32
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  std::mt19937 rng(21);
  for (int i = 0; i < 300000; ++i) xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (float x : {0.0f,
                  -0.0f,
                  FLT_MAX,
                  -FLT_MAX,
                  FLT_MIN,
                  FLT_TRUE_MIN,
                  65504.0f,
                  65519.99f,
                  65520.0f,
                  0x1p-24f,
                  0x1p-25f,
                  0x1.000002p-25f,
                  0x1p-26f,
                  0x1p-14f,
                  std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(),
                  std::bit_cast<float>(0x7f800001u),
                  std::bit_cast<float>(0xffbfe001u),
                  std::bit_cast<float>(0x7fc0ffffu)}) {
    xs.push_back(x);
  }
  (void)to16;
  return xs;
}

TEST(Convert, FromF32MatchesBaseDTypeBitForBitInEveryVariant) {
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", kernels->name, DTypeName(dtype)));
      const bool half = dtype == DType::kF16;
      const std::vector<float> xs = half ? RoundingProbes(FloatToHalf, HalfToFloat)
                                         : RoundingProbes(FloatToBf16, Bf16ToFloat);
      std::vector<uint16_t> out(xs.size(), 0xdead);
      ASSERT_TRUE(internal::ConvertFromF32With(*kernels, xs.data(), out.data(), dtype,
                                               static_cast<int64_t>(xs.size()))
                      .ok());
      int64_t bad = 0;
      for (size_t i = 0; i < xs.size(); ++i) {
        const uint16_t expected = half ? FloatToHalf(xs[i]) : FloatToBf16(xs[i]);
        if (out[i] != expected && bad++ < 5) {
          ADD_FAILURE() << fmt::format("{:a} ({:#010x}) -> {:#06x}, base gives {:#06x}", xs[i],
                                       Bits(xs[i]), out[i], expected);
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(Convert, ToF32MatchesBaseDTypeForAllSixtyFiveThousandPatterns) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", kernels->name, DTypeName(dtype)));
      std::vector<float> out(all.size());
      ASSERT_TRUE(internal::ConvertToF32With(*kernels, all.data(), dtype, out.data(), 65536).ok());
      int64_t bad = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        const float expected = dtype == DType::kF16 ? HalfToFloat(all[i]) : Bf16ToFloat(all[i]);
        if (Bits(out[i]) != Bits(expected) && bad++ < 5) {
          ADD_FAILURE() << fmt::format("{:#06x} -> {:#010x}, base gives {:#010x}", i, Bits(out[i]),
                                       Bits(expected));
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// Hand-derived IEEE 754 answers, independent of base/dtype.h: NaN quieting and payloads,
// signed zeros, fp16 denormals, ties to even, overflow to inf.
TEST(Convert, F16SpecialValuesGiveTheIeeeBitsInEveryVariant) {
  struct ToF32Case {
    uint16_t h;
    uint32_t f;
  };
  const ToF32Case to_f32[] = {
      {0x0000, 0x00000000u}, {0x8000, 0x80000000u},  // signed zeros
      {0x0001, 0x33800000u}, {0x8001, 0xb3800000u},  // smallest denormal: 2^-24
      {0x03ff, 0x387fc000u},                         // largest denormal
      {0x0400, 0x38800000u},                         // smallest normal: 2^-14
      {0x7bff, 0x477fe000u},                         // 65504
      {0x7c00, 0x7f800000u}, {0xfc00, 0xff800000u},  // infinities
      {0x7c01, 0x7fc02000u},                         // signaling NaN: quieted, payload kept
      {0xfd55, 0xffeaa000u},                         // negative signaling NaN
      {0x7e00, 0x7fc00000u}, {0xffff, 0xffffe000u},  // quiet NaNs
  };
  struct FromF32Case {
    uint32_t f;
    uint16_t h;
  };
  const FromF32Case from_f32[] = {
      {0x00000000u, 0x0000}, {0x80000000u, 0x8000},  // signed zeros
      {0x00000001u, 0x0000}, {0x807fffffu, 0x8000},  // fp32 denormals round to signed zero
      {0x33000000u, 0x0000},                         // 2^-25: tie, to even (zero)
      {0x33000001u, 0x0001},                         // just above the tie
      {0x33c00000u, 0x0002},                         // 3 * 2^-25: tie, to even (2)
      {0x387fc000u, 0x03ff},                         // largest denormal
      {0x387fe000u, 0x0400},                         // tie between it and 2^-14: to even
      {0x3f801000u, 0x3c00},                         // 1 + 2^-11: tie, to even (1)
      {0x3f803000u, 0x3c02},                         // 1 + 3 * 2^-11: tie, to even
      {0x477fe000u, 0x7bff},                         // 65504
      {0x477fefffu, 0x7bff},                         // just below 65520
      {0x477ff000u, 0x7c00},                         // 65520: tie, rounds to inf
      {0xc77ff000u, 0xfc00},                         // -65520
      {0x7f7fffffu, 0x7c00},                         // FLT_MAX
      {0x7f800000u, 0x7c00}, {0xff800000u, 0xfc00},  // infinities
      {0x7f800001u, 0x7e00},                         // signaling NaN, payload below fp16's: quieted
      {0x7f802000u, 0x7e01},  // signaling NaN: top 10 payload bits kept, quieted
      {0xffbfe000u, 0xffff},  // negative signaling NaN, all fp16 payload bits
      {0x7fc00000u, 0x7e00}, {0xffffffffu, 0xffff},  // quiet NaNs
  };
  // Each value in 35 copies: two full 16-wide (or four 8-wide) vectors and a scalar tail.
  constexpr int64_t kCopies = 35;
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    SCOPED_TRACE(kernels->name);
    for (const ToF32Case& c : to_f32) {
      const std::vector<uint16_t> h(kCopies, c.h);
      std::vector<float> f(kCopies, 0.0f);
      kernels->to_f32(h.data(), DType::kF16, f.data(), 0, kCopies);
      for (int64_t i = 0; i < kCopies; ++i) {
        EXPECT_EQ(Bits(f[i]), c.f) << fmt::format("{:#06x} at {}", c.h, i);
      }
      EXPECT_EQ(Bits(HalfToFloat(c.h)), c.f) << fmt::format("base/dtype.h, {:#06x}", c.h);
    }
    for (const FromF32Case& c : from_f32) {
      const std::vector<float> f(kCopies, std::bit_cast<float>(c.f));
      std::vector<uint16_t> h(kCopies, 0xdead);
      kernels->from_f32(f.data(), h.data(), DType::kF16, 0, kCopies);
      for (int64_t i = 0; i < kCopies; ++i) {
        EXPECT_EQ(h[i], c.h) << fmt::format("{:#010x} at {}", c.f, i);
      }
      EXPECT_EQ(FloatToHalf(f[0]), c.h) << fmt::format("base/dtype.h, {:#010x}", c.f);
    }
  }
}

// The vector paths convert 8 or 16 elements at a time, then a scalar tail: every length
// up to 3 vectors, from unaligned starts, in the middle of a buffer whose neighbours must
// stay untouched.
TEST(Convert, F16MatchesBaseDTypeAtEveryShortLengthAndOffset) {
  std::mt19937 rng(23);
  std::vector<float> src(64 + 8);
  for (float& x : src) x = std::bit_cast<float>(static_cast<uint32_t>(rng()) & 0xc7ffffffu);
  std::vector<uint16_t> src16(src.size());
  for (uint16_t& h : src16) h = static_cast<uint16_t>(rng());
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    for (int64_t offset = 0; offset < 4; ++offset) {
      for (int64_t n = 0; n <= 52; ++n) {
        SCOPED_TRACE(fmt::format("{} offset {} n {}", kernels->name, offset, n));
        std::vector<uint16_t> h(src.size(), 0xdead);
        kernels->from_f32(src.data(), h.data(), DType::kF16, offset, offset + n);
        std::vector<float> f(src.size(), -7.0f);
        kernels->to_f32(src16.data(), DType::kF16, f.data(), offset, offset + n);
        for (int64_t i = 0; i < static_cast<int64_t>(src.size()); ++i) {
          const bool inside = i >= offset && i < offset + n;
          ASSERT_EQ(h[i], inside ? FloatToHalf(src[i]) : 0xdead) << i;
          ASSERT_EQ(Bits(f[i]), Bits(inside ? HalfToFloat(src16[i]) : -7.0f)) << i;
        }
      }
    }
  }
}

// Every 251st fp32 bit pattern (17M values: all exponents, signs, NaNs; 251 is odd, so the
// 13 bits that fp16 rounds away take every value), through the public call and its tiles.
TEST(Convert, FromF32MatchesBaseDTypeOnASweepOfTheWholeFloatRange) {
  std::vector<float> xs;
  xs.reserve((uint64_t{1} << 32) / 251 + 1);
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 251) {
    xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(u)));
  }
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    SCOPED_TRACE(kernels->name);
    std::vector<uint16_t> out(xs.size(), 0xdead);
    ASSERT_TRUE(internal::ConvertFromF32With(*kernels, xs.data(), out.data(), DType::kF16,
                                             static_cast<int64_t>(xs.size()))
                    .ok());
    int64_t bad = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (out[i] != FloatToHalf(xs[i]) && bad++ < 5) {
        ADD_FAILURE() << fmt::format("{:#010x} -> {:#06x}, base gives {:#06x}", Bits(xs[i]), out[i],
                                     FloatToHalf(xs[i]));
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

#if defined(__x86_64__) || defined(__i386__)
// kernels.h: the conversions give the same bits with flush-to-zero and
// denormals-are-zero set (as some frameworks run). The kernels run on this thread only:
// MXCSR is per thread.
TEST(Convert, F16AndBf16GiveTheSameBitsUnderFlushToZeroAndDenormalsAreZero) {
  const std::vector<float> probes = RoundingProbes(FloatToHalf, HalfToFloat);
  std::vector<float> bf_probes = RoundingProbes(FloatToBf16, Bf16ToFloat);
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR bits 15 (FTZ) and 6 (DAZ)
  const unsigned saved = __builtin_ia32_stmxcsr();
  for (const internal::KernelTable* kernels : internal::SupportedKernelTables()) {
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(fmt::format("{} {}", kernels->name, DTypeName(dtype)));
      const bool half = dtype == DType::kF16;
      const std::vector<float>& xs = half ? probes : bf_probes;
      const auto n = static_cast<int64_t>(xs.size());
      std::vector<uint16_t> out(xs.size());
      std::vector<float> back(all.size());
      __builtin_ia32_ldmxcsr(saved | kFtzDaz);
      kernels->from_f32(xs.data(), out.data(), dtype, 0, n);
      kernels->to_f32(all.data(), dtype, back.data(), 0, 65536);
      __builtin_ia32_ldmxcsr(saved);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t want = half ? FloatToHalf(xs[i]) : FloatToBf16(xs[i]);
        if (out[i] != want && bad++ < 5) {
          ADD_FAILURE() << fmt::format("{:#010x} -> {:#06x}, base gives {:#06x}", Bits(xs[i]),
                                       out[i], want);
        }
      }
      for (uint32_t i = 0; i < 65536; ++i) {
        const float want = half ? HalfToFloat(all[i]) : Bf16ToFloat(all[i]);
        if (Bits(back[i]) != Bits(want) && bad++ < 5) {
          ADD_FAILURE() << fmt::format("{:#06x} -> {:#010x}, base gives {:#010x}", i, Bits(back[i]),
                                       Bits(want));
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}
#endif

TEST(Convert, F32ToF32CopiesBitsIncludingNanPayloads) {
  std::mt19937 rng(22);
  std::vector<float> src(100003);
  for (auto& x : src) x = std::bit_cast<float>(static_cast<uint32_t>(rng() | 0x7f800001u));
  std::vector<float> a(src.size()), b(src.size());
  ASSERT_TRUE(ConvertFromF32(src.data(), a.data(), DType::kF32, src.size()).ok());
  ASSERT_TRUE(ConvertToF32(a.data(), DType::kF32, b.data(), a.size()).ok());
  EXPECT_EQ(std::memcmp(src.data(), b.data(), src.size() * sizeof(float)), 0);
}

TEST(Convert, InvalidArgumentsAreRejected) {
  std::vector<float> f(32, 1.0f);
  std::vector<uint16_t> h(32, 0);
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  EXPECT_EQ(ConvertFromF32(nullptr, h.data(), DType::kF16, 32).code(), kInvalid);
  EXPECT_EQ(ConvertFromF32(f.data(), nullptr, DType::kF16, 32).code(), kInvalid);
  EXPECT_EQ(ConvertFromF32(f.data(), h.data(), DType::kF16, -1).code(), kInvalid);
  EXPECT_EQ(ConvertFromF32(f.data(), h.data(), DType{4}, 32).code(), kInvalid);
  EXPECT_EQ(ConvertFromF32(f.data(), f.data() + 8, DType::kBF16, 32).code(), kInvalid);
  EXPECT_EQ(ConvertToF32(nullptr, DType::kBF16, f.data(), 32).code(), kInvalid);
  EXPECT_EQ(ConvertToF32(h.data(), DType::kBF16, nullptr, 32).code(), kInvalid);
  EXPECT_EQ(ConvertToF32(h.data(), DType{200}, f.data(), 32).code(), kInvalid);
  EXPECT_EQ(ConvertToF32(f.data() + 4, DType::kF16, f.data(), 16).code(), kInvalid);
  EXPECT_TRUE(ConvertToF32(nullptr, DType::kF16, nullptr, 0).ok());
  EXPECT_TRUE(ConvertFromF32(nullptr, nullptr, DType::kBF16, 0).ok());
}

}  // namespace
}  // namespace strata::cpu_optim
