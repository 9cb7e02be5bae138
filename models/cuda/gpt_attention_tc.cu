// Fused causal attention on tensor cores, bf16 and fp16, head dims 64 and 128, in the manner of
// FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
// Partitioning", 2023): tiled, online softmax, no T x T matrix in memory, the backward
// recomputing the probabilities from the saved log-sum-exp. Contract in gpt_cuda.cuh; tile
// schedule in gpt_attention_tiles.h.
//
// Products: mma.sync.aligned.m16n8k16 (D x D -> fp32), sm_80 and later. Every block has 4 warps;
// each warp owns 16 rows of its block's tile (queries in the forward and dq, keys in dk/dv) and
// keeps their fp32 accumulators in registers. Operands come from shared memory by ldmatrix
// (.trans where the reduction runs down the rows of a tile); tiles come from global memory by
// cp.async, 16 bytes a thread, rows past T zero-filled. The accumulator fragment of a score
// tile is, element for element, the A fragment of the next product, so P and dS go from
// registers to the tensor cores without shared memory, rounded to D on the way (the contract's
// rounding points).
//
// Rounding points as the CUDA-core kernels and the host op: scores scaled in fp32, a first pass
// of online softmax in fp32 for lse, then P = exp(s - lse) rounded to D before P V, O in fp32
// rounded once, lse fp32; backward P = exp(s - lse) from q, k, dS = D(D(P) (dP - delta)), dq,
// dk, dv accumulated in fp32 and rounded once.
// Deterministic: no atomics; dk, dv per key tile over the query tiles in order, dq per query
// tile over the key tiles in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "models/cuda/gpt_attention_tc.cuh"
#include "models/cuda/gpt_attention_tiles.h"
#include "models/cuda/gpt_cuda_common.cuh"

namespace strata::models::cuda::internal {
namespace {

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

struct TcDims {
  int T, C, H;
  float scale;
  // First element of head h of sequence b in qkv (3C per row) and in out / dout (C per row).
  __device__ int64_t Qkv(int b, int h, int hs) const {
    return int64_t{b} * T * 3 * C + int64_t{h} * hs;
  }
  __device__ int64_t Out(int b, int h, int hs) const {
    return int64_t{b} * T * C + int64_t{h} * hs;
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

template <typename D, int kHs>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardTcKernel(const D* qkv, TcDims a, D* out, float* lse) {
  constexpr int kStride = at::SmemStride(kHs);
  constexpr int kQ = at::kQueryTile, kK = at::kKeyTile;
  extern __shared__ uint4 smem[];
  D* qs = reinterpret_cast<D*>(smem);
  D* ks = qs + kQ * kStride;
  D* vs = ks + kK * kStride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, c = lane % 4;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int q0 = qt * kQ;
  const int64_t ld = int64_t{3} * a.C;
  const D* q_src = qkv + a.Qkv(b, h, kHs);
  LoadTile<D, kHs, kQ>(qs, q_src, ld, q0, a.T);
  CpAsyncCommit();

  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float o[kHs / 8][4];
  Zero<kHs>(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int last = at::LastKeyTile(qt, kQ, kK, a.T);
  // The scaled scores of key tile k0 (in ks) for the warp's rows, -inf where masked.
  const auto scores = [&](int k0, float(&s)[kK / 8][4]) {
    Zero<kK>(s);
    MmaABt<D, kK, kHs>(s, qs + warp * 16 * kStride, ks, kStride);
    const bool masked = at::TileNeedsMask(q0, kQ, k0, kK, a.T);
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + j * 8 + 2 * c + (e & 1);
        float x = s[j][e] * a.scale;
        if (masked && (key > row[e / 2] || key >= a.T)) x = -INFINITY;
        s[j][e] = x;
      }
    }
  };
  // Pass 1: each row's max and sum (online softmax, fp32), hence its log-sum-exp.
  for (int kt = 0; kt <= last; ++kt) {
    const int k0 = kt * kK;
    __syncthreads();  // the previous k tile is consumed
    LoadTile<D, kHs, kK>(ks, q_src + a.C, ld, k0, a.T);
    CpAsyncCommit();
    CpAsyncWait<0>();  // q and k have landed
    __syncthreads();
    float s[kK / 8][4];
    scores(k0, s);
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
    }
    float m_new[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      m_new[r] = fmaxf(m[r], mx[r]);  // finite: key 0 is valid for every row
    }
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[e / 2] += expf(s[j][e] - m_new[e / 2]);  // 0 where masked
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      l[r] = l[r] * expf(m[r] - m_new[r]) + sum[r];  // the factor is 0 on the first tile
      m[r] = m_new[r];
    }
  }
  const float row_lse[2] = {m[0] + logf(l[0]), m[1] + logf(l[1])};
  // Pass 2: o = sum_j D(exp(s_j - lse)) v_j, the probabilities normalized before they are
  // rounded to D (the host's rounding point, models/ops/attention.cc), the sum in fp32.
  for (int kt = 0; kt <= last; ++kt) {
    const int k0 = kt * kK;
    __syncthreads();  // the previous k and v tiles are consumed
    LoadTile<D, kHs, kK>(ks, q_src + a.C, ld, k0, a.T);
    CpAsyncCommit();
    LoadTile<D, kHs, kK>(vs, q_src + 2 * a.C, ld, k0, a.T);
    CpAsyncCommit();
    CpAsyncWait<1>();  // k has landed; v may still be in flight
    __syncthreads();
    float s[kK / 8][4];
    scores(k0, s);
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = expf(s[j][e] - row_lse[e / 2]);  // 0 where masked
    }
    uint32_t p[kK / 16][4];
    ToFragments<D, kK>(s, p);  // P rounded to D
    CpAsyncWait<0>();
    __syncthreads();  // v has landed for every thread
    MmaAB<D, kHs, kK>(o, p, vs, kStride);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= a.T) continue;
    StoreRow<D, kHs>(out + a.Out(b, h, kHs) + int64_t{row[r]} * a.C, o, r, 1.0f);
    if (c == 0) lse[a.Stat(b, h) + row[r]] = row_lse[r];
  }
}

