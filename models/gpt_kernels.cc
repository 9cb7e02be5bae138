#include "models/gpt_kernels.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <type_traits>

#include "gpu/host/host_gemm.h"
#include "models/gpt_layout.h"

namespace strata::models {
namespace {

using gpu::host::Gemm;

constexpr double kLayerNormEps = 1e-5;
// Attention works on blocks of this many query rows.
constexpr int64_t kAttnRowBlock = 64;
// Column reductions (bias and LayerNorm parameter gradients, embedding rows) run one task per
// block of this many columns, each summing its rows in order.
constexpr int64_t kColBlock = 64;
// Row-parallel loops aim at this many elements per task.
constexpr int64_t kGrainElems = 1 << 14;
// Sub-buffers of a scratch start at multiples of this many bytes.
constexpr int64_t kScratchAlign = 64;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
// Scratch carving. One walk over the layout serves both the size (base == nullptr) and the
// pointers, so the two cannot disagree.

class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* Take(int64_t num_elems) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_bytes_);
    offset_bytes_ +=
        CeilDiv(num_elems * static_cast<int64_t>(sizeof(T)), kScratchAlign) * kScratchAlign;
    return p;
  }
  int64_t size_bytes() const { return offset_bytes_; }

 private:
  char* base_;
  int64_t offset_bytes_ = 0;
};

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
// Per-thread work buffers (compute-type copies of 16-bit GEMM operands, attention tiles),
// grown once. A lease holds them for one product or one attention task; a nested lease on
// the same thread (oneTBB may run another of our tasks on a thread that waits inside a
// parallel loop) gets private heap buffers instead, so no two users ever share one.

constexpr int kNumWorkBuffers = 12;

template <typename F>
struct WorkBuffers {
  std::vector<F> buf[kNumWorkBuffers];
  bool busy = false;
};

template <typename F>
class WorkLease {
 public:
  WorkLease() {
    thread_local WorkBuffers<F> tls;
    if (tls.busy) {
      own_ = std::make_unique<WorkBuffers<F>>();
      w_ = own_.get();
    } else {
      tls.busy = true;
      w_ = &tls;
    }
  }
  ~WorkLease() {
    if (own_ == nullptr) w_->busy = false;
  }
  WorkLease(const WorkLease&) = delete;
  WorkLease& operator=(const WorkLease&) = delete;

  // Buffer i with room for at least n elements (contents unspecified).
  F* Get(int i, int64_t n) {
    std::vector<F>& v = w_->buf[i];
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }

 private:
  WorkBuffers<F>* w_ = nullptr;
  std::unique_ptr<WorkBuffers<F>> own_;
};

// ---------------------------------------------------------------------------
// Elementwise transcendental functions. Every element goes through Eigen's
// code path for a fixed-size array of kVec elements (padded at the tail), so
// the result for an element never depends on its address or on where a range
// was split (Eigen's vectorized exp/tanh differ from the scalar ones in the
// last bits). Loads convert with ToFloat, stores round with FromFloat.

constexpr int kVec = 16;
template <typename F>
using Vec = Eigen::Array<F, kVec, 1>;

template <typename T>
Vec<ComputeType<T>> LoadVec(const T* x, int64_t len) {
  Vec<ComputeType<T>> v;
  for (int64_t j = 0; j < len; ++j) v[j] = ToFloat(x[j]);
  for (int64_t j = len; j < kVec; ++j) v[j] = 0;
  return v;
}

template <typename T>
void StoreVec(const Vec<ComputeType<T>>& v, int64_t len, T* y) {
  for (int64_t j = 0; j < len; ++j) y[j] = FromFloat<T>(v[j]);
}

template <typename F>
constexpr F kGeluScale = F(0.7978845608028654);  // sqrt(2 / pi)
template <typename F>
constexpr F kGeluCubic = F(0.044715);

// gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))).
template <typename F>
Vec<F> Gelu(const Vec<F>& v) {
  const Vec<F> u = kGeluScale<F> * (v + kGeluCubic<F> * v * v * v);
  return F(0.5) * v * (F(1) + u.tanh());
}

// gelu'(v).
template <typename F>
Vec<F> GeluGrad(const Vec<F>& v) {
  const Vec<F> v2 = v * v;
  const Vec<F> th = (kGeluScale<F> * (v + kGeluCubic<F> * v2 * v)).tanh();
  const Vec<F> du = kGeluScale<F> * (F(1) + F(3) * kGeluCubic<F> * v2);
  return F(0.5) * (F(1) + th) + F(0.5) * v * (F(1) - th * th) * du;
}

// Sum of exp(x[i] - shift), added in index order.
template <typename T>
ComputeType<T> SumExpShifted(const T* x, int64_t n, ComputeType<T> shift) {
  ComputeType<T> sum = 0;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<ComputeType<T>> e = (LoadVec(x + i, len) - shift).exp();
    for (int64_t j = 0; j < len; ++j) sum += e[j];
  }
  return sum;
}

template <typename T>
ComputeType<T> MaxOf(const T* x, int64_t n) {
  ComputeType<T> m = ToFloat(x[0]);
  for (int64_t i = 1; i < n; ++i) m = std::max(m, ToFloat(x[i]));
  return m;
}

// ---------------------------------------------------------------------------
// Matrix products with an fp32 (double for the reference) result and one rounding to S.

// The stored A and B of op(A) op(B) widened to fp32 (exact) into buffers 0 and 1 of `work`,
// densely packed: lda and ldb are their stored row lengths.
struct WidenedOperands {
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
};

