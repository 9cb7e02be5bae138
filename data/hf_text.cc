#include "data/hf_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/edits.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <cstring>

namespace strata::data::hf {

size_t FindInvalidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    char32_t cp = 0, min = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

char32_t DecodeUtf8(std::string_view text, size_t i, size_t* len) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data()) + i;
  if (s[0] < 0x80) return *len = 1, s[0];
  if ((s[0] & 0xE0) == 0xC0) return *len = 2, ((s[0] & 0x1F) << 6) | (s[1] & 0x3F);
  if ((s[0] & 0xF0) == 0xE0) {
    return *len = 3, ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F);
  }
  return *len = 4,
         ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

size_t PrevCharStart(std::string_view text, size_t i) {
  do {
    --i;
  } while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80);
  return i;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

bool IsWhitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return u_isUWhiteSpace(static_cast<UChar32>(c));
}

bool IsWordChar(char32_t c) {
  const auto u = static_cast<UChar32>(c);
  if (c < 0x80)
    return c == '_' || (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
  return u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || u_charType(u) == U_DECIMAL_DIGIT_NUMBER ||
         (U_GET_GC_MASK(u) & (U_GC_M_MASK | U_GC_PC_MASK)) != 0 ||
         u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL);
}

bool IsLetter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  return u_isalpha(static_cast<UChar32>(c));
}

namespace {

// bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for 256 + n in
// byte order.
std::array<char32_t, 256> ByteCodePoints() {
  std::array<char32_t, 256> cps{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    cps[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return cps;
}

}  // namespace

const std::array<std::string, 256>& ByteToChar() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    const auto cps = ByteCodePoints();
    for (int b = 0; b < 256; ++b) AppendUtf8(cps[b], &t[b]);
    return t;
  }();
  return table;
}

int CharToByte(char32_t c) {
  static const std::array<int16_t, 512> table = [] {
    std::array<int16_t, 512> t;
    t.fill(-1);
    const auto cps = ByteCodePoints();
    for (int b = 0; b < 256; ++b) t[cps[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return c < 512 ? table[c] : -1;
}

StatusOr<std::unique_ptr<Regex>> Regex::Create(std::string_view pattern) {
  std::unique_ptr<Regex> re(new Regex(std::string(pattern)));
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return InvalidArgumentError(fmt::format("regex /{}/ does not compile (PCRE2): {} at offset {}",
                                            pattern, reinterpret_cast<const char*>(message),
                                            offset));
  }
  re->code_ = code;
  re->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return re;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Regex::Matches::Matches(const Regex& re, std::string_view text)
    : re_(re),
      text_(text),
      match_data_(
          pcre2_match_data_create_from_pattern(static_cast<pcre2_code*>(re.code_), nullptr)) {}

Regex::Matches::~Matches() { pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_)); }

bool Regex::Matches::Next(Span* match) {
  if (start_ > text_.size() || match_data_ == nullptr) return false;
  auto* code = static_cast<pcre2_code*>(re_.code_);
  auto* md = static_cast<pcre2_match_data*>(match_data_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text_.data());
  const int rc =
      re_.jit_ ? pcre2_jit_match(code, subject, text_.size(), start_, 0, md, nullptr)
               : pcre2_match(code, subject, text_.size(), start_, PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc < 0) {  // PCRE2_ERROR_NOMATCH, or a resource limit: the rest is a gap
    start_ = text_.size() + 1;
    return false;
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  *match = {ov[0], ov[1]};
  if (ov[1] > ov[0]) {
    start_ = ov[1];
  } else if (ov[1] < text_.size()) {
    size_t len = 1;
    DecodeUtf8(text_, ov[1], &len);
    start_ = ov[1] + len;
  } else {
    start_ = text_.size() + 1;
  }
  return true;
}

void Regex::FindAll(std::string_view text, std::vector<Span>* matches) const {
  Matches it(*this, text);
  for (Span m; it.Next(&m);) matches->push_back(m);
}

void FindLiteral(std::string_view text, std::string_view needle, std::vector<Span>* matches) {
  size_t pos = 0;
  while ((pos = text.find(needle, pos)) != std::string_view::npos) {
    matches->push_back({pos, pos + needle.size()});
    pos += needle.size();
  }
}

void SplitByMatches(size_t size, const std::vector<Span>& matches, SplitBehavior behavior,
                    bool invert, std::vector<Span>* pieces) {
  if (behavior == SplitBehavior::kIsolated) {  // every part is a piece: no intermediate lists
    size_t prev = 0;
    for (const Span& m : matches) {
      if (m.begin > prev) pieces->push_back({prev, m.begin});
      if (m.end > m.begin) pieces->push_back(m);
      prev = m.end;
    }
    if (prev < size) pieces->push_back({prev, size});
    return;
  }
  // Every byte in one part: (span, is_delimiter), as HF's Pattern::find_matches.
  std::vector<std::pair<Span, bool>> parts;
  size_t prev = 0;
  for (const Span& m : matches) {
    if (m.begin > prev) parts.push_back({{prev, m.begin}, invert});
    parts.push_back({m, !invert});
    prev = m.end;
  }
  if (prev < size || parts.empty()) parts.push_back({{prev, size}, invert});
  std::vector<std::pair<Span, bool>> out;  // (span, remove)
  out.reserve(parts.size());
  bool previous = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      out.assign(parts.begin(), parts.end());
      break;
    case SplitBehavior::kIsolated:
      for (const auto& [s, d] : parts) out.push_back({s, false});
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& [s, d] : parts) {
        if (d && !previous && !out.empty()) {
          out.back().first.end = s.end;
        } else {
          out.push_back({s, false});
        }
        previous = d;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->second && !previous && !out.empty()) {
          out.back().first.begin = it->first.begin;
        } else {
          out.push_back({it->first, false});
        }
        previous = it->second;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::kContiguous:
      for (const auto& [s, d] : parts) {
        if (d == previous && !out.empty()) {
          out.back().first.end = s.end;
        } else {
          out.push_back({s, false});
        }
        previous = d;
      }
      break;
  }
  for (const auto& [s, remove] : out) {
    if (!remove && s.end > s.begin) pieces->push_back(s);
  }
}

