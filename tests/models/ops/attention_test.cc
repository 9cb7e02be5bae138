// models/ops/attention.h: causal grouped-query attention on strided rows, the double
// instantiation against a plain softmax reference (forward and backward, with k and v repeated
// per query head as Hugging Face's repeat_kv), every storage type against double; packed
// sequences (position_ids: block-diagonal causal attention), sliding windows
// (AttentionDims::window: key j seen by queries j .. j + w - 1) and a given score scale
// (AttentionDims::scale, Gemma's query_pre_attn_scalar^-0.5) in the same reference and cases.
#include "models/ops/attention.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tests/models/ops/op_test_util.h"

namespace strata::models::ops {
namespace {

using terms_bound::ExpectWithinTermsBound;
using testing::AllPoisoned;
using testing::BoundEps;
using testing::Cast;
using testing::ExpectNearReference;
using testing::ExpectWithinBound;
using testing::Poisoned;
using testing::RandomDoubles;
using testing::Rounded;
using testing::ToDoubles;

// One fused projection output per token row: [q (H hs) | k (Hkv hs) | v (Hkv hs) | pad], so q, k
// and v are strided column blocks of one buffer, with padding columns nobody may write.
struct Layout {
  AttentionDims d;
  int64_t q_off, k_off, v_off;
  // Packed sequences: (B, T) position ids, empty for one sequence per row.
  std::vector<int32_t> position_ids;
  // d with the position ids of this layout (taken when the op runs: layouts are copied).
  AttentionDims dims() const {
    AttentionDims x = d;
    x.position_ids = position_ids.empty() ? nullptr : position_ids.data();
    return x;
  }
  // The first key query t of sequence b attends to: t - w < j <= t with a window w, as Hugging
  // Face's create_sliding_window_causal_mask, within the query's packed example.
  int64_t first_key(int64_t b, int64_t t) const {
    const int64_t lo = position_ids.empty() ? 0 : t - position_ids[b * d.seq_len + t];
    return d.window > 0 ? std::max(lo, t - d.window + 1) : lo;
  }
  int64_t rows() const { return int64_t{d.batch_size} * d.seq_len; }
  int64_t qkv_elems() const { return rows() * d.row_stride; }
  int64_t out_elems() const { return rows() * d.num_heads * d.head_dim; }
};

Layout MakeLayout(int B, int T, int H, int Hkv, int hs, int pad) {
  const int64_t q = int64_t{H} * hs, kv = int64_t{Hkv} * hs;
  return {{B, T, H, Hkv, hs, q + 2 * kv + pad}, 0, q, q + kv, {}};
}

// MakeLayout(B, T, ...) with every sequence packed from examples of these lengths (summing to T).
Layout MakePacked(int B, const std::vector<int>& lengths, int H, int Hkv, int hs, int pad) {
  int T = 0;
  for (int n : lengths) T += n;
  Layout l = MakeLayout(B, T, H, Hkv, hs, pad);
  for (int b = 0; b < B; ++b) {
    for (int n : lengths) {
      for (int p = 0; p < n; ++p) l.position_ids.push_back(p);
    }
  }
  return l;
}

// l with a sliding window of w keys.
Layout Windowed(Layout l, int w) {
  l.d.window = w;
  return l;
}

// l with the scores scaled by `scale` (AttentionDims::scale; 0: 1 / sqrt(head_dim)).
Layout Scaled(Layout l, double scale) {
  l.d.scale = scale;
  return l;
}

// l with the scores soft-capped at c (AttentionDims::softcap, Gemma 2).
Layout Capped(Layout l, double c) {
  l.d.softcap = c;
  return l;
}

std::string Name(const Layout& l) {
  return "B=" + std::to_string(l.d.batch_size) + " T=" + std::to_string(l.d.seq_len) +
         " H=" + std::to_string(l.d.num_heads) + " Hkv=" + std::to_string(l.d.num_kv_heads) +
         " hs=" + std::to_string(l.d.head_dim) + " stride=" + std::to_string(l.d.row_stride) +
         (l.position_ids.empty() ? "" : " packed") +
         (l.d.window == 0 ? "" : " window=" + std::to_string(l.d.window)) +
         (l.d.scale == 0 ? "" : " scale=" + std::to_string(l.d.scale)) +
         (l.d.softcap == 0 ? "" : " softcap=" + std::to_string(l.d.softcap));
}

// The cases: H / Hkv in {1, 2, 4}; T across the attention row block (64) and not a multiple of
// it; padded rows.
std::vector<Layout> Cases() {
  return {MakeLayout(2, 67, 4, 4, 8, 3),          MakeLayout(3, 19, 4, 2, 7, 1),
          MakeLayout(2, 70, 4, 1, 5, 2),          MakeLayout(1, 1, 2, 1, 3, 0),
          MakePacked(2, {10, 20, 7}, 4, 2, 6, 1), MakePacked(1, {1, 66, 3}, 4, 4, 5, 0)};
}

// Sliding windows: 1 (each query sees itself only) and 2; windows shorter than T that divide no
// block size (T 37, w 5); T 130 across the host op's 64-row blocks with w 64 and 65, so a block's
// first rows and its last see different key ranges; grouped-query heads; packed sequences whose
// examples are longer and shorter than the window.
std::vector<Layout> WindowCases() {
  return {Windowed(MakeLayout(2, 19, 2, 2, 5, 1), 1),
          Windowed(MakeLayout(1, 23, 4, 2, 6, 0), 2),
          Windowed(MakeLayout(2, 37, 4, 2, 7, 3), 5),
          Windowed(MakeLayout(1, 130, 4, 2, 8, 0), 64),
          Windowed(MakeLayout(1, 130, 2, 1, 5, 2), 65),
          Windowed(MakePacked(2, {10, 20, 7}, 4, 2, 6, 1), 5),
          Windowed(MakePacked(1, {1, 66, 3, 60}, 4, 4, 5, 0), 9)};
}

// A score scale other than 1 / sqrt(hs): 0.3 (Gemma's scaling is query_pre_attn_scalar^-0.5, not
// tied to the head size) on the causal cases, with grouped heads, packed sequences and a window.
std::vector<Layout> ScaleCases() {
  return {Scaled(MakeLayout(2, 67, 4, 4, 8, 3), 0.3), Scaled(MakeLayout(3, 19, 4, 2, 7, 1), 0.3),
          Scaled(MakeLayout(1, 1, 2, 1, 3, 0), 0.3),
          Scaled(MakePacked(2, {10, 20, 7}, 4, 2, 6, 1), 0.3),
          Scaled(Windowed(MakeLayout(2, 37, 4, 2, 7, 3), 5), 0.3)};
}

// Soft-capping (Gemma 2) at caps of the order of the scores (inputs of magnitude 1.5: scores of
// a few units), so that tanh saturates on some and is near linear on others: causal, grouped,
// packed, windowed, with a given scale, past the 64-row block.
std::vector<Layout> SoftcapCases() {
  return {Capped(MakeLayout(2, 67, 4, 4, 8, 3), 2.0), Capped(MakeLayout(3, 19, 4, 2, 7, 1), 0.7),
          Capped(MakeLayout(1, 1, 2, 1, 3, 0), 1.0),
          Capped(MakePacked(2, {10, 20, 7}, 4, 2, 6, 1), 3.0),
          Capped(Scaled(Windowed(MakeLayout(2, 37, 4, 2, 7, 3), 5), 0.3), 0.5)};
}

// The reference: per (b, h), plain softmax attention with kv head h / (H / Hkv).
// terms: the magnitude of the terms that cancel in each dq, dk, dv element (terms_bound.h): the
// backward evaluated with absolute values, dP's terms |dO| |v| and dS's P (|dP| + |D|), |dP| and
// |D| by their terms: T_dS(t, s) = p_s (T_dP(t, s) + sum_s' p_s' T_dP(t, s')).
struct Ref {
  std::vector<double> out, lse, dqkv;  // dqkv in the fused layout, padding zero
  std::vector<double> terms;           // as dqkv
};

Ref Reference(const Layout& l, const std::vector<double>& qkv, const std::vector<double>& dout) {
  const AttentionDims& d = l.d;
  const int64_t T = d.seq_len, H = d.num_heads, hs = d.head_dim, ld = d.row_stride;
  const int64_t group = H / d.num_kv_heads, ldo = H * hs;
  const double scale = d.scale != 0 ? d.scale : 1.0 / std::sqrt(static_cast<double>(hs));
  Ref r{std::vector<double>(l.out_elems()), std::vector<double>(int64_t{d.batch_size} * H * T),
        std::vector<double>(l.qkv_elems(), 0.0), std::vector<double>(l.qkv_elems(), 0.0)};
  for (int64_t b = 0; b < d.batch_size; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / group;
      auto q = [&](int64_t t, int64_t j) { return qkv[(b * T + t) * ld + l.q_off + h * hs + j]; };
      auto k = [&](int64_t t, int64_t j) { return qkv[(b * T + t) * ld + l.k_off + kvh * hs + j]; };
      auto v = [&](int64_t t, int64_t j) { return qkv[(b * T + t) * ld + l.v_off + kvh * hs + j]; };
      for (int64_t t = 0; t < T; ++t) {
        // Keys lo..t; p[s] stays 0 for the keys before lo (another packed example).
        const int64_t lo = l.first_key(b, t);
        std::vector<double> p(t + 1, 0.0);
        // Soft-capped: score c tanh(x / c) of the scaled x, its derivative 1 - tanh^2.
        std::vector<double> dcap(t + 1, 1.0);
        double mx = -INFINITY;
        for (int64_t s = lo; s <= t; ++s) {
          double sc = 0;
          for (int64_t j = 0; j < hs; ++j) sc += q(t, j) * k(s, j);
          p[s] = sc * scale;
          if (d.softcap > 0) {
            const double u = std::tanh(p[s] / d.softcap);
            p[s] = d.softcap * u;
            dcap[s] = 1 - u * u;
          }
          mx = std::max(mx, p[s]);
        }
        double sum = 0;
        for (int64_t s = lo; s <= t; ++s) sum += std::exp(p[s] - mx);
        r.lse[(b * H + h) * T + t] = mx + std::log(sum);
        for (int64_t s = lo; s <= t; ++s) p[s] = std::exp(p[s] - mx) / sum;
        std::vector<double> o(hs, 0.0);
        for (int64_t s = 0; s <= t; ++s) {
          for (int64_t j = 0; j < hs; ++j) o[j] += p[s] * v(s, j);
        }
        for (int64_t j = 0; j < hs; ++j) r.out[(b * T + t) * ldo + h * hs + j] = o[j];
        // Backward of this row: dp = dO v^T; D = dO . O; ds = p (dp - D).
        const double* dot = dout.data() + (b * T + t) * ldo + h * hs;
        double D = 0;
        for (int64_t j = 0; j < hs; ++j) D += dot[j] * o[j];
        std::vector<double> dp_terms(t + 1, 0.0);
        double d_terms = 0;
        for (int64_t s = 0; s <= t; ++s) {
          for (int64_t j = 0; j < hs; ++j) dp_terms[s] += std::abs(dot[j] * v(s, j));
          d_terms += p[s] * dp_terms[s];
        }
        for (int64_t s = 0; s <= t; ++s) {
          double dp = 0;
          for (int64_t j = 0; j < hs; ++j) dp += dot[j] * v(s, j);
          const double ds = p[s] * (dp - D) * dcap[s];
          const double ds_terms = p[s] * (dp_terms[s] + d_terms) * dcap[s];
          for (int64_t j = 0; j < hs; ++j) {
            r.dqkv[(b * T + t) * ld + l.q_off + h * hs + j] += scale * ds * k(s, j);
            r.dqkv[(b * T + s) * ld + l.k_off + kvh * hs + j] += scale * ds * q(t, j);
            r.dqkv[(b * T + s) * ld + l.v_off + kvh * hs + j] += p[s] * dot[j];
            r.terms[(b * T + t) * ld + l.q_off + h * hs + j] +=
                scale * ds_terms * std::abs(k(s, j));
            r.terms[(b * T + s) * ld + l.k_off + kvh * hs + j] +=
                scale * ds_terms * std::abs(q(t, j));
            r.terms[(b * T + s) * ld + l.v_off + kvh * hs + j] += std::abs(p[s] * dot[j]);
          }
        }
      }
    }
  }
  return r;
}

template <typename S>
struct Got {
  std::vector<S> out, dqkv;
  std::vector<ComputeType<S>> lse;
};

template <typename S>
Got<S> RunOp(const Layout& l, const std::vector<double>& qkv_d, const std::vector<double>& dout_d) {
  const std::vector<S> qkv = Cast<S>(qkv_d), dout = Cast<S>(dout_d);
  Got<S> g{Poisoned<S>(l.out_elems()), Poisoned<S>(l.qkv_elems()),
           std::vector<ComputeType<S>>(int64_t{l.d.batch_size} * l.d.num_heads * l.d.seq_len)};
  const S* base = qkv.data();
  AttentionForward<S>(l.dims(), base + l.q_off, base + l.k_off, base + l.v_off, g.out.data(),
                      g.lse.data());
  S* dbase = g.dqkv.data();
  AttentionBackward<S>(l.dims(), base + l.q_off, base + l.k_off, base + l.v_off, g.out.data(),
                       dout.data(), g.lse.data(), dbase + l.q_off, dbase + l.k_off,
                       dbase + l.v_off);
  return g;
}

// The q, k, v columns of the fused layout (padding excluded).
template <typename T>
std::vector<double> Columns(const Layout& l, const std::vector<T>& fused, int64_t off,
                            int64_t width) {
  std::vector<double> v;
  for (int64_t r = 0; r < l.rows(); ++r) {
    for (int64_t j = 0; j < width; ++j) {
      v.push_back(static_cast<double>(ToFloat(fused[r * l.d.row_stride + off + j])));
    }
  }
  return v;
}

std::vector<double> Inputs(const Layout& l, uint64_t seed) {
  return RandomDoubles(l.qkv_elems(), seed, 1.5);
}

TEST(AttentionOp, DoubleMatchesThePlainSoftmaxReferenceWithGroupedKvAndStridedRows) {
  for (const Layout& l : Cases()) {
    SCOPED_TRACE(Name(l));
    const std::vector<double> qkv = Inputs(l, 1), dout = RandomDoubles(l.out_elems(), 2);
    const Got<double> g = RunOp<double>(l, qkv, dout);
    const Ref r = Reference(l, qkv, dout);
    ExpectNearReference("out", g.out, r.out);
    ExpectNearReference("lse", g.lse, r.lse);
    const int64_t qw = int64_t{l.d.num_heads} * l.d.head_dim;
    const int64_t kvw = int64_t{l.d.num_kv_heads} * l.d.head_dim;
    ExpectNearReference("dq", Columns(l, g.dqkv, l.q_off, qw), Columns(l, r.dqkv, l.q_off, qw));
    ExpectNearReference("dk", Columns(l, g.dqkv, l.k_off, kvw), Columns(l, r.dqkv, l.k_off, kvw));
    ExpectNearReference("dv", Columns(l, g.dqkv, l.v_off, kvw), Columns(l, r.dqkv, l.v_off, kvw));
  }
}

// The double op against the reference on `cases` (inputs from `seed`). dq and dk cancel
// (softmax's Jacobian); with a window of 1 they are zero in exact arithmetic (dS = 1 (dP - dP)),
// so their bound adds the magnitude of their terms (Ref::terms).
void ExpectDoubleMatchesTheReference(const std::vector<Layout>& cases, uint64_t seed) {
  for (const Layout& l : cases) {
    SCOPED_TRACE(Name(l));
    const std::vector<double> qkv = Inputs(l, seed), dout = RandomDoubles(l.out_elems(), seed + 1);
    const Got<double> g = RunOp<double>(l, qkv, dout);
    const Ref r = Reference(l, qkv, dout);
    ExpectNearReference("out", g.out, r.out);
    ExpectNearReference("lse", g.lse, r.lse);
    const int64_t qw = int64_t{l.d.num_heads} * l.d.head_dim;
    const int64_t kvw = int64_t{l.d.num_kv_heads} * l.d.head_dim;
    ExpectWithinTermsBound("dq", Columns(l, g.dqkv, l.q_off, qw), Columns(l, r.dqkv, l.q_off, qw),
                           Columns(l, r.terms, l.q_off, qw), 1.0, 1e-12);
    ExpectWithinTermsBound("dk", Columns(l, g.dqkv, l.k_off, kvw), Columns(l, r.dqkv, l.k_off, kvw),
                           Columns(l, r.terms, l.k_off, kvw), 1.0, 1e-12);
    ExpectNearReference("dv", Columns(l, g.dqkv, l.v_off, kvw), Columns(l, r.dqkv, l.v_off, kvw));
  }
}

TEST(AttentionOp, DoubleMatchesTheWindowedSoftmaxReference) {
  ExpectDoubleMatchesTheReference(WindowCases(), 11);
}

// A given scale: the scores are scale q k^T in the forward and the backward (dq and dk carry the
// scale, dv does not), with grouped heads, packed sequences and a window.
TEST(AttentionOp, DoubleMatchesTheReferenceWithAGivenScale) {
  ExpectDoubleMatchesTheReference(ScaleCases(), 21);
}

// Soft-capped scores (c tanh(s / c)) in the forward and their derivative in the backward.
TEST(AttentionOp, DoubleMatchesTheSoftCappedReference) {
  ExpectDoubleMatchesTheReference(SoftcapCases(), 31);
}

// The cap is read and bends: on one key of one query (T = 1) lse is that key's capped score
// c tanh(x / c), bounded by c where the plain score is not.
TEST(AttentionOp, LseOfASingleKeyIsItsSoftCappedScore) {
  Layout l = MakeLayout(1, 1, 1, 1, 4, 0);
  const std::vector<double> qkv = Inputs(l, 33), dout = RandomDoubles(l.out_elems(), 34);
  double dot = 0;
  for (int64_t j = 0; j < 4; ++j) dot += qkv[l.q_off + j] * qkv[l.k_off + j];
  const double score = 0.5 * dot, cap = 0.3 * std::abs(score);  // the score lies beyond the cap
  ASSERT_GT(cap, 0);
  l = Capped(l, cap);
  const double want = cap * std::tanh(score / cap);
  EXPECT_LT(std::abs(want), 0.9 * std::abs(score));
  EXPECT_NEAR(RunOp<double>(l, qkv, dout).lse[0], want, 1e-14 * std::abs(score));
  EXPECT_NEAR(Reference(l, qkv, dout).lse[0], want, 1e-14 * std::abs(score));
}

// The reference's scale is used: on one key of one query (T = 1) lse is that key's scaled score,
// so scale 0.3 and the default differ there by the factor between them.
TEST(AttentionOp, LseOfASingleKeyIsItsScoreTimesTheGivenScale) {
  const Layout l = Scaled(MakeLayout(1, 1, 1, 1, 4, 0), 0.3);
  const std::vector<double> qkv = Inputs(l, 23), dout = RandomDoubles(l.out_elems(), 24);
  double dot = 0;
  for (int64_t j = 0; j < 4; ++j) dot += qkv[l.q_off + j] * qkv[l.k_off + j];
  EXPECT_NEAR(Reference(l, qkv, dout).lse[0], 0.3 * dot, 1e-14);
  EXPECT_NEAR(RunOp<double>(l, qkv, dout).lse[0], 0.3 * dot, 1e-14);
  EXPECT_NEAR(RunOp<double>(Scaled(l, 0), qkv, dout).lse[0], 0.5 * dot, 1e-14);
}

// The reference itself: a window of 1 is attention to the query's own key alone (out = v of the
// row, lse = its own scaled score), so the windowed reference is not the causal one in disguise.
TEST(AttentionOp, WindowOfOneAttendsToTheQuerysOwnKeyOnly) {
  const Layout l = Windowed(MakeLayout(1, 9, 2, 1, 4, 0), 1);
  const std::vector<double> qkv = Inputs(l, 13), dout = RandomDoubles(l.out_elems(), 14);
  const Ref r = Reference(l, qkv, dout);
  const Got<double> g = RunOp<double>(l, qkv, dout);
  const int64_t hs = l.d.head_dim, ld = l.d.row_stride, ldo = int64_t{l.d.num_heads} * hs;
  for (int64_t t = 0; t < l.d.seq_len; ++t) {
    for (int64_t h = 0; h < l.d.num_heads; ++h) {
      for (int64_t j = 0; j < hs; ++j) {
        EXPECT_NEAR(r.out[t * ldo + h * hs + j], qkv[t * ld + l.v_off + j], 1e-12);
        EXPECT_EQ(g.out[t * ldo + h * hs + j], qkv[t * ld + l.v_off + j]) << "t " << t;
      }
    }
  }
}

template <typename S>
class AttentionOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(AttentionOpTest, StorageTypes);

// Roundings on the path: out 2 (P, out), dq/dk 3 (P, dS, the result), dv 2; fp32 sums over up
// to T keys times the group's heads (dk, dv) plus the head size. dq and dk are sums of dS whose
// rows sum to zero (softmax's Jacobian), so they cancel: their bound adds the magnitude of the
// cancelling terms (Ref::terms, terms_bound.h), with the gain margin of 2 (k = 2 R = 6).
template <typename S>
void ExpectWithinItsRoundingsOfDouble(const std::vector<Layout>& cases) {
  for (const Layout& l : cases) {
    SCOPED_TRACE(Name(l));
    const std::vector<double> qkv = Inputs(l, 3), dout = RandomDoubles(l.out_elems(), 4);
    const Got<S> g = RunOp<S>(l, qkv, dout);
    const Got<double> r = RunOp<double>(l, Rounded<S>(qkv), Rounded<S>(dout));
    const int64_t K = int64_t{l.d.seq_len} * (l.d.num_heads / l.d.num_kv_heads) + l.d.head_dim;
    ExpectWithinBound("out", ToDoubles(g.out), r.out, 4, BoundEps<S>(K));
    std::vector<double> lse(g.lse.begin(), g.lse.end());
    ExpectWithinBound("lse", lse, r.lse, 2, BoundEps<float>(K));
    const int64_t qw = int64_t{l.d.num_heads} * l.d.head_dim;
    const int64_t kvw = int64_t{l.d.num_kv_heads} * l.d.head_dim;
    const std::vector<double> terms = Reference(l, Rounded<S>(qkv), Rounded<S>(dout)).terms;
    ExpectWithinTermsBound("dq", Columns(l, g.dqkv, l.q_off, qw), Columns(l, r.dqkv, l.q_off, qw),
                           Columns(l, terms, l.q_off, qw), 6, BoundEps<S>(K));
    ExpectWithinTermsBound("dk", Columns(l, g.dqkv, l.k_off, kvw), Columns(l, r.dqkv, l.k_off, kvw),
                           Columns(l, terms, l.k_off, kvw), 6, BoundEps<S>(K));
    ExpectWithinBound("dv", Columns(l, g.dqkv, l.v_off, kvw), Columns(l, r.dqkv, l.v_off, kvw), 4,
                      BoundEps<S>(K));
  }
}

TYPED_TEST(AttentionOpTest, IsWithinItsRoundingsOfDoubleForEveryGroupSize) {
  ExpectWithinItsRoundingsOfDouble<TypeParam>(Cases());
}

// The same bounds with a window (K still counts T keys: a bound for the windowed rows too).
TYPED_TEST(AttentionOpTest, WindowedIsWithinItsRoundingsOfDouble) {
  ExpectWithinItsRoundingsOfDouble<TypeParam>(WindowCases());
}

// The same bounds with a given scale (0.3 rounded to fp32 once: within the scores' rounding).
TYPED_TEST(AttentionOpTest, AGivenScaleIsWithinItsRoundingsOfDouble) {
  ExpectWithinItsRoundingsOfDouble<TypeParam>(ScaleCases());
}

// The same bounds soft-capped: tanh adds one rounding of ComputeType<S> to each score and one to
// its derivative, within the scores' share of K.
TYPED_TEST(AttentionOpTest, SoftCappedIsWithinItsRoundingsOfDouble) {
  ExpectWithinItsRoundingsOfDouble<TypeParam>(SoftcapCases());
}

// 1 / sqrt(hs) given as the scale is the default to the bit: out, lse, dq, dk, dv. Given as the
// double 1 / sqrt(hs) for head sizes whose fp32 rounding of it is the fp32 quotient (3, 5, 8, 64);
// given as the ComputeType<S> quotient itself for every head size (6 and 7 included, where the
// double's rounding is one ulp away from it: AttentionDims::scale).
template <typename S>
void ExpectAnExplicitDefaultScaleIsBitIdentical(const Layout& base, double scale) {
  SCOPED_TRACE(Name(Scaled(base, scale)));
  const std::vector<double> qkv = Inputs(base, 25), dout = RandomDoubles(base.out_elems(), 26);
  const Got<S> plain = RunOp<S>(base, qkv, dout);
  const Got<S> g = RunOp<S>(Scaled(base, scale), qkv, dout);
  EXPECT_EQ(std::memcmp(g.out.data(), plain.out.data(), g.out.size() * sizeof(S)), 0);
  EXPECT_EQ(std::memcmp(g.lse.data(), plain.lse.data(), g.lse.size() * sizeof(ComputeType<S>)), 0);
  EXPECT_EQ(std::memcmp(g.dqkv.data(), plain.dqkv.data(), g.dqkv.size() * sizeof(S)), 0);
}

template <typename S>
class AttentionScaleTest : public ::testing::Test {};
using AllStorageTypes = ::testing::Types<double, float, Bf16, Fp16>;
TYPED_TEST_SUITE(AttentionScaleTest, AllStorageTypes);

TYPED_TEST(AttentionScaleTest, OneOverSqrtHeadDimGivenExplicitlyIsBitIdenticalToTheDefault) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const Layout& l :
       {MakeLayout(2, 67, 4, 2, 8, 3), MakeLayout(2, 70, 4, 1, 5, 2), MakeLayout(1, 9, 2, 1, 3, 0),
        MakeLayout(1, 70, 2, 2, 64, 1), Windowed(MakePacked(1, {1, 66, 3}, 4, 4, 8, 0), 9)}) {
    ExpectAnExplicitDefaultScaleIsBitIdentical<S>(
        l, 1.0 / std::sqrt(static_cast<double>(l.d.head_dim)));
  }
  for (const Layout& l : Cases()) {
    const F quotient = F(1) / std::sqrt(F(l.d.head_dim));
    ExpectAnExplicitDefaultScaleIsBitIdentical<S>(l, static_cast<double>(quotient));
  }
}