template <typename S>
WidenedOperands WidenOperands(WorkLease<float>& work, bool trans_a, bool trans_b, int64_t M,
                              int64_t N, int64_t K, const S* A, int64_t lda, const S* B,
                              int64_t ldb) {
  auto widen = [](const S* x, int64_t ld, int64_t rows, int64_t cols, float* y) {
    ParallelRows(rows, cols, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = ToFloat(x[r * ld + c]);
      }
    });
  };
  const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
  const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  float* af = work.Get(0, a_rows * a_cols);
  float* bf = work.Get(1, b_rows * b_cols);
  widen(A, lda, a_rows, a_cols, af);
  widen(B, ldb, b_rows, b_cols, bf);
  return {af, a_cols, bf, b_cols};
}

// Writes the rounded product: out_row[c] = S(acc[c]).
struct PlainEpilogue {};

// out(M, N) (row stride N) = epilogue of op(A) op(B) (see gpu::host::Gemm for op and the
// strides). The product runs through Gemm<ComputeType<S>>; 16-bit operands are converted to
// fp32 first (exact), and the fp32 result goes through epi(row, acc_row, out_row) once, which
// adds what it adds to the fp32 value and rounds once. For S = float or double the result is
// computed in place in out (acc_row == out_row: an epilogue reads each element before it
// writes it).
template <typename S, typename Epi>
void MatMul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
            const S* B, int64_t ldb, S* out, const Epi& epi) {
  using F = ComputeType<S>;
  constexpr bool kPlain = std::is_same_v<Epi, PlainEpilogue>;
  if constexpr (std::is_same_v<S, F>) {
    Gemm<F>(trans_a, trans_b, M, N, K, F(1), A, lda, B, ldb, F(0), out, N);
    if constexpr (!kPlain) {
      ParallelRows(M, N, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) epi(r, out + r * N, out + r * N);
      });
    }
  } else {
    WorkLease<float> work;
    const WidenedOperands w = WidenOperands(work, trans_a, trans_b, M, N, K, A, lda, B, ldb);
    float* acc = work.Get(2, M * N);
    Gemm<float>(trans_a, trans_b, M, N, K, 1.0f, w.a, w.lda, w.b, w.ldb, 0.0f, acc, N);
    ParallelRows(M, N, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if constexpr (kPlain) {
          for (int64_t c = 0; c < N; ++c) out[r * N + c] = FromFloat<S>(acc[r * N + c]);
        } else {
          epi(r, acc + r * N, out + r * N);
        }
      }
    });
  }
}

template <typename S>
void MatMul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
            const S* B, int64_t ldb, S* out) {
  MatMul(trans_a, trans_b, M, N, K, A, lda, B, ldb, out, PlainEpilogue{});
}

// out = S(acc + bias (+ residual)): the cuBLASLt bias epilogue with beta = 1 on the residual.
template <typename S>
struct BiasEpilogue {
  const S* bias;
  const S* residual;  // (M, N) or nullptr
  int64_t N;
  void operator()(int64_t r, const ComputeType<S>* acc, S* out) const {
    const S* res = residual != nullptr ? residual + r * N : nullptr;
    for (int64_t c = 0; c < N; ++c) {
      ComputeType<S> v = acc[c] + ToFloat(bias[c]);
      if (res != nullptr) v += ToFloat(res[c]);
      out[c] = FromFloat<S>(v);
    }
  }
};

// pre = S(acc + bias), out = S(gelu(acc + bias)) from the unrounded sum (GELU_AUX).
template <typename S>
struct BiasGeluEpilogue {
  const S* bias;
  S* pre;  // (M, N)
  int64_t N;
  void operator()(int64_t r, const ComputeType<S>* acc, S* out) const {
    for (int64_t c = 0; c < N; c += kVec) {
      const int64_t len = std::min<int64_t>(kVec, N - c);
      const Vec<ComputeType<S>> v = LoadVec(acc + c, len) + LoadVec(bias + c, len);
      StoreVec<S>(v, len, pre + r * N + c);
      StoreVec<S>(Gelu(v), len, out + c);
    }
  }
};

// out = S(acc * gelu'(pre)), pre read from S (DGELU).
template <typename S>
struct GeluGradEpilogue {
  const S* pre;  // (M, N)
  int64_t N;
  void operator()(int64_t r, const ComputeType<S>* acc, S* out) const {
    for (int64_t c = 0; c < N; c += kVec) {
      const int64_t len = std::min<int64_t>(kVec, N - c);
      const Vec<ComputeType<S>> g = LoadVec(acc + c, len) * GeluGrad(LoadVec(pre + r * N + c, len));
      StoreVec<S>(g, len, out + c);
    }
  }
};

// ---------------------------------------------------------------------------
// Sums over rows and LayerNorm (Ba et al. 2016).

// out = S(sum over rows of x (rows, cols)), in ComputeType, rows in order.
template <typename S>
void ColumnSums(const S* x, int64_t rows, int64_t cols, S* out) {
  ParallelColumnBlocks(cols, [&](int64_t c0, int64_t c1) {
    ComputeType<S> acc[kColBlock] = {};
    const int64_t w = c1 - c0;
    for (int64_t r = 0; r < rows; ++r) {
      const S* xr = x + r * cols + c0;
      for (int64_t j = 0; j < w; ++j) acc[j] += ToFloat(xr[j]);
    }
    for (int64_t j = 0; j < w; ++j) out[c0 + j] = FromFloat<S>(acc[j]);
  });
}

