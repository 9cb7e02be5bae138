// Fuzzes the chat-template engine (data/chat_template.h): any bytes are parsed as a template and,
// when they parse, rendered over a fixed small conversation with tight limits. Either gives text
// or a one-line error; never a crash, a hang, unbounded recursion or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "data/chat_template.h"
#include "tests/fuzz/one_line_message.h"

namespace {

void CheckMessage(const strata::Status& s) {
  const std::string& m = s.message();
  if (!strata::fuzz::IsOneCleanLine(m)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json* context =
      new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true,
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Hi \u00e9\n"},
                 {"role": "assistant", "content": "<think>x</think>ok",
                  "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})"));
  auto t = strata::data::JinjaTemplate::Parse(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!t.ok()) {
    CheckMessage(t.status());
    return 0;
  }
  strata::data::ChatRenderOptions options;
  options.max_output_bytes = 1 << 20;
  options.max_loop_iterations = 100000;
  options.max_call_depth = 50;
  options.now = 1721995200;
  auto r = (*t)->Render(*context, options);
  if (!r.ok()) CheckMessage(r.status());
  return 0;
}
