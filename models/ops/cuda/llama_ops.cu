// RMSNorm, rotary embeddings and SwiGLU on CUDA (llama_ops.cuh): one warp per row for the
// normalisation, one thread per element (pair) for the elementwise ops.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/cuda/gpt_cuda_common.cuh"
#include "models/ops/cuda/llama_ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace strata::models::cuda::internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;
constexpr int kRowWarps = 8;  // rows (warps) per block of the row kernels

int RowGrid(int64_t rows) { return GridFor(rows, kRowWarps); }

#define STRATA_FOR_EACH_WARP_ROW(r, rows)                                                \
  for (int64_t r = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; r < (rows); \
       r += int64_t{gridDim.x} * blockDim.x / kWarp)
#define STRATA_FOR_EACH_INDEX(i, n)                                         \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

template <typename D>
__global__ void RmsNormForwardKernel(const D* x, const D* w, float eps, int64_t rows, int64_t C,
                                     D* y, float* rstd) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const D* xr = x + r * C;
    float sum_sq = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float v = ToF(xr[c]);
      sum_sq += v * v;
    }
    sum_sq = WarpSum(sum_sq);
    const float s = 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
    if (lane == 0) rstd[r] = s;
    D* yr = y + r * C;
    for (int64_t c = lane; c < C; c += kWarp) yr[c] = FromF<D>((ToF(xr[c]) * s) * ToF(w[c]));
  }
}

template <typename D>
__global__ void RmsNormBackwardKernel(const D* x, const D* w, const float* rstd, const D* dy,
                                      const D* dresidual, int64_t rows, int64_t C, D* dx) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const D* xr = x + r * C;
    const D* dr = dy + r * C;
    const float s = rstd[r];
    float gx = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      gx += ToF(dr[c]) * ToF(w[c]) * (ToF(xr[c]) * s);
    }
    const float gx_mean = WarpSum(gx) / static_cast<float>(C);
    // Every lane has read its dy (and below its dresidual) elements before any lane writes: the
    // warp sum above is a barrier for the dy reads; the residual of element c is read by the
    // lane that writes it.
    const D* res = dresidual != nullptr ? dresidual + r * C : nullptr;
    D* out = dx + r * C;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = ToF(xr[c]) * s;
      float v = s * (ToF(dr[c]) * ToF(w[c]) - xhat * gx_mean);
      if (res != nullptr) v = ToF(res[c]) + v;
      out[c] = FromF<D>(v);
    }
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

// Pass 2: dw[c] = D(sum over p in order of partials[p, c]).
template <typename D>
__global__ void SumPartialsKernel(const float* partials, int64_t num_partials, int64_t C, D* dw) {
  STRATA_FOR_EACH_INDEX(c, C) {
    float acc = 0.0f;
    for (int64_t p = 0; p < num_partials; ++p) acc += partials[p * C + c];
    dw[c] = FromF<D>(acc);
  }
}

struct RopeFreqs {
  double inv[kRopeMaxHeadDim / 2];
};

__global__ void RopeTableKernel(RopeFreqs f, int seq_len, int half, float* cos_out,
                                float* sin_out) {
  STRATA_FOR_EACH_INDEX(i, int64_t{seq_len} * half) {
    const double angle = static_cast<double>(i / half) * f.inv[i % half];
    cos_out[i] = static_cast<float>(cos(angle));
    sin_out[i] = static_cast<float>(sin(angle));
  }
}

// One thread per (row, head, pair i < hs/2).
template <typename D>
__global__ void RopeKernel(D* x, int64_t rows, int64_t row_stride, int num_heads, int half,
                           int seq_len, const float* cos, const float* sin, float sign) {
  const int64_t per_row = int64_t{num_heads} * half;
  STRATA_FOR_EACH_INDEX(idx, rows * per_row) {
    const int64_t r = idx / per_row;
    const int rem = static_cast<int>(idx % per_row);
    const int h = rem / half, i = rem % half;
    const int64_t t = r % seq_len;
    D* p = x + r * row_stride + int64_t{h} * 2 * half;
    const float c = cos[t * half + i], si = sign * sin[t * half + i];
    const float a = ToF(p[i]), b = ToF(p[i + half]);
    p[i] = FromF<D>(a * c - b * si);
    p[i + half] = FromF<D>(b * c + a * si);
  }
}

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
#undef STRATA_FOR_EACH_INDEX

