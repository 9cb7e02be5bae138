// The per-head RMSNorm on CUDA (models/ops/cuda/ops.cuh LaunchHeadRmsNormForward/Backward) in
// fp32, bf16 and fp16 against the host op of the same storage type (same rounding points; the
// differences are the warp's summation order and the GPU's sqrtf) and against the double
// reference (head_rms_norm_reference.h) on the same S-rounded inputs, element by element with the
// bounds of head_rms_norm_op_test.cc (twice them against the host op, whose own error adds);
// raw bit for bit the pre-norm q and k columns, the v and pad columns untouched bit for bit, and
// the backward (weight gradient included) bit-identical from run to run.
// Label gpu: without a GPU the device tests skip with the reason; the argument checks (which run
// before any CUDA call) run anyway.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/device.h"
#include "models/ops/cuda/ops.cuh"
#include "models/ops/cuda/partials.h"
#include "models/ops/head_rms_norm.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/models/head_rms_norm_reference.h"
#include "tests/models/llama_op_test_util.h"
#include "tests/models/terms_bound.h"

namespace strata::models {
namespace {

namespace lops = ops::cuda;
using op_test::Cast;
using op_test::ChangedOtherColumns;
using op_test::Eps;
using op_test::ExpectWithinBound;
using op_test::HeadDims;
using op_test::HeadRmsInputs;
using op_test::HeadRmsNormReference;
using op_test::HeadRmsWeights;
using op_test::QkColumns;
using op_test::RandomValues;
using op_test::Rounded;
using op_test::ToDoubles;
using terms_bound::ExpectWithinTermsBound;

constexpr double kEpsQwen3 = 1e-6;

template <typename S>
using DevOf = std::conditional_t<std::is_same_v<S, Bf16>, __nv_bfloat16,
                                 std::conditional_t<std::is_same_v<S, Fp16>, __half, float>>;

template <typename S>
std::vector<uint8_t> Bits(const std::vector<S>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(S));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename S>
class HeadRmsNormCudaTest : public gpu::testing::CudaTest {
 protected:
  template <typename T>
  gpu::DeviceSpan Put(const std::vector<T>& v) {
    gpu::DeviceSpan d = Carve(std::max<size_t>(v.size() * sizeof(T), 256));
    Upload(d, v);
    return d;
  }
  // Device memory of NaN bytes (0xff), so unwritten outputs show.
  gpu::DeviceSpan Poisoned(size_t bytes) {
    gpu::DeviceSpan d = Carve(std::max<size_t>(bytes, 256));
    Upload(d, std::vector<uint8_t>(d.size_bytes, 0xff));
    return d;
  }
  cudaStream_t Native() { return gpu::NativeStream(*this->stream_); }
};

using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(HeadRmsNormCudaTest, StorageTypes);

// The shapes of head_rms_norm_op_test.cc: GQA and MHA, hs 6, 10 and 128, rows never a multiple
// of the 16-row partials or the 8-warp blocks, padding past v.
const HeadDims kDims[] = {
    {37, 4, 2, 6}, {131, 4, 2, 6, 3}, {19, 1, 1, 10}, {67, 4, 2, 128}, {5, 1, 1, 128},
};

TYPED_TEST(HeadRmsNormCudaTest, MatchesTheHostOpAndDoubleAndIsDeterministic) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    const int64_t n = d.rows * d.ld();
    const std::vector<double> x = Rounded<S>(HeadRmsInputs(d, 1));
    const std::vector<double> w = Rounded<S>(HeadRmsWeights(d.hs, 2));
    const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 3));
    const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy);

    gpu::DeviceSpan g_qk = this->Put(xs), g_w = this->Put(ws);
    gpu::DeviceSpan g_raw = this->Poisoned(d.rows * d.width() * sizeof(S));
    gpu::DeviceSpan g_rstd = this->Poisoned(d.rows * d.num_heads() * sizeof(float));
    gpu::DeviceSpan g_part = this->Poisoned(lops::HeadRmsNormWorkspaceBytes(d.rows, d.hs));
    cudaStream_t cs = this->Native();
    ASSERT_TRUE(lops::LaunchHeadRmsNormForward(
                    cs, g_qk.as<Dev>(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, g_w.as<Dev>(),
                    static_cast<float>(kEpsQwen3), g_raw.as<Dev>(), g_rstd.as<float>())
                    .ok());
    // The backward twice on the same dy: bit-identical dqk and dw.
    std::vector<S> dqk[2], dw[2];
    for (int run = 0; run < 2; ++run) {
      gpu::DeviceSpan g_dqk = this->Put(dys), g_dw = this->Poisoned(2 * d.hs * sizeof(S));
      ASSERT_TRUE(lops::LaunchHeadRmsNormBackward(cs, g_raw.as<Dev>(), d.rows, d.num_heads(), d.H,
                                                  d.hs, g_w.as<Dev>(), g_rstd.as<float>(),
                                                  g_dqk.as<Dev>(), d.ld(), g_dw.as<Dev>(),
                                                  g_part.as<float>())
                      .ok());
      dqk[run] = this->template Download<S>(g_dqk, n);
      dw[run] = this->template Download<S>(g_dw, 2 * d.hs);
    }
    const std::vector<S> qk = this->template Download<S>(g_qk, n);
    const std::vector<S> raw = this->template Download<S>(g_raw, d.rows * d.width());
    const std::vector<float> rstd = this->template Download<float>(g_rstd, d.rows * d.num_heads());
    EXPECT_EQ(Bits(dqk[0]), Bits(dqk[1])) << "the input gradient changed from run to run";
    EXPECT_EQ(Bits(dw[0]), Bits(dw[1])) << "the weight gradient changed from run to run";

    // The host op in S on the same inputs, and the double reference.
    std::vector<S> qk_h = xs, raw_h(d.rows * d.width()), dqk_h = dys, dw_h(2 * d.hs);
    std::vector<float> rstd_h(d.rows * d.num_heads());
    ops::HeadRmsNormForward<S>(qk_h.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                               kEpsQwen3, raw_h.data(), rstd_h.data());
    ops::HeadRmsNormBackward<S>(raw_h.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                                rstd_h.data(), dqk_h.data(), d.ld(), dw_h.data());
    const op_test::HeadRmsNormRef ref = HeadRmsNormReference(x, w, dy, d, kEpsQwen3);

    EXPECT_EQ(Bits(raw), Bits(QkColumns(xs, d))) << "raw is the pre-norm q and k columns";
    EXPECT_EQ(ChangedOtherColumns(qk, xs, d), 0) << "the forward wrote v or pad columns";
    EXPECT_EQ(ChangedOtherColumns(dqk[0], dys, d), 0) << "the backward wrote v or pad columns";
    const int max_heads = std::max(d.H, d.Hkv);
    const double eps_rstd = Eps<float>(d.hs), eps_y = Eps<S>(d.hs), eps_dx = Eps<S>(2 * d.hs),
                 eps_dw = Eps<S>(d.rows * max_heads + d.hs);
    const std::vector<double> rstd_g(rstd.begin(), rstd.end()),
        y = ToDoubles(QkColumns(qk, d)), dx = ToDoubles(QkColumns(dqk[0], d)),
        dw_g = ToDoubles(dw[0]);
    ExpectWithinBound("rstd vs double", rstd_g, ref.rstd, 2, eps_rstd);
    ExpectWithinBound("rstd vs host", rstd_g, ToDoubles(rstd_h), 4, eps_rstd);
    ExpectWithinBound("y vs double", y, ref.y, 2, eps_y);
    ExpectWithinBound("y vs host", y, ToDoubles(QkColumns(qk_h, d)), 4, eps_y);
    ExpectWithinTermsBound("dx vs double", dx, ref.dx, ref.dx_terms, 4, eps_dx);
    ExpectWithinTermsBound("dx vs host", dx, ToDoubles(QkColumns(dqk_h, d)), ref.dx_terms, 8,
                           eps_dx);
    ExpectWithinTermsBound("dw vs double", dw_g, ref.dw, ref.dw_terms, 2, eps_dw);
    ExpectWithinTermsBound("dw vs host", dw_g, ToDoubles(dw_h), ref.dw_terms, 4, eps_dw);
  }
}

