// One task per (sequence, head) in the forward and per (sequence, kv head) in the backward; a
// task copies q, k, v of its heads into compute-type tiles and works on blocks of kAttnRowBlock
// query rows, each block's scores against all keys up to its last row at once; the forward's
// probabilities are then rounded where the online softmax of the CUDA kernels rounds them
// (key tiles of kAttentionKeyTile, attention.h), and the backward's are the normalised ones.
#include "models/ops/attention.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "gpu/host/host_gemm.h"
#include "models/ops/parallel.h"

namespace strata::models::ops {
namespace {

using gpu::host::Gemm;

// Attention works on blocks of this many query rows.
constexpr int64_t kAttnRowBlock = 64;

void CheckDims(const AttentionDims& d) {
  STRATA_CHECK_MSG(
      d.batch_size >= 1 && d.seq_len >= 1 && d.num_heads >= 1 && d.num_kv_heads >= 1 &&
          d.head_dim >= 1 && d.num_heads % d.num_kv_heads == 0 &&
          d.row_stride >= int64_t{d.num_heads} * d.head_dim && d.window >= 0 &&
          std::isfinite(d.scale) && d.scale >= 0 && std::isfinite(d.softcap) && d.softcap >= 0,
      "attention dims B=" + std::to_string(d.batch_size) + " T=" + std::to_string(d.seq_len) +
          " H=" + std::to_string(d.num_heads) + " Hkv=" + std::to_string(d.num_kv_heads) +
          " hs=" + std::to_string(d.head_dim) + " row_stride=" + std::to_string(d.row_stride) +
          " window=" + std::to_string(d.window) + " scale=" + std::to_string(d.scale) +
          " softcap=" + std::to_string(d.softcap));
}

// AttentionDims::scale in F: 1 / sqrt(head_dim) computed in F where it is 0 (the default, as
// before the field existed), else the given scale rounded once to F.
template <typename F>
F AttnScale(const AttentionDims& d) {
  return d.scale == 0 ? F(1) / std::sqrt(F(d.head_dim)) : static_cast<F>(d.scale);
}

// f(i) for i in [0, n), one task each.
template <typename Fn>
void ForEachTask(int64_t n, Fn&& f) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i != r.end(); ++i) {
                        // Isolated: while this task waits inside a Gemm, its thread runs only
                        // that Gemm's tiles, never another head (which would find the work
                        // buffers leased and allocate its own).
                        tbb::this_task_arena::isolate([&] { f(i); });
                      }
                    });
}

// dst (T, hs) = ToFloat of T rows of hs elements at src, rows ld apart.
template <typename S>
void LoadHead(const S* src, int64_t ld, int64_t T, int64_t hs, ComputeType<S>* dst) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < hs; ++j) dst[t * hs + j] = ToFloat(src[t * ld + j]);
  }
}

template <typename S>
void StoreHead(const ComputeType<S>* src, int64_t T, int64_t hs, S* dst, int64_t ld) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < hs; ++j) dst[t * ld + j] = FromFloat<S>(src[t * hs + j]);
  }
}

// Scores of query rows t0..t0+nq against keys 0..nk (nk = t0 + nq), as a (nq, nk) tile:
// scale * q k^T, soft-capped (c tanh(s / c)) with a softcap c. Forward and backward make this
// same call, so the backward's scores are the forward's bit for bit.
template <typename F>
void Scores(const AttentionDims& d, const F* qf, const F* kf, int64_t t0, int64_t nq, F* sc) {
  const int64_t nk = t0 + nq, hs = d.head_dim;
  Gemm<F>(false, true, nq, nk, hs, AttnScale<F>(d), qf + t0 * hs, hs, kf, hs, F(0), sc, nk);
  if (d.softcap > 0) {
    const F c = static_cast<F>(d.softcap);
    for (int64_t i = 0; i < nq * nk; ++i) sc[i] = c * std::tanh(sc[i] / c);
  }
}

// The first key query t of sequence b attends to: t - position_ids[b, t] for packed sequences,
// else 0; with a window w, at least t - w + 1. Every key before it gets probability 0 exactly,
// so the keys outside the bounds add nothing to any result.
int64_t FirstKey(const AttentionDims& d, int64_t b, int64_t t) {
  int64_t lo = 0;
  if (d.position_ids != nullptr) {
    const int32_t p = d.position_ids[b * d.seq_len + t];
    STRATA_CHECK_MSG(p >= 0 && p <= t, "attention: position id " + std::to_string(p) +
                                           " at token " + std::to_string(t) + " of sequence " +
                                           std::to_string(b));
    lo = t - p;
  }
  if (d.window > 0) lo = std::max(lo, t - d.window + 1);
  return lo;
}

