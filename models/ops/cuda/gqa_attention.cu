// Causal grouped-query attention with strided rows on CUDA cores (llama_ops.cuh), the GQA
// generalisation of the GPT's CUDA-core attention (models/cuda/gpt_attention.cu) with the same
// work layout:
//   - forward and dq: one warp per query row, keys streamed through shared memory in tiles of
//     kKeyTile (fp32), online softmax in fp32; lane j scores key j of the tile, lane l
//     accumulates output dimensions l + 32 i.
//   - dk/dv: one block per (sequence, kv head, kKvKeys keys), kKeysPerWarp keys per warp with
//     their dk, dv in registers; the block loops over the query heads of the group in head
//     order and, for each, over the query rows that see its keys in chunks of kQueryChunk. The
//     block owns its dk, dv rows: no atomics, fixed order, bit-identical from run to run.
#include <cmath>
#include <cstdint>
#include <string>

#include "models/cuda/gpt_cuda_common.cuh"
#include "models/ops/cuda/llama_ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace strata::models::cuda::internal;  // NOLINT: the shared device helpers

constexpr int kQueryWarps = 8;
constexpr int kKeyTile = 32;
constexpr int kKvWarps = 4;
constexpr int kKeysPerWarp = 4;
constexpr int kKvKeys = kKvWarps * kKeysPerWarp;
constexpr int kQueryChunk = 32;

struct Dims {
  int B, T, H, Hkv, hs, group;
  int64_t ld;  // row stride of q, k, v, dq, dk, dv
  float scale;
  __device__ int64_t Row(int b, int t) const { return (int64_t{b} * T + t) * ld; }
  __device__ int64_t OutRow(int b, int t) const { return (int64_t{b} * T + t) * H * hs; }
  __device__ int64_t Stat(int b, int h, int t) const { return (int64_t{b} * H + h) * T + t; }
};

// Rows [k0, k0 + kKeyTile) of kv head kh of x (k or v) into tile (fp32); rows past T are zeros.
template <typename D, int kDims>
__device__ void LoadKeyTile(const D* x, const Dims& a, int b, int kh, int k0,
                            float (*tile)[kDims * 32 + 1]) {
  constexpr int kW = kDims * 32;
  for (int i = threadIdx.x; i < kKeyTile * kW; i += blockDim.x) {
    const int r = i / kW, d = i % kW, t = k0 + r;
    tile[r][d] = (t < a.T && d < a.hs) ? ToF(x[a.Row(b, t) + int64_t{kh} * a.hs + d]) : 0.0f;
  }
}

template <typename D, int kDims>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    GqaForwardKernel(const D* q, const D* k, const D* v, Dims a, D* out, float* lse) {
  constexpr int kW = kDims * 32;
  __shared__ float ks[kKeyTile][kW + 1];
  __shared__ float vs[kKeyTile][kW + 1];
  __shared__ float qs[kQueryWarps][kW];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H, kh = h / a.group;
  const int q0 = blockIdx.x * kQueryWarps, t = q0 + warp;
  const int last = min(a.T - 1, q0 + kQueryWarps - 1);
  for (int d = lane; d < kW; d += kWarp) {
    qs[warp][d] = (t < a.T && d < a.hs) ? ToF(q[a.Row(b, t) + int64_t{h} * a.hs + d]) : 0.0f;
  }
  float o[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) o[i] = 0.0f;
  // Lane's scaled score of key j (in the tile in ks) for this warp's row t; -inf past t.
  const auto score = [&](int j) {
    if (j > t) return -INFINITY;
    float dot = 0.0f;
    for (int d = 0; d < a.hs; ++d) dot += qs[warp][d] * ks[lane][d];
    return dot * a.scale;
  };
  // Pass 1: the row's max and sum (online softmax, fp32), hence its log-sum-exp.
  float m = -INFINITY, l = 0.0f;
  for (int k0 = 0; k0 <= last; k0 += kKeyTile) {
    __syncthreads();
    LoadKeyTile<D, kDims>(k, a, b, kh, k0, ks);
    __syncthreads();
    if (t >= a.T || k0 > t) continue;
    const int j = k0 + lane;
    const float s = score(j);
    const float m_new = fmaxf(m, WarpMax(s));
    const float p = j <= t ? expf(s - m_new) : 0.0f;
    l = l * expf(m - m_new) + WarpSum(p);  // m = -inf on the first tile: the factor is 0
    m = m_new;
  }
  const float row_lse = m + logf(l);
  // Pass 2: o = sum_j D(exp(s_j - lse)) v_j, the probabilities normalized before they are
  // rounded to D (the host's rounding point, models/ops/attention.cc), the sum in fp32.
  for (int k0 = 0; k0 <= last; k0 += kKeyTile) {
    __syncthreads();
    LoadKeyTile<D, kDims>(k, a, b, kh, k0, ks);
    LoadKeyTile<D, kDims>(v, a, b, kh, k0, vs);
    __syncthreads();
    if (t >= a.T || k0 > t) continue;
    const int j = k0 + lane;
    const float p_rounded = j <= t ? RoundTo<D>(expf(score(j) - row_lse)) : 0.0f;
    const int keys = min(kKeyTile, t - k0 + 1);
    for (int jj = 0; jj < keys; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p_rounded, jj);
#pragma unroll
      for (int i = 0; i < kDims; ++i) o[i] += pj * vs[jj][lane + 32 * i];
    }
  }
  if (t >= a.T) return;
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hs) out[a.OutRow(b, t) + int64_t{h} * a.hs + d] = FromF<D>(o[i]);
  }
  if (lane == 0) lse[a.Stat(b, h, t)] = row_lse;
}

