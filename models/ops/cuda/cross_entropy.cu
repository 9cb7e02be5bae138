// Cross-entropy and the chunked LM head on CUDA (ops.cuh): one block per row of logits with
// fixed shared-memory trees, the gradient written in place; a row whose target is
// engine::kIgnoreTarget contributes a loss of 0 and a zero gradient; the mean loss summed in
// double over the counted targets; the head's products through Products (matmul.cu), chunk_rows
// rows of logits at a time. Final-logit soft-capping (softcap c > 0, Gemma 2) as the host op
// (models/ops/cross_entropy.h): every logit l the head gives out or takes the loss of is
// D(c tanh(l / c)); the cross-entropy kernel caps the raw logits of its row as it reads them (a
// kCap template flag, so that without it the kernel is the code of before the option) and the
// gradient takes the factor 1 - tanh^2(l / c) from the raw D logit still in the row. Per-row
// losses go straight from the kernel to the caller's buffer; per-row weights scale each row's
// gradient by the fp32 product dloss * w_t (ops/cross_entropy.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "engine/plan/model.h"
#include "gpu/cuda/cuda_kernels.cuh"
#include "gpu/cuda/cuda_lt_matmul.h"
#include "gpu/cuda/cuda_status.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kBlock = 256;  // threads per row

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

// tanh(l / c) of a raw logit l and its capped value D(c tanh(l / c)), the product rounded to fp32
// first (__fmul_rn: not contracted into a following subtraction) as the host op rounds it.
struct CappedLogit {
  float value;
  float u;
};
template <typename D>
__device__ __forceinline__ CappedLogit CapLogit(D l, float c) {
  const float u = tanhf(ToF(l) / c);
  return {RoundTo<D>(__fmul_rn(c, u)), u};
}

// x (n) IN PLACE: D(c tanh(x / c)).
template <typename D>
__global__ void SoftcapKernel(D* x, int64_t n, float c) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = FromF<D>(CapLogit(x[i], c).value);
  }
}

// kCap: the row holds raw logits l and the loss is that of D(c tanh(l / c)), c = softcap.
template <typename D, bool kCap>
__global__ void CrossEntropyKernel(D* logits, const int32_t* targets, int64_t N, int V,
                                   float* losses, bool write_grad, float grad_scale, float softcap,
                                   const float* row_weights) {
  __shared__ float shared[kBlock / kWarp];
  // The logit the loss sees of a stored one.
  const auto logit = [&](D l) {
    if constexpr (kCap) return CapLogit(l, softcap).value;
    return ToF(l);
  };
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    D* row = logits + r * V;
    const int32_t target = targets[r];
    // The row's gradient scale: grad_scale, or its product with the row's weight (fp32, one
    // rounding, not contracted into what follows).
    const float scale = row_weights == nullptr ? grad_scale : __fmul_rn(grad_scale, row_weights[r]);
    if (target == engine::kIgnoreTarget) {  // uniform in the block: no barrier is skipped by part
      if (threadIdx.x == 0) losses[r] = 0.0f;
      if (write_grad) {
        for (int v = threadIdx.x; v < V; v += kBlock) row[v] = FromF<D>(0.0f);
      }
      continue;
    }
    CheckTokenOnDevice(target, V);
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += kBlock) mx = fmaxf(mx, logit(row[v]));
    mx = BlockReduce<kBlock>(mx, shared, true);
    float sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += kBlock) sum += expf(logit(row[v]) - mx);
    sum = BlockReduce<kBlock>(sum, shared, false);
    const float lse = mx + logf(sum);
    const float target_logit = logit(row[target]);
    if (threadIdx.x == 0) losses[r] = lse - target_logit;
    __syncthreads();  // every read of the row before any write
    if (write_grad) {
      for (int v = threadIdx.x; v < V; v += kBlock) {
        if constexpr (kCap) {  // times the cap's slope 1 - u^2, u from the raw logit
          const CappedLogit l = CapLogit(row[v], softcap);
          const float p = expf(l.value - lse);
          row[v] = FromF<D>(scale * (p - (v == target ? 1.0f : 0.0f)) * (1.0f - l.u * l.u));
        } else {
          const float p = expf(ToF(row[v]) - lse);
          row[v] = FromF<D>(scale * (p - (v == target ? 1.0f : 0.0f)));
        }
      }
    }
    __syncthreads();
  }
}

