// Token (and position) embedding on CUDA (ops.cuh): the forward a gather, the backward
// deterministic stable counting sorts (of the rows by token, and by position for packed
// sequences), no floating-point atomics.
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

// scale: the fp32 scale, rounded to D here (s = D(scale), the host op's S(scale)).
template <typename D>
__global__ void EmbeddingForwardKernel(const D* wte, const D* wpe, const int32_t* tokens, int64_t N,
                                       int T, int64_t C, int V, D* x_out,
                                       const int32_t* position_ids, float scale) {
  const float s = RoundTo<D>(scale);
  STRATA_FOR_EACH_INDEX(i, N * C) {
    const int64_t r = i / C, c = i % C;
    const int32_t tok = tokens[r];
    CheckTokenOnDevice(tok, V);
    // Without wpe (the Llama family) and unscaled the row is copied exactly.
    if (wpe == nullptr) {
      x_out[i] = s == 1.0f ? wte[tok * C + c] : FromF<D>(ToF(wte[tok * C + c]) * s);
      continue;
    }
    int64_t t = r % T;
    if (position_ids != nullptr) {  // packed sequences
      t = position_ids[r];
      CheckTokenOnDevice(static_cast<int32_t>(t), T);
    }
    // The product rounded on its own, as the host's (no FMA with the position's add).
    const float e = s == 1.0f ? ToF(wte[tok * C + c]) : __fmul_rn(ToF(wte[tok * C + c]), s);
    x_out[i] = FromF<D>(e + ToF(wpe[t * C + c]));
  }
}

// The counting sort (CountingSort below) of N int32 keys in [0, K): tokens (K = V) or
// positions (K = T).
__global__ void CountKeysKernel(const int32_t* keys, int64_t N, int K, int32_t* counts) {
  STRATA_FOR_EACH_INDEX(r, N) {
    const int32_t key = keys[r];
    CheckTokenOnDevice(key, K);
    atomicAdd(&counts[key], 1);  // integer counts: the same whatever the order
  }
}

// One block: offsets[v] = sum of counts[0, v), offsets[V] = N; cursor = offsets[0, V) (V: the
// number of keys K).
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
// warp, rows of one key take consecutive slots in lane order (__match_any_sync), and the
// lowest such lane advances the key's cursor after its peers have read it.
__global__ void PlaceByKeyKernel(const int32_t* keys, int64_t N, int32_t* cursor, int32_t* order) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int64_t base = 0; base < N; base += kPlaceThreads) {
    const int64_t r = base + threadIdx.x;
    const bool valid = r < N;
    const int32_t tok = valid ? keys[r] : -1;
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

// out[v] = D(s * fp32 sum of the dx_out rows sorted under key v, in their order) for v < K, s =
// D(scale) (the sum scaled once, complete; scale 1: exact, the plain sum): dwte by token, dwpe by
// position (scale 1). blockIdx.y strides over keys; each thread owns one column.
template <typename D>
__global__ void SortedRowSumsKernel(const D* dx_out, const int32_t* offsets, const int32_t* order,
                                    int64_t C, int K, D* out, float scale) {
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float s = RoundTo<D>(scale);
  for (int v = blockIdx.y; v < K; v += gridDim.y) {
    float acc = 0.0f;
    for (int32_t i = offsets[v]; i < offsets[v + 1]; ++i) acc += ToF(dx_out[order[i] * C + c]);
    out[int64_t{v} * C + c] = FromF<D>(acc * s);
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

// A stable counting sort of the N keys (in [0, K); outside traps) into s: s.offsets[v] ..
// s.offsets[v + 1] of s.order are the rows of key v in increasing order.
Status CountingSort(cudaStream_t stream, const int32_t* keys, int64_t N, int K,
                    const CountingSortScratch& s) {
  STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
      cudaMemsetAsync(s.counts, 0, sizeof(int32_t) * K, stream), "cudaMemsetAsync(counts)"));
  if (N > 0) {
    CountKeysKernel<<<GridFor(N, kBlock), kBlock, 0, stream>>>(keys, N, K, s.counts);
    STRATA_RETURN_IF_ERROR(Launched("CountKeysKernel"));
  }
  ScanCountsKernel<<<1, kScanThreads, 0, stream>>>(s.counts, K, s.offsets, s.cursor);
  STRATA_RETURN_IF_ERROR(Launched("ScanCountsKernel"));
  if (N > 0) {
    PlaceByKeyKernel<<<1, kPlaceThreads, 0, stream>>>(keys, N, s.cursor, s.order);
    STRATA_RETURN_IF_ERROR(Launched("PlaceByKeyKernel"));
  }
  return Status::Ok();
}

// out (K, C) from the sort of s (SortedRowSumsKernel), each row's sum times D(scale).
template <typename D>
Status LaunchSortedRowSums(cudaStream_t stream, const D* dx_out, const CountingSortScratch& s,
                           int64_t C, int K, D* out, float scale) {
  const dim3 grid(static_cast<unsigned>((C + kBlock - 1) / kBlock),
                  static_cast<unsigned>(std::min<int64_t>(K, kMaxGrid)));
  SortedRowSumsKernel<D><<<grid, kBlock, 0, stream>>>(dx_out, s.offsets, s.order, C, K, out, scale);
  return Launched("SortedRowSumsKernel");
}

// The embedding scale must be finite in fp32 (it is rounded to fp32, then to D, in the kernels).
Status CheckScale(const char* op, double scale) {
  if (std::isfinite(scale) && std::isfinite(static_cast<float>(scale))) return Status::Ok();
  return InvalidArgumentError(std::string(op) + ": the scale must be finite, got " +
                              std::to_string(scale));
}

Status CheckSortScratch(const char* op, const CountingSortScratch& s, int64_t N) {
  STRATA_RETURN_IF_ERROR(CheckPointers(op, {s.counts, s.offsets, s.cursor}));
  if (N > 0) STRATA_RETURN_IF_ERROR(CheckPointers(op, {s.order}));
  return Status::Ok();
}

}  // namespace

