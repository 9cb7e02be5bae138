// Internal to models/: the host matrix product with an fp32 (double for the reference) result
// and one rounding to the storage type S through an epilogue — the building block of matmul.cc,
// the GELU fusions (gelu.cc) and the LM head (cross_entropy.cc). Header-only.
//
// 16-bit operands are widened to fp32 first (exact) into per-thread buffers; the product runs
// through gpu::host::Gemm<ComputeType<S>> (deterministic: tiling a function of the shape only).
#pragma once

#include <cstdint>
#include <type_traits>

#include "base/dtype.h"
#include "gpu/host/host_gemm.h"
#include "models/ops/parallel.h"

namespace strata::models::ops {

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

// out (M, N) (row stride N) = epilogue of op(A) op(B) (see gpu::host::Gemm for op and the
// strides). The fp32 result goes through epi(row, acc_row, out_row) once, which adds what it
// adds to the fp32 value and rounds once. For S = float or double the result is computed in
// place in out (acc_row == out_row: an epilogue reads each element before it writes it).
template <typename S, typename Epi>
void Product(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
             const S* B, int64_t ldb, S* out, const Epi& epi) {
  using F = ComputeType<S>;
  using gpu::host::Gemm;
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
void Product(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A, int64_t lda,
             const S* B, int64_t ldb, S* out) {
  Product(trans_a, trans_b, M, N, K, A, lda, B, ldb, out, PlainEpilogue{});
}

// acc (M, N) (row stride N) = op(A) op(B) + beta acc in the compute type (a weight gradient
// accumulated over chunks): 16-bit operands widened to fp32 (exact), the product in fp32 into
// the fp32 accumulator; for S = float or double directly.
template <typename S>
void AccumulateProduct(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const S* A,
                       int64_t lda, const S* B, int64_t ldb, ComputeType<S> beta,
                       ComputeType<S>* acc) {
  using F = ComputeType<S>;
  using gpu::host::Gemm;
  if constexpr (std::is_same_v<S, F>) {
    Gemm<F>(trans_a, trans_b, M, N, K, F(1), A, lda, B, ldb, beta, acc, N);
  } else {
    WorkLease<float> work;
    const WidenedOperands w = WidenOperands(work, trans_a, trans_b, M, N, K, A, lda, B, ldb);
    Gemm<float>(trans_a, trans_b, M, N, K, 1.0f, w.a, w.lda, w.b, w.ldb, beta, acc, N);
  }
}

// out = S(acc + bias (+ residual)): the cuBLASLt bias epilogue with beta = 1 on the residual.
// bias nullable.
template <typename S>
struct BiasEpilogue {
  const S* bias;
  const S* residual;  // (M, N) or nullptr
  int64_t N;
  void operator()(int64_t r, const ComputeType<S>* acc, S* out) const {
    const S* res = residual != nullptr ? residual + r * N : nullptr;
    for (int64_t c = 0; c < N; ++c) {
      ComputeType<S> v = acc[c];
      if (bias != nullptr) v += ToFloat(bias[c]);
      if (res != nullptr) v += ToFloat(res[c]);
      out[c] = FromFloat<S>(v);
    }
  }
};

// The product of a linear layer in layout terms: out (rows, out_dim) = epi(in W) with W stored
// (in_dim, out_dim) when !out_in, (out_dim, in_dim) when out_in.
template <typename S, typename Epi>
void LinearProduct(const S* in, const S* w, bool out_in, S* out, int64_t rows, int64_t in_dim,
                   int64_t out_dim, const Epi& epi) {
  Product(false, out_in, rows, out_dim, in_dim, in, in_dim, w, out_in ? in_dim : out_dim, out, epi);
}

// din (rows, in_dim) = epi(dout W^T), W as in LinearProduct.
template <typename S, typename Epi>
void LinearInputGradProduct(const S* dout, const S* w, bool out_in, S* din, int64_t rows,
                            int64_t in_dim, int64_t out_dim, const Epi& epi) {
  Product(false, !out_in, rows, in_dim, out_dim, dout, out_dim, w, out_in ? in_dim : out_dim, din,
          epi);
}

}  // namespace strata::models::ops