// A given scale does change the result (the field is read): 0.3 against the default.
TYPED_TEST(AttentionScaleTest, AGivenScaleChangesTheScores) {
  using S = TypeParam;
  const Layout l = MakeLayout(2, 19, 4, 2, 7, 1);
  const std::vector<double> qkv = Inputs(l, 27), dout = RandomDoubles(l.out_elems(), 28);
  const Got<S> plain = RunOp<S>(l, qkv, dout);
  const Got<S> g = RunOp<S>(Scaled(l, 0.3), qkv, dout);
  int64_t differ = 0;
  for (size_t i = 0; i < g.lse.size(); ++i) differ += g.lse[i] != plain.lse[i];
  EXPECT_GT(differ, int64_t(g.lse.size()) / 2);
}

// The terms bound still fails a wrong gradient: on a single key (T = 1) dq and dk are zero in
// exact arithmetic and the double reference's are zero or its own rounding, so the bound is
// k eps terms; an error of twice that on one element, a sign flipped on the largest dv, or dq
// replaced by its neighbouring row's (off by one position) are each reported.
TEST(AttentionOpBound, PlantedErrorsOutsideTheTermsBoundAreReported) {
  using S = Bf16;
  for (const Layout& l : {MakeLayout(1, 1, 2, 1, 3, 0), MakeLayout(3, 19, 4, 2, 7, 1)}) {
    SCOPED_TRACE(Name(l));
    const std::vector<double> qkv = Inputs(l, 3), dout = RandomDoubles(l.out_elems(), 4);
    const Got<S> g = RunOp<S>(l, qkv, dout);
    const Got<double> r = RunOp<double>(l, Rounded<S>(qkv), Rounded<S>(dout));
    const Ref terms_of = Reference(l, Rounded<S>(qkv), Rounded<S>(dout));
    const int64_t K = int64_t{l.d.seq_len} * (l.d.num_heads / l.d.num_kv_heads) + l.d.head_dim;
    const double eps = BoundEps<S>(K);
    const int64_t qw = int64_t{l.d.num_heads} * l.d.head_dim;
    const std::vector<double> ref = Columns(l, r.dqkv, l.q_off, qw);
    const std::vector<double> terms = Columns(l, terms_of.terms, l.q_off, qw);
    std::vector<double> got = Columns(l, g.dqkv, l.q_off, qw);
    ExpectWithinTermsBound("dq as computed", got, ref, terms, 6, eps);
    // Twice the bound on the element with the largest terms.
    const size_t i =
        static_cast<size_t>(std::max_element(terms.begin(), terms.end()) - terms.begin());
    ASSERT_GT(terms[i], 0.0) << "a case without cancelling terms plants nothing";
    std::vector<double> planted = got;
    planted[i] = ref[i] + 2 * terms_bound::BoundOf(i, ref, terms, terms_bound::Rms(ref), 6, eps);
    EXPECT_NONFATAL_FAILURE(ExpectWithinTermsBound("dq planted", planted, ref, terms, 6, eps),
                            "dq planted");
    if (l.d.seq_len > 1) {
      // dq off by one position: row t's values in row t + 1.
      std::vector<double> shifted(got.size(), 0.0);
      std::copy(got.begin(), got.end() - qw, shifted.begin() + qw);
      EXPECT_NONFATAL_FAILURE(ExpectWithinTermsBound("dq shifted", shifted, ref, terms, 6, eps),
                              "dq shifted");
    }
    const int64_t kvw = int64_t{l.d.num_kv_heads} * l.d.head_dim;
    const std::vector<double> dv_ref = Columns(l, r.dqkv, l.v_off, kvw);
    std::vector<double> dv = Columns(l, g.dqkv, l.v_off, kvw);
    const size_t big = static_cast<size_t>(
        std::max_element(dv_ref.begin(), dv_ref.end(),
                         [](double a, double b) { return std::abs(a) < std::abs(b); }) -
        dv_ref.begin());
    dv[big] = -dv[big];
    EXPECT_NONFATAL_FAILURE(
        ExpectWithinTermsBound("dv sign", dv, dv_ref, Columns(l, terms_of.terms, l.v_off, kvw), 4,
                               eps),
        "dv sign");
  }
}

