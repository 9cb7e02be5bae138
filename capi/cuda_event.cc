#include "capi/cuda_event.h"

#include <dlfcn.h>
#include <fmt/format.h>

namespace strata::capi {

StatusOr<std::unique_ptr<CudaEventWaiter>> CudaEventWaiter::Load(
    const char* call, std::initializer_list<const char*> sonames) {
  // Pass 0: a runtime the process already has (the one the caller's events belong to);
  // pass 1: one from disk, for callers whose runtime is linked statically into their program
  // (their events are driver handles that any runtime instance can wait for).
  for (const bool loaded_only : {true, false}) {
    for (const char* soname : sonames) {
      void* library = dlopen(soname, RTLD_LAZY | RTLD_LOCAL | (loaded_only ? RTLD_NOLOAD : 0));
      if (library == nullptr) continue;
      auto sync = reinterpret_cast<SyncFn>(dlsym(library, "cudaEventSynchronize"));
      if (sync == nullptr) {
        dlclose(library);
        continue;
      }
      auto error_string = reinterpret_cast<ErrorStringFn>(dlsym(library, "cudaGetErrorString"));
      return std::unique_ptr<CudaEventWaiter>(
          new CudaEventWaiter(library, soname, loaded_only, sync, error_string));
    }
  }
  return FailedPreconditionError(fmt::format(
      "{}: cuda_event given but no CUDA runtime (libcudart) is loaded in this process", call));
}

CudaEventWaiter::~CudaEventWaiter() { dlclose(library_); }

Status CudaEventWaiter::Wait(void* event) const {
  const int error = sync_(event);
  if (error == 0) return Status::Ok();
  const char* text = error_string_ != nullptr ? error_string_(error) : nullptr;
  return InternalError(fmt::format("cudaEventSynchronize failed: {} (error {})",
                                   text != nullptr ? text : "unknown CUDA error", error));
}

}  // namespace strata::capi
