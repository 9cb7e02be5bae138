// models/ops/quantize_4bit.h on the host: the record layout, the tables, the packing, the error
// of a quantization round trip (bounded by the tables' gaps), exact reproduction of table
// values, zero and subnormal blocks, double quantization's absmax, determinism across thread
// counts, and the type names. Element-by-element agreement with bitsandbytes' rules is
// tests/python/test_quantize_4bit.py's (an independent reference, through quantize_4bit_dump).
#include "models/ops/quantize_4bit.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gpu/device.h"

namespace strata::models::ops {
namespace {

constexpr Quant4Type kTypes[] = {Quant4Type::kNf4, Quant4Type::kFp4};
constexpr int64_t kSizes[] = {1, 63, 64, 65, 127, 64 * 256, 64 * 256 + 1};

std::vector<std::byte> Quantize(const Quant4Layout& l, const std::vector<float>& x) {
  std::vector<std::byte> record(static_cast<size_t>(l.total_bytes), std::byte{0xAB});
  Quantize4bit(l, x.data(), record.data());
  return record;
}

std::vector<float> Dequantize(const Quant4Layout& l, const std::vector<std::byte>& record) {
  std::vector<float> out(static_cast<size_t>(l.n));
  Dequantize4bit(l, record.data(), out.data());
  return out;
}

float F32At(const std::vector<std::byte>& record, int64_t offset) {
  float v;
  std::memcpy(&v, record.data() + offset, sizeof v);
  return v;
}

uint8_t CodeAt(const std::vector<std::byte>& record, int64_t i) {
  const auto byte = static_cast<uint8_t>(record[static_cast<size_t>(i / 2)]);
  return i % 2 == 0 ? byte >> 4 : byte & 0x0F;
}

// The absmax block b dequantizes with (the stored one, or the double-quantized one decoded).
float DequantizedAbsmax(const Quant4Layout& l, const std::vector<std::byte>& record, int64_t b) {
  if (!l.params.double_quant) return F32At(record, l.absmax_offset + 4 * b);
  const auto q = static_cast<uint8_t>(record[static_cast<size_t>(l.absmax_offset + b)]);
  const float nested = F32At(record, l.nested_absmax_offset + 4 * (b / kQuant4NestedBlockSize));
  const float scaled = DynamicMap8()[q] * nested;
  return scaled + F32At(record, l.offset_offset);
}

// Bf16-rounded normal weights of scale 0.02, with a few outliers (heavy tails) of up to 2.
std::vector<float> RandomWeights(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) {
    v = normal(rng);
    if (unit(rng) < 0.01f) v *= 100.0f * unit(rng);
    v = Bf16ToFloat(FloatToBf16(v));
  }
  return x;
}

// Half the largest distance between neighbouring values of a table, counting the ends' distance
// to +-1 (a normalized value lies in [-1, 1]).
template <size_t N>
double HalfLargestGap(std::span<const float, N> table) {
  std::vector<double> v(table.begin(), table.end());
  std::sort(v.begin(), v.end());
  double gap = std::max(v.front() + 1.0, 1.0 - v.back()) * 2;
  for (size_t i = 1; i < v.size(); ++i) gap = std::max(gap, v[i] - v[i - 1]);
  return gap / 2;
}

TEST(Quant4Layout, PartsAreAlignedOrderedAndSized) {
  for (int64_t n : kSizes) {
    for (bool dq : {false, true}) {
      const Quant4Layout l = MakeQuant4Layout(n, {Quant4Type::kNf4, dq});
      SCOPED_TRACE("n=" + std::to_string(n) + " double_quant=" + std::to_string(dq));
      const int64_t blocks = (n + 63) / 64;
      EXPECT_EQ(l.n, n);
      EXPECT_EQ(l.blocks, blocks);
      EXPECT_EQ(l.codes_offset, 0);
      EXPECT_EQ(l.codes_bytes, (n + 1) / 2);
      EXPECT_EQ(l.absmax_offset % 16, 0);
      EXPECT_GE(l.absmax_offset, l.codes_bytes);
      EXPECT_LT(l.absmax_offset, l.codes_bytes + 16);
      EXPECT_EQ(l.total_bytes % 16, 0);
      if (!dq) {
        EXPECT_EQ(l.absmax_bytes, 4 * blocks);
        EXPECT_EQ(l.nested_blocks, 0);
        EXPECT_EQ(l.nested_absmax_bytes, 0);
        EXPECT_EQ(l.offset_offset, 0);
        EXPECT_EQ(l.total_bytes, (l.absmax_offset + l.absmax_bytes + 15) / 16 * 16);
        continue;
      }
      EXPECT_EQ(l.absmax_bytes, blocks);
      EXPECT_EQ(l.nested_blocks, (blocks + 255) / 256);
      EXPECT_EQ(l.nested_absmax_offset % 16, 0);
      EXPECT_GE(l.nested_absmax_offset, l.absmax_offset + l.absmax_bytes);
      EXPECT_LT(l.nested_absmax_offset, l.absmax_offset + l.absmax_bytes + 16);
      EXPECT_EQ(l.nested_absmax_bytes, 4 * l.nested_blocks);
      EXPECT_EQ(l.offset_offset % 16, 0);
      EXPECT_GE(l.offset_offset, l.nested_absmax_offset + l.nested_absmax_bytes);
      EXPECT_LT(l.offset_offset, l.nested_absmax_offset + l.nested_absmax_bytes + 16);
      EXPECT_EQ(l.total_bytes, l.offset_offset + 16);
    }
  }
}

TEST(Quant4Layout, ConcreteOffsets) {
  // n = 65: 33 bytes of codes, 2 blocks.
  const Quant4Layout plain = MakeQuant4Layout(65, {Quant4Type::kFp4, false});
  EXPECT_EQ(plain.absmax_offset, 48);
  EXPECT_EQ(plain.absmax_bytes, 8);
  EXPECT_EQ(plain.total_bytes, 64);
  const Quant4Layout dq = MakeQuant4Layout(65, {Quant4Type::kFp4, true});
  EXPECT_EQ(dq.absmax_offset, 48);
  EXPECT_EQ(dq.absmax_bytes, 2);
  EXPECT_EQ(dq.nested_blocks, 1);
  EXPECT_EQ(dq.nested_absmax_offset, 64);
  EXPECT_EQ(dq.offset_offset, 80);
  EXPECT_EQ(dq.total_bytes, 96);
  // 64 * 256 + 1 values: 257 blocks, 2 nested blocks.
  const Quant4Layout big = MakeQuant4Layout(64 * 256 + 1, {Quant4Type::kNf4, true});
  EXPECT_EQ(big.codes_bytes, 8193);
  EXPECT_EQ(big.absmax_offset, 8208);
  EXPECT_EQ(big.blocks, 257);
  EXPECT_EQ(big.nested_blocks, 2);
  EXPECT_EQ(big.nested_absmax_offset, 8208 + 272);
  EXPECT_EQ(big.offset_offset, 8208 + 272 + 16);
  EXPECT_EQ(big.total_bytes, 8208 + 272 + 32);
}

TEST(Quant4Maps, AreBitsandbytesTables) {
  const std::span<const float, 16> nf4 = Quant4Map(Quant4Type::kNf4);
  EXPECT_EQ(nf4[0], -1.0f);
  EXPECT_EQ(nf4[7], 0.0f);
  EXPECT_EQ(nf4[8], 0.07958029955625534f);
  EXPECT_EQ(nf4[15], 1.0f);
  EXPECT_TRUE(std::is_sorted(nf4.begin(), nf4.end()));
  // get_4bit_type("fp4"): the e2m1 values divided by 12 in fp32; "-0" is +0.
  const float fp4[8] = {0, 0.0625f, 8, 12, 4, 6, 2, 3};
  const std::span<const float, 16> map = Quant4Map(Quant4Type::kFp4);
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(std::bit_cast<uint32_t>(map[c]), std::bit_cast<uint32_t>(fp4[c] / 12.0f)) << c;
    EXPECT_EQ(std::bit_cast<uint32_t>(map[c + 8]), std::bit_cast<uint32_t>(-fp4[c] / 12.0f + 0.0f))
        << c + 8;
  }
  const std::span<const float, 256> d = DynamicMap8();
  EXPECT_TRUE(std::is_sorted(d.begin(), d.end()));
  EXPECT_EQ(std::adjacent_find(d.begin(), d.end()), d.end());
  EXPECT_EQ(d[127], 0.0f);
  EXPECT_EQ(d[255], 1.0f);
  for (int i = 0; i < 127; ++i) EXPECT_EQ(d[i], -d[254 - i]) << i;
}

