#include "tools/device_select.h"

#include <gtest/gtest.h>

#include <string>

#ifdef STRATA_HAVE_CUDA
#include "gpu/cuda/cuda_device.h"
#endif

namespace strata::tools {
namespace {

using gpu::DeviceKind;

TEST(ResolveDeviceFlag, HostIsAlwaysHost) {
  for (bool built : {false, true}) {
    for (const StatusOr<int>& n :
         {StatusOr<int>(0), StatusOr<int>(2), StatusOr<int>(InternalError("driver crashed"))}) {
      auto k = ResolveDeviceFlag("host", built, n);
      ASSERT_TRUE(k.ok());
      EXPECT_EQ(*k, DeviceKind::kHost);
    }
  }
}

TEST(ResolveDeviceFlag, AutoPicksCudaOnlyWhenBuiltWithItAndAGpuIsVisible) {
  EXPECT_EQ(*ResolveDeviceFlag("auto", true, 1), DeviceKind::kCuda);
  EXPECT_EQ(*ResolveDeviceFlag("auto", true, 8), DeviceKind::kCuda);
  EXPECT_EQ(*ResolveDeviceFlag("auto", true, 0), DeviceKind::kHost);
  EXPECT_EQ(*ResolveDeviceFlag("auto", true, StatusOr<int>(InternalError("x"))), DeviceKind::kHost);
  EXPECT_EQ(*ResolveDeviceFlag("auto", false, 4), DeviceKind::kHost);
}

TEST(ResolveDeviceFlag, CudaWithoutTheBackendSaysRebuildOrUseHost) {
  auto k = ResolveDeviceFlag("cuda", false, 4);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), StatusCode::kFailedPrecondition);
  const std::string m = k.status().message();
  EXPECT_NE(m.find("built without the CUDA backend"), std::string::npos) << m;
  EXPECT_NE(m.find("--device host"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
}

TEST(ResolveDeviceFlag, CudaWithoutAGpuSaysWhyAndWhatToDo) {
  auto k = ResolveDeviceFlag("cuda", true, 0);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), StatusCode::kUnavailable);
  const std::string m = k.status().message();
  EXPECT_NE(m.find("no CUDA GPU is visible"), std::string::npos) << m;
  EXPECT_NE(m.find("nvidia-smi"), std::string::npos) << m;
  EXPECT_NE(m.find("--device host"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;

  auto e = ResolveDeviceFlag("cuda", true, StatusOr<int>(InternalError("cudaErrorUnknown")));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(e.status().message().find("cudaErrorUnknown"), std::string::npos);
  EXPECT_EQ(*ResolveDeviceFlag("cuda", true, 1), DeviceKind::kCuda);
}

TEST(ResolveDeviceFlag, UnknownFlagIsInvalid) {
  for (const char* flag : {"gpu", "CUDA", "", "cuda:0"}) {
    auto k = ResolveDeviceFlag(flag, true, 1);
    ASSERT_FALSE(k.ok()) << flag;
    EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(k.status().message().find("auto, host, cuda"), std::string::npos);
  }
}

// The real thing on this machine and this build: auto and cuda agree with what the
// CUDA runtime sees.
TEST(CreateDeviceFromFlag, FollowsThisBuildAndThisMachine) {
  DeviceSelectOptions o;
  auto host = CreateDeviceFromFlag("host", o);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->kind(), DeviceKind::kHost);

  int gpus = 0;
#ifdef STRATA_HAVE_CUDA
  EXPECT_TRUE(BuiltWithCuda());
  auto n = gpu::CudaDeviceCount();
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  gpus = *n;
#else
  EXPECT_FALSE(BuiltWithCuda());
#endif
  auto automatic = CreateDeviceFromFlag("auto", o);
  ASSERT_TRUE(automatic.ok()) << automatic.status().ToString();
  EXPECT_EQ((*automatic)->kind(), gpus > 0 ? DeviceKind::kCuda : DeviceKind::kHost);

  auto cuda = CreateDeviceFromFlag("cuda", o);
  if (gpus > 0) {
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    EXPECT_EQ((*cuda)->kind(), DeviceKind::kCuda);
  } else {
    ASSERT_FALSE(cuda.ok());
    EXPECT_EQ(cuda.status().message().find('\n'), std::string::npos);
    EXPECT_NE(cuda.status().message().find("--device host"), std::string::npos);
  }
}

}  // namespace
}  // namespace strata::tools
