// Causal grouped-query attention on CUDA (ops.cuh), fused in the manner of FlashAttention-2
// (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023):
// tiled, online softmax, no T x T matrix in memory, the backward recomputing the probabilities
// from the saved log-sum-exp. One op, two implementations with the same rounding points, chosen
// by AttentionPath (attention_tiles.h):
//
// CUDA cores, any head_dim <= 256, every storage type (the reference; the only path past 128,
// Gemma 3's 256):
//   - forward and dq: one warp per query row, keys streamed through shared memory in tiles of
//     kKeyTile (fp32); lane j scores key j of the tile, lane l accumulates output dimensions
//     l + 32 i. The forward is one pass over the keys (online softmax), its softmax tiles of
//     kAttentionKeyTile keys two shared tiles each.
//   - dk/dv: one block per (sequence, kv head, kKvKeys keys), kKeysPerWarp keys per warp with
//     their dk, dv in registers; the block loops over the query heads of the group in head
//     order and, for each, over the query rows that see its keys in chunks of kQueryChunk. The
//     block owns its dk, dv rows: no atomics, fixed order, bit-identical from run to run.
//   Each lane holds kDims = ceil(head_dim / 32) output dimensions: 1..4, and 8 for head dims
//   129..256. Up to 128 the shared tiles are static, as they always were; past it they exceed
//   the 48 KB a kernel may declare statically and are dynamic (SharedTiles, CudaCoreLaunch),
//   the same arrays in the same kernels: the arithmetic does not depend on where they live.
//
// Tensor cores, bf16 and fp16, head_dim 64 and 128 (namespace tc below; tile schedule in
// attention_tiles.h):
//   Products: mma.sync.aligned.m16n8k16 (D x D -> fp32), sm_80 and later. Every block has 4
//   warps; each warp owns 16 rows of its block's tile (queries in the forward and dq, keys in
//   dk/dv) and keeps their fp32 accumulators in registers. Operands come from shared memory by
//   ldmatrix (.trans where the reduction runs down the rows of a tile); tiles come from global
//   memory by cp.async, 16 bytes a thread, rows past T zero-filled. The accumulator fragment of a
//   score tile is, element for element, the A fragment of the next product, so P and dS go from
//   registers to the tensor cores without shared memory, rounded to D on the way (the contract's
//   rounding points). dk/dv: one block per (key tile, sequence, kv head) looping over the query
//   heads of the group in head order, as the CUDA-core kernel.
//
// Rounding points of both, those of the host op (models/ops/attention.cc): scores scaled in fp32;
// the forward one pass of online softmax (FlashAttention-2, Algorithm 1) over key tiles of
// kAttentionKeyTile (models/ops/attention.h; tile i holds keys 64 i .. 64 i + 63 of the row): per
// tile the running max m and sum l in fp32, the accumulator rescaled by exp(m_old - m), the
// tile's P~ = exp(s - m) rounded to D before P~ V; at the end O = acc / l rounded once, lse =
// m + ln l in fp32 (until issue 42 the forward took a second pass to round the normalised
// exp(s - lse), computing q k^T twice); backward P = exp(s - lse) from q, k, rounded to D,
// dS = D(D(P) (dP - delta)), dq, dk, dv accumulated in fp32 and rounded once (dk, dv over the
// query heads of their group in head order). Deterministic: no atomics; dk, dv per key tile over
// the query heads and tiles in order, dq per query tile over the key tiles in order.
//
// Packed sequences and sliding windows: query t of sequence b sees keys FirstKey .. t, where
// FirstKey = t - position_ids[b, t] with position_ids (AttentionDims::position_ids non-null:
// block-diagonal causal attention), else 0, and with a window w >= 1 (AttentionDims::window, as
// Hugging Face's create_sliding_window_causal_mask) at least t - w + 1. Both implementations add
// that lower bound to every mask test; the tensor-core kernels mask every visited tile then
// (TileNeedsMask only knows the causal square). A block starts at the key tile of the smallest
// first key of its queries (forward, dq: max(0, q0 - w + 1) for a window alone) and the dk/dv
// blocks skip the query tiles none of whose queries sees one of their keys; with a window they
// also stop after the last query that sees their last key (key j is seen by queries up to
// j + w - 1). In the online softmax a row may meet a tile whose keys it does not see before any
// it does: its running max is still -inf, and the exponentials are shifted by 0 instead (as
// FlashAttention does), so l and the sums stay 0 rather than NaN. A window of T or more masks
// nothing (CheckDims drops it). Without position_ids and window every first key is 0 and the
// kernels compute what they computed before, bit for bit (the same tiles, the same shifts, the
// same masks).
//
// Soft-capping (AttentionDims::softcap c > 0, Gemma 2): each scaled score x becomes c tanh(x / c)
// before the mask and the softmax, in fp32, in the forward and in the backward's recomputation
// of P; the backward multiplies D(P) (dP - delta) by 1 - tanh^2(x / c) before the rounding to D
// (the host op's order, models/ops/attention.cc). Every kernel takes it as a template flag
// (kCap, as FlashAttention-2's Is_softcap), so that without it the kernels are the code of
// before the option: the same results bit for bit, the same registers.
//
// Indexing (both implementations, the invariant the GPT relies on): element d of head `head` of
// row t of sequence b is at [(b T + t) row_stride + head hs + d] in q, k, v, dq, dk, dv and at
// [(b T + t) H hs + h hs + d] in out and dout; lse and delta at [(b H + h) T + t]; query head h
// reads kv head h / (H / Hkv). The GPT passes q = qkv, k = qkv + C, v = qkv + 2C, row_stride 3C,
// Hkv = H: every address equals the one its former qkv-only kernels computed (b T 3C + h hs,
// + C, + 2C; out rows of C = H hs), and with a group of one head the dk/dv blocks visit the same
// tiles in the same order, so its results are unchanged bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "models/ops/cuda/attention_tiles.h"
#include "models/ops/cuda/common.cuh"
#include "models/ops/cuda/ops.cuh"

