// The op-by-op harness of issue 26 (item 3): every host op of a GPT layer and head, run in the
// shapes of tests/engine/cuda_engine_test.cc (GptModel {V 256, T 16, 6 layers, 2 heads, C 32},
// micro-batch B 2 x T 16) on one set of S-rounded inputs, so that the host op, its double
// instantiation (tests/models/ops/op_parity_test.cc, in CI) and the CUDA op
// (tests/models/gpt_cuda_test.cc, label gpu) can be compared output by output.
//
// The measure is the one the engine test's failure needs: how often and by how many ulps of S
// two runs of an op round differently. Two implementations with the same rounding points differ
// only by fp32 summation order, which moves a value across a 16-bit rounding boundary with a
// probability of about K 2^-24 / u (K the sum's length: under 1% for bf16 and fp16 at K = 32):
// almost every element is bit-identical, the rest one or two ulps away. A rounding point moved
// (a value rounded to S on one side and kept in fp32, or rounded at another scale, on the
// other) flips a large fraction of the roundings it feeds (40% for the attention's P).
// Deviations are counted in ulps of S at max(|a_i|, rms(a)), so that an element near zero by
// cancellation is measured at its tensor's scale.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "models/ops/attention.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/gelu.h"
#include "models/ops/layer_norm.h"
#include "models/ops/matmul.h"
#include "tests/models/ops/op_test_util.h"

