// models/ops/cross_entropy.h: the chunked LM head (logits and cross-entropy) in both weight
// layouts, the double instantiation against a plain softmax reference for several chunkings,
// every storage type against double; the per-row losses and the per-row weights of the sequence
// objectives (row_losses, row_weights) likewise, and weights of 1 / loss_tokens against the
// mean.
#include "models/ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/models/ops/op_test_util.h"
#include "tests/models/terms_bound.h"

namespace strata::models::ops {
namespace {

using testing::BoundEps;
using testing::Cast;
using testing::ExpectNearReference;
using testing::ExpectWithinBound;
using testing::Poisoned;
using testing::RandomDoubles;
using testing::RandomTokens;
using testing::Rounded;
using testing::ToDoubles;

constexpr int kB = 3, kT = 13, kC = 11, kV = 29;
constexpr int64_t kN = int64_t{kB} * kT;

std::string LayoutName(WeightLayout l) { return l == WeightLayout::kInOut ? "in_out" : "out_in"; }

struct Data {
  std::vector<double> x, w;  // w (C, V) for kInOut, (V, C) for kOutIn: the same matrix W
  std::vector<int32_t> targets;
};

// W[c][v] stored in `layout`.
std::vector<double> Stored(const std::vector<double>& w_cv, WeightLayout layout) {
  if (layout == WeightLayout::kInOut) return w_cv;
  std::vector<double> w(w_cv.size());
  for (int c = 0; c < kC; ++c) {
    for (int v = 0; v < kV; ++v) w[int64_t{v} * kC + c] = w_cv[int64_t{c} * kV + v];
  }
  return w;
}

Data MakeData(uint64_t seed) {
  return {RandomDoubles(kN * kC, seed, 1.5), RandomDoubles(int64_t{kC} * kV, seed + 1),
          RandomTokens(kN, kV, seed + 2)};
}

// MakeData with every third target (and the last) ignored (-1, engine::kIgnoreTarget).
Data MakeMaskedData(uint64_t seed) {
  Data d = MakeData(seed);
  for (int64_t r = 0; r < kN; ++r) {
    if (r % 3 == 1 || r == kN - 1) d.targets[r] = -1;
  }
  return d;
}

// The targets that count.
int64_t Counted(const Data& d) {
  return std::count_if(d.targets.begin(), d.targets.end(), [](int32_t t) { return t >= 0; });
}

struct Ref {
  double loss;
  std::vector<double> last_logits, dx, dw_cv;  // dw as (C, V)
  std::vector<double> row_losses;              // (N)
  // The magnitudes of the terms of dx and dw (terms_bound.h): the products evaluated with |g|,
  // |W| and |x|. The weights' signs cancel rows against each other in dw.
  std::vector<double> dx_terms, dw_terms;
};

// The mean over the counted targets; an ignored row has no loss and no gradient. cap > 0: every
// logit l soft-capped to cap tanh(l / cap), each dlogit times 1 - tanh^2 (Gemma 2). weights (N)
// or null: the objective sum_t w_t CE_t instead of the mean.
Ref Reference(const Data& d, double dloss, double cap = 0,
              const std::vector<float>* weights = nullptr) {
  Ref r{0,
        std::vector<double>(int64_t{kB} * kV),
        std::vector<double>(kN * kC, 0.0),
        std::vector<double>(int64_t{kC} * kV, 0.0),
        std::vector<double>(kN, 0.0),
        std::vector<double>(kN * kC, 0.0),
        std::vector<double>(int64_t{kC} * kV, 0.0)};
  const double n = static_cast<double>(Counted(d));
  for (int64_t row = 0; row < kN; ++row) {
    std::vector<double> logits(kV, 0.0);
    for (int v = 0; v < kV; ++v) {
      for (int c = 0; c < kC; ++c) logits[v] += d.x[row * kC + c] * d.w[int64_t{c} * kV + v];
    }
    std::vector<double> dcap(kV, 1.0);
    for (int v = 0; cap > 0 && v < kV; ++v) {
      const double u = std::tanh(logits[v] / cap);
      logits[v] = cap * u;
      dcap[v] = 1 - u * u;
    }
    if (row % kT == kT - 1) std::copy(logits.begin(), logits.end(), &r.last_logits[row / kT * kV]);
    if (d.targets[row] < 0) continue;
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - mx);
    r.row_losses[row] = std::log(sum) + mx - logits[d.targets[row]];
    r.loss += r.row_losses[row];
    const double scale = weights == nullptr ? dloss / n : dloss * (*weights)[row];
    for (int v = 0; v < kV; ++v) {
      const double g =
          scale * (std::exp(logits[v] - mx) / sum - (v == d.targets[row] ? 1.0 : 0.0)) * dcap[v];
      for (int c = 0; c < kC; ++c) {
        r.dx[row * kC + c] += g * d.w[int64_t{c} * kV + v];
        r.dw_cv[int64_t{c} * kV + v] += d.x[row * kC + c] * g;
        r.dx_terms[row * kC + c] += std::abs(g * d.w[int64_t{c} * kV + v]);
        r.dw_terms[int64_t{c} * kV + v] += std::abs(d.x[row * kC + c] * g);
      }
    }
  }
  r.loss /= n;
  return r;
}

template <typename S>
struct Result {
  double loss;
  std::vector<double> last_logits, dx, dw_cv;
  std::vector<float> row_losses;  // (N), the op's row_losses output
};

// w_cv: W as (C, V); passed to the op stored in `layout`. chunk_rows 0 = the default. weights:
// the backward's row_weights (null: the mean).
template <typename S>
Result<S> RunOp(const Data& d, WeightLayout layout, double dloss, int64_t chunk_rows,
                double cap = 0, const std::vector<float>* weights = nullptr) {
  const std::vector<S> x = Cast<S>(d.x), w = Cast<S>(Stored(d.w, layout));
  std::vector<unsigned char> scratch(LmHeadScratchBytes<S>(kB, kT, kC, kV, chunk_rows));
  std::vector<S> last = Poisoned<S>(int64_t{kB} * kV), dx = Poisoned<S>(kN * kC),
                 dw = Poisoned<S>(int64_t{kC} * kV);
  std::vector<float> row_losses = Poisoned<float>(kN);
  const double loss =
      LmHeadForward<S>(x.data(), w.data(), layout, d.targets.data(), kB, kT, kC, kV, last.data(),
                       scratch.data(), chunk_rows, Counted(d), cap, row_losses.data());
  LmHeadBackward<S>(x.data(), w.data(), layout, d.targets.data(),
                    static_cast<ComputeType<S>>(dloss), kB, kT, kC, kV, dx.data(), dw.data(),
                    scratch.data(), chunk_rows, Counted(d), cap,
                    weights == nullptr ? nullptr : weights->data());
  // dw back to (C, V).
  std::vector<double> dw_d = ToDoubles(dw), dw_cv(dw_d.size());
  for (int c = 0; c < kC; ++c) {
    for (int v = 0; v < kV; ++v) {
      dw_cv[int64_t{c} * kV + v] =
          layout == WeightLayout::kInOut ? dw_d[int64_t{c} * kV + v] : dw_d[int64_t{v} * kC + c];
    }
  }
  return {loss, ToDoubles(last), ToDoubles(dx), dw_cv, row_losses};
}

// Chunkings: one row per chunk, 7 rows (not dividing N), all rows, the default.
constexpr int64_t kChunkings[] = {1, 7, kN, 0};

TEST(LmHeadOp, DoubleMatchesThePlainSoftmaxReferenceForEveryLayoutAndChunking) {
  for (const Data& d : {MakeData(1), MakeMaskedData(1)}) {
    const Ref ref = Reference(d, 0.7);
    for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
      for (int64_t chunk : kChunkings) {
        SCOPED_TRACE(LayoutName(layout) + " chunk_rows=" + std::to_string(chunk) +
                     " counted=" + std::to_string(Counted(d)));
        const Result<double> r = RunOp<double>(d, layout, 0.7, chunk);
        ExpectNearReference("loss", {r.loss}, {ref.loss});
        ExpectNearReference("last logits", r.last_logits, ref.last_logits);
        ExpectNearReference("dx", r.dx, ref.dx);
        ExpectNearReference("dw", r.dw_cv, ref.dw_cv);
        // An ignored row's gradient is exactly zero.
        for (int64_t row = 0; row < kN; ++row) {
          for (int c = 0; d.targets[row] < 0 && c < kC; ++c) ASSERT_EQ(r.dx[row * kC + c], 0.0);
        }
      }
    }
  }
}

