// Element types and scalar fp16/bf16 conversions.
//
// Conversions round to nearest even; NaN stays NaN (a quiet NaN with the sign
// kept), infinities stay infinite, values past the 16-bit range become infinity
// (fp16 overflow is what the loss scaler detects). Denormals are kept in both
// directions. These are the scalar reference; vector kernels must match them bit
// for bit.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "base/status.h"

namespace strata {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t SizeOf(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view DTypeName(DType t);  // "fp32", "fp16", "bf16"
// Accepts "fp32"/"float32"/"f32", "fp16"/"float16"/"f16"/"half", "bf16"/"bfloat16".
StatusOr<DType> ParseDType(std::string_view name);

inline float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow rounds to inf
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // denormal: normalize
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
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

}  // namespace strata
