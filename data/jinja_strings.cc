#include "data/jinja_strings.h"

#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include "data/jinja_value.h"

namespace strata::data::jinja {

uint32_t DecodeUtf8(std::string_view s, size_t* i) {
  const auto c = static_cast<unsigned char>(s[*i]);
  int n = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
  uint32_t cp = n == 0 ? c : n == 1 ? (c & 0x1F) : n == 2 ? (c & 0x0F) : (c & 0x07);
  size_t k = *i + 1;
  for (; n > 0 && k < s.size() && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80; --n, ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[k]) & 0x3F);
  }
  *i = k;
  return cp;
}

namespace {

// The code point that ends at `end` (its start in *start).
uint32_t DecodeBefore(std::string_view s, size_t end, size_t* start) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80 && end - b < 4) --b;
  size_t i = b;
  const uint32_t cp = DecodeUtf8(s, &i);
  *start = b;
  return cp;
}

bool InChars(uint32_t cp, std::string_view chars) {
  for (size_t i = 0; i < chars.size();) {
    if (DecodeUtf8(chars, &i) == cp) return true;
  }
  return false;
}

std::string Convert(std::string_view s, int mode) {
  icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (mode == 0) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  std::string out;
  u.toUTF8String(out);
  return out;
}

bool IsCased(uint32_t cp) { return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_CASED); }

}  // namespace

bool IsPyWhitespace(uint32_t cp) {
  switch (cp) {
    case ' ':
    case '\t':
    case '\n':
    case '\v':
    case '\f':
    case '\r':
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

std::string_view PyStrip(std::string_view s, const std::string_view* chars, bool left, bool right) {
  auto strip_it = [&](uint32_t cp) { return chars ? InChars(cp, *chars) : IsPyWhitespace(cp); };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      size_t next = b;
      if (!strip_it(DecodeUtf8(s, &next))) break;
      b = next;
    }
  }
  if (right) {
    while (e > b) {
      size_t start;
      if (!strip_it(DecodeBefore(s, e, &start))) break;
      e = start;
    }
  }
  return s.substr(b, e - b);
}

bool PySplit(std::string_view s, const std::string_view* sep, int64_t maxsplit, bool from_right,
             std::vector<std::string_view>* out) {
  out->clear();
  if (sep && sep->empty()) return false;
  if (sep) {
    std::vector<std::string_view> parts;
    if (!from_right) {
      size_t start = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t at = s.find(*sep, start);
        if (at == std::string_view::npos) break;
        parts.push_back(s.substr(start, at - start));
        start = at + sep->size();
      }
      parts.push_back(s.substr(start));
      *out = std::move(parts);
    } else {
      size_t end = s.size();
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        if (end < sep->size()) break;
        const size_t at = s.rfind(*sep, end - sep->size());
        if (at == std::string_view::npos) break;
        parts.push_back(s.substr(at + sep->size(), end - at - sep->size()));
        end = at;
      }
      parts.push_back(s.substr(0, end));
      out->assign(parts.rbegin(), parts.rend());
    }
    return true;
  }
  // Whitespace runs; empty strings are dropped; with maxsplit the rest keeps its inner spacing.
  if (!from_right) {
    size_t i = 0;
    int64_t splits = 0;
    while (true) {
      while (i < s.size()) {
        size_t next = i;
        if (!IsPyWhitespace(DecodeUtf8(s, &next))) break;
        i = next;
      }
      if (i >= s.size()) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        out->push_back(s.substr(i));
        break;
      }
      size_t j = i;
      while (j < s.size()) {
        size_t next = j;
        if (IsPyWhitespace(DecodeUtf8(s, &next))) break;
        j = next;
      }
      out->push_back(s.substr(i, j - i));
      ++splits;
      i = j;
    }
  } else {
    std::vector<std::string_view> parts;
    size_t e = s.size();
    int64_t splits = 0;
    while (true) {
      while (e > 0) {
        size_t start;
        if (!IsPyWhitespace(DecodeBefore(s, e, &start))) break;
        e = start;
      }
      if (e == 0) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        parts.push_back(s.substr(0, e));
        break;
      }
      size_t b = e;
      while (b > 0) {
        size_t start;
        if (IsPyWhitespace(DecodeBefore(s, b, &start))) break;
        b = start;
      }
      parts.push_back(s.substr(b, e - b));
      ++splits;
      e = b;
    }
    out->assign(parts.rbegin(), parts.rend());
  }
  return true;
}

std::vector<std::string_view> PySplitLines(std::string_view s) {
  std::vector<std::string_view> lines;
  size_t start = 0, i = 0;
  while (i < s.size()) {
    const size_t at = i;
    const uint32_t cp = DecodeUtf8(s, &i);
    const bool br = cp == '\n' || cp == '\r' || cp == '\v' || cp == '\f' || cp == 0x1C ||
                    cp == 0x1D || cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!br) continue;
    lines.push_back(s.substr(start, at - start));
    if (cp == '\r' && i < s.size() && s[i] == '\n') ++i;
    start = i;
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

std::string PyUpper(std::string_view s) { return Convert(s, 0); }
std::string PyLower(std::string_view s) { return Convert(s, 1); }

namespace {

// One character (its UTF-8 bytes) in its title case, as Python's capitalize and title write a
// word's first: 'ß' -> "Ss", 'ǆ' -> 'ǅ' (upper would give "SS" and 'Ǆ').
void AppendTitleCase(std::string_view ch, std::string* out) {
  icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(ch.data(), static_cast<int32_t>(ch.size())));
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_LOWERCASE);
  u.toUTF8String(*out);
}

}  // namespace

std::string PyCapitalize(std::string_view s) {
  if (s.empty()) return {};
  size_t i = 0;
  DecodeUtf8(s, &i);
  std::string out;
  AppendTitleCase(s.substr(0, i), &out);
  out += PyLower(s.substr(i));
  return out;
}

std::string PyTitle(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const uint32_t cp = DecodeUtf8(s, &i);
    const std::string_view ch = s.substr(start, i - start);
    const bool cased = IsCased(cp);
    if (cased && prev_cased) {
      out += PyLower(ch);
    } else if (cased) {
      AppendTitleCase(ch, &out);
    } else {
      out.append(ch);
    }
    prev_cased = cased;
  }
  return out;
}

std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text,
                      int64_t count) {
  std::string out;
  if (old_text.empty()) {
    const std::vector<size_t> offsets = CodePointOffsets(s);
    int64_t done = 0;
    for (size_t k = 0; k + 1 < offsets.size(); ++k) {
      if (count < 0 || done < count) {
        out.append(new_text);
        ++done;
      }
      out.append(s.substr(offsets[k], offsets[k + 1] - offsets[k]));
    }
    if (count < 0 || done < count) out.append(new_text);
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(old_text, start);
    if (at == std::string_view::npos) break;
    out.append(s.substr(start, at - start));
    out.append(new_text);
    start = at + old_text.size();
    ++done;
  }
  out.append(s.substr(start));
  return out;
}

int64_t PyFind(std::string_view s, std::string_view sub, bool from_right) {
  const size_t at = from_right ? s.rfind(sub) : s.find(sub);
  if (at == std::string_view::npos) return -1;
  return static_cast<int64_t>(CodePointCount(s.substr(0, at)));
}

int64_t PyCount(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(CodePointCount(s)) + 1;
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string_view::npos; at = s.find(sub, at + sub.size()))
    ++n;
  return n;
}

}  // namespace strata::data::jinja
