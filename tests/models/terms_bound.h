// The one element-by-element bound the model and op tests hold a result in S (or the CUDA run) to
// against the double reference (tests/models/ops/op_test_util.h and llama_op_test_util.h wrap
// it; tests/models/gpt_cuda_test.cc and llama_cuda_test.cc use it).
//
// Derivation. A sum of n terms computed in floating point with unit roundoff u satisfies
//     |fl(x_1 + ... + x_n) - (x_1 + ... + x_n)| <= gamma_{n-1} (|x_1| + ... + |x_n|),
// gamma_n = n u / (1 - n u) (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
// 2002, section 3.1, eq. 3.5); a product adds u |x y|. The error is relative to the magnitude of
// the TERMS, not of the result: where the terms cancel, the result is small (a gradient that is
// zero in exact arithmetic: the attention's key bias, or q and k with a single key, where
// dS = P (dP - rowsum(P dP)) = 1 (dP - dP)) but its rounding error is not. Through a chain of
// such sums the first-order error of an output is bounded the same way with every term replaced
// by the magnitude of its own terms (running error analysis, Higham section 3.3). So an output
// element i that passes through R roundings to S and fp32 sums of at most K terms is held to
//     |got_i - ref_i| <= k eps (|ref_i| + rms(ref) + terms_i),   eps = u + K 2^-24,  k = 2 R,
// where terms_i >= 0 is the magnitude of the terms that cancel in element i: the same computation
// evaluated with absolute values (for a weight gradient X^T dY: (|X|^T |dY|)_i, with |dY| itself
// the magnitude of dY's terms where dY is a cancelling sum), or 0 where nothing cancels and the
// rms term covers the scale. The rms(ref) term stays: it covers the ordinary case where a result
// of a well-conditioned sum is near zero by chance, and keeps every bound positive when the
// tensor is not zero.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace strata::models::terms_bound {

inline double Rms(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x * x;
  return v.empty() ? 0 : std::sqrt(sum / static_cast<double>(v.size()));
}

// The bound of element i (see the top of the file); terms empty means zeros.
inline double BoundOf(size_t i, const std::vector<double>& ref, const std::vector<double>& terms,
                      double rms, double k, double eps) {
  const double t = terms.empty() ? 0.0 : terms[i];
  return k * eps * (std::abs(ref[i]) + rms + t);
}

// |got_i - ref_i| <= k eps (|ref_i| + rms(ref) + terms_i) for every i (terms empty: zeros, or
// the same size as ref). Reports a violation as one non-fatal gtest failure that names `what`,
// counts the elements out of bounds and lists the first five; returns the worst error over its
// bound.
inline double ExpectWithinTermsBound(const std::string& what, const std::vector<double>& got,
                                     const std::vector<double>& ref,
                                     const std::vector<double>& terms, double k, double eps) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  EXPECT_TRUE(terms.empty() || terms.size() == ref.size()) << what << ": terms of another size";
  if (!terms.empty() && terms.size() != ref.size()) return 0;
  const double rms = Rms(ref);
  double worst = 0;
  int64_t failures = 0;
  std::ostringstream first;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double bound = BoundOf(i, ref, terms, rms, k, eps);
    const double err = std::abs(got[i] - ref[i]);
    if (bound > 0) worst = std::max(worst, err / bound);
    if (!(err <= bound) && ++failures <= 5) {
      first << "\n  [" << i << "]: got " << got[i] << " reference " << ref[i] << " error " << err
            << " bound " << bound << " (terms " << (terms.empty() ? 0.0 : terms[i]) << ")";
    }
  }
  if (failures > 0) {
    ADD_FAILURE() << what << ": " << failures << " of " << ref.size()
                  << " elements out of bounds; the first:" << first.str();
  }
  ::testing::Test::RecordProperty("worst_error_over_bound " + what, std::to_string(worst));
  return worst;
}

// (M, N) row-major = |A|^T |B| for A (K, M) and B (K, N) row-major: the terms of the weight
// gradient A^T B (the sum over the K rows), each product taken in absolute value.
inline std::vector<double> AbsTransposedProduct(const std::vector<double>& a,
                                                const std::vector<double>& b, int64_t K, int64_t M,
                                                int64_t N) {
  std::vector<double> out(static_cast<size_t>(M * N), 0.0);
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t m = 0; m < M; ++m) {
      const double x = std::abs(a[r * M + m]);
      for (int64_t n = 0; n < N; ++n) out[m * N + n] += x * std::abs(b[r * N + n]);
    }
  }
  return out;
}

// The magnitude of the terms that cancel in the attention backward's dq and dk (the softmax
// backward dS = P (dP - D), D = sum_s P_ts dP_ts), per (sequence, head, query t, key s):
//   T_dP(t, s) = sum_j |dO_tj v_sj|,  T_dS(t, s) = P_ts (T_dP(t, s) + sum_s' P_ts' T_dP(t, s')),
//   dq_t += scale T_dS |k_s|,  dk_s += scale T_dS |q_t|   (scale = 1 / sqrt(hs)).
// qkv: (B T) rows of row_stride, q heads at column 0, k and v heads (Hkv of them, query head h
// reads h / (H / Hkv)) at k_off and v_off; dout (B T, H hs); lse (B, H, T), all in double.
// Returns (B T, row_stride): the magnitudes in the q and k columns, zero elsewhere.
inline std::vector<double> AttentionBackwardTerms(int B, int T, int H, int Hkv, int hs,
                                                  int64_t row_stride, int64_t k_off, int64_t v_off,
                                                  const std::vector<double>& qkv,
                                                  const std::vector<double>& dout,
                                                  const std::vector<double>& lse) {
  std::vector<double> mag(static_cast<size_t>(int64_t{B} * T * row_stride), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  const int64_t ldo = int64_t{H} * hs;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / Hkv);
      for (int64_t t = 0; t < T; ++t) {
        const double* q = qkv.data() + (b * T + t) * row_stride + h * hs;
        const double* go = dout.data() + (b * T + t) * ldo + h * hs;
        std::vector<double> p(t + 1), dp_terms(t + 1, 0.0);
        double d_terms = 0;
        for (int64_t s = 0; s <= t; ++s) {
          const double* k = qkv.data() + (b * T + s) * row_stride + k_off + kvh * hs;
          const double* v = qkv.data() + (b * T + s) * row_stride + v_off + kvh * hs;
          double score = 0;
          for (int64_t j = 0; j < hs; ++j) {
            score += q[j] * k[j];
            dp_terms[s] += std::abs(go[j] * v[j]);
          }
          p[s] = std::exp(score * scale - lse[(b * H + h) * T + t]);
          d_terms += p[s] * dp_terms[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          const double ds_terms = p[s] * (dp_terms[s] + d_terms);
          const double* k = qkv.data() + (b * T + s) * row_stride + k_off + kvh * hs;
          double* mq = mag.data() + (b * T + t) * row_stride + h * hs;
          double* mk = mag.data() + (b * T + s) * row_stride + k_off + kvh * hs;
          for (int64_t j = 0; j < hs; ++j) {
            mq[j] += scale * ds_terms * std::abs(k[j]);
            mk[j] += scale * ds_terms * std::abs(q[j]);
          }
        }
      }
    }
  }
  return mag;
}

}  // namespace strata::models::terms_bound
