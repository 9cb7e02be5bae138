#include "models/ops/cross_entropy.h"

#include <cmath>
#include <string>
#include <type_traits>

#include "engine/plan/model.h"
#include "models/ops/parallel.h"
#include "models/ops/product.h"

namespace strata::models::ops {
namespace {

template <typename S>
struct LmHeadScratch {
  ComputeType<S>* losses;  // (N)
  S* chunk;                // (chunk_rows, V) logits, then their gradients
  float* dw_acc;           // C V fp32 for 16-bit S; null for float and double
  int64_t chunk_rows;
  int64_t size_bytes;
};

template <typename S>
LmHeadScratch<S> CarveLmHeadScratch(int B, int T, int C, int V, int64_t chunk_rows, void* scratch) {
  using F = ComputeType<S>;
  STRATA_CHECK_MSG(B >= 1 && T >= 1 && C >= 1 && V >= 1,
                   "B=" + std::to_string(B) + " T=" + std::to_string(T) +
                       " C=" + std::to_string(C) + " V=" + std::to_string(V));
  const int64_t N = int64_t{B} * T;
  if (chunk_rows == 0) chunk_rows = HeadChunkRows(N, V);
  STRATA_CHECK_MSG(chunk_rows >= 1 && chunk_rows <= N,
                   "chunk_rows=" + std::to_string(chunk_rows) + " N=" + std::to_string(N));
  Carver c(scratch);
  LmHeadScratch<S> sc;
  sc.losses = c.Take<F>(N);
  sc.chunk = c.Take<S>(chunk_rows * V);
  sc.dw_acc = std::is_same_v<S, F> ? nullptr : c.Take<float>(int64_t{C} * V);
  sc.chunk_rows = chunk_rows;
  sc.size_bytes = c.size_bytes();
  return sc;
}

// The logits of rows x[r0, r0 + rows): chunk (rows, V) = S(x W).
template <typename S>
void ChunkLogits(const S* x, const S* w, bool out_in, int64_t C, int64_t V, int64_t r0,
                 int64_t rows, S* chunk) {
  LinearProduct(x + r0 * C, w, out_in, chunk, rows, C, V, PlainEpilogue{});
}

// A soft-capped logit: the S logit l as ComputeType, u = tanh(l / c), the capped S(c u).
template <typename S>
struct Capped {
  ComputeType<S> value;  // ToFloat(S(c u))
  ComputeType<S> u;
};
template <typename S>
Capped<S> CapLogit(S l, ComputeType<S> c) {
  const ComputeType<S> u = std::tanh(ToFloat(l) / c);
  return {ToFloat(FromFloat<S>(c * u)), u};
}

// Rows x (rows, V) of S logits replaced by their soft-capped values S(c tanh(l / c)).
template <typename S>
void CapRows(S* x, int64_t rows, int64_t V, ComputeType<S> c) {
  ParallelRows(rows, V, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0 * V; i < i1 * V; ++i) x[i] = FromFloat<S>(CapLogit(x[i], c).value);
  });
}

using engine::kIgnoreTarget;

}  // namespace

template <typename S>
int64_t LmHeadScratchBytes(int B, int T, int C, int V, int64_t chunk_rows) {
  return CarveLmHeadScratch<S>(B, T, C, V, chunk_rows, nullptr).size_bytes;
}

template <typename S>
ComputeType<S> LmHeadForward(const S* x, const S* w, WeightLayout layout, const int32_t* targets,
                             int B, int T, int C, int V, S* last_logits, void* scratch,
                             int64_t chunk_rows, int64_t loss_tokens, double softcap,
                             float* row_losses) {
  using F = ComputeType<S>;
  STRATA_CHECK_MSG(std::isfinite(softcap) && softcap >= 0,
                   "LM head softcap=" + std::to_string(softcap));
  const F cap = static_cast<F>(softcap);
  const LmHeadScratch<S> sc = CarveLmHeadScratch<S>(B, T, C, V, chunk_rows, scratch);
  const bool out_in = layout == WeightLayout::kOutIn;
  const int64_t N = int64_t{B} * T;
  // The last position of each sequence: rows T-1, 2T-1, ... of x (row stride T C).
  Product(false, out_in, B, V, C, x + int64_t{T - 1} * C, int64_t{T} * C, w,
          out_in ? int64_t{C} : int64_t{V}, last_logits);
  if (cap > 0) CapRows(last_logits, B, V, cap);
  if (targets == nullptr) return F(0);
  for (int64_t r0 = 0; r0 < N; r0 += sc.chunk_rows) {
    const int64_t rows = std::min(sc.chunk_rows, N - r0);
    ChunkLogits(x, w, out_in, C, V, r0, rows, sc.chunk);
    if (cap > 0) CapRows(sc.chunk, rows, V, cap);
    ParallelRows(rows, V, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = r0 + i;
        if (targets[r] == kIgnoreTarget) {
          sc.losses[r] = 0;
        } else {
          CheckToken(targets[r], V);
          const S* row = sc.chunk + i * V;
          const F mx = MaxOf(row, V);
          sc.losses[r] = std::log(SumExpShifted(row, V, mx)) + mx - ToFloat(row[targets[r]]);
        }
        if (row_losses != nullptr) row_losses[r] = static_cast<float>(sc.losses[r]);
      }
    });
  }
  double total = 0;  // in token order, in double whatever S is
  for (int64_t r = 0; r < N; ++r) total += sc.losses[r];
  const int64_t divisor = loss_tokens > 0 ? loss_tokens : N;
  return static_cast<F>(total / static_cast<double>(divisor));
}