// ---------------------------------------------------------------------------
// dq: one block per (query tile, b h), over the key tiles 0..last:
// s = q k^T, p = exp(scale s - lse), dp = dout v^T, ds = D(p (dp - delta)), dq += ds k.

template <typename D, int kHs>
__global__ void __launch_bounds__(kThreads)
    AttentionDqTcKernel(const D* qkv, const D* dout, const float* lse, const float* delta, TcDims a,
                        D* dqkv) {
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
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int q0 = qt * kQ;
  const int64_t ld = int64_t{3} * a.C;
  const D* q_src = qkv + a.Qkv(b, h, kHs);
  LoadTile<D, kHs, kQ>(qs, q_src, ld, q0, a.T);
  LoadTile<D, kHs, kQ>(dos, dout + a.Out(b, h, kHs), a.C, q0, a.T);
  CpAsyncCommit();
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_lse[r] = row[r] < a.T ? lse[a.Stat(b, h) + row[r]] : 0.0f;
    row_delta[r] = row[r] < a.T ? delta[a.Stat(b, h) + row[r]] : 0.0f;
  }
  float dq[kHs / 8][4];
  Zero<kHs>(dq);
  const int last = at::LastKeyTile(qt, kQ, kK, a.T);
  for (int kt = 0; kt <= last; ++kt) {
    const int k0 = kt * kK;
    __syncthreads();
    LoadTile<D, kHs, kK>(ks, q_src + a.C, ld, k0, a.T);
    LoadTile<D, kHs, kK>(vs, q_src + 2 * a.C, ld, k0, a.T);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    float s[kK / 8][4], dp[kK / 8][4];
    Zero<kK>(s);
    Zero<kK>(dp);
    MmaABt<D, kK, kHs>(s, qs + warp * 16 * kStride, ks, kStride);
    MmaABt<D, kK, kHs>(dp, dos + warp * 16 * kStride, vs, kStride);
    const bool masked = at::TileNeedsMask(q0, kQ, k0, kK, a.T);
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + j * 8 + 2 * c + (e & 1), r = e / 2;
        const bool valid = !masked || (key <= row[r] && key < a.T && row[r] < a.T);
        const float p = valid ? expf(s[j][e] * a.scale - row_lse[r]) : 0.0f;
        s[j][e] = RoundTo<D>(p) * (dp[j][e] - row_delta[r]);  // P rounded, as the host
      }
    }
    uint32_t ds[kK / 16][4];
    ToFragments<D, kK>(s, ds);  // dS rounded to D
    MmaAB<D, kHs, kK>(dq, ds, ks, kStride);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= a.T) continue;
    StoreRow<D, kHs>(dqkv + a.Qkv(b, h, kHs) + int64_t{row[r]} * 3 * a.C, dq, r, a.scale);
  }
}