namespace strata::models::ops::parity {

// The engine test's GPT and micro-batch (tests/engine/cuda_engine_test.cc).
struct Shape {
  int B = 2, T = 16, C = 32, H = 2, V = 256;
  double ln_eps = 1e-5;  // GptShape's default, and the CUDA kernels' kLayerNormEps
  int64_t N() const { return int64_t{B} * T; }
};

// One set of inputs, as doubles holding S values (Rounded<S>), for every op.
struct Inputs {
  std::vector<double> x, w, b, dy, residual;  // LayerNorm: x (N, C), w, b (C), dy, residual (N, C)
  std::vector<double> qkv, att_dout;          // attention: qkv (N, 3C), dout (N, C)
  std::vector<double> in, w_qkv, b_qkv;       // matmul: in (N, C), W (C, 3C), bias (3C)
  std::vector<double> w_proj, b_proj;         // W (C, C), bias (C), residual as above
  std::vector<double> w_fc, b_fc, w_mp, g;    // W (C, 4C), bias (4C); W (4C, C); g (N, 4C)
  std::vector<double> lnf, w_lm;              // head: lnf (N, C), W (C, V)
  std::vector<int32_t> targets;               // (N)
};

template <typename S>
Inputs MakeInputs(const Shape& s, uint64_t seed) {
  using testing::RandomDoubles;
  using testing::Rounded;
  const int64_t N = s.N(), C = s.C, V = s.V;
  uint64_t k = seed;
  auto r = [&](int64_t n, double scale) { return Rounded<S>(RandomDoubles(n, ++k, scale)); };
  Inputs in;
  in.x = r(N * C, 1.0);
  std::vector<double> w = RandomDoubles(C, ++k, 0.3);
  for (double& v : w) v += 1.0;
  in.w = Rounded<S>(w);
  in.b = r(C, 0.2);
  in.dy = r(N * C, 1.0);
  in.residual = r(N * C, 1.0);
  in.qkv = r(N * 3 * C, 1.5);
  in.att_dout = r(N * C, 1.0);
  in.in = r(N * C, 1.0);
  in.w_qkv = r(C * 3 * C, 0.3);
  in.b_qkv = r(3 * C, 0.1);
  in.w_proj = r(C * C, 0.3);
  in.b_proj = r(C, 0.1);
  in.w_fc = r(C * 4 * C, 0.3);
  in.b_fc = r(4 * C, 0.1);
  in.w_mp = r(4 * C * C, 0.15);
  in.g = r(N * 4 * C, 1.0);
  in.lnf = r(N * C, 1.0);
  in.w_lm = r(C * V, 0.3);
  in.targets = testing::RandomTokens(N, s.V, ++k);
  return in;
}

// One output of one op: its name and its values as doubles.
struct Output {
  std::string name;
  std::vector<double> values;
};

// Every op of a GPT layer and head on the inputs, in storage type S (double: the reference):
// LayerNorm forward, backward and parameter gradients; attention forward and backward (the
// backward fed the forward's own out and lse); the matmul epilogues (bias and residual, GELU_AUX
// bias, DGELU with the weight and bias gradients, the plain weight and bias gradient); and the
// chunked LM head's backward (dlogits inside; dx and dW out).
template <typename S>
std::vector<Output> RunHostOps(const Shape& s, const Inputs& in) {
  using F = ComputeType<S>;
  using testing::Cast;
  using testing::ToDoubles;
  const int64_t N = s.N(), C = s.C, V = s.V;
  std::vector<Output> out;
  auto put = [&](const std::string& name, const std::vector<S>& v) {
    out.push_back({name, ToDoubles(v)});
  };
  {
    const std::vector<S> x = Cast<S>(in.x), w = Cast<S>(in.w), b = Cast<S>(in.b);
    const std::vector<S> dy = Cast<S>(in.dy), res = Cast<S>(in.residual);
    std::vector<S> y(N * C), dx(N * C), dw(C), db(C);
    std::vector<F> mean(N), rstd(N);
    LayerNormForward(x.data(), w.data(), b.data(), s.ln_eps, N, C, y.data(), mean.data(),
                     rstd.data());
    LayerNormBackward(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), res.data(), N, C,
                      dx.data(), dw.data(), db.data());
    put("layer_norm y", y);
    put("layer_norm dx", dx);
    put("layer_norm dw", dw);
    put("layer_norm db", db);
  }
  {
    const std::vector<S> qkv = Cast<S>(in.qkv), dout = Cast<S>(in.att_dout);
    const AttentionDims d{s.B, s.T, s.H, s.H, s.C / s.H, 3 * int64_t{s.C}};
    std::vector<S> att(N * C), dqkv(N * 3 * C);
    std::vector<F> lse(N * s.H);
    AttentionForward(d, qkv.data(), qkv.data() + C, qkv.data() + 2 * C, att.data(), lse.data());
    AttentionBackward(d, qkv.data(), qkv.data() + C, qkv.data() + 2 * C, att.data(), dout.data(),
                      lse.data(), dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C);
    put("attention out", att);
    put("attention dqkv", dqkv);
  }
  {
    const std::vector<S> x = Cast<S>(in.in), w = Cast<S>(in.w_proj), b = Cast<S>(in.b_proj);
    const std::vector<S> res = Cast<S>(in.residual), dy = Cast<S>(in.dy);
    std::vector<S> y(N * C), dx(N * C), dw(C * C), db(C);
    MatmulForward(x.data(), w.data(), WeightLayout::kInOut, b.data(), y.data(), N, C, C,
                  res.data());
    MatmulBackward(x.data(), w.data(), WeightLayout::kInOut, dy.data(), dx.data(), dw.data(),
                   db.data(), N, C, C);
    put("matmul bias+residual y", y);
    put("matmul dx", dx);
    put("matmul dW", dw);
    put("matmul db", db);
  }
  {
    const std::vector<S> x = Cast<S>(in.in), w = Cast<S>(in.w_fc), b = Cast<S>(in.b_fc);
    std::vector<S> pre(N * 4 * C), g(N * 4 * C);
    MatmulGeluForward(x.data(), w.data(), WeightLayout::kInOut, b.data(), pre.data(), g.data(), N,
                      C, 4 * C);
    put("matmul gelu_aux h", pre);
    put("matmul gelu_aux g", g);
    const std::vector<S> gin = Cast<S>(in.g), wp = Cast<S>(in.w_mp), dy = Cast<S>(in.dy);
    std::vector<S> dpre(N * 4 * C), dw(4 * C * C), db(C);
    MatmulGeluBackward(gin.data(), wp.data(), WeightLayout::kInOut, dy.data(), pre.data(),
                       dpre.data(), dw.data(), db.data(), N, 4 * C, C);
    put("matmul dgelu dh", dpre);
    put("matmul dgelu dW", dw);
    put("matmul dgelu db", db);
  }
  {
    const std::vector<S> x = Cast<S>(in.lnf), w = Cast<S>(in.w_lm);
    std::vector<S> dx(N * C), dw(C * V);
    const int64_t rows = std::max<int64_t>(1, N / 3);  // several chunks, the last one short
    std::vector<unsigned char> scratch(LmHeadScratchBytes<S>(s.B, s.T, s.C, s.V, rows) + 64);
    void* aligned = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
    LmHeadBackward(x.data(), w.data(), WeightLayout::kInOut, in.targets.data(), F(1), s.B, s.T, s.C,
                   s.V, dx.data(), dw.data(), aligned, rows);
    put("lm_head dx", dx);
    put("lm_head dW", dw);
  }
  return out;
}

