#include "base/dynamic_library.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

namespace strata {

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "no reason given";
}

std::string DlLoadedPath(void* library, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(library, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

StatusOr<void*> DlSymbol(void* library, const std::string& library_name, const char* symbol,
                         std::string_view hint) {
  dlerror();  // clear a stale error, so the one read below is this lookup's
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    return UnavailableError(fmt::format("{} has no entry point {} (dlsym: {}): {}", library_name,
                                        symbol, DlError(), hint));
  }
  return address;
}

}  // namespace strata