namespace strata::models::ops::cuda {
namespace {

using namespace internal;  // NOLINT: the shared device helpers

// ---------------------------------------------------------------------------
// CUDA cores.

constexpr int kQueryWarps = 8;
constexpr int kKeyTile = 32;
constexpr int kKvWarps = 4;
constexpr int kKeysPerWarp = 4;
constexpr int kKvKeys = kKvWarps * kKeysPerWarp;
constexpr int kQueryChunk = 32;

// The first key query t of sequence b sees: t - position_ids[b, t] with position_ids (packed
// sequences), 0 without; with a window (>= 1) at least t - window + 1. An id outside [0, t]
// traps, as a token outside the vocabulary does.
__device__ __forceinline__ int FirstKeyOf(const int32_t* pos, int window, int T, int b, int t) {
  int lo = 0;
  if (pos != nullptr) {
    const int32_t p = pos[int64_t{b} * T + t];
    if (p < 0 || p > t) __trap();
    lo = t - p;
  }
  return window > 0 ? max(lo, t - window + 1) : lo;
}

// The smallest first key of the queries [q0, q0 + n) below T of sequence b (q0 < T), called by
// every thread of the block (n <= blockDim.x); barriers inside with position_ids. Without them
// the first key grows with the query: 0, or max(0, q0 - window + 1) with a window. The integer
// atomicMin's result does not depend on the order of the atomics.
__device__ int BlockFirstKey(const int32_t* pos, int window, int T, int b, int q0, int n) {
  if (pos == nullptr) return window > 0 ? max(0, q0 - window + 1) : 0;
  __shared__ int first;
  if (threadIdx.x == 0) first = T;
  __syncthreads();
  const int i = static_cast<int>(threadIdx.x), t = q0 + i;
  if (i < n && t < T) atomicMin(&first, FirstKeyOf(pos, window, T, b, t));
  __syncthreads();
  return first;
}

// Packed sequences or a window, the dk/dv kernels: lo_s[i] = the first key of query c0 + i for
// i < n (T past the sequence); returns whether any of them sees a key <= last_key (a barrier:
// every thread of the block calls it, n <= blockDim.x). A query before the block's first key
// counts as seeing (its first key is <= itself): the test never skips a tile with a query that
// sees a key of the block, and the mask zeroes the pairs of the others.
__device__ bool QueriesSeeKeys(const int32_t* pos, int window, int T, int b, int c0, int n,
                               int last_key, int* lo_s) {
  bool sees = false;
  const int i = static_cast<int>(threadIdx.x), t = c0 + i;
  if (i < n) {
    const int lo = t < T ? FirstKeyOf(pos, window, T, b, t) : T;
    lo_s[i] = lo;
    sees = lo <= last_key;
  }
  return __syncthreads_or(sees) != 0;
}

// A soft-capped score (AttentionDims::softcap; Gemma Team, "Gemma 2: Improving Open Language
// Models at a Practical Size", 2024): the scaled score x as c tanh(x / c), rounded to fp32 as the
// host op rounds it (__fmul_rn: not contracted into the subtraction of the max or lse that
// follows), and its derivative 1 - tanh^2(x / c), the factor of the score's gradient.
struct CappedScore {
  float value;
  float slope;
};
__device__ __forceinline__ CappedScore Cap(float x, float c) {
  const float u = tanhf(x / c);
  return {__fmul_rn(c, u), 1.0f - u * u};
}

struct Dims {
  int B, T, H, Hkv, hs, group;
  int64_t ld;  // row stride of q, k, v, dq, dk, dv
  float scale;
  const int32_t* pos;  // (B, T) position_ids or null (AttentionDims::position_ids)
  int window;          // AttentionDims::window, 0 where it is T or more (masks nothing)
  float softcap;       // AttentionDims::softcap in fp32, 0: none (the kernels' kCap false)
  __device__ int64_t Row(int b, int t) const { return (int64_t{b} * T + t) * ld; }
  __device__ int64_t OutRow(int b, int t) const { return (int64_t{b} * T + t) * H * hs; }
  __device__ int64_t Stat(int b, int h, int t) const { return (int64_t{b} * H + h) * T + t; }
};

// The largest kDims whose shared tiles are declared statically (head dim 128).
constexpr int kStaticMaxDims = 4;

// The shared tiles of each CUDA-core kernel for kDims dimensions a lane (width kW = 32 kDims;
// the key tiles padded by a column against bank conflicts).
template <int kDims>
struct ForwardTiles {
  float ks[kKeyTile][kDims * 32 + 1];
  float vs[kKeyTile][kDims * 32 + 1];
  float qs[kQueryWarps][kDims * 32];
};
template <int kDims>
struct DqTiles {
  float ks[kKeyTile][kDims * 32 + 1];
  float vs[kKeyTile][kDims * 32 + 1];
  float qs[kQueryWarps][kDims * 32];
  float dos[kQueryWarps][kDims * 32];
};
template <int kDims>
struct DkDvTiles {
  float qs[kQueryChunk][kDims * 32];
  float dos[kQueryChunk][kDims * 32];
  float lse_s[kQueryChunk];
  float delta_s[kQueryChunk];
  int lo_s[kQueryChunk];  // bounded: the first key of each query of the chunk
};

// The kernel's tiles T: a static __shared__ variable up to kStaticMaxDims, else the start of the
// dynamic shared memory, sizeof(T) bytes given at the launch (CudaCoreLaunch).
template <typename T, int kDims>
__device__ __forceinline__ T& SharedTiles() {
  if constexpr (kDims <= kStaticMaxDims) {
    __shared__ T tiles;
    return tiles;
  } else {
    extern __shared__ uint4 cuda_core_smem[];
    return *reinterpret_cast<T*>(cuda_core_smem);
  }
}

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

template <typename D, int kDims, bool kCap>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    GqaForwardKernel(const D* q, const D* k, const D* v, Dims a, D* out, float* lse) {
  constexpr int kW = kDims * 32;
  ForwardTiles<kDims>& tiles = SharedTiles<ForwardTiles<kDims>, kDims>();
  auto& ks = tiles.ks;
  auto& vs = tiles.vs;
  auto& qs = tiles.qs;
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
  // This warp's row sees keys lo..t; the block starts at the softmax tile of its rows' smallest
  // lo.
  constexpr int kSoftmaxTile = kAttentionKeyTile;  // two shared key tiles
  static_assert(kSoftmaxTile == 2 * kKeyTile);
  const int lo = t < a.T ? FirstKeyOf(a.pos, a.window, a.T, b, t) : 0;
  const int k_begin =
      BlockFirstKey(a.pos, a.window, a.T, b, q0, kQueryWarps) / kSoftmaxTile * kSoftmaxTile;
  // Lane's scaled (kCap: and soft-capped) score of key j (in the tile in ks) for this warp's row
  // t; -inf outside lo..t.
  const auto score = [&](int j) {
    if (t >= a.T || j > t || j < lo) return -INFINITY;
    float dot = 0.0f;
    for (int d = 0; d < a.hs; ++d) dot += qs[warp][d] * ks[lane][d];
    if constexpr (kCap) return Cap(dot * a.scale, a.softcap).value;
    return dot * a.scale;
  };
  // o += sum over key tile k0 (v rows in vs) of D(p_j) v_j, p_j on lane j - k0.
  const auto accumulate = [&](int k0, float p) {
    if (t >= a.T || k0 > t || k0 + kKeyTile <= lo) return;  // the row sees no key of the tile
    const float p_rounded = RoundTo<D>(p);                  // 0 where masked
    const int keys = min(kKeyTile, t - k0 + 1);
    for (int jj = max(0, lo - k0); jj < keys; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p_rounded, jj);
#pragma unroll
      for (int i = 0; i < kDims; ++i) o[i] += pj * vs[jj][lane + 32 * i];
    }
  };
  // One pass (FlashAttention-2's online softmax, Algorithm 1) over softmax tiles of
  // kAttentionKeyTile keys, each two shared tiles of kKeyTile (lane j scores key k0 + j and key
  // k0 + kKeyTile + j): the row's running max m and sum l (fp32, of the unrounded exp(s - m)),
  // o rescaled by exp(m_old - m), the tile's probabilities exp(s - m) rounded to D before P V
  // (the host op's rounding points, models/ops/attention.cc ForwardWeightsInPlace); at the end
  // o / l rounded once, lse = m + ln l. The loads are block-uniform, the barriers unconditional.
  float m = -INFINITY, l = 0.0f;
  for (int k0 = k_begin; k0 <= last; k0 += kSoftmaxTile) {
    const int k1 = k0 + kKeyTile;
    const bool second = k1 <= last;  // the block's rows see a key of the second half
    __syncthreads();                 // the previous tiles are consumed
    LoadKeyTile<D, kDims>(k, a, b, kh, k0, ks);
    __syncthreads();
    const float s0 = score(k0 + lane);
    __syncthreads();
    if (second) LoadKeyTile<D, kDims>(k, a, b, kh, k1, ks);
    LoadKeyTile<D, kDims>(v, a, b, kh, k0, vs);
    __syncthreads();
    const float s1 = second ? score(k1 + lane) : -INFINITY;
    const float m_new = fmaxf(m, WarpMax(fmaxf(s0, s1)));
    const float shift = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: exp(-inf) = 0
    const float rescale = expf(m - shift);  // 0 until the row has seen a key (o and l are 0)
    const float p0 = expf(s0 - shift), p1 = expf(s1 - shift);  // 0 where masked
    l = l * rescale + WarpSum(p0 + p1);
    m = m_new;
#pragma unroll
    for (int i = 0; i < kDims; ++i) o[i] *= rescale;
    accumulate(k0, p0);
    if (!second) continue;  // block-uniform
    __syncthreads();
    LoadKeyTile<D, kDims>(v, a, b, kh, k1, vs);
    __syncthreads();
    accumulate(k1, p1);
  }
  if (t >= a.T) return;  // a row below T has seen its own key: l >= 1
  const float inv_l = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hs) out[a.OutRow(b, t) + int64_t{h} * a.hs + d] = FromF<D>(o[i] * inv_l);
  }
  if (lane == 0) lse[a.Stat(b, h, t)] = m + logf(l);
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

