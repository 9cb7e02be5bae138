#include "models/gpt_kernels.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>

#include "gpu/host/host_gemm.h"
#include "models/gpt_layout.h"

namespace strata::models {
namespace {

using gpu::host::Gemm;

constexpr double kLayerNormEps = 1e-5;
// The layer processes groups of whole sequences with at least this many rows.
constexpr int64_t kMinGroupRows = 256;
// Attention works on blocks of this many query (or key) rows.
constexpr int64_t kAttnRowBlock = 64;
// Column reductions (bias and LayerNorm parameter gradients) run one task per
// block of this many columns, each summing all rows in order.
constexpr int64_t kColBlock = 64;
// Row-parallel loops aim at this many elements per task.
constexpr int64_t kGrainElems = 1 << 14;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t GroupSeqs(int B, int T) {
  return std::min<int64_t>(B, std::max<int64_t>(1, CeilDiv(kMinGroupRows, T)));
}
int64_t AttnRowBlock(int T) { return std::min<int64_t>(T, kAttnRowBlock); }

void CheckBatch(const GptShape& s, int B, int T) {
  STRATA_CHECK_MSG(B >= 1 && T >= 1 && T <= s.max_seq_len,
                   "B=" + std::to_string(B) + " T=" + std::to_string(T) +
                       " max_seq_len=" + std::to_string(s.max_seq_len));
}

void CheckToken(int32_t token, int vocab_size) {
  STRATA_CHECK_MSG(
      token >= 0 && token < vocab_size,
      "token " + std::to_string(token) + " outside [0, " + std::to_string(vocab_size) + ")");
}

// ---------------------------------------------------------------------------
// Parameter layout: the one table every offset comes from.

struct TensorSpec {
  const char* name;
  std::vector<int64_t> shape;
};

std::vector<TensorInfo> Lay(const std::vector<TensorSpec>& specs) {
  std::vector<TensorInfo> out;
  int64_t offset = 0;
  for (const TensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    out.push_back(TensorInfo{s.name, offset, s.shape, n});
    offset += n;
  }
  return out;
}

int64_t Total(const std::vector<TensorInfo>& tensors) {
  return tensors.empty() ? 0 : tensors.back().offset + tensors.back().num_elems;
}

// ---------------------------------------------------------------------------
// Deterministic parallel loops.

// f(begin, end) over row ranges; rows are independent, so any split gives the
// same result.
template <typename F>
void ParallelRows(int64_t rows, int64_t elems_per_row, F&& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, elems_per_row));
  if (rows <= grain) {
    f(int64_t{0}, rows);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); });
}

// f(c0, c1) over fixed column blocks of kColBlock; used for sums over rows, each
// block summing its rows in order.
template <typename F>
void ParallelColumnBlocks(int64_t cols, F&& f) {
  const int64_t blocks = CeilDiv(cols, kColBlock);
  auto run = [&](int64_t i) { f(i * kColBlock, std::min(cols, (i + 1) * kColBlock)); };
  if (blocks == 1) {
    run(0);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i != r.end(); ++i) run(i);
                    });
}

// ---------------------------------------------------------------------------
// Elementwise transcendental functions. Every element goes through Eigen's
// code path for a fixed-size, aligned array of kVec elements (padded at the
// tail), so the result for an element never depends on its address or on where
// a range was split (Eigen's vectorized exp/tanh differ from the scalar ones in
// the last bits).

constexpr int kVec = 16;
template <typename Real>
using Vec = Eigen::Array<Real, kVec, 1>;

template <typename Real>
Vec<Real> Load(const Real* x, int64_t len) {
  Vec<Real> v;
  std::copy(x, x + len, v.data());
  std::fill(v.data() + len, v.data() + kVec, Real(0));
  return v;
}

template <typename Real>
void Store(const Vec<Real>& v, int64_t len, Real* y) {
  std::copy(v.data(), v.data() + len, y);
}

template <typename Real>
constexpr Real kGeluScale = Real(0.7978845608028654);  // sqrt(2 / pi)
template <typename Real>
constexpr Real kGeluCubic = Real(0.044715);

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); y may equal x.
template <typename Real>
void GeluForward(const Real* x, int64_t n, Real* y) {
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<Real> v = Load(x + i, len);
    const Vec<Real> u = kGeluScale<Real> * (v + kGeluCubic<Real> * v * v * v);
    const Vec<Real> th = u.tanh();
    const Vec<Real> out = Real(0.5) * v * (Real(1) + th);
    Store(out, len, y + i);
  }
}

// dx = dy * gelu'(x); dx may equal dy.
template <typename Real>
void GeluBackward(const Real* x, const Real* dy, int64_t n, Real* dx) {
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<Real> v = Load(x + i, len);
    const Vec<Real> g = Load(dy + i, len);
    const Vec<Real> v2 = v * v;
    const Vec<Real> u = kGeluScale<Real> * (v + kGeluCubic<Real> * v2 * v);
    const Vec<Real> th = u.tanh();
    const Vec<Real> du = kGeluScale<Real> * (Real(1) + Real(3) * kGeluCubic<Real> * v2);
    const Vec<Real> d = Real(0.5) * (Real(1) + th) + Real(0.5) * v * (Real(1) - th * th) * du;
    Store(Vec<Real>(g * d), len, dx + i);
  }
}

