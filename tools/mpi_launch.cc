#include "tools/mpi_launch.h"

#include <cstdlib>
#include <initializer_list>

namespace strata::tools {

bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

}  // namespace strata::tools
