// models/ops/rope.h: the table and the rotation against explicit rotation matrices built here,
// the Llama-3 frequency rescaling against its formula evaluated here, the backward as the
// transpose, and every storage type against the double instantiation.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "models/ops/rope.h"
#include "tests/models/llama_op_test_util.h"

namespace strata::models::ops {
namespace {

using op_test::Cast;
using op_test::Close;
using op_test::Eps;
using op_test::ExpectWithinBound;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;

// Transformers' _compute_llama3_parameters, vectorised the way it is written there (masks and
// selections over all frequencies at once), from the published formula.
std::vector<double> Llama3Formula(int hs, double theta, double factor, double low_ff,
                                  double high_ff, double old_len) {
  const int half = hs / 2;
  std::vector<double> base(half), wavelen(half), llama(half), smoothed(half), out(half);
  for (int i = 0; i < half; ++i) {
    base[i] = 1.0 / std::pow(theta, (2.0 * i) / hs);
    wavelen[i] = 2 * std::numbers::pi / base[i];
  }
  const double low_wavelen = old_len / low_ff, high_wavelen = old_len / high_ff;
  for (int i = 0; i < half; ++i) llama[i] = wavelen[i] > low_wavelen ? base[i] / factor : base[i];
  for (int i = 0; i < half; ++i) {
    const double smooth = (old_len / wavelen[i] - low_ff) / (high_ff - low_ff);
    smoothed[i] = (1 - smooth) * llama[i] / factor + smooth * llama[i];
  }
  for (int i = 0; i < half; ++i) {
    const bool medium = !(wavelen[i] < high_wavelen) && !(wavelen[i] > low_wavelen);
    out[i] = medium ? smoothed[i] : llama[i];
  }
  return out;
}

RopeParams Plain(int hs, double theta = 10000.0) {
  RopeParams p;
  p.head_dim = hs;
  p.theta = theta;
  return p;
}

RopeParams Llama3(int hs, double theta, int old_len) {
  RopeParams p = Plain(hs, theta);
  p.llama3 = true;
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_position = old_len;
  return p;
}

TEST(RopeOp, PlainFrequenciesAreThetaToTheMinusTwoIOverHs) {
  for (int hs : {2, 6, 16, 64, 128}) {
    const std::vector<double> inv = RopeInverseFrequencies(Plain(hs, 500000.0));
    ASSERT_EQ(inv.size(), static_cast<size_t>(hs / 2));
    for (int i = 0; i < hs / 2; ++i) {
      EXPECT_TRUE(Close(inv[i], std::exp(-std::log(500000.0) * 2 * i / hs), 0, 1e-14));
    }
  }
}

TEST(RopeOp, Llama3FrequenciesFollowTheFormulaInEveryBand) {
  // Llama 3.1's own values (hs 128, theta 5e5, 8192) put frequencies in all three bands; a
  // short original context pushes most into the low band.
  struct Case {
    int hs;
    double theta;
    int old_len;
  };
  for (const Case& c : {Case{128, 500000.0, 8192}, Case{64, 10000.0, 64}, Case{18, 10000.0, 16}}) {
    const std::vector<double> got = RopeInverseFrequencies(Llama3(c.hs, c.theta, c.old_len));
    const std::vector<double> want = Llama3Formula(c.hs, c.theta, 8.0, 1.0, 4.0, c.old_len);
    const std::vector<double> plain = RopeInverseFrequencies(Plain(c.hs, c.theta));
    int unchanged = 0, divided = 0, blended = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(Close(got[i], want[i], 0, 1e-14)) << i << ": " << got[i] << " vs " << want[i];
      if (got[i] == plain[i]) {
        ++unchanged;
      } else if (Close(got[i], plain[i] / 8, 0, 1e-15)) {
        ++divided;
      } else {
        ++blended;
        EXPECT_LT(got[i], plain[i]);
        EXPECT_GT(got[i], plain[i] / 8);
      }
    }
    if (c.hs == 128) {
      EXPECT_GT(unchanged, 0);
      EXPECT_GT(divided, 0);
      EXPECT_GT(blended, 0);
    }
  }
}

TEST(RopeOp, TableHoldsCosAndSinOfPositionTimesFrequency) {
  const RopeParams p = Llama3(16, 10000.0, 8);
  const std::vector<double> inv = Llama3Formula(16, 10000.0, 8.0, 1.0, 4.0, 8);
  const int T = 37;
  std::vector<double> cd(T * 8), sd(T * 8);
  std::vector<float> cf(T * 8), sf(T * 8);
  RopeTable<double>(p, T, cd.data(), sd.data());
  RopeTable<float>(p, T, cf.data(), sf.data());
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < 8; ++i) {
      const double a = t * inv[i];
      EXPECT_TRUE(Close(cd[t * 8 + i], std::cos(a), 1e-15, 1e-13));
      EXPECT_TRUE(Close(sd[t * 8 + i], std::sin(a), 1e-15, 1e-13));
      // The fp32 table is the double one rounded once.
      EXPECT_EQ(cf[t * 8 + i], static_cast<float>(cd[t * 8 + i]));
      EXPECT_EQ(sf[t * 8 + i], static_cast<float>(sd[t * 8 + i]));
    }
  }
}