// x[i] = exp(x[i] - shift); returns the sum, added in index order.
template <typename Real>
Real ExpShiftedInPlace(Real* x, int64_t n, Real shift) {
  Real sum = 0;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<Real> e = (Load(x + i, len) - shift).exp();
    Store(e, len, x + i);
    for (int64_t j = 0; j < len; ++j) sum += e[j];
  }
  return sum;
}

template <typename Real>
Real MaxOf(const Real* x, int64_t n) {
  Real m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// ---------------------------------------------------------------------------
// Row-wise helpers.

// out[r, :] = (x ? x[r, :] : 0) + bias.  out may equal x.
template <typename Real>
void RowsPlusBias(const Real* x, const Real* bias, int64_t rows, int64_t cols, Real* out) {
  ParallelRows(rows, cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      Real* o = out + r * cols;
      if (x != nullptr) {
        const Real* xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] = xr[c] + bias[c];
      } else {
        std::copy(bias, bias + cols, o);
      }
    }
  });
}

// out (+)= sum over rows of x (rows, cols); fixed order per column.
template <typename Real>
void ColumnSums(const Real* x, int64_t rows, int64_t cols, Real* out, bool accumulate) {
  ParallelColumnBlocks(cols, [&](int64_t c0, int64_t c1) {
    Real acc[kColBlock] = {};
    const int64_t w = c1 - c0;
    for (int64_t r = 0; r < rows; ++r) {
      const Real* xr = x + r * cols + c0;
      for (int64_t j = 0; j < w; ++j) acc[j] += xr[j];
    }
    for (int64_t j = 0; j < w; ++j) out[c0 + j] = accumulate ? out[c0 + j] + acc[j] : acc[j];
  });
}

// LayerNorm (Ba et al. 2016) over the last dimension C of x (rows, C):
// y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), biased variance.
template <typename Real>
inline void LayerNormApplyRow(const Real* x, const Real* w, const Real* b, Real mean, Real rstd,
                              int64_t C, Real* y) {
  for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - mean) * rstd * w[c] + b[c];
}

template <typename Real>
void LayerNormForward(const Real* x, const Real* w, const Real* b, int64_t rows, int64_t C, Real* y,
                      Real* mean, Real* rstd) {
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* xr = x + r * C;
      Real sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += xr[c];
      const Real m = sum / Real(C);
      Real var = 0;
      for (int64_t c = 0; c < C; ++c) var += (xr[c] - m) * (xr[c] - m);
      var /= Real(C);
      const Real s = Real(1) / std::sqrt(var + Real(kLayerNormEps));
      mean[r] = m;
      rstd[r] = s;
      LayerNormApplyRow(xr, w, b, m, s, C, y + r * C);
    }
  });
}

// Recomputes y from x and saved statistics (bit-identical to the forward).
template <typename Real>
void LayerNormRecompute(const Real* x, const Real* w, const Real* b, const Real* mean,
                        const Real* rstd, int64_t rows, int64_t C, Real* y) {
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      LayerNormApplyRow(x + r * C, w, b, mean[r], rstd[r], C, y + r * C);
    }
  });
}

// dw (+)= sum_r dy * xhat, db (+)= sum_r dy, xhat = (x - mean) * rstd.
template <typename Real>
void LayerNormParamGrads(const Real* x, const Real* dy, const Real* mean, const Real* rstd,
                         int64_t rows, int64_t C, Real* dw, Real* db, bool accumulate) {
  ParallelColumnBlocks(C, [&](int64_t c0, int64_t c1) {
    Real acc_w[kColBlock] = {};
    Real acc_b[kColBlock] = {};
    const int64_t w = c1 - c0;
    for (int64_t r = 0; r < rows; ++r) {
      const Real* xr = x + r * C + c0;
      const Real* dr = dy + r * C + c0;
      const Real m = mean[r], s = rstd[r];
      for (int64_t j = 0; j < w; ++j) {
        acc_w[j] += dr[j] * ((xr[j] - m) * s);
        acc_b[j] += dr[j];
      }
    }
    for (int64_t j = 0; j < w; ++j) {
      dw[c0 + j] = accumulate ? dw[c0 + j] + acc_w[j] : acc_w[j];
      db[c0 + j] = accumulate ? db[c0 + j] + acc_b[j] : acc_b[j];
    }
  });
}

