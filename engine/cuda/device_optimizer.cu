// The CUDA kernels of the device optimizer (device_optimizer_kernels.h): cpu_optim's loops
// (cpu_optim/kernels_impl.inc) as per-element ops, run by one grid-stride update kernel four
// elements at a time (16-byte fp32, 8-byte fp16/bf16 accesses) where every buffer is aligned for
// it and one at a time otherwise and for the tail; every fp32 and fp64 operation an _rn intrinsic
// so that nothing contracts into an FMA (the file is also compiled with -fmad=false), conversions
// base/dtype.h's own (host and device code). Elements are independent, so the grouping
// changes no bits. Measured on an H200 (bench/gpu/bench_device_optimizer): AdamW over 2^26
// parameters, bf16 gradient and copy-out, 3.45 TB/s of the 3.68 TB/s a device-to-device copy
// reaches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "base/dtype.h"
#include "engine/cuda/device_optimizer_kernels.h"
#include "gpu/cuda/cuda_status.h"

namespace strata::engine::cuda {
namespace {

namespace ci = cpu_optim::internal;

constexpr int kBlock = 256;
constexpr int64_t kMaxGrid = 4096;  // grid-stride beyond this many blocks

int GridFor(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kBlock - 1) / kBlock, 1, kMaxGrid));
}

Status Launched(const char* kernel) { return gpu::cuda::LaunchStatus(cudaGetLastError(), kernel); }

template <DType kD>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  if constexpr (kD == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kD == DType::kF16) {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
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
    static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToBf16(x);
  }
}

#define STRATA_GRID_STRIDE(i, n)                                            \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }

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

// ---- The per-element updates: cpu_optim's loops (kernels_impl.inc), one element each ----
// Each op takes the unscaled gradient element, the master weight and its kNumState state values
// (in StateLayout's order) and updates them in place.

// AdamW / Adam: cpu_optim AdamWLoop; state exp_avg, exp_avg_sq (, max_exp_avg_sq with amsgrad).
template <bool kAmsgrad>
struct AdamWOp {
  static constexpr int kNumState = kAmsgrad ? 3 : 2;
  ci::AdamWScalars s;
  __device__ __forceinline__ void operator()(float g, float& p, float (&st)[kNumState]) const {
    float gi = Mul(g, s.grad_scale);
    float pi = p;
    if (s.weight_decay_mode == ci::WeightDecayMode::kL2) gi = Add(gi, Mul(s.weight_decay, pi));
    if (s.weight_decay_mode == ci::WeightDecayMode::kDecoupled) pi = Mul(pi, s.decay);
    // torch.lerp(m, g, 1 - beta1), the form picked per call.
    const float m_old = st[0];
    const float diff = Sub(gi, m_old);
    const float mi = s.lerp_small ? Add(m_old, Mul(s.one_minus_beta1, diff))
                                  : Sub(gi, Mul(diff, s.lerp_one_minus_w));
    const float vi = Add(Mul(s.beta2, st[1]), Mul(Mul(s.one_minus_beta2, gi), gi));
    float v_used = vi;
    if constexpr (kAmsgrad) {  // torch.maximum(max_v, v): NaN when either is NaN
      const float old_max = st[2];
      v_used = (vi > old_max || vi != vi) ? vi : old_max;
      if (old_max != old_max) v_used = old_max;
      st[2] = v_used;
    }
    const float denom = Add(Div(__fsqrt_rn(v_used), s.bias_correction2_sqrt), s.eps);
    p = Sub(pi, Div(Mul(s.step_size, mi), denom));
    st[0] = mi;
    st[1] = vi;
  }
};

// Adagrad: cpu_optim AdagradLoop; state sum.
struct AdagradOp {
  static constexpr int kNumState = 1;
  ci::AdagradScalars s;
  __device__ __forceinline__ void operator()(float g, float& p, float (&st)[1]) const {
    float gi = Mul(g, s.grad_scale);
    const float pi = p;
    if (s.has_weight_decay) gi = Add(gi, Mul(s.weight_decay, pi));
    const float si = Add(st[0], Mul(gi, gi));
    const float std_dev = Add(__fsqrt_rn(si), s.eps);
    p = Sub(pi, Div(Mul(s.clr, gi), std_dev));
    st[0] = si;
  }
};