// y = S((x - mean) * rstd * w + b) over the last dimension C of x (rows, C), rstd =
// 1 / sqrt(var + eps) with the biased variance; mean and rstd kept in ComputeType.
template <typename S>
void LayerNormForward(const S* x, const S* w, const S* b, int64_t rows, int64_t C, S* y,
                      ComputeType<S>* mean, ComputeType<S>* rstd) {
  using F = ComputeType<S>;
  ParallelRows(rows, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* xr = x + r * C;
      F sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += ToFloat(xr[c]);
      const F m = sum / F(C);
      F var = 0;
      for (int64_t c = 0; c < C; ++c) var += (ToFloat(xr[c]) - m) * (ToFloat(xr[c]) - m);
      var /= F(C);
      const F s = F(1) / std::sqrt(var + F(kLayerNormEps));
      mean[r] = m;
      rstd[r] = s;
      S* yr = y + r * C;
      for (int64_t c = 0; c < C; ++c) {
        yr[c] = FromFloat<S>((ToFloat(xr[c]) - m) * s * ToFloat(w[c]) + ToFloat(b[c]));
      }
    }
  });
}

// dw = S(sum_r dy * xhat), db = S(sum_r dy), xhat = (x - mean) * rstd; rows in order.
template <typename S>
void LayerNormParamGrads(const S* x, const S* dy, const ComputeType<S>* mean,
                         const ComputeType<S>* rstd, int64_t rows, int64_t C, S* dw, S* db) {
  using F = ComputeType<S>;
  ParallelColumnBlocks(C, [&](int64_t c0, int64_t c1) {
    F acc_w[kColBlock] = {};
    F acc_b[kColBlock] = {};
    const int64_t w = c1 - c0;
    for (int64_t r = 0; r < rows; ++r) {
      const S* xr = x + r * C + c0;
      const S* dr = dy + r * C + c0;
      const F m = mean[r], s = rstd[r];
      for (int64_t j = 0; j < w; ++j) {
        const F d = ToFloat(dr[j]);
        acc_w[j] += d * ((ToFloat(xr[j]) - m) * s);
        acc_b[j] += d;
      }
    }
    for (int64_t j = 0; j < w; ++j) {
      dw[c0 + j] = FromFloat<S>(acc_w[j]);
      db[c0 + j] = FromFloat<S>(acc_b[j]);
    }
  });
}

// dx = S((residual ? residual : 0) + LayerNorm input gradient), in ComputeType:
//   g = dy * w;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// Row-local and element-by-element read-before-write, so dx may equal dy or residual.
template <typename S>
void LayerNormInputGrad(const S* x, const S* w, const S* dy, const ComputeType<S>* mean,
                        const ComputeType<S>* rstd, const S* residual, int64_t rows, int64_t C,
                        S* dx) {
  using F = ComputeType<S>;
  ParallelRows(rows, 2 * C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* xr = x + r * C;
      const S* dr = dy + r * C;
      const F m = mean[r], s = rstd[r];
      F g_mean = 0, gx_mean = 0;
      for (int64_t c = 0; c < C; ++c) {
        const F g = ToFloat(dr[c]) * ToFloat(w[c]);
        g_mean += g;
        gx_mean += g * ((ToFloat(xr[c]) - m) * s);
      }
      g_mean /= F(C);
      gx_mean /= F(C);
      S* out = dx + r * C;
      const S* res = residual != nullptr ? residual + r * C : nullptr;
      for (int64_t c = 0; c < C; ++c) {
        const F xhat = (ToFloat(xr[c]) - m) * s;
        F v = s * (ToFloat(dr[c]) * ToFloat(w[c]) - g_mean - xhat * gx_mean);
        if (res != nullptr) v = ToFloat(res[c]) + v;
        out[c] = FromFloat<S>(v);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Causal multi-head self-attention (Vaswani et al. 2017) with the storage and rounding of
// FlashAttention-2 (Dao, 2023). One task per (sequence, head); the task copies q, k, v of its
// head into compute-type tiles and works on blocks of kAttnRowBlock query rows, each block's
// scores against all keys up to its last row at once (instead of an online softmax: the same
// probabilities, one pass). qkv: (B, T, 3C); att: (B, T, C); lse: (B, H, T).

struct AttnDims {
  int64_t B, T, C, H, hs;
};

template <typename F>
F AttnScale(const AttnDims& d) {
  return F(1) / std::sqrt(F(d.hs));
}

template <typename Fn>
void ForEachHead(const AttnDims& d, Fn&& f) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, d.B * d.H, 1),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t bh = r.begin(); bh != r.end(); ++bh) {
                        // Isolated: while this task waits inside a Gemm, its thread runs
                        // only that Gemm's tiles, never another head (which would find the
                        // work buffers leased and allocate its own).
                        tbb::this_task_arena::isolate([&] { f(bh / d.H, bh % d.H, bh); });
                      }
                    });
}

// dst (T, hs) = ToFloat of the head-h columns at column offset `col` of rows of stride ld.
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
// scale * q k^T. Forward and backward make this same call, so the backward's scores are the
// forward's bit for bit.
template <typename F>
void Scores(const AttnDims& d, const F* qf, const F* kf, int64_t t0, int64_t nq, F* sc) {
  const int64_t nk = t0 + nq;
  Gemm<F>(false, true, nq, nk, d.hs, AttnScale<F>(d), qf + t0 * d.hs, d.hs, kf, d.hs, F(0), sc, nk);
}