template <typename S>
void LmHeadBackward(const S* x, const S* w, WeightLayout layout, const int32_t* targets,
                    ComputeType<S> dloss, int B, int T, int C, int V, S* dx, S* dw, void* scratch,
                    int64_t chunk_rows, int64_t loss_tokens, double softcap,
                    const float* row_weights) {
  using F = ComputeType<S>;
  STRATA_CHECK(targets != nullptr);
  STRATA_CHECK_MSG(std::isfinite(softcap) && softcap >= 0,
                   "LM head softcap=" + std::to_string(softcap));
  const F cap = static_cast<F>(softcap);
  const LmHeadScratch<S> sc = CarveLmHeadScratch<S>(B, T, C, V, chunk_rows, scratch);
  const bool out_in = layout == WeightLayout::kOutIn;
  const int64_t N = int64_t{B} * T;
  F* acc;
  if constexpr (std::is_same_v<S, F>) {
    acc = dw;
  } else {
    acc = sc.dw_acc;
  }
  // The mean's scale, or with row weights each row's own (loss_tokens unread).
  const F mean_scale = dloss / F(loss_tokens > 0 ? loss_tokens : N);
  for (int64_t r0 = 0; r0 < N; r0 += sc.chunk_rows) {
    const int64_t rows = std::min(sc.chunk_rows, N - r0);
    ChunkLogits(x, w, out_in, C, V, r0, rows, sc.chunk);
    // dlogits = S(scale * (softmax(logits) - onehot(target))), in place; scale = dloss / N, or
    // dloss w_t with row weights.
    ParallelRows(rows, V, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t target = targets[r0 + i];
        const F scale =
            row_weights == nullptr ? mean_scale : dloss * static_cast<F>(row_weights[r0 + i]);
        S* row = sc.chunk + i * V;
        if (target == kIgnoreTarget) {
          std::fill(row, row + V, FromFloat<S>(F(0)));
          continue;
        }
        CheckToken(static_cast<int32_t>(target), V);
        if (cap > 0) {
          // Capped: the softmax of the capped logits, each dlogit times 1 - u^2 (u from the
          // S logit still in the row).
          F mx = CapLogit(row[0], cap).value;
          for (int64_t v = 1; v < V; ++v) mx = std::max(mx, CapLogit(row[v], cap).value);
          F sum = 0;
          for (int64_t v = 0; v < V; ++v) sum += std::exp(CapLogit(row[v], cap).value - mx);
          const F factor = scale / sum;
          for (int64_t v = 0; v < V; ++v) {
            const Capped<S> l = CapLogit(row[v], cap);
            F d = std::exp(l.value - mx) * factor;
            if (v == target) d -= scale;
            row[v] = FromFloat<S>(d * (F(1) - l.u * l.u));
          }
          continue;
        }
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
    // acc (+)= the chunk's weight gradient (beta 0 on the first chunk), in chunk order:
    // x_chunk^T dlogits (C, V), or dlogits^T x_chunk (V, C) for the (V, C) layout.
    const F beta = r0 == 0 ? F(0) : F(1);
    if (dw == nullptr) {
      // No weight gradient (a frozen head weight).
    } else if (out_in) {
      AccumulateProduct<S>(true, false, V, C, rows, sc.chunk, V, x + r0 * C, C, beta, acc);
    } else {
      AccumulateProduct<S>(true, false, C, V, rows, x + r0 * C, C, sc.chunk, V, beta, acc);
    }
    // dx rows = S(dlogits W^T).
    LinearInputGradProduct(sc.chunk, w, out_in, dx + r0 * C, rows, C, V, PlainEpilogue{});
  }
  if constexpr (!std::is_same_v<S, F>) {
    if (dw == nullptr) return;
    const int64_t n = int64_t{C} * V;
    ParallelRows(C, V, [&](int64_t c0, int64_t c1) {
      for (int64_t i = c0 * V; i < std::min(n, c1 * V); ++i) dw[i] = FromFloat<S>(acc[i]);
    });
  }
}

#define STRATA_INSTANTIATE_LM_HEAD(S)                                                             \
  template int64_t LmHeadScratchBytes<S>(int, int, int, int, int64_t);                            \
  template ComputeType<S> LmHeadForward<S>(const S*, const S*, WeightLayout, const int32_t*, int, \
                                           int, int, int, S*, void*, int64_t, int64_t, double,    \
                                           float*);                                               \
  template void LmHeadBackward<S>(const S*, const S*, WeightLayout, const int32_t*,               \
                                  ComputeType<S>, int, int, int, int, S*, S*, void*, int64_t,     \
                                  int64_t, double, const float*);

STRATA_INSTANTIATE_LM_HEAD(float)
STRATA_INSTANTIATE_LM_HEAD(double)
STRATA_INSTANTIATE_LM_HEAD(Bf16)
STRATA_INSTANTIATE_LM_HEAD(Fp16)

#undef STRATA_INSTANTIATE_LM_HEAD

}  // namespace strata::models::ops