// A frozen weight (dw null, no workspace) gives the same input gradient; no rows with a weight
// gradient writes zeros.
TYPED_TEST(HeadRmsNormCudaTest, WithoutTheWeightGradientTheInputGradientIsUnchanged) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  const HeadDims d{45, 4, 2, 10, 1};
  const int64_t n = d.rows * d.ld();
  const std::vector<S> xs = Cast<S>(HeadRmsInputs(d, 4)), ws = Cast<S>(HeadRmsWeights(d.hs, 5));
  const std::vector<S> dys = Cast<S>(RandomValues(n, 1.0, 6));
  gpu::DeviceSpan g_qk = this->Put(xs), g_w = this->Put(ws);
  gpu::DeviceSpan g_raw = this->Poisoned(d.rows * d.width() * sizeof(S));
  gpu::DeviceSpan g_rstd = this->Poisoned(d.rows * d.num_heads() * sizeof(float));
  gpu::DeviceSpan g_part = this->Poisoned(lops::HeadRmsNormWorkspaceBytes(d.rows, d.hs));
  gpu::DeviceSpan g_a = this->Put(dys), g_b = this->Put(dys);
  gpu::DeviceSpan g_dw = this->Poisoned(2 * d.hs * sizeof(S));
  cudaStream_t cs = this->Native();
  ASSERT_TRUE(lops::LaunchHeadRmsNormForward(cs, g_qk.as<Dev>(), d.ld(), d.rows, d.num_heads(), d.H,
                                             d.hs, g_w.as<Dev>(), static_cast<float>(kEpsQwen3),
                                             g_raw.as<Dev>(), g_rstd.as<float>())
                  .ok());
  ASSERT_TRUE(lops::LaunchHeadRmsNormBackward(cs, g_raw.as<Dev>(), d.rows, d.num_heads(), d.H, d.hs,
                                              g_w.as<Dev>(), g_rstd.as<float>(), g_a.as<Dev>(),
                                              d.ld(), g_dw.as<Dev>(), g_part.as<float>())
                  .ok());
  ASSERT_TRUE(lops::LaunchHeadRmsNormBackward<Dev>(cs, g_raw.as<Dev>(), d.rows, d.num_heads(), d.H,
                                                   d.hs, g_w.as<Dev>(), g_rstd.as<float>(),
                                                   g_b.as<Dev>(), d.ld(), nullptr, nullptr)
                  .ok());
  EXPECT_EQ(Bits(this->template Download<S>(g_a, n)), Bits(this->template Download<S>(g_b, n)));

  ASSERT_TRUE(lops::LaunchHeadRmsNormBackward<Dev>(cs, nullptr, 0, d.num_heads(), d.H, d.hs,
                                                   g_w.as<Dev>(), nullptr, nullptr, d.ld(),
                                                   g_dw.as<Dev>(), nullptr)
                  .ok());
  EXPECT_EQ(ToDoubles(this->template Download<S>(g_dw, 2 * d.hs)),
            std::vector<double>(2 * d.hs, 0.0));
}

