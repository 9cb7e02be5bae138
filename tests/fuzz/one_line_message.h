// What every refusal a fuzz target meets must look like (issue 47): one line, not empty, at most
// 4096 bytes, with no control character, DEL or NUL in it (a value quoted from the file is
// escaped: base/untrusted_text.h's Excerpt), naming `must_name` (the file) when that is given.
#pragma once

#include <string_view>

namespace strata::fuzz {

inline bool IsOneCleanLine(std::string_view message, std::string_view must_name = {}) {
  if (message.empty() || message.size() > 4096) return false;
  for (const char c : message) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return false;
  }
  return must_name.empty() || message.find(must_name) != std::string_view::npos;
}

}  // namespace strata::fuzz
