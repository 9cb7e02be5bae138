// cuBLAS GEMM wrapper (gpu/cuda/cuda_gemm.h) against a double reference, element by element,
// with a tolerance derived from the dtypes: the inputs are rounded to their dtype first
// (the reference uses the rounded values), so what remains is fp32 accumulation (or TF32
// products when asked) and the rounding of C to its dtype.
#include "gpu/cuda/cuda_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "tests/gpu/cuda_test_util.h"

namespace strata::gpu {
namespace {

using testing::CudaTest;

// Values of `dtype` stored as raw elements plus their exact value as double.
struct Matrix {
  std::vector<std::byte> raw;
  std::vector<double> value;
};

Matrix Random(DType t, size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  Matrix m{std::vector<std::byte>(n * SizeOf(t)), std::vector<double>(n)};
  for (size_t i = 0; i < n; ++i) {
    const float f = u(rng);
    if (t == DType::kF32) {
      std::memcpy(&m.raw[i * 4], &f, 4);
      m.value[i] = f;
    } else {
      const uint16_t h = t == DType::kF16 ? FloatToHalf(f) : FloatToBf16(f);
      std::memcpy(&m.raw[i * 2], &h, 2);
      m.value[i] = t == DType::kF16 ? HalfToFloat(h) : Bf16ToFloat(h);
    }
  }
  return m;
}

double Elem(const std::vector<std::byte>& raw, DType t, size_t i) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, &raw[i * 4], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &raw[i * 2], 2);
  return t == DType::kF16 ? HalfToFloat(h) : Bf16ToFloat(h);
}

// One quiet NaN of `t`, raw (0x7e00 would be NaN in fp16 but the finite 2^125 in bf16).
std::vector<std::byte> NaNElem(DType t) {
  std::vector<std::byte> out(SizeOf(t));
  if (t == DType::kF32) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(out.data(), &nan, 4);
  } else {
    const uint16_t nan = t == DType::kF16 ? 0x7e00 : 0x7fc0;
    std::memcpy(out.data(), &nan, 2);
  }
  return out;
}

double UnitRoundoff(DType t) {
  return t == DType::kF32 ? 0x1p-24 : (t == DType::kF16 ? 0x1p-11 : 0x1p-8);
}

struct Case {
  bool trans_a, trans_b;
  int64_t M, N, K;
  DType ab, c;
  bool tf32 = false;
  float beta = 0.5f;
  int64_t batch = 1;
};

std::string Name(const Case& c) {
  return std::string(DTypeName(c.ab)) + "->" + std::string(DTypeName(c.c)) +
         (c.trans_a ? " A^T" : " A") + (c.trans_b ? " B^T" : " B") + " M=" + std::to_string(c.M) +
         " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
         " batch=" + std::to_string(c.batch) + (c.tf32 ? " tf32" : "");
}

