// The Jinja lexer with the settings transformers' apply_chat_template uses (trim_blocks,
// lstrip_blocks, default delimiters): template text becomes a flat token list in which the
// whitespace control (`{%-`, `-%}`, `{%+`, `+%}`, `{{-`, `-}}`, `{#-`, `-#}`), the two trims,
// newline normalisation (\r\n and \r read as \n) and the dropping of one trailing newline
// (keep_trailing_newline=False) are already applied to the text tokens, as jinja2's lexer does.
// `{% raw %}...{% endraw %}` comes out as one text token; comments are dropped.
//
// Thread-safety: pure function. Errors: throws JinjaError (jinja_error.h) with the line.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::data::jinja {

enum class TokenType : uint8_t {
  kText,        // template text outside tags (value: the text)
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,        // identifier
  kString,      // string literal (value: the unescaped string)
  kInteger,     // value: the digits, underscores removed
  kFloat,       // value: the literal, underscores removed
  kOperator,    // value: the operator text ("+", "//", "==", "(", ...)
  kEnd,         // end of template
};

struct Token {
  TokenType type;
  int line;
  std::string value;
};

std::vector<Token> Tokenize(std::string_view source);

}  // namespace strata::data::jinja
