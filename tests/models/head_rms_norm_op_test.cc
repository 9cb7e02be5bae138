// models/ops/head_rms_norm.h (Qwen3's q_norm / k_norm over the q and k heads of the fused qkv
// rows): every storage type element by element against the double reference written in
// head_rms_norm_reference.h (the double reference itself against central finite differences);
// each head bit for bit RmsNormForward/RmsNormBackward on that head; the v and pad columns
// untouched bit for bit; the weight gradient independent of the thread count. unit_offset (Gemma
// 3's q_norm / k_norm, the multiplier 1 + w): every storage type against the double reference,
// each head bit for bit RMSNorm with unit_offset, and bit for bit the plain op given the weights
// 1 + w where those are exact.
#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "models/ops/head_rms_norm.h"
#include "models/ops/host_ops.h"
#include "models/ops/rms_norm.h"
#include "tests/models/head_rms_norm_reference.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/terms_bound.h"

namespace strata::models::ops {
namespace {

using op_test::Cast;
using op_test::ChangedOtherColumns;
using op_test::Close;
using op_test::Eps;
using op_test::ExpectWithinBound;
using op_test::HeadDims;
using op_test::HeadRmsInputs;
using op_test::HeadRmsNormReference;
using op_test::HeadRmsWeights;
using op_test::Poisoned;
using op_test::QkColumns;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;

constexpr double kEpsQwen3 = 1e-6;  // Qwen3's rms_norm_eps

// Qwen3-like GQA (H = 4, Hkv = 2) and MHA with one head each; odd head widths (6, 10) and
// Qwen3's 128; rows below, across and past the host's 64-row blocks of the weight gradient and
// never a multiple of the CUDA blocks (16 rows, 8 warps); one shape with padding past v.
const HeadDims kDims[] = {
    {37, 4, 2, 6}, {131, 4, 2, 6, 3}, {19, 1, 1, 10}, {67, 4, 2, 128}, {5, 1, 1, 128},
};

template <typename S>
std::vector<uint8_t> Bits(const std::vector<S>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(S));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename S>
class HeadRmsNormTypedTest : public ::testing::Test {};
using AllStorageTypes = ::testing::Types<float, Bf16, Fp16, double>;
TYPED_TEST_SUITE(HeadRmsNormTypedTest, AllStorageTypes);

// Bounds (tests/models/terms_bound.h): rstd an F sum of hs squares, never rounded; y rstd's
// error and one rounding; dx two F sums of hs terms and one rounding, relative to the terms that
// cancel in g - xhat mean(g xhat); dw an F sum over the part's (row, head) pairs of dy xhat (xhat
// with rstd's error) and one rounding, relative to the sum of |dy xhat|.
TYPED_TEST(HeadRmsNormTypedTest, AgreesWithTheDoubleReferenceElementByElement) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    const int64_t n = d.rows * d.ld();
    const std::vector<double> x = Rounded<S>(HeadRmsInputs(d, 1));
    const std::vector<double> w = Rounded<S>(HeadRmsWeights(d.hs, 2));
    const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 3));
    const op_test::HeadRmsNormRef ref = HeadRmsNormReference(x, w, dy, d, kEpsQwen3);

    const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy);
    std::vector<S> qk = xs, raw = Poisoned<S>(d.rows * d.width());
    std::vector<F> rstd(d.rows * d.num_heads());
    HeadRmsNormForward<S>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), kEpsQwen3,
                          raw.data(), rstd.data());
    std::vector<S> dqk = dys, dw = Poisoned<S>(2 * d.hs);
    HeadRmsNormBackward<S>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), rstd.data(),
                           dqk.data(), d.ld(), dw.data());

    EXPECT_EQ(Bits(raw), Bits(QkColumns(xs, d))) << "raw is the pre-norm q and k columns";
    EXPECT_EQ(ChangedOtherColumns(qk, xs, d), 0) << "the forward wrote v or pad columns";
    EXPECT_EQ(ChangedOtherColumns(dqk, dys, d), 0) << "the backward wrote v or pad columns";
    const int max_heads = d.H > d.Hkv ? d.H : d.Hkv;
    ExpectWithinBound("rstd", ToDoubles(rstd), ref.rstd, 2, Eps<F>(d.hs));
    ExpectWithinBound("y", ToDoubles(QkColumns(qk, d)), ref.y, 2, Eps<S>(d.hs));
    terms_bound::ExpectWithinTermsBound("dx", ToDoubles(QkColumns(dqk, d)), ref.dx, ref.dx_terms, 4,
                                        Eps<S>(2 * d.hs));
    terms_bound::ExpectWithinTermsBound("dw", ToDoubles(dw), ref.dw, ref.dw_terms, 2,
                                        Eps<S>(d.rows * max_heads + d.hs));
  }
}

