// capi/cuda_event.h: finding cudaEventSynchronize at run time, without linking the runtime.
#include "capi/cuda_event.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace strata::capi {
namespace {

using ::testing::HasSubstr;

TEST(CudaEventWaiter, NoRuntimeIsFailedPreconditionNamingTheCall) {
  auto waiter =
      CudaEventWaiter::Load("strata_offload_submit_grad", {"libstrata-test-no-such-cudart.so.99"});
  ASSERT_FALSE(waiter.ok());
  EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(waiter.status().message(),
            "strata_offload_submit_grad: cuda_event given but no CUDA runtime (libcudart) is "
            "loaded in this process");
}

// A library that is loaded but is no CUDA runtime (no cudaEventSynchronize) does not count.
TEST(CudaEventWaiter, LoadedLibraryWithoutTheSymbolIsSkipped) {
  auto waiter = CudaEventWaiter::Load("call", {"libc.so.6", "libm.so.6"});
  ASSERT_FALSE(waiter.ok());
  EXPECT_EQ(waiter.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(waiter.status().message(), HasSubstr("no CUDA runtime"));
}

// Where a runtime is installed, it is found under the first soname that has it; a runtime
// that the process had loaded before is reported as such. No event is made (no GPU needed).
TEST(CudaEventWaiter, FindsAnInstalledRuntimePreferringTheLoadedOne) {
  void* preloaded = nullptr;
  const char* found = nullptr;
  for (const char* soname : kCudaRuntimeSonames) {
    preloaded = dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
    if (preloaded != nullptr) {
      found = soname;
      break;
    }
  }
  if (preloaded == nullptr) GTEST_SKIP() << "no CUDA runtime installed here";
  auto waiter = CudaEventWaiter::Load("call");
  ASSERT_TRUE(waiter.ok()) << waiter.status().ToString();
  EXPECT_TRUE((*waiter)->was_loaded());
  EXPECT_STREQ((*waiter)->soname(), found);
  waiter = CudaEventWaiter::Load("call", {"libstrata-test-no-such-cudart.so.99", found});
  ASSERT_TRUE(waiter.ok());
  EXPECT_STREQ((*waiter)->soname(), found);
  dlclose(preloaded);
}

}  // namespace
}  // namespace strata::capi
