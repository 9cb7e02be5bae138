// The per-head RMSNorm (models/ops/head_rms_norm.h, Qwen3's q_norm / k_norm) written straight
// from its definition in double, with the magnitudes of the terms that cancel in its gradients
// (tests/models/terms_bound.h), for head_rms_norm_op_test.cc (the host op) and
// head_rms_norm_cuda_test.cc (the CUDA op).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/models/llama_op_test_util.h"

namespace strata::models::op_test {

// rows of the fused [q (H hs) | k (Hkv hs) | v (Hkv hs) | pad] projection output.
struct HeadDims {
  int64_t rows;
  int H, Hkv;
  int64_t hs;
  int64_t pad = 0;  // columns past v (ld > (H + 2 Hkv) hs), to see that they stay untouched

  int num_heads() const { return H + Hkv; }
  int64_t width() const { return int64_t{num_heads()} * hs; }  // the q and k columns
  int64_t ld() const { return int64_t{H + 2 * Hkv} * hs + pad; }
  std::string Name() const {
    return "rows=" + std::to_string(rows) + " H=" + std::to_string(H) +
           " Hkv=" + std::to_string(Hkv) + " hs=" + std::to_string(hs) +
           " pad=" + std::to_string(pad);
  }
};

struct HeadRmsNormRef {
  std::vector<double> y;         // (rows, width): the normalised q and k columns
  std::vector<double> rstd;      // (rows num_heads)
  std::vector<double> dx;        // (rows, width): the gradient of the pre-norm q and k columns
  std::vector<double> dx_terms;  // (rows, width): rstd (|g| + |xhat| mean(|g xhat|))
  std::vector<double> dw;        // (2, hs)
  std::vector<double> dw_terms;  // (2, hs): sums of |dy xhat|
};

// qkv, dy: (rows, ld); w: (2, hs). Per head h of row r, x = qkv[r, h hs : (h + 1) hs], w_h = w[0]
// for h < H else w[1], and the multiplier m = w_h, or 1 + w_h with unit_offset (Gemma 3):
//   rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd m,
//   dx = rstd (g - xhat mean(g xhat)), g = dy m, xhat = x rstd,  dw[part] += dy xhat.
inline HeadRmsNormRef HeadRmsNormReference(const std::vector<double>& qkv,
                                           const std::vector<double>& w,
                                           const std::vector<double>& dy, const HeadDims& d,
                                           double eps, bool unit_offset = false) {
  const int64_t hs = d.hs, ld = d.ld(), width = d.width();
  HeadRmsNormRef ref;
  ref.y.assign(d.rows * width, 0.0);
  ref.rstd.assign(d.rows * d.num_heads(), 0.0);
  ref.dx.assign(d.rows * width, 0.0);
  ref.dx_terms.assign(d.rows * width, 0.0);
  ref.dw.assign(2 * hs, 0.0);
  ref.dw_terms.assign(2 * hs, 0.0);
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int h = 0; h < d.num_heads(); ++h) {
      const double* x = qkv.data() + r * ld + h * hs;
      const double* g_out = dy.data() + r * ld + h * hs;
      const int part = h < d.H ? 0 : 1;
      std::vector<double> m(w.begin() + part * hs, w.begin() + (part + 1) * hs);
      if (unit_offset) {
        for (double& v : m) v += 1.0;
      }
      const double* wh = m.data();
      double ms = 0;
      for (int64_t c = 0; c < hs; ++c) ms += x[c] * x[c] / static_cast<double>(hs);
      const double s = 1.0 / std::sqrt(ms + eps);
      ref.rstd[r * d.num_heads() + h] = s;
      double mean_gx = 0, mean_abs_gx = 0;
      for (int64_t c = 0; c < hs; ++c) {
        const double gx = g_out[c] * wh[c] * x[c] * s;
        mean_gx += gx / static_cast<double>(hs);
        mean_abs_gx += std::abs(gx) / static_cast<double>(hs);
      }
      for (int64_t c = 0; c < hs; ++c) {
        const int64_t i = r * width + h * hs + c;
        const double xhat = x[c] * s, g = g_out[c] * wh[c];
        ref.y[i] = xhat * wh[c];
        ref.dx[i] = s * (g - xhat * mean_gx);
        ref.dx_terms[i] = s * (std::abs(g) + std::abs(xhat) * mean_abs_gx);
        ref.dw[part * hs + c] += g_out[c] * xhat;
        ref.dw_terms[part * hs + c] += std::abs(g_out[c] * xhat);
      }
    }
  }
  return ref;
}

// The q and k columns (rows, width) of a (rows, ld) buffer.
template <typename T>
std::vector<T> QkColumns(const std::vector<T>& v, const HeadDims& d) {
  std::vector<T> out(d.rows * d.width());
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < d.width(); ++c) out[r * d.width() + c] = v[r * d.ld() + c];
  }
  return out;
}

// The number of columns past the q and k heads (v and pad) of row r whose bits differ between a
// and b, summed over rows ((rows, ld) buffers of S).
template <typename S>
int64_t ChangedOtherColumns(const std::vector<S>& a, const std::vector<S>& b, const HeadDims& d) {
  int64_t changed = 0;
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = d.width(); c < d.ld(); ++c) {
      changed += std::memcmp(&a[r * d.ld() + c], &b[r * d.ld() + c], sizeof(S)) != 0;
    }
  }
  return changed;
}

// Random q|k|v rows with amplitude 2 and, to see the edges of the norm, head 0 of row 0 all
// zeros (rstd = 1 / sqrt(eps), y = 0) and the last head of the last row scaled by 64.
inline std::vector<double> HeadRmsInputs(const HeadDims& d, uint64_t seed) {
  std::vector<double> x = RandomValues(d.rows * d.ld(), 2.0, seed);
  for (int64_t c = 0; c < d.hs; ++c) x[c] = 0.0;
  if (d.rows > 1) {
    double* last = x.data() + (d.rows - 1) * d.ld() + (d.num_heads() - 1) * d.hs;
    for (int64_t c = 0; c < d.hs; ++c) last[c] *= 64.0;
  }
  return x;
}

// q_norm.weight then k_norm.weight, around 1 as trained norms are; with unit_offset (Gemma 3,
// whose stored weight is the multiplier's offset from 1) around 0, in [-0.5, 0.5].
inline std::vector<double> HeadRmsWeights(int64_t hs, uint64_t seed, bool unit_offset = false) {
  if (unit_offset) return RandomValues(2 * hs, 0.5, seed);
  std::vector<double> w = RandomValues(2 * hs, 0.3, seed);
  for (double& v : w) v += 1.0;
  return w;
}

}  // namespace strata::models::op_test
