// Text pieces for the Hugging Face tokenizer.json reader (hf_tokenizer.h): UTF-8 helpers, GPT-2's
// byte-to-character table, PCRE2 regular expressions, the split behaviours of HF tokenizers'
// `Split` pre-tokenizer, and NFC through ICU. Internal to data/.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace strata::data::hf {

// Half-open byte range [begin, end) of a string.
struct Span {
  size_t begin = 0, end = 0;
};

// Byte offset of the first invalid UTF-8 sequence in `text`, or npos when it is valid.
size_t FindInvalidUtf8(std::string_view text);
// The code point starting at `text[i]` (valid UTF-8) and its length in bytes.
char32_t DecodeUtf8(std::string_view text, size_t i, size_t* len);
// The start of the character that ends at `text[i - 1]` (i > 0, valid UTF-8).
size_t PrevCharStart(std::string_view text, size_t i);
void AppendUtf8(char32_t c, std::string* out);
// Unicode White_Space (Rust's char::is_whitespace); a word character (alphabetic, decimal digit,
// mark, connector punctuation: regex \w).
bool IsWhitespace(char32_t c);
bool IsWordChar(char32_t c);
// \p{L}.
bool IsLetter(char32_t c);

// GPT-2's bytes_to_unicode (Radford et al. 2019, openai/gpt-2 encoder.py): each byte as a
// printable character, UTF-8 encoded. ByteToChar()[b] is b's character.
const std::array<std::string, 256>& ByteToChar();
// The byte of a character of that table, or -1.
int CharToByte(char32_t c);

// A compiled PCRE2 pattern (PCRE2_UTF | PCRE2_UCP, JIT-compiled when the library has a JIT).
// Immutable; Find may run concurrently from several threads (each call has its match data).
class Regex {
 public:
  // Errors: kInvalidArgument with PCRE2's message and offset.
  static StatusOr<std::unique_ptr<Regex>> Create(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The non-overlapping matches of one text (valid UTF-8), left to right; an empty match is
  // reported and the search resumes one character further. Owns PCRE2 match data: one per
  // thread. `re` and `text` must outlive it.
  class Matches {
   public:
    Matches(const Regex& re, std::string_view text);
    ~Matches();
    Matches(const Matches&) = delete;
    Matches& operator=(const Matches&) = delete;
    // The next match, or false when there is none.
    bool Next(Span* match);

   private:
    const Regex& re_;
    std::string_view text_;
    size_t start_ = 0;
    void* match_data_;  // pcre2_match_data_8*
  };

  // All of Matches(text), appended to `matches`.
  void FindAll(std::string_view text, std::vector<Span>* matches) const;
  const std::string& pattern() const { return pattern_; }

 private:
  explicit Regex(std::string pattern) : pattern_(std::move(pattern)) {}
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// HF tokenizers' SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Cuts [0, size) into pieces given the delimiter matches (sorted, non-overlapping): each match
// and each gap becomes a part (`invert` swaps which parts are the delimiters), parts are joined
// or dropped by `behavior` as HF's NormalizedString::split does, and empty pieces are dropped.
void SplitByMatches(size_t size, const std::vector<Span>& matches, SplitBehavior behavior,
                    bool invert, std::vector<Span>* pieces);

// The non-overlapping occurrences of `needle` (non-empty) in `text`.
void FindLiteral(std::string_view text, std::string_view needle, std::vector<Span>* matches);

// Unicode NFC (ICU's unorm2). Errors: kInvalidArgument with ICU's error name.
StatusOr<std::string> Nfc(std::string_view text);
// A region NFC changed: the bytes `from` of its input became the bytes `to` of its output.
struct NfcChange {
  Span from, to;
};
// As Nfc, and appends the regions it changed, in order (ICU's fine-grained Edits: a region runs
// between normalization boundaries; bytes outside every region are copied unchanged).
StatusOr<std::string> Nfc(std::string_view text, std::vector<NfcChange>* changes);
// Whether NFC never combines the text before the character `c` with `c` and what follows.
bool NfcBoundaryBefore(char32_t c);
// Whether `text` is in NFC (a quick check that may answer false for some NFC text).
bool IsNfc(std::string_view text);

}  // namespace strata::data::hf
