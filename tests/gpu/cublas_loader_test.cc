// The cuBLAS loader (gpu/cuda/cublas_loader.h). Needs no GPU: loading libcublas and calling
// its host-only functions (status names, version) does not touch a device. The toolkit that
// built this test is installed, so loading must succeed here; the error paths are driven
// through internal::LoadCublas with libraries that are not cuBLAS.
#include "gpu/cuda/cublas_loader.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <library_types.h>

#include <string>
#include <thread>
#include <vector>

#include "gpu/cuda/cuda_status.h"

namespace strata::gpu::cuda {
namespace {

// Whether the dynamic linker has libcublas mapped, without loading it.
bool CublasIsMapped() {
  void* handle = dlopen(CublasLibraryName(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return false;
  dlclose(handle);  // RTLD_NOLOAD still took a reference
  return true;
}

// Taken during static initialization, after the executable's DT_NEEDED libraries are
// loaded and before any test runs: whether linking strata::gpu pulled cuBLAS in.
const bool kCublasMappedAtStart = CublasIsMapped();

TEST(CublasLoader, LibraryNameIsTheSonameOfTheHeadersMajorVersion) {
  EXPECT_EQ(std::string(CublasLibraryName()), "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR));
}

TEST(CublasLoader, LinkingStrataGpuDoesNotMapCublasUntilFirstUse) {
  EXPECT_FALSE(kCublasMappedAtStart)
      << CublasLibraryName() << " was mapped at process start: something links cuBLAS again";
  auto blas = Cublas();
  ASSERT_TRUE(blas.ok()) << blas.status().ToString();
  EXPECT_TRUE(CublasIsMapped());
}

TEST(CublasLoader, LoadsTheInstalledLibraryAndResolvesEveryEntryPoint) {
  auto loaded = Cublas();
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const CublasApi& api = **loaded;
  EXPECT_NE(api.Create, nullptr);
  EXPECT_NE(api.Destroy, nullptr);
  EXPECT_NE(api.SetStream, nullptr);
  EXPECT_NE(api.GetStream, nullptr);
  EXPECT_NE(api.SetWorkspace, nullptr);
  EXPECT_NE(api.SetPointerMode, nullptr);
  EXPECT_NE(api.SetMathMode, nullptr);
  EXPECT_NE(api.GemmEx, nullptr);
  EXPECT_NE(api.GemmStridedBatchedEx, nullptr);
  EXPECT_NE(api.GetStatusName, nullptr);
  EXPECT_NE(api.GetStatusString, nullptr);
  EXPECT_NE(api.GetProperty, nullptr);
  EXPECT_NE(api.path.find(CublasLibraryName()), std::string::npos) << api.path;

  // The resolved functions are cuBLAS' own: the library reports the major version of the
  // headers, and names every status exactly as Strata's table does.
  int major = -1;
  ASSERT_EQ(api.GetProperty(MAJOR_VERSION, &major), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(major, CUBLAS_VER_MAJOR);
  for (cublasStatus_t status :
       {CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_ALLOC_FAILED,
        CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_ARCH_MISMATCH, CUBLAS_STATUS_MAPPING_ERROR,
        CUBLAS_STATUS_EXECUTION_FAILED, CUBLAS_STATUS_INTERNAL_ERROR, CUBLAS_STATUS_NOT_SUPPORTED,
        CUBLAS_STATUS_LICENSE_ERROR}) {
    ASSERT_NE(api.GetStatusName(status), nullptr);
    EXPECT_STREQ(api.GetStatusName(status), CublasStatusName(status));
    ASSERT_NE(api.GetStatusString(status), nullptr);
    EXPECT_GT(std::string(api.GetStatusString(status)).size(), 0u);
  }
}

TEST(CublasLoader, LaterCallsReturnTheSameTable) {
  auto first = Cublas();
  auto second = Cublas();
  ASSERT_TRUE(first.ok() && second.ok()) << first.status().ToString();
  EXPECT_EQ(*first, *second);
}

// Each CTest entry is its own process, so here the threads race for the very first load.
TEST(CublasLoader, ConcurrentFirstCallsLoadOnceAndAllSeeTheSameTable) {
  constexpr int kThreads = 8;
  std::vector<const CublasApi*> seen(kThreads, nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&seen, i] {
      auto blas = Cublas();
      if (blas.ok()) seen[i] = *blas;
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_NE(seen[0], nullptr);
  for (int i = 1; i < kThreads; ++i) EXPECT_EQ(seen[i], seen[0]) << "thread " << i;
}

TEST(CublasLoader, MissingLibraryIsUnavailableAndSaysWhatToDo) {
  const std::string name = "libcublas.so.0.strata-test-does-not-exist";
  auto blas = internal::LoadCublas(name);
  ASSERT_FALSE(blas.ok());
  EXPECT_EQ(blas.status().code(), StatusCode::kUnavailable);
  const std::string m = blas.status().message();
  EXPECT_NE(m.find(name + " not found"), std::string::npos) << m;
  EXPECT_NE(m.find("cannot open shared object file"), std::string::npos) << m;  // dlerror's
  EXPECT_NE(m.find("--device host"), std::string::npos) << m;
}

TEST(CublasLoader, LibraryWithoutTheEntryPointsIsUnavailableAndNamesTheSymbol) {
  // The C math library is loadable everywhere and has none of cuBLAS' symbols.
  auto blas = internal::LoadCublas("libm.so.6");
  ASSERT_FALSE(blas.ok());
  EXPECT_EQ(blas.status().code(), StatusCode::kUnavailable);
  const std::string m = blas.status().message();
  EXPECT_NE(m.find("libm.so.6 has no entry point cublasCreate_v2"), std::string::npos) << m;
  EXPECT_NE(m.find("--device host"), std::string::npos) << m;
}

TEST(CublasLoader, FailedLoadLeavesTheProcessWideTableAlone) {
  ASSERT_FALSE(internal::LoadCublas("libm.so.6").ok());
  auto blas = Cublas();
  ASSERT_TRUE(blas.ok()) << blas.status().ToString();
  EXPECT_NE((*blas)->Create, nullptr);
}

// cuda_status.cc describes a cuBLAS error with the library's own sentence.
TEST(CublasStatus, ErrorNamesTheCallTheStatusAndCublasDescription) {
  auto blas = Cublas();
  ASSERT_TRUE(blas.ok()) << blas.status().ToString();
  const Status s = CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "cublasCreate");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  const std::string expected = std::string("cublasCreate failed: CUBLAS_STATUS_ALLOC_FAILED (") +
                               (*blas)->GetStatusString(CUBLAS_STATUS_ALLOC_FAILED) + ")";
  EXPECT_NE(s.message().find(expected), std::string::npos) << s.message();
  EXPECT_TRUE(CublasStatus(CUBLAS_STATUS_SUCCESS, "cublasCreate").ok());
}

}  // namespace
}  // namespace strata::gpu::cuda
