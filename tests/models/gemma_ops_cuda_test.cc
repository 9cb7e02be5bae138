// Gemma's ops on CUDA (models/ops/cuda/ops.cuh) in fp32, bf16 and fp16 against the host ops of the
// same storage type (same rounding points; the differences are the warp's summation order and the
// GPU's sqrtf) and against the double instantiation or reference on the same S-rounded inputs,
// element by element with the bounds of llama_cuda_test.cc and head_rms_norm_cuda_test.cc (twice
// the bound against double when compared with the host op, whose own error adds):
//   - RMSNorm with unit_offset (the multiplier 1 + w in fp32): forward, weight gradient, backward
//     with and without the residual gradient;
//   - the per-head RMSNorm with unit_offset (Gemma 3's q_norm / k_norm), the v and pad columns
//     untouched bit for bit;
//   - the elementwise add: bit for bit the host op (one fp32 add, one rounding to nearest even on
//     both), in place on either operand, and its argument checks.
// Label gpu: without a GPU the device tests skip with the reason; the argument checks (which run
// before any CUDA call) run anyway.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "gpu/device.h"
#include "models/ops/add.h"
#include "models/ops/cuda/ops.cuh"
#include "models/ops/cuda/partials.h"
#include "models/ops/head_rms_norm.h"
#include "models/ops/rms_norm.h"
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

constexpr bool kUnitOffset = true;

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
class GemmaOpsCudaTest : public gpu::testing::CudaTest {
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
TYPED_TEST_SUITE(GemmaOpsCudaTest, StorageTypes);

// RMSNorm with unit_offset: rows span three weight-gradient partials, C odd and past two warps'
// widths; Gemma-like weights around 0 (the multiplier 1 + w in [0.5, 1.5]). y: one rounding and
// fp32 rstd; dx: C-term fp32 sums, the residual, one rounding; dw: a rows-term fp32 sum, one
// rounding (the weight-gradient launcher is the plain one: dw does not read w).
TYPED_TEST(GemmaOpsCudaTest, RmsNormUnitOffsetMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  const int64_t rows = 131, C = 77;
  const double eps = 1e-6;  // Gemma 3's rms_norm_eps
  const std::vector<double> x = Rounded<S>(RandomValues(rows * C, 1.5, 1));
  const std::vector<double> w = Rounded<S>(RandomValues(C, 0.5, 2));
  const std::vector<double> dy = Rounded<S>(RandomValues(rows * C, 1.0, 3));
  const std::vector<double> dres = Rounded<S>(RandomValues(rows * C, 1.0, 4));
  const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy), ress = Cast<S>(dres);
  for (const bool with_residual : {false, true}) {
    SCOPED_TRACE(with_residual ? "with dres" : "without dres");
    gpu::DeviceSpan gx = this->Put(xs), gw = this->Put(ws), gdy = this->Put(dys),
                    gres = this->Put(ress);
    gpu::DeviceSpan gy = this->Poisoned(rows * C * sizeof(S)), grstd = this->Poisoned(rows * 4),
                    gdx = this->Poisoned(rows * C * sizeof(S)), gdw = this->Poisoned(C * sizeof(S)),
                    gpart = this->Poisoned(lops::RmsPartials(rows) * C * 4);
    cudaStream_t cs = this->Native();
    ASSERT_TRUE(lops::LaunchRmsNormForward(cs, gx.as<Dev>(), gw.as<Dev>(), static_cast<float>(eps),
                                           rows, C, gy.as<Dev>(), grstd.as<float>(), kUnitOffset)
                    .ok());
    ASSERT_TRUE(lops::LaunchRmsNormWeightGrad(cs, gx.as<Dev>(), grstd.as<float>(), gdy.as<Dev>(),
                                              rows, C, gpart.as<float>(), gdw.as<Dev>())
                    .ok());
    ASSERT_TRUE(lops::LaunchRmsNormBackward(cs, gx.as<Dev>(), gw.as<Dev>(), grstd.as<float>(),
                                            gdy.as<Dev>(), with_residual ? gres.as<Dev>() : nullptr,
                                            rows, C, gdx.as<Dev>(), kUnitOffset)
                    .ok());
    const std::vector<double> y = ToDoubles(this->template Download<S>(gy, rows * C));
    const std::vector<double> dx = ToDoubles(this->template Download<S>(gdx, rows * C));
    const std::vector<double> dw = ToDoubles(this->template Download<S>(gdw, C));
    const std::vector<float> rstd_f = this->template Download<float>(grstd, rows);
    const std::vector<double> rstd(rstd_f.begin(), rstd_f.end());

    // The host op in S and in double, with unit_offset.
    std::vector<S> y_h(rows * C), dx_h(rows * C), dw_h(C);
    std::vector<float> rstd_h(rows);
    ops::RmsNormForward<S>(xs.data(), ws.data(), eps, rows, C, y_h.data(), rstd_h.data(),
                           kUnitOffset);
    ops::RmsNormBackward<S>(xs.data(), ws.data(), rstd_h.data(), dys.data(),
                            with_residual ? ress.data() : nullptr, rows, C, dx_h.data(),
                            dw_h.data(), kUnitOffset);
    std::vector<double> y_d(rows * C), dx_d(rows * C), dw_d(C), rstd_d(rows);
    ops::RmsNormForward<double>(x.data(), w.data(), eps, rows, C, y_d.data(), rstd_d.data(),
                                kUnitOffset);
    ops::RmsNormBackward<double>(x.data(), w.data(), rstd_d.data(), dy.data(),
                                 with_residual ? dres.data() : nullptr, rows, C, dx_d.data(),
                                 dw_d.data(), kUnitOffset);

    ExpectWithinBound("rstd vs double", rstd, rstd_d, 4, Eps<float>(C));
    ExpectWithinBound("y vs double", y, y_d, 2, Eps<S>(C));
    ExpectWithinBound("y vs host", y, ToDoubles(y_h), 4, Eps<S>(C));
    ExpectWithinBound("dx vs double", dx, dx_d, 4, Eps<S>(C));
    ExpectWithinBound("dx vs host", dx, ToDoubles(dx_h), 8, Eps<S>(C));
    ExpectWithinBound("dw vs double", dw, dw_d, 2, Eps<S>(rows));
    ExpectWithinBound("dw vs host", dw, ToDoubles(dw_h), 4, Eps<S>(rows));
  }
}