// Replaces the scores of query row t (sc, nk wide) by P = S(exp(score - lse)) for keys <= t
// (as ComputeType values) and zero for the masked keys.
template <typename S>
void ProbabilitiesInPlace(ComputeType<S>* row, int64_t t, int64_t nk, ComputeType<S> lse) {
  using F = ComputeType<S>;
  const int64_t n = t + 1;
  for (int64_t i = 0; i < n; i += kVec) {
    const int64_t len = std::min<int64_t>(kVec, n - i);
    const Vec<F> p = (LoadVec(row + i, len) - lse).exp();
    for (int64_t j = 0; j < len; ++j) row[i + j] = ToFloat(FromFloat<S>(p[j]));
  }
  std::fill(row + n, row + nk, F(0));
}

template <typename S>
void AttentionForward(const AttnDims& d, const S* qkv, S* att, ComputeType<S>* lse) {
  using F = ComputeType<S>;
  const int64_t T = d.T, C = d.C, hs = d.hs, ld3 = 3 * C;
  const int64_t rb = std::min(T, kAttnRowBlock);
  ForEachHead(d, [&](int64_t b, int64_t h, int64_t bh) {
    WorkLease<F> work;
    F* qf = work.Get(0, T * hs);
    F* kf = work.Get(1, T * hs);
    F* vf = work.Get(2, T * hs);
    F* sc = work.Get(3, rb * T);
    F* of = work.Get(4, rb * hs);
    const S* base = qkv + b * T * ld3 + h * hs;
    LoadHead(base, ld3, T, hs, qf);
    LoadHead(base + C, ld3, T, hs, kf);
    LoadHead(base + 2 * C, ld3, T, hs, vf);
    F* lse_bh = lse + bh * T;
    for (int64_t t0 = 0; t0 < T; t0 += rb) {
      const int64_t nq = std::min(rb, T - t0), nk = t0 + nq;
      Scores(d, qf, kf, t0, nq, sc);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i;
        F* row = sc + i * nk;
        const F m = MaxOf(row, t + 1);
        lse_bh[t] = m + std::log(SumExpShifted(row, t + 1, m));
        ProbabilitiesInPlace<S>(row, t, nk, lse_bh[t]);
      }
      Gemm<F>(false, false, nq, hs, nk, F(1), sc, nk, vf, hs, F(0), of, hs);
      StoreHead<S>(of, nq, hs, att + (b * T + t0) * C + h * hs, C);
    }
  });
}

// dqkv: (B, T, 3C) from datt: (B, T, C), the forward's qkv, att (the output O) and lse.
template <typename S>
void AttentionBackward(const AttnDims& d, const S* qkv, const S* att, const S* datt,
                       const ComputeType<S>* lse, S* dqkv) {
  using F = ComputeType<S>;
  const int64_t T = d.T, C = d.C, hs = d.hs, ld3 = 3 * C;
  const int64_t rb = std::min(T, kAttnRowBlock);
  const F scale = AttnScale<F>(d);
  ForEachHead(d, [&](int64_t b, int64_t h, int64_t bh) {
    WorkLease<F> work;
    F* qf = work.Get(0, T * hs);
    F* kf = work.Get(1, T * hs);
    F* vf = work.Get(2, T * hs);
    F* dof = work.Get(3, T * hs);
    F* dk = work.Get(4, T * hs);
    F* dv = work.Get(5, T * hs);
    F* p = work.Get(6, rb * T);
    F* ds = work.Get(7, rb * T);
    F* dq = work.Get(8, rb * hs);
    F* dsum = work.Get(9, T);
    const S* base = qkv + b * T * ld3 + h * hs;
    LoadHead(base, ld3, T, hs, qf);
    LoadHead(base + C, ld3, T, hs, kf);
    LoadHead(base + 2 * C, ld3, T, hs, vf);
    LoadHead(datt + b * T * C + h * hs, C, T, hs, dof);
    // D[t] = rowsum(dO * O).
    const S* o = att + b * T * C + h * hs;
    for (int64_t t = 0; t < T; ++t) {
      F sum = 0;
      for (int64_t j = 0; j < hs; ++j) sum += dof[t * hs + j] * ToFloat(o[t * C + j]);
      dsum[t] = sum;
    }
    std::fill(dk, dk + T * hs, F(0));
    std::fill(dv, dv + T * hs, F(0));
    const F* lse_bh = lse + bh * T;
    S* dq_out = dqkv + b * T * ld3 + h * hs;
    for (int64_t t0 = 0; t0 < T; t0 += rb) {
      const int64_t nq = std::min(rb, T - t0), nk = t0 + nq;
      Scores(d, qf, kf, t0, nq, p);
      for (int64_t i = 0; i < nq; ++i)
        ProbabilitiesInPlace<S>(p + i * nk, t0 + i, nk, lse_bh[t0 + i]);
      // dP = dO v^T; dS = S(P (dP - D)), zero where masked (P is zero there).
      Gemm<F>(false, true, nq, nk, hs, F(1), dof + t0 * hs, hs, vf, hs, F(0), ds, nk);
      for (int64_t i = 0; i < nq; ++i) {
        const F dd = dsum[t0 + i];
        F* drow = ds + i * nk;
        const F* prow = p + i * nk;
        for (int64_t s = 0; s < nk; ++s) drow[s] = ToFloat(FromFloat<S>(prow[s] * (drow[s] - dd)));
      }
      // dv += P^T dO;  dq = scale dS k;  dk += scale dS^T q.
      Gemm<F>(true, false, nk, hs, nq, F(1), p, nk, dof + t0 * hs, hs, F(1), dv, hs);
      Gemm<F>(false, false, nq, hs, nk, scale, ds, nk, kf, hs, F(0), dq, hs);
      Gemm<F>(true, false, nk, hs, nq, scale, ds, nk, qf + t0 * hs, hs, F(1), dk, hs);
      StoreHead<S>(dq, nq, hs, dq_out + t0 * ld3, ld3);
    }
    StoreHead<S>(dk, T, hs, dq_out + C, ld3);
    StoreHead<S>(dv, T, hs, dq_out + 2 * C, ld3);
  });
}

