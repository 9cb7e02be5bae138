// The NCCL loader (comm/nccl_loader.h) and the NCCL communicator's paths that need no GPU. CUDA
// builds only. Loading libnccl and asking its version does not touch a device; where libnccl.so.2
// is not installed, the cases that need it skip and say so.
#include "comm/nccl_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "comm/communicator.h"
#include "gpu/cuda/cuda_device.h"

namespace strata::comm {
namespace {

using ::testing::HasSubstr;

TEST(NcclLoader, LibraryNameIsTheSonameOfNccl2) {
  EXPECT_EQ(std::string(nccl::NcclLibraryName()), "libnccl.so.2");
}

TEST(NcclLoader, LoadsTheInstalledLibraryWithEveryEntryPoint) {
  auto api = nccl::Nccl();
  if (!api.ok() && api.status().message().find("not found") != std::string::npos) {
    GTEST_SKIP() << "NCCL is not installed here: " << api.status().message();
  }
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  const nccl::NcclApi& a = **api;
  for (const void* fn :
       {reinterpret_cast<const void*>(a.GetVersion), reinterpret_cast<const void*>(a.GetUniqueId),
        reinterpret_cast<const void*>(a.CommInitRank), reinterpret_cast<const void*>(a.CommDestroy),
        reinterpret_cast<const void*>(a.CommAbort), reinterpret_cast<const void*>(a.ReduceScatter),
        reinterpret_cast<const void*>(a.AllGather),
        reinterpret_cast<const void*>(a.GetErrorString)}) {
    EXPECT_NE(fn, nullptr);
  }
  EXPECT_GE(a.version, 21200);  // NCCL 2.12 or newer: 2.x.y is x * 100 + y after 2.9
  EXPECT_THAT(a.path, HasSubstr("libnccl.so"));
  EXPECT_EQ(*nccl::Nccl(), *api);  // loaded once
}

TEST(NcclLoader, AMissingLibraryIsUnavailableAndSaysWhatToInstall) {
  auto api = nccl::internal::LoadNccl("libnccl-strata-test-missing.so.2");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(api.status().message(), HasSubstr("libnccl-strata-test-missing.so.2 not found"));
  EXPECT_THAT(api.status().message(), HasSubstr("install NCCL"));
}

TEST(NcclLoader, ALibraryWithoutTheEntryPointsNamesTheFirstMissingOne) {
  auto api = nccl::internal::LoadNccl("libm.so.6");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(api.status().message(), HasSubstr("has no entry point ncclGetVersion"));
}

TEST(NcclLoader, ResultsBecomeStatusCodesByWhatTheCallerShouldDo) {
  EXPECT_TRUE(nccl::NcclStatus(nullptr, nccl::kSuccess, "ncclAllGather").ok());
  Status s = nccl::NcclStatus(nullptr, nccl::kInvalidUsage, "ncclAllGather(...)");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ncclAllGather(...) failed"));
  EXPECT_EQ(nccl::NcclStatus(nullptr, nccl::kInvalidArgument, "x").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(nccl::NcclStatus(nullptr, nccl::kRemoteError, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(nccl::NcclStatus(nullptr, nccl::kSystemError, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(nccl::NcclStatus(nullptr, nccl::kInternalError, "x").code(), StatusCode::kInternal);
  auto api = nccl::Nccl();
  if (api.ok()) {  // with the library, the message is NCCL's own text
    Status t = nccl::NcclStatus(*api, nccl::kRemoteError, "ncclReduceScatter");
    EXPECT_THAT(t.message(), HasSubstr((*api)->GetErrorString(nccl::kRemoteError)));
  }
}

TEST(NcclCommunicator, WithoutAGpuIsUnavailable) {
  auto n = gpu::CudaDeviceCount();
  if (n.ok() && *n > 0) GTEST_SKIP() << "a GPU is present; this tests the no-GPU path";
  auto local = CreateLocalCommunicator();
  auto comm = CreateNcclCommunicator(*local);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable) << comm.status().ToString();
}

}  // namespace
}  // namespace strata::comm