// Final-logit soft-capping (Gemma 2) at caps of the order of the logits (a few units here), so
// that tanh saturates on some: loss, last logits and gradients against the capped reference.
TEST(LmHeadOp, DoubleMatchesTheSoftCappedReference) {
  for (const Data& d : {MakeData(5), MakeMaskedData(5)}) {
    for (double cap : {0.5, 2.0}) {
      const Ref ref = Reference(d, 0.7, cap);
      for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
        for (int64_t chunk : {int64_t{7}, int64_t{0}}) {
          SCOPED_TRACE(LayoutName(layout) + " chunk_rows=" + std::to_string(chunk) +
                       " cap=" + std::to_string(cap));
          const Result<double> r = RunOp<double>(d, layout, 0.7, chunk, cap);
          ExpectNearReference("loss", {r.loss}, {ref.loss});
          ExpectNearReference("last logits", r.last_logits, ref.last_logits);
          ExpectNearReference("dx", r.dx, ref.dx);
          ExpectNearReference("dw", r.dw_cv, ref.dw_cv);
          for (double l : r.last_logits) ASSERT_LT(std::abs(l), cap);
        }
      }
    }
  }
  // The cap is read: the uncapped loss is another.
  const Data d = MakeData(5);
  EXPECT_GT(std::abs(RunOp<double>(d, WeightLayout::kInOut, 0.7, 0, 2.0).loss -
                     RunOp<double>(d, WeightLayout::kInOut, 0.7, 0).loss),
            0.01);
}

