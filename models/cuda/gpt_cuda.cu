// CUDA kernels and blocks of the GPT; see gpt_cuda.cuh (ops) and gpt_cuda.h (blocks).
#include <algorithm>
#include <cstdint>
#include <string>

#include "base/dtype.h"
#include "gpu/cuda/cuda_gemm.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/cuda/cuda_status.h"
#include "models/cuda/gpt_cuda.cuh"
#include "models/cuda/gpt_cuda.h"
#include "models/cuda/gpt_cuda_layout.h"
#include "models/gpt_layout.h"

namespace strata::models::cuda {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
constexpr int kWarp = 32;
constexpr int kBlock = 256;          // threads per block of the elementwise kernels
constexpr int kRowsPerBlock = 4;     // warps (rows) per block of the row kernels
constexpr int64_t kMaxGrid = 65535;  // grid-stride beyond this many blocks
constexpr int kColLanes = 8;         // threads per column in the column sums
constexpr int kEmbedSlices = 64;     // slices of wte rows in the embedding backward

int GridFor(int64_t n, int64_t per_block) {
  return static_cast<int>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kMaxGrid));
}

Status Launched(const char* kernel) { return gpu::cuda::CudaStatus(cudaGetLastError(), kernel); }

Status CheckSizes(const char* op, std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s < 0) return InvalidArgumentError(std::string(op) + ": a size is negative");
  }
  return Status::Ok();
}

Status CheckPointers(const char* op, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (p == nullptr) {
      return InvalidArgumentError(std::string(op) + ": a required device pointer is null");
    }
  }
  return Status::Ok();
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The warp's row: global warp index, grid-stride over rows. Every lane of a warp gets
// the same row, so warp-wide shuffles are safe.
#define STRATA_FOR_EACH_WARP_ROW(row, rows)                                                  \
  for (int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; row < (rows); \
       row += int64_t{gridDim.x} * blockDim.x / kWarp)

#define STRATA_FOR_EACH_INDEX(i, n)                                         \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

__device__ __forceinline__ void CheckTokenOnDevice(int32_t token, int V) {
  if (token < 0 || token >= V) __trap();
}

// ---------------------------------------------------------------------------
// Kernels.

__global__ void EmbeddingForwardKernel(const float* wte, const float* wpe, const int32_t* tokens,
                                       int64_t N, int T, int64_t C, int V, float* x_out) {
  STRATA_FOR_EACH_INDEX(i, N * C) {
    const int64_t r = i / C, c = i % C;
    const int32_t tok = tokens[r];
    CheckTokenOnDevice(tok, V);
    x_out[i] = wte[tok * C + c] + wpe[(r % T) * C + c];
  }
}

// blockIdx.y: a slice of wte rows; thread: one column. Zeroes its elements, then adds
// the rows of dx_out whose token falls in the slice, in row order.
__global__ void EmbeddingBackwardWteKernel(const int32_t* tokens, const float* dx_out, int64_t N,
                                           int64_t C, int V, float* dwte) {
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int slice = (V + gridDim.y - 1) / gridDim.y;
  const int v0 = blockIdx.y * slice, v1 = min(V, v0 + slice);
  if (c >= C || v0 >= v1) return;
  for (int v = v0; v < v1; ++v) dwte[v * C + c] = 0.0f;
  for (int64_t r = 0; r < N; ++r) {
    const int32_t tok = tokens[r];
    CheckTokenOnDevice(tok, V);
    if (tok >= v0 && tok < v1) dwte[tok * C + c] += dx_out[r * C + c];
  }
}

// dwpe[t, c] = sum over sequences b (in order) of dx_out[b T + t, c]; 0 for t >= T.
__global__ void EmbeddingBackwardWpeKernel(const float* dx_out, int64_t N, int T, int64_t C,
                                           int max_seq_len, float* dwpe) {
  STRATA_FOR_EACH_INDEX(i, int64_t{max_seq_len} * C) {
    const int64_t t = i / C, c = i % C;
    float acc = 0.0f;
    if (t < T) {
      for (int64_t r = t; r < N; r += T) acc += dx_out[r * C + c];
    }
    dwpe[i] = acc;
  }
}

__global__ void LayerNormForwardKernel(const float* x, const float* w, const float* b, int64_t rows,
                                       int64_t C, float* y, float* mean, float* rstd) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const float* xr = x + r * C;
    float sum = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) sum += xr[c];
    const float m = WarpSum(sum) / static_cast<float>(C);
    float var = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) var += (xr[c] - m) * (xr[c] - m);
    var = WarpSum(var) / static_cast<float>(C);
    const float s = 1.0f / sqrtf(var + kLayerNormEps);
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
    float* yr = y + r * C;
    for (int64_t c = lane; c < C; c += kWarp) yr[c] = (xr[c] - m) * s * w[c] + b[c];
  }
}

__global__ void LayerNormApplyKernel(const float* x, const float* w, const float* b,
                                     const float* mean, const float* rstd, int64_t rows, int64_t C,
                                     float* y) {
  STRATA_FOR_EACH_INDEX(i, rows * C) {
    const int64_t r = i / C, c = i % C;
    y[i] = (x[i] - mean[r]) * rstd[r] * w[c] + b[c];
  }
}