// dx = (residual ? residual : 0) + LayerNorm input gradient:
//   g = dy * w;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// Row-local and element-by-element read-before-write, so dx may equal x, dy or
// residual.
template <typename Real>
void LayerNormInputGrad(const Real* x, const Real* w, const Real* dy, const Real* mean,
                        const Real* rstd, const Real* residual, int64_t rows, int64_t C, Real* dx) {
  ParallelRows(rows, 2 * C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Real* xr = x + r * C;
      const Real* dr = dy + r * C;
      const Real m = mean[r], s = rstd[r];
      Real g_mean = 0, gx_mean = 0;
      for (int64_t c = 0; c < C; ++c) {
        const Real g = dr[c] * w[c];
        g_mean += g;
        gx_mean += g * ((xr[c] - m) * s);
      }
      g_mean /= Real(C);
      gx_mean /= Real(C);
      Real* out = dx + r * C;
      const Real* res = residual != nullptr ? residual + r * C : nullptr;
      for (int64_t c = 0; c < C; ++c) {
        const Real xhat = (xr[c] - m) * s;
        const Real v = s * (dr[c] * w[c] - g_mean - xhat * gx_mean);
        out[c] = res != nullptr ? res[c] + v : v;
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Causal multi-head self-attention (Vaswani et al. 2017) on a group of `seqs`
// sequences. qkv: (seqs, T, 3C); probs: (seqs, H, T, T), zero above the
// diagonal; y: (seqs, T, C). One task per (sequence, head); the T x T products
// run in blocks of rb query rows (or key columns) and skip the masked part.

struct AttnDims {
  int64_t seqs, T, C, H, hs, rb;
};

template <typename Real>
Real AttnScale(const AttnDims& d) {
  return Real(1) / std::sqrt(Real(d.hs));
}

template <typename F>
void ForEachHead(const AttnDims& d, F&& f) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, d.seqs * d.H, 1),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t bh = r.begin(); bh != r.end(); ++bh) f(bh / d.H, bh % d.H, bh);
                    });
}

// y[b, :, head h] = probs[b, h] v[b, h] for one (b, h).
template <typename Real>
void AttentionValuesOneHead(const AttnDims& d, const Real* qkv, const Real* probs, Real* y,
                            int64_t b, int64_t h, int64_t bh) {
  const int64_t T = d.T, C = d.C, ld3 = 3 * C;
  const Real* v = qkv + b * T * ld3 + 2 * C + h * d.hs;
  const Real* p = probs + bh * T * T;
  Real* yo = y + b * T * C + h * d.hs;
  for (int64_t t0 = 0; t0 < T; t0 += d.rb) {
    const int64_t t1 = std::min(T, t0 + d.rb);
    Gemm<Real>(false, false, t1 - t0, d.hs, t1, Real(1), p + t0 * T, T, v, ld3, Real(0),
               yo + t0 * C, C);
  }
}

template <typename Real>
void AttentionForward(const AttnDims& d, const Real* qkv, Real* probs, Real* y) {
  const int64_t T = d.T, C = d.C, ld3 = 3 * C;
  const Real scale = AttnScale<Real>(d);
  ForEachHead(d, [&](int64_t b, int64_t h, int64_t bh) {
    const Real* q = qkv + b * T * ld3 + h * d.hs;
    const Real* k = q + C;
    Real* p = probs + bh * T * T;
    for (int64_t t0 = 0; t0 < T; t0 += d.rb) {
      const int64_t t1 = std::min(T, t0 + d.rb);
      // Scores of query rows t0..t1 against keys 0..t1.
      Gemm<Real>(false, true, t1 - t0, t1, d.hs, scale, q + t0 * ld3, ld3, k, ld3, Real(0),
                 p + t0 * T, T);
      for (int64_t t = t0; t < t1; ++t) {
        Real* row = p + t * T;
        const Real sum = ExpShiftedInPlace(row, t + 1, MaxOf(row, t + 1));
        const Real inv = Real(1) / sum;
        for (int64_t s = 0; s <= t; ++s) row[s] *= inv;
        std::fill(row + t + 1, row + T, Real(0));
      }
    }
    AttentionValuesOneHead(d, qkv, probs, y, b, h, bh);
  });
}

// Recomputes y from saved probabilities.
template <typename Real>
void AttentionValues(const AttnDims& d, const Real* qkv, const Real* probs, Real* y) {
  ForEachHead(d, [&](int64_t b, int64_t h, int64_t bh) {
    AttentionValuesOneHead(d, qkv, probs, y, b, h, bh);
  });
}

