// Internal to models/ops/: the fp32 operations of the 4-bit dequantization (quantize_4bit.h), in
// host and device code, so that the host op (quantize_4bit.cc) and the CUDA kernel
// (cuda/quantize_4bit.cu) round in one place, as base/dtype.h does for the storage types.
//
// bitsandbytes builds its CUDA code with --use_fast_math (its CMakeLists.txt), so the products of
// its kernels flush subnormal inputs and results to zero of the same sign (mul.ftz.f32); the fp32
// add of the nested offset is torch's, which keeps subnormals. Each product here is one IEEE
// multiplication (__fmul_rn on the device: never fused, whatever -fmad says; the host file is
// compiled with -ffp-contract=off) with that flush around it. Header-only.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "base/host_device.h"
#include "models/ops/quantize_4bit.h"

namespace strata::models::ops::quant4 {

// Subnormal x to zero with x's sign (-ftz=true); NaN, zeros, normals and infinities unchanged.
STRATA_HD inline float FlushSubnormal(float x) {
  constexpr float kMinNormal = 0x1p-126f;
#if defined(__CUDA_ARCH__)
  return fabsf(x) < kMinNormal ? copysignf(0.0f, x) : x;
#else
  return std::fabs(x) < kMinNormal ? std::copysign(0.0f, x) : x;
#endif
}

// a * b as a fast-math kernel multiplies: inputs and result flushed, one rounding.
STRATA_HD inline float FlushedProduct(float a, float b) {
#if defined(__CUDA_ARCH__)
  return FlushSubnormal(__fmul_rn(FlushSubnormal(a), FlushSubnormal(b)));
#else
  return FlushSubnormal(FlushSubnormal(a) * FlushSubnormal(b));
#endif
}

// The absmax of a block under double quantization: dequantize_blockwise's product
// (kDequantizeBlockwise, General8bit) of the 8-bit code's value and the nested block's absmax,
// then dequantize_4bit's `absmax += offset` (a torch fp32 add: not flushed, not fused).
STRATA_HD inline float NestedAbsmax(float map_value, float nested_absmax, float offset) {
  const float scaled = FlushedProduct(map_value, nested_absmax);
#if defined(__CUDA_ARCH__)
  return __fadd_rn(scaled, offset);
#else
  return scaled + offset;
#endif
}

// One dequantized value in fp32: kDequantizeBlockwise's table[code] * absmax (flushed).
STRATA_HD inline float DequantizedValue(float table_value, float absmax) {
  return FlushedProduct(table_value, absmax);
}

// A dequantized value rounded to bitsandbytes' output type (Quant4Params::dtype): bf16 and fp16
// to nearest even, fp32 unchanged.
STRATA_HD inline float RoundToQuantDType(float value, DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToFloat(FloatToBf16(value));
    case DType::kF16:
      return HalfToFloat(FloatToHalf(value));
    case DType::kF32:
      break;
  }
  return value;
}

// What the dequantization multiplies absmax by, per code: Quant4Map(type), except FP4's code 8
// (negative zero), which bitsandbytes' dDequantizeFP4Tree gives as -0.0 (0.0 * -1.0) where its
// stored quant_map (get_4bit_type('fp4')) has +0.0.
std::array<float, 16> DequantTable(Quant4Type type);

}  // namespace strata::models::ops::quant4