// Packed sequences: changing one example's q, k and v (and its output gradient) changes
// nothing of the other examples of the same sequence, forward or backward, to the bit.
TYPED_TEST(AttentionOpTest, AnExampleOfAPackedSequenceDoesNotSeeTheOthers) {
  using S = TypeParam;
  const Layout l = MakePacked(2, {10, 20, 7}, 4, 2, 6, 1);
  std::vector<double> qkv = Inputs(l, 7), dout = RandomDoubles(l.out_elems(), 8);
  const Got<S> before = RunOp<S>(l, qkv, dout);
  // The middle example (tokens 10..29) of sequence 1.
  const int64_t T = l.d.seq_len, ldo = int64_t{l.d.num_heads} * l.d.head_dim;
  auto changed = [&](int64_t r) { return r >= T + 10 && r < T + 30; };
  for (int64_t r = 0; r < l.rows(); ++r) {
    if (!changed(r)) continue;
    for (int64_t j = 0; j < l.d.row_stride; ++j) qkv[r * l.d.row_stride + j] *= -1.5;
    for (int64_t j = 0; j < ldo; ++j) dout[r * ldo + j] += 0.75;
  }
  const Got<S> after = RunOp<S>(l, qkv, dout);
  int64_t differ = 0;
  for (int64_t r = 0; r < l.rows(); ++r) {
    for (int64_t j = 0; j < ldo; ++j) {
      const double a = ToFloat(before.out[r * ldo + j]), b = ToFloat(after.out[r * ldo + j]);
      if (!changed(r)) {
        ASSERT_EQ(a, b) << "out row " << r << " column " << j;
      } else {
        differ += a != b;
      }
    }
    const int64_t used = l.v_off + int64_t{l.d.num_kv_heads} * l.d.head_dim;
    for (int64_t j = 0; !changed(r) && j < used; ++j) {
      ASSERT_EQ(ToFloat(before.dqkv[r * l.d.row_stride + j]),
                ToFloat(after.dqkv[r * l.d.row_stride + j]))
          << "dqkv row " << r << " column " << j;
    }
  }
  EXPECT_GT(differ, 0) << "the changed example's own output must change";
}

