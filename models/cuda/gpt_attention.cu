// Fused causal self-attention of the GPT, forward and backward, in the manner of
// FlashAttention-2 (Dao 2023); see gpt_cuda.cuh for the contract.
//
// Layout of the work: the forward and the dq pass give each warp one query row and stream the
// keys in tiles of kKeyTile through shared memory (converted to fp32 once per tile): lane j
// scores key j of the tile; the forward's first pass keeps the running max and sum (online
// softmax, fp32) for the log-sum-exp, its second pass rescores the keys and each lane
// accumulates the output dimensions d = lane + 32 i from the normalized, rounded probabilities. The
// dk/dv pass gives each block kKvKeys keys (kKeysPerWarp per warp, their dk and dv in registers)
// and streams the query rows that see them in chunks of kQueryChunk; the block owns its dk, dv
// rows, so there are no atomics and every sum runs in a fixed order: results are bit-identical from
// run to run.
//
// These CUDA-core kernels serve every storage type and head dim <= 128 and are the reference;
// for bf16 and fp16 with hs 64 or 128 the launchers run the tensor-core kernels of
// gpt_attention_tc.cu instead unless told otherwise (AttentionPath, gpt_attention_tiles.h).
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "models/cuda/gpt_attention_tc.cuh"
#include "models/cuda/gpt_cuda.cuh"
#include "models/cuda/gpt_cuda_common.cuh"

namespace strata::models::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

constexpr int kQueryWarps = 8;   // query rows (warps) per block, forward and dq
constexpr int kKeyTile = 32;     // keys per shared-memory tile, forward and dq
constexpr int kKvWarps = 4;      // warps per block of the dk/dv pass
constexpr int kKeysPerWarp = 4;  // keys per warp of the dk/dv pass
constexpr int kKvKeys = kKvWarps * kKeysPerWarp;
constexpr int kQueryChunk = 32;  // query rows per shared-memory chunk of the dk/dv pass
constexpr int kMaxHeadDim = 128;

struct AttnDims {
  int B, T, C, H, hs;
  float scale;
  // Element offset of row t of sequence b in qkv (3C per row) or out (C per row).
  __device__ int64_t QkvRow(int b, int t) const { return (int64_t{b} * T + t) * 3 * C; }
  __device__ int64_t OutRow(int b, int t) const { return (int64_t{b} * T + t) * C; }
  __device__ int64_t Stat(int b, int h, int t) const { return (int64_t{b} * H + h) * T + t; }
};

// Loads rows [k0, k0 + kKeyTile) of head h's k (col_off C) or v (2C) into tile (fp32, row
// stride kDims * 32 + 1); rows past T become zeros.
template <typename D, int kDims>
__device__ void LoadKeyTile(const D* qkv, const AttnDims& a, int b, int h, int k0, int col_off,
                            float (*tile)[kDims * 32 + 1]) {
  constexpr int kW = kDims * 32;
  for (int i = threadIdx.x; i < kKeyTile * kW; i += blockDim.x) {
    const int r = i / kW, d = i % kW, t = k0 + r;
    tile[r][d] = (t < a.T && d < a.hs) ? ToF(qkv[a.QkvRow(b, t) + col_off + h * a.hs + d]) : 0.0f;
  }
}