// blockDim (32, kColLanes): thread (tx, ty) sums rows ty, ty + 8, ... of column
// blockIdx.x * 32 + tx; lane 0 of each column adds the 8 partials in order.
__global__ void LayerNormParamGradsKernel(const float* x, const float* dy, const float* mean,
                                          const float* rstd, int64_t rows, int64_t C, float* dw,
                                          float* db, bool accumulate) {
  __shared__ float part_w[kColLanes][kWarp];
  __shared__ float part_b[kColLanes][kWarp];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t{blockIdx.x} * kWarp + tx;
  float acc_w = 0.0f, acc_b = 0.0f;
  if (c < C) {
    for (int64_t r = ty; r < rows; r += kColLanes) {
      const float d = dy[r * C + c];
      acc_w += d * ((x[r * C + c] - mean[r]) * rstd[r]);
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
    dw[c] = accumulate ? dw[c] + sw : sw;
    db[c] = accumulate ? db[c] + sb : sb;
  }
}

// No __restrict__: dx may alias x, dy or residual (each lane reads an element before
// writing it, and the whole row is read by the sums before any write).
__global__ void LayerNormInputGradKernel(const float* x, const float* w, const float* dy,
                                         const float* mean, const float* rstd,
                                         const float* residual, int64_t rows, int64_t C,
                                         float* dx) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, rows) {
    const float* xr = x + r * C;
    const float* dr = dy + r * C;
    const float m = mean[r], s = rstd[r];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float g = dr[c] * w[c];
      g_sum += g;
      gx_sum += g * ((xr[c] - m) * s);
    }
    const float g_mean = WarpSum(g_sum) / static_cast<float>(C);
    const float gx_mean = WarpSum(gx_sum) / static_cast<float>(C);
    float* out = dx + r * C;
    const float* res = residual != nullptr ? residual + r * C : nullptr;
    for (int64_t c = lane; c < C; c += kWarp) {
      const float xhat = (xr[c] - m) * s;
      const float v = s * (dr[c] * w[c] - g_mean - xhat * gx_mean);
      out[c] = res != nullptr ? res[c] + v : v;
    }
  }
}

__global__ void RowsPlusBiasKernel(const float* x, const float* bias, int64_t rows, int64_t cols,
                                   float* out) {
  STRATA_FOR_EACH_INDEX(i, rows * cols) {
    const float bv = bias[i % cols];
    out[i] = x != nullptr ? x[i] + bv : bv;
  }
}

__global__ void ColumnSumsKernel(const float* x, int64_t rows, int64_t cols, float* out,
                                 bool accumulate) {
  __shared__ float part[kColLanes][kWarp];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t{blockIdx.x} * kWarp + tx;
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = ty; r < rows; r += kColLanes) acc += x[r * cols + c];
  }
  part[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float s = 0.0f;
    for (int k = 0; k < kColLanes; ++k) s += part[k][tx];
    out[c] = accumulate ? out[c] + s : s;
  }
}

__global__ void GeluForwardKernel(const float* x, int64_t n, float* y) {
  STRATA_FOR_EACH_INDEX(i, n) {
    const float v = x[i];
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    y[i] = 0.5f * v * (1.0f + tanhf(u));
  }
}

__global__ void GeluBackwardKernel(const float* x, const float* dy, int64_t n, float* dx) {
  STRATA_FOR_EACH_INDEX(i, n) {
    const float v = x[i];
    const float v2 = v * v;
    const float th = tanhf(kGeluScale * (v + kGeluCubic * v2 * v));
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v2);
    const float d = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] = dy[i] * d;
  }
}

__global__ void CausalSoftmaxForwardKernel(float* scores, int64_t num_rows, int T) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, num_rows) {
    float* row = scores + r * T;
    const int t = static_cast<int>(r % T);
    float mx = -INFINITY;
    for (int s = lane; s <= t; s += kWarp) mx = fmaxf(mx, row[s]);
    mx = WarpMax(mx);
    float sum = 0.0f;
    for (int s = lane; s <= t; s += kWarp) {
      const float e = expf(row[s] - mx);
      row[s] = e;
      sum += e;
    }
    const float inv = 1.0f / WarpSum(sum);
    for (int s = lane; s < T; s += kWarp) row[s] = s <= t ? row[s] * inv : 0.0f;
  }
}

__global__ void CausalSoftmaxBackwardKernel(float* probs, const float* dprobs, int64_t num_rows,
                                            int T) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, num_rows) {
    float* row = probs + r * T;
    const float* drow = dprobs + r * T;
    const int t = static_cast<int>(r % T);
    float dot = 0.0f;
    for (int s = lane; s <= t; s += kWarp) dot += row[s] * drow[s];
    dot = WarpSum(dot);
    for (int s = lane; s < T; s += kWarp) row[s] = s <= t ? row[s] * (drow[s] - dot) : 0.0f;
  }
}

__global__ void CrossEntropyForwardKernel(const float* logits, const int32_t* targets, int64_t N,
                                          int V, float* losses) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, N) {
    const int32_t target = targets[r];
    CheckTokenOnDevice(target, V);
    const float* row = logits + r * V;
    float mx = -INFINITY;
    for (int v = lane; v < V; v += kWarp) mx = fmaxf(mx, row[v]);
    mx = WarpMax(mx);
    float sum = 0.0f;
    for (int v = lane; v < V; v += kWarp) sum += expf(row[v] - mx);
    sum = WarpSum(sum);
    if (lane == 0) losses[r] = logf(sum) + mx - row[target];
  }
}

