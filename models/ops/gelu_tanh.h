// Internal to models/ops/: the tanh-approximated GELU (Hendrycks & Gimpel, "Gaussian Error Linear
// Units (GELUs)", 2016) and its derivative on the fixed-width vector path of parallel.h, shared by
// the GELU op and its product epilogues (gelu.cc) and the GeGLU gate (swiglu.cc), so both compute
// gelu and gelu' with the same code, element for element. Header-only.
#pragma once

#include "models/ops/parallel.h"

namespace strata::models::ops {

template <typename F>
inline constexpr F kGeluScale = F(0.7978845608028654);  // sqrt(2 / pi)
template <typename F>
inline constexpr F kGeluCubic = F(0.044715);

// gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), in F = ComputeType<S>.
template <typename F>
Vec<F> GeluTanh(const Vec<F>& v) {
  const Vec<F> u = kGeluScale<F> * (v + kGeluCubic<F> * v * v * v);
  return F(0.5) * v * (F(1) + u.tanh());
}

// gelu'(v) = 0.5 (1 + th) + 0.5 v (1 - th^2) sqrt(2/pi) (1 + 3 0.044715 v^2), th the tanh above.
template <typename F>
Vec<F> GeluTanhGrad(const Vec<F>& v) {
  const Vec<F> v2 = v * v;
  const Vec<F> th = (kGeluScale<F> * (v + kGeluCubic<F> * v2 * v)).tanh();
  const Vec<F> du = kGeluScale<F> * (F(1) + F(3) * kGeluCubic<F> * v2);
  return F(0.5) * (F(1) + th) + F(0.5) * v * (F(1) - th * th) * du;
}

}  // namespace strata::models::ops
