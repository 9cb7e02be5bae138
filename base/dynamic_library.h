// Symbols of a library loaded at run time with dlopen (cuBLAS, NCCL): the lookups and messages
// the loaders share. Thread-safe as dlsym and dlinfo are; dlerror's text is per thread.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "base/status.h"

namespace strata {

// The calling thread's last dlopen/dlsym error, or "no reason given".
std::string DlError();

// The path the dynamic loader resolved for `library` (a dlopen handle), or `fallback`.
std::string DlLoadedPath(void* library, const std::string& fallback);

// The address of `symbol` in `library`; kUnavailable "<library_name> has no entry point <symbol>
// (dlsym: <why>): <hint>" when it has none.
StatusOr<void*> DlSymbol(void* library, const std::string& library_name, const char* symbol,
                         std::string_view hint);

// DlSymbol into a function pointer (POSIX guarantees that a dlsym address of a function converts
// to one).
template <typename Fn>
Status DlResolve(void* library, const std::string& library_name, const char* symbol,
                 std::string_view hint, Fn* out) {
  static_assert(std::is_pointer_v<Fn> && std::is_function_v<std::remove_pointer_t<Fn>>);
  STRATA_ASSIGN_OR_RETURN(void* address, DlSymbol(library, library_name, symbol, hint));
  *out = reinterpret_cast<Fn>(address);
  return Status::Ok();
}

}  // namespace strata
