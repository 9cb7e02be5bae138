// Fuzzes the `strata train --config` parser (tools/config.h): any bytes give OK or an error that
// names the problem, never a crash, a hang or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tests/fuzz/one_line_message.h"
#include "tools/config.h"
#include "tools/train_command.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  strata::tools::TrainFlags flags;
  const strata::Status s = strata::tools::ApplyTrainConfigText(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json", &flags);
  if (!s.ok() && !strata::fuzz::IsOneCleanLine(s.message())) std::abort();
  return 0;
}