// ---------------------------------------------------------------------------
// dk, dv: one block per (key tile, b h), over the query tiles that see it; warp w owns keys
// k0 + 16 w + (g, g + 8). Transposed tiles: s^T = k q^T, p^T = exp(scale s^T - lse),
// dp^T = v dout^T, ds^T = D(p^T (dp^T - delta)); dv += D(p^T) dout, dk += ds^T q.

template <typename D, int kHs>
__global__ void __launch_bounds__(kThreads)
    AttentionDkDvTcKernel(const D* qkv, const D* dout, const float* lse, const float* delta,
                          TcDims a, D* dqkv) {
  constexpr int kStride = at::SmemStride(kHs);
  constexpr int kK = at::kDkDvKeyTile, kQ = at::DkDvQueryTile(kHs);
  extern __shared__ uint4 smem[];
  D* ks = reinterpret_cast<D*>(smem);
  D* vs = ks + kK * kStride;
  D* qs = vs + kK * kStride;
  D* dos = qs + kQ * kStride;
  float* lse_s = reinterpret_cast<float*>(dos + kQ * kStride);
  float* delta_s = lse_s + kQ;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, c = lane % 4;
  const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int kt = blockIdx.x, k0 = kt * kK;
  const int64_t ld = int64_t{3} * a.C;
  const D* q_src = qkv + a.Qkv(b, h, kHs);
  const D* do_src = dout + a.Out(b, h, kHs);
  const float* lse_src = lse + a.Stat(b, h);
  const float* delta_src = delta + a.Stat(b, h);
  LoadTile<D, kHs, kK>(ks, q_src + a.C, ld, k0, a.T);
  LoadTile<D, kHs, kK>(vs, q_src + 2 * a.C, ld, k0, a.T);
  CpAsyncCommit();
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  float dk[kHs / 8][4], dv[kHs / 8][4];
  Zero<kHs>(dk);
  Zero<kHs>(dv);
  const int num_q = at::NumTiles(a.T, kQ);
  for (int qt = at::FirstQueryTile(kt, kK, kQ); qt < num_q; ++qt) {
    const int c0 = qt * kQ;
    __syncthreads();  // the previous q, dout, lse and delta tiles are consumed
    LoadTile<D, kHs, kQ>(qs, q_src, ld, c0, a.T);
    LoadTile<D, kHs, kQ>(dos, do_src, a.C, c0, a.T);
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
    const bool masked = at::TileNeedsMask(c0, kQ, k0, kK, a.T);
#pragma unroll
    for (int j = 0; j < kQ / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = j * 8 + 2 * c + (e & 1), query = c0 + qi, r = e / 2;
        const bool valid = !masked || (key[r] <= query && query < a.T && key[r] < a.T);
        const float p = valid ? expf(st[j][e] * a.scale - lse_s[qi]) : 0.0f;
        st[j][e] = p;
        dpt[j][e] = RoundTo<D>(p) * (dpt[j][e] - delta_s[qi]);  // P rounded, as the host
      }
    }
    uint32_t pf[kQ / 16][4];
    ToFragments<D, kQ>(st, pf);  // P^T rounded to D
    MmaAB<D, kHs, kQ>(dv, pf, dos, kStride);
    ToFragments<D, kQ>(dpt, pf);  // dS^T rounded to D
    MmaAB<D, kHs, kQ>(dk, pf, qs, kStride);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= a.T) continue;
    D* dst = dqkv + a.Qkv(b, h, kHs) + int64_t{key[r]} * 3 * a.C;
    StoreRow<D, kHs>(dst + a.C, dk, r, a.scale);
    StoreRow<D, kHs>(dst + 2 * a.C, dv, r, 1.0f);
  }
}