template <typename D, int kDims>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    AttentionForwardKernel(const D* qkv, AttnDims a, D* out, float* lse) {
  constexpr int kW = kDims * 32;
  __shared__ float ks[kKeyTile][kW + 1];
  __shared__ float vs[kKeyTile][kW + 1];
  __shared__ float qs[kQueryWarps][kW];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int q0 = blockIdx.x * kQueryWarps, t = q0 + warp;
  const int last = min(a.T - 1, q0 + kQueryWarps - 1);
  for (int d = lane; d < kW; d += kWarp) {
    qs[warp][d] = (t < a.T && d < a.hs) ? ToF(qkv[a.QkvRow(b, t) + h * a.hs + d]) : 0.0f;
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
    __syncthreads();  // the previous tile is consumed (and qs written)
    LoadKeyTile<D, kDims>(qkv, a, b, h, k0, a.C, ks);
    __syncthreads();
    if (t >= a.T || k0 > t) continue;  // this warp's row sees no key of the tile
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
    LoadKeyTile<D, kDims>(qkv, a, b, h, k0, a.C, ks);
    LoadKeyTile<D, kDims>(qkv, a, b, h, k0, 2 * a.C, vs);
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
    if (d < a.hs) out[a.OutRow(b, t) + h * a.hs + d] = FromF<D>(o[i]);
  }
  if (lane == 0) lse[a.Stat(b, h, t)] = row_lse;
}

// delta[b, h, t] = sum_d dout * out (fp32 from the stored values). One warp per (row, head).
template <typename D>
__global__ void AttentionDeltaKernel(const D* out, const D* dout, AttnDims a, float* delta) {
  const int lane = threadIdx.x % kWarp;
  const int64_t rows = int64_t{a.B} * a.T * a.H;
  for (int64_t w = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; w < rows;
       w += int64_t{gridDim.x} * blockDim.x / kWarp) {
    const int h = static_cast<int>(w % a.H);
    const int64_t row = w / a.H;  // b T + t
    const int b = static_cast<int>(row / a.T), t = static_cast<int>(row % a.T);
    float acc = 0.0f;
    for (int d = lane; d < a.hs; d += kWarp) {
      const int64_t i = row * a.C + h * a.hs + d;
      acc += ToF(dout[i]) * ToF(out[i]);
    }
    acc = WarpSum(acc);
    if (lane == 0) delta[a.Stat(b, h, t)] = acc;
  }
}

// dq: as the forward, with dp = dout_i . v_j and ds = D(p (dp - delta_i)); dq = D(scale sum ds k).
template <typename D, int kDims>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    AttentionDqKernel(const D* qkv, const D* dout, const float* lse, const float* delta, AttnDims a,
                      D* dqkv) {
  constexpr int kW = kDims * 32;
  __shared__ float ks[kKeyTile][kW + 1];
  __shared__ float vs[kKeyTile][kW + 1];
  __shared__ float qs[kQueryWarps][kW];
  __shared__ float dos[kQueryWarps][kW];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int q0 = blockIdx.x * kQueryWarps, t = q0 + warp;
  const int last = min(a.T - 1, q0 + kQueryWarps - 1);
  for (int d = lane; d < kW; d += kWarp) {
    const bool in = t < a.T && d < a.hs;
    qs[warp][d] = in ? ToF(qkv[a.QkvRow(b, t) + h * a.hs + d]) : 0.0f;
    dos[warp][d] = in ? ToF(dout[a.OutRow(b, t) + h * a.hs + d]) : 0.0f;
  }
  const float row_lse = t < a.T ? lse[a.Stat(b, h, t)] : 0.0f;
  const float row_delta = t < a.T ? delta[a.Stat(b, h, t)] : 0.0f;
  float dq[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) dq[i] = 0.0f;
  for (int k0 = 0; k0 <= last; k0 += kKeyTile) {
    __syncthreads();
    LoadKeyTile<D, kDims>(qkv, a, b, h, k0, a.C, ks);
    LoadKeyTile<D, kDims>(qkv, a, b, h, k0, 2 * a.C, vs);
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
      for (int i = 0; i < kDims; ++i) dq[i] += dsj * ks[jj][lane + 32 * i];
    }
  }
  if (t >= a.T) return;
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hs) dqkv[a.QkvRow(b, t) + h * a.hs + d] = FromF<D>(dq[i] * a.scale);
  }
}

