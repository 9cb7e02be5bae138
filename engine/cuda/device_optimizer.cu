// The CUDA kernels of the device optimizer (device_optimizer_kernels.h): cpu_optim's loops
// (cpu_optim/kernels_impl.inc) one element per thread iteration, grid-stride, every fp32 and fp64
// operation an _rn intrinsic so that nothing contracts into an FMA (the file is also compiled
// with -fmad=false), conversions bit for bit base/dtype.h (gpu/cuda/cuda_dtype.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "engine/cuda/device_optimizer_kernels.h"
#include "gpu/cuda/cuda_dtype.cuh"
#include "gpu/cuda/cuda_status.h"

namespace strata::engine::cuda {
namespace {

namespace ci = cpu_optim::internal;
using gpu::cuda::Bf16ToFloatDev;
using gpu::cuda::FloatToBf16Dev;
using gpu::cuda::FloatToHalfDev;
using gpu::cuda::HalfToFloatDev;

constexpr int kBlock = 256;
constexpr int64_t kMaxGrid = 4096;  // grid-stride beyond this many blocks

int GridFor(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kBlock - 1) / kBlock, 1, kMaxGrid));
}

Status Launched(const char* kernel) { return gpu::cuda::CudaStatus(cudaGetLastError(), kernel); }

template <DType kD>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  if constexpr (kD == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kD == DType::kF16) {
    return HalfToFloatDev(static_cast<const uint16_t*>(p)[i]);
  } else {
    return Bf16ToFloatDev(static_cast<const uint16_t*>(p)[i]);
  }
}

