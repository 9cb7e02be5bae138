// Embedding, LayerNorm, column sums and cross-entropy kernels of the GPT; see gpt_cuda.cuh.
#include <cstdint>

#include "models/cuda/gpt_cuda.cuh"
#include "models/cuda/gpt_cuda_common.cuh"
#include "models/cuda/gpt_cuda_layout.h"

namespace strata::models::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr float kLayerNormEps = 1e-5f;
constexpr int kBlock = 256;       // threads of the elementwise kernels
constexpr int kRowsPerBlock = 4;  // warps (rows) per block of the row kernels
constexpr int kColLanes = 8;      // row lanes per column in the column reductions
constexpr int kPlaceThreads = 1024;
constexpr int kScanThreads = 1024;

#define STRATA_FOR_EACH_WARP_ROW(row, rows)                                                  \
  for (int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; row < (rows); \
       row += int64_t{gridDim.x} * blockDim.x / kWarp)

#define STRATA_FOR_EACH_INDEX(i, n)                                         \
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

int WarpRowGrid(int64_t rows) { return GridFor(rows, kRowsPerBlock); }
constexpr int kWarpRowThreads = kRowsPerBlock * kWarp;

// ---------------------------------------------------------------------------
// Embedding.

template <typename D>
__global__ void EmbeddingForwardKernel(const D* wte, const D* wpe, const int32_t* tokens, int64_t N,
                                       int T, int64_t C, int V, D* x_out) {
  STRATA_FOR_EACH_INDEX(i, N * C) {
    const int64_t r = i / C, c = i % C;
    const int32_t tok = tokens[r];
    CheckTokenOnDevice(tok, V);
    // Without wpe (the Llama family) the row is copied exactly.
    x_out[i] = wpe == nullptr ? wte[tok * C + c]
                              : FromF<D>(ToF(wte[tok * C + c]) + ToF(wpe[(r % T) * C + c]));
  }
}

__global__ void CountTokensKernel(const int32_t* tokens, int64_t N, int V, int32_t* counts) {
  STRATA_FOR_EACH_INDEX(r, N) {
    const int32_t tok = tokens[r];
    CheckTokenOnDevice(tok, V);
    atomicAdd(&counts[tok], 1);  // integer counts: the same whatever the order
  }
}

// One block: offsets[v] = sum of counts[0, v), offsets[V] = N; cursor = offsets[0, V).
__global__ void ScanCountsKernel(const int32_t* counts, int V, int32_t* offsets, int32_t* cursor) {
  __shared__ int32_t sums[kScanThreads];
  const int per = (V + kScanThreads - 1) / kScanThreads;
  const int v0 = min(V, static_cast<int>(threadIdx.x) * per), v1 = min(V, v0 + per);
  int32_t local = 0;
  for (int v = v0; v < v1; ++v) local += counts[v];
  sums[threadIdx.x] = local;
  __syncthreads();
  for (int o = 1; o < kScanThreads; o *= 2) {  // inclusive Hillis-Steele scan
    const int32_t add = threadIdx.x >= o ? sums[threadIdx.x - o] : 0;
    __syncthreads();
    sums[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t run = threadIdx.x > 0 ? sums[threadIdx.x - 1] : 0;
  for (int v = v0; v < v1; ++v) {
    offsets[v] = run;
    cursor[v] = run;
    run += counts[v];
  }
  if (threadIdx.x == kScanThreads - 1) offsets[V] = sums[kScanThreads - 1];
}

// One block, stable: rows are placed in chunks of kPlaceThreads, warp by warp in order; in a
// warp, rows of one token take consecutive slots in lane order (__match_any_sync), and the
// lowest such lane advances the token's cursor after its peers have read it.
__global__ void PlaceByTokenKernel(const int32_t* tokens, int64_t N, int32_t* cursor,
                                   int32_t* order) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int64_t base = 0; base < N; base += kPlaceThreads) {
    const int64_t r = base + threadIdx.x;
    const bool valid = r < N;
    const int32_t tok = valid ? tokens[r] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, tok);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    for (int w = 0; w < kPlaceThreads / kWarp; ++w) {
      if (warp == w && valid) {
        const int32_t slot = cursor[tok] + rank;
        order[slot] = static_cast<int32_t>(r);
      }
      __syncwarp();
      if (warp == w && valid && rank == 0) cursor[tok] += __popc(peers);
      __syncthreads();
    }
  }
}