// delta[b, h, t] = sum_d dout * out (fp32). One warp per (row, head).
template <typename D>
__global__ void GqaDeltaKernel(const D* out, const D* dout, Dims a, float* delta) {
  const int lane = threadIdx.x % kWarp;
  const int64_t rows = int64_t{a.B} * a.T * a.H;
  for (int64_t w = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; w < rows;
       w += int64_t{gridDim.x} * blockDim.x / kWarp) {
    const int h = static_cast<int>(w % a.H);
    const int64_t row = w / a.H;
    const int b = static_cast<int>(row / a.T), t = static_cast<int>(row % a.T);
    float acc = 0.0f;
    for (int d = lane; d < a.hs; d += kWarp) {
      const int64_t i = row * a.H * a.hs + int64_t{h} * a.hs + d;
      acc += ToF(dout[i]) * ToF(out[i]);
    }
    acc = WarpSum(acc);
    if (lane == 0) delta[a.Stat(b, h, t)] = acc;
  }
}

template <typename D, int kDims>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    GqaDqKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                const float* delta, Dims a, D* dq) {
  constexpr int kW = kDims * 32;
  __shared__ float ks[kKeyTile][kW + 1];
  __shared__ float vs[kKeyTile][kW + 1];
  __shared__ float qs[kQueryWarps][kW];
  __shared__ float dos[kQueryWarps][kW];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H, kh = h / a.group;
  const int q0 = blockIdx.x * kQueryWarps, t = q0 + warp;
  const int last = min(a.T - 1, q0 + kQueryWarps - 1);
  for (int d = lane; d < kW; d += kWarp) {
    const bool in = t < a.T && d < a.hs;
    qs[warp][d] = in ? ToF(q[a.Row(b, t) + int64_t{h} * a.hs + d]) : 0.0f;
    dos[warp][d] = in ? ToF(dout[a.OutRow(b, t) + int64_t{h} * a.hs + d]) : 0.0f;
  }
  const float row_lse = t < a.T ? lse[a.Stat(b, h, t)] : 0.0f;
  const float row_delta = t < a.T ? delta[a.Stat(b, h, t)] : 0.0f;
  float acc[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) acc[i] = 0.0f;
  for (int k0 = 0; k0 <= last; k0 += kKeyTile) {
    __syncthreads();
    LoadKeyTile<D, kDims>(k, a, b, kh, k0, ks);
    LoadKeyTile<D, kDims>(v, a, b, kh, k0, vs);
    __syncthreads();
    if (t >= a.T || k0 > t) continue;
    const int j = k0 + lane;
    float ds = 0.0f;
    if (j <= t) {
      float dot = 0.0f, dp = 0.0f;
      for (int d = 0; d < a.hs; ++d) {
        dot += qs[warp][d] * ks[lane][d];
        dp += dos[warp][d] * vs[lane][d];
      }
      const float p = expf(dot * a.scale - row_lse);
      ds = RoundTo<D>(RoundTo<D>(p) * (dp - row_delta));  // P rounded, as the host
    }
    const int keys = min(kKeyTile, t - k0 + 1);
    for (int jj = 0; jj < keys; ++jj) {
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int i = 0; i < kDims; ++i) acc[i] += dsj * ks[jj][lane + 32 * i];
    }
  }
  if (t >= a.T) return;
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hs) dq[a.Row(b, t) + int64_t{h} * a.hs + d] = FromF<D>(acc[i] * a.scale);
  }
}

