// Fuzzes the PEFT adapter_config.json parser (models/lora_adapter.h, ParseLoraAdapterConfig): any
// bytes give a LoRA configuration in range or a one-line error naming the file, never a crash or
// a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "models/lora_adapter.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto c = strata::models::ParseLoraAdapterConfig(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz/adapter_config.json");
  if (!c.ok()) {
    const std::string m = c.status().message();
    if (!strata::fuzz::IsOneCleanLine(m, "fuzz/adapter_config.json")) {
      std::abort();
    }
    return 0;
  }
  if (c->lora.rank < 1 || c->lora.rank > strata::models::kMaxAdapterRank || !(c->lora.alpha > 0)) {
    std::abort();
  }
  return 0;
}
