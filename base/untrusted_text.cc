#include "base/untrusted_text.h"

#include <fmt/format.h>

#include <vector>

namespace strata {
namespace {

using Json = nlohmann::json;

// A first pass over the text that builds nothing: counts the nesting and stops at the limit,
// and keeps nlohmann's reason for a syntax error.
class DepthCheck : public nlohmann::json_sax<Json> {
 public:
  explicit DepthCheck(int max_depth) : max_depth_(max_depth) {}

  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override { return Value() && Enter(false); }
  bool key(string_t& k) override {
    if (frames_.size() <= kNamedLevels) frames_.back().key = k;
    return true;
  }
  bool end_object() override { return frames_.pop_back(), true; }
  bool start_array(std::size_t) override { return Value() && Enter(true); }
  bool end_array() override { return frames_.pop_back(), true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 3, column 5: ..." without its tag.
    std::string what = e.what();
    if (const size_t tag_end = what.find("] ");
        what.starts_with("[json.") && tag_end != what.npos) {
      what.erase(0, tag_end + 2);
    }
    error_ = "malformed JSON: " + Excerpt(what, 240);
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  // An array or object being read: the key or index of the value read last in it.
  struct Frame {
    bool array;
    size_t index;
    std::string key;
  };
  // Where the limit is crossed is named by the pointer of its first levels.
  static constexpr size_t kNamedLevels = 4;

  bool Value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
    return true;
  }
  bool Enter(bool array) {
    if (static_cast<int>(frames_.size()) < max_depth_) {
      frames_.push_back({array, 0, ""});
      return true;
    }
    std::string at;
    for (size_t i = 0; i < frames_.size() && i < kNamedLevels; ++i) {
      at = frames_[i].array ? JsonPointerChild(at, frames_[i].index - 1)
                            : JsonPointerChild(at, frames_[i].key);
    }
    error_ =
        fmt::format("JSON nested deeper than {} levels (the limit) under {}/...", max_depth_, at);
    return false;
  }

  int max_depth_;
  std::vector<Frame> frames_;
  std::string error_;
};

// The length of the valid UTF-8 character at s[i], or 0 when s[i] does not start one.
size_t Utf8CharLength(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = 0;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// s cut to at most max_bytes at a character boundary, with "..." when cut.
std::string Cut(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
  return fmt::format("{}...", s.substr(0, end));
}

void AppendJson(const Json& v, int depth, size_t budget, std::string* out) {
  if (out->size() > budget) return;
  // JSON escapes the C0 controls; DEL it leaves raw, so it is written \u007f here.
  const auto dump_string = [&](const std::string& s) {
    for (const char c :
         Json(s.substr(0, budget)).dump(-1, ' ', false, Json::error_handler_t::replace)) {
      if (c == '\x7f') {
        *out += "\\u007f";
      } else {
        out->push_back(c);
      }
    }
  };
  if (v.is_object() || v.is_array()) {
    const bool object = v.is_object();
    out->push_back(object ? '{' : '[');
    if (depth >= kMaxJsonDepth && !v.empty()) {
      *out += "...";
    } else {
      bool first = true;
      for (auto it = v.begin(); it != v.end() && out->size() <= budget; ++it) {
        if (!first) out->push_back(',');
        first = false;
        if (object) {
          dump_string(it.key());
          out->push_back(':');
        }
        AppendJson(*it, depth + 1, budget, out);
      }
    }
    out->push_back(object ? '}' : ']');
  } else if (v.is_string()) {
    dump_string(v.get_ref<const std::string&>());
  } else {
    *out += v.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
}

std::string EscapePointerToken(std::string_view key) {
  std::string out;
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

StatusOr<Json> ParseJsonBounded(std::string_view text, int max_depth) {
  DepthCheck check(max_depth);
  if (!Json::sax_parse(text.begin(), text.end(), &check)) {
    return InvalidArgumentError(check.error().empty() ? "malformed JSON" : check.error());
  }
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("malformed JSON");
  return j;
}

StatusOr<nlohmann::ordered_json> ParseOrderedJsonBounded(std::string_view text, int max_depth) {
  DepthCheck check(max_depth);
  if (!Json::sax_parse(text.begin(), text.end(), &check)) {
    return InvalidArgumentError(check.error().empty() ? "malformed JSON" : check.error());
  }
  nlohmann::ordered_json j =
      nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("malformed JSON");
  return j;
}

std::string Excerpt(std::string_view bytes, size_t max_bytes) {
  std::string out;
  size_t i = 0;
  for (; i < bytes.size() && out.size() < max_bytes;) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (b >= 0x20 && b < 0x7F) {
      if (b == '\\') out.push_back('\\');
      out.push_back(static_cast<char>(b));
      ++i;
    } else if (const size_t n = b >= 0x80 ? Utf8CharLength(bytes, i) : 0; n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02X}", b);
      ++i;
    }
  }
  if (i < bytes.size()) out += fmt::format("... ({} bytes)", bytes.size());
  return out;
}

std::string JsonExcerpt(const Json& value, size_t max_bytes) {
  std::string out;
  AppendJson(value, 0, max_bytes, &out);
  return Cut(out, max_bytes);
}

std::string JsonPointerChild(std::string_view parent, std::string_view key) {
  return fmt::format("{}/{}", parent, Excerpt(EscapePointerToken(key), kExcerptBytes));
}

std::string JsonPointerChild(std::string_view parent, size_t index) {
  return fmt::format("{}/{}", parent, index);
}

}  // namespace strata
