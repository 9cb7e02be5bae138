// Loads NCCL with dlopen on first use; see nccl_loader.h for the contract.
#include "comm/nccl_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <type_traits>

#include "base/dynamic_library.h"

// Where nccl.h is at hand, the declarations of nccl_loader.h are checked against it: the same
// enum values, the same unique id size and the same function types (with our types substituted).
#if __has_include(<nccl.h>)
#include <nccl.h>
namespace strata::comm::nccl {
static_assert(sizeof(UniqueId) == sizeof(::ncclUniqueId));
static_assert(sizeof(Result) == sizeof(::ncclResult_t));
static_assert(sizeof(DataType) == sizeof(::ncclDataType_t));
static_assert(sizeof(RedOp) == sizeof(::ncclRedOp_t));
// The enums are compared as ints (they are distinct enum types).
constexpr bool SameValue(int ours, int theirs) { return ours == theirs; }
static_assert(SameValue(kSuccess, ::ncclSuccess) &&
              SameValue(kUnhandledCudaError, ::ncclUnhandledCudaError) &&
              SameValue(kSystemError, ::ncclSystemError) &&
              SameValue(kInternalError, ::ncclInternalError) &&
              SameValue(kInvalidArgument, ::ncclInvalidArgument) &&
              SameValue(kInvalidUsage, ::ncclInvalidUsage) &&
              SameValue(kRemoteError, ::ncclRemoteError) &&
              SameValue(kInProgress, ::ncclInProgress));
static_assert(SameValue(kFloat16, ::ncclFloat16) && SameValue(kFloat32, ::ncclFloat32) &&
              SameValue(kBfloat16, ::ncclBfloat16));
static_assert(SameValue(kSum, ::ncclSum));
static_assert(std::is_same_v<decltype(&::ncclAllGather),
                             ::ncclResult_t (*)(const void*, void*, size_t, ::ncclDataType_t,
                                                ::ncclComm_t, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&::ncclReduceScatter),
                             ::ncclResult_t (*)(const void*, void*, size_t, ::ncclDataType_t,
                                                ::ncclRedOp_t, ::ncclComm_t, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&::ncclCommInitRank),
                             ::ncclResult_t (*)(::ncclComm_t*, int, ::ncclUniqueId, int)>);
}  // namespace strata::comm::nccl
#endif

namespace strata::comm::nccl {
namespace {

constexpr char kNcclLibraryName[] = "libnccl.so.2";

template <typename Fn>
Status Resolve(void* library, const std::string& library_name, const char* symbol, Fn* out) {
  return DlResolve(library, library_name, symbol, "install NCCL 2.12 or newer", out);
}

}  // namespace

const char* NcclLibraryName() { return kNcclLibraryName; }

Status NcclStatus(const NcclApi* api, Result result, const char* call) {
  if (result == kSuccess) return Status::Ok();
  const char* text =
      api != nullptr && api->GetErrorString != nullptr ? api->GetErrorString(result) : nullptr;
  std::string message =
      fmt::format("{} failed: {} (ncclResult_t {})", call, text != nullptr ? text : "NCCL error",
                  static_cast<int>(result));
  switch (result) {
    case kInvalidArgument:
    case kInvalidUsage:
      return InvalidArgumentError(std::move(message));
    case kSystemError:
    case kRemoteError:
      return UnavailableError(std::move(message));
    default:
      return InternalError(std::move(message));
  }
}

namespace internal {

StatusOr<NcclApi> LoadNccl(const std::string& library_name) {
  void* library = dlopen(library_name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    return UnavailableError(fmt::format(
        "{} not found or not loadable (dlopen: {}): install NCCL (NVIDIA's libnccl2 package, or "
        "the nvidia-nccl wheel) and add its directory to LD_LIBRARY_PATH, or use one GPU",
        library_name, DlError()));
  }
  NcclApi api{};
  Status s = Resolve(library, library_name, "ncclGetVersion", &api.GetVersion);
  if (s.ok()) s = Resolve(library, library_name, "ncclGetUniqueId", &api.GetUniqueId);
  if (s.ok()) s = Resolve(library, library_name, "ncclCommInitRank", &api.CommInitRank);
  if (s.ok()) s = Resolve(library, library_name, "ncclCommDestroy", &api.CommDestroy);
  if (s.ok()) s = Resolve(library, library_name, "ncclCommAbort", &api.CommAbort);
  if (s.ok()) s = Resolve(library, library_name, "ncclReduceScatter", &api.ReduceScatter);
  if (s.ok()) s = Resolve(library, library_name, "ncclAllGather", &api.AllGather);
  if (s.ok()) s = Resolve(library, library_name, "ncclGetErrorString", &api.GetErrorString);
  if (s.ok()) s = NcclStatus(&api, api.GetVersion(&api.version), "ncclGetVersion");
  if (!s.ok()) {
    dlclose(library);  // nothing stays loaded after a failure
    return s;
  }
  api.path = DlLoadedPath(library, library_name);
  return api;  // the library stays loaded for the life of the process
}

}  // namespace internal

StatusOr<const NcclApi*> Nccl() {
  static const StatusOr<NcclApi> loaded = internal::LoadNccl(kNcclLibraryName);
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

}  // namespace strata::comm::nccl
