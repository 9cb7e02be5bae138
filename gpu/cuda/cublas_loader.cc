// Loads cuBLAS with dlopen on first use; see cublas_loader.h for the contract.
#include "gpu/cuda/cublas_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <type_traits>

#include "base/dynamic_library.h"
#include "base/logging.h"

namespace strata::gpu::cuda {
namespace {

#define STRATA_CUBLAS_STRINGIFY_INNER_(x) #x
#define STRATA_CUBLAS_STRINGIFY_(x) STRATA_CUBLAS_STRINGIFY_INNER_(x)

constexpr char kCublasLibraryName[] = "libcublas.so." STRATA_CUBLAS_STRINGIFY_(CUBLAS_VER_MAJOR);
constexpr char kCublasLtLibraryName[] =
    "libcublasLt.so." STRATA_CUBLAS_STRINGIFY_(CUBLAS_VER_MAJOR);
constexpr char kCublasHeaderVersion[] =
    STRATA_CUBLAS_STRINGIFY_(CUBLAS_VER_MAJOR) "." STRATA_CUBLAS_STRINGIFY_(CUBLAS_VER_MINOR);

// dlerror() is per thread (glibc); it is read right after the failing call.

// Closes the library unless released (a half-resolved table leaves nothing loaded).
class LibraryHandle {
 public:
  explicit LibraryHandle(void* handle) : handle_(handle) {}
  ~LibraryHandle() {
    if (handle_) dlclose(handle_);
  }
  LibraryHandle(const LibraryHandle&) = delete;
  LibraryHandle& operator=(const LibraryHandle&) = delete;
  void* get() const { return handle_; }
  void Release() { handle_ = nullptr; }

