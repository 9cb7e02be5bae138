// Fuzzes the model.safetensors.index.json reader (models/hf_checkpoint.h,
// ParseSafetensorsIndex): any bytes give a weight map whose every shard is a plain file name in
// the model directory, or a one-line error naming the file, never a crash or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "models/hf_checkpoint.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr std::string_view kPath = "fuzz/model.safetensors.index.json";
  auto map = strata::models::ParseSafetensorsIndex(
      std::string_view(reinterpret_cast<const char*>(data), size), kPath);
  if (!map.ok()) {
    if (!strata::fuzz::IsOneCleanLine(map.status().message(), kPath)) std::abort();
    return 0;
  }
  for (const auto& [tensor, shard] : *map) {
    if (shard.empty() || shard == "." || shard == ".." || shard.size() > 255) std::abort();
    for (const char c : shard) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '/' || c == '\\' || u < 0x20 || u == 0x7f) std::abort();
    }
  }
  return 0;
}
