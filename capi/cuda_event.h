// Internal to capi/: waiting for a caller's cudaEvent_t without linking the CUDA runtime.
//
// libstrata.so must load into processes with no CUDA at all, and where there is CUDA it must
// use the runtime the caller's events come from (PyTorch's libcudart.so.N), not a second copy.
// So cudaEventSynchronize is looked up at run time with dlopen: first a runtime already loaded
// in this process (RTLD_NOLOAD), by each soname in turn; only when none is loaded, a runtime
// the dynamic loader can find.
#pragma once

#include <initializer_list>
#include <memory>

#include "base/status.h"

namespace strata::capi {

// The sonames tried, in this order, first among the loaded libraries, then from disk.
inline constexpr std::initializer_list<const char*> kCudaRuntimeSonames = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11", "libcudart.so"};

class CudaEventWaiter {
 public:
  // Finds cudaEventSynchronize (and cudaGetErrorString for messages) in the first of `sonames`
  // already loaded in the process, else in the first that dlopen can load. kFailedPrecondition
  // "<call>: cuda_event given but no CUDA runtime (libcudart) is loaded in this process" when
  // none is found or it lacks the symbol. Thread-safe (dlopen is).
  static StatusOr<std::unique_ptr<CudaEventWaiter>> Load(
      const char* call, std::initializer_list<const char*> sonames = kCudaRuntimeSonames);
  ~CudaEventWaiter();  // drops this object's reference to the library (dlclose)
  CudaEventWaiter(const CudaEventWaiter&) = delete;
  CudaEventWaiter& operator=(const CudaEventWaiter&) = delete;

  // Blocks the calling thread until `event` (a cudaEvent_t of this runtime) has completed.
  // kInternal "cudaEventSynchronize failed: <CUDA's error string> (error N)" when CUDA reports an
  // error. Thread-safe; any thread (CUDA waits for an event from any host thread).
  Status Wait(void* event) const;

  // The soname the runtime was found under, e.g. "libcudart.so.13".
  const char* soname() const { return soname_; }
  // True when the runtime was already loaded before Load (the caller's), false when Load loaded
  // it from disk.
  bool was_loaded() const { return was_loaded_; }

 private:
  using SyncFn = int (*)(void* event);  // cudaError_t cudaEventSynchronize(cudaEvent_t)
  using ErrorStringFn = const char* (*)(int error);  // const char* cudaGetErrorString(cudaError_t)
  CudaEventWaiter(void* library, const char* soname, bool was_loaded, SyncFn sync,
                  ErrorStringFn error_string)
      : library_(library),
        soname_(soname),
        was_loaded_(was_loaded),
        sync_(sync),
        error_string_(error_string) {}

  void* library_;
  const char* soname_;
  bool was_loaded_;
  SyncFn sync_;
  ErrorStringFn error_string_;  // may be null
};

}  // namespace strata::capi
