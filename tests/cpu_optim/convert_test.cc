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