// dqkv: (seqs, T, 3C) from dy: (seqs, T, C). probs is overwritten with the
// score gradients. temp: seqs * H * rb * T elements.
template <typename Real>
void AttentionBackward(const AttnDims& d, const Real* qkv, Real* probs, const Real* dy, Real* dqkv,
                       Real* temp) {
  const int64_t T = d.T, C = d.C, ld3 = 3 * C, hs = d.hs;
  const Real scale = AttnScale<Real>(d);
  ForEachHead(d, [&](int64_t b, int64_t h, int64_t bh) {
    const Real* q = qkv + b * T * ld3 + h * hs;
    const Real* k = q + C;
    const Real* v = q + 2 * C;
    Real* dq = dqkv + b * T * ld3 + h * hs;
    Real* dk = dq + C;
    Real* dv = dq + 2 * C;
    const Real* g = dy + b * T * C + h * hs;
    Real* p = probs + bh * T * T;
    Real* dp = temp + bh * d.rb * T;
    // dv[s] = sum_{t >= s} p[t, s] g[t], by blocks of keys s0..s1.
    for (int64_t s0 = 0; s0 < T; s0 += d.rb) {
      const int64_t s1 = std::min(T, s0 + d.rb);
      Gemm<Real>(true, false, s1 - s0, hs, T - s0, Real(1), p + s0 * T + s0, T, g + s0 * C, C,
                 Real(0), dv + s0 * ld3, ld3);
    }
    // Softmax backward by blocks of queries: dp = g v^T, then in place
    // p[t, s] <- p[t, s] * (dp[t, s] - sum_s' p[t, s'] dp[t, s']).
    for (int64_t t0 = 0; t0 < T; t0 += d.rb) {
      const int64_t t1 = std::min(T, t0 + d.rb);
      Gemm<Real>(false, true, t1 - t0, t1, hs, Real(1), g + t0 * C, C, v, ld3, Real(0), dp, t1);
      for (int64_t t = t0; t < t1; ++t) {
        Real* row = p + t * T;
        const Real* drow = dp + (t - t0) * t1;
        Real dot = 0;
        for (int64_t s = 0; s <= t; ++s) dot += row[s] * drow[s];
        for (int64_t s = 0; s <= t; ++s) row[s] *= drow[s] - dot;
      }
    }
    // dq = scale * ds k;  dk[s] = scale * sum_{t >= s} ds[t, s] q[t].
    for (int64_t t0 = 0; t0 < T; t0 += d.rb) {
      const int64_t t1 = std::min(T, t0 + d.rb);
      Gemm<Real>(false, false, t1 - t0, hs, t1, scale, p + t0 * T, T, k, ld3, Real(0),
                 dq + t0 * ld3, ld3);
    }
    for (int64_t s0 = 0; s0 < T; s0 += d.rb) {
      const int64_t s1 = std::min(T, s0 + d.rb);
      Gemm<Real>(true, false, s1 - s0, hs, T - s0, scale, p + s0 * T + s0, T, q + s0 * ld3, ld3,
                 Real(0), dk + s0 * ld3, ld3);
    }
  });
}

// ---------------------------------------------------------------------------
// Transformer layer on one group of whole sequences.

// Scratch carved for groups of up to G sequences (R = G*T rows); see the
// layout in the header.
template <typename Real>
struct LayerScratch {
  Real* mean1;  // (R)
  Real* rstd1;  // (R)
  Real* mean2;  // (R)
  Real* rstd2;  // (R)
  Real* qkv;    // (R, 3C)
  Real* probs;  // (G, H, T, T)
  Real* work;   // max(8 R C, 5 R C + G H rb T)
};

struct LayerScratchSizes {
  int64_t rows, qkv, probs, work;
  int64_t total() const { return 4 * rows + qkv + probs + work; }
};

LayerScratchSizes LayerScratchSizesFor(const GptShape& s, int B, int T) {
  const int64_t G = GroupSeqs(B, T), R = G * T, C = s.channels, H = s.num_heads;
  return {R, 3 * R * C, G * H * T * T,
          std::max(8 * R * C, 5 * R * C + G * H * AttnRowBlock(T) * T)};
}

template <typename Real>
LayerScratch<Real> CarveLayerScratch(const GptShape& s, int B, int T, Real* scratch) {
  const LayerScratchSizes z = LayerScratchSizesFor(s, B, T);
  LayerScratch<Real> sc;
  Real* p = scratch;
  sc.mean1 = p, p += z.rows;
  sc.rstd1 = p, p += z.rows;
  sc.mean2 = p, p += z.rows;
  sc.rstd2 = p, p += z.rows;
  sc.qkv = p, p += z.qkv;
  sc.probs = p, p += z.probs;
  sc.work = p;
  return sc;
}

template <typename Real>
void GeluForwardRows(const Real* x, int64_t rows, int64_t cols, Real* y) {
  ParallelRows(rows, cols, [&](int64_t r0, int64_t r1) {
    GeluForward(x + r0 * cols, (r1 - r0) * cols, y + r0 * cols);
  });
}

template <typename Real>
void GeluBackwardRows(const Real* x, const Real* dy, int64_t rows, int64_t cols, Real* dx) {
  ParallelRows(rows, cols, [&](int64_t r0, int64_t r1) {
    GeluBackward(x + r0 * cols, dy + r0 * cols, (r1 - r0) * cols, dx + r0 * cols);
  });
}

