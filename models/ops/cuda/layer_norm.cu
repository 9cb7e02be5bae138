// LayerNorm on CUDA (ops.cuh): one warp per row; the parameter gradients and the plain column
// sums (a linear layer's bias gradient) through one deterministic two-pass column reduction.
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

constexpr float kLayerNormEps = 1e-5f;
constexpr int kBlock = 256;       // threads of the elementwise kernels
constexpr int kRowsPerBlock = 4;  // warps (rows) per block of the row kernels
constexpr int kColLanes = 8;      // row lanes per column in the column reductions

int WarpRowGrid(int64_t rows) { return GridFor(rows, kRowsPerBlock); }
constexpr int kWarpRowThreads = kRowsPerBlock * kWarp;

template <typename D>
__global__ void LayerNormForwardKernel(const D* x, const D* w, const D* b, int64_t rows, int64_t C,
                                       D* y, float* mean, float* rstd) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const D* xr = x + r * C;
    float sum = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) sum += ToF(xr[c]);
    const float m = WarpSum(sum) / static_cast<float>(C);
    float var = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float d = ToF(xr[c]) - m;
      var += d * d;
    }
    var = WarpSum(var) / static_cast<float>(C);
    const float s = 1.0f / sqrtf(var + kLayerNormEps);
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
    D* yr = y + r * C;
    for (int64_t c = lane; c < C; c += kWarp) {
      yr[c] = FromF<D>((ToF(xr[c]) - m) * s * ToF(w[c]) + ToF(b[c]));
    }
  }
}

// No __restrict__: dx may alias residual (each lane reads its element before writing it).
template <typename D>
__global__ void LayerNormBackwardKernel(const D* x, const D* w, const D* dy, const float* mean,
                                        const float* rstd, const D* residual, int64_t rows,
                                        int64_t C, D* dx) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const D* xr = x + r * C;
    const D* dr = dy + r * C;
    const float m = mean[r], s = rstd[r];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float g = ToF(dr[c]) * ToF(w[c]);
      g_sum += g;
      gx_sum += g * ((ToF(xr[c]) - m) * s);
    }
    const float g_mean = WarpSum(g_sum) / static_cast<float>(C);
    const float gx_mean = WarpSum(gx_sum) / static_cast<float>(C);
    D* out = dx + r * C;
    const D* res = residual != nullptr ? residual + r * C : nullptr;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = (ToF(xr[c]) - m) * s;
      const float v = s * (ToF(dr[c]) * ToF(w[c]) - g_mean - xhat * gx_mean);
      out[c] = FromF<D>(res != nullptr ? ToF(res[c]) + v : v);
    }
  }
}

// Pass 1 of the column reductions: block (blockIdx.x: 32 columns, blockIdx.y: one partial of
// kLnRowsPerPartial rows); thread (tx, ty) sums rows ty, ty + 8, ... of its partial, then
// ty == 0 adds the 8 lane sums in order. With x == nullptr it sums dy (column sums); else
// both dy xhat (into partials[p][c]) and dy (into partials[p][C + c]).
template <typename D>
__global__ void ColumnPartialsKernel(const D* x, const D* dy, const float* mean, const float* rstd,
                                     int64_t rows, int64_t C, float* partials) {
  __shared__ float part_w[kColLanes][kWarp];
  __shared__ float part_b[kColLanes][kWarp];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t{blockIdx.x} * kWarp + tx;
  const int64_t r0 = int64_t{blockIdx.y} * kLnRowsPerPartial;
  const int64_t r1 = min(rows, r0 + kLnRowsPerPartial);
  float acc_w = 0.0f, acc_b = 0.0f;
  if (c < C) {
    for (int64_t r = r0 + ty; r < r1; r += kColLanes) {
      const float d = ToF(dy[r * C + c]);
      if (x != nullptr) acc_w += d * ((ToF(x[r * C + c]) - mean[r]) * rstd[r]);
      acc_b += d;
    }
  }
  part_w[ty][tx] = acc_w;
  part_b[ty][tx] = acc_b;
  __syncthreads();
  if (ty == 0 && c < C) {
    float sw = 0.0f, sb = 0.0f;
    for (int k = 0; k < kColLanes; ++k) {
      sw += part_w[k][tx];
      sb += part_b[k][tx];
    }
    if (x != nullptr) {
      partials[int64_t{blockIdx.y} * 2 * C + c] = sw;
      partials[int64_t{blockIdx.y} * 2 * C + C + c] = sb;
    } else {
      partials[int64_t{blockIdx.y} * C + c] = sb;
    }
  }
}

// Pass 2: out[c] = D(sum over p in order of partials[p][c]), partial rows of `width`.
template <typename D>
__global__ void ColumnFinishKernel(const float* partials, int64_t num_partials, int64_t width,
                                   int64_t cols, int64_t col_offset, D* out) {
  STRATA_FOR_EACH_INDEX(c, cols) {
    float acc = 0.0f;
    for (int64_t p = 0; p < num_partials; ++p) acc += partials[p * width + col_offset + c];
    out[c] = FromF<D>(acc);
  }
}

}  // namespace