template <typename D, int kDims, bool kCap>
__global__ void __launch_bounds__(kQueryWarps* kWarp)
    GqaDqKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                const float* delta, Dims a, D* dq) {
  constexpr int kW = kDims * 32;
  DqTiles<kDims>& tiles = SharedTiles<DqTiles<kDims>, kDims>();
  auto& ks = tiles.ks;
  auto& vs = tiles.vs;
  auto& qs = tiles.qs;
  auto& dos = tiles.dos;
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
  const int lo = t < a.T ? FirstKeyOf(a.pos, a.window, a.T, b, t) : 0;  // row t sees lo..t
  const int k_begin = BlockFirstKey(a.pos, a.window, a.T, b, q0, kQueryWarps) / kKeyTile * kKeyTile;
  float acc[kDims];
#pragma unroll
  for (int i = 0; i < kDims; ++i) acc[i] = 0.0f;
  for (int k0 = k_begin; k0 <= last; k0 += kKeyTile) {
    __syncthreads();
    LoadKeyTile<D, kDims>(k, a, b, kh, k0, ks);
    LoadKeyTile<D, kDims>(v, a, b, kh, k0, vs);
    __syncthreads();
    if (t >= a.T || k0 > t || k0 + kKeyTile <= lo) continue;
    const int j = k0 + lane;
    float ds = 0.0f;
    if (j <= t && j >= lo) {
      float dot = 0.0f, dp = 0.0f;
      for (int d = 0; d < a.hs; ++d) {
        dot += qs[warp][d] * ks[lane][d];
        dp += dos[warp][d] * vs[lane][d];
      }
      if constexpr (kCap) {  // P of the capped score, dS times the cap's slope before rounding
        const CappedScore x = Cap(dot * a.scale, a.softcap);
        const float p = expf(x.value - row_lse);
        ds = RoundTo<D>(RoundTo<D>(p) * (dp - row_delta) * x.slope);
      } else {
        const float p = expf(dot * a.scale - row_lse);
        ds = RoundTo<D>(RoundTo<D>(p) * (dp - row_delta));  // P rounded, as the host op
      }
    }
    const int keys = min(kKeyTile, t - k0 + 1);
    for (int jj = max(0, lo - k0); jj < keys; ++jj) {
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

template <typename D, int kDims, bool kCap>
__global__ void __launch_bounds__(kKvWarps* kWarp)
    GqaDkDvKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                  const float* delta, Dims a, D* dk_out, D* dv_out) {
  constexpr int kW = kDims * 32;
  DkDvTiles<kDims>& tiles = SharedTiles<DkDvTiles<kDims>, kDims>();
  auto& qs = tiles.qs;
  auto& dos = tiles.dos;
  auto& lse_s = tiles.lse_s;
  auto& delta_s = tiles.delta_s;
  auto& lo_s = tiles.lo_s;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / a.Hkv, kh = blockIdx.y % a.Hkv;
  const int k0 = blockIdx.x * kKvKeys;
  // Packed or windowed: first keys past 0, masked with lo_s.
  const bool bounded = a.pos != nullptr || a.window > 0;
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
      // Windowed: the last query that sees a key of the block is its last key + window - 1.
      if (a.window > 0 && c0 >= k0 + kKvKeys - 1 + a.window) break;
      __syncthreads();
      // Bounded: a chunk none of whose queries sees a key of this block adds nothing.
      if (bounded &&
          !QueriesSeeKeys(a.pos, a.window, a.T, b, c0, kQueryChunk, k0 + kKvKeys - 1, lo_s)) {
        continue;
      }
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
          if (j > t || j >= a.T || (bounded && j < lo_s[r])) continue;  // uniform in the warp
          float sp = 0.0f, dpp = 0.0f;
#pragma unroll
          for (int i = 0; i < kDims; ++i) {
            sp += qv[i] * kr[kk][i];
            dpp += gv[i] * vr[kk][i];
          }
          const float s = WarpSum(sp) * a.scale;
          const float dp = WarpSum(dpp);
          float p_rounded, ds;
          if constexpr (kCap) {  // P of the capped score, dS times the cap's slope
            const CappedScore x = Cap(s, a.softcap);
            p_rounded = RoundTo<D>(expf(x.value - lse_s[r]));
            ds = RoundTo<D>(p_rounded * (dp - delta_s[r]) * x.slope);
          } else {
            const float p = expf(s - lse_s[r]);
            p_rounded = RoundTo<D>(p);
            ds = RoundTo<D>(p_rounded * (dp - delta_s[r]));  // as the host op
          }
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

// AttentionDims::softcap: 0 (none), or finite and > 0 with an fp32 rounding that is finite and
// not 0 (the kernels divide by it in fp32; the host op's fp32 instantiation would divide by 0).
bool SoftcapFitsFp32(double c) {
  if (c == 0) return true;
  const float f = static_cast<float>(c);
  return std::isfinite(c) && c > 0 && std::isfinite(f) && f > 0;
}

StatusOr<Dims> CheckDims(const char* op, const AttentionDims& d) {
  if (d.batch_size < 1 || d.seq_len < 1 || d.num_heads < 1 || d.num_kv_heads < 1 ||
      d.head_dim < 1 || d.head_dim > kAttentionMaxHeadDim || d.num_heads % d.num_kv_heads != 0 ||
      d.row_stride < int64_t{d.num_heads} * d.head_dim ||
      int64_t{d.batch_size} * d.num_heads > kMaxGrid || d.window < 0 || !std::isfinite(d.scale) ||
      d.scale < 0 || !SoftcapFitsFp32(d.softcap)) {
    return InvalidArgumentError(std::string(op) +
                                ": need B, T, H, Hkv >= 1, H a multiple of Hkv, 1 <= head_dim <= "
                                "256, row_stride >= H head_dim, B H <= 65535, window >= 0, a "
                                "finite scale >= 0 and a softcap >= 0 (0: none) finite and not 0 "
                                "in fp32, got softcap=" +
                                std::to_string(d.softcap));
  }
  // AttentionDims::scale: 0 is 1 / sqrt(head_dim) in fp32 (as before the field existed), else the
  // given scale rounded once to fp32; both kernel sets read it from Dims (TcDims copies it).
  const float scale =
      d.scale == 0 ? 1.0f / sqrtf(static_cast<float>(d.head_dim)) : static_cast<float>(d.scale);
  // A window of T or more masks nothing: dropped, so the kernels run their unwindowed schedule
  // (the same results bit for bit, and no window arithmetic near INT_MAX).
  const int window = d.window < d.seq_len ? d.window : 0;
  return Dims{d.batch_size,
              d.seq_len,
              d.num_heads,
              d.num_kv_heads,
              d.head_dim,
              d.num_heads / d.num_kv_heads,
              d.row_stride,
              scale,
              d.position_ids,
              window,
              static_cast<float>(d.softcap)};
}

// Calls f.template operator()<kCap>() with kCap = softcap > 0: the kernels with or without
// soft-capping.
template <typename F>
Status WithSoftcap(float softcap, F&& f) {
  if (softcap > 0.0f) return f.template operator()<true>();
  return f.template operator()<false>();
}

// Calls f.template operator()<kDims>() with kDims = ceil(hs / 32) in 1..4, and 8 for head dims
// 129..256 (one instantiation for them: the lanes' dimensions past hs are masked, as they are
// for any hs not a multiple of 32).
template <typename F>
Status WithDims(int hs, F&& f) {
  switch ((hs + 31) / 32) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 3:
      return f.template operator()<3>();
    case 4:
      return f.template operator()<4>();
    default:
      return f.template operator()<8>();
  }
}

// Launches `kernel` with smem_bytes of dynamic shared memory (0: none), the kernel's limit
// raised to it first (needed past the default 48 KB).
template <typename Kernel, typename... Args>
Status LaunchWithSmem(const char* name, Kernel kernel, dim3 grid, int threads, size_t smem_bytes,
                      cudaStream_t stream, Args... args) {
  if (smem_bytes > 0) {
    STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem_bytes)),
        name));
  }
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  return Launched(name);
}

