// Python str operations over UTF-8 (code points, Python's notion of whitespace and case), for
// the str methods and the filters built on them.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::data::jinja {

// The code point of the UTF-8 sequence at s[*i] (a truncated one from the bytes it has), *i moved
// past it. *i < s.size().
uint32_t DecodeUtf8(std::string_view s, size_t* i);

bool IsPyWhitespace(uint32_t code_point);
// str.strip / lstrip / rstrip: chars == nullptr strips whitespace.
std::string_view PyStrip(std::string_view s, const std::string_view* chars, bool left, bool right);
// str.split / str.rsplit; sep == nullptr splits on runs of whitespace. maxsplit < 0: no limit.
// Returns false for an empty separator (ValueError).
bool PySplit(std::string_view s, const std::string_view* sep, int64_t maxsplit, bool from_right,
             std::vector<std::string_view>* out);
// str.splitlines() (without keepends).
std::vector<std::string_view> PySplitLines(std::string_view s);
std::string PyUpper(std::string_view s);
std::string PyLower(std::string_view s);
std::string PyCapitalize(std::string_view s);  // str.capitalize
std::string PyTitle(std::string_view s);       // str.title
// str.replace(old, new, count); count < 0: all.
std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text,
                      int64_t count);
// str.find / rfind / count in code points (find: -1 when absent).
int64_t PyFind(std::string_view s, std::string_view sub, bool from_right);
int64_t PyCount(std::string_view s, std::string_view sub);

}  // namespace strata::data::jinja