class CudaGemmTest : public CudaTest {
 protected:
  void Check(const Case& c, uint32_t seed) {
    std::mt19937 rng(seed);
    const float alpha = 0.75f;
    // Stored shapes with padded row strides (ld = row length + 3).
    const int64_t a_rows = c.trans_a ? c.K : c.M, a_cols = c.trans_a ? c.M : c.K;
    const int64_t b_rows = c.trans_b ? c.N : c.K, b_cols = c.trans_b ? c.K : c.N;
    const int64_t lda = a_cols + 3, ldb = b_cols + 3, ldc = c.N + 3;
    const int64_t sa = a_rows * lda + 5, sb = b_rows * ldb + 1, sc = c.M * ldc + 2;
    const Matrix A = Random(c.ab, sa * c.batch, rng);
    const Matrix B = Random(c.ab, sb * c.batch, rng);
    Matrix C0 = Random(c.c, sc * c.batch, rng);
    if (c.beta == 0.0f) {  // C must not be read: fill it with NaN
      const std::vector<std::byte> nan = NaNElem(c.c);
      for (int64_t i = 0; i < sc * c.batch; ++i) {
        std::memcpy(&C0.raw[i * nan.size()], nan.data(), nan.size());
      }
    }
    DeviceSpan dA = Carve(A.raw.size()), dB = Carve(B.raw.size()), dC = Carve(C0.raw.size());
    Upload(dA, A.raw);
    Upload(dB, B.raw);
    Upload(dC, C0.raw);
    cuda::GemmOptions options;
    options.allow_tf32 = c.tf32;
    Status s;
    if (c.batch == 1) {
      s = cuda::Gemm(*stream_, c.trans_a, c.trans_b, c.M, c.N, c.K, alpha, dA.data, lda, dB.data,
                     ldb, c.beta, dC.data, ldc, c.ab, c.c, options);
    } else {
      s = cuda::GemmStridedBatched(*stream_, c.trans_a, c.trans_b, c.M, c.N, c.K, alpha, dA.data,
                                   lda, sa, dB.data, ldb, sb, c.beta, dC.data, ldc, sc, c.batch,
                                   c.ab, c.c, options);
    }
    ASSERT_TRUE(s.ok()) << Name(c) << ": " << s.ToString();
    const auto got = Download<std::byte>(dC, C0.raw.size());
    // Per-product error: none for fp16/bf16 (their products are exact in fp32), one fp32
    // rounding for fp32, or TF32 inputs (10 mantissa bits, rounded or truncated: 2^-10 each)
    // when asked. Per addition: one fp32 ulp (2u; tensor cores may truncate). Loose enough
    // for any summation order, tight enough that TF32 would fail the plain fp32 cases.
    const double u_acc = 2 * 0x1p-24;
    const double u_prod = c.tf32 ? 2 * 0x1p-10 : (c.ab == DType::kF32 ? 0x1p-24 : 0.0);
    const double u_out = UnitRoundoff(c.c);
    int shown = 0;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = 0; i < c.M; ++i) {
        for (int64_t j = 0; j < c.N; ++j) {
          double dot = 0, mag = 0;
          for (int64_t k = 0; k < c.K; ++k) {
            const double a = A.value[b * sa + (c.trans_a ? k * lda + i : i * lda + k)];
            const double bb = B.value[b * sb + (c.trans_b ? j * ldb + k : k * ldb + j)];
            dot += a * bb;
            mag += std::fabs(a * bb);
          }
          const double c_in = C0.value[b * sc + i * ldc + j];
          const double want = alpha * dot + (c.beta == 0.0f ? 0.0 : c.beta * c_in);
          const double tol = (u_prod + (c.K + 2) * u_acc) * std::fabs(alpha) * mag +
                             (c.K + 2) * u_acc * std::fabs(c.beta * c_in) +
                             u_out * std::fabs(want) + 1e-30;
          const double v = Elem(got, c.c, b * sc + i * ldc + j);
          if (!(std::fabs(v - want) <= tol) && shown++ < 5) {
            ADD_FAILURE() << Name(c) << " C[" << b << "][" << i << "][" << j << "] = " << v
                          << ", want " << want << " +- " << tol;
          }
        }
      }
      // The padding between rows and batch entries is untouched.
      for (int64_t i = 0; i < c.M; ++i) {
        for (int64_t j = c.N; j < ldc; ++j) {
          const size_t at = b * sc + i * ldc + j;
          ASSERT_EQ(std::memcmp(&got[at * SizeOf(c.c)], &C0.raw[at * SizeOf(c.c)], SizeOf(c.c)), 0)
              << Name(c) << " wrote into the row padding at " << at;
        }
      }
    }
  }
};