// Lion: cpu_optim LionLoop; state exp_avg.
struct LionOp {
  static constexpr int kNumState = 1;
  ci::LionScalars s;
  __device__ __forceinline__ void operator()(float g, float& p, float (&st)[1]) const {
    const float gi = Mul(g, s.grad_scale);
    float pi = p;
    const float mi = st[0];
    if (s.has_weight_decay) pi = Mul(pi, s.decay);
    const float c = Add(Mul(s.beta1, mi), Mul(s.one_minus_beta1, gi));
    // sign(c): +1, -1, +0 for +-0, NaN for NaN.
    float sign = c != c ? c : 0.0f;
    if (c > 0.0f) sign = 1.0f;
    if (c < 0.0f) sign = -1.0f;
    p = Sub(pi, Mul(s.lr, sign));
    st[0] = Add(Mul(s.beta2, mi), Mul(s.one_minus_beta2, gi));
  }
};

// SGD: cpu_optim SgdLoop; state momentum_buffer when momentum != 0 (kMomentum), else none.
template <bool kMomentum>
struct SgdOp {
  static constexpr int kNumState = kMomentum ? 1 : 0;
  ci::SgdScalars s;
  template <int kN>
  __device__ __forceinline__ void operator()(float g, float& p, float (&st)[kN]) const {
    float gi = Mul(g, s.grad_scale);
    const float pi = p;
    if (s.has_weight_decay) gi = Add(gi, Mul(s.weight_decay, pi));
    if constexpr (kMomentum) {
      const float bi = s.momentum_mode == ci::SgdMomentumMode::kInit
                           ? gi
                           : Add(Mul(s.momentum, st[0]), Mul(s.one_minus_dampening, gi));
      st[0] = bi;
      gi = s.nesterov ? Add(gi, Mul(s.momentum, bi)) : bi;
    }
    p = Sub(pi, Mul(s.lr, gi));
  }
};

// The state pointers of an op (at least one slot, so that SGD without momentum compiles).
template <int kNumState>
struct StatePtrs {
  float* p[kNumState > 0 ? kNumState : 1];
};

// Four consecutive gradient elements 4j..4j+3 (grad 16-byte aligned for fp32, 8 for fp16/bf16).
template <DType kD>
__device__ __forceinline__ void LoadGrad4(const void* grad, int64_t j, float (&g)[4]) {
  if constexpr (kD == DType::kF32) {
    const float4 v = static_cast<const float4*>(grad)[j];
    g[0] = v.x, g[1] = v.y, g[2] = v.z, g[3] = v.w;
  } else {
    const uint2 v = static_cast<const uint2*>(grad)[j];
    const uint16_t h[4] = {static_cast<uint16_t>(v.x), static_cast<uint16_t>(v.x >> 16),
                           static_cast<uint16_t>(v.y), static_cast<uint16_t>(v.y >> 16)};
    for (int e = 0; e < 4; ++e) {
      g[e] = kD == DType::kF16 ? HalfToFloat(h[e]) : Bf16ToFloat(h[e]);
    }
  }
}

template <bool kOut, DType kD>
__device__ __forceinline__ void StoreOut4(void* out, int64_t j, const float (&p)[4]) {
  if constexpr (!kOut) {
    return;
  } else if constexpr (kD == DType::kF32) {
    static_cast<float4*>(out)[j] = make_float4(p[0], p[1], p[2], p[3]);
  } else {
    uint16_t h[4];
    for (int e = 0; e < 4; ++e) h[e] = kD == DType::kF16 ? FloatToHalf(p[e]) : FloatToBf16(p[e]);
    static_cast<uint2*>(out)[j] =
        make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
  }
}

