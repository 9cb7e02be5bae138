#include "models/ops/rope.h"

#include <cmath>
#include <numbers>

#include "base/status.h"
#include "models/ops/parallel.h"

namespace strata::models::ops {

std::vector<double> RopeInverseFrequencies(const RopeParams& p) {
  const int dim = RopeRotaryDim(p);
  STRATA_CHECK(p.head_dim > 0 && p.head_dim % 2 == 0 && dim > 0 && dim % 2 == 0 &&
               dim <= p.head_dim);
  const int half = dim / 2;
  STRATA_CHECK(p.ext_factors.empty() || static_cast<int>(p.ext_factors.size()) == half);
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) {
    const double ext = p.ext_factors.empty() ? 1.0 : p.ext_factors[i];
    STRATA_CHECK(ext > 0);
    inv[i] = 1.0 / (ext * std::pow(p.theta, static_cast<double>(2 * i) / dim));
  }
  if (p.linear_factor != 1.0) {
    STRATA_CHECK(p.linear_factor > 0);
    for (double& f : inv) f /= p.linear_factor;
  }
  if (!p.llama3) return inv;
  const double old_len = p.original_max_position;
  const double low_wavelen = old_len / p.low_freq_factor;
  const double high_wavelen = old_len / p.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen < high_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_wavelen) {           // low frequencies: interpolated by factor
      f /= p.factor;
      continue;
    }
    const double s =
        (old_len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
    f = (1.0 - s) * f / p.factor + s * f;
  }
  return inv;
}

template <typename F>
void RopeTable(const RopeParams& p, int seq_len, F* cos, F* sin) {
  const std::vector<double> inv = RopeInverseFrequencies(p);
  const int64_t half = static_cast<int64_t>(inv.size());
  const double a = p.attention_factor;
  STRATA_CHECK(a > 0 && std::isfinite(a));
  ParallelRows(seq_len, half, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(t) * inv[i];
        // a = 1 multiplies exactly: the table of before the attention factor, bit for bit.
        cos[t * half + i] = static_cast<F>(a * std::cos(angle));
        sin[t * half + i] = static_cast<F>(a * std::sin(angle));
      }
    }
  });
}

namespace {

// Turns every pair of the first rotary_dim columns of every head of each row by +angle
// (sign = 1) or -angle (sign = -1).
template <typename S>
void Rotate(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
            const ComputeType<S>* cos, const ComputeType<S>* sin, ComputeType<S> sign,
            const int32_t* position_ids, int rotary_dim) {
  using F = ComputeType<S>;
  if (rotary_dim == 0) rotary_dim = head_dim;
  STRATA_CHECK(rows >= 0 && num_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0 && seq_len >= 1 &&
               row_stride >= int64_t{num_heads} * head_dim && rotary_dim >= 2 &&
               rotary_dim % 2 == 0 && rotary_dim <= head_dim);
  const int64_t half = rotary_dim / 2;
  ParallelRows(rows, int64_t{num_heads} * head_dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = position_ids != nullptr ? position_ids[r] : r % seq_len;
      STRATA_CHECK(t >= 0 && t < seq_len);
      const F* c = cos + t * half;
      const F* s = sin + t * half;
      for (int h = 0; h < num_heads; ++h) {
        S* p = x + r * row_stride + int64_t{h} * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const F a = ToFloat(p[i]), b = ToFloat(p[i + half]);
          const F si = sign * s[i];
          p[i] = FromFloat<S>(a * c[i] - b * si);
          p[i + half] = FromFloat<S>(b * c[i] + a * si);
        }
      }
    }
  });
}

}  // namespace

template <typename S>
void RopeForward(S* x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                 const ComputeType<S>* cos, const ComputeType<S>* sin, const int32_t* position_ids,
                 int rotary_dim) {
  Rotate(x, rows, row_stride, num_heads, head_dim, seq_len, cos, sin, ComputeType<S>(1),
         position_ids, rotary_dim);
}

template <typename S>
void RopeBackward(S* dx, int64_t rows, int64_t row_stride, int num_heads, int head_dim, int seq_len,
                  const ComputeType<S>* cos, const ComputeType<S>* sin, const int32_t* position_ids,
                  int rotary_dim) {
  Rotate(dx, rows, row_stride, num_heads, head_dim, seq_len, cos, sin, ComputeType<S>(-1),
         position_ids, rotary_dim);
}

template void RopeTable<float>(const RopeParams&, int, float*, float*);
template void RopeTable<double>(const RopeParams&, int, double*, double*);

#define STRATA_INSTANTIATE_ROPE(S)                                                          \
  template void RopeForward<S>(S*, int64_t, int64_t, int, int, int, const ComputeType<S>*,  \
                               const ComputeType<S>*, const int32_t*, int);                 \
  template void RopeBackward<S>(S*, int64_t, int64_t, int, int, int, const ComputeType<S>*, \
                                const ComputeType<S>*, const int32_t*, int);
STRATA_INSTANTIATE_ROPE(float)
STRATA_INSTANTIATE_ROPE(double)
STRATA_INSTANTIATE_ROPE(Bf16)
STRATA_INSTANTIATE_ROPE(Fp16)
#undef STRATA_INSTANTIATE_ROPE

}  // namespace strata::models::ops