namespace {

const icu::Normalizer2* NfcInstance() {
  static const icu::Normalizer2* nfc = [] {
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(err);
    return U_SUCCESS(err) ? n : nullptr;
  }();
  return nfc;
}

}  // namespace

bool IsNfc(std::string_view text) {
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      const icu::Normalizer2* nfc = NfcInstance();
      if (nfc == nullptr) return false;
      UErrorCode err = U_ZERO_ERROR;
      const bool yes = nfc->isNormalizedUTF8(icu::StringPiece(text.data(), text.size()), err);
      return U_SUCCESS(err) && yes;
    }
  }
  return true;
}

StatusOr<std::string> Nfc(std::string_view text) {
  const icu::Normalizer2* nfc = NfcInstance();
  if (nfc == nullptr) return InternalError("ICU's NFC normalizer is not available");
  std::string out;
  out.reserve(text.size());
  icu::StringByteSink<std::string> sink(&out);
  UErrorCode err = U_ZERO_ERROR;
  nfc->normalizeUTF8(0, icu::StringPiece(text.data(), text.size()), sink, nullptr, err);
  if (U_FAILURE(err)) {
    return InvalidArgumentError(fmt::format("NFC normalization failed: {}", u_errorName(err)));
  }
  return out;
}

StatusOr<std::string> Nfc(std::string_view text, std::vector<NfcChange>* changes) {
  const icu::Normalizer2* nfc = NfcInstance();
  if (nfc == nullptr) return InternalError("ICU's NFC normalizer is not available");
  std::string out;
  out.reserve(text.size());
  icu::StringByteSink<std::string> sink(&out);
  icu::Edits edits;
  UErrorCode err = U_ZERO_ERROR;
  nfc->normalizeUTF8(0, icu::StringPiece(text.data(), text.size()), sink, &edits, err);
  for (icu::Edits::Iterator it = edits.getFineChangesIterator(); U_SUCCESS(err) && it.next(err);) {
    const auto from = static_cast<size_t>(it.sourceIndex());
    const auto to = static_cast<size_t>(it.destinationIndex());
    changes->push_back({{from, from + static_cast<size_t>(it.oldLength())},
                        {to, to + static_cast<size_t>(it.newLength())}});
  }
  if (U_FAILURE(err)) {
    return InvalidArgumentError(fmt::format("NFC normalization failed: {}", u_errorName(err)));
  }
  return out;
}

bool NfcBoundaryBefore(char32_t c) {
  const icu::Normalizer2* nfc = NfcInstance();
  return nfc != nullptr && nfc->hasBoundaryBefore(static_cast<UChar32>(c));
}

}  // namespace strata::data::hf