// One optimizer step over [0, n): the first num_vec * 4 elements four at a time with 16-byte
// fp32 and 8-byte 16-bit accesses (num_vec is 0 unless every buffer is aligned for them), the
// rest one at a time; grid-stride over both.
template <DType kGrad, bool kOut, DType kOutDType, typename Op>
__global__ void UpdateKernel(Op op, float* master, StatePtrs<Op::kNumState> state, const void* grad,
                             void* out, int64_t n, int64_t num_vec) {
  constexpr int kS = Op::kNumState;
  STRATA_GRID_STRIDE(j, num_vec) {
    const float4 pv = reinterpret_cast<float4*>(master)[j];
    float p[4] = {pv.x, pv.y, pv.z, pv.w};
    float st[4][kS > 0 ? kS : 1];
    for (int k = 0; k < kS; ++k) {
      const float4 sv = reinterpret_cast<float4*>(state.p[k])[j];
      st[0][k] = sv.x, st[1][k] = sv.y, st[2][k] = sv.z, st[3][k] = sv.w;
    }
    float g[4];
    LoadGrad4<kGrad>(grad, j, g);
    for (int e = 0; e < 4; ++e) op(g[e], p[e], st[e]);
    reinterpret_cast<float4*>(master)[j] = make_float4(p[0], p[1], p[2], p[3]);
    for (int k = 0; k < kS; ++k) {
      reinterpret_cast<float4*>(state.p[k])[j] =
          make_float4(st[0][k], st[1][k], st[2][k], st[3][k]);
    }
    StoreOut4<kOut, kOutDType>(out, j, p);
  }
  const int64_t first = num_vec * 4;
  STRATA_GRID_STRIDE(t, n - first) {
    const int64_t i = first + t;
    float p = master[i];
    float st[kS > 0 ? kS : 1];
    for (int k = 0; k < kS; ++k) st[k] = state.p[k][i];
    op(Load<kGrad>(grad, i), p, st);
    master[i] = p;
    for (int k = 0; k < kS; ++k) state.p[k][i] = st[k];
    Store<kOut, kOutDType>(out, i, p);
  }
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

// Launches UpdateKernel for the run-time dtypes, four elements at a time where every buffer is
// aligned for it.
template <typename Op>
Status LaunchUpdate(cudaStream_t stream, const Op& op, float* master,
                    std::initializer_list<float*> state_ptrs, const void* grad, DType grad_dtype,
                    void* out, DType out_dtype, int64_t n) {
  StatePtrs<Op::kNumState> state{};
  int k = 0;
  for (float* p : state_ptrs) state.p[k++] = p;
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  bool vec = aligned(master, 16) && aligned(grad, grad_dtype == DType::kF32 ? 16 : 8) &&
             (out == nullptr || aligned(out, out_dtype == DType::kF32 ? 16 : 8));
  for (int i = 0; i < Op::kNumState; ++i) vec = vec && aligned(state.p[i], 16);
  const int64_t num_vec = vec ? n / 4 : 0;
  const int grid = GridFor(num_vec > 0 ? num_vec : n);
  return DispatchDTypes(grad_dtype, out, out_dtype, [&](auto g, auto has_out, auto o) {
    UpdateKernel<decltype(g)::value, decltype(has_out)::value, decltype(o)::value>
        <<<grid, kBlock, 0, stream>>>(op, master, state, grad, out, n, num_vec);
    return Launched("UpdateKernel");
  });
}

}  // namespace

Status LaunchAdamWUpdate(cudaStream_t stream, const ci::AdamWScalars& s, const ci::AdamWBuffers& b,
                         int64_t num_elems) {
  if (s.amsgrad) {
    return LaunchUpdate(stream, AdamWOp<true>{s}, b.master, {b.m, b.v, b.max_v}, b.grad,
                        b.grad_dtype, b.out, b.out_dtype, num_elems);
  }
  return LaunchUpdate(stream, AdamWOp<false>{s}, b.master, {b.m, b.v}, b.grad, b.grad_dtype, b.out,
                      b.out_dtype, num_elems);
}

Status LaunchAdagradUpdate(cudaStream_t stream, const ci::AdagradScalars& s,
                           const ci::StateBuffers& b, int64_t num_elems) {
  return LaunchUpdate(stream, AdagradOp{s}, b.master, {b.state}, b.grad, b.grad_dtype, b.out,
                      b.out_dtype, num_elems);
}

Status LaunchLionUpdate(cudaStream_t stream, const ci::LionScalars& s, const ci::StateBuffers& b,
                        int64_t num_elems) {
  return LaunchUpdate(stream, LionOp{s}, b.master, {b.state}, b.grad, b.grad_dtype, b.out,
                      b.out_dtype, num_elems);
}

Status LaunchSgdUpdate(cudaStream_t stream, const ci::SgdScalars& s, const ci::StateBuffers& b,
                       int64_t num_elems) {
  if (s.momentum_mode == ci::SgdMomentumMode::kNone) {
    return LaunchUpdate(stream, SgdOp<false>{s}, b.master, {}, b.grad, b.grad_dtype, b.out,
                        b.out_dtype, num_elems);
  }
  return LaunchUpdate(stream, SgdOp<true>{s}, b.master, {b.state}, b.grad, b.grad_dtype, b.out,
                      b.out_dtype, num_elems);
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
