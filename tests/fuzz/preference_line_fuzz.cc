// Fuzzes the parser of one JSON line of preference data (data/preference_data.h,
// ParsePreferenceLine: TRL's standard, conversational and implicit-prompt forms) and its
// rendering: any bytes give a pair whose sides share their prompt and each hold a completion with
// an assistant message, or a one-line error, never a crash or a sanitizer report; a pair renders
// with the built-in chatml template (the loss cut at the prompt) and with none over byte tokens,
// flagged as a pair, or fails with a one-line error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "data/chat_format.h"
#include "data/preference_data.h"
#include "data/token_dataset.h"
#include "tests/fuzz/one_line_message.h"

namespace {

void CheckOneLine(const strata::Status& s) {
  const std::string m = s.message();
  if (!strata::fuzz::IsOneCleanLine(m)) std::abort();
}

// A side's messages past the prompt hold an assistant message; the prompts are the same.
void CheckPair(const strata::data::PreferencePair& p) {
  for (const auto* side : {&p.chosen, &p.rejected}) {
    if (side->messages.size() <= p.prompt_messages) std::abort();
    bool assistant = false;
    for (size_t i = p.prompt_messages; i < side->messages.size(); ++i) {
      assistant |= side->messages[i]["role"] == "assistant";
    }
    if (!assistant) std::abort();
  }
  for (size_t i = 0; i < p.prompt_messages; ++i) {
    if (p.chosen.messages[i] != p.rejected.messages[i]) std::abort();
  }
}

void CheckFlags(const strata::data::RenderedExample& e, uint8_t first) {
  using namespace strata::data;
  if (e.tokens.size() != e.flags.size() || e.flags.empty()) std::abort();
  if ((e.flags[0] & ~kTokenFlagInLoss) != first) std::abort();
  for (size_t i = 1; i < e.flags.size(); ++i) {
    if ((e.flags[i] & ~kTokenFlagInLoss) != 0) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::data;
  static const auto bytes = MakeByteLevelTokenizer();
  static const auto chatml = ResolveChatFormat("chatml", "/nonexistent/tokenizer.json");
  static const ChatFormat none;
  if (!chatml.ok()) std::abort();
  auto pair = ParsePreferenceLine(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!pair.ok()) {
    CheckOneLine(pair.status());
    return 0;
  }
  CheckPair(*pair);
  for (const ChatFormat* f : {&*chatml, &none}) {
    auto r = RenderPreferencePair(*f, *bytes, *pair);
    if (!r.ok()) {
      CheckOneLine(r.status());
      continue;
    }
    CheckFlags(r->chosen, kTokenFlagExampleStart | kTokenFlagPairStart);
    CheckFlags(r->rejected, kTokenFlagExampleStart);
  }
  return 0;
}