// Launches a CUDA-core kernel with kDims dimensions a lane and shared tiles Tiles: no dynamic
// shared memory up to kStaticMaxDims (the tiles are static), else sizeof(Tiles) of it.
template <int kDims, typename Tiles, typename Kernel, typename... Args>
Status CudaCoreLaunch(const char* name, Kernel kernel, dim3 grid, int threads, cudaStream_t stream,
                      Args... args) {
  return LaunchWithSmem(name, kernel, grid, threads, kDims > kStaticMaxDims ? sizeof(Tiles) : 0,
                        stream, args...);
}

// ---------------------------------------------------------------------------
// Tensor cores.

namespace tc {

namespace at = attention_tiles;

constexpr int kThreads = at::kWarpsPerBlock * kWarp;

// ---------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes 0 writes zeros (rows past T).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}

// c += a b, m16n8k16, fp32 accumulators. a: 4 registers of 2 D, b: 2.
template <typename D>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 rounded to D (nearest even), lo in the low half: the element of lower column index.
template <typename D>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// ---------------------------------------------------------------------------
// Warp-level tile products. Fragment layout of m16n8k16 (PTX ISA, "Matrix fragments for
// mma.m16n8k16"), g = lane / 4, c = lane % 4: accumulator n-tile j holds rows g (elements 0,
// 1) and g + 8 (2, 3) at columns 8 j + 2 c + (0, 1).

// acc (16 x kN) += A (16 x kK) B^T, A rows at a (stride elements), B: kN rows of kK at b; both
// row-major with the reduction dimension contiguous (q k^T, dout v^T, k q^T, v dout^T).
template <typename D, int kN, int kK>
__device__ __forceinline__ void MmaABt(float (&acc)[kN / 8][4], const D* a, const D* b,
                                       int stride) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int kc = 0; kc < kK / 16; ++kc) {
    uint32_t af[4];  // matrices: rows 0-7 / 8-15 x cols 0-7, then cols 8-15
    LdMatrixX4(af, a + (lane % 16) * stride + kc * 16 + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t bf[4];  // n-tile nt: k 0-7, k 8-15; n-tile nt + 1: k 0-7, k 8-15
      LdMatrixX4(
          bf, b + (nt * 8 + lane % 8 + (lane / 16) * 8) * stride + kc * 16 + ((lane / 8) % 2) * 8);
      Mma<D>(acc[nt], af, bf[0], bf[1]);
      Mma<D>(acc[nt + 1], af, bf[2], bf[3]);
    }
  }
}

// acc (16 x kN) += A (16 x kK, register fragments) B, B: kK rows of kN at b (stride elements),
// row-major (p v, ds k, p^T dout, ds^T q): the reduction runs down B's rows, hence .trans.
template <typename D, int kN, int kK>
__device__ __forceinline__ void MmaAB(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4],
                                      const D* b, int stride) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int kc = 0; kc < kK / 16; ++kc) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t bf[4];  // k 0-7 / 8-15 of n-tile nt, then of n-tile nt + 1
      LdMatrixX4Trans(
          bf, b + (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * stride + nt * 8 + (lane / 16) * 8);
      Mma<D>(acc[nt], a[kc], bf[0], bf[1]);
      Mma<D>(acc[nt + 1], a[kc], bf[2], bf[3]);
    }
  }
}

