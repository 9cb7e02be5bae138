// Test helpers of the host op tests (tests/models/ops/*_test.cc): random data, storage-type
// conversions, and the element-by-element bound every op test holds an S result to.
//
// Error model (as tests/models/gpt_kernels_test.cc states it for whole blocks): each rounding
// to S of a value v adds at most u |v| (u = 2^-8 bf16, 2^-11 fp16, 2^-24 fp32, 0 for the double
// instantiation itself); an fp32 sum of K terms adds at most about K 2^-24 times the magnitude
// of the result's scale. So an output element that passes through R roundings and fp32 sums of
// at most K terms is held to
//     |got - ref| <= k (u + K 2^-24) (|ref| + rms(ref)),   k = 2 R (a gain margin of 2),
// against the double instantiation of the same op on the same S-rounded inputs.
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

namespace strata::models::ops::testing {

template <typename S>
constexpr double kUnitRoundoff = std::is_same_v<S, Bf16>    ? 0x1p-8
                                 : std::is_same_v<S, Fp16>  ? 0x1p-11
                                 : std::is_same_v<S, float> ? 0x1p-24
                                                            : 0.0;

// eps of the bound above for an output whose fp32 sums have at most K terms.
template <typename S>
double BoundEps(int64_t K) {
  return kUnitRoundoff<S> + (std::is_same_v<S, double> ? 0.0 : static_cast<double>(K) * 0x1p-24);
}

// n values uniform in [-scale, scale].
inline std::vector<double> RandomDoubles(int64_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = u(gen);
  return v;
}

inline std::vector<int32_t> RandomTokens(int64_t n, int vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& t : v) t = d(gen);
  return v;
}

// A double stored as S: one rounding (through fp32 for the 16-bit types).
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
std::vector<double> ToDoubles(const S* v, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(ToFloat(v[i]));
  return out;
}
template <typename S>
std::vector<double> ToDoubles(const std::vector<S>& v) {
  return ToDoubles(v.data(), v.size());
}

// The values an S tensor holds, as doubles: the inputs of the double reference.
template <typename S>
std::vector<double> Rounded(const std::vector<double>& v) {
  return ToDoubles(Cast<S>(v));
}

// n elements with every byte 0xff (NaN in every storage type): an output the op should not write
// stays recognisable.
template <typename S>
std::vector<S> Poisoned(size_t n) {
  std::vector<S> v(n);
  std::memset(v.data(), 0xff, n * sizeof(S));
  return v;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename S>
bool AllPoisoned(const S* v, size_t n) {
  std::vector<unsigned char> bytes(n * sizeof(S));
  std::memcpy(bytes.data(), v, bytes.size());
  return std::all_of(bytes.begin(), bytes.end(), [](unsigned char b) { return b == 0xff; });
}

using terms_bound::Rms;

// |got - ref| <= k eps (|ref| + rms(ref)) element by element (terms_bound.h with no cancelling
// terms; an all-zero reference demands exact zeros); returns the worst error over its bound.
inline double ExpectWithinBound(const std::string& what, const std::vector<double>& got,
                                const std::vector<double>& ref, double k, double eps) {
  return terms_bound::ExpectWithinTermsBound(what, got, ref, {}, k, eps);
}

// The double instantiation against a plain scalar reference written in the test: equal up to
// double rounding (different summation orders), relative to the tensor's scale.
inline void ExpectNearReference(const std::string& what, const std::vector<double>& got,
                                const std::vector<double>& ref) {
  ExpectWithinBound(what + " (double vs scalar reference)", got, ref, 1.0, 1e-12);
}

}  // namespace strata::models::ops::testing
