// The error raised inside the Jinja engine (lexer, parser, interpreter): a status code, the
// template line it concerns (0 when none) and a one-line message. It never leaves the engine:
// JinjaTemplate::Parse and ::Render catch it and return a Status (chat_template.h).
//
// Why an exception inside: the tree-walking interpreter has hundreds of places where evaluation
// can fail (jinja2 raises from each of them too); unwinding to the one Status boundary keeps the
// hot path free of a StatusOr per node.
#pragma once

#include <string>
#include <utility>

#include "base/status.h"

namespace strata::data::jinja {

struct JinjaError {
  StatusCode code = StatusCode::kInvalidArgument;
  int line = 0;
  std::string message;
};

[[noreturn]] inline void Fail(int line, std::string message) {
  throw JinjaError{StatusCode::kInvalidArgument, line, std::move(message)};
}
[[noreturn]] inline void FailExhausted(int line, std::string message) {
  throw JinjaError{StatusCode::kResourceExhausted, line, std::move(message)};
}

}  // namespace strata::data::jinja