TEST(Quantize4bit, PacksTheFirstValueOfAPairInTheHighNibble) {
  // NF4: 1.0 -> 0b1111, -1.0 -> 0b0000, 0.5 -> 0b1100 (below the 0.5017 midpoint); n odd: the
  // low nibble of the last byte is the code of the padding zero, 0b0111.
  const std::vector<float> x = {1.0f, -1.0f, 0.5f};
  const Quant4Layout l = MakeQuant4Layout(3, {Quant4Type::kNf4, false});
  const std::vector<std::byte> r = Quantize(l, x);
  EXPECT_EQ(static_cast<uint8_t>(r[0]), 0xF0);
  EXPECT_EQ(static_cast<uint8_t>(r[1]), 0xC7);
  EXPECT_EQ(F32At(r, l.absmax_offset), 1.0f);
  for (int64_t i = l.codes_bytes; i < l.absmax_offset; ++i) EXPECT_EQ(r[i], std::byte{0}) << i;
  // FP4: 1.0 -> 0b0011, -1.0 -> 0b1011, 0.5 -> 0b0101, the padding zero 0b0000.
  const Quant4Layout f = MakeQuant4Layout(3, {Quant4Type::kFp4, false});
  const std::vector<std::byte> rf = Quantize(f, x);
  EXPECT_EQ(static_cast<uint8_t>(rf[0]), 0x3B);
  EXPECT_EQ(static_cast<uint8_t>(rf[1]), 0x50);
}