// A window of T or more masks nothing: out, lse, dq, dk, dv equal those without a window to the
// bit, with and without packed sequences.
TYPED_TEST(AttentionOpTest, AWindowOfTOrMoreIsBitIdenticalToNoWindow) {
  using S = TypeParam;
  for (const Layout& base :
       {MakeLayout(2, 67, 4, 2, 8, 3), MakePacked(1, {1, 66, 3}, 4, 4, 5, 0)}) {
    const std::vector<double> qkv = Inputs(base, 15), dout = RandomDoubles(base.out_elems(), 16);
    const Got<S> plain = RunOp<S>(base, qkv, dout);
    const int T = base.d.seq_len;
    for (const int w : {T, T + 1, 1 << 30}) {
      const Layout l = Windowed(base, w);
      SCOPED_TRACE(Name(l));
      const Got<S> g = RunOp<S>(l, qkv, dout);
      EXPECT_EQ(std::memcmp(g.out.data(), plain.out.data(), g.out.size() * sizeof(S)), 0);
      EXPECT_EQ(std::memcmp(g.lse.data(), plain.lse.data(), g.lse.size() * sizeof(ComputeType<S>)),
                0);
      EXPECT_EQ(std::memcmp(g.dqkv.data(), plain.dqkv.data(), g.dqkv.size() * sizeof(S)), 0);
    }
  }
}