// Writes the copy-out when kOut.
template <bool kOut, DType kD>
__device__ __forceinline__ void Store(void* p, int64_t i, float x) {
  if constexpr (!kOut) {
    return;
  } else if constexpr (kD == DType::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (kD == DType::kF16) {
    static_cast<uint16_t*>(p)[i] = FloatToHalfDev(x);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToBf16Dev(x);
  }
}

#define STRATA_GRID_STRIDE(i, n)                                            \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }

// ---- AdamW / Adam: cpu_optim AdamWLoop ----
template <DType kGrad, bool kOut, DType kOutDType>
__global__ void AdamWKernel(ci::AdamWScalars s, ci::AdamWBuffers b, int64_t n) {
  STRATA_GRID_STRIDE(i, n) {
    float gi = Mul(Load<kGrad>(b.grad, i), s.grad_scale);
    float pi = b.master[i];
    if (s.weight_decay_mode == ci::WeightDecayMode::kL2) gi = Add(gi, Mul(s.weight_decay, pi));
    if (s.weight_decay_mode == ci::WeightDecayMode::kDecoupled) pi = Mul(pi, s.decay);
    // torch.lerp(m, g, 1 - beta1), the form picked per call.
    const float m_old = b.m[i];
    const float diff = Sub(gi, m_old);
    const float mi = s.lerp_small ? Add(m_old, Mul(s.one_minus_beta1, diff))
                                  : Sub(gi, Mul(diff, s.lerp_one_minus_w));
    const float vi = Add(Mul(s.beta2, b.v[i]), Mul(Mul(s.one_minus_beta2, gi), gi));
    float v_used = vi;
    if (s.amsgrad) {  // torch.maximum(max_v, v): NaN when either is NaN
      const float old_max = b.max_v[i];
      v_used = (vi > old_max || vi != vi) ? vi : old_max;
      if (old_max != old_max) v_used = old_max;
      b.max_v[i] = v_used;
    }
    const float denom = Add(Div(__fsqrt_rn(v_used), s.bias_correction2_sqrt), s.eps);
    pi = Sub(pi, Div(Mul(s.step_size, mi), denom));
    b.master[i] = pi;
    b.m[i] = mi;
    b.v[i] = vi;
    Store<kOut, kOutDType>(b.out, i, pi);
  }
}

// ---- Adagrad: cpu_optim AdagradLoop ----
template <DType kGrad, bool kOut, DType kOutDType>
__global__ void AdagradKernel(ci::AdagradScalars s, ci::StateBuffers b, int64_t n) {
  STRATA_GRID_STRIDE(i, n) {
    float gi = Mul(Load<kGrad>(b.grad, i), s.grad_scale);
    float pi = b.master[i];
    if (s.has_weight_decay) gi = Add(gi, Mul(s.weight_decay, pi));
    const float si = Add(b.state[i], Mul(gi, gi));
    const float std_dev = Add(__fsqrt_rn(si), s.eps);
    pi = Sub(pi, Div(Mul(s.clr, gi), std_dev));
    b.master[i] = pi;
    b.state[i] = si;
    Store<kOut, kOutDType>(b.out, i, pi);
  }
}

// ---- Lion: cpu_optim LionLoop ----
template <DType kGrad, bool kOut, DType kOutDType>
__global__ void LionKernel(ci::LionScalars s, ci::StateBuffers b, int64_t n) {
  STRATA_GRID_STRIDE(i, n) {
    const float gi = Mul(Load<kGrad>(b.grad, i), s.grad_scale);
    float pi = b.master[i];
    const float mi = b.state[i];
    if (s.has_weight_decay) pi = Mul(pi, s.decay);
    const float c = Add(Mul(s.beta1, mi), Mul(s.one_minus_beta1, gi));
    // sign(c): +1, -1, +0 for +-0, NaN for NaN.
    float sign = c != c ? c : 0.0f;
    if (c > 0.0f) sign = 1.0f;
    if (c < 0.0f) sign = -1.0f;
    pi = Sub(pi, Mul(s.lr, sign));
    b.master[i] = pi;
    b.state[i] = Add(Mul(s.beta2, mi), Mul(s.one_minus_beta2, gi));
    Store<kOut, kOutDType>(b.out, i, pi);
  }
}

// ---- SGD: cpu_optim SgdLoop ----
template <DType kGrad, bool kOut, DType kOutDType>
__global__ void SgdKernel(ci::SgdScalars s, ci::StateBuffers b, int64_t n) {
  STRATA_GRID_STRIDE(i, n) {
    float gi = Mul(Load<kGrad>(b.grad, i), s.grad_scale);
    float pi = b.master[i];
    if (s.has_weight_decay) gi = Add(gi, Mul(s.weight_decay, pi));
    if (s.momentum_mode != ci::SgdMomentumMode::kNone) {
      const float bi = s.momentum_mode == ci::SgdMomentumMode::kInit
                           ? gi
                           : Add(Mul(s.momentum, b.state[i]), Mul(s.one_minus_dampening, gi));
      b.state[i] = bi;
      gi = s.nesterov ? Add(gi, Mul(s.momentum, bi)) : bi;
    }
    pi = Sub(pi, Mul(s.lr, gi));
    b.master[i] = pi;
    Store<kOut, kOutDType>(b.out, i, pi);
  }
}

template <DType kD>
using DTypeConstant = std::integral_constant<DType, kD>;

// f(DTypeConstant<grad>, std::bool_constant<has out>, DTypeConstant<out>) for the run-time dtypes
// (checked by the caller: fp32, fp16 or bf16).
template <typename F>
Status DispatchDTypes(DType grad_dtype, const void* out, DType out_dtype, const F& f) {
  auto with_out = [&](auto g) -> Status {
    if (out == nullptr) return f(g, std::false_type{}, DTypeConstant<DType::kF32>{});
    switch (out_dtype) {
      case DType::kF32:
        return f(g, std::true_type{}, DTypeConstant<DType::kF32>{});
      case DType::kF16:
        return f(g, std::true_type{}, DTypeConstant<DType::kF16>{});
      case DType::kBF16:
        return f(g, std::true_type{}, DTypeConstant<DType::kBF16>{});
    }
    return InvalidArgumentError("device optimizer: unknown working dtype");
  };
  switch (grad_dtype) {
    case DType::kF32:
      return with_out(DTypeConstant<DType::kF32>{});
    case DType::kF16:
      return with_out(DTypeConstant<DType::kF16>{});
    case DType::kBF16:
      return with_out(DTypeConstant<DType::kBF16>{});
  }
  return InvalidArgumentError("device optimizer: unknown gradient dtype");
}

// ---- Gradient statistics: cpu_optim SumSquaresChunk / SumSquaresTyped, one block per leaf ----
constexpr int kChunksPerLeaf = static_cast<int>(ci::kStatsChunksPerLeaf);
constexpr int kLanes = static_cast<int>(ci::kStatsLanes);
constexpr int kStatsBlock = kChunksPerLeaf * kLanes;  // one thread per (chunk, lane)
static_assert(kStatsBlock == 128);

struct StatsHeader {  // as device_optimizer.cc's
  int64_t num_elems;
  int64_t num_sums;
};

template <DType kD>
__global__ void GradStatsKernel(const void* grad, int64_t n, double scale, std::byte* record) {
  __shared__ double lanes[kStatsBlock];
  __shared__ double chunks[kChunksPerLeaf];
  const int64_t leaf = blockIdx.x;
  const int chunk = threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t chunk_begin = leaf * ci::kStatsLeafElems + chunk * ci::kStatsChunkElems;
  const int64_t chunk_end =
      n < chunk_begin + ci::kStatsChunkElems ? n : chunk_begin + ci::kStatsChunkElems;
  // Lane `lane` of a chunk adds elements lane, lane + 8, ... in index order, from 0.
  double acc = 0.0;
  for (int64_t i = chunk_begin + lane; i < chunk_end; i += kLanes) {
    const double y = __dmul_rn(static_cast<double>(Load<kD>(grad, i)), scale);
    acc = __dadd_rn(acc, __dmul_rn(y, y));
  }
  lanes[threadIdx.x] = acc;
  __syncthreads();
  if (lane == 0) {  // ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))
    const double* l = lanes + chunk * kLanes;
    chunks[chunk] = __dadd_rn(__dadd_rn(__dadd_rn(l[0], l[1]), __dadd_rn(l[2], l[3])),
                              __dadd_rn(__dadd_rn(l[4], l[5]), __dadd_rn(l[6], l[7])));
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // 0.0 + chunk0 + chunk1 + ... over the leaf's chunks, in order
    double sum = 0.0;
    for (int c = 0; c < kChunksPerLeaf; ++c) {
      if (leaf * ci::kStatsLeafElems + c * ci::kStatsChunkElems >= n) break;
      sum = __dadd_rn(sum, chunks[c]);
    }
    reinterpret_cast<double*>(record + sizeof(StatsHeader))[leaf] = sum;
    if (leaf == 0) {
      auto* header = reinterpret_cast<StatsHeader*>(record);
      header->num_elems = n;
      header->num_sums = gridDim.x;
    }
  }
}

__global__ void EmptyStatsKernel(std::byte* record) {
  auto* header = reinterpret_cast<StatsHeader*>(record);
  header->num_elems = 0;
  header->num_sums = 0;
}

// ---- Accumulation: cpu_optim AccumulateChunk ----
template <DType kD>
__global__ void AccumulateKernel(float* acc, const void* grad, int64_t n, bool overwrite) {
  STRATA_GRID_STRIDE(i, n) {
    const float x = Load<kD>(grad, i);
    acc[i] = overwrite ? x : Add(acc[i], x);
  }
}

template <typename F>
Status DispatchGrad(DType dtype, const F& f) {
  switch (dtype) {
    case DType::kF32:
      return f(DTypeConstant<DType::kF32>{});
    case DType::kF16:
      return f(DTypeConstant<DType::kF16>{});
    case DType::kBF16:
      return f(DTypeConstant<DType::kBF16>{});
  }
  return InvalidArgumentError("device optimizer: unknown gradient dtype");
}

}  // namespace