 private:
  void* handle_;
};

template <typename Fn>
Status Resolve(void* library, const std::string& library_name, const char* symbol, Fn* out) {
  return DlResolve(library, library_name, symbol,
                   fmt::format("it is older than the cuBLAS {} headers this strata was built "
                               "with; install cuBLAS {} or newer, or use --device host",
                               kCublasHeaderVersion, kCublasHeaderVersion),
                   out);
}

}  // namespace

const char* CublasLibraryName() { return kCublasLibraryName; }
const char* CublasLtLibraryName() { return kCublasLtLibraryName; }

namespace internal {

StatusOr<CublasApi> LoadCublas(const std::string& library_name) {
  // RTLD_NOW: an unresolvable symbol inside cuBLAS (or a missing libcublasLt) fails here,
  // not later in the middle of a step; RTLD_LOCAL: its symbols stay out of the global
  // namespace of the process.
  LibraryHandle library(dlopen(library_name.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (library.get() == nullptr) {
    return UnavailableError(
        fmt::format("{} not found or not loadable (dlopen: {}): install the CUDA toolkit's cuBLAS "
                    "(libcublas{}) or add its directory to LD_LIBRARY_PATH, or use --device host",
                    library_name, DlError(), CUBLAS_VER_MAJOR));
  }
  CublasApi api{};
  void* const lib = library.get();
  // Each dlsym name is checked against the member's type: the name is the exported symbol
  // of the very declaration the member's type was taken from.
#define STRATA_CUBLAS_RESOLVE_(member, symbol)                                       \
  static_assert(std::is_same_v<decltype(api.member), decltype(&::symbol)>, #symbol); \
  STRATA_RETURN_IF_ERROR(Resolve(lib, library_name, #symbol, &api.member))
  STRATA_CUBLAS_RESOLVE_(Create, cublasCreate_v2);
  STRATA_CUBLAS_RESOLVE_(Destroy, cublasDestroy_v2);
  STRATA_CUBLAS_RESOLVE_(SetStream, cublasSetStream_v2);
  STRATA_CUBLAS_RESOLVE_(GetStream, cublasGetStream_v2);
  STRATA_CUBLAS_RESOLVE_(SetWorkspace, cublasSetWorkspace_v2);
  STRATA_CUBLAS_RESOLVE_(SetPointerMode, cublasSetPointerMode_v2);
  STRATA_CUBLAS_RESOLVE_(SetMathMode, cublasSetMathMode);
  STRATA_CUBLAS_RESOLVE_(GetStatusName, cublasGetStatusName);
  STRATA_CUBLAS_RESOLVE_(GetStatusString, cublasGetStatusString);
  STRATA_CUBLAS_RESOLVE_(GetProperty, cublasGetProperty);
#undef STRATA_CUBLAS_RESOLVE_
  // The two overloaded names: their member types select the exported overload
  // (cublas_loader.h), so only the names are given here.
  STRATA_RETURN_IF_ERROR(Resolve(lib, library_name, "cublasGemmEx", &api.GemmEx));
  STRATA_RETURN_IF_ERROR(
      Resolve(lib, library_name, "cublasGemmStridedBatchedEx", &api.GemmStridedBatchedEx));
  api.path = DlLoadedPath(lib, library_name);
  library.Release();  // loaded for the life of the process
  return api;
}

StatusOr<CublasLtApi> LoadCublasLt(const std::string& library_name) {
  LibraryHandle library(dlopen(library_name.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (library.get() == nullptr) {
    return UnavailableError(
        fmt::format("{} not found or not loadable (dlopen: {}): install the CUDA toolkit's cuBLAS "
                    "(libcublasLt{}) or add its directory to LD_LIBRARY_PATH, or use --device host",
                    library_name, DlError(), CUBLAS_VER_MAJOR));
  }
  CublasLtApi api{};
  void* const lib = library.get();
#define STRATA_CUBLASLT_RESOLVE_(member, symbol)                                     \
  static_assert(std::is_same_v<decltype(api.member), decltype(&::symbol)>, #symbol); \
  STRATA_RETURN_IF_ERROR(Resolve(lib, library_name, #symbol, &api.member))
  STRATA_CUBLASLT_RESOLVE_(Create, cublasLtCreate);
  STRATA_CUBLASLT_RESOLVE_(Destroy, cublasLtDestroy);
  STRATA_CUBLASLT_RESOLVE_(MatmulDescCreate, cublasLtMatmulDescCreate);
  STRATA_CUBLASLT_RESOLVE_(MatmulDescDestroy, cublasLtMatmulDescDestroy);
  STRATA_CUBLASLT_RESOLVE_(MatmulDescSetAttribute, cublasLtMatmulDescSetAttribute);
  STRATA_CUBLASLT_RESOLVE_(MatrixLayoutCreate, cublasLtMatrixLayoutCreate);
  STRATA_CUBLASLT_RESOLVE_(MatrixLayoutDestroy, cublasLtMatrixLayoutDestroy);
  STRATA_CUBLASLT_RESOLVE_(MatmulPreferenceCreate, cublasLtMatmulPreferenceCreate);
  STRATA_CUBLASLT_RESOLVE_(MatmulPreferenceDestroy, cublasLtMatmulPreferenceDestroy);
  STRATA_CUBLASLT_RESOLVE_(MatmulPreferenceSetAttribute, cublasLtMatmulPreferenceSetAttribute);
  STRATA_CUBLASLT_RESOLVE_(MatmulAlgoGetHeuristic, cublasLtMatmulAlgoGetHeuristic);
  STRATA_CUBLASLT_RESOLVE_(Matmul, cublasLtMatmul);
#undef STRATA_CUBLASLT_RESOLVE_
  api.path = DlLoadedPath(lib, library_name);
  library.Release();  // loaded for the life of the process
  return api;
}

}  // namespace internal

StatusOr<const CublasLtApi*> CublasLt() {
  static const StatusOr<CublasLtApi>* const loaded = [] {
    auto* result = new StatusOr<CublasLtApi>(internal::LoadCublasLt(kCublasLtLibraryName));
    if (!result->ok()) {  // an unversioned development link, where only that exists
      auto fallback = internal::LoadCublasLt("libcublasLt.so");
      if (fallback.ok()) *result = std::move(fallback);
    }
    if (result->ok()) {
      STRATA_LOG_DEBUG("cuBLASLt loaded from {}", (*result)->path);
    } else {
      STRATA_LOG_DEBUG("cuBLASLt not loaded: {}", result->status().message());
    }
    return result;
  }();
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

StatusOr<const CublasApi*> Cublas() {
  // Loaded once (a function-local static is initialized exactly once, thread-safely) and
  // never destroyed: streams may still destroy their handles during static destruction.
  static const StatusOr<CublasApi>* const loaded = [] {
    auto* result = new StatusOr<CublasApi>(internal::LoadCublas(kCublasLibraryName));
    if (result->ok()) {
      STRATA_LOG_DEBUG("cuBLAS loaded from {}", (*result)->path);
    } else {
      STRATA_LOG_DEBUG("cuBLAS not loaded: {}", result->status().message());
    }
    return result;
  }();
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

}  // namespace strata::gpu::cuda