// The per-head RMSNorm with unit_offset, on the shapes of head_rms_norm_cuda_test.cc (GQA and
// MHA, hs 6, 10 and 128, rows never a multiple of the partials or the warps' blocks, padding past
// v), against the host op with unit_offset and the double reference with the multiplier 1 + w.
const HeadDims kDims[] = {
    {37, 4, 2, 6}, {131, 4, 2, 6, 3}, {19, 1, 1, 10}, {67, 4, 2, 128}, {5, 1, 1, 128},
};

TYPED_TEST(GemmaOpsCudaTest, HeadRmsNormUnitOffsetMatchesTheHostOpAndDouble) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  constexpr double kEpsGemma3 = 1e-6;
  for (const HeadDims& d : kDims) {
    SCOPED_TRACE(d.Name());
    const int64_t n = d.rows * d.ld();
    const std::vector<double> x = Rounded<S>(HeadRmsInputs(d, 11));
    const std::vector<double> w = Rounded<S>(HeadRmsWeights(d.hs, 12, kUnitOffset));
    const std::vector<double> dy = Rounded<S>(RandomValues(n, 1.0, 13));
    const std::vector<S> xs = Cast<S>(x), ws = Cast<S>(w), dys = Cast<S>(dy);

    gpu::DeviceSpan g_qk = this->Put(xs), g_w = this->Put(ws), g_dqk = this->Put(dys);
    gpu::DeviceSpan g_raw = this->Poisoned(d.rows * d.width() * sizeof(S));
    gpu::DeviceSpan g_rstd = this->Poisoned(d.rows * d.num_heads() * sizeof(float));
    gpu::DeviceSpan g_part = this->Poisoned(lops::HeadRmsNormWorkspaceBytes(d.rows, d.hs));
    gpu::DeviceSpan g_dw = this->Poisoned(2 * d.hs * sizeof(S));
    cudaStream_t cs = this->Native();
    ASSERT_TRUE(lops::LaunchHeadRmsNormForward(cs, g_qk.as<Dev>(), d.ld(), d.rows, d.num_heads(),
                                               d.H, d.hs, g_w.as<Dev>(),
                                               static_cast<float>(kEpsGemma3), g_raw.as<Dev>(),
                                               g_rstd.as<float>(), kUnitOffset)
                    .ok());
    ASSERT_TRUE(lops::LaunchHeadRmsNormBackward(cs, g_raw.as<Dev>(), d.rows, d.num_heads(), d.H,
                                                d.hs, g_w.as<Dev>(), g_rstd.as<float>(),
                                                g_dqk.as<Dev>(), d.ld(), g_dw.as<Dev>(),
                                                g_part.as<float>(), kUnitOffset)
                    .ok());
    const std::vector<S> qk = this->template Download<S>(g_qk, n);
    const std::vector<S> dqk = this->template Download<S>(g_dqk, n);
    const std::vector<S> dw = this->template Download<S>(g_dw, 2 * d.hs);
    const std::vector<float> rstd = this->template Download<float>(g_rstd, d.rows * d.num_heads());

    std::vector<S> qk_h = xs, raw_h(d.rows * d.width()), dqk_h = dys, dw_h(2 * d.hs);
    std::vector<float> rstd_h(d.rows * d.num_heads());
    ops::HeadRmsNormForward<S>(qk_h.data(), d.ld(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                               kEpsGemma3, raw_h.data(), rstd_h.data(), kUnitOffset);
    ops::HeadRmsNormBackward<S>(raw_h.data(), d.rows, d.num_heads(), d.H, d.hs, ws.data(),
                                rstd_h.data(), dqk_h.data(), d.ld(), dw_h.data(), kUnitOffset);
    const op_test::HeadRmsNormRef ref = HeadRmsNormReference(x, w, dy, d, kEpsGemma3, kUnitOffset);

    EXPECT_EQ(ChangedOtherColumns(qk, xs, d), 0) << "the forward wrote v or pad columns";
    EXPECT_EQ(ChangedOtherColumns(dqk, dys, d), 0) << "the backward wrote v or pad columns";
    const int max_heads = std::max(d.H, d.Hkv);
    const double eps_rstd = Eps<float>(d.hs), eps_y = Eps<S>(d.hs), eps_dx = Eps<S>(2 * d.hs),
                 eps_dw = Eps<S>(d.rows * max_heads + d.hs);
    const std::vector<double> rstd_g(rstd.begin(), rstd.end()),
        y = ToDoubles(QkColumns(qk, d)), dx = ToDoubles(QkColumns(dqk, d)), dw_g = ToDoubles(dw);
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

// The add: one fp32 addition and one round-to-nearest-even conversion on both sides, so the
// device result is the host op's bit for bit; in place on either operand the same bits. Sizes:
// one, odd, and past one grid-stride pass (65535 blocks of 256 threads).
TYPED_TEST(GemmaOpsCudaTest, AddIsTheHostOpBitForBitAndMayRunInPlace) {
  using S = TypeParam;
  using Dev = DevOf<S>;
  for (const int64_t n : {int64_t{1}, int64_t{1001}, int64_t{65535} * 256 + 77}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<double> a = RandomValues(n, 4.0, 21), b = RandomValues(n, 4.0, 22);
    for (int64_t i = 0; i < n; i += 7) b[i] = -a[i] * 0.999;  // near-cancelling pairs
    const std::vector<S> as = Cast<S>(a), bs = Cast<S>(b);
    std::vector<S> host(n);
    ops::AddForward<S>(as.data(), bs.data(), n, host.data());

    gpu::DeviceSpan ga = this->Put(as), gb = this->Put(bs);
    gpu::DeviceSpan gout = this->Poisoned(n * sizeof(S));
    cudaStream_t cs = this->Native();
    ASSERT_TRUE(lops::LaunchAdd(cs, ga.as<Dev>(), gb.as<Dev>(), n, gout.as<Dev>()).ok());
    EXPECT_EQ(Bits(this->template Download<S>(gout, n)), Bits(host)) << "separate out";
    ASSERT_TRUE(lops::LaunchAdd(cs, ga.as<Dev>(), gb.as<Dev>(), n, ga.as<Dev>()).ok());
    EXPECT_EQ(Bits(this->template Download<S>(ga, n)), Bits(host)) << "out == a";
    gpu::DeviceSpan ga2 = this->Put(as);
    ASSERT_TRUE(lops::LaunchAdd(cs, ga2.as<Dev>(), gb.as<Dev>(), n, gb.as<Dev>()).ok());
    EXPECT_EQ(Bits(this->template Download<S>(gb, n)), Bits(host)) << "out == b";
  }
}

// Argument checks run before any CUDA call, so they hold without a GPU.
TEST(GemmaOpsCudaArguments, AddRejectsBadArgumentsBeforeLaunching) {
  float* p = reinterpret_cast<float*>(uintptr_t{256});  // never dereferenced
  const auto invalid = [](const Status& s) { return s.code() == StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(lops::LaunchAdd<float>(nullptr, p, p, -1, p))) << "negative size";
  EXPECT_TRUE(invalid(lops::LaunchAdd<float>(nullptr, nullptr, p, 8, p)));
  EXPECT_TRUE(invalid(lops::LaunchAdd<float>(nullptr, p, nullptr, 8, p)));
  EXPECT_TRUE(invalid(lops::LaunchAdd<float>(nullptr, p, p, 8, nullptr)));
  EXPECT_TRUE(lops::LaunchAdd<float>(nullptr, nullptr, nullptr, 0, nullptr).ok())
      << "nothing to add: no pointer is read";
  // unit_offset does not change the norms' checks.
  EXPECT_TRUE(invalid(lops::LaunchRmsNormForward<float>(nullptr, p, p, 0.0f, 4, 8, p, p, true)));
  EXPECT_TRUE(invalid(
      lops::LaunchHeadRmsNormForward<float>(nullptr, p, 47, 4, 6, 4, 8, p, 1e-6f, p, p, true)));
}

}  // namespace
}  // namespace strata::models
