// SwiGLU and GeGLU on CUDA (ops.cuh): one thread per (gate, up) pair, the kernels templated on
// the gate's activation (ops/swiglu.h GatedActivation).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/gelu_tanh.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;

__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <GatedActivation kAct, typename D>
__global__ void SwigluForwardKernel(const D* gate_up, int64_t rows, int64_t I, D* h) {
  STRATA_FOR_EACH_INDEX(idx, rows * I) {
    const int64_t r = idx / I, j = idx % I;
    const float g = ToF(gate_up[r * 2 * I + j]), u = ToF(gate_up[r * 2 * I + I + j]);
    if constexpr (kAct == GatedActivation::kSilu) {
      h[idx] = FromF<D>(g * Sigmoid(g) * u);
    } else {
      h[idx] = FromF<D>(GeluTanh(g) * u);
    }
  }
}

template <GatedActivation kAct, typename D>
__global__ void SwigluBackwardKernel(const D* gate_up, const D* dh, int64_t rows, int64_t I,
                                     D* dgate_up) {
  STRATA_FOR_EACH_INDEX(idx, rows * I) {
    const int64_t r = idx / I, j = idx % I;
    const float g = ToF(gate_up[r * 2 * I + j]), u = ToF(gate_up[r * 2 * I + I + j]);
    const float d = ToF(dh[idx]);
    if constexpr (kAct == GatedActivation::kSilu) {
      const float sig = Sigmoid(g);
      dgate_up[r * 2 * I + j] = FromF<D>(d * u * sig * (1.0f + g * (1.0f - sig)));
      dgate_up[r * 2 * I + I + j] = FromF<D>(d * g * sig);
    } else {
      dgate_up[r * 2 * I + j] = FromF<D>(d * u * GeluTanhGrad(g));
      dgate_up[r * 2 * I + I + j] = FromF<D>(d * GeluTanh(g));
    }
  }
}

Status CheckActivation(const char* op, GatedActivation act) {
  if (act == GatedActivation::kSilu || act == GatedActivation::kGeluTanh) return Status::Ok();
  return InvalidArgumentError(std::string(op) + ": unknown GatedActivation " +
                              std::to_string(static_cast<int>(act)));
}

#undef STRATA_FOR_EACH_WARP_ROW

}  // namespace

template <typename D>
Status LaunchSwigluForward(cudaStream_t stream, const D* gate_up, int64_t rows, int64_t I, D* h,
                           GatedActivation act) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchSwigluForward", rows, I));
  STRATA_RETURN_IF_ERROR(CheckActivation("LaunchSwigluForward", act));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchSwigluForward", {gate_up, h}));
  const int grid = GridFor(rows * I, kBlock);
  if (act == GatedActivation::kSilu) {
    SwigluForwardKernel<GatedActivation::kSilu, D>
        <<<grid, kBlock, 0, stream>>>(gate_up, rows, I, h);
  } else {
    SwigluForwardKernel<GatedActivation::kGeluTanh, D>
        <<<grid, kBlock, 0, stream>>>(gate_up, rows, I, h);
  }
  return Launched("SwigluForwardKernel");
}

template <typename D>
Status LaunchSwigluBackward(cudaStream_t stream, const D* gate_up, const D* dh, int64_t rows,
                            int64_t I, D* dgate_up, GatedActivation act) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchSwigluBackward", rows, I));
  STRATA_RETURN_IF_ERROR(CheckActivation("LaunchSwigluBackward", act));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchSwigluBackward", {gate_up, dh, dgate_up}));
  const int grid = GridFor(rows * I, kBlock);
  if (act == GatedActivation::kSilu) {
    SwigluBackwardKernel<GatedActivation::kSilu, D>
        <<<grid, kBlock, 0, stream>>>(gate_up, dh, rows, I, dgate_up);
  } else {
    SwigluBackwardKernel<GatedActivation::kGeluTanh, D>
        <<<grid, kBlock, 0, stream>>>(gate_up, dh, rows, I, dgate_up);
  }
  return Launched("SwigluBackwardKernel");
}

#define STRATA_INSTANTIATE_SWIGLU(D)                                                              \
  template Status LaunchSwigluForward<D>(cudaStream_t, const D*, int64_t, int64_t, D*,            \
                                         GatedActivation);                                        \
  template Status LaunchSwigluBackward<D>(cudaStream_t, const D*, const D*, int64_t, int64_t, D*, \
                                          GatedActivation);
STRATA_INSTANTIATE_SWIGLU(float)
STRATA_INSTANTIATE_SWIGLU(__half)
STRATA_INSTANTIATE_SWIGLU(__nv_bfloat16)
#undef STRATA_INSTANTIATE_SWIGLU

}  // namespace strata::models::ops::cuda