// Replaces the scores of query row t (sc, nk wide) by P = S(exp(score - lse)) for keys lo..t
// (as ComputeType values) and zero for the masked keys: the backward's probabilities, and the
// forward's where S is its own compute type (nothing rounded).
template <typename S>
void ProbabilitiesInPlace(ComputeType<S>* row, int64_t lo, int64_t t, int64_t nk,
                          ComputeType<S> lse) {
  using F = ComputeType<S>;
  const int64_t n = t + 1;
  std::fill(row, row + lo, F(0));
  for (int64_t i = lo; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<F> p = (LoadVec(row + i, len) - lse).exp();
    for (int64_t j = 0; j < len; ++j) row[i + j] = ToFloat(FromFloat<S>(p[j]));
  }
  std::fill(row + n, row + nk, F(0));
}

// The forward's weights of the values for query row t (sc, nk wide, scores of keys lo..t in;
// lse the row's log-sum-exp): FlashAttention-2's online softmax at its rounding points
// (attention.h). Keys in tiles of kAttentionKeyTile; tile i's probabilities S(exp(s - m_i)), m_i
// the running max through tile i, then times exp(m_i - lse) = exp(m_i - m) / l in
// ComputeType<S>, so that P V is the sum of the tiles' products rescaled to the row's final
// max m and divided by its sum l, as the one-pass kernel forms it (up to fp32 rounding). Masked
// keys zero. S = float or double: S(exp(s - lse)), nothing to round.
template <typename S>
void ForwardWeightsInPlace(ComputeType<S>* row, int64_t lo, int64_t t, int64_t nk,
                           ComputeType<S> lse) {
  using F = ComputeType<S>;
  if constexpr (std::is_same_v<S, F>) {
    ProbabilitiesInPlace<S>(row, lo, t, nk, lse);
  } else {
    constexpr int64_t kTile = kAttentionKeyTile;
    const int64_t n = t + 1;
    std::fill(row, row + lo, F(0));
    F m = -std::numeric_limits<F>::infinity();
    for (int64_t k0 = lo / kTile * kTile; k0 < n; k0 += kTile) {
      const int64_t begin = std::max(lo, k0), end = std::min(n, k0 + kTile);
      m = std::max(m, MaxOf(row + begin, end - begin));  // finite: key `begin` is seen
      const F to_final = std::exp(m - lse);
      for (int64_t i = begin; i < end; i += kVec) {
        const int64_t len = std::min<int64_t>(kVec, end - i);
        const Vec<F> p = (LoadVec(row + i, len) - m).exp();
        for (int64_t j = 0; j < len; ++j) row[i + j] = ToFloat(FromFloat<S>(p[j])) * to_final;
      }
    }
    std::fill(row + n, row + nk, F(0));
  }
}

}  // namespace

template <typename S>
void AttentionForward(const AttentionDims& d, const S* q, const S* k, const S* v, S* out,
                      ComputeType<S>* lse) {
  using F = ComputeType<S>;
  CheckDims(d);
  const int64_t T = d.seq_len, H = d.num_heads, hs = d.head_dim, ld = d.row_stride;
  const int64_t group = H / d.num_kv_heads, ld_out = H * hs;
  const int64_t rb = std::min(T, kAttnRowBlock);
  ForEachTask(int64_t{d.batch_size} * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H, kvh = h / group;
    WorkLease<F> work;
    F* qf = work.Get(0, T * hs);
    F* kf = work.Get(1, T * hs);
    F* vf = work.Get(2, T * hs);
    F* sc = work.Get(3, rb * T);
    F* of = work.Get(4, rb * hs);
    LoadHead(q + b * T * ld + h * hs, ld, T, hs, qf);
    LoadHead(k + b * T * ld + kvh * hs, ld, T, hs, kf);
    LoadHead(v + b * T * ld + kvh * hs, ld, T, hs, vf);
    F* lse_bh = lse + bh * T;
    for (int64_t t0 = 0; t0 < T; t0 += rb) {
      const int64_t nq = std::min(rb, T - t0), nk = t0 + nq;
      Scores(d, qf, kf, t0, nq, sc);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i, lo = FirstKey(d, b, t);
        F* row = sc + i * nk;
        const F m = MaxOf(row + lo, t + 1 - lo);
        lse_bh[t] = m + std::log(SumExpShifted(row + lo, t + 1 - lo, m));
        ForwardWeightsInPlace<S>(row, lo, t, nk, lse_bh[t]);
      }
      Gemm<F>(false, false, nq, hs, nk, F(1), sc, nk, vf, hs, F(0), of, hs);
      StoreHead<S>(of, nq, hs, out + (b * T + t0) * ld_out + h * hs, ld_out);
    }
  });
}

