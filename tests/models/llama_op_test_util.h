// Test helpers shared by the tests of the Llama ops and blocks (rms_norm, rope, swiglu,
// llama_kernels): random data, casts between S and double, and the element-by-element
// comparison of an S result with the double reference under the error model of
// tests/models/gpt_kernels_test.cc ("Error model"): one output element may be off by
//     k * (u + K 2^-24) * (|ref| + rms(ref)),
// u the unit roundoff of S, K the longest fp32 sum on the path, k the number of roundings on the
// path times a gain margin.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "tests/models/terms_bound.h"

namespace strata::models::op_test {

template <typename S>
constexpr double kUnitRoundoff = std::is_same_v<S, Bf16>    ? 0x1p-8
                                 : std::is_same_v<S, Fp16>  ? 0x1p-11
                                 : std::is_same_v<S, float> ? 0x1p-24
                                                            : 0x1p-53;

// u + K 2^-24 for S (the fp32 accumulation error of a K-term sum; none for double beyond u).
template <typename S>
double Eps(double K) {
  return kUnitRoundoff<S> + (std::is_same_v<S, double> ? K * 0x1p-53 : K * 0x1p-24);
}

// One rounding of v to S (through fp32 for the 16-bit types).
template <typename S>
S FromDouble(double v) {
  if constexpr (std::is_same_v<S, double>) {
    return v;
  } else {
    return FromFloat<S>(static_cast<float>(v));
  }
}

template <typename S>
std::vector<S> Cast(const std::vector<double>& v) {
  std::vector<S> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FromDouble<S>(v[i]);
  return out;
}

template <typename S>
std::vector<double> ToDoubles(const std::vector<S>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(ToFloat(v[i]));
  return out;
}

// The values v takes once stored as S, in double: the reference's inputs for an S run.
template <typename S>
std::vector<double> Rounded(const std::vector<double>& v) {
  return ToDoubles(Cast<S>(v));
}

inline std::vector<double> RandomValues(size_t n, double amplitude, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-amplitude, amplitude);
  std::vector<double> v(n);
  for (double& x : v) x = u(gen);
  return v;
}

// n values of S with all bits set (NaN in every storage type).
template <typename S>
std::vector<S> Poisoned(size_t n) {
  std::vector<S> v(n);
  if (n > 0) std::memset(v.data(), 0xff, n * sizeof(S));  // data() may be null when empty
  return v;
}

using terms_bound::Rms;

// Element by element: |got - ref| <= k eps (|ref| + rms(ref)) (terms_bound.h with no cancelling
// terms). Returns the worst ratio.
inline double ExpectWithinBound(const std::string& what, const std::vector<double>& got,
                                const std::vector<double>& ref, double k, double eps) {
  return terms_bound::ExpectWithinTermsBound(what, got, ref, {}, k, eps);
}

// Scratch of `size_bytes` (64-byte aligned) poisoned with all-ones bytes (NaN in every storage
// type) before each call, followed by a guard region that must stay untouched.
class GuardedScratch {
 public:
  static constexpr size_t kGuardBytes = 64;
  static constexpr unsigned char kGuardByte = 0xa5;

  explicit GuardedScratch(int64_t size_bytes)
      : size_bytes_(static_cast<size_t>(size_bytes)), bytes_(size_bytes_ + kGuardBytes + 64) {}

  void* Poisoned() {
    unsigned char* p = Base();
    std::memset(p, 0xff, size_bytes_);
    std::memset(p + size_bytes_, kGuardByte, kGuardBytes);
    return p;
  }
  void CheckGuard(const std::string& what) {
    const unsigned char* p = Base();
    for (size_t i = 0; i < kGuardBytes; ++i) {
      ASSERT_EQ(p[size_bytes_ + i], kGuardByte) << what << " wrote past its scratch size";
    }
  }

 private:
  unsigned char* Base() {
    const uintptr_t a = reinterpret_cast<uintptr_t>(bytes_.data());
    return bytes_.data() + ((64 - a % 64) % 64);
  }
  size_t size_bytes_;
  std::vector<unsigned char> bytes_;
};

