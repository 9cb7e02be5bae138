// Fuzzes the tokenizer_config.json reader of the special-token names
// (data/hf_tokenizer_json.h, ParseTokenizerConfigJson): any bytes give names or a one-line
// error, never a crash or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "data/hf_tokenizer_json.h"
#include "tests/fuzz/one_line_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto names = strata::data::hf::ParseTokenizerConfigJson(
      std::string_view(reinterpret_cast<const char*>(data), size));
  if (!names.ok()) {
    const std::string m = names.status().message();
    if (!strata::fuzz::IsOneCleanLine(m)) std::abort();
  }
  return 0;
}