// An accumulator tile (16 x kN fp32) rounded to D as the A fragments of a product over kN.
template <typename D, int kN>
__device__ __forceinline__ void ToFragments(const float (&c)[kN / 8][4],
                                            uint32_t (&a)[kN / 16][4]) {
#pragma unroll
  for (int kc = 0; kc < kN / 16; ++kc) {
    a[kc][0] = Pack<D>(c[2 * kc][0], c[2 * kc][1]);          // row g, k 2c
    a[kc][1] = Pack<D>(c[2 * kc][2], c[2 * kc][3]);          // row g + 8, k 2c
    a[kc][2] = Pack<D>(c[2 * kc + 1][0], c[2 * kc + 1][1]);  // row g, k 8 + 2c
    a[kc][3] = Pack<D>(c[2 * kc + 1][2], c[2 * kc + 1][3]);  // row g + 8, k 8 + 2c
  }
}

template <int kN>
__device__ __forceinline__ void Zero(float (&c)[kN / 8][4]) {
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) c[j][e] = 0.0f;
  }
}

// Rows [row0, row0 + kRows) of a (T rows, row stride ld elements, kHs columns at src) into
// shared memory (stride SmemStride(kHs)) by cp.async, by all threads of the block; rows past T
// become zeros. The caller commits the group.
template <typename D, int kHs, int kRows>
__device__ __forceinline__ void LoadTile(D* dst, const D* src, int64_t ld, int row0, int T) {
  constexpr int kChunks = kHs * int{sizeof(D)} / 16;  // 16-byte pieces per row
  constexpr int kStride = at::SmemStride(kHs);
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * (16 / int{sizeof(D)});
    const int t = row0 + r;
    const D* from = t < T ? src + t * ld + c : src;
    CpAsync16(dst + r * kStride + c, from, t < T ? 16 : 0);
  }
}

// The indexing invariant (the same as the CUDA-core kernels' Dims): element d of head `head` of
// row t of sequence b is at [(b T + t) ld + head hs + d] in q, k, v, dq, dk, dv (ld = row_stride)
// and at [(b T + t) H hs + h hs + d] in out and dout; query head h reads kv head h / group. For
// the GPT (q = qkv, k = qkv + C, v = qkv + 2C, ld = 3C, group 1, C = H hs) every address is the
// one the GPT-only kernels computed from qkv: Row0(b, h) = b T 3C + h hs, k and v C and 2C
// further; Out(b, h) = b T C + h hs with row stride C. With group 1 the dk/dv block visits one
// query head, so loop order, tiles and rounding are those of the GPT-only kernels.
struct TcDims {
  int T, H, group;
  int64_t ld;  // row stride of q, k, v, dq, dk, dv (elements)
  float scale;
  const int32_t* pos;  // (B, T) position_ids or null
  int window;          // Dims::window (0: none)
  float softcap;       // Dims::softcap (0: none; the kernels' kCap)
  // Bounded (position_ids or a window): first keys past 0, so every visited tile is masked.
  __device__ bool Bounded() const { return pos != nullptr || window > 0; }
  // First element of head `head` of sequence b in q, k, v, dq, dk, dv (rows of ld).
  __device__ int64_t Row0(int b, int head, int hs) const {
    return int64_t{b} * T * ld + int64_t{head} * hs;
  }
  // First element of head h of sequence b in out / dout (rows of H hs).
  __device__ int64_t Out(int b, int h, int hs) const {
    return int64_t{b} * T * H * hs + int64_t{h} * hs;
  }
  __device__ int64_t Stat(int b, int h) const { return (int64_t{b} * H + h) * T; }
};

// Writes the two D of accumulator elements (e, e + 1) of n-tile nt, row `row`, scaled by mul.
template <typename D, int kHs>
__device__ __forceinline__ void StoreRow(D* dst_row, const float (&acc)[kHs / 8][4], int half,
                                         float mul) {
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int nt = 0; nt < kHs / 8; ++nt) {
    *reinterpret_cast<uint32_t*>(dst_row + nt * 8 + 2 * c) =
        Pack<D>(acc[nt][2 * half] * mul, acc[nt][2 * half + 1] * mul);
  }
}

// ---------------------------------------------------------------------------
// Forward: one block per (query tile, b h); warp w owns queries q0 + 16 w + (g, g + 8).

template <typename D, int kHs, bool kCap>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardTcKernel(const D* q, const D* k, const D* v, TcDims a, D* out, float* lse) {
  constexpr int kStride = at::SmemStride(kHs);
  constexpr int kQ = at::kQueryTile, kK = at::kKeyTile;
  extern __shared__ uint4 smem[];
  D* qs = reinterpret_cast<D*>(smem);
  D* ks = qs + kQ * kStride;
  D* vs = ks + kK * kStride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, c = lane % 4;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int kh = h / a.group;
  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int q0 = qt * kQ;
  const int64_t ld = a.ld;
  const D* q_src = q + a.Row0(b, h, kHs);
  const D* k_src = k + a.Row0(b, kh, kHs);
  const D* v_src = v + a.Row0(b, kh, kHs);
  LoadTile<D, kHs, kQ>(qs, q_src, ld, q0, a.T);
  CpAsyncCommit();

  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  // Bounded: row r sees keys lo[r]..row[r], and every tile is masked.
  const bool bounded = a.Bounded();
  int lo[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < a.T ? FirstKeyOf(a.pos, a.window, a.T, b, row[r]) : 0;
  }
  const int first = BlockFirstKey(a.pos, a.window, a.T, b, q0, kQ) / kK;
  float o[kHs / 8][4];
  Zero<kHs>(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int last = at::LastKeyTile(qt, kQ, kK, a.T);
  // The scaled (kCap: and soft-capped) scores of key tile k0 (in ks) for the warp's rows, -inf
  // where masked.
  const auto scores = [&](int k0, float(&s)[kK / 8][4]) {
    Zero<kK>(s);
    MmaABt<D, kK, kHs>(s, qs + warp * 16 * kStride, ks, kStride);
    const bool masked = bounded || at::TileNeedsMask(q0, kQ, k0, kK, a.T);
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + j * 8 + 2 * c + (e & 1);
        float x = s[j][e] * a.scale;
        if constexpr (kCap) x = Cap(x, a.softcap).value;
        if (masked && (key > row[e / 2] || key >= a.T || key < lo[e / 2])) x = -INFINITY;
        s[j][e] = x;
      }
    }
  };
  // One pass (FlashAttention-2's online softmax, Algorithm 1): per key tile the rows' running
  // max m and sum l (fp32, of the unrounded exp(s - m)), o rescaled by exp(m_old - m) and the
  // tile's probabilities exp(s - m) rounded to D before P V (the host op's rounding points,
  // models/ops/attention.cc ForwardWeightsInPlace: kK is kAttentionKeyTile, tile kt holds keys
  // kt kK .. kt kK + kK - 1 of the row); at the end o / l, rounded once, and lse = m + ln l.
  for (int kt = first; kt <= last; ++kt) {
    const int k0 = kt * kK;
    __syncthreads();  // the previous k and v tiles are consumed
    LoadTile<D, kHs, kK>(ks, k_src, ld, k0, a.T);
    CpAsyncCommit();
    LoadTile<D, kHs, kK>(vs, v_src, ld, k0, a.T);
    CpAsyncCommit();
    CpAsyncWait<1>();  // q and k have landed; v may still be in flight
    __syncthreads();
    float s[kK / 8][4];
    scores(k0, s);
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
    }
    float shift[2], rescale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // Finite unbounded (key 0 is valid for every row); -inf for a bounded row (packed or
      // windowed) that has seen no key yet, which shifts by 0 then (exp(-inf) = 0, no NaN).
      const float m_new = fmaxf(m[r], mx[r]);
      shift[r] = m_new == -INFINITY ? 0.0f : m_new;
      rescale[r] = expf(m[r] - shift[r]);  // 0 until the row has seen a key (o and l are 0)
      m[r] = m_new;
    }
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = expf(s[j][e] - shift[e / 2]);  // 0 where masked
        sum[e / 2] += s[j][e];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      l[r] = l[r] * rescale[r] + sum[r];
    }