TEST(Quantize4bit, RoundTripErrorIsAtMostHalfTheLargestGapTimesAbsmax) {
  for (Quant4Type type : kTypes) {
    const double half_gap = HalfLargestGap(Quant4Map(type));
    for (int64_t n : kSizes) {
      const Quant4Layout l = MakeQuant4Layout(n, {type, false});
      const std::vector<float> x = RandomWeights(n, 7 + n);
      const std::vector<std::byte> r = Quantize(l, x);
      const std::vector<float> y = Dequantize(l, r);
      for (int64_t b = 0; b < l.blocks; ++b) {
        double absmax = 0;
        for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) {
          absmax = std::max(absmax, std::fabs(static_cast<double>(x[i])));
        }
        ASSERT_EQ(F32At(r, l.absmax_offset + 4 * b), static_cast<float>(absmax));
        // The midpoints and the normalized values are fp32: a few ulps of slack.
        const double bound = (half_gap + 1e-6) * absmax;
        for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) {
          ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), bound)
              << Quant4TypeName(type) << " n=" << n << " i=" << i;
        }
      }
    }
  }
}

TEST(Quantize4bit, TableValuesTimesAPowerOfTwoComeBackExactly) {
  for (Quant4Type type : kTypes) {
    const std::span<const float, 16> map = Quant4Map(type);
    for (bool dq : {false, true}) {
      for (int exponent : {-20, -3, 0, 5}) {
        // 3 blocks (the last partial), each holding every table value (+-1 among them).
        const int64_t n = 64 * 2 + 40;
        std::vector<float> x(n);
        for (int64_t i = 0; i < n; ++i) x[i] = std::ldexp(map[(i * 5) % 16], exponent);
        const Quant4Layout l = MakeQuant4Layout(n, {type, dq});
        const std::vector<std::byte> r = Quantize(l, x);
        const std::vector<float> y = Dequantize(l, r);
        for (int64_t i = 0; i < n; ++i) {
          const int expected = static_cast<int>((i * 5) % 16);
          // FP4's code 8 is -0: -0.0 is not < 0, so it is quantized as +0, code 0.
          const int code = type == Quant4Type::kFp4 && expected == 8 ? 0 : expected;
          ASSERT_EQ(CodeAt(r, i), code) << Quant4TypeName(type) << " i=" << i << " dq=" << dq;
          ASSERT_EQ(y[i], x[i]) << Quant4TypeName(type) << " i=" << i << " dq=" << dq;
        }
      }
    }
  }
}