__global__ void MeanLossKernel(const float* losses, int64_t N, int64_t divisor, float* loss) {
  __shared__ double part[kBlock];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += kBlock) acc += losses[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int o = kBlock / 2; o > 0; o /= 2) {
    if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *loss = divisor == 0 ? 0.0f : static_cast<float>(part[0] / static_cast<double>(divisor));
  }
}

// The mean loss's divisor: the counted targets, B T (N) when the caller passes 0.
int64_t LossDivisor(int64_t loss_tokens, int64_t N) { return loss_tokens > 0 ? loss_tokens : N; }

Status CheckSoftcap(const char* op, float softcap) {
  if (std::isfinite(softcap) && softcap >= 0.0f) return Status::Ok();
  return InvalidArgumentError(std::string(op) +
                              ": softcap must be finite and >= 0 (0: none), got " +
                              std::to_string(softcap));
}

// x (n) IN PLACE: D(c tanh(x / c)) (the last logits of a soft-capped head).
template <typename D>
Status LaunchSoftcap(cudaStream_t stream, D* x, int64_t n, float c) {
  if (n == 0) return Status::Ok();
  SoftcapKernel<D><<<GridFor(n, kBlock), kBlock, 0, stream>>>(x, n, c);
  return Launched("SoftcapKernel");
}

}  // namespace