// ---------------------------------------------------------------------------
// Transformer layer over all N = B T rows.

// The layer scratch (see LayerScratchBytes in the header).
template <typename S>
struct LayerScratch {
  using F = ComputeType<S>;
  F *mean1, *rstd1, *mean2, *rstd2;  // (N)
  F* lse;                            // (B, H, T)
  S* ln1;                            // (N, C)
  S* qkv;                            // (N, 3C)
  S* att;                            // (N, C)
  S* x2;                             // (N, C)
  S* ln2;                            // (N, C)
  S* h;                              // (N, 4C)
  S* g;                              // (N, 4C)
  int64_t size_bytes;
};

template <typename S>
LayerScratch<S> CarveLayerScratch(const GptShape& s, int B, int T, void* scratch) {
  using F = ComputeType<S>;
  const int64_t N = int64_t{B} * T, C = s.channels;
  Carver c(scratch);
  LayerScratch<S> sc;
  sc.mean1 = c.Take<F>(N);
  sc.rstd1 = c.Take<F>(N);
  sc.mean2 = c.Take<F>(N);
  sc.rstd2 = c.Take<F>(N);
  sc.lse = c.Take<F>(N * s.num_heads);
  sc.ln1 = c.Take<S>(N * C);
  sc.qkv = c.Take<S>(3 * N * C);
  sc.att = c.Take<S>(N * C);
  sc.x2 = c.Take<S>(N * C);
  sc.ln2 = c.Take<S>(N * C);
  sc.h = c.Take<S>(4 * N * C);
  sc.g = c.Take<S>(4 * N * C);
  sc.size_bytes = c.size_bytes();
  return sc;
}

// The forward up to the GELU output g (all the backward needs), every value in scratch.
template <typename S>
void LayerForwardToGelu(const GptShape& s, const LayerParams<const S*>& p, const S* x, int B, int T,
                        const LayerScratch<S>& sc) {
  const int64_t C = s.channels, N = int64_t{B} * T;
  const AttnDims dims{B, T, C, s.num_heads, C / s.num_heads};
  LayerNormForward(x, p.ln1_w, p.ln1_b, N, C, sc.ln1, sc.mean1, sc.rstd1);
  MatMul(false, false, N, 3 * C, C, sc.ln1, C, p.qkv_w, 3 * C, sc.qkv,
         BiasEpilogue<S>{p.qkv_b, nullptr, 3 * C});
  AttentionForward(dims, sc.qkv, sc.att, sc.lse);
  MatMul(false, false, N, C, C, sc.att, C, p.attn_proj_w, C, sc.x2,
         BiasEpilogue<S>{p.attn_proj_b, x, C});
  LayerNormForward(sc.x2, p.ln2_w, p.ln2_b, N, C, sc.ln2, sc.mean2, sc.rstd2);
  MatMul(false, false, N, 4 * C, C, sc.ln2, C, p.fc_w, 4 * C, sc.g,
         BiasGeluEpilogue<S>{p.fc_b, sc.h, 4 * C});
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

// ---------------------------------------------------------------------------
// Scratch sizes.

namespace {

// The embedding backward's counting sort: first[V + 1] (where each token's positions start)
// and order[N] (positions sorted by token id, in token order within an id).
struct EmbeddingScratch {
  int32_t* first;
  int32_t* order;
  int64_t size_bytes;
};

EmbeddingScratch CarveEmbeddingScratch(const GptShape& s, int B, int T, void* scratch) {
  Carver c(scratch);
  EmbeddingScratch sc;
  sc.first = c.Take<int32_t>(int64_t{s.vocab_size} + 1);
  sc.order = c.Take<int32_t>(int64_t{B} * T);
  sc.size_bytes = c.size_bytes();
  return sc;
}

template <typename S>
struct HeadScratch {
  S* lnf;                               // (N, C)
  ComputeType<S>*mean, *rstd, *losses;  // (N)
  S* chunk;                             // (chunk_rows, V) logits, then their gradients
  float* dwlm_acc;                      // (C, V) fp32 for 16-bit S; null for float and double
  int64_t size_bytes;
};

template <typename S>
HeadScratch<S> CarveHeadScratch(const GptShape& s, int B, int T, int64_t chunk_rows,
                                void* scratch) {
  using F = ComputeType<S>;
  const int64_t N = int64_t{B} * T, C = s.channels, V = s.vocab_size;
  STRATA_CHECK_MSG(chunk_rows >= 1 && chunk_rows <= N,
                   "chunk_rows=" + std::to_string(chunk_rows) + " N=" + std::to_string(N));
  Carver c(scratch);
  HeadScratch<S> sc;
  sc.lnf = c.Take<S>(N * C);
  sc.mean = c.Take<F>(N);
  sc.rstd = c.Take<F>(N);
  sc.losses = c.Take<F>(N);
  sc.chunk = c.Take<S>(chunk_rows * V);
  sc.dwlm_acc = std::is_same_v<S, F> ? nullptr : c.Take<float>(C * V);
  sc.size_bytes = c.size_bytes();
  return sc;
}

}  // namespace

template <typename S>
int64_t EmbeddingScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return CarveEmbeddingScratch(s, B, T, nullptr).size_bytes;
}

