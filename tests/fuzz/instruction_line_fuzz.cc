// Fuzzes the parser of one JSON line of instruction data (data/instruction_data.h,
// ParseInstructionLine: "messages", or "prompt" and "response") and its rendering: any bytes give
// a conversation with an assistant message or a one-line error, never a crash or a sanitizer
// report; a conversation renders with the built-in chatml template (prefix renders and the loss
// mask) and with none over byte tokens, or fails with a one-line error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "data/chat_format.h"
#include "data/instruction_data.h"
#include "tests/fuzz/one_line_message.h"

namespace {

void CheckOneLine(const strata::Status& s) {
  const std::string m = s.message();
  if (!strata::fuzz::IsOneCleanLine(m)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::data;
  static const auto bytes = MakeByteLevelTokenizer();
  static const auto chatml = ResolveChatFormat("chatml", "/nonexistent/tokenizer.json");
  static const ChatFormat none;
  if (!chatml.ok()) std::abort();
  auto example = ParseInstructionLine(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!example.ok()) {
    CheckOneLine(example.status());
    return 0;
  }
  bool assistant = false;
  for (const auto& m : example->messages) assistant |= m["role"] == "assistant";
  if (!assistant) std::abort();
  for (const ChatFormat* f : {&*chatml, &none}) {
    auto r = RenderExample(*f, *bytes, *example);
    if (!r.ok()) {
      CheckOneLine(r.status());
      continue;
    }
    if (r->tokens.size() != r->flags.size()) std::abort();
  }
  return 0;
}