Status LaunchAdamWUpdate(cudaStream_t stream, const ci::AdamWScalars& s, const ci::AdamWBuffers& b,
                         int64_t num_elems) {
  return DispatchDTypes(b.grad_dtype, b.out, b.out_dtype, [&](auto g, auto has_out, auto o) {
    AdamWKernel<decltype(g)::value, decltype(has_out)::value, decltype(o)::value>
        <<<GridFor(num_elems), kBlock, 0, stream>>>(s, b, num_elems);
    return Launched("AdamWKernel");
  });
}

Status LaunchAdagradUpdate(cudaStream_t stream, const ci::AdagradScalars& s,
                           const ci::StateBuffers& b, int64_t num_elems) {
  return DispatchDTypes(b.grad_dtype, b.out, b.out_dtype, [&](auto g, auto has_out, auto o) {
    AdagradKernel<decltype(g)::value, decltype(has_out)::value, decltype(o)::value>
        <<<GridFor(num_elems), kBlock, 0, stream>>>(s, b, num_elems);
    return Launched("AdagradKernel");
  });
}

Status LaunchLionUpdate(cudaStream_t stream, const ci::LionScalars& s, const ci::StateBuffers& b,
                        int64_t num_elems) {
  return DispatchDTypes(b.grad_dtype, b.out, b.out_dtype, [&](auto g, auto has_out, auto o) {
    LionKernel<decltype(g)::value, decltype(has_out)::value, decltype(o)::value>
        <<<GridFor(num_elems), kBlock, 0, stream>>>(s, b, num_elems);
    return Launched("LionKernel");
  });
}

Status LaunchSgdUpdate(cudaStream_t stream, const ci::SgdScalars& s, const ci::StateBuffers& b,
                       int64_t num_elems) {
  return DispatchDTypes(b.grad_dtype, b.out, b.out_dtype, [&](auto g, auto has_out, auto o) {
    SgdKernel<decltype(g)::value, decltype(has_out)::value, decltype(o)::value>
        <<<GridFor(num_elems), kBlock, 0, stream>>>(s, b, num_elems);
    return Launched("SgdKernel");
  });
}

Status LaunchGradStats(cudaStream_t stream, const void* grad, DType dtype, int64_t num_elems,
                       float scale, std::byte* record) {
  if (num_elems == 0) {
    EmptyStatsKernel<<<1, 1, 0, stream>>>(record);
    return Launched("EmptyStatsKernel");
  }
  const int64_t leaves = (num_elems + ci::kStatsLeafElems - 1) / ci::kStatsLeafElems;
  if (leaves > int64_t{0x7fffffff}) {
    return InvalidArgumentError("LaunchGradStats: more leaves than a grid holds");
  }
  return DispatchGrad(dtype, [&](auto d) {
    GradStatsKernel<decltype(d)::value><<<static_cast<unsigned>(leaves), kStatsBlock, 0, stream>>>(
        grad, num_elems, static_cast<double>(scale), record);
    return Launched("GradStatsKernel");
  });
}

Status LaunchGradAccumulate(cudaStream_t stream, float* acc, const void* grad, DType dtype,
                            int64_t num_elems, bool overwrite) {
  return DispatchGrad(dtype, [&](auto d) {
    AccumulateKernel<decltype(d)::value>
        <<<GridFor(num_elems), kBlock, 0, stream>>>(acc, grad, num_elems, overwrite);
    return Launched("AccumulateKernel");
  });
}

}  // namespace strata::engine::cuda
