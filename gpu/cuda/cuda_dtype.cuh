// Scalar fp16/bf16 conversions for the CUDA kernels, compiled for host and device, so
// the device code can be checked on any machine against the scalar reference in
// base/dtype.h (tests/gpu/cuda_dtype_test.cc, which needs no GPU, compares them bit for
// bit). Same rules as base/dtype.h: round to nearest even, NaN stays NaN (quiet, sign and
// top payload bits kept), past the fp16 range -> +-inf, denormals kept both ways.
//
// The CUDA intrinsics (__float_as_uint, __clz) are used in device code; host code uses
// their standard equivalents. Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cstdint>

#include "base/host_device.h"

namespace strata::gpu::cuda {

STRATA_HD inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

STRATA_HD inline float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// Leading zero bits of a nonzero 32-bit value.
STRATA_HD inline int CountLeadingZeros(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(v);
#else
  return __builtin_clz(v);
#endif
}

STRATA_HD inline float Bf16ToFloatDev(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

STRATA_HD inline uint16_t FloatToBf16Dev(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow rounds to inf
  return static_cast<uint16_t>(u >> 16);
}

STRATA_HD inline float HalfToFloatDev(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // denormal: shift the leading one into the implicit bit (1..10 shifts)
    const int shift = CountLeadingZeros(mant) - 21;
    bits =
        sign | ((113u - static_cast<uint32_t>(shift)) << 23) | (((mant << shift) & 0x3ffu) << 13);
  }
  return BitsToFloat(bits);
}

STRATA_HD inline uint16_t FloatToHalfDev(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504 -> inf (also inf)
  if (a < 0x38800000u) {                        // result is fp16 denormal or zero
    if (a < 0x33000000u) return sign;           // < 2^-25: rounds to zero
    const uint32_t exp = a >> 23;
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// x * scale as the host reference computes it on x86-64 (SSE): a NaN operand keeps its
// sign and payload and comes back quiet. (NVIDIA's FMUL would return the canonical NaN.)
STRATA_HD inline float ScaleDev(float x, float scale) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BitsToFloat(u | 0x00400000u);
  return x * scale;
}

}  // namespace strata::gpu::cuda
