// GELU's backward on CUDA (ops.cuh): the DGELU product's epilogue, one thread per element, the
// host op's formula (ops/gelu.cc GeluGrad) in fp32.
#include <cmath>
#include <cstdint>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// gelu'(v) of gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), as ops/gelu.cc.
__device__ __forceinline__ float GeluGrad(float v) {
  const float v2 = v * v;
  const float th = tanhf(kGeluScale * (v + kGeluCubic * v2 * v));
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v2);
  return 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
}

template <typename D>
__global__ void TimesGeluGradKernel(const float* acc, const D* pre, int64_t n, D* out) {
  STRATA_FOR_EACH_INDEX(i, n) { out[i] = FromF<D>(acc[i] * GeluGrad(ToF(pre[i]))); }
}

}  // namespace

template <typename D>
Status LaunchTimesGeluGrad(cudaStream_t stream, const float* acc, const D* pre, int64_t n, D* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchTimesGeluGrad", {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchTimesGeluGrad", {acc, pre, out}));
  TimesGeluGradKernel<D><<<GridFor(n, kBlock), kBlock, 0, stream>>>(acc, pre, n, out);
  return Launched("TimesGeluGradKernel");
}

#define STRATA_INSTANTIATE_GELU(D) \
  template Status LaunchTimesGeluGrad<D>(cudaStream_t, const float*, const D*, int64_t, D*);
STRATA_INSTANTIATE_GELU(float)
STRATA_INSTANTIATE_GELU(__half)
STRATA_INSTANTIATE_GELU(__nv_bfloat16)
#undef STRATA_INSTANTIATE_GELU

}  // namespace strata::models::ops::cuda
