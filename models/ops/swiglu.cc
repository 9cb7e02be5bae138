#include "models/ops/swiglu.h"

#include <algorithm>

#include "base/status.h"
#include "models/ops/gelu_tanh.h"
#include "models/ops/parallel.h"

namespace strata::models::ops {

namespace {

template <typename F>
Vec<F> Sigmoid(const Vec<F>& g) {
  return (F(1) + (-g).exp()).inverse();
}

void CheckActivation(GatedActivation act) {
  STRATA_CHECK(act == GatedActivation::kSilu || act == GatedActivation::kGeluTanh);
}

}  // namespace

template <typename S>
void SwigluForward(const S* gate_up, int64_t rows, int64_t I, S* h, GatedActivation act) {
  using F = ComputeType<S>;
  STRATA_CHECK(rows >= 0 && I >= 1);
  CheckActivation(act);
  ParallelRows(rows, 2 * I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* gate = gate_up + r * 2 * I;
      const S* up = gate + I;
      for (int64_t c = 0; c < I; c += kVec) {
        const int64_t len = std::min<int64_t>(kVec, I - c);
        const Vec<F> g = LoadVec(gate + c, len);
        if (act == GatedActivation::kSilu) {
          const Vec<F> out = g * Sigmoid(g) * LoadVec(up + c, len);
          StoreVec<S>(out, len, h + r * I + c);
        } else {
          const Vec<F> out = GeluTanh(g) * LoadVec(up + c, len);
          StoreVec<S>(out, len, h + r * I + c);
        }
      }
    }
  });
}

template <typename S>
void SwigluBackward(const S* gate_up, const S* dh, int64_t rows, int64_t I, S* dgate_up,
                    GatedActivation act) {
  using F = ComputeType<S>;
  STRATA_CHECK(rows >= 0 && I >= 1);
  CheckActivation(act);
  ParallelRows(rows, 3 * I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* gate = gate_up + r * 2 * I;
      const S* up = gate + I;
      S* dgate = dgate_up + r * 2 * I;
      S* dup = dgate + I;
      for (int64_t c = 0; c < I; c += kVec) {
        const int64_t len = std::min<int64_t>(kVec, I - c);
        const Vec<F> g = LoadVec(gate + c, len);
        const Vec<F> u = LoadVec(up + c, len);
        const Vec<F> d = LoadVec(dh + r * I + c, len);
        if (act == GatedActivation::kSilu) {
          const Vec<F> sig = Sigmoid(g);
          const Vec<F> dg = d * u * sig * (F(1) + g * (F(1) - sig));
          const Vec<F> du = d * g * sig;
          StoreVec<S>(dg, len, dgate + c);
          StoreVec<S>(du, len, dup + c);
        } else {
          const Vec<F> dg = d * u * GeluTanhGrad(g);
          const Vec<F> du = d * GeluTanh(g);
          StoreVec<S>(dg, len, dgate + c);
          StoreVec<S>(du, len, dup + c);
        }
      }
    }
  });
}

#define STRATA_INSTANTIATE_SWIGLU(S)                                               \
  template void SwigluForward<S>(const S*, int64_t, int64_t, S*, GatedActivation); \
  template void SwigluBackward<S>(const S*, const S*, int64_t, int64_t, S*, GatedActivation);
STRATA_INSTANTIATE_SWIGLU(float)
STRATA_INSTANTIATE_SWIGLU(double)
STRATA_INSTANTIATE_SWIGLU(Bf16)
STRATA_INSTANTIATE_SWIGLU(Fp16)
#undef STRATA_INSTANTIATE_SWIGLU

}  // namespace strata::models::ops