#pragma unroll
    for (int nt = 0; nt < kHs / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] *= rescale[e / 2];
    }
    uint32_t p[kK / 16][4];
    ToFragments<D, kK>(s, p);  // exp(s - m) rounded to D
    CpAsyncWait<0>();
    __syncthreads();  // v has landed for every thread
    MmaAB<D, kHs, kK>(o, p, vs, kStride);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= a.T) continue;  // a row below T has seen its own key: l >= 1
    StoreRow<D, kHs>(out + a.Out(b, h, kHs) + int64_t{row[r]} * a.H * kHs, o, r, 1.0f / l[r]);
    if (c == 0) lse[a.Stat(b, h) + row[r]] = m[r] + logf(l[r]);
  }
}

// ---------------------------------------------------------------------------
// dq: one block per (query tile, b h), over the key tiles 0..last:
// s = q k^T, p = exp(scale s - lse), dp = dout v^T, ds = D(D(p) (dp - delta)), dq += ds k.

template <typename D, int kHs, bool kCap>
__global__ void __launch_bounds__(kThreads)
    AttentionDqTcKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                        const float* delta, TcDims a, D* dq_out) {
  constexpr int kStride = at::SmemStride(kHs);
  constexpr int kQ = at::kQueryTile, kK = at::kKeyTile;
  extern __shared__ uint4 smem[];
  D* qs = reinterpret_cast<D*>(smem);
  D* dos = qs + kQ * kStride;
  D* ks = dos + kQ * kStride;
  D* vs = ks + kK * kStride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, c = lane % 4;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int kh = h / a.group;
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int q0 = qt * kQ;
  const int64_t ld = a.ld;
  const D* q_src = q + a.Row0(b, h, kHs);
  const D* k_src = k + a.Row0(b, kh, kHs);
  const D* v_src = v + a.Row0(b, kh, kHs);
  LoadTile<D, kHs, kQ>(qs, q_src, ld, q0, a.T);
  LoadTile<D, kHs, kQ>(dos, dout + a.Out(b, h, kHs), int64_t{a.H} * kHs, q0, a.T);
  CpAsyncCommit();
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_lse[r] = row[r] < a.T ? lse[a.Stat(b, h) + row[r]] : 0.0f;
    row_delta[r] = row[r] < a.T ? delta[a.Stat(b, h) + row[r]] : 0.0f;
  }
  // Bounded: row r sees keys lo[r]..row[r], and every tile is masked.
  const bool bounded = a.Bounded();
  int lo[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = row[r] < a.T ? FirstKeyOf(a.pos, a.window, a.T, b, row[r]) : 0;
  }
  const int first = BlockFirstKey(a.pos, a.window, a.T, b, q0, kQ) / kK;
  float dq[kHs / 8][4];
  Zero<kHs>(dq);
  const int last = at::LastKeyTile(qt, kQ, kK, a.T);
  for (int kt = first; kt <= last; ++kt) {
    const int k0 = kt * kK;
    __syncthreads();
    LoadTile<D, kHs, kK>(ks, k_src, ld, k0, a.T);
    LoadTile<D, kHs, kK>(vs, v_src, ld, k0, a.T);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    float s[kK / 8][4], dp[kK / 8][4];
    Zero<kK>(s);
    Zero<kK>(dp);
    MmaABt<D, kK, kHs>(s, qs + warp * 16 * kStride, ks, kStride);
    MmaABt<D, kK, kHs>(dp, dos + warp * 16 * kStride, vs, kStride);
    const bool masked = bounded || at::TileNeedsMask(q0, kQ, k0, kK, a.T);
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + j * 8 + 2 * c + (e & 1), r = e / 2;
        const bool valid = !masked || (key <= row[r] && key < a.T && row[r] < a.T && key >= lo[r]);
        if constexpr (kCap) {  // P of the capped score, dS times the cap's slope
          const CappedScore x = Cap(s[j][e] * a.scale, a.softcap);
          const float p = valid ? expf(x.value - row_lse[r]) : 0.0f;
          s[j][e] = RoundTo<D>(p) * (dp[j][e] - row_delta[r]) * x.slope;
        } else {
          const float p = valid ? expf(s[j][e] * a.scale - row_lse[r]) : 0.0f;
          s[j][e] = RoundTo<D>(p) * (dp[j][e] - row_delta[r]);  // P rounded, as the host op
        }
      }
    }
    uint32_t ds[kK / 16][4];
    ToFragments<D, kK>(s, ds);  // dS rounded to D
    MmaAB<D, kHs, kK>(dq, ds, ks, kStride);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= a.T) continue;
    StoreRow<D, kHs>(dq_out + a.Row0(b, h, kHs) + int64_t{row[r]} * a.ld, dq, r, a.scale);
  }
}

// ---------------------------------------------------------------------------
// dk, dv: one block per (key tile, b kh), over the query heads of kv head kh's group in head
// order and, for each, the query tiles that see the key tile; warp w owns keys k0 + 16 w +
// (g, g + 8). dk, dv accumulate over the whole group in fp32 and are rounded once. Transposed
// tiles: s^T = k q^T, p^T = exp(scale s^T - lse), dp^T = v dout^T, ds^T = D(D(p^T) (dp^T - delta));
// dv += D(p^T) dout, dk += ds^T q.

