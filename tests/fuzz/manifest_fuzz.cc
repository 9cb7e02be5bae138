// Fuzzes the checkpoint manifest parser (engine/checkpoint.h): any bytes give a manifest or an
// error; an accepted manifest serializes to text that parses back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "engine/checkpoint.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  strata::StatusOr<strata::engine::Manifest> manifest =
      strata::engine::ParseManifest(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!manifest.ok()) {
    if (!strata::fuzz::IsOneCleanLine(manifest.status().message())) std::abort();
    return 0;
  }
  const std::string again = strata::engine::SerializeManifest(*manifest);
  if (!strata::engine::ParseManifest(again).ok()) std::abort();
  return 0;
}