TEST(LmHeadOp, WithoutTargetsReturnsZeroAndTheSameLastLogits) {
  const Data d = MakeData(2);
  const std::vector<float> x = Cast<float>(d.x), w = Cast<float>(d.w);
  std::vector<unsigned char> scratch(LmHeadScratchBytes<float>(kB, kT, kC, kV));
  std::vector<float> with(int64_t{kB} * kV), without(int64_t{kB} * kV);
  const float loss =
      LmHeadForward<float>(x.data(), w.data(), WeightLayout::kInOut, d.targets.data(), kB, kT, kC,
                           kV, with.data(), scratch.data());
  EXPECT_GT(loss, 0.5f);
  EXPECT_EQ(LmHeadForward<float>(x.data(), w.data(), WeightLayout::kInOut, nullptr, kB, kT, kC, kV,
                                 without.data(), scratch.data()),
            0.0f);
  EXPECT_EQ(with, without);
}

template <typename S>
class LmHeadOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(LmHeadOpTest, StorageTypes);

// Roundings: logits 1 (then the loss in fp32 from them), dlogits 2, dx 3, dw 3; fp32 sums over
// C (logits), V (dx, softmax) and N (dw).
TYPED_TEST(LmHeadOpTest, IsWithinItsRoundingsOfDoubleInBothLayouts) {
  using S = TypeParam;
  for (const Data& d : {MakeData(3), MakeMaskedData(3)}) {
    const Data rd{Rounded<S>(d.x), Rounded<S>(d.w), d.targets};
    const int64_t K = std::max<int64_t>({kC, kV, kN});
    for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
      for (int64_t chunk : {int64_t{7}, int64_t{0}}) {
        SCOPED_TRACE(LayoutName(layout) + " chunk_rows=" + std::to_string(chunk));
        const Result<S> got = RunOp<S>(d, layout, 1.3, chunk);
        const Result<double> ref = RunOp<double>(rd, layout, 1.3, chunk);
        ExpectWithinBound("loss", {got.loss}, {ref.loss}, 2, BoundEps<S>(K));
        ExpectWithinBound("last logits", got.last_logits, ref.last_logits, 2, BoundEps<S>(kC));
        ExpectWithinBound("dx", got.dx, ref.dx, 6, BoundEps<S>(K));
        ExpectWithinBound("dw", got.dw_cv, ref.dw_cv, 6, BoundEps<S>(K));
      }
    }
  }
}

