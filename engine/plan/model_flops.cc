#include "engine/plan/model_flops.h"

#include <cmath>

namespace strata::engine {
namespace {

// a * b + c, nullopt on overflow of int64_t.
std::optional<int64_t> MulAdd(int64_t a, int64_t b, int64_t c) {
  int64_t p = 0, s = 0;
  if (__builtin_mul_overflow(a, b, &p) || __builtin_add_overflow(p, c, &s)) return std::nullopt;
  return s;
}

}  // namespace

std::optional<int64_t> ModelFlopsPerToken(const ModelFlopsShape& s) {
  if (s.trained_params < 0 || s.frozen_params < 0 || s.num_layers < 0 || s.attention_width < 0 ||
      s.seq_len < 0) {
    return std::nullopt;
  }
  int64_t attention = 0;
  if (__builtin_mul_overflow(s.num_layers, s.seq_len, &attention) ||
      __builtin_mul_overflow(attention, s.attention_width, &attention)) {
    return std::nullopt;
  }
  std::optional<int64_t> f = MulAdd(12, attention, 0);
  if (f) f = MulAdd(4, s.frozen_params, *f);
  if (f) f = MulAdd(6, s.trained_params, *f);
  return f;
}

std::optional<double> ModelFlopsUtilisation(int64_t flops_per_token, double tokens_per_second,
                                            double peak_TFLOPs) {
  if (!(peak_TFLOPs > 0) || !std::isfinite(tokens_per_second) || flops_per_token < 0) {
    return std::nullopt;
  }
  return static_cast<double>(flops_per_token) * tokens_per_second / (peak_TFLOPs * 1e12);
}

}  // namespace strata::engine
