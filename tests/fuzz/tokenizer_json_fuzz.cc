// Fuzzes the tokenizer.json parser (data/hf_tokenizer_json.h) and, for what it accepts, the
// tokenizer built from it (data/hf_tokenizer.h: the id table sized from the file, the special
// ids): any bytes give a tokenizer or a one-line error, never a crash, a hang, an allocation
// beyond the file's entries or a sanitizer report.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "data/hf_tokenizer.h"
#include "data/hf_tokenizer_json.h"
#include "tests/fuzz/one_line_message.h"
#include "tests/fuzz/scratch_file.h"

namespace {

const std::string& ScratchFile() {
  return strata::fuzz::ScratchFile("tokenizer_json_fuzz", "tokenizer.json");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = strata::data::hf::ParseTokenizerJson(text);
  if (!parsed.ok()) {
    const std::string m = parsed.status().message();
    if (!strata::fuzz::IsOneCleanLine(m)) std::abort();
    return 0;
  }
  // Accepted: the id table is bounded by the entries, and the tokenizer loads from the file.
  const auto& c = *parsed;
  if (c.vocab_size < 0 ||
      c.vocab_size > static_cast<int64_t>(c.model->vocab().size() + c.added_tokens.size()) +
                         strata::data::hf::kMaxUnusedIds) {
    std::abort();
  }
  std::ofstream(ScratchFile(), std::ios::binary | std::ios::trunc).write(text.data(), text.size());
  auto t = strata::data::HfTokenizer::Load(ScratchFile());
  if (t.ok()) {
    const int v = (*t)->vocab_size();
    if ((*t)->bos_id() >= v || (*t)->eos_id() >= v) std::abort();
  } else if (!strata::fuzz::IsOneCleanLine(t.status().message())) {
    std::abort();
  }
  return 0;
}