template <typename D, int kDims>
__global__ void __launch_bounds__(kKvWarps* kWarp)
    GqaDkDvKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                  const float* delta, Dims a, D* dk_out, D* dv_out) {
  constexpr int kW = kDims * 32;
  __shared__ float qs[kQueryChunk][kW];
  __shared__ float dos[kQueryChunk][kW];
  __shared__ float lse_s[kQueryChunk];
  __shared__ float delta_s[kQueryChunk];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.Hkv, kh = blockIdx.y % a.Hkv;
  const int k0 = blockIdx.x * kKvKeys;
  const int my_k0 = k0 + warp * kKeysPerWarp;
  float kr[kKeysPerWarp][kDims], vr[kKeysPerWarp][kDims];
  float dk[kKeysPerWarp][kDims], dv[kKeysPerWarp][kDims];
#pragma unroll
  for (int kk = 0; kk < kKeysPerWarp; ++kk) {
    const int j = my_k0 + kk;
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      const int d = lane + 32 * i;
      const bool in = j < a.T && d < a.hs;
      kr[kk][i] = in ? ToF(k[a.Row(b, j) + int64_t{kh} * a.hs + d]) : 0.0f;
      vr[kk][i] = in ? ToF(v[a.Row(b, j) + int64_t{kh} * a.hs + d]) : 0.0f;
      dk[kk][i] = 0.0f;
      dv[kk][i] = 0.0f;
    }
  }
  for (int g = 0; g < a.group; ++g) {
    const int h = kh * a.group + g;
    for (int c0 = k0; c0 < a.T; c0 += kQueryChunk) {
      __syncthreads();
      for (int x = threadIdx.x; x < kQueryChunk * kW; x += blockDim.x) {
        const int r = x / kW, d = x % kW, t = c0 + r;
        const bool in = t < a.T && d < a.hs;
        qs[r][d] = in ? ToF(q[a.Row(b, t) + int64_t{h} * a.hs + d]) : 0.0f;
        dos[r][d] = in ? ToF(dout[a.OutRow(b, t) + int64_t{h} * a.hs + d]) : 0.0f;
      }
      for (int r = threadIdx.x; r < kQueryChunk; r += blockDim.x) {
        const int t = c0 + r;
        lse_s[r] = t < a.T ? lse[a.Stat(b, h, t)] : 0.0f;
        delta_s[r] = t < a.T ? delta[a.Stat(b, h, t)] : 0.0f;
      }
      __syncthreads();
      const int rows = min(kQueryChunk, a.T - c0);
      for (int r = 0; r < rows; ++r) {
        const int t = c0 + r;
        float qv[kDims], gv[kDims];
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
          qv[i] = qs[r][lane + 32 * i];
          gv[i] = dos[r][lane + 32 * i];
        }
#pragma unroll
        for (int kk = 0; kk < kKeysPerWarp; ++kk) {
          const int j = my_k0 + kk;
          if (j > t || j >= a.T) continue;  // uniform across the warp
          float sp = 0.0f, dpp = 0.0f;
#pragma unroll
          for (int i = 0; i < kDims; ++i) {
            sp += qv[i] * kr[kk][i];
            dpp += gv[i] * vr[kk][i];
          }
          const float s = WarpSum(sp) * a.scale;
          const float dp = WarpSum(dpp);
          const float p = expf(s - lse_s[r]);
          const float p_rounded = RoundTo<D>(p);
          const float ds = RoundTo<D>(p_rounded * (dp - delta_s[r]));  // as the host
#pragma unroll
          for (int i = 0; i < kDims; ++i) {
            dv[kk][i] += p_rounded * gv[i];
            dk[kk][i] += ds * qv[i];
          }
        }
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < kKeysPerWarp; ++kk) {
    const int j = my_k0 + kk;
    if (j >= a.T) continue;
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      const int d = lane + 32 * i;
      if (d >= a.hs) continue;
      dk_out[a.Row(b, j) + int64_t{kh} * a.hs + d] = FromF<D>(dk[kk][i] * a.scale);
      dv_out[a.Row(b, j) + int64_t{kh} * a.hs + d] = FromF<D>(dv[kk][i]);
    }
  }
}

