// The CUDA kernels' scalar conversions (gpu/cuda/cuda_dtype.cuh), compiled here for the
// host, against the scalar reference of base/dtype.h, bit for bit. Needs no GPU: the same
// source is what nvcc compiles into the kernels.
#include "gpu/cuda/cuda_dtype.cuh"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <limits>

#include "base/dtype.h"

namespace strata::gpu::cuda {
namespace {

TEST(CudaScalarConversions, EverySixteenBitPatternWidensLikeTheReference) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto x = static_cast<uint16_t>(h);
    ASSERT_EQ(std::bit_cast<uint32_t>(HalfToFloatDev(x)), std::bit_cast<uint32_t>(HalfToFloat(x)))
        << "fp16 0x" << std::hex << h;
    ASSERT_EQ(std::bit_cast<uint32_t>(Bf16ToFloatDev(x)), std::bit_cast<uint32_t>(Bf16ToFloat(x)))
        << "bf16 0x" << std::hex << h;
  }
}

// Every 61st fp32 bit pattern (70 million, all exponents, both signs, NaN payloads) plus
// every pattern next to the fp16 rounding boundaries.
TEST(CudaScalarConversions, Fp32NarrowsLikeTheReference) {
  auto check = [](uint32_t u) {
    const float f = std::bit_cast<float>(u);
    if (FloatToHalfDev(f) != FloatToHalf(f)) {
      ADD_FAILURE() << "fp16 of 0x" << std::hex << u << ": " << FloatToHalfDev(f) << " vs "
                    << FloatToHalf(f);
      return false;
    }
    if (FloatToBf16Dev(f) != FloatToBf16(f)) {
      ADD_FAILURE() << "bf16 of 0x" << std::hex << u << ": " << FloatToBf16Dev(f) << " vs "
                    << FloatToBf16(f);
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

// The NaN rule of ScaleDev is what x86-64 does when it multiplies: checked against the
// real multiplication on this host, for quiet and signalling NaNs of both signs.
TEST(CudaScalarConversions, ScaleKeepsNaNsAsTheHostMultiplicationDoes) {
  for (uint32_t u : {0x7fc00000u, 0x7fc12345u, 0x7f812345u, 0x7f800001u, 0xffc00001u, 0xff812345u,
                     0x7fffffffu}) {
    const float x = std::bit_cast<float>(u);
    for (float scale : {2.0f, 0.5f, 1024.0f, -3.0f}) {
      volatile float s = scale;  // a real multiplication at run time
      ASSERT_EQ(std::bit_cast<uint32_t>(ScaleDev(x, scale)), std::bit_cast<uint32_t>(x * s))
          << std::hex << u;
    }
  }
  for (float x : {1.5f, -0.0f, 1e-40f, 3e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(std::bit_cast<uint32_t>(ScaleDev(x, 4.0f)), std::bit_cast<uint32_t>(x * 4.0f));
  }
}

}  // namespace
}  // namespace strata::gpu::cuda