// Soft-capped: the capped logit adds a rounding to S (and tanh one in ComputeType<S>), the
// dlogit's factor 1 - u^2 one more in ComputeType<S>.
TYPED_TEST(LmHeadOpTest, SoftCappedIsWithinItsRoundingsOfDouble) {
  using S = TypeParam;
  for (const Data& d : {MakeData(6), MakeMaskedData(6)}) {
    const Data rd{Rounded<S>(d.x), Rounded<S>(d.w), d.targets};
    const int64_t K = std::max<int64_t>({kC, kV, kN});
    for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
      SCOPED_TRACE(LayoutName(layout));
      const Result<S> got = RunOp<S>(d, layout, 1.3, 7, 2.0);
      const Result<double> ref = RunOp<double>(rd, layout, 1.3, 7, 2.0);
      ExpectWithinBound("loss", {got.loss}, {ref.loss}, 3, BoundEps<S>(K));
      ExpectWithinBound("last logits", got.last_logits, ref.last_logits, 3, BoundEps<S>(kC));
      ExpectWithinBound("dx", got.dx, ref.dx, 8, BoundEps<S>(K));
      ExpectWithinBound("dw", got.dw_cv, ref.dw_cv, 8, BoundEps<S>(K));
    }
  }
}

// ---------------------------------------------------------------------------
// Per-row losses (row_losses) and per-row weights (row_weights): the sequence objectives of
// preference training (engine::BlockBuffers::target_losses, target_weights).

// The backward's weights: uniform in [-2, 2] with every fifth exactly 0; the ignored rows get
// weights too, which the op must not apply.
std::vector<float> RandomWeights(uint64_t seed) {
  const std::vector<double> u = RandomDoubles(kN, seed, 2.0);
  std::vector<float> w(kN);
  for (int64_t r = 0; r < kN; ++r) w[r] = r % 5 == 2 ? 0.0f : static_cast<float>(u[r]);
  return w;
}

std::vector<double> Widened(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// What every run with weights must show exactly: an ignored row has loss 0 and dx 0, a counted
// row of weight 0 has dx 0.
void ExpectIgnoredAndZeroWeightRowsExactlyZero(const Data& d, const std::vector<float>& weights,
                                               const std::vector<float>& row_losses,
                                               const std::vector<double>& dx) {
  for (int64_t row = 0; row < kN; ++row) {
    if (d.targets[row] < 0) {
      ASSERT_EQ(row_losses[row], 0.0f) << "ignored row " << row;
    }
    if (d.targets[row] >= 0 && weights[row] != 0.0f) continue;
    for (int c = 0; c < kC; ++c) ASSERT_EQ(dx[row * kC + c], 0.0) << "row " << row;
  }
}

// In double: each row's loss is the reference's rounded to fp32 once (for S = double the output
// is that rounding: within 2^-24 of it, relative); the weighted gradients are the reference's up
// to double rounding, bounded on their terms (the weights' signs cancel rows against each other
// in dw).
TEST(LmHeadOp, DoublePerRowLossesAndWeightedGradientsMatchTheReference) {
  const std::vector<float> weights = RandomWeights(8);
  for (const Data& d : {MakeData(7), MakeMaskedData(7)}) {
    for (double cap : {0.0, 2.0}) {
      const Ref ref = Reference(d, 0.7, cap, &weights);
      const Ref mean = Reference(d, 0.7, cap);
      for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
        for (int64_t chunk : kChunkings) {
          SCOPED_TRACE(LayoutName(layout) + " chunk_rows=" + std::to_string(chunk) +
                       " cap=" + std::to_string(cap) + " counted=" + std::to_string(Counted(d)));
          const Result<double> r = RunOp<double>(d, layout, 0.7, chunk, cap, &weights);
          ExpectWithinBound("row losses", Widened(r.row_losses), ref.row_losses, 1.0,
                            0x1p-24 + 1e-12);
          ExpectNearReference("loss (still the mean)", {r.loss}, {mean.loss});
          terms_bound::ExpectWithinTermsBound("weighted dx", r.dx, ref.dx, ref.dx_terms, 1.0,
                                              1e-12);
          terms_bound::ExpectWithinTermsBound("weighted dw", r.dw_cv, ref.dw_cv, ref.dw_terms, 1.0,
                                              1e-12);
          ExpectIgnoredAndZeroWeightRowsExactlyZero(d, weights, r.row_losses, r.dx);
        }
      }
    }
  }
  // The weights are read: the mean's gradient is another.
  const Data d = MakeData(7);
  EXPECT_GT(std::abs(RunOp<double>(d, WeightLayout::kInOut, 0.7, 0, 0, &weights).dx[0] -
                     RunOp<double>(d, WeightLayout::kInOut, 0.7, 0).dx[0]),
            1e-6);
}