// |a - b| <= atol + rtol max(|a|, |b|).
inline bool Close(double a, double b, double atol, double rtol) {
  return std::abs(a - b) <= atol + rtol * std::max(std::abs(a), std::abs(b));
}

// GeGLU (models/ops/swiglu.h, GatedActivation::kGeluTanh) on gate_up (rows, 2I) and dh (rows, I):
// the magnitude of the terms that cancel in each output (terms_bound.h), from the formula
// gelu(g) = 0.5 g (1 + th), gelu'(g) = 0.5 (1 + th) + 0.5 g (1 - th^2) s (1 + 3 c g^2), th =
// tanh(s (g + c g^3)): 1 + th and 1 - th^2 cancel for negative gates, so an fp32 tanh's absolute
// error (a few ulp of 1, more where a fast tanh saturates early) reaches h and the gradients
// scaled by these terms, not by their (tiny) values. h_terms (rows, I) = |u| 0.5 |g| (1 + |th|);
// dgate_up_terms (rows, 2I) = [|dh u| (0.5 (1 + |th|) + 0.5 |g| (1 + th^2) s (1 + 3 c g^2)) |
// |dh| 0.5 |g| (1 + |th|)].
struct GegluTerms {
  std::vector<double> h, dgate_up;
};
inline GegluTerms GegluTermsOf(const std::vector<double>& gate_up, const std::vector<double>& dh,
                               int64_t rows, int64_t I) {
  constexpr double kS = 0.7978845608028654, kC = 0.044715;
  GegluTerms t{std::vector<double>(rows * I), std::vector<double>(rows * 2 * I)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      const double g = gate_up[r * 2 * I + c], u = gate_up[r * 2 * I + I + c];
      const double d = dh[r * I + c];
      const double th = std::tanh(kS * (g + kC * g * g * g));
      const double gelu_terms = 0.5 * std::abs(g) * (1 + std::abs(th));
      const double grad_terms =
          0.5 * (1 + std::abs(th)) + 0.5 * std::abs(g) * (1 + th * th) * kS * (1 + 3 * kC * g * g);
      t.h[r * I + c] = std::abs(u) * gelu_terms;
      t.dgate_up[r * 2 * I + c] = std::abs(d * u) * grad_terms;
      t.dgate_up[r * 2 * I + I + c] = std::abs(d) * gelu_terms;
    }
  }
  return t;
}

// GeGLU where the fp32 tanh saturates (|g| >= 8: |sqrt(2/pi) (g + 0.044715 g^3)| > 24, tanh
// within 1e-21 of +-1, so +-1 exactly in fp32): the terms bound above grows like g^3 there and
// says little, but the results are exact: gelu(g) = g or -0, gelu'(g) = 1 or 0, so h = S(g u),
// dgate = S(dh u), dup = S(dh g) for g >= 8 and all three zero for g <= -8 (the products of two S
// values, exact in fp32 for the 16-bit types and rounded once in fp32 for float, as S(double
// product)). h (rows, I) and dgate_up (rows, 2I) the results as doubles. Returns the number of
// saturated gates checked.
template <typename S>
int64_t ExpectSaturatedGegluIsExact(const std::string& what, const std::vector<double>& gate_up,
                                    const std::vector<double>& dh, int64_t rows, int64_t I,
                                    const std::vector<double>& h,
                                    const std::vector<double>& dgate_up) {
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      const double g = gate_up[r * 2 * I + c], u = gate_up[r * 2 * I + I + c];
      const double d = dh[r * I + c];
      if (std::abs(g) < 8) continue;
      ++checked;
      const bool pos = g > 0;
      const auto s = [](double v) { return static_cast<double>(ToFloat(FromDouble<S>(v))); };
      EXPECT_EQ(h[r * I + c], pos ? s(g * u) : 0.0) << what << " h " << r << " " << c << " g=" << g;
      EXPECT_EQ(dgate_up[r * 2 * I + c], pos ? s(d * u) : 0.0)
          << what << " dgate " << r << " " << c << " g=" << g;
      EXPECT_EQ(dgate_up[r * 2 * I + I + c], pos ? s(d * g) : 0.0)
          << what << " dup " << r << " " << c << " g=" << g;
    }
  }
  return checked;
}

}  // namespace strata::models::op_test