// Forward of one group: x (r, C) -> x2 = x + attention (written to x2). With
// mlp_output, x2 is then updated in place to the layer output; without, the
// forward stops after the GELU (all the backward needs). Work area afterwards:
// fc pre-activation at [0, 4rC), GELU output at [4rC, 8rC).
template <typename Real>
void LayerForwardGroup(const GptShape& s, const LayerParams<const Real*>& p, const Real* x,
                       Real* x2, int64_t seqs, int T, const LayerScratch<Real>& sc,
                       bool mlp_output) {
  const int64_t C = s.channels, r = seqs * T;
  const AttnDims dims{seqs, T, C, s.num_heads, C / s.num_heads, AttnRowBlock(T)};
  Real* ln1 = sc.work;               // (r, C), until the qkv product
  Real* atty = sc.work;              // (r, C), until the projection
  Real* fch = sc.work;               // (r, 4C)
  Real* ln2 = sc.work + 4 * r * C;   // (r, C), until the fc product
  Real* gelu = sc.work + 4 * r * C;  // (r, 4C)

  LayerNormForward(x, p.ln1_w, p.ln1_b, r, C, ln1, sc.mean1, sc.rstd1);
  RowsPlusBias<Real>(nullptr, p.qkv_b, r, 3 * C, sc.qkv);
  Gemm<Real>(false, false, r, 3 * C, C, Real(1), ln1, C, p.qkv_w, 3 * C, Real(1), sc.qkv, 3 * C);
  AttentionForward(dims, sc.qkv, sc.probs, atty);
  RowsPlusBias(x, p.attn_proj_b, r, C, x2);
  Gemm<Real>(false, false, r, C, C, Real(1), atty, C, p.attn_proj_w, C, Real(1), x2, C);

  LayerNormForward(x2, p.ln2_w, p.ln2_b, r, C, ln2, sc.mean2, sc.rstd2);
  RowsPlusBias<Real>(nullptr, p.fc_b, r, 4 * C, fch);
  Gemm<Real>(false, false, r, 4 * C, C, Real(1), ln2, C, p.fc_w, 4 * C, Real(1), fch, 4 * C);
  GeluForwardRows(fch, r, 4 * C, gelu);
  if (mlp_output) {
    RowsPlusBias(x2, p.mlp_proj_b, r, C, x2);
    Gemm<Real>(false, false, r, C, 4 * C, Real(1), gelu, 4 * C, p.mlp_proj_w, C, Real(1), x2, C);
  }
}

// Backward of one group. dx (r, C) receives dx_in; it first holds x2. With
// accumulate, parameter gradients are added to dp (later groups), else written.
template <typename Real>
void LayerBackwardGroup(const GptShape& s, const LayerParams<const Real*>& p,
                        const LayerParams<Real*>& dp, const Real* x, const Real* dout, Real* dx,
                        int64_t seqs, int T, const LayerScratch<Real>& sc, bool accumulate) {
  const int64_t C = s.channels, r = seqs * T, rC = r * C;
  const AttnDims dims{seqs, T, C, s.num_heads, C / s.num_heads, AttnRowBlock(T)};
  const Real beta = accumulate ? Real(1) : Real(0);
  Real* w = sc.work;

  LayerForwardGroup(s, p, x, dx, seqs, T, sc, /*mlp_output=*/false);
  const Real* x2 = dx;

  // MLP projection: out = x2 + gelu Wp + bp.
  Real* fch = w;            // [0, 4rC)
  Real* gelu = w + 4 * rC;  // [4rC, 8rC)
  Gemm<Real>(true, false, 4 * C, C, r, Real(1), gelu, 4 * C, dout, C, beta, dp.mlp_proj_w, C);
  ColumnSums(dout, r, C, dp.mlp_proj_b, accumulate);
  Real* dfch = w + 4 * rC;  // replaces gelu
  Gemm<Real>(false, true, r, 4 * C, C, Real(1), dout, C, p.mlp_proj_w, C, Real(0), dfch, 4 * C);
  GeluBackwardRows(fch, dfch, r, 4 * C, dfch);

  // MLP fc: fch = ln2 Wfc + bfc; ln2 recomputed over the dead fch.
  ColumnSums(dfch, r, 4 * C, dp.fc_b, accumulate);
  Real* ln2 = w;        // [0, rC)
  Real* dln2 = w + rC;  // [rC, 2rC)
  LayerNormRecompute(x2, p.ln2_w, p.ln2_b, sc.mean2, sc.rstd2, r, C, ln2);
  Gemm<Real>(true, false, C, 4 * C, r, Real(1), ln2, C, dfch, 4 * C, beta, dp.fc_w, 4 * C);
  Gemm<Real>(false, true, r, C, 4 * C, Real(1), dfch, 4 * C, p.fc_w, 4 * C, Real(0), dln2, C);

  // LayerNorm 2 and the MLP residual: dx <- dout + d(ln2)/d(x2), over x2.
  LayerNormParamGrads(x2, dln2, sc.mean2, sc.rstd2, r, C, dp.ln2_w, dp.ln2_b, accumulate);
  LayerNormInputGrad(x2, p.ln2_w, dln2, sc.mean2, sc.rstd2, dout, r, C, dx);

  // Attention projection: x2 = x + atty Wo + bo; atty recomputed.
  Real* atty = w;        // [0, rC)
  Real* datty = w + rC;  // [rC, 2rC)
  AttentionValues(dims, sc.qkv, sc.probs, atty);
  Gemm<Real>(true, false, C, C, r, Real(1), atty, C, dx, C, beta, dp.attn_proj_w, C);
  ColumnSums(dx, r, C, dp.attn_proj_b, accumulate);
  Gemm<Real>(false, true, r, C, C, Real(1), dx, C, p.attn_proj_w, C, Real(0), datty, C);

  // Attention core.
  Real* dqkv = w + 2 * rC;  // [2rC, 5rC)
  Real* temp = w + 5 * rC;  // seqs * H * rb * T
  AttentionBackward(dims, sc.qkv, sc.probs, datty, dqkv, temp);

  // qkv = ln1 Wqkv + bqkv; ln1 recomputed.
  ColumnSums(dqkv, r, 3 * C, dp.qkv_b, accumulate);
  Real* ln1 = w;        // [0, rC)
  Real* dln1 = w + rC;  // [rC, 2rC)
  LayerNormRecompute(x, p.ln1_w, p.ln1_b, sc.mean1, sc.rstd1, r, C, ln1);
  Gemm<Real>(true, false, C, 3 * C, r, Real(1), ln1, C, dqkv, 3 * C, beta, dp.qkv_w, 3 * C);
  Gemm<Real>(false, true, r, C, 3 * C, Real(1), dqkv, 3 * C, p.qkv_w, 3 * C, Real(0), dln1, C);

  // LayerNorm 1 and the attention residual: dx += d(ln1)/dx.
  LayerNormParamGrads(x, dln1, sc.mean1, sc.rstd1, r, C, dp.ln1_w, dp.ln1_b, accumulate);
  LayerNormInputGrad(x, p.ln1_w, dln1, sc.mean1, sc.rstd1, dx, r, C, dx);
}