Status CheckRows(const char* op, int64_t rows, int64_t C) {
  if (rows < 0 || C < 1) {
    return InvalidArgumentError(std::string(op) + ": need rows >= 0 and C >= 1");
  }
  return Status::Ok();
}

}  // namespace

template <typename D>
Status LaunchRmsNormForward(cudaStream_t stream, const D* x, const D* w, float eps, int64_t rows,
                            int64_t C, D* y, float* rstd) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchRmsNormForward", rows, C));
  if (!(eps > 0.0f)) return InvalidArgumentError("LaunchRmsNormForward: eps must be > 0");
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormForward", {x, w, y, rstd}));
  RmsNormForwardKernel<D>
      <<<RowGrid(rows), kRowWarps * kWarp, 0, stream>>>(x, w, eps, rows, C, y, rstd);
  return Launched("RmsNormForwardKernel");
}

template <typename D>
Status LaunchRmsNormBackward(cudaStream_t stream, const D* x, const D* w, const float* rstd,
                             const D* dy, const D* dresidual, int64_t rows, int64_t C, D* dx) {
  STRATA_RETURN_IF_ERROR(CheckRows("LaunchRmsNormBackward", rows, C));
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRmsNormBackward", {x, w, rstd, dy, dx}));
  RmsNormBackwardKernel<D>
      <<<RowGrid(rows), kRowWarps * kWarp, 0, stream>>>(x, w, rstd, dy, dresidual, rows, C, dx);
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

Status LaunchRopeTable(cudaStream_t stream, const RopeParams& p, int seq_len, float* cos,
                       float* sin) {
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > kRopeMaxHeadDim || seq_len < 1) {
    return InvalidArgumentError(
        "LaunchRopeTable: need an even head_dim in [2, 256] and seq_len >= 1");
  }
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRopeTable", {cos, sin}));
  const std::vector<double> inv = RopeInverseFrequencies(p);
  RopeFreqs f{};
  for (size_t i = 0; i < inv.size(); ++i) f.inv[i] = inv[i];
  const int half = p.head_dim / 2;
  RopeTableKernel<<<GridFor(int64_t{seq_len} * half, kBlock), kBlock, 0, stream>>>(f, seq_len, half,
                                                                                   cos, sin);
  return Launched("RopeTableKernel");
}

template <typename D>
Status LaunchRope(cudaStream_t stream, D* x, int64_t rows, int64_t row_stride, int num_heads,
                  int head_dim, int seq_len, const float* cos, const float* sin, bool inverse) {
  if (rows < 0 || num_heads < 1 || head_dim < 2 || head_dim % 2 != 0 || seq_len < 1 ||
      row_stride < int64_t{num_heads} * head_dim) {
    return InvalidArgumentError(
        "LaunchRope: need rows >= 0, num_heads >= 1, an even head_dim >= 2, seq_len >= 1 and "
        "row_stride >= num_heads head_dim");
  }
  if (rows == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRope", {x, cos, sin}));
  const int half = head_dim / 2;
  RopeKernel<D><<<GridFor(rows * num_heads * half, kBlock), kBlock, 0, stream>>>(
      x, rows, row_stride, num_heads, half, seq_len, cos, sin, inverse ? -1.0f : 1.0f);
  return Launched("RopeKernel");
}

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

#define STRATA_INSTANTIATE_LLAMA_OPS(D)                                                          \
  template Status LaunchRmsNormForward<D>(cudaStream_t, const D*, const D*, float, int64_t,      \
                                          int64_t, D*, float*);                                  \
  template Status LaunchRmsNormBackward<D>(cudaStream_t, const D*, const D*, const float*,       \
                                           const D*, const D*, int64_t, int64_t, D*);            \
  template Status LaunchRmsNormWeightGrad<D>(cudaStream_t, const D*, const float*, const D*,     \
                                             int64_t, int64_t, float*, D*);                      \
  template Status LaunchRope<D>(cudaStream_t, D*, int64_t, int64_t, int, int, int, const float*, \
                                const float*, bool);                                             \
  template Status LaunchSwigluForward<D>(cudaStream_t, const D*, int64_t, int64_t, D*);          \
  template Status LaunchSwigluBackward<D>(cudaStream_t, const D*, const D*, int64_t, int64_t, D*);
STRATA_INSTANTIATE_LLAMA_OPS(float)
STRATA_INSTANTIATE_LLAMA_OPS(__half)
STRATA_INSTANTIATE_LLAMA_OPS(__nv_bfloat16)
#undef STRATA_INSTANTIATE_LLAMA_OPS

}  // namespace strata::models::ops::cuda