// One block of kBlock threads: thread i sums losses i, i + kBlock, ... in double, then a
// fixed shared-memory tree.
__global__ void MeanLossKernel(const float* losses, int64_t N, float* loss) {
  __shared__ double part[kBlock];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += kBlock) acc += losses[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = static_cast<float>(part[0] / static_cast<double>(N));
}

__global__ void CrossEntropyBackwardKernel(float* logits, const int32_t* targets, int64_t N, int V,
                                           float scale) {
  const int lane = threadIdx.x % kWarp;
  STRATA_FOR_EACH_WARP_ROW(r, N) {
    const int32_t target = targets[r];
    CheckTokenOnDevice(target, V);
    float* row = logits + r * V;
    float mx = -INFINITY;
    for (int v = lane; v < V; v += kWarp) mx = fmaxf(mx, row[v]);
    mx = WarpMax(mx);
    float sum = 0.0f;
    for (int v = lane; v < V; v += kWarp) {
      const float e = expf(row[v] - mx);
      row[v] = e;
      sum += e;
    }
    const float factor = scale / WarpSum(sum);
    for (int v = lane; v < V; v += kWarp) row[v] *= factor;
    __syncwarp();
    if (lane == 0) row[target] -= scale;
    __syncwarp();
  }
}

#undef STRATA_FOR_EACH_WARP_ROW
#undef STRATA_FOR_EACH_INDEX

int WarpRowGrid(int64_t rows) { return GridFor(rows, kRowsPerBlock); }
constexpr int kWarpRowThreads = kRowsPerBlock * kWarp;

}  // namespace

// ---------------------------------------------------------------------------
// Op launchers.

Status LaunchEmbeddingForward(cudaStream_t stream, const float* wte, const float* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V,
                              float* x_out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingForward", {N, C}));
  if (T < 1 || V < 1) return InvalidArgumentError("LaunchEmbeddingForward: T and V must be >= 1");
  if (N == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingForward", {wte, wpe, tokens, x_out}));
  EmbeddingForwardKernel<<<GridFor(N * C, kBlock), kBlock, 0, stream>>>(wte, wpe, tokens, N, T, C,
                                                                        V, x_out);
  return Launched("EmbeddingForwardKernel");
}

Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const float* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, float* dwte,
                               float* dwpe) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingBackward", {N, C}));
  if (T < 1 || V < 1 || max_seq_len < T) {
    return InvalidArgumentError(
        "LaunchEmbeddingBackward: need T >= 1, V >= 1 and max_seq_len >= T");
  }
  if (N % T != 0) {
    return InvalidArgumentError(
        "LaunchEmbeddingBackward: N must be a multiple of T (whole "
        "sequences)");
  }
  if (C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {dwte, dwpe}));
  if (N > 0) STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {tokens, dx_out}));
  const dim3 grid(static_cast<unsigned>((C + kBlock - 1) / kBlock),
                  static_cast<unsigned>(std::min(V, kEmbedSlices)));
  EmbeddingBackwardWteKernel<<<grid, kBlock, 0, stream>>>(tokens, dx_out, N, C, V, dwte);
  STRATA_RETURN_IF_ERROR(Launched("EmbeddingBackwardWteKernel"));
  EmbeddingBackwardWpeKernel<<<GridFor(int64_t{max_seq_len} * C, kBlock), kBlock, 0, stream>>>(
      dx_out, N, T, C, max_seq_len, dwpe);
  return Launched("EmbeddingBackwardWpeKernel");
}

Status LaunchLayerNormForward(cudaStream_t stream, const float* x, const float* w, const float* b,
                              int64_t rows, int64_t C, float* y, float* mean, float* rstd) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormForward", {rows, C}));
  if (rows == 0) return Status::Ok();
  if (C < 1) return InvalidArgumentError("LaunchLayerNormForward: C must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormForward", {x, w, b, y, mean, rstd}));
  LayerNormForwardKernel<<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(x, w, b, rows, C, y,
                                                                            mean, rstd);
  return Launched("LayerNormForwardKernel");
}

Status LaunchLayerNormApply(cudaStream_t stream, const float* x, const float* w, const float* b,
                            const float* mean, const float* rstd, int64_t rows, int64_t C,
                            float* y) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormApply", {rows, C}));
  if (rows == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormApply", {x, w, b, mean, rstd, y}));
  LayerNormApplyKernel<<<GridFor(rows * C, kBlock), kBlock, 0, stream>>>(x, w, b, mean, rstd, rows,
                                                                         C, y);
  return Launched("LayerNormApplyKernel");
}

Status LaunchLayerNormParamGrads(cudaStream_t stream, const float* x, const float* dy,
                                 const float* mean, const float* rstd, int64_t rows, int64_t C,
                                 float* dw, float* db, bool accumulate) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormParamGrads", {rows, C}));
  if (C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormParamGrads", {dw, db}));
  if (rows > 0) {
    STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormParamGrads", {x, dy, mean, rstd}));
  }
  LayerNormParamGradsKernel<<<static_cast<unsigned>((C + kWarp - 1) / kWarp),
                              dim3(kWarp, kColLanes), 0, stream>>>(x, dy, mean, rstd, rows, C, dw,
                                                                   db, accumulate);
  return Launched("LayerNormParamGradsKernel");
}