// ---------------------------------------------------------------------------
// Initialisation.

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Block tags for the per-block random streams.
constexpr uint64_t kEmbeddingTag = 0;
constexpr uint64_t kHeadTag = ~uint64_t{0};
uint64_t LayerTag(int layer_index) { return 1 + static_cast<uint64_t>(layer_index); }

// Standard normal samples: Box-Muller on 53-bit uniforms from std::mt19937_64
// (whose output sequence the standard fixes).
class NormalSampler {
 public:
  NormalSampler(uint64_t seed, uint64_t tag) : gen_(SplitMix64(seed ^ SplitMix64(tag))) {}

  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = Uniform();  // (0, 1): log(u1) is finite
    const double u2 = Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  double Uniform() { return (static_cast<double>(gen_() >> 11) + 0.5) * 0x1.0p-53; }

  std::mt19937_64 gen_;
  bool has_spare_ = false;
  double spare_ = 0;
};

void FillNormal(NormalSampler& rng, double stddev, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(stddev * rng.Next());
}

constexpr double kInitStd = 0.02;

double ResidualInitStd(const GptShape& s) {
  return kInitStd / std::sqrt(2.0 * static_cast<double>(s.num_layers));
}

// Row-wise logsumexp of logits: returns (max, sum of exp(x - max)) without
// modifying the row.
template <typename Real>
Real SumExpShifted(const Real* x, int64_t n, Real shift) {
  Real sum = 0;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<Real> e = (Load(x + i, len) - shift).exp();
    for (int64_t j = 0; j < len; ++j) sum += e[j];
  }
  return sum;
}

}  // namespace

// ---------------------------------------------------------------------------
// Shapes and layouts.

Status ValidateShape(const GptShape& s) {
  if (s.vocab_size <= 0 || s.max_seq_len <= 0 || s.num_layers <= 0 || s.num_heads <= 0 ||
      s.channels <= 0) {
    return InvalidArgumentError(
        "GPT shape fields must be positive: vocab_size=" + std::to_string(s.vocab_size) +
        " max_seq_len=" + std::to_string(s.max_seq_len) +
        " num_layers=" + std::to_string(s.num_layers) +
        " num_heads=" + std::to_string(s.num_heads) + " channels=" + std::to_string(s.channels));
  }
  if (s.channels % s.num_heads != 0) {
    return InvalidArgumentError("channels (" + std::to_string(s.channels) +
                                ") must be a multiple of num_heads (" +
                                std::to_string(s.num_heads) + ")");
  }
  return Status::Ok();
}

std::vector<TensorInfo> EmbeddingTensors(const GptShape& s) {
  const int64_t C = s.channels;
  return Lay({{"wte", {s.vocab_size, C}}, {"wpe", {s.max_seq_len, C}}});
}

std::vector<TensorInfo> LayerTensors(const GptShape& s) {
  const int64_t C = s.channels;
  return Lay({{"ln1_w", {C}},
              {"ln1_b", {C}},
              {"attn_qkv_w", {C, 3 * C}},
              {"attn_qkv_b", {3 * C}},
              {"attn_proj_w", {C, C}},
              {"attn_proj_b", {C}},
              {"ln2_w", {C}},
              {"ln2_b", {C}},
              {"mlp_fc_w", {C, 4 * C}},
              {"mlp_fc_b", {4 * C}},
              {"mlp_proj_w", {4 * C, C}},
              {"mlp_proj_b", {C}}});
}

std::vector<TensorInfo> HeadTensors(const GptShape& s) {
  const int64_t C = s.channels;
  return Lay({{"lnf_w", {C}}, {"lnf_b", {C}}, {"lm_head_w", {C, s.vocab_size}}});
}

