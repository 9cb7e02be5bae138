#include "engine/version.h"

namespace strata::engine {

std::string_view VersionString() { return STRATA_ENGINE_VERSION_STRING; }

}  // namespace strata::engine