// The op is RMSNorm on each head: the q heads (gathered in (row, head) order) through
// RmsNormForward/RmsNormBackward with q_norm.weight, the k heads with k_norm.weight, give the
// same bits: y, rstd and dx always; dw when the rows fit one 64-row block of the weight gradient
// (then both sum the same products in the same order from 0).
TYPED_TEST(HeadRmsNormTypedTest, EachHeadIsBitForBitTheRmsNormOfThatHead) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    const std::vector<S> xs = Cast<S>(HeadRmsInputs(d, 4));
    const std::vector<S> ws = Cast<S>(HeadRmsWeights(d.hs, 5));
    const std::vector<S> dys = Cast<S>(RandomValues(d.rows * d.ld(), 1.0, 6));
    std::vector<S> qk = xs, raw(d.rows * d.width()), dqk = dys, dw(2 * d.hs);
    std::vector<F> rstd(d.rows * d.num_heads());
    HeadRmsNormForward<S>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), kEpsQwen3,
                          raw.data(), rstd.data());
    HeadRmsNormBackward<S>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), rstd.data(),
                           dqk.data(), d.ld(), dw.data());

    for (int part = 0; part < 2; ++part) {
      const int h0 = part == 0 ? 0 : d.H, h1 = part == 0 ? d.H : d.num_heads();
      const int64_t n_rows = d.rows * (h1 - h0);
      // The part's heads as rows of hs, in (row, head) order: inputs, dy and the op's results.
      std::vector<S> x_rows, dy_rows, y_op, dx_op;
      std::vector<F> rstd_op;
      for (int64_t r = 0; r < d.rows; ++r) {
        for (int h = h0; h < h1; ++h) {
          const int64_t at = r * d.ld() + h * d.hs;
          x_rows.insert(x_rows.end(), xs.begin() + at, xs.begin() + at + d.hs);
          dy_rows.insert(dy_rows.end(), dys.begin() + at, dys.begin() + at + d.hs);
          y_op.insert(y_op.end(), qk.begin() + at, qk.begin() + at + d.hs);
          dx_op.insert(dx_op.end(), dqk.begin() + at, dqk.begin() + at + d.hs);
          rstd_op.push_back(rstd[r * d.num_heads() + h]);
        }
      }
      const S* wp = ws.data() + part * d.hs;
      std::vector<S> y(n_rows * d.hs), dx(n_rows * d.hs), dwp(d.hs);
      std::vector<F> rstd_rms(n_rows);
      RmsNormForward<S>(x_rows.data(), wp, kEpsQwen3, n_rows, d.hs, y.data(), rstd_rms.data());
      RmsNormBackward<S>(x_rows.data(), wp, rstd_rms.data(), dy_rows.data(), nullptr, n_rows, d.hs,
                         dx.data(), dwp.data());
      const std::string tag = part == 0 ? "q heads" : "k heads";
      EXPECT_EQ(Bits(y_op), Bits(y)) << tag;
      EXPECT_EQ(Bits(rstd_op), Bits(rstd_rms)) << tag;
      EXPECT_EQ(Bits(dx_op), Bits(dx)) << tag;
      if (d.rows <= kHeadRmsRowsPerBlock) {
        const std::vector<S> dw_op(dw.begin() + part * d.hs, dw.begin() + (part + 1) * d.hs);
        EXPECT_EQ(Bits(dw_op), Bits(dwp)) << tag;
      }
    }
  }
}