// How two runs of one output differ, in ulps of S at max(|a_i|, rms(a)).
struct Spread {
  double q99 = 0, max = 0;
  double differing = 0;  // fraction of elements not bit-identical
};

template <typename S>
double UlpOf(double v) {
  constexpr int kMantissa = std::is_same_v<S, Bf16> ? 8 : std::is_same_v<S, Fp16> ? 11 : 24;
  if (v == 0) return 0x1p-126;
  int e = 0;
  std::frexp(v, &e);  // v = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - kMantissa);
}

template <typename S>
Spread Compare(const std::vector<double>& a, const std::vector<double>& b) {
  const double rms = testing::Rms(a);
  std::vector<double> d(a.size());
  int64_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d[i] = std::abs(a[i] - b[i]) / UlpOf<S>(std::max(std::abs(a[i]), rms));
    differing += a[i] != b[i];
  }
  Spread s;
  if (d.empty()) return s;
  std::sort(d.begin(), d.end());
  s.q99 = d[static_cast<size_t>(0.99 * static_cast<double>(d.size() - 1))];
  s.max = d.back();
  s.differing = static_cast<double>(differing) / static_cast<double>(d.size());
  return s;
}

inline std::string TableRow(const std::string& op, const Spread& s) {
  char line[160];
  std::snprintf(line, sizeof(line), "  %-24s q99 %6.2f ulp  max %7.2f ulp  differing %6.2f%%\n",
                op.c_str(), s.q99, s.max, 100 * s.differing);
  return line;
}

// The magnitude of the terms that cancel in each element of the attention's dqkv (N, 3C)
// (terms_bound.h): the backward with absolute values, T_dP(t, s) = sum_j |dO_tj v_sj|,
// T_dS(t, s) = P_ts (T_dP(t, s) + sum_s' P_ts' T_dP(t, s')), dq_t += scale T_dS |k_s|,
// dk_s += scale T_dS |q_t|, dv_s += P_ts |dO_t|. qkv (N, 3C), dout (N, C), in double.
inline std::vector<double> AttentionTerms(const Shape& sh, const std::vector<double>& qkv,
                                          const std::vector<double>& dout) {
  const int64_t T = sh.T, C = sh.C, H = sh.H, hs = C / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> terms(qkv.size(), 0.0);
  for (int64_t b = 0; b < sh.B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const double* q = qkv.data() + (b * T + t) * 3 * C + h * hs;
        const double* go = dout.data() + (b * T + t) * C + h * hs;
        std::vector<double> p(t + 1), dp_terms(t + 1, 0.0);
        double mx = -INFINITY, sum = 0, d_terms = 0;
        for (int64_t s = 0; s <= t; ++s) {
          const double* k = qkv.data() + (b * T + s) * 3 * C + C + h * hs;
          double dot = 0;
          for (int64_t j = 0; j < hs; ++j) {
            dot += q[j] * k[j];
            dp_terms[s] += std::abs(go[j] * k[C + j]);  // v = k + C
          }
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        for (int64_t s = 0; s <= t; ++s) sum += std::exp(p[s] - mx);
        for (int64_t s = 0; s <= t; ++s) {
          p[s] = std::exp(p[s] - mx) / sum;
          d_terms += p[s] * dp_terms[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          const double ds = p[s] * (dp_terms[s] + d_terms);
          const double* k = qkv.data() + (b * T + s) * 3 * C + C + h * hs;
          double* tq = terms.data() + (b * T + t) * 3 * C + h * hs;
          double* tk = terms.data() + (b * T + s) * 3 * C + C + h * hs;
          for (int64_t j = 0; j < hs; ++j) {
            tq[j] += scale * ds * std::abs(k[j]);
            tk[j] += scale * ds * std::abs(q[j]);
            tk[C + j] += p[s] * std::abs(go[j]);
          }
        }
      }
    }
  }
  return terms;
}

}  // namespace strata::models::ops::parity