template <typename S>
int64_t LayerScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return CarveLayerScratch<S>(s, B, T, nullptr).size_bytes;
}

template <typename S>
int64_t HeadScratchBytes(const GptShape& s, int B, int T) {
  CheckBatch(s, B, T);
  return internal::HeadScratchBytesWithChunkRows<S>(s, B, T,
                                                    HeadChunkRows(int64_t{B} * T, s.vocab_size));
}

template <typename S>
int64_t internal::HeadScratchBytesWithChunkRows(const GptShape& s, int B, int T,
                                                int64_t chunk_rows) {
  CheckBatch(s, B, T);
  return CarveHeadScratch<S>(s, B, T, chunk_rows, nullptr).size_bytes;
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

template <typename S>
void EmbeddingForward(const GptShape& s, const S* params, const int32_t* tokens, int B, int T,
                      S* x_out) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels;
  const S* wte = params;
  const S* wpe = params + int64_t{s.vocab_size} * C;
  ParallelRows(int64_t{B} * T, C, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      CheckToken(tokens[r], s.vocab_size);
      const S* te = wte + tokens[r] * C;
      const S* pe = wpe + (r % T) * C;
      S* o = x_out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = FromFloat<S>(ToFloat(te[c]) + ToFloat(pe[c]));
    }
  });
}