// L = sum(dy * y(x, w)) on the double op: dL/dx is the backward's dqk, dL/dw its dw.
TEST(HeadRmsNormOp, DoubleBackwardMatchesCentralFiniteDifferences) {
  const HeadDims d{7, 2, 1, 6, 2};
  const int64_t n = d.rows * d.ld();
  std::vector<double> x = HeadRmsInputs(d, 7);
  for (int64_t c = 0; c < d.hs; ++c) x[c] = 0.1 * (c + 1);  // the zero head has no derivative
  std::vector<double> w = HeadRmsWeights(d.hs, 8);
  const std::vector<double> dy = RandomValues(n, 1.0, 9);
  auto loss = [&] {
    std::vector<double> qk = x, raw(d.rows * d.width()), rstd(d.rows * d.num_heads());
    HeadRmsNormForward<double>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, w.data(),
                               kEpsQwen3, raw.data(), rstd.data());
    double l = 0;
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.width(); ++c) l += dy[r * d.ld() + c] * qk[r * d.ld() + c];
    }
    return l;
  };
  std::vector<double> qk = x, raw(d.rows * d.width()), rstd(d.rows * d.num_heads());
  HeadRmsNormForward<double>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, w.data(),
                             kEpsQwen3, raw.data(), rstd.data());
  std::vector<double> dqk = dy, dw = Poisoned<double>(2 * d.hs);
  HeadRmsNormBackward<double>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, w.data(), rstd.data(),
                              dqk.data(), d.ld(), dw.data());
  const op_test::HeadRmsNormRef ref = HeadRmsNormReference(x, w, dy, d, kEpsQwen3);
  constexpr double kH = 1e-6;
  auto numeric = [&](double& p) {
    const double saved = p;
    p = saved + kH;
    const double up = loss();
    p = saved - kH;
    const double down = loss();
    p = saved;
    return (up - down) / (2 * kH);
  };
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < d.width(); ++c) {
      const int64_t i = r * d.ld() + c;
      const double want = numeric(x[i]);
      EXPECT_TRUE(Close(dqk[i], want, 1e-7, 1e-6)) << "dx[" << r << ", " << c << "] " << dqk[i];
      EXPECT_TRUE(Close(ref.dx[r * d.width() + c], want, 1e-7, 1e-6)) << "reference dx";
    }
  }
  for (int64_t c = 0; c < 2 * d.hs; ++c) {
    const double want = numeric(w[c]);
    EXPECT_TRUE(Close(dw[c], want, 1e-7, 1e-6)) << "dw[" << c << "] " << dw[c] << " " << want;
    EXPECT_TRUE(Close(ref.dw[c], want, 1e-7, 1e-6)) << "reference dw[" << c << "]";
  }
}

// The weight gradient's order is fixed by the shape (64-row blocks, then the blocks in order):
// one thread and all threads give the same bits, and a frozen weight (dw null) the same dx.
TEST(HeadRmsNormOp, BackwardIsBitIdenticalAcrossThreadCountsAndWithoutTheWeightGradient) {
  const HeadDims d{517, 4, 2, 10};
  const std::vector<Bf16> xs = Cast<Bf16>(HeadRmsInputs(d, 10));
  const std::vector<Bf16> ws = Cast<Bf16>(HeadRmsWeights(d.hs, 11));
  const std::vector<Bf16> dys = Cast<Bf16>(RandomValues(d.rows * d.ld(), 1.0, 12));
  std::vector<Bf16> qk = xs, raw(d.rows * d.width());
  std::vector<float> rstd(d.rows * d.num_heads());
  HeadRmsNormForward<Bf16>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                           kEpsQwen3, raw.data(), rstd.data());
  auto backward = [&](bool with_dw) {
    std::pair<std::vector<Bf16>, std::vector<Bf16>> out{dys, std::vector<Bf16>(2 * d.hs)};
    HeadRmsNormBackward<Bf16>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), rstd.data(),
                              out.first.data(), d.ld(), with_dw ? out.second.data() : nullptr);
    return out;
  };
  const auto all = backward(true);
  decltype(backward(true)) one;
  {
    tbb::global_control single(tbb::global_control::max_allowed_parallelism, 1);
    one = backward(true);
  }
  EXPECT_EQ(Bits(all.first), Bits(one.first));
  EXPECT_EQ(Bits(all.second), Bits(one.second));
  EXPECT_EQ(Bits(backward(false).first), Bits(all.first));
}

TEST(HeadRmsNormOp, NoRowsWritesAZeroWeightGradientAndNothingElse) {
  const std::vector<float> w(2 * 6, 1.0f);
  std::vector<float> dw(2 * 6, 7.0f);
  float* none = nullptr;
  HeadRmsNormForward<float>(none, 24, 0, 3, 2, 6, w.data(), kEpsQwen3, none, none);
  HeadRmsNormBackward<float>(none, 0, 3, 2, 6, w.data(), none, none, 24, dw.data());
  EXPECT_EQ(dw, std::vector<float>(2 * 6, 0.0f));
}

