// Internal to models/ops/cuda/: the tanh-approximated GELU and its derivative in fp32 on the
// device, the formulas of the host's models/ops/gelu_tanh.h, shared by the GELU kernels
// (gelu.cu) and the GeGLU gate (swiglu.cu).
#pragma once

#include <cuda_runtime_api.h>

namespace strata::models::ops::cuda::internal {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), as gelu_tanh.h GeluTanh.
__device__ __forceinline__ float GeluTanh(float v) {
  return 0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCubic * v * v * v)));
}

// gelu'(v), as gelu_tanh.h GeluTanhGrad.
__device__ __forceinline__ float GeluTanhGrad(float v) {
  const float v2 = v * v;
  const float th = tanhf(kGeluScale * (v + kGeluCubic * v2 * v));
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v2);
  return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
}

}  // namespace strata::models::ops::cuda::internal