template <typename D>
Status LaunchEmbeddingForward(cudaStream_t stream, const D* wte, const D* wpe,
                              const int32_t* tokens, int64_t N, int T, int64_t C, int V, D* x_out,
                              const int32_t* position_ids, double scale) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingForward", {N, C}));
  if (T < 1 || V < 1) return InvalidArgumentError("LaunchEmbeddingForward: T and V must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckScale("LaunchEmbeddingForward", scale));
  if (N == 0 || C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingForward", {wte, tokens, x_out}));
  EmbeddingForwardKernel<D><<<GridFor(N * C, kBlock), kBlock, 0, stream>>>(
      wte, wpe, tokens, N, T, C, V, x_out, position_ids, static_cast<float>(scale));
  return Launched("EmbeddingForwardKernel");
}

template <typename D>
Status LaunchEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const D* dx_out,
                               int64_t N, int T, int64_t C, int V, int max_seq_len, D* dwte,
                               D* dwpe, const CountingSortScratch& by_token,
                               const int32_t* position_ids, const CountingSortScratch& by_position,
                               double scale) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchEmbeddingBackward", {N, C}));
  if (T < 1 || V < 1 || max_seq_len < T || N % T != 0 || N > INT32_MAX) {
    return InvalidArgumentError(
        "LaunchEmbeddingBackward: need T >= 1, V >= 1, max_seq_len >= T, N a multiple of T and "
        "N < 2^31");
  }
  STRATA_RETURN_IF_ERROR(CheckScale("LaunchEmbeddingBackward", scale));
  if (C == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {dwte}));
  STRATA_RETURN_IF_ERROR(CheckSortScratch("LaunchEmbeddingBackward", by_token, N));
  if (N > 0) STRATA_RETURN_IF_ERROR(CheckPointers("LaunchEmbeddingBackward", {tokens, dx_out}));
  const bool packed = dwpe != nullptr && position_ids != nullptr;
  if (packed) STRATA_RETURN_IF_ERROR(CheckSortScratch("LaunchEmbeddingBackward", by_position, N));
  STRATA_RETURN_IF_ERROR(CountingSort(stream, tokens, N, V, by_token));
  STRATA_RETURN_IF_ERROR(
      LaunchSortedRowSums(stream, dx_out, by_token, C, V, dwte, static_cast<float>(scale)));
  if (dwpe == nullptr) return Status::Ok();
  if (!packed) {
    EmbeddingWpeKernel<D><<<GridFor(int64_t{max_seq_len} * C, kBlock), kBlock, 0, stream>>>(
        dx_out, N, T, C, max_seq_len, dwpe);
    return Launched("EmbeddingWpeKernel");
  }
  // Packed sequences: the rows sorted by position, each dwpe row their sum in row order; rows
  // T .. max_seq_len - 1 zero (all-zero bits are +0 in every D).
  STRATA_RETURN_IF_ERROR(CountingSort(stream, position_ids, N, T, by_position));
  STRATA_RETURN_IF_ERROR(LaunchSortedRowSums(stream, dx_out, by_position, C, T, dwpe, 1.0f));
  if (max_seq_len == T) return Status::Ok();
  return gpu::cuda::CudaStatus(
      cudaMemsetAsync(dwpe + int64_t{T} * C, 0,
                      static_cast<size_t>(max_seq_len - T) * static_cast<size_t>(C) * sizeof(D),
                      stream),
      "cudaMemsetAsync(dwpe)");
}

#define STRATA_INSTANTIATE_EMBEDDING(D)                                                       \
  template Status LaunchEmbeddingForward<D>(cudaStream_t, const D*, const D*, const int32_t*, \
                                            int64_t, int, int64_t, int, D*, const int32_t*,   \
                                            double);                                          \
  template Status LaunchEmbeddingBackward<D>(                                                 \
      cudaStream_t, const int32_t*, const D*, int64_t, int, int64_t, int, int, D*, D*,        \
      const CountingSortScratch&, const int32_t*, const CountingSortScratch&, double);
STRATA_INSTANTIATE_EMBEDDING(float)
STRATA_INSTANTIATE_EMBEDDING(__half)
STRATA_INSTANTIATE_EMBEDDING(__nv_bfloat16)
#undef STRATA_INSTANTIATE_EMBEDDING

}  // namespace strata::models::ops::cuda