StatusOr<Dims> CheckDims(const char* op, const GqaDims& d) {
  if (d.batch_size < 1 || d.seq_len < 1 || d.num_heads < 1 || d.num_kv_heads < 1 ||
      d.head_dim < 1 || d.head_dim > kGqaMaxHeadDim || d.num_heads % d.num_kv_heads != 0 ||
      d.row_stride < int64_t{d.num_heads} * d.head_dim ||
      int64_t{d.batch_size} * d.num_heads > kMaxGrid) {
    return InvalidArgumentError(std::string(op) +
                                ": need B, T, H, Hkv >= 1, H a multiple of Hkv, 1 <= head_dim <= "
                                "128, row_stride >= H head_dim and B H <= 65535");
  }
  return Dims{d.batch_size, d.seq_len,
              d.num_heads,  d.num_kv_heads,
              d.head_dim,   d.num_heads / d.num_kv_heads,
              d.row_stride, 1.0f / sqrtf(static_cast<float>(d.head_dim))};
}

// Calls f.template operator()<kDims>() with kDims = ceil(hs / 32) in 1..4.
template <typename F>
Status WithDims(int hs, F&& f) {
  switch ((hs + 31) / 32) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 3:
      return f.template operator()<3>();
    default:
      return f.template operator()<4>();
  }
}

}  // namespace

template <typename D>
Status LaunchGqaAttentionForward(cudaStream_t stream, const GqaDims& d, const D* q, const D* k,
                                 const D* v, D* out, float* lse) {
  STRATA_ASSIGN_OR_RETURN(const Dims a, CheckDims("LaunchGqaAttentionForward", d));
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchGqaAttentionForward", {q, k, v, out, lse}));
  const dim3 grid((a.T + kQueryWarps - 1) / kQueryWarps, a.B * a.H);
  return WithDims(a.hs, [&]<int kDims>() {
    GqaForwardKernel<D, kDims><<<grid, kQueryWarps * kWarp, 0, stream>>>(q, k, v, a, out, lse);
    return Launched("GqaForwardKernel");
  });
}

template <typename D>
Status LaunchGqaAttentionBackward(cudaStream_t stream, const GqaDims& d, const D* q, const D* k,
                                  const D* v, const D* out, const D* dout, const float* lse,
                                  float* delta, D* dq, D* dk, D* dv) {
  STRATA_ASSIGN_OR_RETURN(const Dims a, CheckDims("LaunchGqaAttentionBackward", d));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LaunchGqaAttentionBackward", {q, k, v, out, dout, lse, delta, dq, dk, dv}));
  GqaDeltaKernel<D>
      <<<GridFor(int64_t{a.B} * a.T * a.H, 8), 8 * kWarp, 0, stream>>>(out, dout, a, delta);
  STRATA_RETURN_IF_ERROR(Launched("GqaDeltaKernel"));
  return WithDims(a.hs, [&]<int kDims>() -> Status {
    const dim3 q_grid((a.T + kQueryWarps - 1) / kQueryWarps, a.B * a.H);
    GqaDqKernel<D, kDims>
        <<<q_grid, kQueryWarps * kWarp, 0, stream>>>(q, k, v, dout, lse, delta, a, dq);
    STRATA_RETURN_IF_ERROR(Launched("GqaDqKernel"));
    const dim3 kv_grid((a.T + kKvKeys - 1) / kKvKeys, a.B * a.Hkv);
    GqaDkDvKernel<D, kDims>
        <<<kv_grid, kKvWarps * kWarp, 0, stream>>>(q, k, v, dout, lse, delta, a, dk, dv);
    return Launched("GqaDkDvKernel");
  });
}

#define STRATA_INSTANTIATE_GQA(D)                                                                 \
  template Status LaunchGqaAttentionForward<D>(cudaStream_t, const GqaDims&, const D*, const D*,  \
                                               const D*, D*, float*);                             \
  template Status LaunchGqaAttentionBackward<D>(cudaStream_t, const GqaDims&, const D*, const D*, \
                                                const D*, const D*, const D*, const float*,       \
                                                float*, D*, D*, D*);
STRATA_INSTANTIATE_GQA(float)
STRATA_INSTANTIATE_GQA(__half)
STRATA_INSTANTIATE_GQA(__nv_bfloat16)
#undef STRATA_INSTANTIATE_GQA

}  // namespace strata::models::ops::cuda