template <typename D>
Status LaunchCrossEntropy(cudaStream_t stream, D* logits, const int32_t* targets, int64_t N, int V,
                          float* losses, bool write_grad, float grad_scale, float softcap,
                          const float* row_weights) {
  STRATA_RETURN_IF_ERROR(CheckSizes("LaunchCrossEntropy", {N}));
  if (V < 1) return InvalidArgumentError("LaunchCrossEntropy: V must be >= 1");
  STRATA_RETURN_IF_ERROR(CheckSoftcap("LaunchCrossEntropy", softcap));
  if (N == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchCrossEntropy", {logits, targets, losses}));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(N, kMaxGrid));
  if (softcap > 0.0f) {
    CrossEntropyKernel<D, true><<<grid, kBlock, 0, stream>>>(
        logits, targets, N, V, losses, write_grad, grad_scale, softcap, row_weights);
  } else {
    CrossEntropyKernel<D, false><<<grid, kBlock, 0, stream>>>(
        logits, targets, N, V, losses, write_grad, grad_scale, 0.0f, row_weights);
  }
  return Launched("CrossEntropyKernel");
}

Status LaunchMeanLoss(cudaStream_t stream, const float* losses, int64_t N, int64_t divisor,
                      float* loss) {
  if (N < 1 || divisor < 0) {
    return InvalidArgumentError("LaunchMeanLoss: need N >= 1 and divisor >= 0");
  }
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchMeanLoss", {losses, loss}));
  MeanLossKernel<<<1, kBlock, 0, stream>>>(losses, N, divisor, loss);
  return Launched("MeanLossKernel");
}

template <typename S>
Status ChunkedHeadForward(const Products<S>& mm, const S* xn, const S* W, WeightLayout layout,
                          int B, int T, int64_t C, int64_t V, const HeadScratch<S>& scratch,
                          S* logits, const int32_t* targets, float* loss, int64_t loss_tokens,
                          float softcap, float* row_losses) {
  STRATA_RETURN_IF_ERROR(CheckSoftcap("ChunkedHeadForward", softcap));
  const cudaStream_t cs = mm.stream;
  const int64_t N = int64_t{B} * T;
  // kInOut: W (C, V); kOutIn: W (V, C), read transposed.
  const bool tied = layout == WeightLayout::kOutIn;
  const int64_t ldw = tied ? C : V;
  // The last position of each sequence: rows T-1, 2T-1, ... of xn, gathered into (B, C).
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(S);
  STRATA_RETURN_IF_ERROR(
      gpu::cuda::CudaStatus(cudaMemcpy2DAsync(scratch.xn_last, row_bytes, xn + (T - 1) * C,
                                              static_cast<size_t>(T) * row_bytes, row_bytes,
                                              static_cast<size_t>(B), cudaMemcpyDeviceToDevice, cs),
                            "cudaMemcpy2DAsync"));
  STRATA_RETURN_IF_ERROR(mm.Run(false, tied, B, V, C, scratch.xn_last, C, W, ldw, logits, V));
  if (softcap > 0.0f) STRATA_RETURN_IF_ERROR(LaunchSoftcap(cs, D(logits), int64_t{B} * V, softcap));
  if (targets == nullptr || (loss == nullptr && row_losses == nullptr)) return Status::Ok();
  // The rows' losses: the caller's buffer when given, else the scratch's.
  float* losses = row_losses != nullptr ? row_losses : scratch.losses;
  for (int64_t r0 = 0; r0 < N; r0 += scratch.chunk_rows) {
    const int64_t rows = std::min(scratch.chunk_rows, N - r0);
    STRATA_RETURN_IF_ERROR(
        mm.Run(false, tied, rows, V, C, xn + r0 * C, C, W, ldw, scratch.chunk, V));
    STRATA_RETURN_IF_ERROR(LaunchCrossEntropy(cs, D(scratch.chunk), targets + r0, rows,
                                              static_cast<int>(V), losses + r0, false, 0.0f,
                                              softcap));
  }
  if (loss == nullptr) return Status::Ok();
  return LaunchMeanLoss(cs, losses, N, LossDivisor(loss_tokens, N), loss);
}

// acc (+)= the head weight's gradient from the rows [r0, r0 + rows) (ChunkedHeadBackward):
// xn_chunk^T dlogits (C, V), kOutIn dlogits^T xn_chunk (V, C); beta 0 on the first chunk, 1 after
// (C == D), fp32 C and D.
template <typename S>
Status AccumulateHeadWeightGrad(const Products<S>& mm, const S* xn, const S* chunk, bool tied,
                                int64_t r0, int64_t rows, int64_t C, int64_t V, void* acc) {
  gpu::cuda::LtMatmulArgs a;
  a.trans_a = true;
  a.M = tied ? V : C;
  a.N = tied ? C : V;
  a.K = rows;
  a.A = tied ? chunk : xn + r0 * C;
  a.lda = tied ? V : C;
  a.B = tied ? xn + r0 * C : chunk;
  a.ldb = tied ? C : V;
  a.C = r0 == 0 ? nullptr : acc;
  a.ldc = a.N;
  a.D = acc;
  a.ldd = a.N;
  a.dtype = DTypeOf<S>();
  a.fp32_output = !std::is_same_v<S, float>;
  a.allow_tf32 = mm.allow_tf32;
  return gpu::cuda::LtMatmul(mm.stream, a, mm.workspace.data, mm.workspace.size_bytes);
}

template <typename S>
Status ChunkedHeadBackward(const Products<S>& mm, const S* xn, const S* W, WeightLayout layout,
                           const int32_t* targets, float dloss, int64_t N, int64_t C, int64_t V,
                           const HeadScratch<S>& scratch, S* dW, S* dxn, int64_t loss_tokens,
                           float softcap, const float* row_weights) {
  STRATA_RETURN_IF_ERROR(CheckSoftcap("ChunkedHeadBackward", softcap));
  const cudaStream_t cs = mm.stream;
  const bool tied = layout == WeightLayout::kOutIn;
  const int64_t ldw = tied ? C : V;
  S* chunk = scratch.chunk;
  constexpr bool kFp32 = std::is_same_v<S, float>;
  // dW accumulates in fp32: in place for float, else in the scratch's accumulator.
  void* acc = kFp32 ? static_cast<void*>(dW) : scratch.dw_acc;
  for (int64_t r0 = 0; r0 < N; r0 += scratch.chunk_rows) {
    const int64_t rows = std::min(scratch.chunk_rows, N - r0);
    STRATA_RETURN_IF_ERROR(mm.Run(false, tied, rows, V, C, xn + r0 * C, C, W, ldw, chunk, V));
    // dlogits = S(dloss / loss_tokens (softmax - onehot)), in place in the chunk (0 in the rows of
    // ignored targets); soft-capped: the softmax of the capped logits, times 1 - u^2 with u from
    // the raw logit the product just wrote. With row weights: S(dloss w_t (softmax - onehot)).
    const float grad_scale =
        row_weights != nullptr ? dloss : dloss / static_cast<float>(LossDivisor(loss_tokens, N));
    STRATA_RETURN_IF_ERROR(LaunchCrossEntropy(cs, D(chunk), targets + r0, rows, static_cast<int>(V),
                                              scratch.losses + r0, true, grad_scale, softcap,
                                              row_weights == nullptr ? nullptr : row_weights + r0));
    if (dW != nullptr) {  // null: a frozen head (LoRA)
      STRATA_RETURN_IF_ERROR(AccumulateHeadWeightGrad(mm, xn, chunk, tied, r0, rows, C, V, acc));
    }
    // dxn rows = S(dlogits W^T) (kInOut), S(dlogits W) (kOutIn).
    STRATA_RETURN_IF_ERROR(mm.InputGrad(layout, rows, C, V, chunk, W, dxn + r0 * C));
  }
  if (kFp32 || dW == nullptr) return Status::Ok();
  return gpu::cuda::LaunchConvert(cs, dW, DTypeOf<S>(), acc, DType::kF32, C * V,
                                  1.0f);  // one rounding
}

template Status ChunkedHeadForward<float>(const Products<float>&, const float*, const float*,
                                          WeightLayout, int, int, int64_t, int64_t,
                                          const HeadScratch<float>&, float*, const int32_t*, float*,
                                          int64_t, float, float*);
template Status ChunkedHeadForward<Bf16>(const Products<Bf16>&, const Bf16*, const Bf16*,
                                         WeightLayout, int, int, int64_t, int64_t,
                                         const HeadScratch<Bf16>&, Bf16*, const int32_t*, float*,
                                         int64_t, float, float*);
template Status ChunkedHeadForward<Fp16>(const Products<Fp16>&, const Fp16*, const Fp16*,
                                         WeightLayout, int, int, int64_t, int64_t,
                                         const HeadScratch<Fp16>&, Fp16*, const int32_t*, float*,
                                         int64_t, float, float*);
template Status ChunkedHeadBackward<float>(const Products<float>&, const float*, const float*,
                                           WeightLayout, const int32_t*, float, int64_t, int64_t,
                                           int64_t, const HeadScratch<float>&, float*, float*,
                                           int64_t, float, const float*);
template Status ChunkedHeadBackward<Bf16>(const Products<Bf16>&, const Bf16*, const Bf16*,
                                          WeightLayout, const int32_t*, float, int64_t, int64_t,
                                          int64_t, const HeadScratch<Bf16>&, Bf16*, Bf16*, int64_t,
                                          float, const float*);
template Status ChunkedHeadBackward<Fp16>(const Products<Fp16>&, const Fp16*, const Fp16*,
                                          WeightLayout, const int32_t*, float, int64_t, int64_t,
                                          int64_t, const HeadScratch<Fp16>&, Fp16*, Fp16*, int64_t,
                                          float, const float*);

#define STRATA_INSTANTIATE_CROSS_ENTROPY(D)                                                     \
  template Status LaunchCrossEntropy<D>(cudaStream_t, D*, const int32_t*, int64_t, int, float*, \
                                        bool, float, float, const float*);
STRATA_INSTANTIATE_CROSS_ENTROPY(float)
STRATA_INSTANTIATE_CROSS_ENTROPY(__half)
STRATA_INSTANTIATE_CROSS_ENTROPY(__nv_bfloat16)
#undef STRATA_INSTANTIATE_CROSS_ENTROPY

}  // namespace strata::models::ops::cuda
