#include "models/ops/gelu.h"

#include "models/ops/gelu_tanh.h"
#include "models/ops/parallel.h"
#include "models/ops/product.h"

namespace strata::models::ops {
namespace {

// pre = S(acc + bias), out = S(gelu(acc + bias)) from the unrounded sum (GELU_AUX).
template <typename S>
struct BiasGeluEpilogue {
  const S* bias;  // nullable
  S* pre;         // (M, N)
  int64_t N;
  void operator()(int64_t r, const ComputeType<S>* acc, S* out) const {
    for (int64_t c = 0; c < N; c += kVec) {
      const int64_t len = std::min<int64_t>(kVec, N - c);
      Vec<ComputeType<S>> v = LoadVec(acc + c, len);
      if (bias != nullptr) v += LoadVec(bias + c, len);
      StoreVec<S>(v, len, pre + r * N + c);
      StoreVec<S>(GeluTanh(v), len, out + c);
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
      const Vec<ComputeType<S>> g =
          LoadVec(acc + c, len) * GeluTanhGrad(LoadVec(pre + r * N + c, len));
      StoreVec<S>(g, len, out + c);
    }
  }
};

}  // namespace

template <typename S>
void GeluForward(const S* h, int64_t n, S* g) {
  // Whole kVec groups per task, so every group is the same vector computation.
  const int64_t groups = CeilDiv(n, kVec);
  ParallelRows(groups, kVec, [&](int64_t g0, int64_t g1) {
    for (int64_t i = g0 * kVec; i < std::min(n, g1 * kVec); i += kVec) {
      const int64_t len = std::min<int64_t>(kVec, n - i);
      StoreVec<S>(GeluTanh(LoadVec(h + i, len)), len, g + i);
    }
  });
}

template <typename S>
void GeluBackward(const S* h, const S* dg, int64_t n, S* dh) {
  const int64_t groups = CeilDiv(n, kVec);
  ParallelRows(groups, kVec, [&](int64_t g0, int64_t g1) {
    for (int64_t i = g0 * kVec; i < std::min(n, g1 * kVec); i += kVec) {
      const int64_t len = std::min<int64_t>(kVec, n - i);
      StoreVec<S>(LoadVec(dg + i, len) * GeluTanhGrad(LoadVec(h + i, len)), len, dh + i);
    }
  });
}

template <typename S>
void MatmulGeluForward(const S* in, const S* w, WeightLayout layout, const S* bias, S* pre, S* g,
                       int64_t rows, int64_t in_dim, int64_t out_dim) {
  LinearProduct(in, w, layout == WeightLayout::kOutIn, g, rows, in_dim, out_dim,
                BiasGeluEpilogue<S>{bias, pre, out_dim});
}

template <typename S>
void MatmulGeluBackward(const S* in, const S* w, WeightLayout layout, const S* dout, const S* pre,
                        S* dpre, S* dw, S* db, int64_t rows, int64_t in_dim, int64_t out_dim) {
  MatmulBackward<S>(in, w, layout, dout, nullptr, dw, db, rows, in_dim, out_dim);
  LinearInputGradProduct(dout, w, layout == WeightLayout::kOutIn, dpre, rows, in_dim, out_dim,
                         GeluGradEpilogue<S>{pre, in_dim});
}

#define STRATA_INSTANTIATE_GELU(S)                                                                \
  template void GeluForward<S>(const S*, int64_t, S*);                                            \
  template void GeluBackward<S>(const S*, const S*, int64_t, S*);                                 \
  template void MatmulGeluForward<S>(const S*, const S*, WeightLayout, const S*, S*, S*, int64_t, \
                                     int64_t, int64_t);                                           \
  template void MatmulGeluBackward<S>(const S*, const S*, WeightLayout, const S*, const S*, S*,   \
                                      S*, S*, int64_t, int64_t, int64_t);

STRATA_INSTANTIATE_GELU(float)
STRATA_INSTANTIATE_GELU(double)
STRATA_INSTANTIATE_GELU(Bf16)
STRATA_INSTANTIATE_GELU(Fp16)

#undef STRATA_INSTANTIATE_GELU

}  // namespace strata::models::ops