// A key outside a query's window does not influence that query: with k and v of token 10 of
// sequence 0 replaced (window 5: seen by queries 10..14 only), the outputs and dq of every other
// query row, and dk, dv of every key none of whose queries is 10..14 (keys before 6 and after
// 14), are unchanged to the bit, as is all of sequence 1; out row 10 does change (the check is
// not vacuous).
TYPED_TEST(AttentionOpTest, AKeyOutsideTheWindowDoesNotInfluenceTheQuery) {
  using S = TypeParam;
  const int w = 5, key = 10;
  for (const Layout& l : {Windowed(MakeLayout(2, 37, 4, 2, 7, 3), w),
                          Windowed(MakePacked(2, {3, 30, 4}, 4, 2, 6, 1), w)}) {
    SCOPED_TRACE(Name(l));
    std::vector<double> qkv = Inputs(l, 17);
    const std::vector<double> dout = RandomDoubles(l.out_elems(), 18);
    const Got<S> before = RunOp<S>(l, qkv, dout);
    const int64_t ld = l.d.row_stride, kvw = int64_t{l.d.num_kv_heads} * l.d.head_dim;
    for (int64_t j = l.k_off; j < l.v_off + kvw; ++j) {
      qkv[key * ld + j] = -1.5 * qkv[key * ld + j] + 0.5;
    }
    const Got<S> after = RunOp<S>(l, qkv, dout);
    const int64_t T = l.d.seq_len, ldo = int64_t{l.d.num_heads} * l.d.head_dim;
    const auto sees_key = [&](int64_t r) { return r >= key && r < key + w; };
    for (int64_t r = 0; r < l.rows(); ++r) {
      const bool other_row = r >= T;
      const bool same_q = other_row || !sees_key(r);
      const bool same_kv = other_row || r < key - w + 1 || r >= key + w;
      for (int64_t j = 0; j < ldo; ++j) {
        const double a = ToFloat(before.out[r * ldo + j]), b = ToFloat(after.out[r * ldo + j]);
        if (same_q) {
          ASSERT_EQ(a, b) << "out row " << r << " column " << j;
        }
      }
      for (int64_t j = 0; same_q && j < ldo; ++j) {
        ASSERT_EQ(ToFloat(before.dqkv[r * ld + l.q_off + j]),
                  ToFloat(after.dqkv[r * ld + l.q_off + j]))
            << "dq row " << r << " column " << j;
      }
      for (int64_t j = l.k_off; same_kv && j < l.v_off + kvw; ++j) {
        ASSERT_EQ(ToFloat(before.dqkv[r * ld + j]), ToFloat(after.dqkv[r * ld + j]))
            << "dk/dv row " << r << " column " << j;
      }
    }
    int64_t differ = 0;
    for (int64_t j = 0; j < ldo; ++j) {
      differ += ToFloat(before.out[key * ldo + j]) != ToFloat(after.out[key * ldo + j]);
    }
    EXPECT_GT(differ, 0) << "the changed key's own query must change";
  }
}

