// Random test data for cpu_optim: values that break kernels (huge, tiny, denormal,
// signed zeros, and on request inf/NaN), in every gradient dtype.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optim/adamw.h"

namespace strata::cpu_optim::testing {

// A float with random sign and mantissa and an exponent uniform in
// [min_exp, max_exp] (powers of two).
inline float RandomFloat(std::mt19937& rng, int min_exp, int max_exp) {
  std::uniform_int_distribution<int> exp_dist(min_exp, max_exp);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  const float x = std::ldexp(mant(rng), exp_dist(rng));
  return (rng() & 1u) ? -x : x;
}

inline float RandomDenormal(std::mt19937& rng) {
  const auto bits = static_cast<uint32_t>((rng() & 0x007fffffu) | 1u | (rng() & 0x80000000u));
  return std::bit_cast<float>(bits);
}

enum class Mix {
  // Finite values whose squares stay finite in fp32 (|x| <= 2^60): mostly O(1),
  // some huge, tiny, denormal and signed zeros. fp16: any finite bit pattern.
  kFinite,
  // Any bit pattern: also inf, NaN, values whose squares overflow.
  kAnyBits,
};

inline float RandomValue(std::mt19937& rng, Mix mix) {
  if (mix == Mix::kAnyBits) {
    const uint32_t r = rng() % 8;
    if (r == 0) return std::numeric_limits<float>::infinity() * ((rng() & 1u) ? -1.0f : 1.0f);
    if (r == 1)
      return std::bit_cast<float>(
          static_cast<uint32_t>(0x7f800001u | (rng() & 0x807fffffu)));  // NaN
    return std::bit_cast<float>(static_cast<uint32_t>(rng()));
  }
  const uint32_t r = rng() % 100;
  if (r < 70) return RandomFloat(rng, -20, 2);
  if (r < 80) return RandomFloat(rng, 20, 59);
  if (r < 90) return RandomFloat(rng, -126, -60);
  if (r < 96) return RandomDenormal(rng);
  return (r & 1u) ? -0.0f : 0.0f;
}

// A gradient bucket of one dtype; value(i) is the exact float value of element i.
class GradData {
 public:
  GradData(DType dtype, int64_t num_elems) : dtype_(dtype), n_(num_elems) {
    if (dtype == DType::kF32) {
      f32_.resize(num_elems);
    } else {
      u16_.resize(num_elems);
    }
  }
  static GradData Random(DType dtype, int64_t num_elems, std::mt19937& rng, Mix mix) {
    GradData g(dtype, num_elems);
    for (int64_t i = 0; i < num_elems; ++i) {
      if (dtype == DType::kF16) {
        uint16_t h;
        do {
          h = static_cast<uint16_t>(rng());
        } while (mix == Mix::kFinite && (h & 0x7c00u) == 0x7c00u);
        g.u16_[i] = h;
      } else {
        g.Set(i, RandomValue(rng, mix));
      }
    }
    return g;
  }

  // Stores dtype(x) (rounded as base/dtype.h).
  void Set(int64_t i, float x) {
    switch (dtype_) {
      case DType::kF32:
        f32_[i] = x;
        break;
      case DType::kF16:
        u16_[i] = FloatToHalf(x);
        break;
      case DType::kBF16:
        u16_[i] = FloatToBf16(x);
        break;
    }
  }
  void SetBits(int64_t i, uint16_t bits) { u16_[i] = bits; }
  float value(int64_t i) const {
    switch (dtype_) {
      case DType::kF32:
        return f32_[i];
      case DType::kF16:
        return HalfToFloat(u16_[i]);
      case DType::kBF16:
        return Bf16ToFloat(u16_[i]);
    }
    return 0.0f;
  }
  const void* data() const {
    return dtype_ == DType::kF32 ? static_cast<const void*>(f32_.data()) : u16_.data();
  }
  GradView view() const { return GradView{data(), dtype_}; }
  DType dtype() const { return dtype_; }
  int64_t size() const { return n_; }

 private:
  DType dtype_;
  int64_t n_;
  std::vector<float> f32_;
  std::vector<uint16_t> u16_;
};

// A copy-out buffer of one dtype (or none).
class OutData {
 public:
  OutData() = default;
  OutData(DType dtype, int64_t num_elems)
      : has_(true), dtype_(dtype), bytes_(static_cast<size_t>(num_elems) * SizeOf(dtype), 0xAB) {}
  CopyOut copy_out() { return has_ ? CopyOut{bytes_.data(), dtype_} : CopyOut{}; }
  bool has() const { return has_; }
  DType dtype() const { return dtype_; }
  uint16_t u16(int64_t i) const {
    uint16_t x;
    std::memcpy(&x, bytes_.data() + 2 * i, 2);
    return x;
  }
  uint32_t u32(int64_t i) const {
    uint32_t x;
    std::memcpy(&x, bytes_.data() + 4 * i, 4);
    return x;
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  bool has_ = false;
  DType dtype_ = DType::kBF16;
  std::vector<unsigned char> bytes_;
};

inline uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

// Same bits, or both NaN (NaN payloads may differ when two NaN operands meet: which
// one x86 returns depends on the operand order the compiler chose).
inline bool SameFloat(float a, float b) {
  return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b));
}