template <typename D>
Status LaunchLayerNormForward(cudaStream_t stream, const D* x, const D* w, const D* b, int64_t rows,
                              int64_t C, D* y, float* mean, float* rstd) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormForward", {rows, C}));
  if (rows == 0) return Status::Ok();
  if (C < 1) return InvalidArgumentError("LaunchLayerNormForward: C must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormForward", {x, w, b, y, mean, rstd}));
  LayerNormForwardKernel<D>
      <<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(x, w, b, rows, C, y, mean, rstd);
  return Launched("LayerNormForwardKernel");
}

template <typename D>
Status LaunchLayerNormBackward(cudaStream_t stream, const D* x, const D* w, const D* dy,
                               const float* mean, const float* rstd, const D* residual,
                               int64_t rows, int64_t C, D* dx) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormBackward", {rows, C}));
  if (rows == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormBackward", {x, w, dy, mean, rstd, dx}));
  LayerNormBackwardKernel<D><<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(
      x, w, dy, mean, rstd, residual, rows, C, dx);
  return Launched("LayerNormBackwardKernel");
}

template <typename D>
Status LaunchLayerNormParamGrads(cudaStream_t stream, const D* x, const D* dy, const float* mean,
                                 const float* rstd, int64_t rows, int64_t C, float* partials, D* dw,
                                 D* db) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormParamGrads", {rows, C}));
  if (C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormParamGrads", {dw, db}));
  const int64_t P = LnPartials(rows);
  if (P > 0) {
    STRATA_RETURN_IF_ERROR(
        CheckPointers("LaunchLayerNormParamGrads", {x, dy, mean, rstd, partials}));
    const dim3 grid(static_cast<unsigned>((C + kWarp - 1) / kWarp), static_cast<unsigned>(P));
    ColumnPartialsKernel<D>
        <<<grid, dim3(kWarp, kColLanes), 0, stream>>>(x, dy, mean, rstd, rows, C, partials);
    STRATA_RETURN_IF_ERROR(Launched("ColumnPartialsKernel"));
  }
  ColumnFinishKernel<D><<<GridFor(C, kBlock), kBlock, 0, stream>>>(partials, P, 2 * C, C, 0, dw);
  STRATA_RETURN_IF_ERROR(Launched("ColumnFinishKernel"));
  ColumnFinishKernel<D><<<GridFor(C, kBlock), kBlock, 0, stream>>>(partials, P, 2 * C, C, C, db);
  return Launched("ColumnFinishKernel");
}

template <typename D>
Status LaunchColumnSums(cudaStream_t stream, const D* x, int64_t rows, int64_t cols,
                        float* partials, D* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchColumnSums", {rows, cols}));
  if (cols == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchColumnSums", {out}));
  const int64_t P = LnPartials(rows);
  if (P > 0) {
    STRATA_RETURN_IF_ERROR(CheckPointers("LaunchColumnSums", {x, partials}));
    const dim3 grid(static_cast<unsigned>((cols + kWarp - 1) / kWarp), static_cast<unsigned>(P));
    ColumnPartialsKernel<D><<<grid, dim3(kWarp, kColLanes), 0, stream>>>(
        static_cast<const D*>(nullptr), x, nullptr, nullptr, rows, cols, partials);
    STRATA_RETURN_IF_ERROR(Launched("ColumnPartialsKernel"));
  }
  ColumnFinishKernel<D>
      <<<GridFor(cols, kBlock), kBlock, 0, stream>>>(partials, P, cols, cols, 0, out);
  return Launched("ColumnFinishKernel");
}

#define STRATA_INSTANTIATE_LAYER_NORM(D)                                                         \
  template Status LaunchLayerNormForward<D>(cudaStream_t, const D*, const D*, const D*, int64_t, \
                                            int64_t, D*, float*, float*);                        \
  template Status LaunchLayerNormBackward<D>(cudaStream_t, const D*, const D*, const D*,         \
                                             const float*, const float*, const D*, int64_t,      \
                                             int64_t, D*);                                       \
  template Status LaunchLayerNormParamGrads<D>(cudaStream_t, const D*, const D*, const float*,   \
                                               const float*, int64_t, int64_t, float*, D*, D*);  \
  template Status LaunchColumnSums<D>(cudaStream_t, const D*, int64_t, int64_t, float*, D*);
STRATA_INSTANTIATE_LAYER_NORM(float)
STRATA_INSTANTIATE_LAYER_NORM(__half)
STRATA_INSTANTIATE_LAYER_NORM(__nv_bfloat16)
#undef STRATA_INSTANTIATE_LAYER_NORM

}  // namespace strata::models::ops::cuda
