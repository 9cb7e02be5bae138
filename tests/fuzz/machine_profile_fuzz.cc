// Fuzzes the machine profile parser (engine/plan/machine_profile.h): any bytes give a profile whose
// values are in their plausible ranges or a one-line error naming the file, never a crash or a
// sanitizer report; an accepted profile writes JSON that parses back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "engine/plan/machine_profile.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto p = strata::engine::ParseMachineProfile(text, "'fuzz.json'");
  if (!p.ok()) {
    const std::string m = p.status().message();
    if (!strata::fuzz::IsOneCleanLine(m, "'fuzz.json'")) {
      std::abort();
    }
    return 0;
  }
  if (p->host && (p->host->cores < 1 || !(p->host->memory_GiB > 0))) std::abort();
  if (p->device && !(p->device->bf16_TFLOPs > 0 && p->device->memory_GiB <= 1048576)) {
    std::abort();
  }
  if (!strata::engine::ParseMachineProfile(strata::engine::MachineProfileJson(*p), "again").ok()) {
    std::abort();
  }
  return 0;
}