Status LaunchLayerNormInputGrad(cudaStream_t stream, const float* x, const float* w,
                                const float* dy, const float* mean, const float* rstd,
                                const float* residual, int64_t rows, int64_t C, float* dx) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchLayerNormInputGrad", {rows, C}));
  if (rows == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchLayerNormInputGrad", {x, w, dy, mean, rstd, dx}));
  LayerNormInputGradKernel<<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(
      x, w, dy, mean, rstd, residual, rows, C, dx);
  return Launched("LayerNormInputGradKernel");
}

Status LaunchRowsPlusBias(cudaStream_t stream, const float* x, const float* bias, int64_t rows,
                          int64_t cols, float* out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchRowsPlusBias", {rows, cols}));
  if (rows == 0 || cols == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchRowsPlusBias", {bias, out}));
  RowsPlusBiasKernel<<<GridFor(rows * cols, kBlock), kBlock, 0, stream>>>(x, bias, rows, cols, out);
  return Launched("RowsPlusBiasKernel");
}

Status LaunchColumnSums(cudaStream_t stream, const float* x, int64_t rows, int64_t cols, float* out,
                        bool accumulate) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchColumnSums", {rows, cols}));
  if (cols == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchColumnSums", {out}));
  if (rows > 0) STRATA_RETURN_IF_ERROR(CheckPointers("LaunchColumnSums", {x}));
  ColumnSumsKernel<<<static_cast<unsigned>((cols + kWarp - 1) / kWarp), dim3(kWarp, kColLanes), 0,
                     stream>>>(x, rows, cols, out, accumulate);
  return Launched("ColumnSumsKernel");
}

Status LaunchGeluForward(cudaStream_t stream, const float* x, int64_t n, float* y) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchGeluForward", {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchGeluForward", {x, y}));
  GeluForwardKernel<<<GridFor(n, kBlock), kBlock, 0, stream>>>(x, n, y);
  return Launched("GeluForwardKernel");
}

Status LaunchGeluBackward(cudaStream_t stream, const float* x, const float* dy, int64_t n,
                          float* dx) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchGeluBackward", {n}));
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchGeluBackward", {x, dy, dx}));
  GeluBackwardKernel<<<GridFor(n, kBlock), kBlock, 0, stream>>>(x, dy, n, dx);
  return Launched("GeluBackwardKernel");
}

Status LaunchCausalSoftmaxForward(cudaStream_t stream, float* scores, int64_t num_mats, int T) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCausalSoftmaxForward", {num_mats, T}));
  if (num_mats == 0 || T == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCausalSoftmaxForward", {scores}));
  const int64_t rows = num_mats * T;
  CausalSoftmaxForwardKernel<<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(scores, rows, T);
  return Launched("CausalSoftmaxForwardKernel");
}

Status LaunchCausalSoftmaxBackward(cudaStream_t stream, float* probs, const float* dprobs,
                                   int64_t num_mats, int T) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCausalSoftmaxBackward", {num_mats, T}));
  if (num_mats == 0 || T == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCausalSoftmaxBackward", {probs, dprobs}));
  const int64_t rows = num_mats * T;
  CausalSoftmaxBackwardKernel<<<WarpRowGrid(rows), kWarpRowThreads, 0, stream>>>(probs, dprobs,
                                                                                 rows, T);
  return Launched("CausalSoftmaxBackwardKernel");
}

Status LaunchCrossEntropyForward(cudaStream_t stream, const float* logits, const int32_t* targets,
                                 int64_t N, int V, float* losses) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCrossEntropyForward", {N}));
  if (V < 1) return InvalidArgumentError("LaunchCrossEntropyForward: V must be >= 1");
  if (N == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCrossEntropyForward", {logits, targets, losses}));
  CrossEntropyForwardKernel<<<WarpRowGrid(N), kWarpRowThreads, 0, stream>>>(logits, targets, N, V,
                                                                            losses);
  return Launched("CrossEntropyForwardKernel");
}

Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, float* loss) {
  if (N < 1) return InvalidArgumentError("LaunchMeanLoss: N must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchMeanLoss", {losses, loss}));
  MeanLossKernel<<<1, kBlock, 0, stream>>>(losses, N, loss);
  return Launched("MeanLossKernel");
}

Status LaunchCrossEntropyBackward(cudaStream_t stream, float* logits, const int32_t* targets,
                                  int64_t N, int V, float scale) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCrossEntropyBackward", {N}));
  if (V < 1) return InvalidArgumentError("LaunchCrossEntropyBackward: V must be >= 1");
  if (N == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCrossEntropyBackward", {logits, targets}));
  CrossEntropyBackwardKernel<<<WarpRowGrid(N), kWarpRowThreads, 0, stream>>>(logits, targets, N, V,
                                                                             scale);
  return Launched("CrossEntropyBackwardKernel");
}

// ---------------------------------------------------------------------------
// Blocks.