template <typename S>
void EmbeddingBackward(const GptShape& s, const int32_t* tokens, const S* dx_out, int B, int T,
                       S* dparams, void* scratch) {
  using F = ComputeType<S>;
  CheckBatch(s, B, T);
  const int64_t C = s.channels, N = int64_t{B} * T, V = s.vocab_size;
  const EmbeddingScratch sc = CarveEmbeddingScratch(s, B, T, scratch);
  // Counting sort of the positions by token id, stable (token order within an id).
  std::fill(sc.first, sc.first + V + 1, 0);
  for (int64_t r = 0; r < N; ++r) {
    CheckToken(tokens[r], s.vocab_size);
    ++sc.first[tokens[r] + 1];
  }
  for (int64_t v = 0; v < V; ++v) sc.first[v + 1] += sc.first[v];
  for (int64_t r = 0; r < N; ++r) sc.order[sc.first[tokens[r]]++] = static_cast<int32_t>(r);
  // first[v] now holds the end of token v's run, which is where token v + 1's starts.
  auto run_begin = [&](int64_t v) { return v == 0 ? 0 : sc.first[v - 1]; };

  S* dwte = dparams;
  S* dwpe = dparams + V * C;
  // wte row v: its positions' dx rows in token order; wpe row t < T: dx[b, t] over b in order.
  ParallelRows(V + s.max_seq_len, C, [&](int64_t r0, int64_t r1) {
    F acc[kColBlock];
    for (int64_t row = r0; row < r1; ++row) {
      const bool is_wte = row < V;
      S* out = is_wte ? dwte + row * C : dwpe + (row - V) * C;
      const int64_t t = row - V;
      const int64_t count = is_wte ? sc.first[row] - run_begin(row) : (t < T ? B : 0);
      for (int64_t c0 = 0; c0 < C; c0 += kColBlock) {
        const int64_t w = std::min(kColBlock, C - c0);
        std::fill(acc, acc + w, F(0));
        for (int64_t i = 0; i < count; ++i) {
          const int64_t pos = is_wte ? sc.order[run_begin(row) + i] : i * T + t;
          const S* g = dx_out + pos * C + c0;
          for (int64_t j = 0; j < w; ++j) acc[j] += ToFloat(g[j]);
        }
        for (int64_t j = 0; j < w; ++j) out[c0 + j] = FromFloat<S>(acc[j]);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Layer.

template <typename S>
void LayerForward(const GptShape& s, const S* params, const S* x_in, S* x_out, int B, int T,
                  void* scratch) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, N = int64_t{B} * T;
  const LayerParams<const S*> p(params, C);
  const LayerScratch<S> sc = CarveLayerScratch<S>(s, B, T, scratch);
  LayerForwardToGelu(s, p, x_in, B, T, sc);
  MatMul(false, false, N, C, 4 * C, sc.g, 4 * C, p.mlp_proj_w, C, x_out,
         BiasEpilogue<S>{p.mlp_proj_b, sc.x2, C});
}

template <typename S>
void LayerBackward(const GptShape& s, const S* params, const S* x_in, const S* dx_out, S* dx_in,
                   S* dparams, int B, int T, void* scratch) {
  CheckBatch(s, B, T);
  const int64_t C = s.channels, N = int64_t{B} * T;
  const AttnDims dims{B, T, C, s.num_heads, C / s.num_heads};
  const LayerParams<const S*> p(params, C);
  const LayerParams<S*> dp(dparams, C);
  const LayerScratch<S> sc = CarveLayerScratch<S>(s, B, T, scratch);
  LayerForwardToGelu(s, p, x_in, B, T, sc);
  const S* dy = dx_out;

  // MLP projection y = x2 + g Wp + bp.
  MatMul(true, false, 4 * C, C, N, sc.g, 4 * C, dy, C, dp.mlp_proj_w);
  ColumnSums(dy, N, C, dp.mlp_proj_b);
  S* dh = sc.g;  // g is dead
  MatMul(false, true, N, 4 * C, C, dy, C, p.mlp_proj_w, C, dh, GeluGradEpilogue<S>{sc.h, 4 * C});

  // MLP fc h = ln2 Wfc + bfc.
  ColumnSums(dh, N, 4 * C, dp.fc_b);
  MatMul(true, false, C, 4 * C, N, sc.ln2, C, dh, 4 * C, dp.fc_w);
  S* dln2 = sc.h;  // h is dead
  MatMul(false, true, N, C, 4 * C, dh, 4 * C, p.fc_w, 4 * C, dln2);

  // LayerNorm 2 and the MLP residual: dx2 = S(dy + LN2'(dln2)).
  LayerNormParamGrads(sc.x2, dln2, sc.mean2, sc.rstd2, N, C, dp.ln2_w, dp.ln2_b);
  S* dx2 = sc.ln2;  // ln2 is dead
  LayerNormInputGrad(sc.x2, p.ln2_w, dln2, sc.mean2, sc.rstd2, dy, N, C, dx2);

  // Attention projection x2 = x + att Wo + bo.
  ColumnSums(dx2, N, C, dp.attn_proj_b);
  MatMul(true, false, C, C, N, sc.att, C, dx2, C, dp.attn_proj_w);
  S* datt = sc.x2;  // x2 is dead
  MatMul(false, true, N, C, C, dx2, C, p.attn_proj_w, C, datt);

  // Attention core.
  S* dqkv = sc.g;  // dh is dead
  AttentionBackward(dims, sc.qkv, sc.att, datt, sc.lse, dqkv);

  // qkv = ln1 Wqkv + bqkv.
  ColumnSums(dqkv, N, 3 * C, dp.qkv_b);
  MatMul(true, false, C, 3 * C, N, sc.ln1, C, dqkv, 3 * C, dp.qkv_w);
  S* dln1 = sc.h;  // dln2 is dead
  MatMul(false, true, N, C, 3 * C, dqkv, 3 * C, p.qkv_w, 3 * C, dln1);

  // LayerNorm 1 and the attention residual: dx = S(dx2 + LN1'(dln1)).
  LayerNormParamGrads(x_in, dln1, sc.mean1, sc.rstd1, N, C, dp.ln1_w, dp.ln1_b);
  LayerNormInputGrad(x_in, p.ln1_w, dln1, sc.mean1, sc.rstd1, dx2, N, C, dx_in);
}

// ---------------------------------------------------------------------------
// Head.

namespace {

// acc (M, N) (row stride N) = op(A) op(B) + beta acc in the compute type: the head's weight
// gradient accumulated over chunks. 16-bit operands are widened to fp32 first (exact) and the
// product runs in fp32 into the fp32 accumulator; for S = float or double directly.
template <typename S>
void AccumulateProduct(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A,
                       int64_t lda, const S* B, int64_t ldb, ComputeType<S> beta,
                       ComputeType<S>* acc) {
  using F = ComputeType<S>;
  if constexpr (std::is_same_v<S, F>) {
    Gemm<F>(trans_a, trans_b, M, N, K, F(1), A, lda, B, ldb, beta, acc, N);
  } else {
    WorkLease<float> work;
    const WidenedOperands w = WidenOperands(work, trans_a, trans_b, M, N, K, A, lda, B, ldb);
    Gemm<float>(trans_a, trans_b, M, N, K, 1.0f, w.a, w.lda, w.b, w.ldb, beta, acc, N);
  }
}

// The chunk's logits: chunk (rows, V) = S(lnf[r0, r0 + rows) Wlm).
template <typename S>
void ChunkLogits(const GptShape& s, const S* wlm, const HeadScratch<S>& sc, int64_t r0,
                 int64_t rows) {
  const int64_t C = s.channels, V = s.vocab_size;
  MatMul(false, false, rows, V, C, sc.lnf + r0 * C, C, wlm, V, sc.chunk);
}

}  // namespace

template <typename S>
ComputeType<S> HeadForward(const GptShape& s, const S* params, const S* x_in,
                           const int32_t* targets, int B, int T, S* logits, void* scratch) {
  CheckBatch(s, B, T);
  return internal::HeadForwardWithChunkRows(s, params, x_in, targets, B, T, logits, scratch,
                                            HeadChunkRows(int64_t{B} * T, s.vocab_size));
}

template <typename S>
void HeadBackward(const GptShape& s, const S* params, const S* x_in, const int32_t* targets,
                  ComputeType<S> dloss, int B, int T, S* dx_in, S* dparams, void* scratch) {
  CheckBatch(s, B, T);
  internal::HeadBackwardWithChunkRows(s, params, x_in, targets, dloss, B, T, dx_in, dparams,
                                      scratch, HeadChunkRows(int64_t{B} * T, s.vocab_size));
}

template <typename S>
ComputeType<S> internal::HeadForwardWithChunkRows(const GptShape& s, const S* params, const S* x_in,
                                                  const int32_t* targets, int B, int T, S* logits,
                                                  void* scratch, int64_t chunk_rows) {
  using F = ComputeType<S>;
  CheckBatch(s, B, T);
  const int64_t C = s.channels, V = s.vocab_size, N = int64_t{B} * T;
  const S* lnf_w = params;
  const S* lnf_b = params + C;
  const S* wlm = params + 2 * C;
  const HeadScratch<S> sc = CarveHeadScratch<S>(s, B, T, chunk_rows, scratch);
  LayerNormForward(x_in, lnf_w, lnf_b, N, C, sc.lnf, sc.mean, sc.rstd);
  // The last position of each sequence: rows T-1, 2T-1, ... of lnf (row stride T C).
  MatMul(false, false, B, V, C, sc.lnf + (T - 1) * C, T * C, wlm, V, logits);
  if (targets == nullptr) return F(0);
  for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, N - r0);
    ChunkLogits(s, wlm, sc, r0, rows);
    ParallelRows(rows, V, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = r0 + i;
        CheckToken(targets[r], s.vocab_size);
        const S* row = sc.chunk + i * V;
        const F mx = MaxOf(row, V);
        sc.losses[r] = std::log(SumExpShifted(row, V, mx)) + mx - ToFloat(row[targets[r]]);
      }
    });
  }
  double total = 0;  // in token order, in double whatever S is
  for (int64_t r = 0; r < N; ++r) total += sc.losses[r];
  return static_cast<F>(total / static_cast<double>(N));
}