// Storage types against the plain reference on the S-rounded inputs. A row's loss has the
// roundings of the mean (2; soft-capped 3, as the tests above count them) and is the very value
// the mean sums: the returned loss is the rows' sum in double in token order over the counted
// ones, rounded to fp32, bit for bit. A weighted dlogit adds one fp32 rounding (scale_t =
// dloss w_t) to the mean's path, one of the fp32 terms that K 2^-24 counts: dx and dw keep
// the mean's k (6; soft-capped 8), on the terms of their sums.
TYPED_TEST(LmHeadOpTest, PerRowLossesAndWeightedGradientsAreWithinTheirRoundingsOfDouble) {
  using S = TypeParam;
  const std::vector<float> weights = RandomWeights(9);
  for (const Data& d : {MakeData(10), MakeMaskedData(10)}) {
    const Data rd{Rounded<S>(d.x), Rounded<S>(d.w), d.targets};
    const int64_t K = std::max<int64_t>({kC, kV, kN});
    for (double cap : {0.0, 2.0}) {
      const Ref ref = Reference(rd, 1.3, cap, &weights);
      const double k_loss = cap > 0 ? 3 : 2, k_grad = cap > 0 ? 8 : 6;
      for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
        SCOPED_TRACE(LayoutName(layout) + " cap=" + std::to_string(cap) +
                     " counted=" + std::to_string(Counted(d)));
        const Result<S> got = RunOp<S>(d, layout, 1.3, 7, cap, &weights);
        ExpectWithinBound("row losses", Widened(got.row_losses), ref.row_losses, k_loss,
                          BoundEps<S>(K));
        double sum = 0;
        for (float l : got.row_losses) sum += l;
        EXPECT_EQ(got.loss,
                  static_cast<double>(static_cast<float>(sum / static_cast<double>(Counted(d)))));
        terms_bound::ExpectWithinTermsBound("weighted dx", got.dx, ref.dx, ref.dx_terms, k_grad,
                                            BoundEps<S>(K));
        terms_bound::ExpectWithinTermsBound("weighted dw", got.dw_cv, ref.dw_cv, ref.dw_terms,
                                            k_grad, BoundEps<S>(K));
        ExpectIgnoredAndZeroWeightRowsExactlyZero(d, weights, got.row_losses, got.dx);
      }
    }
  }
}

template <typename S>
class LmHeadMeanWeightsTest : public ::testing::Test {};
using AllTypes = ::testing::Types<double, float, Bf16, Fp16>;
TYPED_TEST_SUITE(LmHeadMeanWeightsTest, AllTypes);

// MakeData with the rows of `ignored` ignored.
Data WithIgnored(uint64_t seed, const std::vector<int64_t>& ignored) {
  Data d = MakeData(seed);
  for (int64_t r : ignored) d.targets[r] = -1;
  return d;
}