// A negative window is a broken invariant of the caller's dims.
TEST(AttentionOpDeathTest, ANegativeWindowIsRejected) {
  Layout l = Windowed(MakeLayout(1, 4, 1, 1, 2, 0), -1);
  const std::vector<float> qkv(l.qkv_elems(), 0.5f);
  std::vector<float> out(l.out_elems()), lse(4);
  EXPECT_DEATH(AttentionForward<float>(l.dims(), qkv.data(), qkv.data() + l.k_off,
                                       qkv.data() + l.v_off, out.data(), lse.data()),
               "window=-1");
}

// A negative or non-finite scale is a broken invariant of the caller's dims.
TEST(AttentionOpDeathTest, ANegativeOrNonFiniteScaleIsRejected) {
  for (const double scale : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    Layout l = Scaled(MakeLayout(1, 4, 1, 1, 2, 0), scale);
    const std::vector<float> qkv(l.qkv_elems(), 0.5f);
    std::vector<float> out(l.out_elems()), lse(4);
    EXPECT_DEATH(AttentionForward<float>(l.dims(), qkv.data(), qkv.data() + l.k_off,
                                         qkv.data() + l.v_off, out.data(), lse.data()),
                 "scale=");
  }
}

// The padding columns between rows are neither read into the result nor written.
TYPED_TEST(AttentionOpTest, PaddingColumnsOfStridedRowsAreLeftUntouched) {
  using S = TypeParam;
  const Layout l = MakeLayout(2, 67, 4, 2, 8, 5);
  const std::vector<double> qkv = Inputs(l, 5), dout = RandomDoubles(l.out_elems(), 6);
  const Got<S> g = RunOp<S>(l, qkv, dout);
  const int64_t used = l.v_off + int64_t{l.d.num_kv_heads} * l.d.head_dim;
  for (int64_t r = 0; r < l.rows(); ++r) {
    ASSERT_TRUE(AllPoisoned(g.dqkv.data() + r * l.d.row_stride + used, l.d.row_stride - used))
        << "row " << r;
  }
}

}  // namespace
}  // namespace strata::models::ops