struct Layout {
  int B, T, heads, hs;
  int64_t stride;  // >= heads * hs; the columns past the heads must stay untouched
};
const Layout kLayouts[] = {
    {2, 5, 3, 2, 7}, {3, 9, 5, 6, 33}, {1, 70, 2, 16, 40}, {2, 3, 4, 64, 256}};

// y = R(t) x per head with the (hs, hs) rotation matrix written out: rows i and i + hs/2 of the
// identity replaced by the 2 x 2 rotation of pair i.
std::vector<double> MatrixReference(const Layout& l, const std::vector<double>& x,
                                    const std::vector<double>& inv, int sign) {
  std::vector<double> y = x;
  const int half = l.hs / 2;
  std::vector<double> R(l.hs * l.hs);
  for (int64_t r = 0; r < int64_t{l.B} * l.T; ++r) {
    const int t = static_cast<int>(r % l.T);
    std::fill(R.begin(), R.end(), 0.0);
    for (int i = 0; i < half; ++i) {
      const double c = std::cos(t * inv[i]), s = sign * std::sin(t * inv[i]);
      R[i * l.hs + i] = c;
      R[i * l.hs + i + half] = -s;
      R[(i + half) * l.hs + i] = s;
      R[(i + half) * l.hs + i + half] = c;
    }
    for (int h = 0; h < l.heads; ++h) {
      const double* in = x.data() + r * l.stride + h * l.hs;
      double* out = y.data() + r * l.stride + h * l.hs;
      for (int a = 0; a < l.hs; ++a) {
        double sum = 0;
        for (int b = 0; b < l.hs; ++b) sum += R[a * l.hs + b] * in[b];
        out[a] = sum;
      }
    }
  }
  return y;
}

template <typename F>
struct Table {
  std::vector<F> cos, sin;
  Table(const RopeParams& p, int T) : cos(T * p.head_dim / 2), sin(T * p.head_dim / 2) {
    RopeTable<F>(p, T, cos.data(), sin.data());
  }
};

TEST(RopeOp, DoubleRotationMatchesExplicitRotationMatricesAndLeavesOtherColumnsAlone) {
  for (const Layout& l : kLayouts) {
    for (bool llama3 : {false, true}) {
      const RopeParams p = llama3 ? Llama3(l.hs, 10000.0, 4) : Plain(l.hs);
      const std::vector<double> inv =
          llama3 ? Llama3Formula(l.hs, 10000.0, 8, 1, 4, 4) : RopeInverseFrequencies(Plain(l.hs));
      const std::vector<double> x = RandomValues(int64_t{l.B} * l.T * l.stride, 1.0, l.hs);
      const Table<double> tab(p, l.T);
      std::vector<double> y = x;
      RopeForward<double>(y.data(), int64_t{l.B} * l.T, l.stride, l.heads, l.hs, l.T,
                          tab.cos.data(), tab.sin.data());
      const std::vector<double> want = MatrixReference(l, x, inv, 1);
      for (size_t i = 0; i < y.size(); ++i) {
        if (static_cast<int64_t>(i % l.stride) >= int64_t{l.heads} * l.hs) {
          ASSERT_EQ(y[i], x[i]) << "column outside the heads changed at " << i;
        } else {
          ASSERT_TRUE(Close(y[i], want[i], 1e-13, 1e-12)) << i << " hs=" << l.hs;
        }
      }
      std::vector<double> dx = x;
      RopeBackward<double>(dx.data(), int64_t{l.B} * l.T, l.stride, l.heads, l.hs, l.T,
                           tab.cos.data(), tab.sin.data());
      const std::vector<double> want_back = MatrixReference(l, x, inv, -1);  // R^T = R(-angle)
      for (size_t i = 0; i < dx.size(); ++i) {
        ASSERT_TRUE(Close(dx[i], want_back[i], 1e-13, 1e-12)) << i << " hs=" << l.hs;
      }
    }
  }
}