// HostOps<S> (the block bodies' host adapter) is the op, with the CUDA workspace unused.
TEST(HeadRmsNormOp, HostOpsAdapterCallsTheOp) {
  const HeadDims d{9, 4, 2, 10};
  const std::vector<Fp16> xs = Cast<Fp16>(HeadRmsInputs(d, 13));
  const std::vector<Fp16> ws = Cast<Fp16>(HeadRmsWeights(d.hs, 14));
  const std::vector<Fp16> dys = Cast<Fp16>(RandomValues(d.rows * d.ld(), 1.0, 15));
  std::vector<Fp16> qk_op = xs, qk_ad = xs, raw_op(d.rows * d.width()), raw_ad(raw_op.size());
  std::vector<float> rstd_op(d.rows * d.num_heads()), rstd_ad(rstd_op.size());
  HeadRmsNormForward<Fp16>(qk_op.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                           kEpsQwen3, raw_op.data(), rstd_op.data());
  const HostOps<Fp16> host;
  ASSERT_TRUE(host.HeadRmsNormForward(qk_ad.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs,
                                      ws.data(), kEpsQwen3, raw_ad.data(), rstd_ad.data())
                  .ok());
  std::vector<Fp16> dqk_op = dys, dqk_ad = dys, dw_op(2 * d.hs), dw_ad(2 * d.hs);
  HeadRmsNormBackward<Fp16>(raw_op.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                            rstd_op.data(), dqk_op.data(), d.ld(), dw_op.data());
  ASSERT_TRUE(host.HeadRmsNormBackward(raw_ad.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                                       rstd_ad.data(), dqk_ad.data(), d.ld(), dw_ad.data())
                  .ok());
  EXPECT_EQ(Bits(qk_ad), Bits(qk_op));
  EXPECT_EQ(Bits(raw_ad), Bits(raw_op));
  EXPECT_EQ(Bits(rstd_ad), Bits(rstd_op));
  EXPECT_EQ(Bits(dqk_ad), Bits(dqk_op));
  EXPECT_EQ(Bits(dw_ad), Bits(dw_op));
}

// unit_offset: every storage type against the double reference with the multiplier 1 + w (the
// weights Gemma-like, around 0), with the bounds of AgreesWithTheDoubleReferenceElementByElement.
TYPED_TEST(HeadRmsNormTypedTest, UnitOffsetAgreesWithTheDoubleReferenceElementByElement) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    const int64_t n = d.rows * d.ld();
    const std::vector<double> x = Rounded<S>(HeadRmsInputs(d, 21));
    const std::vector<double> w = Rounded<S>(HeadRmsWeights(d.hs, 22, /*unit_offset=*/true));
    const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 23));
    const op_test::HeadRmsNormRef ref =
        HeadRmsNormReference(x, w, dy, d, kEpsQwen3, /*unit_offset=*/true);

    const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy);
    std::vector<S> qk = xs, raw = Poisoned<S>(d.rows * d.width());
    std::vector<F> rstd(d.rows * d.num_heads());
    HeadRmsNormForward<S>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), kEpsQwen3,
                          raw.data(), rstd.data(), /*unit_offset=*/true);
    std::vector<S> dqk = dys, dw = Poisoned<S>(2 * d.hs);
    HeadRmsNormBackward<S>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(), rstd.data(),
                           dqk.data(), d.ld(), dw.data(), /*unit_offset=*/true);

    EXPECT_EQ(Bits(raw), Bits(QkColumns(xs, d))) << "raw is the pre-norm q and k columns";
    EXPECT_EQ(ChangedOtherColumns(qk, xs, d), 0) << "the forward wrote v or pad columns";
    EXPECT_EQ(ChangedOtherColumns(dqk, dys, d), 0) << "the backward wrote v or pad columns";
    const int max_heads = d.H > d.Hkv ? d.H : d.Hkv;
    ExpectWithinBound("rstd", ToDoubles(rstd), ref.rstd, 2, Eps<F>(d.hs));
    ExpectWithinBound("y", ToDoubles(QkColumns(qk, d)), ref.y, 2, Eps<S>(d.hs));
    terms_bound::ExpectWithinTermsBound("dx", ToDoubles(QkColumns(dqk, d)), ref.dx, ref.dx_terms, 4,
                                        Eps<S>(2 * d.hs));
    terms_bound::ExpectWithinTermsBound("dw", ToDoubles(dw), ref.dw, ref.dw_terms, 2,
                                        Eps<S>(d.rows * max_heads + d.hs));
  }
}

