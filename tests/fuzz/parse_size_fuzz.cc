// Fuzzes ParseSize (base/units.h), the parser of every size flag and config value: it must
// return a value or an error for any bytes, and an accepted size must print and parse back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "base/units.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::StatusOr<uint64_t> parsed = strata::ParseSize(text);
  if (!parsed.ok()) {
    // Every error says what was wrong, in one line.
    if (!strata::fuzz::IsOneCleanLine(parsed.status().message())) std::abort();
    return 0;
  }
  // A plain decimal byte count of the result parses to the same value.
  strata::StatusOr<uint64_t> again = strata::ParseSize(std::to_string(*parsed));
  if (!again.ok() || *again != *parsed) std::abort();
  (void)strata::FormatBytes(*parsed);
  return 0;
}