// The property rotary embeddings exist for: the score of a rotated query and key depends on
// their positions only through the distance.
TEST(RopeOp, RotatedDotProductDependsOnlyOnRelativePosition) {
  const int hs = 16, T = 40;
  const RopeParams p = Llama3(hs, 10000.0, 8);
  const Table<double> tab(p, T);
  const std::vector<double> q0 = RandomValues(hs, 1.0, 1), k0 = RandomValues(hs, 1.0, 2);
  auto rotated = [&](const std::vector<double>& v, int t) {
    std::vector<double> rows(int64_t{T} * hs, 0.0);
    std::copy(v.begin(), v.end(), rows.begin() + int64_t{t} * hs);
    RopeForward<double>(rows.data(), T, hs, 1, hs, T, tab.cos.data(), tab.sin.data());
    return std::vector<double>(rows.begin() + int64_t{t} * hs, rows.begin() + int64_t{t + 1} * hs);
  };
  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  for (int distance : {0, 3, 17}) {
    const double first = dot(rotated(q0, distance), rotated(k0, 0));
    for (int k_pos : {5, 11, 22}) {
      EXPECT_TRUE(
          Close(dot(rotated(q0, k_pos + distance), rotated(k0, k_pos)), first, 1e-12, 1e-12))
          << "distance " << distance << " key position " << k_pos;
    }
  }
}

// Packed examples: with position ids, each row turns by its position within its example, the
// same bits as that row at that position of an unpacked sequence, forward and backward.
TEST(RopeOp, PositionIdsTurnEachRowByItsPositionWithinItsExample) {
  const int hs = 8, heads = 2, stride = heads * hs + 1, T = 12;
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6};
  const RopeParams p = Llama3(hs, 10000.0, 8);
  const Table<float> tab(p, T);
  const std::vector<double> xd = RandomValues(int64_t{T} * stride, 1.0, 9);
  const std::vector<float> x(xd.begin(), xd.end());
  for (bool backward : {false, true}) {
    auto rotate = [&](float* rows, const int32_t* position_ids) {
      if (backward) {
        RopeBackward<float>(rows, T, stride, heads, hs, T, tab.cos.data(), tab.sin.data(),
                            position_ids);
      } else {
        RopeForward<float>(rows, T, stride, heads, hs, T, tab.cos.data(), tab.sin.data(),
                           position_ids);
      }
    };
    std::vector<float> packed = x;
    rotate(packed.data(), ids.data());
    for (int r = 0; r < T; ++r) {
      std::vector<float> alone(x.size(), 0.0f);
      std::copy_n(x.begin() + int64_t{r} * stride, stride, alone.begin() + ids[r] * stride);
      rotate(alone.data(), nullptr);
      for (int j = 0; j < stride; ++j) {
        ASSERT_EQ(packed[r * stride + j], alone[ids[r] * stride + j])
            << (backward ? "backward" : "forward") << " row " << r << " column " << j;
      }
    }
  }
}