// unit_offset with w a multiple of 1/64 in [-0.5, 0.5] (1 + w exact in every storage type) is
// the plain op with the stored weights 1 + w, bit for bit: the forward's heads, raw and rstd, the
// backward's dqk and dw. And each head is RmsNormForward/RmsNormBackward with unit_offset on that
// head (the shared row functions), bit for bit.
TYPED_TEST(HeadRmsNormTypedTest, UnitOffsetIsThePlainOpWithWeightsOnePlusWBitForBit) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    std::vector<double> w = RandomValues(2 * d.hs, 32.0, 24);
    for (double& v : w) v = std::round(v) / 64.0;
    std::vector<double> one_plus_w = w;
    for (double& v : one_plus_w) v += 1.0;
    const std::vector<S> ws = Cast<S>(w), ws1 = Cast<S>(one_plus_w);
    ASSERT_EQ(ToDoubles(ws), w) << "w is exact in S";
    ASSERT_EQ(ToDoubles(ws1), one_plus_w) << "1 + w is exact in S";
    const std::vector<S> xs = Cast<S>(HeadRmsInputs(d, 25));
    const std::vector<S> dys = Cast<S>(RandomValues(d.rows * d.ld(), 1.0, 26));
    auto run = [&](const std::vector<S>& weights, bool unit_offset) {
      struct Out {
        std::vector<S> qk, raw, dqk, dw;
        std::vector<F> rstd;
      } o{xs, std::vector<S>(d.rows * d.width()), dys, std::vector<S>(2 * d.hs),
          std::vector<F>(d.rows * d.num_heads())};
      HeadRmsNormForward<S>(o.qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, weights.data(),
                            kEpsQwen3, o.raw.data(), o.rstd.data(), unit_offset);
      HeadRmsNormBackward<S>(o.raw.data(), d.rows, d.num_heads(), d.H, d.hs, weights.data(),
                             o.rstd.data(), o.dqk.data(), d.ld(), o.dw.data(), unit_offset);
      return o;
    };
    const auto offset = run(ws, true);
    const auto plain = run(ws1, false);
    EXPECT_EQ(Bits(offset.qk), Bits(plain.qk));
    EXPECT_EQ(Bits(offset.raw), Bits(plain.raw));
    EXPECT_EQ(Bits(offset.rstd), Bits(plain.rstd));
    EXPECT_EQ(Bits(offset.dqk), Bits(plain.dqk));
    EXPECT_EQ(Bits(offset.dw), Bits(plain.dw));

    // The q heads (part 0) in (row, head) order through RmsNorm with unit_offset.
    const int64_t n_rows = d.rows * d.H;
    std::vector<S> x_rows, dy_rows, y_op, dx_op;
    std::vector<F> rstd_op;
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int h = 0; h < d.H; ++h) {
        const int64_t at = r * d.ld() + h * d.hs;
        x_rows.insert(x_rows.end(), xs.begin() + at, xs.begin() + at + d.hs);
        dy_rows.insert(dy_rows.end(), dys.begin() + at, dys.begin() + at + d.hs);
        y_op.insert(y_op.end(), offset.qk.begin() + at, offset.qk.begin() + at + d.hs);
        dx_op.insert(dx_op.end(), offset.dqk.begin() + at, offset.dqk.begin() + at + d.hs);
        rstd_op.push_back(offset.rstd[r * d.num_heads() + h]);
      }
    }
    std::vector<S> y(n_rows * d.hs), dx(n_rows * d.hs);
    std::vector<F> rstd_rms(n_rows);
    RmsNormForward<S>(x_rows.data(), ws.data(), kEpsQwen3, n_rows, d.hs, y.data(), rstd_rms.data(),
                      /*unit_offset=*/true);
    RmsNormBackward<S>(x_rows.data(), ws.data(), rstd_rms.data(), dy_rows.data(), nullptr, n_rows,
                       d.hs, dx.data(), nullptr, /*unit_offset=*/true);
    EXPECT_EQ(Bits(y_op), Bits(y)) << "q heads";
    EXPECT_EQ(Bits(rstd_op), Bits(rstd_rms)) << "q heads";
    EXPECT_EQ(Bits(dx_op), Bits(dx)) << "q heads";
  }
}

