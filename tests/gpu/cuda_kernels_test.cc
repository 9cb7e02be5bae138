// The CUDA kernels (gpu/cuda/cuda_kernels.cuh) element by element against the host
// backend (conversions: bit for bit) and a double reference (sum of squares).
#include "gpu/cuda/cuda_kernels.cuh"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "gpu/cuda/cuda_native.h"
#include "tests/gpu/cuda_test_util.h"

namespace strata::gpu {
namespace {

using cuda::LaunchConvert;
using testing::CudaTest;

// Random raw elements of `dtype`: normal values over a wide exponent range, denormals of
// fp32 and of fp16, values past the fp16 range, exact rounding ties, +-0, +-inf, NaNs
// with payloads; 16-bit types take random bit patterns too (every class appears).
std::vector<std::byte> RandomElems(DType dtype, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n * SizeOf(dtype));
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-40, 40);
  for (size_t i = 0; i < n; ++i) {
    float f;
    switch (rng() % 12) {
      case 0:
        f = std::ldexp(mant(rng), -135);  // fp32 denormal
        break;
      case 1:
        f = std::ldexp(mant(rng), -20);  // fp16 denormal range
        break;
      case 2:
        f = mant(rng) * 70000.0f;  // past fp16 max 65504
        break;
      case 3:
        f = mant(rng) * 3.0e38f;  // near fp32 max (overflows when scaled up)
        break;
      case 4: {  // an exact fp16 tie: 1 + 2^-11 times a power of two
        f = std::ldexp(1.0f + std::ldexp(1.0f, -11), exp(rng) % 14) * (rng() & 1 ? 1 : -1);
        break;
      }
      case 5: {
        const float special[] = {0.0f,
                                 -0.0f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::bit_cast<float>(0x7fc12345u),
                                 std::bit_cast<float>(0xff812345u),  // signalling, negative
                                 65504.0f,
                                 65520.0f};
        f = special[rng() % 8];
        break;
      }
      default:
        f = std::ldexp(mant(rng), exp(rng));
    }
    if (dtype == DType::kF32) {
      std::memcpy(&out[i * 4], &f, 4);
    } else {
      uint16_t h = (rng() % 3 == 0) ? static_cast<uint16_t>(rng())
                                    : (dtype == DType::kF16 ? FloatToHalf(f) : FloatToBf16(f));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// The host backend's conversion (its Stream::Convert), the reference.
std::vector<std::byte> HostConvert(const std::vector<std::byte>& src, DType st, DType dt, size_t n,
                                   float scale) {
  auto dev = CreateHostDevice({});
  STRATA_CHECK(dev.ok());
  auto arena = (*dev)->CreateArena(n * 4 + n * SizeOf(dt) + 1024);
  auto stream = (*dev)->CreateStream("host");
  STRATA_CHECK(arena.ok() && stream.ok());
  DeviceSpan s = *(*arena)->Carve(n * SizeOf(st), "src");
  DeviceSpan d = *(*arena)->Carve(n * SizeOf(dt), "dst");
  std::vector<std::byte> out(n * SizeOf(dt));
  STRATA_CHECK((*stream)
                   ->LaunchHost([&] {
                     std::memcpy(s.data, src.data(), src.size());
                     return Status::Ok();
                   })
                   .ok());
  STRATA_CHECK((*stream)->Convert(d, dt, s, st, static_cast<int64_t>(n), scale).ok());
  STRATA_CHECK((*stream)
                   ->LaunchHost([&] {
                     std::memcpy(out.data(), d.data, out.size());
                     return Status::Ok();
                   })
                   .ok());
  STRATA_CHECK((*stream)->Synchronize().ok());
  return out;
}

// Bit for bit, with the first mismatches printed as raw bits.
void ExpectSameElems(const std::vector<std::byte>& got, const std::vector<std::byte>& want,
                     DType dt, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  const size_t es = SizeOf(dt);
  int shown = 0;
  size_t bad = 0;
  for (size_t i = 0; i < got.size() / es; ++i) {
    if (std::memcmp(&got[i * es], &want[i * es], es) != 0) {
      ++bad;
      if (shown++ < 5) {
        uint32_t g = 0, w = 0;
        std::memcpy(&g, &got[i * es], es);
        std::memcpy(&w, &want[i * es], es);
        ADD_FAILURE() << what << ": element " << i << " is 0x" << std::hex << g
                      << ", the host backend gives 0x" << w;
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

class CudaKernelsTest : public CudaTest {
 protected:
  std::vector<std::byte> DeviceConvert(const std::vector<std::byte>& src, DType st, DType dt,
                                       size_t n, float scale) {
    // A scratch arena per call: the fixture's arena is never freed, and this runs 144 times.
    auto scratch = device_->CreateArena(src.size() + n * SizeOf(dt) + 1024);
    EXPECT_TRUE(scratch.ok()) << scratch.status().ToString();
    if (!scratch.ok()) return {};
    DeviceSpan s = *(*scratch)->Carve(std::max<size_t>(src.size(), 1), "src");
    DeviceSpan d = *(*scratch)->Carve(std::max<size_t>(n * SizeOf(dt), 1), "dst");
    Upload(s, src);
    EXPECT_TRUE(stream_->Convert(d, dt, s, st, static_cast<int64_t>(n), scale).ok());
    return Download<std::byte>(d, n * SizeOf(dt));
  }
};

TEST_F(CudaKernelsTest, ConvertMatchesTheHostBackendBitForBit) {
  const DType types[] = {DType::kF32, DType::kF16, DType::kBF16};
  uint32_t seed = 1;
  for (DType st : types) {
    for (DType dt : types) {
      for (float scale : {1.0f, 1024.0f, 1.0f / 3.0f, 65536.0f * 65536.0f}) {
        for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{(1 << 20) + 3}}) {
          const auto src = RandomElems(st, n, seed++);
          const auto want = HostConvert(src, st, dt, n, scale);
          const auto got = DeviceConvert(src, st, dt, n, scale);
          ExpectSameElems(got, want, dt,
                          std::string(DTypeName(st)) + "->" + std::string(DTypeName(dt)) +
                              " n=" + std::to_string(n) + " scale=" + std::to_string(scale));
          if (HasFatalFailure() || HasFailure()) return;
        }
      }
    }
  }
}

// In-place narrowing runs as a first chunk plus launches over doubling ranges; lengths
// around each boundary must come out exactly as the out-of-place host conversion.
TEST_F(CudaKernelsTest, InPlaceNarrowingMatchesOutOfPlace) {
  for (DType dt : {DType::kF16, DType::kBF16}) {
    for (size_t n : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{8193},
                     size_t{5 * 4096 + 3}, size_t{3000001}}) {
      const auto src = RandomElems(DType::kF32, n, static_cast<uint32_t>(n));
      const auto want = HostConvert(src, DType::kF32, dt, n, 0.5f);
      DeviceSpan buf = Carve(n * 4);
      Upload(buf, src);
      ASSERT_TRUE(stream_->Convert(buf, dt, buf, DType::kF32, static_cast<int64_t>(n), 0.5f).ok());
      ExpectSameElems(Download<std::byte>(buf, n * 2), want, dt,
                      "in place fp32->" + std::string(DTypeName(dt)) + " n=" + std::to_string(n));
    }
  }
}

TEST_F(CudaKernelsTest, InPlaceSameWidthAndScaleMatchTheHost) {
  const size_t n = 100003;
  const auto h = RandomElems(DType::kF16, n, 5);
  DeviceSpan buf = Carve(n * 2);
  Upload(buf, h);
  ASSERT_TRUE(stream_->Convert(buf, DType::kBF16, buf, DType::kF16, n, 3.0f).ok());
  ExpectSameElems(Download<std::byte>(buf, n * 2),
                  HostConvert(h, DType::kF16, DType::kBF16, n, 3.0f), DType::kBF16,
                  "in place fp16->bf16");
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    const auto x = RandomElems(t, n, 6);
    DeviceSpan d = Carve(n * SizeOf(t));
    Upload(d, x);
    ASSERT_TRUE(cuda::LaunchScale(NativeStream(*stream_), d.data, t, n, 1.0f / 1024).ok());
    ExpectSameElems(Download<std::byte>(d, n * SizeOf(t)), HostConvert(x, t, t, n, 1.0f / 1024), t,
                    "scale " + std::string(DTypeName(t)));
  }
}

TEST_F(CudaKernelsTest, ConvertOutOfBoundsIsRejectedByTheStream) {
  DeviceSpan d = Carve(1024);
  EXPECT_EQ(stream_->Convert(d.subspan(0, 100), DType::kF32, d, DType::kF16, 26, 1.0f).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(stream_->Convert(d, DType::kF32, d, DType::kF16, 16, 1.0f).code(),
            StatusCode::kInvalidArgument);  // in-place widening
  EXPECT_TRUE(stream_->Synchronize().ok());
}

// Arguments are checked before anything is launched, so these need no GPU.
TEST(CudaKernelArguments, AreCheckedBeforeLaunching) {
  auto* p = reinterpret_cast<void*>(uintptr_t{0x100000});
  auto* odd = reinterpret_cast<void*>(uintptr_t{0x100002});
  EXPECT_EQ(LaunchConvert(nullptr, p, DType::kF16, p, DType::kF32, -1, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchConvert(nullptr, p, DType::kF16, nullptr, DType::kF32, 5, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchConvert(nullptr, p, DType::kF16, odd, DType::kF32, 5, 1).code(),
            StatusCode::kInvalidArgument);  // fp32 source not 4-byte aligned
  EXPECT_EQ(LaunchConvert(nullptr, p, DType::kF32, p, DType::kF16, 5, 1).code(),
            StatusCode::kInvalidArgument);  // in-place widening
  auto* shifted = reinterpret_cast<void*>(uintptr_t{0x100004});
  EXPECT_EQ(LaunchConvert(nullptr, shifted, DType::kF32, p, DType::kF32, 5, 1).code(),
            StatusCode::kInvalidArgument);  // partial overlap
  EXPECT_EQ(LaunchConvert(nullptr, p, static_cast<DType>(7), p, DType::kF32, 5, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(LaunchConvert(nullptr, nullptr, DType::kF16, nullptr, DType::kF32, 0, 1).ok());

  auto* result = reinterpret_cast<cuda::NonFiniteAndSumSquares*>(uintptr_t{0x200000});
  const size_t need = cuda::NonFiniteAndSumSquaresWorkspaceBytes(1 << 24);
  EXPECT_GT(need, 0u);
  EXPECT_LE(need, size_t{16} << 10);
  EXPECT_EQ(
      cuda::LaunchNonFiniteAndSumSquares(nullptr, p, DType::kF32, 1 << 24, p, need - 1, result)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::LaunchNonFiniteAndSumSquares(nullptr, p, DType::kF32, 10, p, need, nullptr).code(),
      StatusCode::kInvalidArgument);

  cuda::PackSegment* segs = reinterpret_cast<cuda::PackSegment*>(uintptr_t{0x300000});
  EXPECT_EQ(cuda::LaunchPackBucket(nullptr, p, DType::kF32, 100, segs, 1, 10, 1).code(),
            StatusCode::kInvalidArgument);  // bucket must be 16-bit
  EXPECT_EQ(cuda::LaunchPackBucket(nullptr, p, DType::kF16, 100, segs, 1, 101, 1).code(),
            StatusCode::kInvalidArgument);  // more than the bucket holds
  EXPECT_EQ(cuda::LaunchPackBucket(nullptr, p, DType::kF16, 100, nullptr, 1, 10, 1).code(),
            StatusCode::kInvalidArgument);
}

double ToDouble(const std::vector<std::byte>& x, DType t, size_t i) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, &x[i * 4], 4);
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, &x[i * 2], 2);
      return HalfToFloat(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, &x[i * 2], 2);
      return Bf16ToFloat(h);
    }
  }
  return 0;
}

TEST_F(CudaKernelsTest, SumOfSquaresMatchesADoubleReferenceAndCountsNonFinite) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4097}, size_t{(1 << 22) + 5}}) {
      std::vector<std::byte> x(n * SizeOf(t));
      uint64_t want_bad = 0;
      for (size_t i = 0; i < n; ++i) {
        float f = normal(rng);
        if (rng() % 1000 == 0) {
          f = (rng() & 1) ? std::numeric_limits<float>::infinity()
                          : std::numeric_limits<float>::quiet_NaN();
        }
        if (t == DType::kF32) {
          std::memcpy(&x[i * 4], &f, 4);
        } else {
          const uint16_t h = t == DType::kF16 ? FloatToHalf(f) : FloatToBf16(f);
          std::memcpy(&x[i * 2], &h, 2);
        }
      }
      double want = 0;
      for (size_t i = 0; i < n; ++i) {
        const double v = ToDouble(x, t, i);
        if (std::isfinite(v)) {
          want += v * v;
        } else {
          ++want_bad;
        }
      }
      DeviceSpan dx = Carve(std::max<size_t>(x.size(), 1));
      const size_t ws = cuda::NonFiniteAndSumSquaresWorkspaceBytes(n);
      DeviceSpan work = Carve(ws);
      DeviceSpan res = Carve(sizeof(cuda::NonFiniteAndSumSquares));
      Upload(dx, x);
      cuda::NonFiniteAndSumSquares got[2];
      for (int run = 0; run < 2; ++run) {
        ASSERT_TRUE(cuda::LaunchNonFiniteAndSumSquares(NativeStream(*stream_), dx.data, t, n,
                                                       work.data, ws,
                                                       res.as<cuda::NonFiniteAndSumSquares>())
                        .ok());
        auto r = Download<cuda::NonFiniteAndSumSquares>(res, 1);
        got[run] = r[0];
      }
      EXPECT_EQ(got[0].num_nonfinite, want_bad) << DTypeName(t) << " n=" << n;
      // fp32 accumulation: each element's square is rounded once and added to a partial
      // of at most ~16 terms per thread plus a log2(256)-deep tree, so relative error
      // stays under ~32 fp32 ulps of the total (all terms are positive).
      EXPECT_NEAR(got[0].sum_squares, want, 32 * 0x1p-24 * want + 1e-30)
          << DTypeName(t) << " n=" << n;
      // Deterministic: the same bits on a second run.
      EXPECT_EQ(std::bit_cast<uint64_t>(got[0].sum_squares),
                std::bit_cast<uint64_t>(got[1].sum_squares));
    }
  }
}