namespace {

// The stream the matrix products go to, with how they may compute (GptCudaOptions).
struct Matmul {
  gpu::Stream& stream;
  gpu::cuda::GemmOptions options;
};

// Row-major fp32 GEMM, fp32 accumulate; TF32 only with options.allow_tf32 (cuda_gemm.h).
Status Gemm(const Matmul& s, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
            const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
            int64_t ldc) {
  return gpu::cuda::Gemm(s.stream, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                         DType::kF32, DType::kF32, s.options);
}

Status GemmBatched(const Matmul& s, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb, int64_t sb,
                   float beta, float* C, int64_t ldc, int64_t sc, int64_t batch) {
  return gpu::cuda::GemmStridedBatched(s.stream, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb,
                                       beta, C, ldc, sc, batch, DType::kF32, DType::kF32,
                                       s.options);
}

// Checks B and T and makes the stream's device current; returns its cudaStream_t.
StatusOr<cudaStream_t> Prepare(const char* what, const GptShape& s, gpu::Stream& stream, int B,
                               int T) {
  STRATA_RETURN_IF_ERROR(ValidateShape(s));
  if (B < 1 || T < 1 || T > s.max_seq_len) {
    return InvalidArgumentError(
        std::string(what) + ": need B >= 1 and 1 <= T <= max_seq_len, got B=" + std::to_string(B) +
        " T=" + std::to_string(T) + " max_seq_len=" + std::to_string(s.max_seq_len));
  }
  STRATA_RETURN_IF_ERROR(gpu::CublasHandle(stream).status());  // also cudaSetDevice
  return gpu::NativeStream(stream);
}

// The scratch regions of a micro-batch (gpt_cuda_layout.h) as pointers.
struct LayerScratch {
  float* mean1;  // (R)
  float* rstd1;  // (R)
  float* mean2;  // (R)
  float* rstd2;  // (R)
  float* qkv;    // (R, 3C)
  float* probs;  // (G, H, T, T)
  float* work;   // CudaLayerWorkLayout
};

LayerScratch CarveLayerScratch(const GptShape& s, int B, int T, float* scratch) {
  const CudaLayerScratchLayout l = CudaLayerScratchLayoutFor(s, B, T);
  return {scratch + l.mean1.offset, scratch + l.rstd1.offset, scratch + l.mean2.offset,
          scratch + l.rstd2.offset, scratch + l.qkv.offset,   scratch + l.probs.offset,
          scratch + l.work.offset};
}

// Device pointers of the attention's buffers (AttnBuffer order); read through `in`,
// written through `out` (null where a buffer is read-only in that pass).
struct AttnBuffers {
  const float* in[kNumAttnBuffers] = {};
  float* out[kNumAttnBuffers] = {};
};

// One attention GEMM of gpt_cuda_layout.h on the device.
Status RunAttnGemm(const Matmul& s, const AttnGemm& g, const AttnBuffers& p) {
  auto in = [&p](const AttnOperand& o) { return p.in[static_cast<int>(o.buffer)] + o.offset; };
  float* c = p.out[static_cast<int>(g.c.buffer)];
  STRATA_CHECK_MSG(c != nullptr && p.in[static_cast<int>(g.a.buffer)] != nullptr &&
                       p.in[static_cast<int>(g.b.buffer)] != nullptr,
                   "attention GEMM on a buffer that this pass does not provide");
  return GemmBatched(s, g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, in(g.a), g.a.ld, g.a.stride,
                     in(g.b), g.b.ld, g.b.stride, 0.0f, c + g.c.offset, g.c.ld, g.c.stride,
                     g.batch);
}

// probs (seqs, H, T, T) = causal softmax(scale q k^T) per (sequence, head), then
// y (seqs, T, C) = probs v. One strided-batched GEMM per head over the sequences.
Status AttentionForward(const Matmul& s, cudaStream_t cs, const AttnShape& d, const float* qkv,
                        float* probs, float* y) {
  AttnBuffers p;
  p.in[static_cast<int>(AttnBuffer::kQkv)] = qkv;
  p.in[static_cast<int>(AttnBuffer::kProbs)] = probs;
  p.out[static_cast<int>(AttnBuffer::kProbs)] = probs;
  p.out[static_cast<int>(AttnBuffer::kOut)] = y;
  for (int64_t h = 0; h < d.H; ++h) STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnScoresGemm(d, h), p));
  STRATA_RETURN_IF_ERROR(
      LaunchCausalSoftmaxForward(cs, probs, d.seqs * d.H, static_cast<int>(d.T)));
  for (int64_t h = 0; h < d.H; ++h) STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnValuesGemm(d, h), p));
  return Status::Ok();
}

// y recomputed from the saved probabilities.
Status AttentionValues(const Matmul& s, const AttnShape& d, const float* qkv, const float* probs,
                       float* y) {
  AttnBuffers p;
  p.in[static_cast<int>(AttnBuffer::kQkv)] = qkv;
  p.in[static_cast<int>(AttnBuffer::kProbs)] = probs;
  p.out[static_cast<int>(AttnBuffer::kOut)] = y;
  for (int64_t h = 0; h < d.H; ++h) STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnValuesGemm(d, h), p));
  return Status::Ok();
}