// Weights of 1 / n on the n counted rows (5 on the ignored ones, never applied) give the mean's
// gradient. Bit for bit when 1 / n is a power of two (n = 32): fl(dloss fl(1 / n)) and
// fl(dloss / n) are then both the exact dloss / n. Otherwise (n = 25) not bit for bit: the two
// scales differ by up to three fp32 roundings (one in fl(1 / n), one in each product or
// quotient), which can move a dlogit across a rounding boundary of S (one ulp) and the outputs'
// fp32 sums by their terms' K 2^-24: |weighted - mean| <= 2 eps (|mean| + rms + terms) with eps
// = u + K 2^-24 (K > 3 covers the scales; in double, where nothing else rounds to fp32, eps =
// 2^-24, the fp32 weight's rounding). Every other output (loss, last logits) is untouched.
TYPED_TEST(LmHeadMeanWeightsTest, WeightsOfOneOverTheCountGiveTheMeansGradient) {
  using S = TypeParam;
  const int64_t K = std::max<int64_t>({kC, kV, kN});
  const double eps = std::is_same_v<S, double> ? 0x1p-24 : BoundEps<S>(K);
  const std::vector<int64_t> seven = {1, 5, 9, 14, 20, 27, 38};
  const std::vector<int64_t> fourteen = {0, 1, 5, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 38};
  for (const std::vector<int64_t>* ignored : {&seven, &fourteen}) {
    const Data d = WithIgnored(12, *ignored);
    const int64_t n = Counted(d);
    ASSERT_EQ(n, kN - static_cast<int64_t>(ignored->size()));
    std::vector<float> weights(kN);
    for (int64_t r = 0; r < kN; ++r) {
      weights[r] = d.targets[r] < 0 ? 5.0f : 1.0f / static_cast<float>(n);
    }
    for (double cap : {0.0, 2.0}) {
      const Ref terms = Reference(Data{Rounded<S>(d.x), Rounded<S>(d.w), d.targets}, 1.3, cap);
      for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
        SCOPED_TRACE(LayoutName(layout) + " cap=" + std::to_string(cap) +
                     " counted=" + std::to_string(n));
        const Result<S> mean = RunOp<S>(d, layout, 1.3, 7, cap);
        const Result<S> weighted = RunOp<S>(d, layout, 1.3, 7, cap, &weights);
        EXPECT_EQ(weighted.loss, mean.loss);
        EXPECT_TRUE(testing::SameBits(weighted.last_logits, mean.last_logits));
        if (n == 32) {
          EXPECT_TRUE(testing::SameBits(weighted.dx, mean.dx)) << "dx";
          EXPECT_TRUE(testing::SameBits(weighted.dw_cv, mean.dw_cv)) << "dw";
        } else {
          terms_bound::ExpectWithinTermsBound("dx", weighted.dx, mean.dx, terms.dx_terms, 2, eps);
          terms_bound::ExpectWithinTermsBound("dw", weighted.dw_cv, mean.dw_cv, terms.dw_terms, 2,
                                              eps);
        }
      }
    }
  }
}

// The new outputs are optional and change nothing else: without row_losses the loss and the last
// logits are the same bits.
TYPED_TEST(LmHeadMeanWeightsTest, RowLossesChangeNoOtherOutput) {
  using S = TypeParam;
  const Data d = MakeMaskedData(13);
  const std::vector<S> x = Cast<S>(d.x), w = Cast<S>(d.w);
  std::vector<unsigned char> scratch(LmHeadScratchBytes<S>(kB, kT, kC, kV));
  std::vector<S> with = Poisoned<S>(int64_t{kB} * kV), without = Poisoned<S>(int64_t{kB} * kV);
  std::vector<float> row_losses = Poisoned<float>(kN);
  const ComputeType<S> loss_with =
      LmHeadForward<S>(x.data(), w.data(), WeightLayout::kInOut, d.targets.data(), kB, kT, kC, kV,
                       with.data(), scratch.data(), 0, Counted(d), 0, row_losses.data());
  const ComputeType<S> loss_without =
      LmHeadForward<S>(x.data(), w.data(), WeightLayout::kInOut, d.targets.data(), kB, kT, kC, kV,
                       without.data(), scratch.data(), 0, Counted(d));
  EXPECT_TRUE(testing::SameBits(std::vector<ComputeType<S>>{loss_with},
                                std::vector<ComputeType<S>>{loss_without}));
  EXPECT_TRUE(testing::SameBits(with, without));
  // Without targets no row is computed and row_losses is not written.
  std::vector<float> untouched = Poisoned<float>(kN);
  LmHeadForward<S>(x.data(), w.data(), WeightLayout::kInOut, nullptr, kB, kT, kC, kV,
                   without.data(), scratch.data(), 0, 0, 0, untouched.data());
  EXPECT_TRUE(testing::AllPoisoned(untouched.data(), untouched.size()));
}

}  // namespace
}  // namespace strata::models::ops