// dk, dv of kKvKeys keys per block: warp w owns keys k0 + w kKeysPerWarp + kk; lane owns
// dimensions lane + 32 i. Query rows i >= k0 stream through shared memory in chunks.
template <typename D, int kDims>
__global__ void __launch_bounds__(kKvWarps* kWarp)
    AttentionDkDvKernel(const D* qkv, const D* dout, const float* lse, const float* delta,
                        AttnDims a, D* dqkv) {
  constexpr int kW = kDims * 32;
  __shared__ float qs[kQueryChunk][kW];
  __shared__ float dos[kQueryChunk][kW];
  __shared__ float lse_s[kQueryChunk];
  __shared__ float delta_s[kQueryChunk];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
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
      kr[kk][i] = in ? ToF(qkv[a.QkvRow(b, j) + a.C + h * a.hs + d]) : 0.0f;
      vr[kk][i] = in ? ToF(qkv[a.QkvRow(b, j) + 2 * a.C + h * a.hs + d]) : 0.0f;
      dk[kk][i] = 0.0f;
      dv[kk][i] = 0.0f;
    }
  }
  for (int c0 = k0; c0 < a.T; c0 += kQueryChunk) {
    __syncthreads();
    for (int x = threadIdx.x; x < kQueryChunk * kW; x += blockDim.x) {
      const int r = x / kW, d = x % kW, t = c0 + r;
      const bool in = t < a.T && d < a.hs;
      qs[r][d] = in ? ToF(qkv[a.QkvRow(b, t) + h * a.hs + d]) : 0.0f;
      dos[r][d] = in ? ToF(dout[a.OutRow(b, t) + h * a.hs + d]) : 0.0f;
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
      float q[kDims], g[kDims];
#pragma unroll
      for (int i = 0; i < kDims; ++i) {
        q[i] = qs[r][lane + 32 * i];
        g[i] = dos[r][lane + 32 * i];
      }
#pragma unroll
      for (int kk = 0; kk < kKeysPerWarp; ++kk) {
        const int j = my_k0 + kk;
        if (j > t || j >= a.T) continue;  // uniform across the warp
        float sp = 0.0f, dpp = 0.0f;
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
          sp += q[i] * kr[kk][i];
          dpp += g[i] * vr[kk][i];
        }
        const float s = WarpSum(sp) * a.scale;
        const float dp = WarpSum(dpp);
        const float p = expf(s - lse_s[r]);
        const float p_rounded = RoundTo<D>(p);
        const float ds = RoundTo<D>(p_rounded * (dp - delta_s[r]));  // as the host
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
          dv[kk][i] += p_rounded * g[i];
          dk[kk][i] += ds * q[i];
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
      dqkv[a.QkvRow(b, j) + a.C + h * a.hs + d] = FromF<D>(dk[kk][i] * a.scale);
      dqkv[a.QkvRow(b, j) + 2 * a.C + h * a.hs + d] = FromF<D>(dv[kk][i]);
    }
  }
}

Status CheckAttention(const char* op, int B, int T, int C, int H) {
  if (B < 1 || T < 1 || H < 1 || C < H || C % H != 0 || C / H > kMaxHeadDim) {
    return InvalidArgumentError(std::string(op) +
                                ": need B, T, H >= 1, C a multiple of H and C / H <= 128");
  }
  return Status::Ok();
}

AttnDims Dims(int B, int T, int C, int H) {
  const int hs = C / H;
  return {B, T, C, H, hs, 1.0f / sqrtf(static_cast<float>(hs))};
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

// Whether to run the tensor-core kernels (gpt_attention_tc.cu): kAuto takes them where they
// apply; kTensorCores where they do not is an error.
template <typename D>
StatusOr<bool> UseTensorCores(const char* op, AttentionPath path, int hs,
                              std::initializer_list<const void*> ptrs) {
  if (path == AttentionPath::kCudaCores) return false;
  bool ok =
      attention_tiles::TensorCoreAttentionSupports(hs, sizeof(D)) && !std::is_same_v<D, float>;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (path == AttentionPath::kTensorCores && !ok) {
    return InvalidArgumentError(std::string(op) +
                                ": the tensor-core path needs bf16 or fp16, head dim 64 or 128 "
                                "and 16-byte aligned buffers");
  }
  return ok;
}

}  // namespace

