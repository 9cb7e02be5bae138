// models/ops/embedding.h: token (and learned position) embedding lookup and its gradients, the
// double instantiation against a scalar reference, every storage type against double; the scaled
// embedding (Gemma's embed_scale = sqrt(hidden_size), here sqrt(71) for the odd C) in the same
// reference and cases, with its scale rounded to S first.
#include "models/ops/embedding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/models/ops/op_test_util.h"

namespace strata::models::ops {
namespace {

using testing::AllPoisoned;
using testing::BoundEps;
using testing::Cast;
using testing::ExpectNearReference;
using testing::ExpectWithinBound;
using testing::Poisoned;
using testing::RandomDoubles;
using testing::RandomTokens;
using testing::Rounded;
using testing::ToDoubles;

// V larger than the rows' distinct tokens (absent tokens), C not a multiple of the column block.
constexpr int kV = 53, kB = 3, kT = 13, kMaxT = 17;
constexpr int64_t kC = 71, kRows = int64_t{kB} * kT;

struct Data {
  std::vector<double> table, positions, dout;
  std::vector<int32_t> tokens;
};

// Learned positions: none, row t of each sequence, or packed examples (position ids restarting
// at each example: lengths 4, 6 and 3 in every sequence of 13).
enum class Positions { kNone, kSequence, kPacked };

std::string PositionsName(Positions p) {
  return p == Positions::kNone       ? "no positions"
         : p == Positions::kSequence ? "positions"
                                     : "packed";
}

const std::vector<int32_t>& PackedIds() {
  static const std::vector<int32_t> ids = [] {
    std::vector<int32_t> v;
    for (int b = 0; b < kB; ++b) {
      for (int n : {4, 6, 3}) {
        for (int p = 0; p < n; ++p) v.push_back(p);
      }
    }
    return v;
  }();
  return ids;
}

int64_t PositionOf(int64_t row, Positions p) {
  return p == Positions::kPacked ? PackedIds()[row] : row % kT;
}

Data MakeData(uint64_t seed) {
  std::vector<int32_t> tokens = RandomTokens(kRows, kV / 2, seed + 3);  // tokens >= V/2 absent
  tokens[5] = tokens[20] = tokens[33] = 7;                              // a repeated token
  return {RandomDoubles(int64_t{kV} * kC, seed), RandomDoubles(kMaxT * kC, seed + 1),
          RandomDoubles(kRows * kC, seed + 2), tokens};
}

template <typename S>
struct Result {
  std::vector<S> out, dtable, dpositions;
};

// Gemma's embed_scale for this hidden size: sqrt(71), not representable in any storage type.
const double kScale = std::sqrt(static_cast<double>(kC));

// scale: omitted (the default argument) when nullptr, else passed.
template <typename S>
Result<S> RunOp(const Data& d, Positions mode, const double* scale = nullptr) {
  const bool positions = mode != Positions::kNone;
  const int32_t* ids = mode == Positions::kPacked ? PackedIds().data() : nullptr;
  const std::vector<S> table = Cast<S>(d.table), pos = Cast<S>(d.positions), dout = Cast<S>(d.dout);
  Result<S> r{Poisoned<S>(kRows * kC), Poisoned<S>(int64_t{kV} * kC), Poisoned<S>(kMaxT * kC)};
  const S* p = positions ? pos.data() : nullptr;
  std::vector<unsigned char> scratch(EmbeddingBackwardScratchBytes(kRows, kV));
  S* dp = positions ? r.dpositions.data() : nullptr;
  const int T = positions ? kT : 0;
  if (scale == nullptr) {
    EmbeddingForward<S>(table.data(), d.tokens.data(), kRows, kC, kV, r.out.data(), p, T, ids);
    EmbeddingBackward<S>(d.tokens.data(), dout.data(), kRows, kC, kV, r.dtable.data(),
                         scratch.data(), dp, T, ids);
  } else {
    EmbeddingForward<S>(table.data(), d.tokens.data(), kRows, kC, kV, r.out.data(), p, T, ids,
                        *scale);
    EmbeddingBackward<S>(d.tokens.data(), dout.data(), kRows, kC, kV, r.dtable.data(),
                         scratch.data(), dp, T, ids, *scale);
  }
  return r;
}

struct Ref {
  std::vector<double> out, dtable, dpositions;
};

// The reference with the table rows scaled by `scale` (1: the plain lookup): out = table s + pos,
// dtable = s sum(dout), dpositions unscaled.
Ref Reference(const Data& d, Positions mode, double scale = 1.0) {
  const bool positions = mode != Positions::kNone;
  Ref r{std::vector<double>(kRows * kC), std::vector<double>(int64_t{kV} * kC, 0.0),
        std::vector<double>(kT * kC, 0.0)};
  for (int64_t row = 0; row < kRows; ++row) {
    for (int64_t c = 0; c < kC; ++c) {
      const double g = d.dout[row * kC + c];
      r.out[row * kC + c] = d.table[d.tokens[row] * kC + c] * scale +
                            (positions ? d.positions[PositionOf(row, mode) * kC + c] : 0.0);
      r.dtable[d.tokens[row] * kC + c] += g * scale;
      r.dpositions[PositionOf(row, mode) * kC + c] += g;
    }
  }
  return r;
}

TEST(EmbeddingOp, DoubleMatchesTheScalarReferenceWithAndWithoutPositions) {
  const Data d = MakeData(1);
  for (Positions positions : {Positions::kNone, Positions::kSequence, Positions::kPacked}) {
    SCOPED_TRACE(PositionsName(positions));
    const Result<double> r = RunOp<double>(d, positions);
    const Ref ref = Reference(d, positions);
    ExpectNearReference("out", r.out, ref.out);
    ExpectNearReference("dtable", r.dtable, ref.dtable);
    if (positions != Positions::kNone) {
      ExpectNearReference("dpositions",
                          std::vector<double>(r.dpositions.begin(), r.dpositions.begin() + kT * kC),
                          ref.dpositions);
    }
  }
}

TEST(EmbeddingOp, DoubleScaledMatchesTheScalarReferenceWithAndWithoutPositions) {
  const Data d = MakeData(5);
  for (Positions positions : {Positions::kNone, Positions::kSequence, Positions::kPacked}) {
    SCOPED_TRACE(PositionsName(positions));
    const Result<double> r = RunOp<double>(d, positions, &kScale);
    const Ref ref = Reference(d, positions, kScale);
    ExpectNearReference("out", r.out, ref.out);
    ExpectNearReference("dtable", r.dtable, ref.dtable);
    if (positions != Positions::kNone) {
      ExpectNearReference("dpositions",
                          std::vector<double>(r.dpositions.begin(), r.dpositions.begin() + kT * kC),
                          ref.dpositions);
    }
  }
}

template <typename S>
class EmbeddingOpTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(EmbeddingOpTest, StorageTypes);

TYPED_TEST(EmbeddingOpTest, IsWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const Data d = MakeData(2);
  const Data rd{Rounded<S>(d.table), Rounded<S>(d.positions), Rounded<S>(d.dout), d.tokens};
  for (Positions positions : {Positions::kNone, Positions::kSequence, Positions::kPacked}) {
    SCOPED_TRACE(PositionsName(positions));
    const Result<S> got = RunOp<S>(d, positions);
    const Result<double> ref = RunOp<double>(rd, positions);
    ExpectWithinBound("out", ToDoubles(got.out), ref.out, 2, BoundEps<S>(2));
    ExpectWithinBound("dtable", ToDoubles(got.dtable), ref.dtable, 2, BoundEps<S>(kRows));
    if (positions != Positions::kNone) {
      // A position row sums its rows: kB of them, or with packing up to 3 kB.
      ExpectWithinBound(
          "dpositions", ToDoubles(got.dpositions.data(), kT * kC),
          std::vector<double>(ref.dpositions.begin(), ref.dpositions.begin() + kT * kC), 2,
          BoundEps<S>(3 * kB));
    }
  }
}

// The scaled op against double with the scale rounded to S first (the contract: s = S(scale), as
// transformers casts embed_scale to the weight dtype): out one rounding after the product (two
// with positions: the product and the sum in fp32, then S); dtable one fp32 product after the
// kRows-term sum, then S (K = kRows + 1).
TYPED_TEST(EmbeddingOpTest, ScaledIsWithinOneRoundingOfDouble) {
  using S = TypeParam;
  const Data d = MakeData(6);
  const Data rd{Rounded<S>(d.table), Rounded<S>(d.positions), Rounded<S>(d.dout), d.tokens};
  const double s = Rounded<S>({kScale})[0];
  ASSERT_NE(s, kScale) << "sqrt(71) is not representable in S";
  for (Positions positions : {Positions::kNone, Positions::kSequence, Positions::kPacked}) {
    SCOPED_TRACE(PositionsName(positions));
    const Result<S> got = RunOp<S>(d, positions, &kScale);
    const Ref ref = Reference(rd, positions, s);
    ExpectWithinBound("out", ToDoubles(got.out), ref.out, 4, BoundEps<S>(2));
    ExpectWithinBound("dtable", ToDoubles(got.dtable), ref.dtable, 2, BoundEps<S>(kRows + 1));
    if (positions != Positions::kNone) {
      ExpectWithinBound("dpositions", ToDoubles(got.dpositions.data(), kT * kC), ref.dpositions, 2,
                        BoundEps<S>(3 * kB));
    }
  }
}

// Without positions the scaled lookup is S(table[t] s) with s = S(scale) and nothing else: the
// product of two S values is exact in double (and in fp32 for the 16-bit types), so the op's
// one rounding of it equals the double product rounded to S, bit for bit. The double scale
// unrounded would give other bits (the rounding to S is the one transformers does).
TYPED_TEST(EmbeddingOpTest, ScaledLookupIsTheProductWithTheScaleRoundedToSRoundedOnce) {
  using S = TypeParam;
  const Data d = MakeData(7);
  const Result<S> got = RunOp<S>(d, Positions::kNone, &kScale);
  const std::vector<double> table = Rounded<S>(d.table);
  const double s = Rounded<S>({kScale})[0];
  int64_t unrounded_differs = 0;
  for (int64_t row = 0; row < kRows; ++row) {
    for (int64_t c = 0; c < kC; ++c) {
      const double t = table[d.tokens[row] * kC + c];
      const S want = testing::FromDouble<S>(t * s);
      ASSERT_EQ(std::memcmp(&got.out[row * kC + c], &want, sizeof(S)), 0)
          << "row " << row << " column " << c << ": " << ToFloat(got.out[row * kC + c]) << " vs "
          << ToFloat(want);
      const S unrounded = testing::FromDouble<S>(t * kScale);
      unrounded_differs += std::memcmp(&got.out[row * kC + c], &unrounded, sizeof(S)) != 0;
    }
  }
  EXPECT_GT(unrounded_differs, 0);
}

// The table gradient scales the complete sum once: row v = S(s * (fp32 sum of its dout rows in
// token order)), reproduced here bit for bit for a token repeated in rows 5, 20 and 33 and every
// other token; absent tokens stay exact zeros.
TYPED_TEST(EmbeddingOpTest, ScaledTableGradientScalesTheCompleteSumOnce) {
  using S = TypeParam;
  using F = ComputeType<S>;
  const Data d = MakeData(8);
  const Result<S> got = RunOp<S>(d, Positions::kNone, &kScale);
  const std::vector<S> dout = Cast<S>(d.dout);
  const F s = static_cast<F>(Rounded<S>({kScale})[0]);
  for (int v = 0; v < kV; ++v) {
    for (int64_t c = 0; c < kC; ++c) {
      F acc = 0;
      for (int64_t row = 0; row < kRows; ++row) {
        if (d.tokens[row] == v) acc += ToFloat(dout[row * kC + c]);
      }
      const S want = FromFloat<S>(acc * s);
      ASSERT_EQ(std::memcmp(&got.dtable[v * kC + c], &want, sizeof(S)), 0)
          << "token " << v << " column " << c;
    }
  }
}

// Scale 1.0 given explicitly is the default to the bit (out an exact copy of the table row
// without positions), forward and backward, with and without positions.
TYPED_TEST(EmbeddingOpTest, ScaleOneIsTheUnscaledOpBitForBit) {
  using S = TypeParam;
  const Data d = MakeData(9);
  const double one = 1.0;
  for (Positions positions : {Positions::kNone, Positions::kSequence, Positions::kPacked}) {
    SCOPED_TRACE(PositionsName(positions));
    const Result<S> plain = RunOp<S>(d, positions), given = RunOp<S>(d, positions, &one);
    EXPECT_TRUE(testing::SameBits(plain.out, given.out));
    EXPECT_TRUE(testing::SameBits(plain.dtable, given.dtable));
    EXPECT_TRUE(testing::SameBits(plain.dpositions, given.dpositions));
  }
}

// Absent tokens get exact zero rows; position rows at and beyond seq_len are left to the caller;
// without positions the lookup is the table row itself, bit for bit.
TYPED_TEST(EmbeddingOpTest, AbsentTokensAreZeroAndRowsBeyondSeqLenUntouched) {
  using S = TypeParam;
  const Data d = MakeData(3);
  const Result<S> r = RunOp<S>(d, Positions::kSequence);
  std::vector<bool> present(kV, false);
  for (int32_t t : d.tokens) present[t] = true;
  for (int v = 0; v < kV; ++v) {
    if (present[v]) continue;
    for (int64_t c = 0; c < kC; ++c) {
      ASSERT_EQ(ToFloat(r.dtable[v * kC + c]), 0.0f) << "token " << v;
    }
  }
  EXPECT_TRUE(AllPoisoned(r.dpositions.data() + kT * kC, (kMaxT - kT) * kC));
  const Result<S> plain = RunOp<S>(d, Positions::kNone);
  const std::vector<S> table = Cast<S>(d.table);
  for (int64_t row = 0; row < kRows; ++row) {
    ASSERT_EQ(
        std::memcmp(plain.out.data() + row * kC, table.data() + d.tokens[row] * kC, kC * sizeof(S)),
        0)
        << "row " << row;
  }
}

TEST(EmbeddingOpDeathTest, ANonFiniteScaleIsABrokenInvariant) {
  const Data d = MakeData(10);
  const std::vector<float> table = Cast<float>(d.table);
  std::vector<float> out(kRows * kC);
  EXPECT_DEATH(EmbeddingForward<float>(table.data(), d.tokens.data(), kRows, kC, kV, out.data(),
                                       nullptr, 0, nullptr, std::nan("")),
               "embedding scale");
}

TEST(EmbeddingOpDeathTest, ATokenOutsideTheVocabularyIsABrokenInvariant) {
  const Data d = MakeData(4);
  std::vector<int32_t> tokens = d.tokens;
  tokens[kRows - 1] = kV;
  const std::vector<float> table = Cast<float>(d.table);
  std::vector<float> out(kRows * kC);
  EXPECT_DEATH(EmbeddingForward<float>(table.data(), tokens.data(), kRows, kC, kV, out.data()),
               "outside");
}

}  // namespace
}  // namespace strata::models::ops
