// Fuzzes the safetensors header parser (formats/safetensors.h) that every checkpoint load goes
// through: the input is a whole file. Any bytes give a header or an error; an accepted header
// never points outside the file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "base/dtype.h"
#include "formats/safetensors.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  strata::StatusOr<strata::formats::SafetensorsHeader> header =
      strata::formats::ParseSafetensorsHeader(file, size);
  if (!header.ok()) {
    if (!strata::fuzz::IsOneCleanLine(header.status().message())) std::abort();
    return 0;
  }
  if (header->data_offset_bytes != 8 + header->header_bytes || header->data_offset_bytes > size) {
    std::abort();
  }
  const uint64_t data_bytes = size - header->data_offset_bytes;
  for (const auto& t : header->tensors) {
    if (t.begin_bytes > t.end_bytes || t.end_bytes > data_bytes) std::abort();
    if (t.size_bytes() != static_cast<uint64_t>(t.num_elems) * t.dtype.size()) {
      std::abort();
    }
    if (header->Find(t.name) != &t) std::abort();
  }
  return 0;
}
