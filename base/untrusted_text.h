// Reading files from outside (a tokenizer.json, a config.json, a machine profile, a DeepSpeed
// config): JSON parsed with a nesting limit, before any value of it is walked or printed, and
// bounded excerpts of what a file holds, for error messages.
//
// Why: a value nested 100,000 deep overflows the stack of any recursive walk (nlohmann's dump()
// is one); an error that echoes a 10 MB string is a 10 MB line; a NUL in a message cuts it where
// it is printed with %s; other control characters reach the terminal. A message built from
// these functions is one line of bounded length with no control character.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata {

// The deepest nesting of arrays and objects accepted in a JSON file Strata reads. The formats
// it reads nest at most ~6 deep (a tokenizer.json's Sequence of Sequences); 64 leaves room and
// keeps every recursive walk of a parsed value shallow.
inline constexpr int kMaxJsonDepth = 64;

// The longest excerpt of a file's value that an error message quotes, in bytes.
inline constexpr size_t kExcerptBytes = 64;

// Parses `text` as one JSON value. Errors (kInvalidArgument, one line, no file name: the caller
// adds it): "malformed JSON: parse error at line L, column C: ..." (nlohmann's reason, cut to a
// bounded excerpt), or "JSON nested deeper than 64 levels (the limit) at byte N", found by a
// first pass that builds nothing, so a deep value never reaches the document parser.
StatusOr<nlohmann::json> ParseJsonBounded(std::string_view text, int max_depth = kMaxJsonDepth);
// The same, keeping each object's keys in the text's order (what a chat template's tojson and
// dict iteration show, as Python's json module keeps them).
StatusOr<nlohmann::ordered_json> ParseOrderedJsonBounded(std::string_view text,
                                                         int max_depth = kMaxJsonDepth);

// `bytes` for a message: at most `max_bytes` of them (cut at a UTF-8 character boundary, then
// "... (N bytes)"), each control character, DEL and NUL written as \xNN, a backslash as \\.
// Printable ASCII and UTF-8 are kept as they are.
std::string Excerpt(std::string_view bytes, size_t max_bytes = kExcerptBytes);

// A parsed JSON value for a message: its compact text (a string with its quotes, control
// characters escaped as JSON escapes them) cut to about max_bytes with "...", without recursing
// deeper than kMaxJsonDepth ("[...]" / "{...}" below that).
std::string JsonExcerpt(const nlohmann::json& value, size_t max_bytes = kExcerptBytes);

// `parent` + "/" + `key` as a JSON pointer (RFC 6901: "~" written "~0", "/" written "~1"), the
// key cut by Excerpt: the way a message names where in a file a value is ("/model/vocab/a").
std::string JsonPointerChild(std::string_view parent, std::string_view key);
std::string JsonPointerChild(std::string_view parent, size_t index);

}  // namespace strata