template <typename D, int kHs, bool kCap>
__global__ void __launch_bounds__(kThreads)
    AttentionDkDvTcKernel(const D* q, const D* k, const D* v, const D* dout, const float* lse,
                          const float* delta, TcDims a, D* dk_out, D* dv_out) {
  constexpr int kStride = at::SmemStride(kHs);
  constexpr int kK = at::kDkDvKeyTile, kQ = at::DkDvQueryTile(kHs);
  extern __shared__ uint4 smem[];
  D* ks = reinterpret_cast<D*>(smem);
  D* vs = ks + kK * kStride;
  D* qs = vs + kK * kStride;
  D* dos = qs + kQ * kStride;
  float* lse_s = reinterpret_cast<float*>(dos + kQ * kStride);
  float* delta_s = lse_s + kQ;
  __shared__ int lo_s[kQ];  // bounded: the first key of each query of the tile
  const bool bounded = a.Bounded();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, c = lane % 4;
  const int Hkv = a.H / a.group;
  const int b = blockIdx.y / Hkv, kh = blockIdx.y % Hkv;
  const int kt = blockIdx.x, k0 = kt * kK;
  const int64_t ld = a.ld;
  LoadTile<D, kHs, kK>(ks, k + a.Row0(b, kh, kHs), ld, k0, a.T);
  LoadTile<D, kHs, kK>(vs, v + a.Row0(b, kh, kHs), ld, k0, a.T);
  CpAsyncCommit();
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  float dk[kHs / 8][4], dv[kHs / 8][4];
  Zero<kHs>(dk);
  Zero<kHs>(dv);
  const int q_end = at::EndQueryTile(kt, kK, kQ, a.T, a.window);  // NumTiles without a window
  for (int gi = 0; gi < a.group; ++gi) {
    const int h = kh * a.group + gi;
    const D* q_src = q + a.Row0(b, h, kHs);
    const D* do_src = dout + a.Out(b, h, kHs);
    const float* lse_src = lse + a.Stat(b, h);
    const float* delta_src = delta + a.Stat(b, h);
    for (int qt = at::FirstQueryTile(kt, kK, kQ); qt < q_end; ++qt) {
      const int c0 = qt * kQ;
      __syncthreads();  // the previous q, dout, lse, delta (and lo) tiles are consumed
      // Bounded: a query tile none of whose queries sees a key of this block adds nothing.
      if (bounded && !QueriesSeeKeys(a.pos, a.window, a.T, b, c0, kQ, k0 + kK - 1, lo_s)) {
        continue;
      }
      LoadTile<D, kHs, kQ>(qs, q_src, ld, c0, a.T);
      LoadTile<D, kHs, kQ>(dos, do_src, int64_t{a.H} * kHs, c0, a.T);
      CpAsyncCommit();
      for (int i = threadIdx.x; i < kQ; i += kThreads) {
        lse_s[i] = c0 + i < a.T ? lse_src[c0 + i] : 0.0f;
        delta_s[i] = c0 + i < a.T ? delta_src[c0 + i] : 0.0f;
      }
      CpAsyncWait<0>();
      __syncthreads();
      float st[kQ / 8][4], dpt[kQ / 8][4];
      Zero<kQ>(st);
      Zero<kQ>(dpt);
      MmaABt<D, kQ, kHs>(st, ks + warp * 16 * kStride, qs, kStride);
      MmaABt<D, kQ, kHs>(dpt, vs + warp * 16 * kStride, dos, kStride);
      const bool masked = bounded || at::TileNeedsMask(c0, kQ, k0, kK, a.T);
#pragma unroll
      for (int j = 0; j < kQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = j * 8 + 2 * c + (e & 1), query = c0 + qi, r = e / 2;
          const bool valid = !masked || (key[r] <= query && query < a.T && key[r] < a.T &&
                                         (!bounded || key[r] >= lo_s[qi]));
          if constexpr (kCap) {  // P of the capped score, dS times the cap's slope
            const CappedScore x = Cap(st[j][e] * a.scale, a.softcap);
            const float p = valid ? expf(x.value - lse_s[qi]) : 0.0f;
            st[j][e] = p;
            dpt[j][e] = RoundTo<D>(p) * (dpt[j][e] - delta_s[qi]) * x.slope;
          } else {
            const float p = valid ? expf(st[j][e] * a.scale - lse_s[qi]) : 0.0f;
            st[j][e] = p;
            dpt[j][e] = RoundTo<D>(p) * (dpt[j][e] - delta_s[qi]);  // P rounded, as the host op
          }
        }
      }
      uint32_t pf[kQ / 16][4];
      ToFragments<D, kQ>(st, pf);  // P^T rounded to D
      MmaAB<D, kHs, kQ>(dv, pf, dos, kStride);
      ToFragments<D, kQ>(dpt, pf);  // dS^T rounded to D
      MmaAB<D, kHs, kQ>(dk, pf, qs, kStride);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= a.T) continue;
    const int64_t dst = a.Row0(b, kh, kHs) + int64_t{key[r]} * a.ld;
    StoreRow<D, kHs>(dk_out + dst, dk, r, a.scale);
    StoreRow<D, kHs>(dv_out + dst, dv, r, 1.0f);
  }
}

template <typename D, bool kCap>
Status LaunchForward(cudaStream_t stream, const Dims& d, const D* q, const D* k, const D* v, D* out,
                     float* lse) {
  const TcDims a{d.T, d.H, d.group, d.ld, d.scale, d.pos, d.window, d.softcap};
  const dim3 grid(at::NumTiles(d.T, at::kQueryTile), d.B * d.H);
  if (d.hs == 64) {
    return LaunchWithSmem("AttentionForwardTcKernel<64>", AttentionForwardTcKernel<D, 64, kCap>,
                          grid, kThreads, at::ForwardSmemBytes(64, sizeof(D)), stream, q, k, v, a,
                          out, lse);
  }
  return LaunchWithSmem("AttentionForwardTcKernel<128>", AttentionForwardTcKernel<D, 128, kCap>,
                        grid, kThreads, at::ForwardSmemBytes(128, sizeof(D)), stream, q, k, v, a,
                        out, lse);
}