// Raises the kernel's dynamic shared-memory limit (needed past 48 KB), then launches.
template <typename Kernel, typename... Args>
Status LaunchWithSmem(const char* name, Kernel kernel, dim3 grid, size_t smem_bytes,
                      cudaStream_t stream, Args... args) {
  STRATA_RETURN_IF_ERROR(gpu::cuda::CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes)),
      name));
  kernel<<<grid, kThreads, smem_bytes, stream>>>(args...);
  return Launched(name);
}

TcDims TcDimsOf(int T, int C, int H) { return {T, C, H, 1.0f / sqrtf(static_cast<float>(C / H))}; }

}  // namespace

template <typename D>
Status LaunchAttentionForwardTc(cudaStream_t stream, const D* qkv, int B, int T, int C, int H,
                                D* out, float* lse) {
  const TcDims a = TcDimsOf(T, C, H);
  const dim3 grid(at::NumTiles(T, at::kQueryTile), B * H);
  if (C / H == 64) {
    return LaunchWithSmem("AttentionForwardTcKernel<64>", AttentionForwardTcKernel<D, 64>, grid,
                          at::ForwardSmemBytes(64, sizeof(D)), stream, qkv, a, out, lse);
  }
  return LaunchWithSmem("AttentionForwardTcKernel<128>", AttentionForwardTcKernel<D, 128>, grid,
                        at::ForwardSmemBytes(128, sizeof(D)), stream, qkv, a, out, lse);
}

template <typename D>
Status LaunchAttentionBackwardTc(cudaStream_t stream, const D* qkv, const D* dout, const float* lse,
                                 const float* delta, int B, int T, int C, int H, D* dqkv) {
  const TcDims a = TcDimsOf(T, C, H);
  const int hs = C / H;
  const dim3 q_grid(at::NumTiles(T, at::kQueryTile), B * H);
  const dim3 kv_grid(at::NumTiles(T, at::kDkDvKeyTile), B * H);
  if (hs == 64) {
    STRATA_RETURN_IF_ERROR(LaunchWithSmem("AttentionDqTcKernel<64>", AttentionDqTcKernel<D, 64>,
                                          q_grid, at::DqSmemBytes(64, sizeof(D)), stream, qkv, dout,
                                          lse, delta, a, dqkv));
    return LaunchWithSmem("AttentionDkDvTcKernel<64>", AttentionDkDvTcKernel<D, 64>, kv_grid,
                          at::DkDvSmemBytes(64, sizeof(D)), stream, qkv, dout, lse, delta, a, dqkv);
  }
  STRATA_RETURN_IF_ERROR(LaunchWithSmem("AttentionDqTcKernel<128>", AttentionDqTcKernel<D, 128>,
                                        q_grid, at::DqSmemBytes(128, sizeof(D)), stream, qkv, dout,
                                        lse, delta, a, dqkv));
  return LaunchWithSmem("AttentionDkDvTcKernel<128>", AttentionDkDvTcKernel<D, 128>, kv_grid,
                        at::DkDvSmemBytes(128, sizeof(D)), stream, qkv, dout, lse, delta, a, dqkv);
}

#define STRATA_INSTANTIATE_ATTENTION_TC(D)                                                     \
  template Status LaunchAttentionForwardTc<D>(cudaStream_t, const D*, int, int, int, int, D*,  \
                                              float*);                                         \
  template Status LaunchAttentionBackwardTc<D>(cudaStream_t, const D*, const D*, const float*, \
                                               const float*, int, int, int, int, D*);
STRATA_INSTANTIATE_ATTENTION_TC(__half)
STRATA_INSTANTIATE_ATTENTION_TC(__nv_bfloat16)
#undef STRATA_INSTANTIATE_ATTENTION_TC

}  // namespace strata::models::cuda::internal
