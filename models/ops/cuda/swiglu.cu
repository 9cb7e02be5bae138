// SwiGLU on CUDA (ops.cuh): one thread per (gate, up) pair.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;

__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename D>
__global__ void SwigluForwardKernel(const D* gate_up, int64_t rows, int64_t I, D* h) {
  STRATA_FOR_EACH_INDEX(idx, rows * I) {
    const int64_t r = idx / I, j = idx % I;
    const float g = ToF(gate_up[r * 2 * I + j]), u = ToF(gate_up[r * 2 * I + I + j]);
    h[idx] = FromF<D>(g * Sigmoid(g) * u);
  }
}

template <typename D>
__global__ void SwigluBackwardKernel(const D* gate_up, const D* dh, int64_t rows, int64_t I,
                                     D* dgate_up) {
  STRATA_FOR_EACH_INDEX(idx, rows * I) {
    const int64_t r = idx / I, j = idx % I;
    const float g = ToF(gate_up[r * 2 * I + j]), u = ToF(gate_up[r * 2 * I + I + j]);
    const float d = ToF(dh[idx]);
    const float sig = Sigmoid(g);
    dgate_up[r * 2 * I + j] = FromF<D>(d * u * sig * (1.0f + g * (1.0f - sig)));
    dgate_up[r * 2 * I + I + j] = FromF<D>(d * g * sig);
  }
}

#undef STRATA_FOR_EACH_WARP_ROW

}  // namespace

template <typename D>
Status LaunchSwigluForward(cudaStream_t stream, const D* gate_up, int64_t rows, int64_t I, D* h) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchSwigluForward", rows, I));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchSwigluForward", {gate_up, h}));
  SwigluForwardKernel<D><<<GridFor(rows * I, kBlock), kBlock, 0, stream>>>(gate_up, rows, I, h);
  return Launched("SwigluForwardKernel");
}

template <typename D>
Status LaunchSwigluBackward(cudaStream_t stream, const D* gate_up, const D* dh, int64_t rows,
                            int64_t I, D* dgate_up) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchSwigluBackward", rows, I));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchSwigluBackward", {gate_up, dh, dgate_up}));
  SwigluBackwardKernel<D>
      <<<GridFor(rows * I, kBlock), kBlock, 0, stream>>>(gate_up, dh, rows, I, dgate_up);
  return Launched("SwigluBackwardKernel");
}

#define STRATA_INSTANTIATE_SWIGLU(D)                                                    \
  template Status LaunchSwigluForward<D>(cudaStream_t, const D*, int64_t, int64_t, D*); \
  template Status LaunchSwigluBackward<D>(cudaStream_t, const D*, const D*, int64_t, int64_t, D*);
STRATA_INSTANTIATE_SWIGLU(float)
STRATA_INSTANTIATE_SWIGLU(__half)
STRATA_INSTANTIATE_SWIGLU(__nv_bfloat16)
#undef STRATA_INSTANTIATE_SWIGLU

}  // namespace strata::models::ops::cuda
