// Fuzzes the `strata train --config` parser (tools/config.h): any bytes give OK or an error
// naming the file and each problem, one clean line each, never a crash, a hang or a sanitizer
// report.
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
  if (s.ok()) return 0;
  // Several problems are listed one per line under a first line naming the file ("fuzz.json: 2
  // problems:", docs/deepspeed.md); each line is held to the rule, the first names the file.
  std::string_view m = s.message();
  for (bool first = true;; first = false) {
    const size_t end = m.find('\n');
    if (!strata::fuzz::IsOneCleanLine(m.substr(0, end), first ? "fuzz.json" : "")) std::abort();
    if (end == std::string_view::npos) break;
    m.remove_prefix(end + 1);
  }
  return 0;
}