int64_t EmbeddingNumParams(const GptShape& s) { return Total(EmbeddingTensors(s)); }
int64_t LayerNumParams(const GptShape& s) { return Total(LayerTensors(s)); }
int64_t HeadNumParams(const GptShape& s) { return Total(HeadTensors(s)); }

int64_t LayerScratchElems(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return LayerScratchSizesFor(s, B, T).total();
}

int64_t HeadScratchElems(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  const int64_t N = int64_t{B} * T;
  return N * s.channels + 3 * N;
}

// ---------------------------------------------------------------------------
// Initialisation.

void InitEmbeddingParams(const GptShape& s, uint64_t seed, float* params) {
  NormalSampler rng(seed, kEmbeddingTag);
  FillNormal(rng, kInitStd, EmbeddingNumParams(s), params);
}

void InitLayerParams(const GptShape& s, int layer_index, uint64_t seed, float* params) {
  STRATA_CHECK(layer_index >= 0 && layer_index < s.num_layers);
  const int64_t C = s.channels;
  const LayerParams<float*> p(params, C);
  NormalSampler rng(seed, LayerTag(layer_index));
  std::fill(p.ln1_w, p.ln1_w + C, 1.0f);
  std::fill(p.ln1_b, p.ln1_b + C, 0.0f);
  FillNormal(rng, kInitStd, C * 3 * C, p.qkv_w);
  std::fill(p.qkv_b, p.qkv_b + 3 * C, 0.0f);
  FillNormal(rng, ResidualInitStd(s), C * C, p.attn_proj_w);
  std::fill(p.attn_proj_b, p.attn_proj_b + C, 0.0f);
  std::fill(p.ln2_w, p.ln2_w + C, 1.0f);
  std::fill(p.ln2_b, p.ln2_b + C, 0.0f);
  FillNormal(rng, kInitStd, C * 4 * C, p.fc_w);
  std::fill(p.fc_b, p.fc_b + 4 * C, 0.0f);
  FillNormal(rng, ResidualInitStd(s), 4 * C * C, p.mlp_proj_w);
  std::fill(p.mlp_proj_b, p.mlp_proj_b + C, 0.0f);
}

void InitHeadParams(const GptShape& s, uint64_t seed, float* params) {
  const int64_t C = s.channels;
  NormalSampler rng(seed, kHeadTag);
  std::fill(params, params + C, 1.0f);
  std::fill(params + C, params + 2 * C, 0.0f);
  FillNormal(rng, kInitStd, C * s.vocab_size, params + 2 * C);
}

// ---------------------------------------------------------------------------
// Embedding.

template <typename Real>
void EmbeddingForward(const GptShape& s, const Real* params, const int32_t* tokens, int B, int T,
                      Real* x_out) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels;
  const Real* wte = params;
  const Real* wpe = params + int64_t{s.vocab_size} * C;
  ParallelRows(int64_t{B} * T, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      CheckToken(tokens[r], s.vocab_size);
      const Real* te = wte + tokens[r] * C;
      const Real* pe = wpe + (r % T) * C;
      Real* o = x_out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = te[c] + pe[c];
    }
  });
}

template <typename Real>
void EmbeddingBackward(const GptShape& s, const int32_t* tokens, const Real* dx_out, int B, int T,
                       Real* dparams) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, N = int64_t{B} * T;
  for (int64_t r = 0; r < N; ++r) CheckToken(tokens[r], s.vocab_size);
  Real* dwte = dparams;
  Real* dwpe = dparams + int64_t{s.vocab_size} * C;
  ParallelRows(int64_t{s.vocab_size} + s.max_seq_len, C, [&](int64_t r0, int64_t r1) {
    std::fill(dparams + r0 * C, dparams + r1 * C, Real(0));
  });
  // Each column block adds the rows in token order: deterministic.
  ParallelColumnBlocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < N; ++r) {
      const Real* g = dx_out + r * C;
      Real* te = dwte + tokens[r] * C;
      Real* pe = dwpe + (r % T) * C;
      for (int64_t c = c0; c < c1; ++c) {
        te[c] += g[c];
        pe[c] += g[c];
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Layer.

template <typename Real>
void LayerForward(const GptShape& s, const Real* params, const Real* x_in, Real* x_out, int B,
                  int T, Real* scratch) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, G = GroupSeqs(B, T);
  const LayerParams<const Real*> p(params, C);
  const LayerScratch<Real> sc = CarveLayerScratch(s, B, T, scratch);
  for (int64_t b0 = 0; b0 < B; b0 += G) {
    const int64_t seqs = std::min<int64_t>(G, B - b0), off = b0 * T * C;
    LayerForwardGroup(s, p, x_in + off, x_out + off, seqs, T, sc, /*mlp_output=*/true);
  }
}

template <typename Real>
void LayerBackward(const GptShape& s, const Real* params, const Real* x_in, const Real* dx_out,
                   Real* dx_in, Real* dparams, int B, int T, Real* scratch) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, G = GroupSeqs(B, T);
  const LayerParams<const Real*> p(params, C);
  const LayerParams<Real*> dp(dparams, C);
  const LayerScratch<Real> sc = CarveLayerScratch(s, B, T, scratch);
  for (int64_t b0 = 0; b0 < B; b0 += G) {
    const int64_t seqs = std::min<int64_t>(G, B - b0), off = b0 * T * C;
    LayerBackwardGroup(s, p, dp, x_in + off, dx_out + off, dx_in + off, seqs, T, sc,
                       /*accumulate=*/b0 > 0);
  }
}