// L = sum(dy * y(x, w)) on the double op with unit_offset: dL/dx is the backward's dqk, dL/dw its
// dw (d(1 + w)/dw = 1).
TEST(HeadRmsNormOp, DoubleUnitOffsetBackwardMatchesCentralFiniteDifferences) {
  const HeadDims d{7, 2, 1, 6, 2};
  const int64_t n = d.rows * d.ld();
  std::vector<double> x = HeadRmsInputs(d, 27);
  for (int64_t c = 0; c < d.hs; ++c) x[c] = 0.1 * (c + 1);  // the zero head has no derivative
  std::vector<double> w = HeadRmsWeights(d.hs, 28, /*unit_offset=*/true);
  const std::vector<double> dy = RandomValues(n, 1.0, 29);
  auto forward = [&](std::vector<double>& qk, std::vector<double>& raw, std::vector<double>& rstd) {
    HeadRmsNormForward<double>(qk.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, w.data(),
                               kEpsQwen3, raw.data(), rstd.data(), /*unit_offset=*/true);
  };
  auto loss = [&] {
    std::vector<double> qk = x, raw(d.rows * d.width()), rstd(d.rows * d.num_heads());
    forward(qk, raw, rstd);
    double l = 0;
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.width(); ++c) l += dy[r * d.ld() + c] * qk[r * d.ld() + c];
    }
    return l;
  };
  std::vector<double> qk = x, raw(d.rows * d.width()), rstd(d.rows * d.num_heads());
  forward(qk, raw, rstd);
  std::vector<double> dqk = dy, dw = Poisoned<double>(2 * d.hs);
  HeadRmsNormBackward<double>(raw.data(), d.rows, d.num_heads(), d.H, d.hs, w.data(), rstd.data(),
                              dqk.data(), d.ld(), dw.data(), /*unit_offset=*/true);
  constexpr double kH = 1e-6;
  auto numeric = [&](double& p) {
    const double saved = p;
    p = saved + kH;
    const double up = loss();
    p = saved - kH;
    const double down = loss();
    p = saved;
    return (up - down) / (2 * kH);
  };
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t c = 0; c < d.width(); ++c) {
      const int64_t i = r * d.ld() + c;
      const double want = numeric(x[i]);
      EXPECT_TRUE(Close(dqk[i], want, 1e-7, 1e-6)) << "dx[" << r << ", " << c << "] " << dqk[i];
    }
  }
  for (int64_t c = 0; c < 2 * d.hs; ++c) {
    const double want = numeric(w[c]);
    EXPECT_TRUE(Close(dw[c], want, 1e-7, 1e-6)) << "dw[" << c << "] " << dw[c] << " " << want;
  }
}

// HostOps<S> passes unit_offset through to the op.
TEST(HeadRmsNormOp, HostOpsAdapterPassesUnitOffset) {
  const HeadDims d{9, 4, 2, 10};
  const std::vector<Bf16> xs = Cast<Bf16>(HeadRmsInputs(d, 30));
  const std::vector<Bf16> ws = Cast<Bf16>(HeadRmsWeights(d.hs, 31, /*unit_offset=*/true));
  const std::vector<Bf16> dys = Cast<Bf16>(RandomValues(d.rows * d.ld(), 1.0, 32));
  std::vector<Bf16> qk_op = xs, qk_ad = xs, raw_op(d.rows * d.width()), raw_ad(raw_op.size());
  std::vector<float> rstd_op(d.rows * d.num_heads()), rstd_ad(rstd_op.size());
  HeadRmsNormForward<Bf16>(qk_op.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                           kEpsQwen3, raw_op.data(), rstd_op.data(), true);
  const HostOps<Bf16> host;
  ASSERT_TRUE(host.HeadRmsNormForward(qk_ad.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs,
                                      ws.data(), kEpsQwen3, raw_ad.data(), rstd_ad.data(), true)
                  .ok());
  std::vector<Bf16> dqk_op = dys, dqk_ad = dys, dw_op(2 * d.hs), dw_ad(2 * d.hs);
  HeadRmsNormBackward<Bf16>(raw_op.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                            rstd_op.data(), dqk_op.data(), d.ld(), dw_op.data(), true);
  ASSERT_TRUE(host.HeadRmsNormBackward(raw_ad.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                                       rstd_ad.data(), dqk_ad.data(), d.ld(), dw_ad.data(), true)
                  .ok());
  EXPECT_EQ(Bits(qk_ad), Bits(qk_op));
  EXPECT_EQ(Bits(dqk_ad), Bits(dqk_op));
  EXPECT_EQ(Bits(dw_ad), Bits(dw_op));
  std::vector<Bf16> qk_plain = xs;
  ASSERT_TRUE(host.HeadRmsNormForward(qk_plain.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs,
                                      ws.data(), kEpsQwen3, raw_ad.data(), rstd_ad.data())
                  .ok());
  EXPECT_NE(Bits(qk_plain), Bits(qk_op)) << "the offset changes the result";
}

}  // namespace
}  // namespace strata::models::ops
