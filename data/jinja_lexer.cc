#include "data/jinja_lexer.h"

#include <cstring>
#include <string>

#include "base/untrusted_text.h"
#include "data/jinja_error.h"
#include "data/jinja_value.h"

namespace strata::data::jinja {
namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

int CountNewlines(std::string_view s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// Python's unicode-escape decoding of a string literal's body (what jinja2 applies).
std::string Unescape(std::string_view body, int line) {
  std::string out;
  out.reserve(body.size());
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    char e = body[++i];
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
      case 'u':
      case 'U': {
        const size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (size_t k = 0; k < digits; ++k) {
          const int h = i + 1 + k < body.size() ? HexValue(body[i + 1 + k]) : -1;
          if (h < 0) Fail(line, "truncated \\" + std::string(1, e) + " escape in a string literal");
          cp = cp * 16 + static_cast<uint32_t>(h);
        }
        i += digits;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
          Fail(line, "string literal escape names no Unicode character");
        }
        AppendUtf8(out, cp);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k) {
            cp = cp * 8 + static_cast<uint32_t>(body[++i] - '0');
          }
          AppendUtf8(out, cp);
        } else {
          out += '\\';  // unknown escapes are kept as written
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const size_t open = FindOpener(pos_);
      std::string_view text(src_.data() + pos_,
                            (open == std::string::npos ? src_.size() : open) - pos_);
      if (open == std::string::npos) {
        Emit(TokenType::kText, std::string(text));
        line_ += CountNewlines(text);
        pos_ = src_.size();
        break;
      }
      const char kind = src_[open + 1];
      size_t after = open + 2;
      const char sign =
          after < src_.size() && (src_[after] == '-' || src_[after] == '+') ? src_[after] : 0;
      // A raw block begins with `{%` [sign] ws* raw ws* [-]%}.
      size_t raw_end_of_open = 0;
      if (kind == '%') raw_end_of_open = MatchRawOpen(after + (sign ? 1 : 0));
      std::string_view kept = text;
      if (sign == '-') {
        size_t n = kept.size();
        while (n > 0 && IsSpace(kept[n - 1])) --n;
        kept = kept.substr(0, n);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = kept.rfind('\n');
        const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          bool all_space = l_pos < kept.size();
          for (size_t k = l_pos; k < kept.size(); ++k) all_space &= IsSpace(kept[k]);
          if (all_space) kept = kept.substr(0, l_pos);
        }
      }
      if (!kept.empty()) Emit(TokenType::kText, std::string(kept));
      line_ += CountNewlines(text);
      pos_ = after + (sign ? 1 : 0);
      if (raw_end_of_open) {
        pos_ = raw_end_of_open;
        line_starting = LexRaw();
      } else if (kind == '#') {
        line_starting = LexComment();
      } else {
        line_starting = LexTag(kind == '%');
      }
    }
    Emit(TokenType::kEnd, "");
    return std::move(tokens_);
  }

 private:
  size_t FindOpener(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  void Emit(TokenType type, std::string value) {
    tokens_.push_back({type, line_, std::move(value)});
  }

  // If `at` begins `ws* raw ws* [-]%}`, the position after it; else 0.
  size_t MatchRawOpen(size_t at) const {
    size_t i = at;
    while (i < src_.size() && IsSpace(src_[i])) ++i;
    if (src_.compare(i, 3, "raw") != 0) return 0;
    i += 3;
    if (i < src_.size() && IsNameChar(src_[i])) return 0;
    while (i < src_.size() && IsSpace(src_[i])) ++i;
    if (src_.compare(i, 3, "-%}") == 0) {
      i += 3;
      while (i < src_.size() && IsSpace(src_[i])) ++i;
      return i;
    }
    if (src_.compare(i, 2, "%}") == 0) return i + 2;
    return 0;
  }

  // Consumes the block end at pos_ (`%}`, `-%}`, `+%}` with their trims); returns line_starting.
  bool ConsumeBlockEnd(size_t end_at, char sign) {
    pos_ = end_at + 2;
    if (sign == '-') {
      const size_t start = pos_;
      while (pos_ < src_.size() && IsSpace(src_[pos_])) ++pos_;
      line_ += CountNewlines(std::string_view(src_).substr(start, pos_ - start));
      return pos_ > start ? src_[pos_ - 1] == '\n' : false;
    }
    if (sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
      return true;
    }
    return false;
  }

  bool LexRaw() {
    // Body up to `{%` [sign] ws* endraw ws* [sign]%}.
    for (size_t i = src_.find("{%", pos_); i != std::string::npos; i = src_.find("{%", i + 1)) {
      size_t k = i + 2;
      const char open_sign = k < src_.size() && (src_[k] == '-' || src_[k] == '+') ? src_[k] : 0;
      if (open_sign) ++k;
      while (k < src_.size() && IsSpace(src_[k])) ++k;
      if (src_.compare(k, 6, "endraw") != 0) continue;
      k += 6;
      while (k < src_.size() && IsSpace(src_[k])) ++k;
      char close_sign = 0;
      if (k < src_.size() && (src_[k] == '-' || src_[k] == '+')) close_sign = src_[k++];
      if (src_.compare(k, 2, "%}") != 0) continue;
      std::string_view body(src_.data() + pos_, i - pos_);
      std::string_view kept = body;
      if (open_sign == '-') {
        size_t n = kept.size();
        while (n > 0 && IsSpace(kept[n - 1])) --n;
        kept = kept.substr(0, n);
      } else if (open_sign != '+') {
        const size_t nl = kept.rfind('\n');
        if (nl != std::string_view::npos) {
          bool all_space = nl + 1 < kept.size();
          for (size_t q = nl + 1; q < kept.size(); ++q) all_space &= IsSpace(kept[q]);
          if (all_space) kept = kept.substr(0, nl + 1);
        }
      }
      if (!kept.empty()) Emit(TokenType::kText, std::string(kept));
      line_ += CountNewlines(std::string_view(src_).substr(pos_, k - pos_));
      return ConsumeBlockEnd(k, close_sign);
    }
    Fail(line_, "missing end of raw directive");
  }

  bool LexComment() {
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) Fail(line_, "missing end of comment tag");
    line_ += CountNewlines(std::string_view(src_).substr(pos_, end - pos_));
    const char sign =
        end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    return ConsumeBlockEnd(end, sign);
  }

  // Tokens of a `{{ }}` or `{% %}` tag up to and including its end.
  bool LexTag(bool block) {
    const int begin_line = line_;
    Emit(block ? TokenType::kBlockBegin : TokenType::kVarBegin, "");
    std::vector<char> brackets;
    while (true) {
      if (pos_ >= src_.size()) {
        line_ = begin_line;
        Fail(begin_line, block ? "unexpected end of template, expected '%}'"
                               : "unexpected end of template, expected '}}'");
      }
      const char c = src_[pos_];
      // The end rule comes first, as in jinja2.
      if (block && brackets.empty()) {
        if ((c == '-' || c == '+') && src_.compare(pos_ + 1, 2, "%}") == 0) {
          Emit(TokenType::kBlockEnd, "");
          return ConsumeBlockEnd(pos_ + 1, c);
        }
        if (src_.compare(pos_, 2, "%}") == 0) {
          Emit(TokenType::kBlockEnd, "");
          return ConsumeBlockEnd(pos_, 0);
        }
      }
      if (!block && brackets.empty()) {
        if (c == '-' && src_.compare(pos_ + 1, 2, "}}") == 0) {
          Emit(TokenType::kVarEnd, "");
          pos_ += 3;
          const size_t start = pos_;
          while (pos_ < src_.size() && IsSpace(src_[pos_])) ++pos_;
          line_ += CountNewlines(std::string_view(src_).substr(start, pos_ - start));
          return pos_ > start && src_[pos_ - 1] == '\n';
        }
        if (src_.compare(pos_, 2, "}}") == 0) {
          Emit(TokenType::kVarEnd, "");
          pos_ += 2;
          return false;
        }
      }
      if (IsSpace(c)) {
        line_ += c == '\n';
        ++pos_;
        continue;
      }
      if (IsDigit(c)) {
        LexNumber();
        continue;
      }
      if (IsNameStart(c)) {
        size_t e = pos_;
        while (e < src_.size() && IsNameChar(src_[e])) ++e;
        Emit(TokenType::kName, src_.substr(pos_, e - pos_));
        pos_ = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        LexString(c);
        continue;
      }
      static constexpr const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                             "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                             ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
      const char* op = nullptr;
      for (const char* o : kOps) {
        if (src_.compare(pos_, std::strlen(o), o) == 0) {
          op = o;
          break;
        }
      }
      if (op == nullptr) {
        Fail(line_, "unexpected character '" + Excerpt(std::string_view(&src_[pos_], 1)) + "'");
      }
      const std::string o(op);
      if (o == "(" || o == "[" || o == "{") brackets.push_back(o[0]);
      if (o == ")" || o == "]" || o == "}") {
        const char want = o == ")" ? '(' : o == "]" ? '[' : '{';
        if (brackets.empty() || brackets.back() != want) Fail(line_, "unexpected '" + o + "'");
        brackets.pop_back();
      }
      Emit(TokenType::kOperator, o);
      pos_ += o.size();
    }
  }

  void LexNumber() {
    std::string digits;
    auto take_digits = [&] {
      while (pos_ < src_.size() &&
             (IsDigit(src_[pos_]) || (src_[pos_] == '_' && pos_ + 1 < src_.size() &&
                                      IsDigit(src_[pos_ + 1]) && !digits.empty()))) {
        if (src_[pos_] != '_') digits += src_[pos_];
        ++pos_;
      }
    };
    take_digits();
    bool is_float = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && IsDigit(src_[pos_ + 1])) {
      is_float = true;
      digits += '.';
      ++pos_;
      const size_t before = digits.size();
      take_digits();
      (void)before;
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t k = pos_ + 1;
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < src_.size() && IsDigit(src_[k])) {
        is_float = true;
        digits += 'e';
        digits.append(src_, pos_ + 1, k - pos_ - 1);
        pos_ = k;
        take_digits();
      }
    }
    Emit(is_float ? TokenType::kFloat : TokenType::kInteger, std::move(digits));
  }

  void LexString(char quote) {
    size_t i = pos_ + 1;
    while (i < src_.size() && src_[i] != quote) {
      if (src_[i] == '\\') ++i;
      ++i;
    }
    if (i >= src_.size()) Fail(line_, "unterminated string literal");
    std::string_view body(src_.data() + pos_ + 1, i - pos_ - 1);
    Emit(TokenType::kString, Unescape(body, line_));
    line_ += CountNewlines(body);
    pos_ = i + 1;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

// \r\n and \r become \n; one trailing newline is dropped (keep_trailing_newline=False).
std::string NormalizeNewlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

std::vector<Token> Tokenize(std::string_view source) {
  return Lexer(NormalizeNewlines(source)).Run();
}

}  // namespace strata::data::jinja
