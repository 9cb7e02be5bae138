// When STRATA_TBB_MAX_THREADS is set (the `tsan` test preset sets it to 1), oneTBB runs every
// parallel loop of this test binary on the calling thread. Debian's libtbb is not built with
// ThreadSanitizer, so the synchronisation inside it is invisible to TSan and its task stealing
// would be reported as races in oneTBB's own headers; with one thread the engine's own threads
// (device streams, events, I/O) are still checked.
#include <oneapi/tbb/global_control.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

namespace {

struct TbbLimit {
  TbbLimit() {
    if (const char* v = std::getenv("STRATA_TBB_MAX_THREADS")) {
      control.emplace(tbb::global_control::max_allowed_parallelism,
                      static_cast<size_t>(std::max(1, std::atoi(v))));
    }
  }
  std::optional<tbb::global_control> control;
};

const TbbLimit tbb_limit;

}  // namespace