// blockIdx.y strides over tokens; each thread owns one column of dwte[v].
template <typename D>
__global__ void EmbeddingWteKernel(const D* dx_out, const int32_t* offsets, const int32_t* order,
                                   int64_t C, int V, D* dwte) {
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int v = blockIdx.y; v < V; v += gridDim.y) {
    float acc = 0.0f;
    for (int32_t i = offsets[v]; i < offsets[v + 1]; ++i) acc += ToF(dx_out[order[i] * C + c]);
    dwte[int64_t{v} * C + c] = FromF<D>(acc);
  }
}

template <typename D>
__global__ void EmbeddingWpeKernel(const D* dx_out, int64_t N, int T, int64_t C, int max_seq_len,
                                   D* dwpe) {
  STRATA_FOR_EACH_INDEX(i, int64_t{max_seq_len} * C) {
    const int64_t t = i / C, c = i % C;
    float acc = 0.0f;
    if (t < T) {
      for (int64_t r = t; r < N; r += T) acc += ToF(dx_out[r * C + c]);
    }
    dwpe[i] = FromF<D>(acc);
  }
}

// ---------------------------------------------------------------------------
// LayerNorm.

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

// ---------------------------------------------------------------------------
// Cross-entropy: one block per row, fixed shared-memory trees.

template <int kThreads>
__device__ float BlockReduce(float v, float* shared, bool is_max) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = is_max ? WarpMax(v) : WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = is_max ? -INFINITY : 0.0f;
  for (int i = 0; i < kThreads / kWarp; ++i) r = is_max ? fmaxf(r, shared[i]) : r + shared[i];
  __syncthreads();
  return r;
}

template <typename D>
__global__ void CrossEntropyKernel(D* logits, const int32_t* targets, int64_t N, int V,
                                   float* losses, bool write_grad, float grad_scale) {
  __shared__ float shared[kBlock / kWarp];
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    D* row = logits + r * V;
    const int32_t target = targets[r];
    CheckTokenOnDevice(target, V);
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += kBlock) mx = fmaxf(mx, ToF(row[v]));
    mx = BlockReduce<kBlock>(mx, shared, true);
    float sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += kBlock) sum += expf(ToF(row[v]) - mx);
    sum = BlockReduce<kBlock>(sum, shared, false);
    const float lse = mx + logf(sum);
    const float target_logit = ToF(row[target]);
    if (threadIdx.x == 0) losses[r] = lse - target_logit;
    __syncthreads();  // every read of the row before any write
    if (write_grad) {
      for (int v = threadIdx.x; v < V; v += kBlock) {
        const float p = expf(ToF(row[v]) - lse);
        row[v] = FromF<D>(grad_scale * (p - (v == target ? 1.0f : 0.0f)));
      }
    }
    __syncthreads();
  }
}

__global__ void MeanLossKernel(const float* losses, int64_t N, float* loss) {
  __shared__ double part[kBlock];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += kBlock) acc += losses[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int o = kBlock / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = static_cast<float>(part[0] / static_cast<double>(N));
}

#undef STRATA_FOR_EACH_WARP_ROW
#undef STRATA_FOR_EACH_INDEX

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

template <typename D>
Status LaunchEmbeddingForward(cudaStream_t stream, const D* wte, const D* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V, D* x_out) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingForward", {N, C}));
  if (T < 1 || V < 1) return InvalidArgumentError("LaunchEmbeddingForward: T and V must be >= 1");
  if (N == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingForward", {wte, tokens, x_out}));
  EmbeddingForwardKernel<D>
      <<<GridFor(N * C, kBlock), kBlock, 0, stream>>>(wte, wpe, tokens, N, T, C, V, x_out);
  return Launched("EmbeddingForwardKernel");
}

