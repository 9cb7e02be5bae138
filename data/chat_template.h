// A Hugging Face chat template (the `chat_template` of a tokenizer_config.json), rendered as
// transformers' apply_chat_template renders it with Python's jinja2: an
// ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension
// ({% break %}, {% continue %}), the {% generation %} tag, the globals raise_exception(msg) and
// strftime_now(fmt), and the tojson filter as json.dumps(ensure_ascii=False) with keys in order.
//
// Supported: text, {{ }}, comments, whitespace control, {% raw %}, if/elif/else, for (tuple
// targets, `if` filter, else, loop.*), break/continue, set (names, tuples, ns.attr, block set
// with filters), macro (positional/keyword arguments, defaults), filter blocks, generation;
// expressions with jinja2's precedence, literals, slicing, filters, tests and the non-mutating
// Python str/dict/list methods (jinja_builtins.h). Refused with an error naming them: include,
// extends, block, import, call, with, recursive loops, *args in calls, '%' string formatting,
// str.format, filters and tests outside the list, mutating methods (as the sandbox refuses them).
// Known differences from CPython: integers are 64-bit (overflow is an error, not a big int);
// map/select/... give lists where jinja2 gives generators (the same once iterated or joined).
//
// Thread-safety: a JinjaTemplate is immutable after Parse; Render is const and may run on many
// threads at once.
#pragma once

#include <cstddef>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace strata::data {

namespace jinja {
struct Stmt;
}  // namespace jinja

// What Render returns: the text and, in order, the byte spans [begin, end) of `text` written
// inside {% generation %} blocks (transformers' assistant masks, there in characters).
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

struct ChatRenderOptions {
  // Output bytes (also the largest string a template may compute): kResourceExhausted past it.
  size_t max_output_bytes = size_t{64} << 20;
  // Macro calls nested deeper: kResourceExhausted (a macro calling itself without end).
  int max_call_depth = 100;
  // Loop iterations over the whole render: kResourceExhausted past it (never hang).
  int64_t max_loop_iterations = 10'000'000;
  // strftime_now's clock, seconds since the epoch shown in local time; 0: the current time.
  std::time_t now = 0;
};

class JinjaTemplate {
 public:
  // `where` names the template's origin in errors ("'dir/tokenizer_config.json' chat_template").
  // kInvalidArgument "<where> line N: <what>" naming the construct it cannot parse ("unknown tag
  // 'include'", "unexpected end of template, expected 'endfor'").
  static StatusOr<std::unique_ptr<JinjaTemplate>> Parse(std::string_view source, std::string where);
  ~JinjaTemplate();
  JinjaTemplate(const JinjaTemplate&) = delete;
  JinjaTemplate& operator=(const JinjaTemplate&) = delete;

  // `context`: a JSON object whose keys are the template's variables (messages, bos_token,
  // eos_token, add_generation_prompt, tools, extra kwargs such as enable_thinking). An ordered
  // JSON keeps the caller's key order, which tojson and dict iteration show. The context must
  // outlive the call only.
  // Errors: kInvalidArgument "<where> line N: <message>" for raise_exception (its message), a
  // type error, an undefined value used where jinja2 raises, an unsupported filter, test or
  // method; kResourceExhausted when a limit of `options` is passed.
  StatusOr<RenderedChat> Render(const nlohmann::ordered_json& context,
                                const ChatRenderOptions& options = {}) const;

  bool has_generation_blocks() const { return has_generation_; }
  const std::string& where() const { return where_; }

 private:
  JinjaTemplate() = default;

  std::string where_;
  std::vector<std::unique_ptr<jinja::Stmt>> body_;
  bool has_generation_ = false;
};

}  // namespace strata::data