// dqkv (seqs, T, 3C) from dy (seqs, T, C). probs is overwritten with the score
// gradients; dprobs: seqs H T T elements of scratch.
Status AttentionBackward(const Matmul& s, cudaStream_t cs, const AttnShape& d, const float* qkv,
                         float* probs, const float* dy, float* dqkv, float* dprobs) {
  AttnBuffers p;
  p.in[static_cast<int>(AttnBuffer::kQkv)] = qkv;
  p.in[static_cast<int>(AttnBuffer::kProbs)] = probs;
  p.in[static_cast<int>(AttnBuffer::kOut)] = dy;
  p.in[static_cast<int>(AttnBuffer::kDprobs)] = dprobs;
  p.out[static_cast<int>(AttnBuffer::kDqkv)] = dqkv;
  p.out[static_cast<int>(AttnBuffer::kDprobs)] = dprobs;
  for (int64_t h = 0; h < d.H; ++h) {
    STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnGradValuesGemm(d, h), p));  // dv = p^T dy
    STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnGradProbsGemm(d, h), p));   // dp = dy v^T
  }
  STRATA_RETURN_IF_ERROR(
      LaunchCausalSoftmaxBackward(cs, probs, dprobs, d.seqs * d.H, static_cast<int>(d.T)));
  for (int64_t h = 0; h < d.H; ++h) {
    STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnGradQueriesGemm(d, h), p));  // dq = scale ds k
    STRATA_RETURN_IF_ERROR(RunAttnGemm(s, AttnGradKeysGemm(d, h), p));     // dk = scale ds^T q
  }
  return Status::Ok();
}

// Forward of one group, as the host's LayerForwardGroup: x (r, C) -> x2 (written to
// x2); with mlp_output x2 becomes the layer output, else it stops after the GELU
// (fch and gelu of CudaLayerWorkLayout then hold what the backward needs).
Status LayerForwardGroup(const Matmul& s, cudaStream_t cs, const GptShape& shape,
                         const LayerParams<const float*>& p, const float* x, float* x2,
                         int64_t seqs, int T, const LayerScratch& sc, bool mlp_output) {
  const int64_t C = shape.channels, r = seqs * T;
  const AttnShape dims{seqs, T, C, shape.num_heads};
  const CudaLayerWorkLayout wl = CudaLayerWorkLayoutFor(shape, seqs, T);
  float* ln1 = sc.work + wl.ln1.offset;
  float* atty = sc.work + wl.atty.offset;
  float* fch = sc.work + wl.fch.offset;
  float* ln2 = sc.work + wl.ln2.offset;
  float* gelu = sc.work + wl.gelu.offset;

  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormForward(cs, x, p.ln1_w, p.ln1_b, r, C, ln1, sc.mean1, sc.rstd1));
  STRATA_RETURN_IF_ERROR(LaunchRowsPlusBias(cs, nullptr, p.qkv_b, r, 3 * C, sc.qkv));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, false, r, 3 * C, C, 1.0f, ln1, C, p.qkv_w, 3 * C, 1.0f, sc.qkv, 3 * C));
  STRATA_RETURN_IF_ERROR(AttentionForward(s, cs, dims, sc.qkv, sc.probs, atty));
  STRATA_RETURN_IF_ERROR(LaunchRowsPlusBias(cs, x, p.attn_proj_b, r, C, x2));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, false, r, C, C, 1.0f, atty, C, p.attn_proj_w, C, 1.0f, x2, C));

  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormForward(cs, x2, p.ln2_w, p.ln2_b, r, C, ln2, sc.mean2, sc.rstd2));
  STRATA_RETURN_IF_ERROR(LaunchRowsPlusBias(cs, nullptr, p.fc_b, r, 4 * C, fch));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, false, r, 4 * C, C, 1.0f, ln2, C, p.fc_w, 4 * C, 1.0f, fch, 4 * C));
  STRATA_RETURN_IF_ERROR(LaunchGeluForward(cs, fch, r * 4 * C, gelu));
  if (mlp_output) {
    STRATA_RETURN_IF_ERROR(LaunchRowsPlusBias(cs, x2, p.mlp_proj_b, r, C, x2));
    STRATA_RETURN_IF_ERROR(
        Gemm(s, false, false, r, C, 4 * C, 1.0f, gelu, 4 * C, p.mlp_proj_w, C, 1.0f, x2, C));
  }
  return Status::Ok();
}

