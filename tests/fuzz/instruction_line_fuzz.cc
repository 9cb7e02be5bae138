// Fuzzes the parser of one JSON line of instruction data (data/instruction_data.h,
// ParseInstructionLine: "messages", or "prompt" and "response"): any bytes give messages with an
// assistant message or a one-line error, never a crash or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "data/instruction_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto messages = strata::data::ParseInstructionLine(
      std::string_view(reinterpret_cast<const char*>(data), size));
  if (!messages.ok()) {
    const std::string m = messages.status().message();
    if (m.empty() || m.find('\n') != std::string::npos || m.size() > 4096) std::abort();
    return 0;
  }
  bool assistant = false;
  for (const auto& msg : *messages) assistant |= msg.role == strata::data::ChatRole::kAssistant;
  if (!assistant) std::abort();
  return 0;
}
