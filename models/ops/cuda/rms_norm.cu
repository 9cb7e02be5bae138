// RMSNorm on CUDA (ops.cuh): one warp per row (the row functions of rms_norm_row.cuh, shared
// with the per-head RMSNorm); the weight gradient through a deterministic two-pass column
// reduction.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"
#include "models/ops/cuda/rms_norm_row.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;
constexpr int kRowWarps = 8;  // rows (warps) per block of the row kernels

int RowGrid(int64_t rows) { return GridFor(rows, kRowWarps); }

template <typename D>
__global__ void RmsNormForwardKernel(const D* x, const D* w, float eps, int64_t rows, int64_t C,
                                     D* y, float* rstd, bool unit_offset) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const float s = RmsNormWarpRowForward(x + r * C, w, eps, C, y + r * C, lane, unit_offset);
    if (lane == 0) rstd[r] = s;
  }
}

template <typename D>
__global__ void RmsNormBackwardKernel(const D* x, const D* w, const float* rstd, const D* dy,
                                      const D* dresidual, int64_t rows, int64_t C, D* dx,
                                      bool unit_offset) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    RmsNormWarpRowBackward(x + r * C, w, rstd[r], dy + r * C,
                           dresidual != nullptr ? dresidual + r * C : nullptr, C, dx + r * C, lane,
                           unit_offset);
  }
}

// Pass 1: partials[p, c] = sum over rows p R .. (p + 1) R - 1 (in order) of dy xhat.
template <typename D>
__global__ void RmsNormPartialsKernel(const D* x, const float* rstd, const D* dy, int64_t rows,
                                      int64_t C, float* partials) {
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t p = blockIdx.y;
  if (c >= C) return;
  const int64_t r0 = p * kRmsRowsPerPartial;
  const int64_t r1 = r0 + kRmsRowsPerPartial < rows ? r0 + kRmsRowsPerPartial : rows;
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += ToF(dy[r * C + c]) * (ToF(x[r * C + c]) * rstd[r]);
  partials[p * C + c] = acc;
}

}  // namespace

template <typename D>
Status LaunchRmsNormForward(cudaStream_t stream, const D* x, const D* w, float eps, int64_t rows,
                            int64_t C, D* y, float* rstd, bool unit_offset) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchRmsNormForward", rows, C));
  if (!(eps > 0.0f)) return InvalidArgumentError("LaunchRmsNormForward: eps must be > 0");
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormForward", {x, w, y, rstd}));
  RmsNormForwardKernel<D>
      <<<RowGrid(rows), kRowWarps * kWarp, 0, stream>>>(x, w, eps, rows, C, y, rstd, unit_offset);
  return Launched("RmsNormForwardKernel");
}

template <typename D>
Status LaunchRmsNormBackward(cudaStream_t stream, const D* x, const D* w, const float* rstd,
                             const D* dy, const D* dresidual, int64_t rows, int64_t C, D* dx,
                             bool unit_offset) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchRmsNormBackward", rows, C));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormBackward", {x, w, rstd, dy, dx}));
  RmsNormBackwardKernel<D><<<RowGrid(rows), kRowWarps * kWarp, 0, stream>>>(
      x, w, rstd, dy, dresidual, rows, C, dx, unit_offset);
  return Launched("RmsNormBackwardKernel");
}

template <typename D>
Status LaunchRmsNormWeightGrad(cudaStream_t stream, const D* x, const float* rstd, const D* dy,
                               int64_t rows, int64_t C, float* partials, D* dw) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchRmsNormWeightGrad", rows, C));
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormWeightGrad", {dw, partials}));
  const int64_t num_partials = RmsPartials(rows);
  if (num_partials > kMaxGrid) {
    return InvalidArgumentError("LaunchRmsNormWeightGrad: too many rows for the partial sums");
  }
  if (rows > 0) {
    STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormWeightGrad", {x, rstd, dy}));
    const dim3 grid(static_cast<unsigned>((C + kBlock - 1) / kBlock),
                    static_cast<unsigned>(num_partials));
    RmsNormPartialsKernel<D><<<grid, kBlock, 0, stream>>>(x, rstd, dy, rows, C, partials);
    STRATA_RETURN_IF_ERROR(Launched("RmsNormPartialsKernel"));
  }
  SumPartialsKernel<D><<<GridFor(C, kBlock), kBlock, 0, stream>>>(partials, num_partials, C, dw);
  return Launched("SumPartialsKernel");
}

#define STRATA_INSTANTIATE_RMS_NORM(D)                                                       \
  template Status LaunchRmsNormForward<D>(cudaStream_t, const D*, const D*, float, int64_t,  \
                                          int64_t, D*, float*, bool);                        \
  template Status LaunchRmsNormBackward<D>(cudaStream_t, const D*, const D*, const float*,   \
                                           const D*, const D*, int64_t, int64_t, D*, bool);  \
  template Status LaunchRmsNormWeightGrad<D>(cudaStream_t, const D*, const float*, const D*, \
                                             int64_t, int64_t, float*, D*);
STRATA_INSTANTIATE_RMS_NORM(float)
STRATA_INSTANTIATE_RMS_NORM(__half)
STRATA_INSTANTIATE_RMS_NORM(__nv_bfloat16)
#undef STRATA_INSTANTIATE_RMS_NORM

}  // namespace strata::models::ops::cuda