template <typename D>
Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const D* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, D* dwte,
                               D* dwpe, int32_t* counts, int32_t* offsets, int32_t* cursor,
                               int32_t* order) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingBackward", {N, C}));
  if (T < 1 || V < 1 || max_seq_len < T || N % T != 0 || N > INT32_MAX) {
    return InvalidArgumentError(
        "LaunchEmbeddingBackward: need T >= 1, V >= 1, max_seq_len >= T, N a multiple of T and "
        "N < 2^31");
  }
  if (C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {dwte, counts, offsets, cursor}));
  if (N > 0) {
    STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {tokens, dx_out, order}));
  }
  STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
      cudaMemsetAsync(counts, 0, sizeof(int32_t) * V, stream), "cudaMemsetAsync(counts)"));
  if (N > 0) {
    CountTokensKernel<<<GridFor(N, kBlock), kBlock, 0, stream>>>(tokens, N, V, counts);
    STRATA_RETURN_IF_ERROR(Launched("CountTokensKernel"));
  }
  ScanCountsKernel<<<1, kScanThreads, 0, stream>>>(counts, V, offsets, cursor);
  STRATA_RETURN_IF_ERROR(Launched("ScanCountsKernel"));
  if (N > 0) {
    PlaceByTokenKernel<<<1, kPlaceThreads, 0, stream>>>(tokens, N, cursor, order);
    STRATA_RETURN_IF_ERROR(Launched("PlaceByTokenKernel"));
  }
  const dim3 grid(static_cast<unsigned>((C + kBlock - 1) / kBlock),
                  static_cast<unsigned>(std::min<int64_t>(V, kMaxGrid)));
  EmbeddingWteKernel<D><<<grid, kBlock, 0, stream>>>(dx_out, offsets, order, C, V, dwte);
  STRATA_RETURN_IF_ERROR(Launched("EmbeddingWteKernel"));
  if (dwpe == nullptr) return Status::Ok();
  EmbeddingWpeKernel<D><<<GridFor(int64_t{max_seq_len} * C, kBlock), kBlock, 0, stream>>>(
      dx_out, N, T, C, max_seq_len, dwpe);
  return Launched("EmbeddingWpeKernel");
}

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

template <typename D>
Status LaunchCrossEntropy(cudaStream_t stream, D* logits, const int32_t* targets, int64_t N, int V,
                          float* losses, bool write_grad, float grad_scale) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCrossEntropy", {N}));
  if (V < 1) return InvalidArgumentError("LaunchCrossEntropy: V must be >= 1");
  if (N == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCrossEntropy", {logits, targets, losses}));
  CrossEntropyKernel<D>
      <<<static_cast<unsigned>(std::min<int64_t>(N, kMaxGrid)), kBlock, 0, stream>>>(
          logits, targets, N, V, losses, write_grad, grad_scale);
  return Launched("CrossEntropyKernel");
}

Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, float* loss) {
  if (N < 1) return InvalidArgumentError("LaunchMeanLoss: N must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchMeanLoss", {losses, loss}));
  MeanLossKernel<<<1, kBlock, 0, stream>>>(losses, N, loss);
  return Launched("MeanLossKernel");
}

#define STRATA_INSTANTIATE_GPT_OPS(D)                                                              \
  template Status LaunchEmbeddingForward<D>(cudaStream_t, const D*, const D*, const int32_t*,      \
                                            int64_t, int, int64_t, int, D*);                       \
  template Status LaunchEmbeddingBackward<D>(cudaStream_t, const int32_t*, const D*, int64_t, int, \
                                             int64_t, int, int, D*, D*, int32_t*, int32_t*,        \
                                             int32_t*, int32_t*);                                  \
  template Status LaunchLayerNormForward<D>(cudaStream_t, const D*, const D*, const D*, int64_t,   \
                                            int64_t, D*, float*, float*);                          \
  template Status LaunchLayerNormBackward<D>(cudaStream_t, const D*, const D*, const D*,           \
                                             const float*, const float*, const D*, int64_t,        \
                                             int64_t, D*);                                         \
  template Status LaunchLayerNormParamGrads<D>(cudaStream_t, const D*, const D*, const float*,     \
                                               const float*, int64_t, int64_t, float*, D*, D*);    \
  template Status LaunchColumnSums<D>(cudaStream_t, const D*, int64_t, int64_t, float*, D*);       \
  template Status LaunchCrossEntropy<D>(cudaStream_t, D*, const int32_t*, int64_t, int, float*,    \
                                        bool, float);
STRATA_INSTANTIATE_GPT_OPS(float)
STRATA_INSTANTIATE_GPT_OPS(__half)
STRATA_INSTANTIATE_GPT_OPS(__nv_bfloat16)
#undef STRATA_INSTANTIATE_GPT_OPS

}  // namespace strata::models::cuda
