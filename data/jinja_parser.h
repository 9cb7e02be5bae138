// Parses Jinja template text (the subset Hugging Face chat templates use, listed in
// chat_template.h) into a syntax tree (jinja_ast.h), with jinja2's grammar and operator
// precedence. Tags outside the subset (include, extends, block, import, call, with, ...) are
// refused by name.
//
// Thread-safety: pure function. Errors: throws JinjaError (jinja_error.h) with the line; a tree
// nested deeper than kMaxParseDepth is refused the same way.
#pragma once

#include <string_view>

#include "data/jinja_ast.h"

namespace strata::data::jinja {

inline constexpr int kMaxParseDepth = 128;

StmtList ParseTemplate(std::string_view source, bool* has_generation);

}  // namespace strata::data::jinja