// Backward of one group, as the host's LayerBackwardGroup. dx first holds x2.
Status LayerBackwardGroup(const Matmul& s, cudaStream_t cs, const GptShape& shape,
                          const LayerParams<const float*>& p, const LayerParams<float*>& dp,
                          const float* x, const float* dout, float* dx, int64_t seqs, int T,
                          const LayerScratch& sc, bool accumulate) {
  const int64_t C = shape.channels, r = seqs * T;
  const AttnShape dims{seqs, T, C, shape.num_heads};
  const CudaLayerWorkLayout wl = CudaLayerWorkLayoutFor(shape, seqs, T);
  const float beta = accumulate ? 1.0f : 0.0f;
  float* w = sc.work;

  STRATA_RETURN_IF_ERROR(LayerForwardGroup(s, cs, shape, p, x, dx, seqs, T, sc, false));
  const float* x2 = dx;

  // MLP projection.
  float* fch = w + wl.fch.offset;
  float* gelu = w + wl.gelu.offset;
  STRATA_RETURN_IF_ERROR(
      Gemm(s, true, false, 4 * C, C, r, 1.0f, gelu, 4 * C, dout, C, beta, dp.mlp_proj_w, C));
  STRATA_RETURN_IF_ERROR(LaunchColumnSums(cs, dout, r, C, dp.mlp_proj_b, accumulate));
  float* dfch = w + wl.dfch.offset;  // replaces gelu
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, true, r, 4 * C, C, 1.0f, dout, C, p.mlp_proj_w, C, 0.0f, dfch, 4 * C));
  STRATA_RETURN_IF_ERROR(LaunchGeluBackward(cs, fch, dfch, r * 4 * C, dfch));

  // MLP fc; ln2 recomputed over the dead fch.
  STRATA_RETURN_IF_ERROR(LaunchColumnSums(cs, dfch, r, 4 * C, dp.fc_b, accumulate));
  float* ln2 = w + wl.ln2_again.offset;
  float* dln2 = w + wl.dln2.offset;
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormApply(cs, x2, p.ln2_w, p.ln2_b, sc.mean2, sc.rstd2, r, C, ln2));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, true, false, C, 4 * C, r, 1.0f, ln2, C, dfch, 4 * C, beta, dp.fc_w, 4 * C));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, true, r, C, 4 * C, 1.0f, dfch, 4 * C, p.fc_w, 4 * C, 0.0f, dln2, C));

  // LayerNorm 2 and the MLP residual: dx <- dout + d(ln2)/d(x2), over x2.
  STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs, x2, dln2, sc.mean2, sc.rstd2, r, C, dp.ln2_w,
                                                   dp.ln2_b, accumulate));
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormInputGrad(cs, x2, p.ln2_w, dln2, sc.mean2, sc.rstd2, dout, r, C, dx));

  // Attention projection; atty recomputed.
  float* atty = w + wl.atty_again.offset;
  float* datty = w + wl.datty.offset;
  STRATA_RETURN_IF_ERROR(AttentionValues(s, dims, sc.qkv, sc.probs, atty));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, true, false, C, C, r, 1.0f, atty, C, dx, C, beta, dp.attn_proj_w, C));
  STRATA_RETURN_IF_ERROR(LaunchColumnSums(cs, dx, r, C, dp.attn_proj_b, accumulate));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, true, r, C, C, 1.0f, dx, C, p.attn_proj_w, C, 0.0f, datty, C));

  // Attention core: dqkv, then the probability gradients of the whole group.
  float* dqkv = w + wl.dqkv.offset;
  float* dprobs = w + wl.dprobs.offset;
  STRATA_RETURN_IF_ERROR(AttentionBackward(s, cs, dims, sc.qkv, sc.probs, datty, dqkv, dprobs));

  // qkv = ln1 Wqkv + bqkv; ln1 recomputed.
  STRATA_RETURN_IF_ERROR(LaunchColumnSums(cs, dqkv, r, 3 * C, dp.qkv_b, accumulate));
  float* ln1 = w + wl.ln1_again.offset;
  float* dln1 = w + wl.dln1.offset;
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormApply(cs, x, p.ln1_w, p.ln1_b, sc.mean1, sc.rstd1, r, C, ln1));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, true, false, C, 3 * C, r, 1.0f, ln1, C, dqkv, 3 * C, beta, dp.qkv_w, 3 * C));
  STRATA_RETURN_IF_ERROR(
      Gemm(s, false, true, r, C, 3 * C, 1.0f, dqkv, 3 * C, p.qkv_w, 3 * C, 0.0f, dln1, C));

  // LayerNorm 1 and the attention residual: dx += d(ln1)/dx.
  STRATA_RETURN_IF_ERROR(LaunchLayerNormParamGrads(cs, x, dln1, sc.mean1, sc.rstd1, r, C, dp.ln1_w,
                                                   dp.ln1_b, accumulate));
  return LaunchLayerNormInputGrad(cs, x, p.ln1_w, dln1, sc.mean1, sc.rstd1, dx, r, C, dx);
}

}  // namespace

Status CudaPrepareStream(gpu::Stream& stream) { return gpu::CublasHandle(stream).status(); }

Status CudaEmbeddingForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                            const int32_t* tokens, int B, int T, float* x_out) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaEmbeddingForward", shape, stream, B, T));
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaEmbeddingForward", {params, tokens, x_out}));
  const int64_t C = shape.channels;
  return LaunchEmbeddingForward(cs, params, params + int64_t{shape.vocab_size} * C, tokens,
                                int64_t{B} * T, T, C, shape.vocab_size, x_out);
}

Status CudaEmbeddingBackward(const GptShape& shape, gpu::Stream& stream, const int32_t* tokens,
                             const float* dx_out, int B, int T, float* dparams) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaEmbeddingBackward", shape, stream, B, T));
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaEmbeddingBackward", {tokens, dx_out, dparams}));
  const int64_t C = shape.channels;
  return LaunchEmbeddingBackward(cs, tokens, dx_out, int64_t{B} * T, T, C, shape.vocab_size,
                                 shape.max_seq_len, dparams,
                                 dparams + int64_t{shape.vocab_size} * C);
}

