// Token (and position) embedding on CUDA (ops.cuh): the forward a gather, the backward a
// deterministic counting sort by token, no floating-point atomics.
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

constexpr int kBlock = 256;  // threads of the elementwise kernels
constexpr int kPlaceThreads = 1024;
constexpr int kScanThreads = 1024;

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

}  // namespace

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

#define STRATA_INSTANTIATE_EMBEDDING(D)                                                            \
  template Status LaunchEmbeddingForward<D>(cudaStream_t, const D*, const D*, const int32_t*,      \
                                            int64_t, int, int64_t, int, D*);                       \
  template Status LaunchEmbeddingBackward<D>(cudaStream_t, const int32_t*, const D*, int64_t, int, \
                                             int64_t, int, int, D*, D*, int32_t*, int32_t*,        \
                                             int32_t*, int32_t*);
STRATA_INSTANTIATE_EMBEDDING(float)
STRATA_INSTANTIATE_EMBEDDING(__half)
STRATA_INSTANTIATE_EMBEDDING(__nv_bfloat16)
#undef STRATA_INSTANTIATE_EMBEDDING

}  // namespace strata::models::ops::cuda