// dq, dk, dv given delta = rowsum(dout out) (B, H, T) fp32, already computed on `stream`.
template <typename D, bool kCap>
Status LaunchBackward(cudaStream_t stream, const Dims& d, const D* q, const D* k, const D* v,
                      const D* dout, const float* lse, const float* delta, D* dq, D* dk, D* dv) {
  const TcDims a{d.T, d.H, d.group, d.ld, d.scale, d.pos, d.window, d.softcap};
  const dim3 q_grid(at::NumTiles(d.T, at::kQueryTile), d.B * d.H);
  const dim3 kv_grid(at::NumTiles(d.T, at::kDkDvKeyTile), d.B * d.Hkv);
  if (d.hs == 64) {
    STRATA_RETURN_IF_ERROR(LaunchWithSmem(
        "AttentionDqTcKernel<64>", AttentionDqTcKernel<D, 64, kCap>, q_grid, kThreads,
        at::DqSmemBytes(64, sizeof(D)), stream, q, k, v, dout, lse, delta, a, dq));
    return LaunchWithSmem("AttentionDkDvTcKernel<64>", AttentionDkDvTcKernel<D, 64, kCap>, kv_grid,
                          kThreads, at::DkDvSmemBytes(64, sizeof(D)), stream, q, k, v, dout, lse,
                          delta, a, dk, dv);
  }
  STRATA_RETURN_IF_ERROR(LaunchWithSmem(
      "AttentionDqTcKernel<128>", AttentionDqTcKernel<D, 128, kCap>, q_grid, kThreads,
      at::DqSmemBytes(128, sizeof(D)), stream, q, k, v, dout, lse, delta, a, dq));
  return LaunchWithSmem("AttentionDkDvTcKernel<128>", AttentionDkDvTcKernel<D, 128, kCap>, kv_grid,
                        kThreads, at::DkDvSmemBytes(128, sizeof(D)), stream, q, k, v, dout, lse,
                        delta, a, dk, dv);
}

}  // namespace tc

// Whether to run the tensor-core kernels: kAuto takes them where they apply (bf16 or fp16, head
// dim 64 or 128, the buffers 16-byte aligned and rows a multiple of 16 bytes apart, so that every
// tile row is a whole number of cp.async pieces); kTensorCores where they do not is an error.
template <typename D>
StatusOr<bool> UseTensorCores(const char* op, AttentionPath path, const Dims& a,
                              std::initializer_list<const void*> ptrs) {
  if (path == AttentionPath::kCudaCores) return false;
  bool ok = attention_tiles::TensorCoreAttentionSupports(a.hs, sizeof(D)) &&
            !std::is_same_v<D, float> && (a.ld * static_cast<int64_t>(sizeof(D))) % 16 == 0;
  for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (path == AttentionPath::kTensorCores && !ok) {
    return InvalidArgumentError(std::string(op) +
                                ": the tensor-core path needs bf16 or fp16, head dim 64 or 128, "
                                "16-byte aligned buffers and rows");
  }
  return ok;
}

}  // namespace

template <typename D>
Status LaunchAttentionForward(cudaStream_t stream, const AttentionDims& d, const D* q, const D* k,
                              const D* v, D* out, float* lse, AttentionPath path) {
  STRATA_ASSIGN_OR_RETURN(const Dims a, CheckDims("LaunchAttentionForward", d));
  STRATA_RETURN_IF_ERROR(CheckPointers("LaunchAttentionForward", {q, k, v, out, lse}));
  STRATA_ASSIGN_OR_RETURN(const bool use_tc,
                          UseTensorCores<D>("LaunchAttentionForward", path, a, {q, k, v, out}));
  return WithSoftcap(a.softcap, [&]<bool kCap>() -> Status {
    if constexpr (!std::is_same_v<D, float>) {
      if (use_tc) return tc::LaunchForward<D, kCap>(stream, a, q, k, v, out, lse);
    }
    const dim3 grid((a.T + kQueryWarps - 1) / kQueryWarps, a.B * a.H);
    return WithDims(a.hs, [&]<int kDims>() {
      return CudaCoreLaunch<kDims, ForwardTiles<kDims>>(
          "GqaForwardKernel", GqaForwardKernel<D, kDims, kCap>, grid, kQueryWarps * kWarp, stream,
          q, k, v, a, out, lse);
    });
  });
}

template <typename D>
Status LaunchAttentionBackward(cudaStream_t stream, const AttentionDims& d, const D* q, const D* k,
                               const D* v, const D* out, const D* dout, const float* lse,
                               float* delta, D* dq, D* dk, D* dv, AttentionPath path) {
  STRATA_ASSIGN_OR_RETURN(const Dims a, CheckDims("LaunchAttentionBackward", d));
  STRATA_RETURN_IF_ERROR(
      CheckPointers("LaunchAttentionBackward", {q, k, v, out, dout, lse, delta, dq, dk, dv}));
  STRATA_ASSIGN_OR_RETURN(const bool use_tc, UseTensorCores<D>("LaunchAttentionBackward", path, a,
                                                               {q, k, v, dout, dq, dk, dv}));
  GqaDeltaKernel<D>
      <<<GridFor(int64_t{a.B} * a.T * a.H, 8), 8 * kWarp, 0, stream>>>(out, dout, a, delta);
  STRATA_RETURN_IF_ERROR(Launched("GqaDeltaKernel"));
  return WithSoftcap(a.softcap, [&]<bool kCap>() -> Status {
    if constexpr (!std::is_same_v<D, float>) {
      if (use_tc) {
        return tc::LaunchBackward<D, kCap>(stream, a, q, k, v, dout, lse, delta, dq, dk, dv);
      }
    }
    return WithDims(a.hs, [&]<int kDims>() -> Status {
      const dim3 q_grid((a.T + kQueryWarps - 1) / kQueryWarps, a.B * a.H);
      const Status dq_launched = CudaCoreLaunch<kDims, DqTiles<kDims>>(
          "GqaDqKernel", GqaDqKernel<D, kDims, kCap>, q_grid, kQueryWarps * kWarp, stream, q, k, v,
          dout, lse, delta, a, dq);
      STRATA_RETURN_IF_ERROR(dq_launched);
      const dim3 kv_grid((a.T + kKvKeys - 1) / kKvKeys, a.B * a.Hkv);
      return CudaCoreLaunch<kDims, DkDvTiles<kDims>>("GqaDkDvKernel", GqaDkDvKernel<D, kDims, kCap>,
                                                     kv_grid, kKvWarps * kWarp, stream, q, k, v,
                                                     dout, lse, delta, a, dk, dv);
    });
  });
}

#define STRATA_INSTANTIATE_ATTENTION(D)                                                            \
  template Status LaunchAttentionForward<D>(cudaStream_t, const AttentionDims&, const D*,          \
                                            const D*, const D*, D*, float*, AttentionPath);        \
  template Status LaunchAttentionBackward<D>(cudaStream_t, const AttentionDims&, const D*,         \
                                             const D*, const D*, const D*, const D*, const float*, \
                                             float*, D*, D*, D*, AttentionPath);
STRATA_INSTANTIATE_ATTENTION(float)
STRATA_INSTANTIATE_ATTENTION(__half)
STRATA_INSTANTIATE_ATTENTION(__nv_bfloat16)
#undef STRATA_INSTANTIATE_ATTENTION

}  // namespace strata::models::ops::cuda