// ---------------------------------------------------------------------------
// Head.

template <typename Real>
Real HeadForward(const GptShape& s, const Real* params, const Real* x_in, const int32_t* targets,
                 int B, int T, Real* logits, Real* scratch) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, V = s.vocab_size, N = int64_t{B} * T;
  const Real* lnf_w = params;
  const Real* lnf_b = params + C;
  const Real* wlm = params + 2 * C;
  Real* lnf = scratch;       // (N, C)
  Real* mean = lnf + N * C;  // (N)
  Real* rstd = mean + N;     // (N)
  Real* losses = rstd + N;   // (N)
  LayerNormForward(x_in, lnf_w, lnf_b, N, C, lnf, mean, rstd);
  Gemm<Real>(false, false, N, V, C, Real(1), lnf, C, wlm, V, Real(0), logits, V);
  if (targets == nullptr) return Real(0);
  ParallelRows(N, V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      CheckToken(targets[r], s.vocab_size);
      const Real* row = logits + r * V;
      const Real mx = MaxOf(row, V);
      losses[r] = std::log(SumExpShifted(row, V, mx)) + mx - row[targets[r]];
    }
  });
  double total = 0;  // in token order, in double whatever Real is
  for (int64_t r = 0; r < N; ++r) total += losses[r];
  return static_cast<Real>(total / static_cast<double>(N));
}

template <typename Real>
void HeadBackward(const GptShape& s, const Real* params, const Real* x_in, const int32_t* targets,
                  Real dloss, int B, int T, Real* dx_in, Real* dparams, Real* logits,
                  Real* scratch) {
  CheckBatch(s, B, T);
  STRATA_CHECK(targets != nullptr);
  const int64_t C = s.channels, V = s.vocab_size, N = int64_t{B} * T;
  const Real* lnf_w = params;
  const Real* lnf_b = params + C;
  const Real* wlm = params + 2 * C;
  Real* lnf = scratch;       // (N, C)
  Real* mean = lnf + N * C;  // (N)
  Real* rstd = mean + N;     // (N)
  LayerNormForward(x_in, lnf_w, lnf_b, N, C, lnf, mean, rstd);
  Gemm<Real>(false, false, N, V, C, Real(1), lnf, C, wlm, V, Real(0), logits, V);

  // dlogits = dloss / N * (softmax(logits) - onehot(target)), in place.
  const Real scale = dloss / Real(N);
  ParallelRows(N, V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      CheckToken(targets[r], s.vocab_size);
      Real* row = logits + r * V;
      const Real sum = ExpShiftedInPlace(row, V, MaxOf(row, V));
      const Real factor = scale / sum;
      for (int64_t v = 0; v < V; ++v) row[v] *= factor;
      row[targets[r]] -= scale;
    }
  });

  Real* dlnf_w = dparams;
  Real* dlnf_b = dparams + C;
  Real* dwlm = dparams + 2 * C;
  Gemm<Real>(true, false, C, V, N, Real(1), lnf, C, logits, V, Real(0), dwlm, V);
  Gemm<Real>(false, true, N, C, V, Real(1), logits, V, wlm, V, Real(0), dx_in, C);  // dlnf
  LayerNormParamGrads(x_in, dx_in, mean, rstd, N, C, dlnf_w, dlnf_b, /*accumulate=*/false);
  LayerNormInputGrad<Real>(x_in, lnf_w, dx_in, mean, rstd, nullptr, N, C, dx_in);
}

#define STRATA_INSTANTIATE_GPT_KERNELS(Real)                                                       \
  template void EmbeddingForward<Real>(const GptShape&, const Real*, const int32_t*, int, int,     \
                                       Real*);                                                     \
  template void EmbeddingBackward<Real>(const GptShape&, const int32_t*, const Real*, int, int,    \
                                        Real*);                                                    \
  template void LayerForward<Real>(const GptShape&, const Real*, const Real*, Real*, int, int,     \
                                   Real*);                                                         \
  template void LayerBackward<Real>(const GptShape&, const Real*, const Real*, const Real*, Real*, \
                                    Real*, int, int, Real*);                                       \
  template Real HeadForward<Real>(const GptShape&, const Real*, const Real*, const int32_t*, int,  \
                                  int, Real*, Real*);                                              \
  template void HeadBackward<Real>(const GptShape&, const Real*, const Real*, const int32_t*,      \
                                   Real, int, int, Real*, Real*, Real*, Real*);

STRATA_INSTANTIATE_GPT_KERNELS(float)
STRATA_INSTANTIATE_GPT_KERNELS(double)

#undef STRATA_INSTANTIATE_GPT_KERNELS

}  // namespace strata::models
