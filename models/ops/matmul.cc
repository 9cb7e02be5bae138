#include "models/ops/matmul.h"

#include <algorithm>
#include <type_traits>

#include "models/ops/parallel.h"
#include "models/ops/product.h"

namespace strata::models::ops {

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

template <typename S>
void MatmulForward(const S* in, const S* w, WeightLayout layout, const S* bias, S* out,
                   int64_t rows, int64_t in_dim, int64_t out_dim, const S* residual) {
  using F = ComputeType<S>;
  const bool out_in = layout == WeightLayout::kOutIn;
  if constexpr (std::is_same_v<S, F>) {
    // For float and double the product is computed in place in out (product.h), which would
    // overwrite an aliasing residual before the epilogue reads it: read a copy instead, so the
    // result is the non-aliased one bit for bit.
    if (residual != nullptr && residual == out) {
      WorkLease<F> work;
      F* copy = work.Get(0, rows * out_dim);
      std::copy(residual, residual + rows * out_dim, copy);
      LinearProduct(in, w, out_in, out, rows, in_dim, out_dim,
                    BiasEpilogue<S>{bias, copy, out_dim});
      return;
    }
  }
  if (bias == nullptr && residual == nullptr) {
    LinearProduct(in, w, out_in, out, rows, in_dim, out_dim, PlainEpilogue{});
  } else {
    LinearProduct(in, w, out_in, out, rows, in_dim, out_dim,
                  BiasEpilogue<S>{bias, residual, out_dim});
  }
}

template <typename S>
void MatmulBackward(const S* in, const S* w, WeightLayout layout, const S* dout, S* din, S* dw,
                    S* db, int64_t rows, int64_t in_dim, int64_t out_dim) {
  const bool out_in = layout == WeightLayout::kOutIn;
  if (dw != nullptr) {
    if (out_in) {  // dW (out_dim, in_dim) = dout^T in
      Product(true, false, out_dim, in_dim, rows, dout, out_dim, in, in_dim, dw);
    } else {  // dW (in_dim, out_dim) = in^T dout
      Product(true, false, in_dim, out_dim, rows, in, in_dim, dout, out_dim, dw);
    }
  }
  if (db != nullptr) ColumnSums(dout, rows, out_dim, db);
  if (din != nullptr) {
    LinearInputGradProduct(dout, w, out_in, din, rows, in_dim, out_dim, PlainEpilogue{});
  }
}

#define STRATA_INSTANTIATE_MATMUL(S)                                                               \
  template void MatmulForward<S>(const S*, const S*, WeightLayout, const S*, S*, int64_t, int64_t, \
                                 int64_t, const S*);                                               \
  template void MatmulBackward<S>(const S*, const S*, WeightLayout, const S*, S*, S*, S*, int64_t, \
                                  int64_t, int64_t);                                               \
  template void ColumnSums<S>(const S*, int64_t, int64_t, S*);

STRATA_INSTANTIATE_MATMUL(float)
STRATA_INSTANTIATE_MATMUL(double)
STRATA_INSTANTIATE_MATMUL(Bf16)
STRATA_INSTANTIATE_MATMUL(Fp16)

#undef STRATA_INSTANTIATE_MATMUL

}  // namespace strata::models::ops