TEST_F(CudaKernelsTest, PackBucketGathersScaledSegmentsAndLeavesGapsAlone) {
  const size_t sizes[] = {1, 7, 33, 1000, 129, 70001};
  const float scale = 512.0f;
  for (DType bt : {DType::kF16, DType::kBF16}) {
    std::vector<std::vector<float>> tensors;
    std::vector<DeviceSpan> spans;
    std::vector<cuda::PackSegment> segs;
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 40.0f);  // some overflow fp16 once scaled
    int64_t offset = 3;                                   // gaps before and between segments
    int64_t total = 0;
    for (size_t n : sizes) {
      std::vector<float> t(n);
      for (auto& v : t) v = normal(rng);
      DeviceSpan d = Carve(n * 4);
      Upload(d, t);
      segs.push_back({d.as<const float>(), static_cast<int64_t>(n), offset});
      offset += static_cast<int64_t>(n) + 5;
      total += static_cast<int64_t>(n);
      tensors.push_back(std::move(t));
      spans.push_back(d);
    }
    const int64_t capacity = offset;
    DeviceSpan table = Carve(segs.size() * sizeof(cuda::PackSegment));
    Upload(table, segs);
    DeviceSpan bucket = Carve(capacity * 2);
    Upload(bucket, std::vector<uint16_t>(capacity, 0xabcd));
    ASSERT_TRUE(cuda::LaunchPackBucket(NativeStream(*stream_), bucket.data, bt, capacity,
                                       table.as<const cuda::PackSegment>(),
                                       static_cast<int>(segs.size()), total, scale)
                    .ok());
    const auto got = Download<uint16_t>(bucket, capacity);
    std::vector<uint16_t> want(capacity, 0xabcd);
    for (size_t s = 0; s < segs.size(); ++s) {
      for (size_t i = 0; i < tensors[s].size(); ++i) {
        const float x = tensors[s][i] * scale;
        want[segs[s].dst_offset_elems + i] = bt == DType::kF16 ? FloatToHalf(x) : FloatToBf16(x);
      }
    }
    for (int64_t i = 0; i < capacity; ++i) {
      ASSERT_EQ(got[i], want[i]) << DTypeName(bt) << " bucket element " << i;
    }
  }
}

}  // namespace
}  // namespace strata::gpu
