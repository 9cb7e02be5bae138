// Element types and scalar fp16/bf16 conversions.
//
// Conversions round to nearest even; NaN stays NaN (a quiet NaN with the sign
// kept), infinities stay infinite, values past the 16-bit range become infinity
// (fp16 overflow is what the loss scaler detects). Denormals are kept in both
// directions. These are the scalar reference; vector kernels must match them bit
// for bit. The four conversions are host and device code (STRATA_HD): the CUDA
// kernels call these same functions (gpu/cuda/cuda_kernels.cu,
// engine/cuda/device_optimizer.cu), so host and device round in one place.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "base/host_device.h"
#include "base/status.h"

namespace strata {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t SizeOf(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view DTypeName(DType t);  // "fp32", "fp16", "bf16"
// Accepts "fp32"/"float32"/"f32", "fp16"/"float16"/"f16"/"half", "bf16"/"bfloat16".
StatusOr<DType> ParseDType(std::string_view name);

// The bits of a float and back, in host and device code (device code has no std::bit_cast; it
// has nvcc's intrinsics).
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

STRATA_HD inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

STRATA_HD inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow rounds to inf
  return static_cast<uint16_t>(u >> 16);
}

STRATA_HD inline float HalfToFloat(uint16_t h) {
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
  return BitsToFloat(bits);
}

STRATA_HD inline uint16_t FloatToHalf(float f) {
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

// Host storage types of one 16-bit value: the bits, nothing else. Host kernels load them with
// ToFloat, compute in fp32 and store with FromFloat<S> (one rounding, to nearest even), so a
// host kernel templated on its storage type S in {float, double, Bf16, Fp16} rounds exactly
// where a GPU kernel that keeps __nv_bfloat16 / __half in memory does. Trivially copyable,
// 2 bytes, no arithmetic operators: every use spells out where a value is rounded.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2 && sizeof(Fp16) == 2);

inline float ToFloat(Bf16 x) { return Bf16ToFloat(x.bits); }
inline float ToFloat(Fp16 x) { return HalfToFloat(x.bits); }
inline float ToFloat(float x) { return x; }
inline double ToFloat(double x) { return x; }  // the double reference keeps double

// The compute type of storage type S: float for float, Bf16 and Fp16; double for double.
template <typename S>
using ComputeType = decltype(ToFloat(S{}));

// Rounds an fp32 (or double, for S = double) value to storage type S.
template <typename S>
inline S FromFloat(ComputeType<S> x) {
  if constexpr (std::is_same_v<S, Bf16>) {
    return Bf16{FloatToBf16(x)};
  } else if constexpr (std::is_same_v<S, Fp16>) {
    return Fp16{FloatToHalf(x)};
  } else {
    return x;
  }
}

// The DType of a storage type (double has none: it is a test reference only).
template <typename S>
constexpr DType DTypeOf() {
  if constexpr (std::is_same_v<S, Bf16>) {
    return DType::kBF16;
  } else if constexpr (std::is_same_v<S, Fp16>) {
    return DType::kF16;
  } else {
    static_assert(std::is_same_v<S, float>, "no DType for this storage type");
    return DType::kF32;
  }
}

// Calls f.template operator()<S>() with the storage type S of `dtype` (float, Fp16, Bf16) and
// returns its result: one switch where a run-time dtype picks a compile-time kernel.
template <typename F>
decltype(auto) DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF16:
      return f.template operator()<Fp16>();
    case DType::kBF16:
      return f.template operator()<Bf16>();
    case DType::kF32:
      break;
  }
  return f.template operator()<float>();
}

}  // namespace strata
