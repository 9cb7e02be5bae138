// The CUDA kernels' scalar helpers (gpu/cuda/cuda_dtype.cuh), compiled here for the host.
// Needs no GPU: the same source is what nvcc compiles into the kernels. Their fp16/bf16
// conversions are base/dtype.h's, checked exhaustively in tests/base/dtype_test.cc.
#include "gpu/cuda/cuda_dtype.cuh"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <limits>

namespace strata::gpu::cuda {
namespace {

// The NaN rule of ScaleDev is what x86-64 does when it multiplies: checked against the
// real multiplication on this host, for quiet and signalling NaNs of both signs.
TEST(CudaScalarConversions, ScaleKeepsNaNsAsTheHostMultiplicationDoes) {
  for (uint32_t u : {0x7fc00000u, 0x7fc12345u, 0x7f812345u, 0x7f800001u, 0xffc00001u, 0xff812345u,
                     0x7fffffffu}) {
    const float x = std::bit_cast<float>(u);
    for (float scale : {2.0f, 0.5f, 1024.0f, -3.0f}) {
      volatile float s = scale;  // a real multiplication at run time
      ASSERT_EQ(std::bit_cast<uint32_t>(ScaleDev(x, scale)), std::bit_cast<uint32_t>(x * s))
          << std::hex << u;
    }
  }
  for (float x : {1.5f, -0.0f, 1e-40f, 3e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(std::bit_cast<uint32_t>(ScaleDev(x, 4.0f)), std::bit_cast<uint32_t>(x * 4.0f));
  }
}

}  // namespace
}  // namespace strata::gpu::cuda