TEST_F(CudaGemmTest, MatchesADoubleReferenceOnOddShapesAllDtypesAndTransposes) {
  const int64_t shapes[][3] = {{1, 1, 1},   {7, 33, 129}, {129, 7, 33},   {33, 129, 7},
                               {1, 129, 7}, {129, 1, 33}, {129, 129, 129}};
  const std::pair<DType, DType> types[] = {{DType::kF32, DType::kF32},
                                           {DType::kF16, DType::kF16},
                                           {DType::kF16, DType::kF32},
                                           {DType::kBF16, DType::kBF16},
                                           {DType::kBF16, DType::kF32}};
  uint32_t seed = 1;
  for (const auto& [ab, c] : types) {
    for (const auto& s : shapes) {
      for (int t = 0; t < 4; ++t) {
        Check({(t & 1) != 0, (t & 2) != 0, s[0], s[1], s[2], ab, c}, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(CudaGemmTest, BetaZeroDoesNotReadC) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    Case c{false, true, 33, 7, 129, t, t};
    c.beta = 0.0f;
    Check(c, 77);
  }
}

// The poison of BetaZeroDoesNotReadC is NaN in every output type (else reading C with
// beta 0 would go unnoticed). No GPU needed.
TEST(CudaGemmPoison, IsNaNInEveryOutputType) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    EXPECT_TRUE(std::isnan(Elem(NaNElem(t), t, 0))) << DTypeName(t);
  }
}

TEST_F(CudaGemmTest, Tf32OnlyWhenAskedAndWithinItsTolerance) {
  Check({false, false, 129, 33, 129, DType::kF32, DType::kF32, /*tf32=*/true}, 5);
  Check({true, true, 7, 129, 33, DType::kF32, DType::kF32, /*tf32=*/true}, 6);
}

TEST_F(CudaGemmTest, StridedBatchedMatchesPerBatchReference) {
  Case c{false, true, 33, 7, 129, DType::kBF16, DType::kF32};
  c.batch = 3;
  Check(c, 9);
  Case d{true, false, 7, 129, 33, DType::kF16, DType::kF16};
  d.batch = 4;
  Check(d, 10);
}

// Argument checks come before any cuBLAS call, so they run (and must fail cleanly) even
// on a host-backend stream and without a GPU.
TEST(CudaGemmArguments, AreCheckedBeforeCublasIsCalled) {
  auto dev = CreateHostDevice({});
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream("host");
  ASSERT_TRUE(stream.ok());
  Stream& s = **stream;
  float buf[64] = {};
  // fp16 inputs into a bf16 output: not a cuBLAS pair.
  EXPECT_EQ(
      cuda::Gemm(s, false, false, 2, 2, 2, 1, buf, 2, buf, 2, 0, buf, 2, DType::kF16, DType::kBF16)
          .code(),
      StatusCode::kInvalidArgument);
  // fp32 inputs into a 16-bit output.
  EXPECT_EQ(
      cuda::Gemm(s, false, false, 2, 2, 2, 1, buf, 2, buf, 2, 0, buf, 2, DType::kF32, DType::kF16)
          .code(),
      StatusCode::kInvalidArgument);
  // lda shorter than A's stored row (K=3).
  EXPECT_EQ(
      cuda::Gemm(s, false, false, 2, 2, 3, 1, buf, 2, buf, 2, 0, buf, 2, DType::kF32, DType::kF32)
          .code(),
      StatusCode::kInvalidArgument);
  // With trans_a the stored row of A is M long.
  EXPECT_EQ(
      cuda::Gemm(s, true, false, 4, 2, 3, 1, buf, 3, buf, 2, 0, buf, 2, DType::kF32, DType::kF32)
          .code(),
      StatusCode::kInvalidArgument);
  // Shapes past cuBLAS' int.
  EXPECT_EQ(cuda::Gemm(s, false, false, int64_t{1} << 31, 2, 2, 1, buf, 2, buf, 2, 0, buf, 2,
                       DType::kF32, DType::kF32)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::Gemm(s, false, false, 2, 2, 2, 1, nullptr, 2, buf, 2, 0, buf, 2, DType::kF32,
                       DType::kF32)
                .code(),
            StatusCode::kInvalidArgument);
  // Overlapping outputs of a batched GEMM.
  EXPECT_EQ(cuda::GemmStridedBatched(s, false, false, 2, 2, 2, 1, buf, 2, 4, buf, 2, 4, 0, buf, 2,
                                     3, 2, DType::kF32, DType::kF32)
                .code(),
            StatusCode::kInvalidArgument);
  // Empty products are a no-op (nothing is called).
  EXPECT_TRUE(cuda::Gemm(s, false, false, 0, 2, 2, 1, nullptr, 2, nullptr, 2, 0, nullptr, 2,
                         DType::kF32, DType::kF32)
                  .ok());
}

}  // namespace
}  // namespace strata::gpu
