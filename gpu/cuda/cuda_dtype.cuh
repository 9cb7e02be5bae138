// Scalar helpers of the CUDA kernels, compiled for host and device (STRATA_HD), so that they can
// be checked on any machine (tests/gpu/cuda_dtype_test.cc, which needs no GPU). The kernels'
// fp16/bf16 conversions are base/dtype.h's own (FloatToHalf, HalfToFloat, FloatToBf16,
// Bf16ToFloat, host and device code too): one rounding for the host reference and the device.
// Pure functions, thread-safe.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "base/host_device.h"

namespace strata::gpu::cuda {

// x * scale as the host reference computes it on x86-64 (SSE): a NaN operand keeps its
// sign and payload and comes back quiet. (NVIDIA's FMUL would return the canonical NaN.)
STRATA_HD inline float ScaleDev(float x, float scale) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BitsToFloat(u | 0x00400000u);
  return x * scale;
}

}  // namespace strata::gpu::cuda
