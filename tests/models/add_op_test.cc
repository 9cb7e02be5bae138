// models/ops/add.h (Gemma's residual add): every storage type element by element against the
// sum in double on the same S-rounded inputs; out equal to a or to b gives the same bits as a
// separate out; sizes below, at and past the oneTBB grain; infinities, NaN and overflow.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "models/ops/add.h"
#include "models/ops/host_ops.h"
#include "models/ops/parallel.h"
#include "tests/models/llama_op_test_util.h"

namespace strata::models::ops {
namespace {

using op_test::Cast;
using op_test::FromDouble;
using op_test::Poisoned;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;

template <typename S>
std::vector<uint8_t> Bits(const std::vector<S>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(S));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The largest finite value and the smallest subnormal of S.
template <typename S>
double MaxFinite() {
  if constexpr (std::is_same_v<S, Bf16>) {
    return std::ldexp(2.0 - std::ldexp(1.0, -7), 127);
  } else if constexpr (std::is_same_v<S, Fp16>) {
    return 65504.0;
  } else {
    return std::numeric_limits<S>::max();
  }
}
template <typename S>
double MinSubnormal() {
  if constexpr (std::is_same_v<S, Bf16>) {
    return std::ldexp(1.0, -133);
  } else if constexpr (std::is_same_v<S, Fp16>) {
    return std::ldexp(1.0, -24);
  } else {
    return std::numeric_limits<S>::denorm_min();
  }
}

// Empty, one, odd, below / at / past one task's grain (kGrainElems), and past several.
const int64_t kSizes[] = {0, 1, 7, 1001, kGrainElems, kGrainElems + 1, 3 * kGrainElems + 17};

template <typename S>
class AddTypedTest : public ::testing::Test {};
using AllStorageTypes = ::testing::Types<float, double, Bf16, Fp16>;
TYPED_TEST_SUITE(AddTypedTest, AllStorageTypes);

// The sum a + b of two S values is within u_F |a + b| after the ComputeType addition, then one
// rounding to S: |out - (a + b)| <= (u_S + u_F + u_S u_F) |a + b| <= 2 Eps<S>(1) |a + b|, relative
// to the value itself (nothing cancels beyond the one sum). b spans magnitudes 2^-20 .. 2^12 of a
// (finite in fp16) to exercise the alignment of the operands, and some pairs cancel exactly
// (b = -a).
TYPED_TEST(AddTypedTest, AgreesWithTheDoubleSumElementByElement) {
  using S = TypeParam;
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<double> a = Rounded<S>(RandomValues(n, 4.0, 1));
    std::vector<double> b = RandomValues(n, 4.0, 2);
    for (int64_t i = 0; i < n; ++i) {
      if (i % 5 == 0) b[i] = -a[i];
      if (i % 5 == 1) b[i] *= std::ldexp(1.0, static_cast<int>(i % 33) - 20);
    }
    b = Rounded<S>(b);
    const std::vector<S> as = Cast<S>(a), bs = Cast<S>(b);
    std::vector<S> out = Poisoned<S>(n);
    AddForward<S>(as.data(), bs.data(), n, out.data());
    const std::vector<double> got = ToDoubles(out);
    int64_t failures = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = a[i] + b[i];
      const double bound = 2 * op_test::Eps<S>(1) * std::abs(want);
      if (!(std::abs(got[i] - want) <= bound) && ++failures <= 5) {
        ADD_FAILURE() << "[" << i << "] " << a[i] << " + " << b[i] << ": got " << got[i] << " want "
                      << want;
      }
    }
    EXPECT_EQ(failures, 0);
  }
}

// In place on either operand: the same bits as a separate output.
TYPED_TEST(AddTypedTest, OutMayEqualEitherOperand) {
  using S = TypeParam;
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<S> as = Cast<S>(RandomValues(n, 3.0, 3));
    const std::vector<S> bs = Cast<S>(RandomValues(n, 3.0, 4));
    std::vector<S> out(n), in_a = as, in_b = bs;
    AddForward<S>(as.data(), bs.data(), n, out.data());
    AddForward<S>(in_a.data(), bs.data(), n, in_a.data());
    AddForward<S>(as.data(), in_b.data(), n, in_b.data());
    EXPECT_EQ(Bits(in_a), Bits(out)) << "out == a";
    EXPECT_EQ(Bits(in_b), Bits(out)) << "out == b";
  }
}

// IEEE behaviour through the ComputeType sum and the one rounding: inf + finite = inf, inf - inf
// and NaN operands give NaN, the largest finite value doubled overflows to inf, and subnormal
// operands are added exactly where the sum is representable.
TYPED_TEST(AddTypedTest, InfinitiesNanOverflowAndSubnormals) {
  using S = TypeParam;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double max = MaxFinite<S>(), tiny = MinSubnormal<S>();
  const std::vector<double> a = {inf, inf, -inf, nan, 1.0, max, -max, tiny, 3 * tiny};
  const std::vector<double> b = {2.0, -inf, -1.0, 1.0, nan, max, -max, tiny, -tiny};
  const std::vector<S> as = Cast<S>(a), bs = Cast<S>(b);
  std::vector<S> out = Poisoned<S>(a.size());
  AddForward<S>(as.data(), bs.data(), static_cast<int64_t>(a.size()), out.data());
  const std::vector<double> got = ToDoubles(out);
  const std::vector<double> want = {inf, nan, -inf, nan, nan, inf, -inf, 2 * tiny, 2 * tiny};
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "[" << i << "] " << got[i];
    } else {
      EXPECT_EQ(got[i], want[i]) << "[" << i << "]";
    }
  }
}

TEST(AddOp, HostOpsAdapterCallsTheOp) {
  const int64_t n = 2 * kGrainElems + 5;
  const std::vector<Fp16> as = Cast<Fp16>(RandomValues(n, 2.0, 5));
  const std::vector<Fp16> bs = Cast<Fp16>(RandomValues(n, 2.0, 6));
  std::vector<Fp16> out_op(n), out_ad(n);
  AddForward<Fp16>(as.data(), bs.data(), n, out_op.data());
  ASSERT_TRUE(HostOps<Fp16>().Add(as.data(), bs.data(), n, out_ad.data()).ok());
  EXPECT_EQ(Bits(out_ad), Bits(out_op));
}

}  // namespace
}  // namespace strata::models::ops