// Argument checks run before any CUDA call, so they hold without a GPU.
TEST(HeadRmsNormCudaArguments, LaunchersRejectBadArgumentsBeforeLaunching) {
  float* p = reinterpret_cast<float*>(uintptr_t{256});  // never dereferenced
  const auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  // Forward: (qk, ld, rows, num_heads, num_q_heads, hs, w, eps, raw, rstd).
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 47, 4, 6, 4, 8, p, 1e-6f, p, p)))
      << "ld < num_heads hs";
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 6, 7, 8, p, 1e-6f, p, p)))
      << "num_q_heads > num_heads";
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 6, -1, 8, p, 1e-6f, p, p)));
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 0, 0, 8, p, 1e-6f, p, p)));
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 6, 4, 0, p, 1e-6f, p, p)));
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, -1, 6, 4, 8, p, 1e-6f, p, p)));
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 6, 4, 8, p, 0.0f, p, p)));
  EXPECT_TRUE(invalid(
      lops::LaunchHeadRmsNormForward<float>(nullptr, p, 64, 4, 6, 4, 8, p, 1e-6f, nullptr, p)));
  // Backward: (raw, rows, num_heads, num_q_heads, hs, w, rstd, dqk, ld, dw, partials).
  EXPECT_TRUE(
      invalid(lops::LaunchHeadRmsNormBackward<float>(nullptr, p, 4, 6, 4, 8, p, p, p, 47, p, p)));
  EXPECT_TRUE(invalid(
      lops::LaunchHeadRmsNormBackward<float>(nullptr, p, 4, 6, 4, 8, p, p, nullptr, 64, p, p)));
  EXPECT_TRUE(invalid(
      lops::LaunchHeadRmsNormBackward<float>(nullptr, p, 4, 6, 4, 8, p, p, p, 64, p, nullptr)))
      << "a weight gradient needs the workspace";
}

TEST(HeadRmsNormCudaArguments, WorkspaceHoldsTwoWeightRowsPerPartial) {
  EXPECT_EQ(lops::HeadRmsNormWorkspaceBytes(0, 128), 0);
  EXPECT_EQ(lops::HeadRmsNormWorkspaceBytes(1, 128), 2 * 128 * 4);
  EXPECT_EQ(lops::HeadRmsNormWorkspaceBytes(lops::kHeadRmsRowsPerPartial, 6), 2 * 6 * 4);
  EXPECT_EQ(lops::HeadRmsNormWorkspaceBytes(lops::kHeadRmsRowsPerPartial + 1, 6), 2 * 2 * 6 * 4);
}

}  // namespace
}  // namespace strata::models
