// GELU on CUDA (ops.cuh): the DGELU product's epilogue and the unfused forward and backward
// (LoRA's GPT-2 MLP), one thread per element, the host op's formulas (ops/gelu.cc) in fp32.
#include <cmath>
#include <cstdint>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/gelu_tanh.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;
// acc: fp32 or the stored D (its value read exactly).
template <typename A, typename D>
__global__ void TimesGeluGradKernel(const A* acc, const D* pre, int64_t n, D* out) {
  STRATA_FOR_EACH_INDEX(i, n) { out[i] = FromF<D>(ToF(acc[i]) * GeluTanhGrad(ToF(pre[i]))); }
}

template <typename D>
__global__ void GeluKernel(const D* pre, int64_t n, D* out) {
  STRATA_FOR_EACH_INDEX(i, n) { out[i] = FromF<D>(GeluTanh(ToF(pre[i]))); }
}

template <typename A, typename D>
Status LaunchTimesGelu(const char* op, cudaStream_t stream, const A* acc, const D* pre, int64_t n,
                       D* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes(op, {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers(op, {acc, pre, out}));
  TimesGeluGradKernel<A, D><<<GridFor(n, kBlock), kBlock, 0, stream>>>(acc, pre, n, out);
  return Launched("TimesGeluGradKernel");
}

}  // namespace

template <typename D>
Status LaunchTimesGeluGrad(cudaStream_t stream, const float* acc, const D* pre, int64_t n, D* out) {
  return LaunchTimesGelu("LaunchTimesGeluGrad", stream, acc, pre, n, out);
}

template <typename D>
Status LaunchGeluBackward(cudaStream_t stream, const D* pre, const D* dg, int64_t n, D* dpre) {
  return LaunchTimesGelu("LaunchGeluBackward", stream, dg, pre, n, dpre);
}

template <typename D>
Status LaunchGeluForward(cudaStream_t stream, const D* pre, int64_t n, D* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchGeluForward", {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchGeluForward", {pre, out}));
  GeluKernel<D><<<GridFor(n, kBlock), kBlock, 0, stream>>>(pre, n, out);
  return Launched("GeluKernel");
}

#define STRATA_INSTANTIATE_GELU(D)                                                           \
  template Status LaunchTimesGeluGrad<D>(cudaStream_t, const float*, const D*, int64_t, D*); \
  template Status LaunchGeluBackward<D>(cudaStream_t, const D*, const D*, int64_t, D*);      \
  template Status LaunchGeluForward<D>(cudaStream_t, const D*, int64_t, D*);
STRATA_INSTANTIATE_GELU(float)
STRATA_INSTANTIATE_GELU(__half)
STRATA_INSTANTIATE_GELU(__nv_bfloat16)
#undef STRATA_INSTANTIATE_GELU

}  // namespace strata::models::ops::cuda