TEST(Quantize4bit, ZeroBlocksDequantizeToZero) {
  for (Quant4Type type : kTypes) {
    const int64_t n = 64 * 3 + 5;
    const std::vector<float> x(n, 0.0f);
    for (bool dq : {false, true}) {
      const Quant4Layout l = MakeQuant4Layout(n, {type, dq});
      const std::vector<std::byte> r = Quantize(l, x);
      // absmax 0: scale inf, 0 * inf = NaN, code 0 for every value (the padding's too).
      for (int64_t i = 0; i < l.codes_bytes; ++i) EXPECT_EQ(r[i], std::byte{0}) << i;
      const std::vector<float> y = Dequantize(l, r);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(y[i], 0.0f) << i;
        // NF4's code 0 is -1.0: -1.0 * 0 = -0.0 (bitsandbytes' result); FP4's is +0.
        ASSERT_EQ(std::signbit(y[i]), type == Quant4Type::kNf4) << i;
      }
    }
  }
}

TEST(Quantize4bit, SubnormalBlocksQuantizeAsZeroBlocks) {
  // bitsandbytes' fast-math kernels flush subnormal |x| to 0 before the maximum.
  const std::vector<float> x(64, std::numeric_limits<float>::denorm_min() * 1000);
  const Quant4Layout l = MakeQuant4Layout(64, {Quant4Type::kNf4, false});
  const std::vector<std::byte> r = Quantize(l, x);
  EXPECT_EQ(F32At(r, l.absmax_offset), 0.0f);
  for (int64_t i = 0; i < l.codes_bytes; ++i) EXPECT_EQ(r[i], std::byte{0}) << i;
}

TEST(Quantize4bit, OutputsAreFiniteForWideRangesAndZeroBlocks) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> exponent(-130.0f, 100.0f);
  std::uniform_int_distribution<int> sign(0, 1);
  const int64_t n = 64 * 300 + 31;
  std::vector<float> x(n);
  for (float& v : x) v = (sign(rng) ? -1.0f : 1.0f) * std::exp2(exponent(rng));
  std::fill(x.begin() + 640, x.begin() + 704, 0.0f);  // block 10 all zero
  for (Quant4Type type : kTypes) {
    for (bool dq : {false, true}) {
      const Quant4Layout l = MakeQuant4Layout(n, {type, dq});
      const std::vector<std::byte> r = Quantize(l, x);
      std::vector<Bf16> b(n);
      std::vector<Fp16> h(n);
      Dequantize4bit(l, r.data(), b.data());
      Dequantize4bit(l, r.data(), h.data());
      const std::vector<float> y = Dequantize(l, r);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_FALSE(std::isnan(y[i])) << i;
        ASSERT_FALSE(std::isnan(ToFloat(b[i]))) << i;
        ASSERT_FALSE(std::isnan(ToFloat(h[i]))) << i;  // may overflow to inf, never NaN
        ASSERT_EQ(b[i].bits, FloatToBf16(y[i])) << i;
        ASSERT_EQ(h[i].bits, FloatToHalf(y[i])) << i;
      }
    }
  }
}