// Collects element mismatches and reports the first few.
class Mismatches {
 public:
  explicit Mismatches(std::string what) : what_(std::move(what)) {}
  void Add(const std::string& detail) {
    if (count_++ < 5) first_ += "\n  " + detail;
  }
  int64_t count() const { return count_; }
  std::string Report() const {
    return what_ + ": " + std::to_string(count_) + " mismatches, first:" + first_;
  }

 private:
  std::string what_;
  std::string first_;
  int64_t count_ = 0;
};

// ---- Float64 references with a running error bound ----
//
// Bounded{v, err}: v is the exact value of a quantity (computed in float64, whose
// own rounding is 2^29 times smaller than fp32's), err a bound on how far the fp32
// kernel's value of the same quantity can be from v when every fp32 operation is
// correctly rounded (unit roundoff kU = 2^-24; a result in the denormal range may
// carry an absolute error of up to kTiny). The operators propagate the bound, so a
// float64 formula written from the paper yields, element by element, the
// tolerance that fp32 arithmetic allows: derived from the dtype, not guessed.
inline constexpr double kU = 0x1p-24;
inline constexpr double kTiny = 0x1p-149;

struct Bounded {
  double v = 0.0;
  double err = 0.0;
};

// An fp32 input, exact.
inline Bounded Exact(double x) { return {x, 0.0}; }
// A per-call scalar computed in fp64 and rounded to fp32 once.
inline Bounded RoundedOnce(double exact) { return {exact, kU * std::abs(exact) + kTiny}; }

inline Bounded Rounding(double v, double e) { return {v, e + kU * (std::abs(v) + e) + kTiny}; }
inline Bounded operator-(Bounded a) { return {-a.v, a.err}; }
inline Bounded operator+(Bounded a, Bounded b) { return Rounding(a.v + b.v, a.err + b.err); }
inline Bounded operator-(Bounded a, Bounded b) { return a + (-b); }
inline Bounded operator*(Bounded a, Bounded b) {
  return Rounding(a.v * b.v, std::abs(a.v) * b.err + std::abs(b.v) * a.err + a.err * b.err);
}
inline Bounded operator/(Bounded a, Bounded b) {
  const double lo = std::abs(b.v) - b.err;
  if (!(lo > 0.0)) return {a.v / b.v, std::numeric_limits<double>::infinity()};
  return Rounding(a.v / b.v, a.err / lo + std::abs(a.v) * b.err / (lo * std::abs(b.v)));
}
inline Bounded Sqrt(Bounded a) {
  const double v = std::sqrt(std::max(a.v, 0.0));
  const double e = v > 0.0 ? std::min(std::sqrt(a.err), a.err / v) : std::sqrt(a.err);
  return Rounding(v, e);
}
// torch.maximum: 1-Lipschitz in each operand.
inline Bounded Max(Bounded a, Bounded b) { return {std::max(a.v, b.v), std::max(a.err, b.err)}; }

// Whether the fp32 result x lies within the bound (with 2x slack for the float64
// evaluation of v and err themselves).
// A value beyond fp32's range (after its error) must have overflowed to inf, and
// inf is right only for such a value.
inline bool Within(float x, Bounded b) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (std::abs(b.v) - 2.0 * b.err > kMax) return std::isinf(x) && (x > 0) == (b.v > 0);
  if (std::isinf(x)) return (x > 0) == (b.v > 0) && std::abs(b.v) + 2.0 * b.err >= kMax;
  return std::abs(static_cast<double>(x) - b.v) <= 2.0 * b.err + 0x1p-50 * std::abs(b.v);
}

// fp32 state of n elements starting at a chosen element offset inside a larger
// vector (offset 1: 4-byte aligned only, so the vector loops see misaligned
// pointers).
class FloatBuffer {
 public:
  FloatBuffer() = default;
  FloatBuffer(int64_t n, int64_t offset) : offset_(offset), data_(n + offset, 0.0f) {}
  std::span<float> span() { return {data_.data() + offset_, data_.size() - offset_}; }
  float& operator[](int64_t i) { return data_[offset_ + i]; }
  float operator[](int64_t i) const { return data_[offset_ + i]; }
  int64_t size() const { return static_cast<int64_t>(data_.size()) - offset_; }

 private:
  int64_t offset_ = 0;
  std::vector<float> data_;
};

}  // namespace strata::cpu_optim::testing
