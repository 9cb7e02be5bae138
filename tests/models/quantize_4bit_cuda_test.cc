// CudaDequantize4bit (models/ops/quantize_4bit.h) against the host Dequantize4bit, bit for bit:
// NF4 and FP4, with and without double quantization, fp32, bf16 and fp16 outputs, sizes with
// partial blocks and odd n, random weights with heavy tails, an all-zero block, subnormals and
// values up to 2^100. Also the argument checks. Label gpu: without a GPU every case skips with
// the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/ops/quantize_4bit.h"
#include "tests/gpu/cuda_test_util.h"

namespace strata::models::ops {
namespace {

template <typename S>
class Quantize4bitCudaTest : public gpu::testing::CudaTest {};

using StorageTypes = ::testing::Types<float, Bf16, Fp16>;
TYPED_TEST_SUITE(Quantize4bitCudaTest, StorageTypes);

// Normal weights of scale 0.02 (bf16-rounded), 1% outliers up to 100x, one all-zero block (when
// n has one), and a few values spread over 2^-130 .. 2^100.
std::vector<float> Values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) {
    v = normal(rng);
    if (unit(rng) < 0.01f) v *= 100.0f * unit(rng);
    if (unit(rng) < 0.002f) v = std::exp2(-130.0f + 230.0f * unit(rng));
    v = Bf16ToFloat(FloatToBf16(v));
  }
  if (n >= 3 * 64) std::fill(x.begin() + 64, x.begin() + 128, 0.0f);
  return x;
}

template <typename S>
uint32_t Bits(S v) {
  if constexpr (std::is_same_v<S, float>) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  } else {
    return v.bits;
  }
}

TYPED_TEST(Quantize4bitCudaTest, MatchesTheHostBitForBit) {
  using S = TypeParam;
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{127},
                    int64_t{64 * 256}, int64_t{64 * 256 + 1}, int64_t{64 * 256 * 3 + 77}}) {
    for (Quant4Type type : {Quant4Type::kNf4, Quant4Type::kFp4}) {
      for (bool dq : {false, true}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " " + std::string(Quant4TypeName(type)) +
                     " double_quant=" + std::to_string(dq));
        const Quant4Layout l = MakeQuant4Layout(n, {type, dq});
        const std::vector<float> x = Values(n, 17 + n);
        std::vector<std::byte> record(l.total_bytes);
        Quantize4bit(l, x.data(), record.data());
        std::vector<S> host(n);
        Dequantize4bit(l, record.data(), host.data());

        const gpu::DeviceSpan d_record = this->Carve(l.total_bytes);
        const gpu::DeviceSpan d_out = this->Carve(n * sizeof(S));
        this->Upload(d_record, record);
        const Status s = CudaDequantize4bit(l, d_record.data, d_out.as<S>(), *this->stream_);
        ASSERT_TRUE(s.ok()) << s.ToString();
        const std::vector<S> device = this->template Download<S>(d_out, n);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(Bits(device[i]), Bits(host[i])) << "i=" << i;
        }
      }
    }
  }
}

TYPED_TEST(Quantize4bitCudaTest, RefusesNullAndMisalignedPointers) {
  using S = TypeParam;
  const Quant4Layout l = MakeQuant4Layout(100, {Quant4Type::kNf4, true});
  const gpu::DeviceSpan d_record = this->Carve(l.total_bytes + 16);
  const gpu::DeviceSpan d_out = this->Carve(100 * sizeof(S));
  EXPECT_EQ(CudaDequantize4bit<S>(l, nullptr, d_out.as<S>(), *this->stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDequantize4bit<S>(l, d_record.data, nullptr, *this->stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDequantize4bit<S>(l, d_record.data + 4, d_out.as<S>(), *this->stream_).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::models::ops