// Phi-4-mini's partial rotary with Phi-3.5's LongRoPE (transformers _compute_longrope_parameters
// and modeling_phi3.apply_rotary_pos_emb, from their formulas): the first rotary_dim columns of a
// head turn, pair i with i + rotary_dim / 2, inv_freq[i] = 1 / (ext[i] theta^(2i / rotary_dim)),
// cos and sin times the attention factor a; the other columns pass through. The backward is the
// transpose of that map (a times a rotation).
TEST(RopeOp, PartialRotaryWithLongRopeFactorsTurnsTheFirstColumnsScaledByTheAttentionFactor) {
  const int hs = 16, rd = 12, half = rd / 2, heads = 3, T = 9, B = 2;
  const int64_t stride = heads * hs + 5, rows = int64_t{B} * T;
  RopeParams p = Plain(hs, 500.0);
  p.rotary_dim = rd;
  p.ext_factors = {1.0, 1.25, 2.0, 3.5, 8.0, 20.0};
  p.attention_factor = 1.1902380714238083;  // sqrt(1 + ln 32 / ln 4096), Phi-3.5-mini's
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) {
    inv[i] = 1.0 / (p.ext_factors[i] * std::pow(500.0, 2.0 * i / rd));
  }
  const std::vector<double> got_inv = RopeInverseFrequencies(p);
  ASSERT_EQ(got_inv.size(), static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) EXPECT_TRUE(Close(got_inv[i], inv[i], 0, 1e-14)) << i;
  std::vector<double> cd(T * half), sd(T * half);
  std::vector<float> cf(T * half), sf(T * half);
  RopeTable<double>(p, T, cd.data(), sd.data());
  RopeTable<float>(p, T, cf.data(), sf.data());
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      EXPECT_TRUE(Close(cd[t * half + i], p.attention_factor * std::cos(t * inv[i]), 1e-15, 1e-13));
      EXPECT_TRUE(Close(sd[t * half + i], p.attention_factor * std::sin(t * inv[i]), 1e-15, 1e-13));
      EXPECT_EQ(cf[t * half + i], static_cast<float>(cd[t * half + i]));
    }
  }
  const std::vector<double> x = RandomValues(rows * stride, 1.0, 77);
  for (int sign : {1, -1}) {
    std::vector<double> y = x;
    if (sign > 0) {
      RopeForward<double>(y.data(), rows, stride, heads, hs, T, cd.data(), sd.data(), nullptr, rd);
    } else {
      RopeBackward<double>(y.data(), rows, stride, heads, hs, T, cd.data(), sd.data(), nullptr, rd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int t = static_cast<int>(r % T);
      for (int64_t j = 0; j < stride; ++j) {
        const int64_t h = j / hs, col = j % hs;
        double want = x[r * stride + j];
        if (h < heads && col < rd) {
          const int i = static_cast<int>(col % half);
          const double c = p.attention_factor * std::cos(t * inv[i]);
          const double s = sign * p.attention_factor * std::sin(t * inv[i]);
          const double a = x[r * stride + h * hs + i], b = x[r * stride + h * hs + i + half];
          want = col < half ? a * c - b * s : b * c + a * s;
          ASSERT_TRUE(Close(y[r * stride + j], want, 1e-13, 1e-12))
              << (sign > 0 ? "forward" : "backward") << " row " << r << " column " << j;
        } else {
          ASSERT_EQ(y[r * stride + j], want) << "a column that does not turn changed: " << j;
        }
      }
    }
  }
  // The backward is the transpose: <R x, g> = <x, R^T g> over the whole buffer.
  const std::vector<double> g = RandomValues(rows * stride, 1.0, 78);
  std::vector<double> rx = x, rtg = g;
  RopeForward<double>(rx.data(), rows, stride, heads, hs, T, cd.data(), sd.data(), nullptr, rd);
  RopeBackward<double>(rtg.data(), rows, stride, heads, hs, T, cd.data(), sd.data(), nullptr, rd);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    lhs += rx[i] * g[i];
    rhs += x[i] * rtg[i];
  }
  EXPECT_TRUE(Close(lhs, rhs, 1e-12, 1e-12)) << lhs << " vs " << rhs;
}

template <typename S>
class RopeTypedTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(RopeTypedTest, StorageTypes);

TYPED_TEST(RopeTypedTest, AgreesWithTheDoubleInstantiationElementByElement) {
  using S = TypeParam;
  using F = ComputeType<S>;
  for (const Layout& l : kLayouts) {
    const RopeParams p = Llama3(l.hs, 10000.0, 8);
    const int64_t rows = int64_t{l.B} * l.T;
    const std::vector<double> x = Rounded<S>(RandomValues(rows * l.stride, 2.0, 40 + l.hs));
    const Table<double> td(p, l.T);
    const Table<F> tf(p, l.T);
    std::vector<double> y = x, dx = x;
    RopeForward<double>(y.data(), rows, l.stride, l.heads, l.hs, l.T, td.cos.data(), td.sin.data());
    RopeBackward<double>(dx.data(), rows, l.stride, l.heads, l.hs, l.T, td.cos.data(),
                         td.sin.data());
    std::vector<S> ys = Cast<S>(x), dxs = Cast<S>(x);
    RopeForward<S>(ys.data(), rows, l.stride, l.heads, l.hs, l.T, tf.cos.data(), tf.sin.data());
    RopeBackward<S>(dxs.data(), rows, l.stride, l.heads, l.hs, l.T, tf.cos.data(), tf.sin.data());
    // A two-term fp32 sum with an fp32 table, one rounding.
    const std::string tag = " hs=" + std::to_string(l.hs);
    ExpectWithinBound("forward" + tag, ToDoubles(ys), y, 2, Eps<S>(4));
    ExpectWithinBound("backward" + tag, ToDoubles(dxs), dx, 2, Eps<S>(4));
  }
}

}  // namespace
}  // namespace strata::models::ops