template <typename S>
void AttentionBackward(const AttentionDims& d, const S* q, const S* k, const S* v, const S* out,
                       const S* dout, const ComputeType<S>* lse, S* dq, S* dk, S* dv) {
  using F = ComputeType<S>;
  CheckDims(d);
  const int64_t T = d.seq_len, H = d.num_heads, Hkv = d.num_kv_heads, hs = d.head_dim;
  const int64_t ld = d.row_stride, group = H / Hkv, ld_out = H * hs;
  const int64_t rb = std::min(T, kAttnRowBlock);
  const F scale = AttnScale<F>(d);
  ForEachTask(int64_t{d.batch_size} * Hkv, [&](int64_t bkv) {
    const int64_t b = bkv / Hkv, kvh = bkv % Hkv;
    WorkLease<F> work;
    F* qf = work.Get(0, T * hs);
    F* kf = work.Get(1, T * hs);
    F* vf = work.Get(2, T * hs);
    F* dof = work.Get(3, T * hs);
    F* dkf = work.Get(4, T * hs);
    F* dvf = work.Get(5, T * hs);
    F* p = work.Get(6, rb * T);
    F* ds = work.Get(7, rb * T);
    F* dqf = work.Get(8, rb * hs);
    F* dsum = work.Get(9, T);
    // Soft-capping: 1 - tanh^2 of each score, the capped score's derivative.
    F* dcap = d.softcap > 0 ? work.Get(10, rb * T) : nullptr;
    LoadHead(k + b * T * ld + kvh * hs, ld, T, hs, kf);
    LoadHead(v + b * T * ld + kvh * hs, ld, T, hs, vf);
    std::fill(dkf, dkf + T * hs, F(0));
    std::fill(dvf, dvf + T * hs, F(0));
    // The query heads of this kv head's group, in head order: dk and dv add up over them.
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      LoadHead(q + b * T * ld + h * hs, ld, T, hs, qf);
      LoadHead(dout + b * T * ld_out + h * hs, ld_out, T, hs, dof);
      // D[t] = rowsum(dO * O).
      const S* o = out + b * T * ld_out + h * hs;
      for (int64_t t = 0; t < T; ++t) {
        F sum = 0;
        for (int64_t j = 0; j < hs; ++j) sum += dof[t * hs + j] * ToFloat(o[t * ld_out + j]);
        dsum[t] = sum;
      }
      const F* lse_bh = lse + (b * H + h) * T;
      S* dq_out = dq + b * T * ld + h * hs;
      for (int64_t t0 = 0; t0 < T; t0 += rb) {
        const int64_t nq = std::min(rb, T - t0), nk = t0 + nq;
        Scores(d, qf, kf, t0, nq, p);
        if (dcap != nullptr) {
          const F c = static_cast<F>(d.softcap);
          for (int64_t i = 0; i < nq * nk; ++i) {
            const F u = p[i] / c;
            dcap[i] = F(1) - u * u;
          }
        }
        for (int64_t i = 0; i < nq; ++i) {
          ProbabilitiesInPlace<S>(p + i * nk, FirstKey(d, b, t0 + i), t0 + i, nk, lse_bh[t0 + i]);
        }
        // dP = dO v^T; dS = S(P (dP - D)), zero where masked (P is zero there); soft-capped:
        // S(P (dP - D) (1 - tanh^2)).
        Gemm<F>(false, true, nq, nk, hs, F(1), dof + t0 * hs, hs, vf, hs, F(0), ds, nk);
        for (int64_t i = 0; i < nq; ++i) {
          const F dd = dsum[t0 + i];
          F* drow = ds + i * nk;
          const F* prow = p + i * nk;
          if (dcap == nullptr) {
            for (int64_t s = 0; s < nk; ++s) {
              drow[s] = ToFloat(FromFloat<S>(prow[s] * (drow[s] - dd)));
            }
          } else {
            const F* crow = dcap + i * nk;
            for (int64_t s = 0; s < nk; ++s) {
              drow[s] = ToFloat(FromFloat<S>(prow[s] * (drow[s] - dd) * crow[s]));
            }
          }
        }
        // dv += P^T dO;  dq = scale dS k;  dk += scale dS^T q.
        Gemm<F>(true, false, nk, hs, nq, F(1), p, nk, dof + t0 * hs, hs, F(1), dvf, hs);
        Gemm<F>(false, false, nq, hs, nk, scale, ds, nk, kf, hs, F(0), dqf, hs);
        Gemm<F>(true, false, nk, hs, nq, scale, ds, nk, qf + t0 * hs, hs, F(1), dkf, hs);
        StoreHead<S>(dqf, nq, hs, dq_out + t0 * ld, ld);
      }
    }
    StoreHead<S>(dkf, T, hs, dk + b * T * ld + kvh * hs, ld);
    StoreHead<S>(dvf, T, hs, dv + b * T * ld + kvh * hs, ld);
  });
}

#define STRATA_INSTANTIATE_ATTENTION(S)                                                            \
  template void AttentionForward<S>(const AttentionDims&, const S*, const S*, const S*, S*,        \
                                    ComputeType<S>*);                                              \
  template void AttentionBackward<S>(const AttentionDims&, const S*, const S*, const S*, const S*, \
                                     const S*, const ComputeType<S>*, S*, S*, S*);

STRATA_INSTANTIATE_ATTENTION(float)
STRATA_INSTANTIATE_ATTENTION(double)
STRATA_INSTANTIATE_ATTENTION(Bf16)
STRATA_INSTANTIATE_ATTENTION(Fp16)

#undef STRATA_INSTANTIATE_ATTENTION

}  // namespace strata::models::ops
