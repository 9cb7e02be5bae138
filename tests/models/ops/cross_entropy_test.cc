// models/ops/cross_entropy.h: the chunked LM head (logits and cross-entropy) in both weight
// layouts, the double instantiation against a plain softmax reference for several chunkings,
// every storage type against double.
#include "models/ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/models/ops/op_test_util.h"

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
};

// The mean over the counted targets; an ignored row has no loss and no gradient. cap > 0: every
// logit l soft-capped to cap tanh(l / cap), each dlogit times 1 - tanh^2 (Gemma 2).
Ref Reference(const Data& d, double dloss, double cap = 0) {
  Ref r{0, std::vector<double>(int64_t{kB} * kV), std::vector<double>(kN * kC, 0.0),
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
    r.loss += std::log(sum) + mx - logits[d.targets[row]];
    for (int v = 0; v < kV; ++v) {
      const double g = dloss / n *
                       (std::exp(logits[v] - mx) / sum - (v == d.targets[row] ? 1.0 : 0.0)) *
                       dcap[v];
      for (int c = 0; c < kC; ++c) {
        r.dx[row * kC + c] += g * d.w[int64_t{c} * kV + v];
        r.dw_cv[int64_t{c} * kV + v] += d.x[row * kC + c] * g;
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
};

// w_cv: W as (C, V); passed to the op stored in `layout`. chunk_rows 0 = the default.
template <typename S>
Result<S> RunOp(const Data& d, WeightLayout layout, double dloss, int64_t chunk_rows,
                double cap = 0) {
  const std::vector<S> x = Cast<S>(d.x), w = Cast<S>(Stored(d.w, layout));
  std::vector<unsigned char> scratch(LmHeadScratchBytes<S>(kB, kT, kC, kV, chunk_rows));
  std::vector<S> last = Poisoned<S>(int64_t{kB} * kV), dx = Poisoned<S>(kN * kC),
                 dw = Poisoned<S>(int64_t{kC} * kV);
  const double loss = LmHeadForward<S>(x.data(), w.data(), layout, d.targets.data(), kB, kT, kC, kV,
                                       last.data(), scratch.data(), chunk_rows, Counted(d), cap);
  LmHeadBackward<S>(x.data(), w.data(), layout, d.targets.data(),
                    static_cast<ComputeType<S>>(dloss), kB, kT, kC, kV, dx.data(), dw.data(),
                    scratch.data(), chunk_rows, Counted(d), cap);
  // dw back to (C, V).
  std::vector<double> dw_d = ToDoubles(dw), dw_cv(dw_d.size());
  for (int c = 0; c < kC; ++c) {
    for (int v = 0; v < kV; ++v) {
      dw_cv[int64_t{c} * kV + v] =
          layout == WeightLayout::kInOut ? dw_d[int64_t{c} * kV + v] : dw_d[int64_t{v} * kC + c];
    }
  }
  return {loss, ToDoubles(last), ToDoubles(dx), dw_cv};
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

}  // namespace
}  // namespace strata::models::ops