Status CudaLayerForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                        const float* x_in, float* x_out, int B, int T, float* scratch,
                        const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaLayerForward", shape, stream, B, T));
  const Matmul mm{stream, {.allow_tf32 = options.allow_tf32}};
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaLayerForward", {params, x_in, x_out, scratch}));
  const int64_t C = shape.channels, G = CudaLayerGroupSeqs(B, T);
  const LayerParams<const float*> p(params, C);
  const LayerScratch sc = CarveLayerScratch(shape, B, T, scratch);
  for (int64_t b0 = 0; b0 < B; b0 += G) {
    const int64_t seqs = std::min<int64_t>(G, B - b0), off = b0 * T * C;
    STRATA_RETURN_IF_ERROR(
        LayerForwardGroup(mm, cs, shape, p, x_in + off, x_out + off, seqs, T, sc, true));
  }
  return Status::Ok();
}

Status CudaLayerBackward(const GptShape& shape, gpu::Stream& stream, const float* params,
                         const float* x_in, const float* dx_out, float* dx_in, float* dparams,
                         int B, int T, float* scratch, const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaLayerBackward", shape, stream, B, T));
  const Matmul mm{stream, {.allow_tf32 = options.allow_tf32}};
  STRATA_RETURN_IF_ERROR(
      CheckPointers("CudaLayerBackward", {params, x_in, dx_out, dx_in, dparams, scratch}));
  const int64_t C = shape.channels, G = CudaLayerGroupSeqs(B, T);
  const LayerParams<const float*> p(params, C);
  const LayerParams<float*> dp(dparams, C);
  const LayerScratch sc = CarveLayerScratch(shape, B, T, scratch);
  for (int64_t b0 = 0; b0 < B; b0 += G) {
    const int64_t seqs = std::min<int64_t>(G, B - b0), off = b0 * T * C;
    STRATA_RETURN_IF_ERROR(LayerBackwardGroup(mm, cs, shape, p, dp, x_in + off, dx_out + off,
                                              dx_in + off, seqs, T, sc, b0 > 0));
  }
  return Status::Ok();
}

Status CudaHeadForward(const GptShape& shape, gpu::Stream& stream, const float* params,
                       const float* x_in, const int32_t* targets, int B, int T, float* logits,
                       float* scratch, float* loss, const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaHeadForward", shape, stream, B, T));
  const Matmul mm{stream, {.allow_tf32 = options.allow_tf32}};
  STRATA_RETURN_IF_ERROR(CheckPointers("CudaHeadForward", {params, x_in, logits, scratch}));
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  float* lnf = scratch;
  float* mean = lnf + N * C;
  float* rstd = mean + N;
  float* losses = rstd + N;
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormForward(cs, x_in, params, params + C, N, C, lnf, mean, rstd));
  STRATA_RETURN_IF_ERROR(
      Gemm(mm, false, false, N, V, C, 1.0f, lnf, C, params + 2 * C, V, 0.0f, logits, V));
  if (targets == nullptr || loss == nullptr) return Status::Ok();
  STRATA_RETURN_IF_ERROR(
      LaunchCrossEntropyForward(cs, logits, targets, N, static_cast<int>(V), losses));
  return LaunchMeanLoss(cs, losses, N, loss);
}

Status CudaHeadBackward(const GptShape& shape, gpu::Stream& stream, const float* params,
                        const float* x_in, const int32_t* targets, float dloss, int B, int T,
                        float* dx_in, float* dparams, float* logits, float* scratch,
                        const GptCudaOptions& options) {
  STRATA_ASSIGN_OR_RETURN(cudaStream_t cs, Prepare("CudaHeadBackward", shape, stream, B, T));
  const Matmul mm{stream, {.allow_tf32 = options.allow_tf32}};
  STRATA_RETURN_IF_ERROR(
      CheckPointers("CudaHeadBackward", {params, x_in, targets, dx_in, dparams, logits, scratch}));
  const int64_t C = shape.channels, V = shape.vocab_size, N = int64_t{B} * T;
  const float* lnf_w = params;
  const float* wlm = params + 2 * C;
  float* lnf = scratch;
  float* mean = lnf + N * C;
  float* rstd = mean + N;
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormForward(cs, x_in, lnf_w, params + C, N, C, lnf, mean, rstd));
  STRATA_RETURN_IF_ERROR(Gemm(mm, false, false, N, V, C, 1.0f, lnf, C, wlm, V, 0.0f, logits, V));
  STRATA_RETURN_IF_ERROR(LaunchCrossEntropyBackward(cs, logits, targets, N, static_cast<int>(V),
                                                    dloss / static_cast<float>(N)));
  float* dlnf_w = dparams;
  float* dlnf_b = dparams + C;
  float* dwlm = dparams + 2 * C;
  STRATA_RETURN_IF_ERROR(Gemm(mm, true, false, C, V, N, 1.0f, lnf, C, logits, V, 0.0f, dwlm, V));
  STRATA_RETURN_IF_ERROR(Gemm(mm, false, true, N, C, V, 1.0f, logits, V, wlm, V, 0.0f, dx_in, C));
  STRATA_RETURN_IF_ERROR(
      LaunchLayerNormParamGrads(cs, x_in, dx_in, mean, rstd, N, C, dlnf_w, dlnf_b, false));
  return LaunchLayerNormInputGrad(cs, x_in, lnf_w, dx_in, mean, rstd, nullptr, N, C, dx_in);
}

}  // namespace strata::models::cuda