template <typename D>
Status LaunchAttentionForward(cudaStream_t stream, const D* qkv, int B, int T, int C, int H, D* out,
                              float* lse, AttentionPath path) {
  STRATA_RETURN_IF_ERROR(CheckAttention("LaunchAttentionForward", B, T, C, H));
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchAttentionForward", {qkv, out, lse}));
  const AttnDims a = Dims(B, T, C, H);
  STRATA_ASSIGN_OR_RETURN(const bool tc,
                          UseTensorCores<D>("LaunchAttentionForward", path, a.hs, {qkv, out}));
  if constexpr (!std::is_same_v<D, float>) {
    if (tc) return LaunchAttentionForwardTc<D>(stream, qkv, B, T, C, H, out, lse);
  }
  const dim3 grid((T + kQueryWarps - 1) / kQueryWarps, B * H);
  return WithDims(a.hs, [&]<int kDims>() {
    AttentionForwardKernel<D, kDims><<<grid, kQueryWarps * kWarp, 0, stream>>>(qkv, a, out, lse);
    return Launched("AttentionForwardKernel");
  });
}

template <typename D>
Status LaunchAttentionBackward(cudaStream_t stream, const D* qkv, const D* out, const D* dout,
                               const float* lse, int B, int T, int C, int H, float* delta, D* dqkv,
                               AttentionPath path) {
  STRATA_RETURN_IF_ERROR(CheckAttention("LaunchAttentionBackward", B, T, C, H));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LaunchAttentionBackward", {qkv, out, dout, lse, delta, dqkv}));
  const AttnDims a = Dims(B, T, C, H);
  STRATA_ASSIGN_OR_RETURN(
      const bool tc, UseTensorCores<D>("LaunchAttentionBackward", path, a.hs, {qkv, dout, dqkv}));
  AttentionDeltaKernel<D>
      <<<GridFor(int64_t{B} * T * H, 8), 8 * kWarp, 0, stream>>>(out, dout, a, delta);
  STRATA_RETURN_IF_ERROR(Launched("AttentionDeltaKernel"));
  if constexpr (!std::is_same_v<D, float>) {
    if (tc) return LaunchAttentionBackwardTc<D>(stream, qkv, dout, lse, delta, B, T, C, H, dqkv);
  }
  return WithDims(a.hs, [&]<int kDims>() -> Status {
    const dim3 q_grid((T + kQueryWarps - 1) / kQueryWarps, B * H);
    AttentionDqKernel<D, kDims>
        <<<q_grid, kQueryWarps * kWarp, 0, stream>>>(qkv, dout, lse, delta, a, dqkv);
    STRATA_RETURN_IF_ERROR(Launched("AttentionDqKernel"));
    const dim3 kv_grid((T + kKvKeys - 1) / kKvKeys, B * H);
    AttentionDkDvKernel<D, kDims>
        <<<kv_grid, kKvWarps * kWarp, 0, stream>>>(qkv, dout, lse, delta, a, dqkv);
    return Launched("AttentionDkDvKernel");
  });
}

#define STRATA_INSTANTIATE_ATTENTION(D)                                                     \
  template Status LaunchAttentionForward<D>(cudaStream_t, const D*, int, int, int, int, D*, \
                                            float*, AttentionPath);                         \
  template Status LaunchAttentionBackward<D>(cudaStream_t, const D*, const D*, const D*,    \
                                             const float*, int, int, int, int, float*, D*,  \
                                             AttentionPath);
STRATA_INSTANTIATE_ATTENTION(float)
STRATA_INSTANTIATE_ATTENTION(__half)
STRATA_INSTANTIATE_ATTENTION(__nv_bfloat16)
#undef STRATA_INSTANTIATE_ATTENTION

}  // namespace strata::models::cuda