TEST(Quantize4bit, DoubleQuantizedAbsmaxIsWithinHalfTheMapsGapOfTheNestedAbsmax) {
  const double half_gap = HalfLargestGap(DynamicMap8());
  for (int64_t n : {int64_t{64 * 256}, int64_t{64 * 256 * 3 + 65}}) {
    const std::vector<float> x = RandomWeights(n, 3 + n);
    const Quant4Layout l = MakeQuant4Layout(n, {Quant4Type::kNf4, true});
    const Quant4Layout plain = MakeQuant4Layout(n, {Quant4Type::kNf4, false});
    const std::vector<std::byte> r = Quantize(l, x);
    const std::vector<std::byte> rp = Quantize(plain, x);
    // The codes do not depend on how absmax is stored.
    ASSERT_TRUE(std::equal(r.begin(), r.begin() + l.codes_bytes, rp.begin()));
    std::vector<float> absmax(l.blocks);
    double sum = 0;
    for (int64_t b = 0; b < l.blocks; ++b) {
      absmax[b] = F32At(rp, plain.absmax_offset + 4 * b);
      sum += absmax[b];
    }
    const float offset = F32At(r, l.offset_offset);
    EXPECT_EQ(offset, static_cast<float>(sum / static_cast<double>(l.blocks)));
    for (int64_t nb = 0; nb < l.nested_blocks; ++nb) {
      float expected = 0;
      for (int64_t b = nb * 256; b < std::min(l.blocks, nb * 256 + 256); ++b) {
        expected = std::max(expected, std::fabs(absmax[b] - offset));
      }
      const float nested = F32At(r, l.nested_absmax_offset + 4 * nb);
      ASSERT_EQ(nested, expected) << nb;
      for (int64_t b = nb * 256; b < std::min(l.blocks, nb * 256 + 256); ++b) {
        const double err = std::fabs(static_cast<double>(DequantizedAbsmax(l, r, b)) - absmax[b]);
        ASSERT_LE(err, (half_gap + 1e-6) * nested + 1e-7 * offset) << b;
      }
    }
    // The dequantized values use the decoded absmax: the 4-bit bound with it.
    const std::vector<float> y = Dequantize(l, r);
    const std::span<const float, 16> map = Quant4Map(Quant4Type::kNf4);
    for (int64_t i = 0; i < n; ++i) {
      const float expected = map[CodeAt(r, i)] * DequantizedAbsmax(l, r, i / 64);
      ASSERT_EQ(y[i], expected) << i;
    }
  }
}

TEST(Quantize4bit, RecordDoesNotDependOnTheThreadCount) {
  const int64_t n = 64 * 256 * 5 + 3;
  const std::vector<float> x = RandomWeights(n, 5);
  for (Quant4Type type : kTypes) {
    const Quant4Layout l = MakeQuant4Layout(n, {type, true});
    const std::vector<std::byte> parallel = Quantize(l, x);
    const std::vector<float> y_parallel = Dequantize(l, parallel);
    tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
    EXPECT_EQ(Quantize(l, x), parallel);
    const std::vector<float> y = Dequantize(l, parallel);
    EXPECT_EQ(std::memcmp(y.data(), y_parallel.data(), 4 * y.size()), 0);
  }
}

TEST(Quant4Type, ParsesBitsandbytesNames) {
  for (Quant4Type type : kTypes) {
    const StatusOr<Quant4Type> parsed = ParseQuant4Type(Quant4TypeName(type));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, type);
  }
  EXPECT_EQ(Quant4TypeName(Quant4Type::kNf4), "nf4");
  EXPECT_EQ(Quant4TypeName(Quant4Type::kFp4), "fp4");
  for (const char* bad : {"NF4", "int4", "", "nf4 "}) {
    const StatusOr<Quant4Type> parsed = ParseQuant4Type(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(std::string("\"") + bad + "\""), std::string::npos);
    EXPECT_NE(parsed.status().message().find("nf4, fp4"), std::string::npos);
  }
}

#ifndef STRATA_HAVE_CUDA
TEST(CudaDequantize4bit, IsAFailedPreconditionWithoutTheCudaBackend) {
  auto device = gpu::CreateHostDevice({});
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  auto stream = (*device)->CreateStream("test");
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  const Quant4Layout l = MakeQuant4Layout(64, {Quant4Type::kNf4, true});
  std::vector<std::byte> record(l.total_bytes);
  std::vector<Bf16> out(64);
  const Status s = CudaDequantize4bit(l, record.data(), out.data(), **stream);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
}
#endif

}  // namespace
}  // namespace strata::models::ops
