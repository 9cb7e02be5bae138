// Fuzzes the Hugging Face config.json parser (models/hf_config.h, ParseHfConfig): any bytes give
// a configuration or a one-line error naming the file, never a crash or a sanitizer report; an
// accepted configuration has positive shapes and writes a config.json that parses back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "models/hf_config.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto c = strata::models::ParseHfConfig(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
  if (!c.ok()) {
    const std::string m = c.status().message();
    if (!strata::fuzz::IsOneCleanLine(m, "fuzz/config.json")) {
      std::abort();
    }
    return 0;
  }
  if (strata::models::HfNumBlocks(*c) < 3) std::abort();
  if (!strata::models::ParseHfConfig(strata::models::HfConfigJson(*c), "again").ok()) std::abort();
  return 0;
}