template <typename S>
void internal::HeadBackwardWithChunkRows(const GptShape& s, const S* params, const S* x_in,
                                         const int32_t* targets, ComputeType<S> dloss, int B, int T,
                                         S* dx_in, S* dparams, void* scratch, int64_t chunk_rows) {
  using F = ComputeType<S>;
  CheckBatch(s, B, T);
  STRATA_CHECK(targets != nullptr);
  const int64_t C = s.channels, V = s.vocab_size, N = int64_t{B} * T;
  const S* lnf_w = params;
  const S* lnf_b = params + C;
  const S* wlm = params + 2 * C;
  S* dlnf_w = dparams;
  S* dlnf_b = dparams + C;
  S* dwlm = dparams + 2 * C;
  const HeadScratch<S> sc = CarveHeadScratch<S>(s, B, T, chunk_rows, scratch);
  F* acc;
  if constexpr (std::is_same_v<S, F>) {
    acc = dwlm;
  } else {
    acc = sc.dwlm_acc;
  }
  LayerNormForward(x_in, lnf_w, lnf_b, N, C, sc.lnf, sc.mean, sc.rstd);

  const F scale = dloss / F(N);
  for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, N - r0);
    ChunkLogits(s, wlm, sc, r0, rows);
    // dlogits = S(dloss / N * (softmax(logits) - onehot(target))), in place.
    ParallelRows(rows, V, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t target = targets[r0 + i];
        CheckToken(static_cast<int32_t>(target), s.vocab_size);
        S* row = sc.chunk + i * V;
        const F mx = MaxOf(row, V);
        const F factor = scale / SumExpShifted(row, V, mx);
        for (int64_t v = 0; v < V; v += kVec) {
          const int64_t len = std::min<int64_t>(kVec, V - v);
          Vec<F> d = (LoadVec(row + v, len) - mx).exp() * factor;
          if (target >= v && target < v + len) d[target - v] -= scale;
          StoreVec<S>(d, len, row + v);
        }
      }
    });
    // acc (+)= lnf_chunk^T dlogits (beta 0 on the first chunk), in chunk order.
    AccumulateProduct<S>(true, false, C, V, rows, sc.lnf + r0 * C, C, sc.chunk, V,
                         r0 == 0 ? F(0) : F(1), acc);
    MatMul(false, true, rows, C, V, sc.chunk, V, wlm, V, dx_in + r0 * C);  // dlnf rows
  }
  if constexpr (!std::is_same_v<S, F>) {
    ParallelRows(C, V, [&](int64_t c0, int64_t c1) {
      for (int64_t i = c0 * V; i < c1 * V; ++i) dwlm[i] = FromFloat<S>(acc[i]);
    });
  }
  LayerNormParamGrads(x_in, dx_in, sc.mean, sc.rstd, N, C, dlnf_w, dlnf_b);
  LayerNormInputGrad<S>(x_in, lnf_w, dx_in, sc.mean, sc.rstd, nullptr, N, C, dx_in);
}

#define STRATA_INSTANTIATE_GPT_KERNELS(S)                                                          \
  template int64_t EmbeddingScratchBytes<S>(const GptShape&, int, int);                            \
  template int64_t LayerScratchBytes<S>(const GptShape&, int, int);                                \
  template int64_t HeadScratchBytes<S>(const GptShape&, int, int);                                 \
  template void EmbeddingForward<S>(const GptShape&, const S*, const int32_t*, int, int, S*);      \
  template void EmbeddingBackward<S>(const GptShape&, const int32_t*, const S*, int, int, S*,      \
                                     void*);                                                       \
  template void LayerForward<S>(const GptShape&, const S*, const S*, S*, int, int, void*);         \
  template void LayerBackward<S>(const GptShape&, const S*, const S*, const S*, S*, S*, int, int,  \
                                 void*);                                                           \
  template ComputeType<S> HeadForward<S>(const GptShape&, const S*, const S*, const int32_t*, int, \
                                         int, S*, void*);                                          \
  template void HeadBackward<S>(const GptShape&, const S*, const S*, const int32_t*,               \
                                ComputeType<S>, int, int, S*, S*, void*);                          \
  template int64_t internal::HeadScratchBytesWithChunkRows<S>(const GptShape&, int, int, int64_t); \
  template ComputeType<S> internal::HeadForwardWithChunkRows<S>(                                   \
      const GptShape&, const S*, const S*, const int32_t*, int, int, S*, void*, int64_t);          \
  template void internal::HeadBackwardWithChunkRows<S>(const GptShape&, const S*, const S*,        \
                                                       const int32_t*, ComputeType<S>, int, int,   \
                                                       S*, S*, void*, int64_t);

STRATA_INSTANTIATE_GPT_KERNELS(float)
STRATA_INSTANTIATE_GPT_KERNELS(double)
STRATA_INSTANTIATE_GPT_KERNELS(Bf16)
STRATA_INSTANTIATE_GPT_KERNELS(Fp16)

#undef STRATA_INSTANTIATE_GPT_KERNELS

}  // namespace strata::models
